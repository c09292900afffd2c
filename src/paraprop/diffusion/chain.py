"""A diffusion sampler with its noise drawn up front, as a triangular system over the steps.

Step ``s`` maps ``x_s`` to ``x_{s+1} = step_s(x_s, model(x_s, t_s), z_s)`` (``x_0`` is the
initial noise, ``x_N`` the sample). With every ``z_s`` fixed, the trajectory ``X = (x_1 .. x_N)``
is the unique solution of ``X = F(X)`` for the *Picard map* ``F`` below, and ``F`` is strictly
triangular: position ``s`` of ``F(X)`` reads only positions ``< s`` of ``X``. So every solver of
:func:`paraprop.solve` samples it, and all of them return the sequential trajectory.

The Picard map (ParaDiGMS, Shih et al. 2023): split each step as
``x_{s+1} = a_s x_s + g_s(x_s)`` with a scalar ``a_s``, evaluate every ``g_s`` at the current
iterate in one batched model call, then solve the linear recurrence ``X_{s+1} = a_s X_s + g_s``
exactly by a scan. One iteration is one model call over the window plus one scan; information
travels the whole window in one iteration instead of one step.
"""

from __future__ import annotations

import torch

from paraprop.diffusion.schedulers import StepTable
from paraprop.scan import linear_recurrence


