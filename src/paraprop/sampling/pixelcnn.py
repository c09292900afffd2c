"""Samplers of :class:`paraprop.models.PixelCNN` (Song et al. 2021, §5.3.2, Table 1).

The state is all channels of one pixel, in raster order; the noise (Gumbel variables for the
mixture component, a logistic variable for the value) is fixed up front, so every sampler returns
the same discrete image for the same noise.

- ``sequential``: a full forward pass per pixel (through :func:`paraprop.solve`);
- ``sequential_cached``: fast generation (Ramachandran et al. 2017): per-layer caches, each new
  pixel computes only the one column of every layer that depends on it;
- ``jacobi``: full forward passes of the whole image (through :func:`paraprop.solve`);
- ``jacobi_gs``: blocks of rows in parallel (stacked along the batch), pixels inside a block one
  by one with the cache; the rows above a block come from the previous iterate;
- ``gs_jacobi``: windows of rows one after another, Jacobi inside the window with forward passes
  of the window only (the frozen rows above enter through the cached context).
"""

from __future__ import annotations

import math
import time

import torch
from torch.nn import functional as F

from paraprop.errors import ConvergenceError
from paraprop.solve import Solution

DEFAULT_BLOCK_ROWS = 4  # Jacobi-GS: rows per block (7 blocks on 28 rows)
DEFAULT_WINDOW_ROWS = 4  # GS-Jacobi: rows per window (fastest in the bench's sweep)


