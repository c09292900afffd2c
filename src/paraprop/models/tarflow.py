"""TarFlow (Zhai et al. 2024, "Normalizing Flows are Capable Generative Models"): a stack of
transformer autoregressive flows on image patches, sampled by solving triangular systems.

An image ``(C, S, S)`` is cut into ``T`` patches of ``P = p * p * C`` values in raster order.
Each of the ``K`` flow blocks is a causal transformer that gives the affine parameters
``(mu_t, alpha_t)`` of patch ``t`` from the patches before it (the outputs are shifted by one
position, so patch 0 gets ``mu = alpha = 0``), and maps ``z_t = (x_t - mu_t) exp(-alpha_t)``
(``log |det| = -sum alpha``). Odd blocks read the patches in reverse order. The output
projections start at zero, so every block starts as the identity.

The density is one parallel pass; sampling inverts the blocks last to first, and the inverse of
one block is the triangular system ``x_t = z_t exp(alpha_t(x_<t)) + mu_t(x_<t)`` along the
patches. Every triangular method of :func:`paraprop.solve` solves it (Jacobi as in
Liu & Qin 2025, "Accelerate TarFlow Sampling with GS-Jacobi Iteration"); ``"sequential_cached"``
is the usual loop, one patch per transformer call with keys and values cached.

The sampling map of a block (:class:`~paraprop.flows.tarflow_inverse.BlockInverse`, beside the
other flow inverses in :mod:`paraprop.flows`) runs the transformer one chunk of about ``CHUNK``
positions after the other from cached keys and values, with the same operations on tensors of
the same shapes for a chunk whether the call is a full pass or a window; so a window is bitwise
the full pass's values, and ``tol=0`` gives the same bits with every method. The inversion of
the stack, block by block, and the per-block plan of ``method="auto"`` are in
:mod:`paraprop.flows.tarflow_sampling`; this module is the model and its documented API.
"""

from __future__ import annotations

import math
import time
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from paraprop import checks
from paraprop.checks import check_max_iters, check_tol
from paraprop.determinism import require_deterministic
from paraprop.flows import tarflow_sampling
from paraprop.flows.tarflow_inverse import BlockInverse, default_chunk
from paraprop.models.checkpoint import Checkpointed
from paraprop.result import Solution

__all__ = ["TarFlow", "patchify", "unpatchify"]


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """Images ``(B, C, S, S)`` as patches ``(B, T, P)``: raster order, ``P = p * p * C`` values
    per patch ordered (row, column, channel)."""
    B, C, S, _ = x.shape
    n = S // p
    return x.reshape(B, C, n, p, n, p).permute(0, 2, 4, 3, 5, 1).reshape(B, n * n, p * p * C)


def unpatchify(t: torch.Tensor, p: int, channels: int) -> torch.Tensor:
    """The inverse of :func:`patchify`: patches ``(B, T, P)`` as images ``(B, C, S, S)``."""
    B, T, _ = t.shape
    n = math.isqrt(T)
    return t.reshape(B, n, n, p, p, channels).permute(0, 5, 1, 3, 2, 4).reshape(
        B, channels, n * p, n * p)


class _Layer(nn.Module):
    """One pre-norm transformer layer: causal self-attention, then a GELU MLP (width x 4)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, N, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(B, N, d))
        return h + self.mlp(h)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln2(h))))


class _Block(nn.Module):
    """One flow block: a causal transformer over patches ``0 .. T-2`` whose output at ``s`` is
    ``(mu, alpha)`` of patch ``s + 1``."""

    def __init__(self, T: int, P: int, layers: int, width: int, heads: int, g: torch.Generator):
        super().__init__()
        self.T, self.P, self.heads = T, P, heads
        self.inp = nn.Linear(P, width)
        self.pos = nn.Parameter(torch.randn(T - 1, width, generator=g) * 0.02)
        self.layers = nn.ModuleList(_Layer(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 2 * P)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def params(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, alpha)``, each ``(B, T, P)``, of the patches ``x`` ``(B, T, P)``."""
        h = self.inp(x[:, :-1]) + self.pos
        for layer in self.layers:
            h = layer(h)
        raw = F.pad(self.out(self.norm(h)), (0, 0, 1, 0))  # patch 0: mu = alpha = 0
        return raw[..., : self.P], raw[..., self.P :]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, alpha = self.params(x)
        return (x - mu) * torch.exp(-alpha), -alpha.sum(dim=(1, 2))


