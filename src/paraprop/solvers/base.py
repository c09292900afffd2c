"""The pieces every solver of a nonlinear triangular system shares.

A feedforward computation ``s_t = f_t(s_<t)`` over ``T`` positions is the triangular system
``x = fn(x)`` (Song et al. 2021, eq. 2). :class:`System` is that system seen in a canonical layout
``(B, T, F)``: ``B`` independent samples (the flattened leading dims), ``T`` positions (the
flattened autoregressive dims, row-major), ``F`` values per position (the flattened trailing dims).
Solvers work on the canonical layout; ``fn`` always sees the caller's shape.

:class:`State` is what one solver iteration reads and writes; :func:`accept` is the shared rule
that turns freshly computed values into the next iterate with per-sample stopping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from paraprop.errors import NonFiniteError, NotTriangularError


class System:
    """A triangular system ``x = fn(x)`` in the canonical ``(B, T, F)`` layout.

    Counts the calls of ``fn`` (``evaluations``) and the positions computed (``positions``, the
    hardware-independent work).
    """

    def __init__(self, fn, shape: torch.Size, dtype: torch.dtype, dims: tuple[int, int]):
        self.fn = fn
        self.shape = shape
        self.dtype = dtype
        start, end = dims  # inclusive range of autoregressive dims, already normalised
        self.batch_shape = shape[:start]
        self.pos_shape = shape[start : end + 1]
        self.feature_shape = shape[end + 1 :]
        self.B = math.prod(self.batch_shape)
        self.T = math.prod(self.pos_shape)
        self.F = math.prod(self.feature_shape)
        self.fast = callable(getattr(fn, "update", None))
        self.evaluations = 0
        self.positions = 0
        self.iteration = 0  # set by the driver, used in error messages

    # -- layout -------------------------------------------------------------------------------
    def canon(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.B, self.T, self.F)

    def user(self, xc: torch.Tensor) -> torch.Tensor:
        return xc.reshape(self.shape)

    def unravel_position(self, t: int) -> tuple[int, ...]:
        return _unravel(t, self.pos_shape)

    def unravel_sample(self, b: int) -> tuple[int, ...]:
        return _unravel(b, self.batch_shape)

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, xc: torch.Tensor) -> torch.Tensor:
        """All positions of ``fn(x)``, canonical layout."""
        y = self.fn(self.user(xc))
        self._check_output(y, self.shape, "fn(x)")
        self.evaluations += 1
        self.positions += self.T
        return self.canon(y)

    def update(self, xc: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Positions ``index`` (flat, 1-D) of ``fn(x)``, shape ``(B, len(index), F)``.

        Uses ``fn.update(x, index)`` when ``fn`` provides it, otherwise evaluates ``fn`` fully.
        """
        if not self.fast:
            return self.evaluate(xc).index_select(1, index)
        y = self.fn.update(self.user(xc), index)
        expected = (*self.batch_shape, index.numel(), *self.feature_shape)
        self._check_output(y, torch.Size(expected), "fn.update(x, index)")
        self.evaluations += 1
        self.positions += index.numel()
        return y.reshape(self.B, index.numel(), self.F)

    def _check_output(self, y, shape, what: str) -> None:
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"fn: {what} must return a torch.Tensor, got {type(y).__name__}")
        if y.shape != shape:
            raise ValueError(
                f"fn: {what} returned shape {tuple(y.shape)}, expected {tuple(shape)} "
                "(fn must map x to a tensor of the same shape)"
            )
        if y.dtype != self.dtype:
            raise TypeError(f"fn: {what} returned dtype {y.dtype}, expected {self.dtype}")

    def check_finite(self, values: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Raise :class:`NonFiniteError` naming the iteration, sample and position."""
        finite = torch.isfinite(values)
        if bool(finite.all()):
            return
        b, t, _ = (int(i) for i in (~finite).nonzero()[0])
        if index is not None:
            t = int(index[t])
        raise NonFiniteError(
            f"fn produced a non-finite value at iteration {self.iteration}, sample "
            f"{self.unravel_sample(b)}, position {self.unravel_position(t)} "
            "(NaN or inf; note that 0 * inf is NaN, so an overflow at a later position can "
            "poison earlier ones in masked networks)"
        )


@dataclass
class State:
    """The iterate and the per-sample bookkeeping of one solve."""

    x: torch.Tensor  # (B, T, F), owned by the solver
    active: torch.Tensor  # (B,) bool: samples still iterating
    sample_iterations: torch.Tensor  # (B,) long: sweeps each sample took part in
    residual: float = math.inf  # forward difference of the last iteration (max over samples)
    finished: bool = False
    extra: dict = field(default_factory=dict)


def sample_norm(d: torch.Tensor, norm: str) -> torch.Tensor:
    """Per-sample norm of a ``(B, n, F)`` difference: ``max`` or ``l2``."""
    flat = d.reshape(d.shape[0], -1)
    if flat.shape[1] == 0:
        return flat.new_zeros(flat.shape[0])
    if norm == "max":
        return flat.abs().amax(dim=1)
    return torch.linalg.vector_norm(flat, dim=1)


def check_prefix(system: System, new: torch.Tensor, old: torch.Tensor, start: int, stop: int,
                 tol: float, active: torch.Tensor) -> None:
    """Positions ``[start, stop)`` are exact already; raise if any of them still moves.

    ``new`` and ``old`` hold positions ``[start, ...)`` after and before this iteration. For an
    autoregressive ``fn`` these positions cannot change (Song et al. 2021, Prop. 1), so a change
    larger than ``tol`` proves that ``fn`` is not triangular.
    """
    if stop <= start:
        return
    n = stop - start
    moved = (new[:, :n] - old[:, :n]).abs().amax(dim=2) > tol  # (B, n)
    moved &= active[:, None]
    if bool(moved.any()):
        b, t = (int(i) for i in moved.nonzero()[0])
        raise NotTriangularError(
            f"fn is not autoregressive along dim: position {system.unravel_position(start + t)} "
            f"of sample {system.unravel_sample(b)} changed at iteration {system.iteration} "
            "although every position it may depend on was already final; some position "
            "depends on itself or on a later one"
        )


def accept(state: State, lo: int, hi: int, new: torch.Tensor, tol: float, norm: str
           ) -> torch.Tensor:
    """Write ``new`` into positions ``[lo, hi)`` of the active samples; per-sample stopping.

    Returns the per-sample forward difference (zero for samples that were already frozen).
    Samples whose difference is ``<= tol`` stop: their values are frozen from now on.
    """
    old = state.x[:, lo:hi]
    res = sample_norm(new - old, norm)
    active = state.active
    if bool(active.all()):
        state.x[:, lo:hi] = new
    else:
        res = torch.where(active, res, torch.zeros_like(res))
        state.x[:, lo:hi] = torch.where(active[:, None, None], new, old)
    state.sample_iterations += active.long()
    state.active = active & ~(res <= tol)
    state.residual = float(res.max()) if res.numel() else 0.0
    return res


def _unravel(i: int, shape: torch.Size) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return tuple(reversed(out))