class PixelSystem:
    """The uncached triangular system ``x = g(x, noise)``: state ``(B, H, W, C)``,
    ``dim=(1, 2)``."""

    def __init__(self, model, noise: torch.Tensor):
        self.m, self.noise = model, noise
        B, H, W, C, _ = noise.shape
        self.x0 = noise.new_zeros(B, H, W, C)
        self.dim = (1, 2)

    def to_data(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 3, 1, 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        params = self.m(x.permute(0, 3, 1, 2))  # (B, C, 3M, H, W)
        return self.m.draw(params, self.noise).permute(0, 2, 3, 1)


def _solution(method, x, iterations, evaluations, residuals, start, *, converged=True,
              throw=False, tol=0.0, max_iters=None, **stats) -> Solution:
    sol = Solution(value=x, method=method, iterations=iterations, evaluations=evaluations,
                   converged=converged, residuals=torch.tensor(residuals, dtype=torch.float64),
                   stats={"time_s": time.perf_counter() - start, **stats})
    if throw and not converged:
        last = residuals[-1] if residuals else float("nan")
        raise ConvergenceError(
            f"method={method!r} did not converge within max_iters={max_iters} iterations (last "
            f"forward difference {last:.3g} > tol={tol}); pass throw=False to inspect the "
            "unconverged Solution", solution=sol)
    return sol


def check_stopping(tol, max_iters) -> None:
    """Validate ``tol`` (a number >= 0) and ``max_iters`` (a positive int or ``None``)."""
    if isinstance(tol, bool) or not isinstance(tol, int | float) or not tol >= 0:
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    if max_iters is not None and (
            isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 1):
        raise ValueError(f"max_iters must be a positive int or None, got {max_iters!r}")


class _Cache:
    """Per-layer caches for generating a strip of rows pixel by pixel.

    For every layer ``i``: ``v_in`` (the ``k//2`` rows of the vertical input above the current
    row), ``v_pre`` (the vertical pre-activation of the row above the current row), and
    ``h`` (this layer's horizontal input for the current row, left-padded by ``k//2 + 1``).
    """

    def __init__(self, model, ctx: dict, batch: int, width: int, like: torch.Tensor):
        self.m = model
        self.p = model.k // 2
        self.v_in = list(ctx["v_in"])
        self.v_pre = list(ctx["v_pre_last"])
        chans = [model.C] + [layer.h_out.out_channels for layer in model.layers]
        self.h = [like.new_zeros(batch, c, width + self.p + 1) for c in chans]
        # per-pixel weights as matrices: (out, in * (p + 1)), (out, in)
        self.w = []
        for layer in model.layers:
            hc = layer.h_conv
            self.w.append((hc.weight.flatten(1), hc.bias, layer.link.weight.flatten(1),
                           layer.link.bias, layer.h_out.weight.flatten(1), layer.h_out.bias))
        self.w_out = (model.out.weight.flatten(1), model.out.bias)

    def pixel(self, c: int) -> torch.Tensor:
        """Mixture parameters at column ``c`` of the current row: ``(B, C * 3M)``."""
        P = self.p + 1
        stream = None
        for i, layer in enumerate(self.m.layers):
            wh, bh, wl, bl, wo, bo = self.w[i]
            # layer 0 reads columns c-p-1..c-1 (mask A); later layers c-p..c
            lo = c if layer.first else c + 1
            window = self.h[i][:, :, lo : lo + P].flatten(1)
            pre = F.linear(window, wh, bh) + F.linear(self.v_pre[i][:, :, 0, c], wl, bl)
            a, b = pre.chunk(2, dim=1)
            h = F.linear(torch.tanh(a) * torch.sigmoid(b), wo, bo)
            stream = h if layer.first else stream + h
            self.h[i + 1][:, :, c + P] = stream
        return F.linear(torch.relu(stream), *self.w_out)

    def set_input(self, c: int, value: torch.Tensor) -> None:
        self.h[0][:, :, c + self.p + 1] = value

    def finish_row(self, row: torch.Tensor) -> None:
        """The row (B, C, 1, W) is final: advance the vertical caches by one row."""
        v_in = row
        for i, layer in enumerate(self.m.layers):
            pre, v = layer.vertical(v_in, self.v_in[i])
            self.v_in[i] = torch.cat([self.v_in[i], v_in], dim=2)[:, :, -self.p :]
            self.v_pre[i] = pre
            v_in = v
        for buf in self.h:
            buf.zero_()


def cached_strip(model, noise: torch.Tensor, ctx: dict) -> tuple[torch.Tensor, int]:
    """Generate a strip of rows pixel by pixel with the cache.

    Arguments:
        model: the PixelCNN.
        noise: ``(B, R, W, C, M + 1)`` for the strip's pixels.
        ctx: the context of the rows above the strip (:meth:`PixelCNN.context` or
            :meth:`PixelCNN.empty_context`).

    Returns:
        ``(x, steps)``: the strip ``(B, C, R, W)`` and the number of pixel steps.
    """
    B, R, W, C, _ = noise.shape
    cache = _Cache(model, ctx, B, W, noise)
    x = noise.new_zeros(B, C, R, W)
    for r in range(R):
        for c in range(W):
            params = cache.pixel(c).reshape(B, C, 3 * model.M)
            val = model.draw(params, noise[:, r, c])  # (B, C)
            x[:, :, r, c] = val
            cache.set_input(c, val)
        if r + 1 < R:
            cache.finish_row(x[:, :, r : r + 1])
    return x, R * W


def sequential_cached(model, noise: torch.Tensor) -> Solution:
    """Fast generation: every pixel in order, each computing one column of every layer."""
    start = time.perf_counter()
    B = noise.shape[0]
    x, steps = cached_strip(model, noise, model.empty_context(B, like=noise))
    return _solution("sequential_cached", x.permute(0, 2, 3, 1), steps, steps, [], start,
                     T=steps, positions=steps, sequential_steps=steps)


def _check_rows(name: str, rows, H: int) -> None:
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= H:
        raise ValueError(f"{name} must be an int in [1, {H}] (rows of the image), got {rows!r}")


def jacobi_gs(model, noise: torch.Tensor, block_rows: int, *, tol: float = 0.0,
              max_iters: int | None = None, throw: bool = True) -> Solution:
    """Blocks of ``block_rows`` rows in parallel (stacked along the batch), each generated pixel
    by pixel with the cache from the previous iterate's rows above it; repeated until an
    iteration changes no pixel by more than ``tol`` (any ``tol`` below the grid step
    ``2 / (levels - 1)`` means "no pixel changed": the exact image), at most
    ``ceil(H / block_rows)`` iterations (the first ``k`` blocks are final after iteration
    ``k``) or ``max_iters``. Not converged (``ConvergenceError`` with ``throw``) when
    ``max_iters`` ends it first."""
    start = time.perf_counter()
    B, H, W, C, M1 = noise.shape
    _check_rows("block_size", block_rows, H)
    check_stopping(tol, max_iters)
    nb = math.ceil(H / block_rows)
    pad = nb * block_rows - H
    noise_p = F.pad(noise, (0, 0, 0, 0, 0, 0, 0, pad)) if pad else noise
    # (B, nb, R, ...) -> (nb * B, R, ...): block b of sample s is batch row b * B + s
    strips = noise_p.reshape(B, nb, block_rows, W, C, M1).transpose(0, 1).reshape(
        nb * B, block_rows, W, C, M1)
    x = noise.new_zeros(B, C, H, W)
    residuals, steps, it = [], 0, 0
    bound = nb if max_iters is None else min(nb, max_iters)
    while it < bound:
        it += 1
        ctxs = [model.empty_context(B, like=noise)]
        running = ctxs[0]
        for b in range(1, nb):
            running = model.context(x[:, :, (b - 1) * block_rows : b * block_rows], running)
            ctxs.append(running)
        ctx = {key: [torch.cat([c[key][i] for c in ctxs], dim=0)
                     for i in range(len(model.layers))] for key in ctxs[0]}
        out, n = cached_strip(model, strips, ctx)
        steps += n
        new = out.reshape(nb, B, C, block_rows, W).permute(1, 2, 0, 3, 4).reshape(
            B, C, nb * block_rows, W)[:, :, :H]
        changed = float((new - x).abs().max())
        residuals.append(changed)
        x = new
        if changed <= tol:
            break
    converged = it >= nb or residuals[-1] <= tol
    return _solution("jacobi_gs", x.permute(0, 2, 3, 1), it, steps, residuals, start,
                     converged=converged, throw=throw, tol=tol, max_iters=max_iters,
                     T=H * W, positions=steps * nb, sequential_steps=steps, bound=nb,
                     block_size=block_rows)


def gs_jacobi(model, noise: torch.Tensor, window_rows: int, *, tol: float = 0.0,
              max_iters: int | None = None, throw: bool = True) -> Solution:
    """Windows of ``window_rows`` rows in order; inside a window, Jacobi sweeps (one forward
    pass of the window's rows each, the frozen rows above entering through the cached context)
    until a sweep changes no pixel by more than ``tol`` (below the grid step: no pixel changed),
    or the window has had as many sweeps as pixels (its exactness bound), or ``max_iters``
    sweeps (a cap *per window*). Not converged (``ConvergenceError`` with ``throw``) when the
    cap ends some window first; ``iterations`` counts the sweeps of all windows."""
    start = time.perf_counter()
    B, H, W, C, _ = noise.shape
    _check_rows("block_size", window_rows, H)
    check_stopping(tol, max_iters)
    x = noise.new_zeros(B, C, H, W)
    ctx = model.empty_context(B, like=noise)
    residuals, sweeps, converged, window_sweeps = [], 0, True, []
    for r0 in range(0, H, window_rows):
        r1 = min(H, r0 + window_rows)
        win_noise = noise[:, r0:r1]
        win = x[:, :, r0:r1]
        bound = (r1 - r0) * W
        cap = bound if max_iters is None else min(bound, max_iters)
        k, changed = 0, math.inf
        while k < cap and changed > tol:
            new = model.draw(model.rows(win, ctx), win_noise)
            k += 1
            changed = float((new - win).abs().max())
            residuals.append(changed)
            win = new
        sweeps += k
        window_sweeps.append(k)
        converged = converged and (k >= bound or changed <= tol)
        x[:, :, r0:r1] = win
        ctx = model.context(win, ctx)
    return _solution("gs_jacobi", x.permute(0, 2, 3, 1), sweeps, sweeps, residuals, start,
                     converged=converged, throw=throw, tol=tol, max_iters=max_iters,
                     T=H * W, positions=sweeps * window_rows * W, sequential_steps=sweeps,
                     bound=H * W, block_size=window_rows, window_sweeps=window_sweeps)
