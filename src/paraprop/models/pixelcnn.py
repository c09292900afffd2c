"""A gated PixelCNN (van den Oord et al. 2016) with a discretized logistic mixture likelihood
(Salimans et al. 2017, PixelCNN++), small enough to train on a CPU.

Two stacks remove the blind spot of masked convolutions: the *vertical* stack at row ``r`` sees
image rows ``<= r`` (a ``(k//2 + 1) x k`` convolution padded above), and enters the *horizontal*
stack only shifted down by one row, so that the horizontal stack at ``(r, c)`` sees every row
above and, through ``(1 x (k//2 + 1))`` convolutions padded on the left, the pixels ``(r, < c)``
(the first layer reads the image shifted right by one: mask A). Channels of one pixel are
generated together (one state = all channels of a pixel, each channel its own mixture).

Besides ``forward`` the module offers the pieces the samplers of :mod:`paraprop.sampling.pixelcnn`
need to run it incrementally: one vertical layer on a strip of rows given the rows above, and
one horizontal layer at one column given a window of the previous layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from paraprop import checks
from paraprop.models.checkpoint import Checkpointed


class _GatedLayer(nn.Module):
    """One layer of both stacks (gated activations ``tanh(a) * sigmoid(b)``)."""

    def __init__(self, c_in: int, hidden: int, k: int, first: bool):
        super().__init__()
        self.k, self.first = k, first
        self.v_conv = nn.Conv2d(c_in, 2 * hidden, (k // 2 + 1, k))
        self.h_conv = nn.Conv2d(c_in, 2 * hidden, (1, k // 2 + 1))
        self.link = nn.Conv2d(2 * hidden, 2 * hidden, 1)
        self.h_out = nn.Conv2d(hidden, hidden, 1)

    @staticmethod
    def gate(a: torch.Tensor) -> torch.Tensor:
        x, y = a.chunk(2, dim=1)
        return torch.tanh(x) * torch.sigmoid(y)

    def vertical(self, v_in: torch.Tensor, above: torch.Tensor | None) -> tuple:
        """Vertical pre-activation for a strip of rows: ``v_in`` (B, C, R, W); ``above`` holds the
        ``k//2`` rows of this layer's input just above the strip (zeros at the top)."""
        p = self.k // 2
        if above is None:
            above = v_in.new_zeros(v_in.shape[0], v_in.shape[1], p, v_in.shape[3])
        pre = self.v_conv(F.pad(torch.cat([above, v_in], dim=2), (p, p, 0, 0)))
        return pre, self.gate(pre)

    def horizontal(self, h_in: torch.Tensor, v_pre_above: torch.Tensor) -> torch.Tensor:
        """Horizontal layer on rows: ``h_in`` (B, C, R, W'), already padded/shifted on the left
        (``W' = W + k//2``); ``v_pre_above`` the vertical pre-activation of the row above each
        row (B, 2H, R, W)."""
        pre = self.h_conv(h_in) + self.link(v_pre_above)
        return self.h_out(self.gate(pre))