class TarFlow(Checkpointed, nn.Module):
    """A transformer autoregressive flow on image patches (Zhai et al. 2024).

    Arguments:
        image_size: side ``S`` of the square images (values in ``[-1, 1]``).
        channels: image channels ``C``.
        patch_size: side ``p`` of a patch; must divide ``S`` into at least 2 patches per image.
            ``T = (S / p)^2`` patches of ``P = p * p * C`` values.
        blocks: flow blocks ``K``; odd blocks read the patches in reverse order.
        layers: transformer layers per block.
        width: transformer width (a multiple of ``heads``).
        heads: attention heads.
        noise_std: standard deviation of the Gaussian noise added to the training data (the
            model's density is that of the noisy data, as in Zhai et al.).
        seed: seed of the weight initialisation.

    Raises:
        ValueError: an argument that is not a positive int (``noise_std``: a finite number
            ``>= 0``; ``seed``: an int ``>= 0``), a ``patch_size`` that does not divide
            ``image_size`` into at least 2 patches, a ``width`` not divisible by ``heads``.

    Example:
        >>> flow = TarFlow(8, patch_size=2, blocks=2, layers=1, width=32, heads=2)
        >>> flow.log_prob(torch.rand(3, 1, 8, 8) * 2 - 1).shape
        torch.Size([3])
        >>> images, sol = flow.sample(3, method="jacobi", tol=0)
    """

    load_in_eval = True  # checkpoints come back ready to sample

    def __init__(self, image_size: int, channels: int = 1, patch_size: int = 2, blocks: int = 4,
                 layers: int = 2, width: int = 128, heads: int = 4, noise_std: float = 0.05,
                 seed: int = 0):
        super().__init__()
        for name, value in (("image_size", image_size), ("channels", channels),
                            ("patch_size", patch_size), ("blocks", blocks), ("layers", layers),
                            ("width", width), ("heads", heads)):
            checks.positive_int(name, value)
        checks.nonneg_number("noise_std", noise_std, finite=True)
        checks.nonneg_int("seed", seed)
        if image_size % patch_size or patch_size == image_size:
            raise ValueError(f"patch_size must divide image_size={image_size} into at least 2 "
                             f"patches per side, got patch_size={patch_size}")
        if width % heads:
            raise ValueError(f"width must be a multiple of heads={heads}, got width={width}")
        self.config = {"image_size": image_size, "channels": channels, "patch_size": patch_size,
                       "blocks": blocks, "layers": layers, "width": width, "heads": heads,
                       "noise_std": float(noise_std), "seed": seed}
        self.image_size, self.channels, self.patch_size = image_size, channels, patch_size
        self.noise_std = float(noise_std)
        self.T = (image_size // patch_size) ** 2
        self.P = patch_size * patch_size * channels
        g = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):  # nn.Linear draws from the global generator
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList(_Block(self.T, self.P, layers, width, heads, g)
                                        for _ in range(blocks))
        self._plans: dict = {}  # the plan of method="auto" (see calibrate)

    @property
    def _weight(self) -> torch.Tensor:
        """A parameter of the model (the first block's output projection): its dtype and
        device are the model's."""
        return cast(_Block, self.blocks[0]).out.weight

    # -- density ------------------------------------------------------------------------------
    def _check_images(self, x, name: str = "x") -> None:
        shape = (self.channels, self.image_size, self.image_size)
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or tuple(x.shape[1:]) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must have shape (N, {', '.join(map(str, shape))}), "
                             f"got {got}")
        ref = self._weight
        if x.dtype != ref.dtype:
            raise TypeError(f"{name} must have the model's dtype {ref.dtype}, got {x.dtype}")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, logdet)``: the latent ``z`` shaped like ``x`` ``(N, C, S, S)`` and
        ``log |det dz/dx|`` per image ``(N,)``.

        Raises:
            ValueError / TypeError: ``x`` of the wrong shape or dtype.
        """
        self._check_images(x)
        h = patchify(x, self.patch_size)
        logdet = h.new_zeros(h.shape[0])
        for k, block in enumerate(self.blocks):
            h, ld = block(h.flip(1) if k % 2 else h)
            h = h.flip(1) if k % 2 else h
            logdet = logdet + ld
        return unpatchify(h, self.patch_size, self.channels), logdet

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """``log p(x)`` per image ``(N,)`` in nats: standard normal prior on ``z``."""
        z, logdet = self(x)
        D = z[0].numel()
        return -0.5 * z.pow(2).flatten(1).sum(1) - 0.5 * D * math.log(2 * math.pi) + logdet

    # -- sampling -----------------------------------------------------------------------------
    def sampling_map(self, z: torch.Tensor, block: int, chunk: int | None = None
                     ) -> BlockInverse:
        """The triangular system of the inverse of block ``block`` at its output ``z``
        ``(N, T, P)`` (patches in the block's own order), for :func:`paraprop.solve` with
        ``dim=-2``."""
        return BlockInverse(self.blocks[block], z, chunk)

    def sample(self, n: int, *, method="jacobi", tol: float = 1e-5,
               generator: torch.Generator | None = None, noise: torch.Tensor | None = None,
               max_iters: int | None = None, throw: bool = True, temperature: float = 1.0,
               chunk: int | None = None) -> tuple[torch.Tensor, Solution]:
        """Draw ``n`` images: ``z = temperature * noise`` with standard normal ``noise``, then
        the blocks inverted last to first (:meth:`inverse`, which documents ``method``, ``tol``,
        ``max_iters``, ``throw``, ``chunk`` and what ``converged`` promises).

        Arguments:
            n: number of images.
            generator: random generator of the noise (drawn on its device, CPU without one, in
                the model's dtype, then moved to the model's device).
            noise: the standard normal noise ``(n, C, S, S)`` instead of drawing it.
            temperature: scale of the noise, a finite number ``> 0``.

        Returns:
            ``(images, solution)``: images ``(n, C, S, S)`` and one :class:`paraprop.Solution`.

        Raises:
            ValueError / TypeError: a bad ``n``, ``temperature`` or ``noise``, and everything
                :meth:`inverse` raises.
            paraprop.StochasticModelError: the flow is in train mode with a stochastic layer
                (dropout, ...): call ``flow.eval()``.
        """
        checks.positive_int("n", n)
        checks.positive_number("temperature", temperature, finite=True)
        require_deterministic(self, argument="flow", entry="TarFlow.sample")
        ref = self._weight
        if noise is None:
            where = generator.device if generator is not None else torch.device("cpu")
            shape = (n, self.channels, self.image_size, self.image_size)
            noise = torch.randn(shape, generator=generator, dtype=ref.dtype,
                                device=where).to(ref.device)
        else:
            self._check_images(noise, "noise")
            if noise.shape[0] != n:
                raise ValueError(f"noise must hold n={n} images, got {noise.shape[0]}")
        return self.inverse(noise * temperature if temperature != 1 else noise, method=method,
                            tol=tol, max_iters=max_iters, throw=throw, chunk=chunk)

    def inverse(self, z: torch.Tensor, *, method="jacobi", tol: float = 1e-5,
                max_iters: int | None = None, throw: bool = True, chunk: int | None = None
                ) -> tuple[torch.Tensor, Solution]:
        """The images ``x`` with ``forward(x)[0] == z``: the blocks inverted last to first, each
        by solving its triangular system (:class:`BlockInverse`) with :func:`paraprop.solve`.

        Arguments:
            z: latents ``(N, C, S, S)`` in the model's dtype.
            method: how each block is inverted:

                * ``"sequential_cached"``: the usual loop, one patch per transformer call with
                  the keys and values cached
                  (:func:`~paraprop.flows.tarflow_inverse.sequential_cached`; ``T - 1`` calls a
                  block; exact up to rounding, ``tol`` unused);
                * a triangular method of :func:`paraprop.solve`, meaning what it means there:
                  ``"sequential"`` (``T`` full passes a block, the reference), ``"jacobi"``
                  (the default, as for :func:`paraprop.solve` and
                  :func:`paraprop.sampling.sample`), ``"jacobi_gs"``, ``"gs_jacobi"``,
                  ``"sliding_jacobi"`` or ``"anderson"``, or a solver object such as
                  ``SlidingJacobi(16)`` or ``GSJacobi(7)`` (the Newton family is refused: a
                  block is not a Markov system);
                * a list with one of the above per block, **in block order** (``method[k]``
                  inverts ``self.blocks[k]``, the ``k``-th block of :meth:`forward`);
                * ``"auto"``: the plan of :meth:`calibrate` with ``cost="time"`` for this
                  ``tol``, ``chunk`` and batch size (made on first use, timed on this
                  machine, and kept until the weights change).
            tol: passed to :func:`paraprop.solve` for each block.
            max_iters: cap on the iterations of each block's solve (``None``: its exactness
                bound). Not accepted with ``"sequential_cached"`` (with ``"auto"`` it caps the
                blocks the plan solves iteratively).
            throw: raise :class:`paraprop.ConvergenceError` (with the combined Solution) if a
                block's solve stopped at ``max_iters`` unconverged; ``False`` returns it.
            chunk: positions per chunk of the sampling maps (:class:`BlockInverse`; ``None``:
                :func:`default_chunk`). Every method of a call solves the same maps, hence the
                same bits at ``tol=0``; another ``chunk`` rounds differently. ``chunk=T`` makes
                a full pass one chunk (the cheapest full pass, for Jacobi) and a window a full
                pass; a small chunk makes windows cheap (``GSJacobi(block_size=chunk)``).

        Returns:
            ``(images, solution)``: one :class:`paraprop.Solution` for the whole inverse, with
            ``iterations`` and ``evaluations`` summed over the blocks (an evaluation is one
            transformer pass, full or windowed), ``converged`` when every block converged, and
            ``stats``: ``"blocks"`` (each block's Solution, block order), ``"methods"`` (the
            method of each block), ``"model_calls"`` (transformer passes, = ``evaluations``),
            ``"positions"`` (patches computed), ``"chunks"`` (chunks of the sampling maps
            computed, the work of the solve methods), ``"error_estimates"`` (each block's
            stopping estimate) and ``"time_s"``.

            What ``converged=True`` promises: each block's solve stopped with its estimated
            error ``<= tol`` (largest absolute error of a patch value, per image) against the
            exact inverse **of the input that block was given**, or at its exactness bound
            (see :func:`paraprop.solve`). It does not bound the error of the images: the
            inversions run from the last block to the first, and an error left by an early
            inversion is the input error of the later ones, which can grow it (the inverse
            of a block multiplies by ``exp(alpha)`` and feeds every later patch; on the trained
            MNIST model, 8 blocks at ``tol=1e-4`` left 4.5e-4 in the images, at ``tol=1e-5``
            3e-5). The per-block figure is the stopping rule's estimate, not a proof: on a
            strongly expanding block (``exp(alpha)`` up to ~100) Jacobi's contraction estimate
            was seen to stop a sample at 3x its ``tol`` (a case of the test suite). ``tol=0``
            gives the exact fixed point of every block, bitwise ``method="sequential"``
            whatever the solve method, in every dtype (float64, float32, bf16, fp16), or
            ``converged=False``; at ``tol > 0`` a ``tol`` below the dtype's rounding at the
            values' scale cannot be certified, and the solve says so (``converged=False``).
            ``"sequential_cached"`` rounds differently (one-patch products): asked for by name
            it is its own reference; in an ``"auto"`` plan a block it inverts carries the
            deviation measured at calibration, at most ``CACHED_SHARE * tol``
            (:meth:`calibrate`).

        Raises:
            ValueError / TypeError: bad ``z``, ``method`` (a name, solver object or list of
                the wrong length), ``tol``, ``max_iters`` or ``throw``.
            paraprop.StochasticModelError: the flow is in train mode with a stochastic layer
                (dropout, ...): call ``flow.eval()``.
            paraprop.ConvergenceError: a block did not converge within ``max_iters`` and
                ``throw=True``.

        Example:
            >>> flow = TarFlow(8, patch_size=2, blocks=2, layers=1, width=32, heads=2)
            >>> z = torch.randn(4, 1, 8, 8)
            >>> x, sol = flow.inverse(z, method="jacobi", tol=0)
            >>> torch.equal(x, flow.inverse(z, method="sequential")[0])
            True
        """
        self._check_images(z, "z")
        check_tol(tol)
        check_max_iters(max_iters)
        checks.boolean("throw", throw)
        chunk = default_chunk(self.T) if chunk is None else checks.positive_int("chunk", chunk)
        require_deterministic(self, argument="flow", entry="TarFlow.inverse")
        plan, measured = self._plan(method, tol, chunk, z.shape[0])
        # (an "auto" plan may hand a block to the cached loop: max_iters caps the others)
        if max_iters is not None and "sequential_cached" in plan and method != "auto":
            raise ValueError("max_iters is not used by method='sequential_cached' (always T - 1 "
                             f"transformer calls a block), got max_iters={max_iters!r}")
        start = time.perf_counter()
        h, sols = tarflow_sampling.invert(self.blocks, patchify(z, self.patch_size), plan,
                                          measured, tol=tol, max_iters=max_iters, chunk=chunk)
        images = unpatchify(h, self.patch_size, self.channels)
        return images, tarflow_sampling.solution(images, sols, plan, method, start, throw=throw,
                                                 tol=tol, max_iters=max_iters)

    def _plan(self, method, tol: float, chunk: int, batch: int) -> tuple[list, list]:
        """One method per block (block order): ``"sequential_cached"`` or a solver object; and
        per block the cached loop's deviation measured at calibration (``None``: not an
        ``"auto"`` plan's cached block)."""
        K = len(self.blocks)
        none = [None] * K
        if isinstance(method, list | tuple):
            if len(method) != K:
                raise ValueError(f"method must be one method per block ({K}), got a list of "
                                 f"{len(method)}")
            return [tarflow_sampling.block_method(m, f"method[{k}]")
                    for k, m in enumerate(method)], none
        if isinstance(method, str):
            checks.one_of("method", method, tarflow_sampling.TARFLOW_METHODS)
        if method == "auto":
            version = self._weights_version()
            samples = min(batch, 64)
            key = (float(tol), chunk, samples, self._weight.dtype, version)
            if key not in self._plans:   # plans of older weights go; other settings stay
                self._plans = {k: v for k, v in self._plans.items() if k[-1] == version}
                self._plans[key] = self._calibrate(tol, samples, 0, chunk, "time")
            plan, deviation = self._plans[key]
            return plan, [d if m == "sequential_cached" else None
                          for m, d in zip(plan, deviation, strict=True)]
        return [tarflow_sampling.block_method(method, "method")] * K, none

    def _weights_version(self) -> int:
        """Changes whenever a parameter is modified in place (an optimizer step, a load)."""
        return sum(p._version for p in self.parameters())

    def calibrate(self, *, tol: float = 1e-5, samples: int = 4, seed: int = 0,
                  chunk: int | None = None, cost: str = "count") -> list:
        """The plan of ``method="auto"``: one solver per block.

        A short calibration ranks the blocks by how fast their inversions converge (after Liu &
        Qin 2025, who rank TarFlow blocks by convergence and spend Gauss-Seidel effort only on
        the slow ones): ``samples`` latents (seeded by ``seed``) are inverted at ``tol`` once
        with ``"jacobi"`` and once with ``GSJacobi(block_size=chunk)``, and each block keeps
        the method with the smaller count of chunks of its sampling map computed
        (:class:`BlockInverse`, ``stats["chunks"]``) plus sweeps (each has a fixed cost, about
        that of a chunk on a CPU); Jacobi wins ties. A Jacobi sweep computes all
        ``ceil(T / chunk)`` chunks and converges in few sweeps on an easy block; a GS-Jacobi
        sweep computes one chunk from cached keys and values, and pays off on a block that
        needs many sweeps. (With ``chunk=T`` the two are the same.) The KV-cached loop is the
        third candidate when ``tol > 0``, at ``2 (T - 1)``: ``T - 1`` calls that compute one
        position each; it takes a block that neither iteration inverts in fewer than about
        ``T`` chunks (on a trained model, the block inverted first: Liu & Qin's slow block). It
        is exact up to rounding, not bitwise, so ``tol=0`` leaves it out; and since its rounding
        is not the solve's (a one-patch product is another kernel), it is a candidate for a
        block only where its deviation from the exact inverse of that block, measured on the
        calibration latents (the exact inverse by ``GSJacobi(chunk)`` at ``tol=0``), is at most
        :data:`~paraprop.flows.tarflow_sampling.CACHED_SHARE` ``* tol``. That measurement is
        what a cached block of an ``"auto"`` plan reports as its ``error_estimate``: an estimate
        from other latents, not a proof; in bf16 and fp16 the loop's rounding is far above any
        useful ``tol`` (``docs/sampling.md``), so it is left out there.

        With ``cost="time"`` (what ``method="auto"`` uses, with as many calibration latents as
        the batch it inverts, up to 64) the candidates are compared by their measured wall time
        per block instead (the better of two runs each): a full pass costs a different multiple
        of a one-position call on each machine and at each batch size, which no count captures.
        The plan then depends on the machine and its load; every plan gives the sequential
        result within ``tol``, only its speed varies.

        Arguments:
            tol: the ``tol`` of the calibration and of the plan.
            samples: latents of the calibration run.
            seed: their seed.
            chunk: as in :meth:`inverse`.
            cost: ``"count"`` (chunks computed plus sweeps; deterministic) or ``"time"``.

        Returns:
            One method per block, block order: a solver object or ``"sequential_cached"``.

        Raises:
            ValueError: a bad ``tol``, ``samples``, ``seed`` or ``chunk``.
            paraprop.StochasticModelError: the flow is in train mode with a stochastic layer.
        """
        check_tol(tol)
        checks.positive_int("samples", samples)
        checks.nonneg_int("seed", seed)
        checks.one_of("cost", cost, ("count", "time"))
        chunk = default_chunk(self.T) if chunk is None else checks.positive_int("chunk", chunk)
        require_deterministic(self, argument="flow", entry="TarFlow.calibrate")
        return self._calibrate(tol, samples, seed, chunk, cost)[0]

    def _calibrate(self, tol: float, samples: int, seed: int, chunk: int, cost: str
                   ) -> tuple[list, list[float]]:
        """:meth:`calibrate`'s plan, and per block the cached loop's measured deviation from
        the exact inverse (``inf`` where it was not measured: ``tol=0``)."""
        ref = self._weight
        g = torch.Generator().manual_seed(seed)
        shape = (samples, self.channels, self.image_size, self.image_size)
        z = torch.randn(shape, generator=g, dtype=ref.dtype).to(ref.device)
        return tarflow_sampling.calibrate(self.blocks, patchify(z, self.patch_size), tol=tol,
                                          chunk=chunk, cost=cost)
