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
import threading
from dataclasses import dataclass, field

import torch

from paraprop.errors import NonFiniteError, NotTriangularError
from paraprop.solvers.stopping import ContractionRule


class System:
    """A triangular system ``x = fn(x)`` in the canonical ``(B, T, F)`` layout.

    Counts the calls of ``fn`` (``evaluations``) and the positions computed (``positions``, the
    hardware-independent work).
    """

    def __init__(self, fn, shape: torch.Size, dtype: torch.dtype, dims: tuple[int, int]):
        self.fn = fn
        self._lock = threading.Lock()  # the counters, when a solver evaluates on threads
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
        self.windowed = callable(getattr(fn, "window", None))
        self.cache = None  # fn.window's cache of the frozen prefix, kept between calls
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
        self._count(self.T)
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
        self._count(index.numel())
        return y.reshape(self.B, index.numel(), self.F)

    def window(self, xc: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Positions ``[start, stop)`` (flat) of ``fn(x)``, shape ``(B, stop - start, F)``.

        The cached-prefix protocol: with ``fn.window(x, start, stop, cache)`` the driver promises
        that the positions ``< start`` of ``x`` are final, and passes back the cache ``fn``
        returned last time (``None`` at first); ``fn`` returns ``(values, cache)``. Without it,
        ``fn.update`` (or a full evaluation) computes the window.
        """
        n = stop - start
        if not self.windowed:
            return self.update(xc, torch.arange(start, stop, device=xc.device))
        out = self.fn.window(self.user(xc), start, stop, self.cache)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("fn.window(x, start, stop, cache) must return a tuple (values, "
                            f"cache), got {type(out).__name__}")
        y, self.cache = out
        expected = torch.Size((*self.batch_shape, n, *self.feature_shape))
        self._check_output(y, expected, "fn.window(x, start, stop, cache)")
        self._count(n)
        return y.reshape(self.B, n, self.F)

    def _count(self, positions: int) -> None:
        with self._lock:
            self.evaluations += 1
            self.positions += positions

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
        if bool(torch.isfinite(values.sum())):  # one reduction; inf/NaN anywhere poisons it
            return
        finite = torch.isfinite(values)
        if bool(finite.all()):  # the sum overflowed, the values are fine
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
    residual: float = math.inf  # convergence measure of the last iteration (max over samples)
    finished: bool = False
    extra: dict = field(default_factory=dict)
    rule: ContractionRule | None = None  # the per-sample contraction estimate
    estimate: torch.Tensor | None = None  # (B,) float64: error estimate where a sample stopped

    def __post_init__(self):
        B, device = self.active.shape[0], self.active.device
        if self.rule is None:
            self.rule = ContractionRule(B, device)
        if self.estimate is None:
            self.estimate = torch.zeros(B, dtype=torch.float64, device=device)


def accept(system: System, state: State, lo: int, hi: int, new: torch.Tensor, tol: float,
           norm: str, exact: int = 0, budget: float | None = None) -> None:
    """Write ``new`` into positions ``[lo, hi)`` of the active samples, with per-sample stopping.

    Arguments:
        system, state: the system and the solver state (``state.x`` is updated in place).
        lo, hi: the positions ``new`` holds (canonical layout ``(B, hi - lo, F)``).
        tol, norm: a sample stops when the contraction estimate of its error
            (:class:`~paraprop.solvers.stopping.ContractionRule`) and its forward difference are
            ``<= tol``, or when it did not move at all; its values are then frozen.
        exact: the first ``exact`` positions of ``[lo, hi)`` are final already. For an
            autoregressive ``fn`` they cannot move (Song et al. 2021, Prop. 1-2), so a change
            larger than ``tol`` there proves that ``fn`` is not triangular.
        budget: the bound the error estimate must meet (default ``tol``; windowed methods pass
            their share of it).
    """
    old = state.x[:, lo:hi]
    d = new - old
    per_pos = d.abs().amax(dim=2)  # (B, n): one pass over the difference serves both checks
    active = state.active
    if exact > 0:
        check_final(system, per_pos[:, :exact], tol, active, lo)
    if norm == "max":
        res = per_pos.amax(dim=1)
    else:
        res = torch.linalg.vector_norm(d.reshape(d.shape[0], -1), dim=1)
    if bool(active.all()):
        old.copy_(new)
    else:
        res = torch.where(active, res, torch.zeros_like(res))
        old.copy_(torch.where(active[:, None, None], new, old))
    stop, est = state.rule.update(res, tol, active, budget)
    state.sample_iterations += active.long()
    if bool(stop.any()):
        state.estimate = torch.where(stop, est, state.estimate)
    state.active = active & ~stop
    state.residual = float(res.max())


def check_final(system: System, moved_by: torch.Tensor, tol: float, active: torch.Tensor,
                lo: int = 0) -> None:
    """Raise :class:`NotTriangularError` if a final position moved: ``moved_by`` ``(B, n)`` is
    the change of the final positions ``[lo, lo + n)``; by the triangular structure (Song et al.
    2021, Prop. 1-2) none may move by more than ``tol``."""
    moved = (moved_by > tol) & active[:, None]
    if bool(moved.any()):
        b, t = (int(i) for i in moved.nonzero()[0])
        raise NotTriangularError(
            f"fn is not autoregressive along dim: position {system.unravel_position(lo + t)} of "
            f"sample {system.unravel_sample(b)} changed at iteration {system.iteration} although "
            "every position it may depend on was already final; some position depends on itself "
            "or on a later one")


def verify_fixed_point(system: System, state: State, lo: int, new: torch.Tensor,
                       tol: float) -> None:
    """At the exactness bound every position is final, so one more evaluation (``new``, the
    positions ``[lo, lo + n)``) must not move any of them by more than ``tol``; otherwise some
    position depends on itself or on a later one. Costs one evaluation, and only when the bound
    was reached with a forward difference still above ``tol``."""
    old = state.x[:, lo : lo + new.shape[1]]
    moved = ((new - old).abs().amax(dim=2) > tol) & state.active[:, None]
    if bool(moved.any()):
        b, t = (int(i) for i in moved.nonzero()[0])
        raise NotTriangularError(
            f"fn is not autoregressive along dim: position {system.unravel_position(lo + t)} "
            f"of sample {system.unravel_sample(b)} still changes after {system.iteration} "
            "iterations, the bound by which every position of a triangular system is final; "
            "some position depends on itself or on a later one"
        )


def _unravel(i: int, shape: torch.Size) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return tuple(reversed(out))
