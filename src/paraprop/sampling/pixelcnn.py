"""Samplers of :class:`paraprop.models.PixelCNN` (Song et al. 2021, §5.3.2, Table 1).

The state is all channels of one pixel, in raster order; the noise (Gumbel variables for the
mixture component, a logistic variable for the value) is fixed up front, so every sampler returns
the same discrete image for the same noise. Every sampler runs through :func:`paraprop.solve`:

- ``sequential``: a full forward pass per pixel (:class:`PixelSystem`);
- ``sequential_cached``: fast generation (Ramachandran et al. 2017): ``Sequential()`` on
  :class:`CachedPixels`, whose per-layer caches let each new pixel compute only the one column of
  every layer that depends on it;
- ``jacobi``: full forward passes of the whole image (:class:`PixelSystem`);
- ``jacobi_gs``: ``JacobiGS`` with blocks of rows on :class:`CachedPixels`: the blocks are
  stacked along the batch and generated pixel by pixel with the cache, the rows above a block
  coming from the previous iterate;
- ``gs_jacobi``: ``GSJacobi`` with windows of rows on :class:`CachedPixels`: Jacobi inside the
  window with forward passes of the window only, the frozen rows above entering through the
  per-layer caches that the cached-prefix protocol (``window(x, start, stop, cache)``) carries.

The cached paths compute a pixel with other products than the full forward pass (one column of
each layer against the convolutions), so their parameters round differently; the pixel values
are rounded to the grid of ``levels`` values, which absorbs that in every case tested (float32,
bf16, fp16). A rounding difference that moved a value across a grid boundary would be caught by
the solvers' verification of a ``tol=0`` result against the full map (a
:class:`paraprop.ProtocolError` naming the hook that disagrees with the full pass), not returned
as exact; ``sequential_cached`` (``Sequential()`` on the cached map) is its own reference.

On a GPU, cuDNN runs float32 convolutions in TF32 unless told otherwise (torch's default,
``torch.backends.cudnn.conv.fp32_precision == "tf32"``): the full pass then rounds to about
``2**-11`` while the cached columns (matrix products, float32) do not, and on the first GPU run
(an H200, 256 levels) the two disagreed by one grid step within the first rows. ``jacobi_gs`` and
``gs_jacobi`` check their cached result against the full pass, so there they are refused up front
with the setting named (:func:`refuse_tf32_convolutions`); ``sequential_cached`` and the uncached
samplers are each consistent with themselves and run in the user's setting.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.nn import functional as F

from paraprop import checks
from paraprop.determinism import require_deterministic
from paraprop.result import Solution
from paraprop.solve import solve
from paraprop.solvers import GSJacobi, JacobiGS, Sequential

DEFAULT_BLOCK_ROWS = 4  # Jacobi-GS: rows per block (7 blocks on 28 rows)
DEFAULT_WINDOW_ROWS = 4  # GS-Jacobi: rows per window (fastest in the bench's sweep)


def cudnn_conv_tf32() -> bool:
    """Whether cuDNN may run float32 convolutions in TF32 now: the first of
    ``torch.backends.cudnn.conv.fp32_precision``, ``torch.backends.cudnn.fp32_precision`` and
    ``torch.backends.fp32_precision`` that is not ``"none"`` (torch's default: ``"tf32"``)."""
    import torch.backends.cudnn as cudnn

    # set on the modules at import: torch's stubs do not list them
    for value in (cudnn.conv.fp32_precision,  # type: ignore[attr-defined]
                  cudnn.fp32_precision,
                  torch.backends.fp32_precision):  # type: ignore[attr-defined]
        if value != "none":
            return value == "tf32"
    return False


def refuse_tf32_convolutions(model, device: torch.device, entry: str) -> None:
    """Refuse a sampler that checks the cached columns against the full pass where the full pass
    would run in TF32 (CUDA, float32, :func:`cudnn_conv_tf32`).

    Raises:
        ValueError: naming the setting and the ways out.
    """
    dtype = next(model.parameters()).dtype
    if (device.type == "cuda" and dtype == torch.float32 and torch.backends.cudnn.enabled
            and cudnn_conv_tf32()):
        raise ValueError(
            f"{entry} checks the cached columns (float32 matrix products) against the full "
            "forward pass, whose convolutions cuDNN runs in TF32 here (torch.backends.cudnn."
            "conv.fp32_precision resolves to 'tf32', torch's default on CUDA): the two round "
            "differently by more than a pixel's grid step, and the check would refuse the "
            "result. Set torch.backends.cudnn.allow_tf32 = False for float32 convolutions "
            "(setting torch.backends.cudnn.conv.fp32_precision = 'ieee' alone does it too, but "
            "torch then refuses reads of allow_tf32 and torch.backends.cudnn.flags, as a mix of "
            "its two APIs), or sample with method='sequential_cached' or 'jacobi', which are "
            "each consistent in TF32")


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
            stream = h if stream is None else stream + h  # the first layer starts it
            self.h[i + 1][:, :, c + P] = stream
        assert stream is not None  # a PixelCNN has at least one layer
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


class CachedPixels(PixelSystem):
    """The sampling map with the per-layer caches of fast generation, for :func:`paraprop.solve`.

    State ``(B, H, W, C)`` with ``dim=(1, 2)``: flat position ``t = r * W + c``. Besides the full
    forward pass (``__call__``) it computes parts of the image from caches:

    - ``update(x, index)`` at the offsets of a Jacobi-GS sweep over blocks of ``block_rows`` rows
      (``index = j, j + bs, j + 2 bs, ...`` below ``T`` with ``bs = block_rows * W``, called for
      ``j = 0, 1, ..., bs - 1`` in order, each result written back into ``x``; with one block,
      ``block_rows=None``, these are the single positions of ``Sequential()``): offset ``j`` of
      every block, as Algorithm 2's parallel blocks compute it: from the rows above the block as
      they were at offset ``0`` (the previous iterate) and the block's own new pixels ``< j``.
      Those pixels are the values returned for the earlier offsets, so the whole sweep is known
      at offset ``0``: it is generated there, the blocks stacked along the batch, pixel by pixel
      with the per-layer caches (:func:`cached_strip`), and each offset returns its part after
      checking that ``x`` holds the value returned for the offset before it. A sweep depends only
      on the rows above the last block: one that starts from the same rows as the previous sweep
      (e.g. the fixed-point check of ``JacobiGS`` at its bound) reuses its values. Any other call
      (another ``index``, an offset out of order, ``x`` not holding the returned values) is
      served by a full forward pass.
    - ``window(x, start, stop, cache)`` (the cached-prefix protocol): the rows covering
      ``[start, stop)`` in one forward pass of those rows, given the context of the final rows
      above them. ``cache`` holds the per-layer caches of the frozen rows ``< cache["row"]``
      (:meth:`PixelCNN.context`); the rows that became final since the last call are folded in.

    Counters: ``computed`` (positions the network computed) and ``reused`` (positions served
    again from the previous sweep).
    """

    def __init__(self, model, noise: torch.Tensor, block_rows: int | None = None):
        super().__init__(model, noise)
        B, H, W, C, M1 = noise.shape
        R = H if block_rows is None else block_rows
        self.B, self.W, self.C, self.T = B, W, C, H * W
        self.block_rows, self.nb, self.bs = R, math.ceil(H / R), R * W
        pad = self.nb * R - H
        noise_p = F.pad(noise, (0, 0, 0, 0, 0, 0, 0, pad)) if pad else noise
        # (B, nb, R, ...) -> (nb * B, R, ...): block b of sample s is batch row b * B + s
        self.strips = noise_p.reshape(B, self.nb, R, W, C, M1).transpose(0, 1).reshape(
            self.nb * B, R, W, C, M1)
        self.computed = 0
        self.reused = 0
        self._offsets: dict[int, tuple[torch.Tensor, int]] = {}  # id(index) -> (index, j)
        self._sweep: dict | None = None  # the sweep being served: its rows above, its values

    # -- update: the offsets of a Jacobi-GS sweep ---------------------------------------------
    def _offset(self, index: torch.Tensor) -> int | None:
        """``j`` if ``index`` is offset ``j`` of a sweep (``j, j + bs, ...`` below ``T``)."""
        hit = self._offsets.get(id(index))
        if hit is not None and hit[0] is index:
            return hit[1]
        if index.dim() != 1 or index.numel() == 0:
            return None
        j = int(index[0])
        if not 0 <= j < self.bs or index.numel() != len(range(j, self.T, self.bs)):
            return None
        if index.numel() > 1 and not torch.equal(
                index, torch.arange(j, self.T, self.bs, device=index.device)):
            return None
        self._offsets[id(index)] = (index, j)
        return j

    def update(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        j = self._offset(index)
        s = self._sweep
        if j == 0:
            s = self._start_sweep(x)
        elif j is None or s is None or s["next"] != j or not torch.equal(
                x.reshape(self.B, self.T, self.C)[:, j - 1 :: self.bs], s["values"][j - 1]):
            self._sweep = None  # not the next offset of the sweep: the full forward pass
            self.computed += self.T
            return self(x).reshape(self.B, self.T, self.C).index_select(1, index)
        s["next"] = j + 1
        return s["values"][j]

    def _start_sweep(self, x: torch.Tensor) -> dict:
        m, B, R, nb = self.m, self.B, self.block_rows, self.nb
        xd = x.permute(0, 3, 1, 2)  # (B, C, H, W)
        above = xd[:, :, : (nb - 1) * R]  # the rows that enter the blocks' contexts
        last = self._sweep
        if last is not None and torch.equal(above, last["above"]):
            last["next"] = 1
            self.reused += self.T
            return last
        ctxs = [m.empty_context(B, like=self.noise)]
        running = ctxs[0]
        for b in range(1, nb):
            running = m.context(xd[:, :, (b - 1) * R : b * R].contiguous(), running)
            ctxs.append(running)
        ctx = {key: [torch.cat([cx[key][i] for cx in ctxs], dim=0) for i in range(len(m.layers))]
               for key in ctxs[0]}
        out, _ = cached_strip(m, self.strips, ctx)  # (nb * B, C, R, W)
        self.computed += self.T
        # offset-major: values[j] is (B, blocks at offset j, C), the positions j, j + bs, ...
        by_offset = out.reshape(nb, B, self.C, self.bs).permute(3, 1, 0, 2).contiguous()
        values = [by_offset[j, :, : len(range(j, self.T, self.bs))] for j in range(self.bs)]
        self._sweep = {"above": above.clone(), "values": values, "next": 1}
        return self._sweep

    # -- window: the cached-prefix protocol ---------------------------------------------------
    def window(self, x: torch.Tensor, start: int, stop: int, cache: dict | None
               ) -> tuple[torch.Tensor, dict]:
        m, B, W = self.m, self.B, self.W
        r0, r1 = start // W, -(-stop // W)
        xd = x.permute(0, 3, 1, 2)  # (B, C, H, W)
        if cache is None or cache["row"] > r0:
            cache = {"row": 0, "ctx": m.empty_context(B, like=self.noise)}
        if cache["row"] < r0:  # fold the rows that became final into the per-layer caches
            ctx = m.context(xd[:, :, cache["row"] : r0].contiguous(), cache["ctx"])
            cache = {"row": r0, "ctx": ctx}
        vals = m.draw(m.rows(xd[:, :, r0:r1].contiguous(), cache["ctx"]), self.noise[:, r0:r1])
        self.computed += (r1 - r0) * W
        lo = r0 * W
        return vals.permute(0, 2, 3, 1).reshape(B, (r1 - r0) * W, self.C)[
            :, start - lo : stop - lo], cache


def _check_rows(name: str, rows, H: int) -> None:
    if not checks.is_int(rows) or not 1 <= rows <= H:
        raise ValueError(f"{name} must be an int in [1, {H}] (rows of the image), got {rows!r}")


def sequential_cached(model, noise: torch.Tensor) -> Solution:
    """Fast generation: every pixel in order, each computing one column of every layer
    (``Sequential()`` on :class:`CachedPixels`; the Solution's method is
    ``"sequential_cached"``)."""
    require_deterministic(model, entry="paraprop.sampling.pixelcnn.sequential_cached")
    fn = CachedPixels(model, noise)
    sol = solve(fn, fn.x0, method=Sequential(), dim=fn.dim)
    return dataclasses.replace(sol, method="sequential_cached")


def jacobi_gs(model, noise: torch.Tensor, block_rows: int, *, tol: float = 0.0,
              max_iters: int | None = None, throw: bool = True) -> Solution:
    """Blocks of ``block_rows`` rows in parallel (stacked along the batch), each generated pixel
    by pixel with the cache from the previous iterate's rows above it: ``JacobiGS`` with blocks
    of ``block_rows * W`` pixels on :class:`CachedPixels`. At most ``ceil(H / block_rows)``
    iterations (the first ``k`` blocks are final after iteration ``k``); stopping, ``max_iters``
    and ``throw`` are those of :func:`paraprop.solve` (any ``tol`` below the grid step
    ``2 / (levels - 1)`` means "no pixel changed": the exact image)."""
    require_deterministic(model, entry="paraprop.sampling.pixelcnn.jacobi_gs")
    refuse_tf32_convolutions(model, noise.device, "paraprop.sampling.pixelcnn.jacobi_gs")
    H, W = noise.shape[1:3]
    _check_rows("block_size", block_rows, H)
    fn = CachedPixels(model, noise, block_rows)
    return solve(fn, fn.x0, method=JacobiGS(block_size=block_rows * W), dim=fn.dim, tol=tol,
                 max_iters=max_iters, throw=throw)


def gs_jacobi(model, noise: torch.Tensor, window_rows: int, *, tol: float = 0.0,
              max_iters: int | None = None, throw: bool = True) -> Solution:
    """Windows of ``window_rows`` rows in order; inside a window, Jacobi sweeps (one forward
    pass of the window's rows each, the frozen rows above entering through the per-layer caches)
    until no pixel changes, or the window has had as many sweeps as pixels (its exactness
    bound): ``GSJacobi`` with blocks of ``window_rows * W`` pixels on :class:`CachedPixels`
    through the cached-prefix protocol. Stopping, ``max_iters`` (a cap on the sweeps of all
    windows together) and ``throw`` are those of :func:`paraprop.solve`."""
    require_deterministic(model, entry="paraprop.sampling.pixelcnn.gs_jacobi")
    refuse_tf32_convolutions(model, noise.device, "paraprop.sampling.pixelcnn.gs_jacobi")
    H, W = noise.shape[1:3]
    _check_rows("block_size", window_rows, H)
    fn = CachedPixels(model, noise)
    return solve(fn, fn.x0, method=GSJacobi(block_size=window_rows * W), dim=fn.dim, tol=tol,
                 max_iters=max_iters, throw=throw)