class PixelCNN(Checkpointed, nn.Module):
    """Gated PixelCNN with a discretized logistic mixture per channel.

    Arguments:
        in_channels: image channels (1 for MNIST).
        image_size: side of the square images (28 for MNIST, 8 for the digits).
        hidden: channels of each stack.
        layers: gated layers (the receptive field grows by ``k//2`` rows and columns per layer).
        mixtures: logistic components per channel.
        kernel: odd kernel width ``k``.
        levels: discrete pixel values (256 for 8-bit images, 17 for the digits); data in
            ``[-1, 1]``.
        seed: initialisation seed.

    Raises:
        ValueError: a size that is not a positive int, ``levels`` below 2, an even kernel or
            one below 3, a negative or non-int seed.

    Example:
        >>> model = PixelCNN(image_size=6, hidden=8, layers=2, mixtures=2, levels=17).eval()
        >>> noise = model.draw_noise(2, torch.Generator().manual_seed(0))
        >>> x, sol = paraprop.sampling.sample(model, 2, noise=noise, method="jacobi", tol=0)
        >>> ref, _ = paraprop.sampling.sample(model, 2, noise=noise, method="sequential")
        >>> x.shape, torch.equal(x, ref), model.log_prob(x).shape
        (torch.Size([2, 1, 6, 6]), True, torch.Size([2]))
    """

    def __init__(self, in_channels: int = 1, image_size: int = 28, hidden: int = 32,
                 layers: int = 5, mixtures: int = 5, kernel: int = 3, levels: int = 256,
                 seed: int = 0):
        super().__init__()
        for name, v in [("in_channels", in_channels), ("image_size", image_size),
                        ("hidden", hidden), ("layers", layers), ("mixtures", mixtures),
                        ("levels", levels)]:
            checks.positive_int(name, v)
        if levels < 2:
            raise ValueError(f"levels must be >= 2 (the discrete pixel values), got {levels}")
        if not checks.is_int(kernel) or kernel < 3 or kernel % 2 == 0:
            raise ValueError(f"kernel must be odd and >= 3, got {kernel!r}")
        checks.nonneg_int("seed", seed)
        self.config = {"in_channels": in_channels, "image_size": image_size, "hidden": hidden,
                       "layers": layers, "mixtures": mixtures, "kernel": kernel,
                       "levels": levels, "seed": seed}
        self.C, self.size, self.M, self.k, self.levels = (in_channels, image_size, mixtures,
                                                          kernel, levels)
        # seeded initialisation without touching the caller's global RNG state
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(
                _GatedLayer(in_channels if i == 0 else hidden, hidden, kernel, i == 0)
                for i in range(layers))
            self.out = nn.Conv2d(hidden, in_channels * 3 * mixtures, 1)

    def _gated(self) -> Sequence[_GatedLayer]:
        """The gated layers (``nn.ModuleList`` types its items as plain modules)."""
        return cast("Sequence[_GatedLayer]", self.layers)

    # -- full forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mixture parameters for every pixel: ``(B, C, 3M, H, W)`` from images ``(B, C, H, W)``
        in ``[-1, 1]``; position ``(r, c)`` depends only on pixels before it in raster order."""
        self._check(x)
        return self.rows(x, None)

    def rows(self, x: torch.Tensor, ctx: dict | None) -> torch.Tensor:
        """The network on a strip of rows ``x`` (B, C, R, W), given the context of the rows
        above (``ctx`` from :meth:`context`, ``None`` at the top of the image)."""
        p = self.k // 2
        v_in, h_in = x, x
        B, _, R, W = x.shape
        if ctx is None:
            ctx = self.empty_context(B, W, like=x)
        for i, layer in enumerate(self._gated()):
            v_pre, v = layer.vertical(v_in, ctx["v_in"][i])
            top = ctx["v_pre_last"][i]
            v_above = torch.cat([top, v_pre[:, :, :-1]], dim=2)  # the row above each row
            if layer.first:  # mask A: shift right by one, then pad on the left
                h_src = F.pad(h_in, (p + 1, 0))[..., :W + p]
            else:
                h_src = F.pad(h_in, (p, 0))
            h = layer.horizontal(h_src, v_above)
            h_in = h if layer.first else h_in + h
            v_in = v
        out = self.out(torch.relu(h_in))
        return out.reshape(B, self.C, 3 * self.M, R, W)

    def context(self, x_rows: torch.Tensor, ctx: dict | None = None) -> dict:
        """The context below the (final) rows ``x_rows`` (B, C, R, W), themselves below ``ctx``
        (``None``: ``x_rows`` start at the top of the image): for every layer the ``k//2`` rows of
        its vertical input and the vertical pre-activation of the last row. This is the
        per-layer cache of fast generation (Ramachandran et al. 2017) for the vertical stack."""
        p = self.k // 2
        B, _, R, W = x_rows.shape
        v_in_rows, v_pre_last = [], []
        v_in = x_rows
        for i, layer in enumerate(self._gated()):
            above = None if ctx is None else ctx["v_in"][i]
            if above is None:
                above = v_in.new_zeros(B, v_in.shape[1], p, W)
            v_in_rows.append(torch.cat([above, v_in], dim=2)[:, :, -p:])
            v_pre, v = layer.vertical(v_in, above)
            v_pre_last.append(v_pre[:, :, -1:])
            v_in = v
        return {"v_in": v_in_rows, "v_pre_last": v_pre_last}

    def empty_context(self, batch: int, width: int | None = None, like=None) -> dict:
        """The context above row 0 (zeros)."""
        w = self.size if width is None else width
        ref = self.out.weight if like is None else like
        p = self.k // 2
        chans = [self.C] + [layer.h_out.out_channels for layer in self._gated()[:-1]]
        return {"v_in": [ref.new_zeros(batch, c, p, w) for c in chans],
                "v_pre_last": [ref.new_zeros(batch, layer.link.in_channels, 1, w)
                               for layer in self._gated()]}

    # -- likelihood ---------------------------------------------------------------------------
    def split(self, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logit_pi, mean, log_scale)``, each ``(..., M, ...)`` from ``(..., 3M, ...)``."""
        lp, mu, ls = params.chunk(3, dim=2)
        return lp, torch.tanh(mu) * 1.2, ls.clamp(min=-7.0)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """Discretized logistic mixture log-likelihood per image (nats), ``x`` on the grid of
        ``levels`` values in ``[-1, 1]``."""
        logit_pi, mu, log_s = self.split(self(x))
        lp = discretized_logistic_log_prob(x.unsqueeze(2), mu, log_s, self.levels)
        lp = torch.logsumexp(lp + torch.log_softmax(logit_pi, dim=2), dim=2)
        return lp.flatten(1).sum(1)

    # -- sampling as a triangular system ------------------------------------------------------
    def noise_shape(self, n: int) -> tuple[int, ...]:
        """Per pixel and channel: ``M`` Gumbel variables (component choice) and one standard
        logistic variable; layout ``(n, H, W, C, M + 1)``."""
        return (n, self.size, self.size, self.C, self.M + 1)

    def draw_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """The noise of ``n`` images, drawn on the generator's device (CPU without one) in the
        model's dtype and moved to the model's device: the same seed gives the same image on
        every device."""
        w = self.out.weight
        where = generator.device if generator is not None else torch.device("cpu")
        u = torch.rand(self.noise_shape(n), generator=generator, dtype=w.dtype,
                       device=where).to(w.device)
        eps = torch.finfo(w.dtype).eps
        u = u.clamp(eps, 1 - eps)
        gumbel = -torch.log(-torch.log(u[..., : self.M]))
        return torch.cat([gumbel, torch.logit(u[..., self.M :])], dim=-1)

    def draw(self, params: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Pixel values from mixture parameters ``(B, C, 3M, *pos)`` and noise ``(B, *pos, C,
        M + 1)`` (``pos`` any trailing layout): component by Gumbel-max, then the logistic
        inverse CDF, clamped and rounded to the grid. Returns ``(B, C, *pos)``."""
        logit_pi, mu, log_s = self.split(params)
        nz = noise.movedim(-2, 1).movedim(-1, 2)  # (B, C, M + 1, *pos)
        choice = (logit_pi + nz[:, :, : self.M]).argmax(dim=2, keepdim=True)
        m = mu.gather(2, choice).squeeze(2)
        s = log_s.gather(2, choice).squeeze(2)
        x = (m + torch.exp(s) * nz[:, :, self.M]).clamp(-1.0, 1.0)
        q = self.levels - 1
        return torch.round((x + 1) * (q / 2)) * (2 / q) - 1

    def sampling_map(self, noise: torch.Tensor):
        """The uncached triangular system (a full forward pass per call), state ``(B, H, W, C)``
        with ``dim=(1, 2)``; see :mod:`paraprop.sampling.pixelcnn` for the cached samplers."""
        from paraprop.sampling.pixelcnn import PixelSystem

        return PixelSystem(self, noise)

    def samplers(self) -> dict:
        """The model-specific methods of :func:`paraprop.sampling.sample`: each is called as
        ``f(noise, block_size=..., tol=..., max_iters=..., throw=...)`` (``block_size``: rows
        per block or window) and returns the Solution of :func:`paraprop.solve` on the cached
        map (:class:`paraprop.sampling.pixelcnn.CachedPixels`). ``sequential_cached`` is exact
        in one pass and refuses ``block_size`` and ``max_iters`` (``tol`` does not apply, as for
        ``"sequential"``); ``jacobi_gs`` and ``gs_jacobi`` take ``tol``, ``max_iters`` (for
        ``gs_jacobi`` the sweeps of all windows together) and ``throw`` as ``paraprop.solve``
        does."""
        from paraprop.sampling import pixelcnn as ps

        def cached(noise, *, block_size, tol, max_iters, throw):
            for name, value in (("block_size", block_size), ("max_iters", max_iters)):
                if value is not None:
                    raise ValueError(f"{name} is not used by method='sequential_cached', "
                                     f"got {name}={value!r}")
            return ps.sequential_cached(self, noise)

        def jacobi_gs(noise, *, block_size, tol, max_iters, throw):
            rows = ps.DEFAULT_BLOCK_ROWS if block_size is None else block_size
            return ps.jacobi_gs(self, noise, rows, tol=tol, max_iters=max_iters, throw=throw)

        def gs_jacobi(noise, *, block_size, tol, max_iters, throw):
            rows = ps.DEFAULT_WINDOW_ROWS if block_size is None else block_size
            return ps.gs_jacobi(self, noise, rows, tol=tol, max_iters=max_iters, throw=throw)

        return {"sequential_cached": cached, "jacobi_gs": jacobi_gs, "gs_jacobi": gs_jacobi}

    def _check(self, x):
        want = (self.C, self.size, self.size)
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or tuple(x.shape[1:]) != want:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (B, {want[0]}, {want[1]}, {want[2]}), got {got}")



def discretized_logistic_log_prob(x: torch.Tensor, mu: torch.Tensor, log_s: torch.Tensor,
                                  levels: int) -> torch.Tensor:
    """``log P(x)`` of a logistic ``(mu, exp(log_s))`` discretized to ``levels`` bins on
    ``[-1, 1]``, computed in log space as in PixelCNN++ (Salimans et al. 2017, eq. 2 and their
    ``discretized_mix_logistic_loss``): the edge bins use ``log sigmoid(a) = a - softplus(a)``
    and ``log(1 - sigmoid(b)) = -softplus(b)``; an inner bin whose probability is below
    ``1e-5`` (the difference of two sigmoids would underflow and lose its gradient) uses the
    density at the bin centre times the bin width."""
    half = 1.0 / (levels - 1)
    inv_s = torch.exp(-log_s)
    centred = x - mu
    plus_in = (centred + half) * inv_s
    min_in = (centred - half) * inv_s
    log_cdf_plus = plus_in - F.softplus(plus_in)  # left edge: log P(X <= -1 + half)
    log_one_minus_cdf_min = -F.softplus(min_in)  # right edge: log P(X > 1 - half)
    delta = torch.sigmoid(plus_in) - torch.sigmoid(min_in)
    mid_in = centred * inv_s
    log_pdf_mid = mid_in - log_s - 2.0 * F.softplus(mid_in)
    inner = torch.where(delta > 1e-5, torch.log(delta.clamp(min=1e-12)),
                        log_pdf_mid + math.log(2 * half))
    return torch.where(x < -1 + 1e-3, log_cdf_plus,
                       torch.where(x > 1 - 1e-3, log_one_minus_cdf_min, inner))


def bits_per_dim(model: PixelCNN, x: torch.Tensor) -> float:
    """Negative log-likelihood in bits per sub-pixel."""
    return float(-model.log_prob(x).mean() / (x[0].numel() * math.log(2)))