class DiffusionChain:
    """The Picard map of one sampling run, in the layout ``(B, N, F)`` (``B`` samples, ``N``
    steps, ``F`` values per sample), with the cached-prefix protocol of
    :func:`paraprop.solve` (``window``) and single-step updates (``update``, the sequential
    reference, computed exactly as ``scheduler.step`` computes it).

    Arguments:
        model: ``model(x, t, **model_kwargs)`` -> the model output shaped like ``x`` (a tensor,
            or an object with ``.sample`` such as diffusers' ``UNet2DOutput``); ``t`` is a 1-D
            long tensor, one timestep per row of ``x``.
        table: the scheduler's step coefficients
            (:func:`~paraprop.diffusion.schedulers.step_table`).
        x_init: ``(B, *sample_shape)``, the initial noise ``x_0``.
        z: ``(N, B, *sample_shape)``, the noise of every step (zeros where none is added).
        model_kwargs: extra model arguments; tensors whose first dim is ``B`` are repeated for
            every step of a window, the rest are passed as they are.
        split: the linear part of the Picard split (see
            :meth:`~paraprop.diffusion.schedulers.StepTable.linear_part`).
        evaluate: how the batched model rows are computed: ``evaluate(fn, x, t)``, where
            ``fn(x_rows, t_rows, rows)`` evaluates the rows ``rows`` (a slice); the default calls
            ``fn(x, t)`` once (:mod:`paraprop.diffusion.distributed` shards it).
    """

    def __init__(self, model, table: StepTable, x_init: torch.Tensor, z: torch.Tensor,
                 model_kwargs: dict | None = None, split: str = "identity", evaluate=None):
        self.model = model
        self.table = table
        self.sample_shape = tuple(x_init.shape)
        self.B = x_init.shape[0]
        self.N = table.N
        self.F = x_init[0].numel()
        self.x_init = x_init.reshape(self.B, self.F)
        self.z = z.reshape(self.N, self.B, self.F)
        self.kwargs = dict(model_kwargs or {})
        self.device = x_init.device
        self.timesteps = table.timesteps.to(self.device)
        self.a = table.linear_part(split).to(self.device, x_init.dtype)
        self.identity_split = bool((self.a == 1).all())   # the scan is then a cumulative sum
        self._evaluate = evaluate
        self.model_calls = 0   # batched model calls
        self.model_rows = 0    # model evaluations (rows of x per call, in samples)
        self.track_gains = False
        self.growth = None     # (B, N): how much an error at each step grows by the end
        self.lam = None        # (B, N): largest observed |d (step_s(x) - x)| / |d x|
        self.gain = None       # (B, N): largest observed |d step_s(x)| / |d x| (NaN: none yet)
        self._seen = None      # (last inputs, last outputs) of every step, (B, N, F) each

    # -- the model -----------------------------------------------------------------------------
    def _kwargs(self, n: int) -> tuple[dict, set]:
        out, per_row = {}, set()
        for k, v in self.kwargs.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == self.B:
                out[k] = v.repeat(n, *([1] * (v.dim() - 1))) if n > 1 else v
                per_row.add(k)
            else:
                out[k] = v
        return out, per_row

    def call_model(self, x: torch.Tensor, t: torch.Tensor, n: int) -> torch.Tensor:
        """The model output for the rows ``x`` (``(n * B, *sample_shape[1:])``, step-major)."""
        kwargs, per_row = self._kwargs(n)

        def fn(xx, tt, rows=slice(None)):
            kw = {k: (v[rows] if k in per_row else v) for k, v in kwargs.items()}
            return _output(self.model(xx, tt, **kw), xx)

        out = fn(x, t) if self._evaluate is None else self._evaluate(fn, x, t)
        self.model_calls += 1
        self.model_rows += x.shape[0]
        return out

    def steps(self, xin: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``x_{s+1}`` for ``s`` in ``[start, stop)`` from the inputs ``xin`` ``(B, n, F)``
        (``x_s``), in one batched model call; returns ``(B, n, F)``."""
        n = stop - start
        rows = xin.transpose(0, 1).reshape(n * self.B, *self.sample_shape[1:])
        t = self.timesteps[start:stop].repeat_interleave(self.B)
        out = self.call_model(rows, t, n)
        index = torch.arange(start, stop)
        shape = (n, self.B, self.F)
        prev = self.table.apply(index, rows.reshape(shape), out.reshape(shape),
                                self.z[start:stop]).transpose(0, 1)
        if self.track_gains:
            self._observe(xin, prev, start, stop)
        return prev

    def _observe(self, xin: torch.Tensor, nxt: torch.Tensor, start: int, stop: int) -> None:
        """Record each step's gain ``max|step(x) - step(x')| / max|x - x'|`` (per sample, the
        largest seen) between this evaluation and the step's previous one. Input changes at the
        rounding level are skipped: their ratios measure rounding, not the map."""
        if self._seen is None:
            nan = torch.full((self.B, self.N, self.F), float("nan"), dtype=xin.dtype,
                             device=xin.device)
            self._seen = (nan, nan.clone())
            self.gain = torch.full((self.B, self.N), float("nan"), dtype=torch.float64,
                                   device=xin.device)
            self.lam = self.gain.clone()
        last_in, last_out = self._seen
        dx = xin - last_in[:, start:stop]
        dy = nxt - last_out[:, start:stop]
        din = dx.abs().amax(2).to(torch.float64)
        level = 1024 * torch.finfo(xin.dtype).eps * (xin.abs().amax(2).to(torch.float64) + 1)
        ok = din > level
        for store, dnum in ((self.gain, dy), (self.lam, dy - dx)):
            ratio = torch.where(ok, dnum.abs().amax(2).to(torch.float64) / din, torch.nan)
            old = store[:, start:stop]
            store[:, start:stop] = torch.where(ratio.isnan(), old, torch.fmax(old, ratio))
        last_in[:, start:stop] = xin
        last_out[:, start:stop] = nxt

    def inputs(self, X: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``x_s`` for ``s`` in ``[start, stop)``: ``x_0`` then the positions of ``X``."""
        if start == 0:
            return torch.cat([self.x_init[:, None], X[:, : stop - 1]], dim=1)
        return X[:, start - 1 : stop - 1]

    @property
    def sensitivity(self):
        """``(B, N)``: how much a change at position ``i`` moves the later positions of the
        Picard map, ``|d (step_{i+1}(x) - x)| / |d x|`` as observed (the split's increment,
        small for a diffusion step), for :class:`~paraprop.solvers.SlidingJacobi`'s freeze
        estimate; ``None`` until steps have been observed twice, NaN where unknown."""
        if self.lam is None or not self.track_gains:
            return None
        lam = fill_unobserved(self.lam, none=float("nan"))
        return torch.cat([lam[:, 1:], torch.zeros_like(lam[:, :1])], dim=1)

    # -- the triangular system -----------------------------------------------------------------
    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        return self.window(X, 0, self.N, None)[0]

    def window(self, X: torch.Tensor, start: int, stop: int, cache=None):
        """Positions ``[start, stop)`` of the Picard map, given final positions ``< start``."""
        xin = self.inputs(X, start, stop)
        nxt = self.steps(xin, start, stop)
        a = self.a[start:stop]
        g = nxt - a[None, :, None] * xin
        h0 = xin[:, 0]
        if self.identity_split:
            vals = torch.cat([h0[:, None], g], dim=1).cumsum(dim=1)[:, 1:]
        else:
            A = a[None, :, None].expand(1, stop - start, self.F)
            vals = linear_recurrence(A, g, h0)
        return vals, None

    def update(self, X: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Positions ``index`` computed step by step from ``X`` (the sequential reference)."""
        outs = []
        for s in index.tolist():
            xin = self.inputs(X, s, s + 1)
            outs.append(self.steps(xin, s, s + 1))
        return torch.cat(outs, dim=1)


def fill_unobserved(v: torch.Tensor, *, none: float) -> torch.Tensor:
    """``v`` ``(B, N)`` with each NaN (a step never observed) replaced by the largest value
    observed for that sample, or by ``none`` where the sample has no observation at all."""
    largest = torch.where(v.isnan(), -torch.inf, v).amax(1, keepdim=True)
    largest = torch.where(largest == -torch.inf, none, largest)
    return torch.where(v.isnan(), largest, v)


def _output(out, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        if hasattr(out, "sample"):
            out = out.sample
        elif isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            out = out[0]
        else:
            raise TypeError("model must return a tensor (or an object with .sample, such as "
                            f"diffusers' UNet2DOutput), got {type(out).__name__}")
    if out.shape != x.shape:
        raise ValueError(f"model output has shape {tuple(out.shape)}, expected {tuple(x.shape)} "
                         "(the shape of its input x; a learned variance, with twice the channels,"
                         " is not supported)")
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out


def draw_noise(table: StepTable, shape: tuple[int, ...], *, generator=None, dtype=torch.float32,
               device=None) -> torch.Tensor:
    """All the noise of one run, drawn in the order of the diffusers loop: the initial sample
    ``x_0``, then the noise of each step that adds some (``randn`` of ``shape`` each, as
    ``diffusers.utils.torch_utils.randn_tensor`` draws it with one generator). Returns
    ``(N + 1, *shape)``: row ``0`` is ``x_0``, row ``1 + s`` the noise of step ``s`` (zeros where
    the step adds none)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    gen_device = generator.device if generator is not None else device

    def randn():
        return torch.randn(shape, generator=generator, device=gen_device, dtype=dtype).to(device)

    rows = [randn()]
    zero = torch.zeros(shape, dtype=dtype, device=device)
    for noisy in table.noisy.tolist():
        rows.append(randn() if noisy else zero)
    return torch.stack(rows)
