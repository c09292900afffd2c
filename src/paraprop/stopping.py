"""Stopping rules that bound the error, not the last step.

A rule that stops when the last step is small (``||x_k - x_{k-1}|| <= tol``) is wrong for maps
that accumulate small steps: on ``h_t = h_{t-1} + tanh(W h_{t-1} + b) / T`` every Jacobi sweep
moves the iterate by about ``1 / T``, so that rule stops after one sweep with an error of almost
the whole answer. paraprop's rules estimate the distance to the exact (sequential) solution:

* **Contraction estimate** (Jacobi family; quasi-Newton and the damped methods on their steps).
  With ``d_k = ||x_k - x_{k-1}||`` and the observed rate ``q``, the largest of the last
  :data:`RATES` ratios ``d_j / d_{j-1}``, an iteration that contracts by ``q < 1`` is within
  ``q / (1 - q) * d_k`` of its fixed point. Three ratios, not one or two: Jacobi on a triangular
  map that expands differences (a flow inverse with large scales) shows transient growth, a
  step that drops 40x in one sweep and grows 7x in the next, while the error barely moves
  (``tests/test_tarflow.py``, ``test_expanding_block_stops_within_tol``); the estimate is still
  an estimate, and ``tol=0`` or the windowed methods' growth budgets are the tools for maps
  that expand strongly. A sample stops when that estimate and ``d_k`` itself
  are ``<= tol``, or when ``d_k == 0`` (a bitwise fixed point of a triangular system is its
  unique solution). A map that accumulates small steps has ``q ~ 1`` and never stops early: it
  runs to the exactness bound, where the value is the sequential result.
* **Newton step** (exact Newton): the step ``delta = (I - J)^{-1} r`` is the linearised error of
  the iterate, accumulation included, and the new iterate's error is far below it
  (quadratic convergence). A sample stops when ``||delta|| <= tol``.
* **Exact prefix** (all of them): after ``k`` iterations the first positions are exact by the
  triangular structure (Song et al. 2021, Prop. 1-2); at the bound everything is.

All of them add the rounding floor of the dtype (one unit in the last place at the largest value
that is not final: what rounding the iterate's value and the sequential one can add to their
difference, :func:`paraprop.solvers.rounding.rounding_floor`) and ignore ratios over steps at the
rounding level (:class:`ContractionRule`): in bf16 and fp16 a ``tol`` below the floor is certified
only by a bitwise fixed point or the exactness bound.

Windowed methods freeze positions before the whole sample is done. Each freeze may introduce its
error estimate into the positions after it, so a freeze of ``m`` of the ``T`` positions is allowed
only with an estimate ``<= tol * m / T``: the errors added by all freezes sum to at most ``tol``
when the map does not amplify errors along the sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["NOISE", "RATES", "ContractionRule", "Floor", "freeze_budget", "freeze_thresholds"]

RATES = 3  # ratios d_j / d_{j-1} the contraction estimate takes the largest of
NOISE = 4  # a step within this many rounding units is rounding noise (no ratio)


class Floor(NamedTuple):
    """The rounding floor of each sample's values (``(B,)`` float64 tensors), as the stopping
    rules use it (:func:`paraprop.solvers.rounding.rounding_floor` computes it):

    * ``bound``: the most that one more rounding can add to an error, what an estimate adds;
    * ``unit``: one unit of the dtype at the values' scale (``eps * scale``), the unit of
      rounding noise (a step within :data:`NOISE` units gives no ratio);
    * ``slack``: the share of the error itself in that rounding (the sequential value's own
      rounding is at most ``eps / 2`` of its size, which is within the error of the values'):
      an estimate divides by ``1 - q - slack`` instead of ``1 - q``.

    A plain tensor ``r`` stands for ``Floor(r, r, 0.0)``.
    """

    bound: torch.Tensor
    unit: torch.Tensor
    slack: float = 0.0


class ContractionRule:
    """Per-sample contraction estimate over successive differences ``d_k`` (shape ``(B,)``).

    Call :meth:`update` once per iteration with the new differences of the samples that iterated;
    it returns ``(stop, estimate)``: which samples may stop, and the estimated error of each.
    After the call, :attr:`stopped` and :attr:`n_stopped` say whether and how many samples
    stopped (``None`` on an accelerator, where knowing it would cost a synchronisation).
    On the host the ``(B,)`` arithmetic runs on NumPy views of the rule's tensors.

    **Rounding.** In floating point the iteration is ``x_{k+1} = fl(f(x_k))`` and the sequential
    result ``x* = fl(f(x*))``; two evaluations from inputs within ``e`` of each other differ by
    up to ``q e`` plus the two roundings, the floor ``r`` (:class:`Floor`; the sequential
    value's own rounding grows with the error by ``slack = eps / 2`` of it). So ``|x_k - x*| <=
    (q d_k + r) / (1 - q - slack)``, and that is the estimate. A step ``d_{j-1} <= NOISE * u``
    (``u = eps m``, one unit of the dtype at the values' largest magnitude ``m``) is rounding
    noise: a ratio over it says nothing
    about contraction (an accumulating map moving one unit in the last place per sweep shows
    ratios near 1 or anything else), so it counts as no contraction, and such a sample does not
    stop early on it (it goes on to a bitwise fixed point or the exactness bound). A ``tol``
    below the floor can only be met bitwise; :attr:`blocked` records the largest floor that kept
    a sample from stopping, for the message when ``max_iters`` ends the solve first.

    A sample that was not active in a call must not be active again before :meth:`reset` (the
    solvers' samples only ever stop); the history of such a sample is not kept. A caller may also
    pass ``d = inf`` for the samples that are not active, with ``all_active=True``: such a
    sample can neither stop nor be held.

    A rule takes ``rate`` (the map's own observed contraction, see :meth:`update`) in every call
    or in none.
    """

    TAPE = 32   # rows of the history tape (see __init__)

    def __init__(self, B: int, device, dtype=torch.float64):
        # the differences d_j of each sample, one row per call, on a tape whose last RATES rows
        # move back to its start when it is full: rows [k - RATES, k) are the last RATES
        # differences (NaN: none yet), in order, so their ratios are one division, formed only
        # when a sample may stop
        self._tape = torch.full((self.TAPE, B), float("nan"), dtype=dtype, device=device)
        self._k = RATES
        self._rated: bool | None = None   # whether the calls pass `rate`
        # with `rate`: the previous RATES - 1 rates (0 before they exist) and the differences
        # d_{j-1} they were observed with (inf before they exist: a missing ratio restricts
        # nothing), in a ring written in place; only their maximum is read
        self._q = torch.zeros(RATES - 1, B, dtype=dtype, device=device)
        self._den = torch.full((RATES - 1, B), float("inf"), dtype=dtype, device=device)
        self._slot = 0
        # the largest rounding floor that kept a sample from stopping (0: none did)
        self.blocked = torch.zeros((), dtype=dtype, device=device)
        # after an update: whether any sample stopped and how many (None on an accelerator)
        self.stopped: bool | None = None
        self.n_stopped: int | None = None
        # On the host the per-sample arithmetic runs on NumPy views of the same memory: the
        # same IEEE operations on (B,) arrays, at a fraction of the cost of a tensor operator
        # each (``tests/test_faults_precision.py`` checks the two bitwise)
        self._host = self._tape.device.type == "cpu"
        self._ops = _NUMPY if self._host and dtype == torch.float64 else _TORCH
        self._views()

    @property
    def host_arrays(self) -> bool:
        """Whether :meth:`update` computes on NumPy arrays (on the host)."""
        return self._ops is _NUMPY

    def _views(self) -> None:
        ops = self._ops
        self._tape_a, self._q_a, self._den_a = (ops.array(t) for t in
                                                (self._tape, self._q, self._den))

    @property
    def d_prev(self) -> torch.Tensor:
        """``(B,)``: each sample's last difference ``d_{k-1}`` (NaN before the first)."""
        return self._tape[self._k - 1]

    def reset(self) -> None:
        """Forget the history: a new problem starts (the next block of GS-Jacobi)."""
        self._tape[:RATES].fill_(float("nan"))
        self._k = RATES
        self._q.zero_()
        self._den.fill_(float("inf"))

    def _push(self, d, active, all_active) -> None:
        """Write ``d`` on the tape (a sample that is not active repeats its last difference)."""
        k, tape = self._k, self._tape_a
        if k == self.TAPE:
            tape[:RATES] = tape[k - RATES:]
            k = RATES
        tape[k] = d if all_active else self._ops.where(active, d, tape[k - 1])
        self._k = k + 1

    def _record_rate(self, q, den, active) -> None:
        i, ops = self._slot, self._ops
        self._slot = (i + 1) % (RATES - 1)
        self._q_a[i] = ops.where(active, ops.nan_to_zero(q), self._q_a[i])
        self._den_a[i] = ops.where(active, den, self._den_a[i])

    def update(self, d: torch.Tensor, tol: float, active: torch.Tensor,
               budget: float | None = None, rate: torch.Tensor | None = None,
               floor=None, all_active: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record ``d`` (``(B,)``) for the ``active`` samples; return ``(stop, estimate)``.

        ``budget`` (default ``tol``) is the bound the estimate must meet; ``d`` itself must also
        be ``<= tol``. A change at the rounding level is a change: even one unit in the last
        place per step accumulates (``tests/test_faults_solve.py``).

        ``rate`` (``(B,)``, optional) is the observed contraction of the map itself,
        ``||fn(x_k) - fn(x_{k-1})|| / ||x_k - x_{k-1}||`` with ``||x_k - x_{k-1}||`` the
        previous ``d``, for methods whose iterates are not ``fn``'s own (Anderson); ``d`` is
        then the residual ``||fn(x_k) - x_k||``, and the estimate bounds the error of
        ``fn(x_k)``. Without it the rate is ``d_k / d_{k-1}``.

        ``floor`` (a :class:`Floor` or a ``(B,)`` float64 tensor, or a callable returning one,
        called only when a sample may stop; on the host its fields may be NumPy arrays): the
        rounding floor of the values (:func:`paraprop.solvers.rounding.rounding_floor`;
        ``None``: exact arithmetic). A ratio whose denominator is within :data:`NOISE` units
        is rounding noise and gives no estimate.

        ``all_active``: the caller knows that every sample is active (saves the masking).
        """
        out = self._update(d, tol, active, budget, rate, floor, all_active)
        if out is None:
            return torch.zeros_like(active), torch.full(active.shape, float("inf"),
                                                        dtype=self._tape.dtype,
                                                        device=active.device)
        return out

    def _update(self, d, tol, active, budget, rate, floor, all_active, arrays=False):
        """:meth:`update`; ``None`` where no sample can stop (on the host). ``arrays``: return
        the NumPy arrays themselves on the host."""
        rated = rate is not None
        if self._rated is None:
            self._rated = rated
        elif self._rated != rated:
            raise ValueError("ContractionRule: pass rate in every call or in none")
        ops = self._ops
        host = self._host
        d = ops.values(d, self._tape.dtype)
        small = d <= tol
        if not all_active:
            active = ops.array(active)
            small = small & active
        # no sample can stop: record and go on (on the host the test is free and saves the
        # estimate; on an accelerator it would cost a synchronisation, so it is skipped there)
        if host and not small.any():
            if rated:
                self._record_rate(ops.values(rate, d.dtype), self._tape_a[self._k - 1], active)
            self._push(d, active, all_active)
            self.stopped, self.n_stopped = False, 0
            return None
        with ops.quiet():
            stop, est = self._estimate(d, small, active, tol, budget, rate, floor, all_active)
        return (stop, est) if arrays else (ops.tensor(stop, None), ops.tensor(est, None))

    def _estimate(self, d, small, active, tol, budget, rate, floor, all_active):
        """The part of :meth:`_update` where a sample may stop."""
        ops = self._ops
        host = self._host
        limit = tol if budget is None else budget
        zero = d == 0
        if self._rated:
            den = self._tape_a[self._k - 1]
            q_now = ops.values(rate, d.dtype)
            raw = ops.maximum(q_now, ops.amax0(self._q_a))
        else:
            self._push(d, active, all_active)
            k = self._k
            win = self._tape_a[k - RATES - 1:k]         # d_{k-RATES} .. d_k, oldest first
            den = win[:-1]
            ratios = win[1:] / den                      # the last row: d_k / d_{k-1}
            # the earlier ratios: NaN (no difference yet) is 0, a missing ratio restricts
            # nothing; the newest stays NaN on the first iteration (no estimate yet)
            ratios[:-1] = ops.nan_to_zero(ratios[:-1])
            raw = ops.amax0(ratios)
        # the estimate in exact arithmetic, over every ratio: the estimate below is at least
        # this (its ratio is at least raw, and it adds the floor), so where no sample other
        # than a bitwise fixed point passes it, none can stop, and none is held by the rounding
        maybe = small & (raw < 1) & (raw * d / (1 - raw) <= limit)
        if host and not maybe.any():
            if self._rated:
                self._record_rate(q_now, den, active)
                self._push(d, active, all_active)
            stop = zero if all_active else zero & active
            return self._result(stop, ops.where(zero, d, _INF), host)
        f = _floor(floor, d, ops)
        signal = NOISE * f.unit
        # a ratio over a denominator at the noise level is no estimate (NaN: none yet)
        if self._rated:
            older = ops.amax0(ops.where(self._den_a <= signal, _INF, self._q_a))
            q = ops.maximum(ops.where(den <= signal, _INF, q_now), older)
            self._record_rate(q_now, den, active)
            self._push(d, active, all_active)
        else:
            q = ops.amax0(ops.where(den <= signal, _INF, ratios))
        c = 1.0 - f.slack
        est = ops.where(q < c, (q * d + f.bound) / (c - q), _INF)
        est = ops.where(zero, 0.0, est)
        stop = zero | (small & (est <= limit))
        if not all_active:
            stop = stop & active
        held = maybe & ~stop
        if not host or held.any():
            # held by the rounding: the estimate in exact arithmetic would have stopped it
            worst = ops.amax_all(ops.where(held, f.bound, 0.0))
            self.blocked = torch.maximum(self.blocked, ops.tensor(worst, self.blocked))
        return self._result(stop, est, host)

    def _result(self, stop, est, host: bool):
        self.n_stopped = int(stop.sum()) if host else None
        self.stopped = None if self.n_stopped is None else self.n_stopped > 0
        return stop, est


_INF = float("inf")
_FMAX = float(np.finfo(np.float64).max)


class _TorchOps:
    """The array operations of :class:`ContractionRule`, on tensors (any device)."""

    # (typed as plain callables: mypy cannot bind staticmethod() of an overloaded function)
    where: Callable[..., Any] = staticmethod(torch.where)
    maximum: Callable[..., Any] = staticmethod(torch.maximum)
    zeros_like: Callable[..., Any] = staticmethod(torch.zeros_like)

    @staticmethod
    def array(t):
        return t

    @staticmethod
    def tensor(a, like):
        return a

    @staticmethod
    def values(t, dtype):
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(t)
        return t.to(dtype)

    @staticmethod
    def amax0(x):
        return x.amax(0)

    @staticmethod
    def amax_all(x):
        return x.amax()

    @staticmethod
    def nan_to_zero(x):
        return torch.nan_to_num(x, nan=0.0)

    @staticmethod
    def quiet():
        return contextlib.nullcontext()


class _NumPyOps:
    """The same operations on NumPy views of host tensors (``(B,)`` arrays: a NumPy call costs
    a fraction of a tensor operator's dispatch). The elementwise IEEE operations round alike,
    and ``np.nan_to_num`` maps NaN and infinities as ``torch.nan_to_num`` does."""

    # (typed as plain callables: mypy cannot bind staticmethod() of an overloaded function)
    where: Callable[..., Any] = staticmethod(np.where)
    maximum: Callable[..., Any] = staticmethod(np.maximum)
    zeros_like: Callable[..., Any] = staticmethod(np.zeros_like)

    @staticmethod
    def array(t):
        if isinstance(t, np.ndarray):
            return t
        return (t.detach() if t.requires_grad else t).numpy()

    @staticmethod
    def tensor(a, like):
        a = torch.from_numpy(np.asarray(a))
        return a if like is None else a.to(like.dtype)

    @staticmethod
    def values(t, dtype):
        if isinstance(t, np.ndarray):
            return t.astype(np.float64, copy=False)
        if t.dtype == torch.bfloat16:   # NumPy has no bfloat16: widen with torch
            t = t.to(dtype)
        return _NumPyOps.array(t).astype(np.float64, copy=False)

    @staticmethod
    def amax0(x):
        return x.max(axis=0)

    @staticmethod
    def amax_all(x):
        return x.max()

    @staticmethod
    def nan_to_zero(x):
        # torch.nan_to_num(x, nan=0.0): NaN to 0, +-inf to the largest finite numbers
        # (np.nan_to_num does the same, with more overhead than these three calls)
        y = np.where(np.isnan(x), 0.0, x)
        return np.clip(y, -_FMAX, _FMAX, out=y)

    @staticmethod
    def quiet():
        # NaN (no ratio yet) and infinities are expected operands, as in the torch operators
        return np.errstate(all="ignore")


_TORCH, _NUMPY = _TorchOps(), _NumPyOps()


def _floor(floor, d, ops) -> Floor:
    """``floor`` (see :meth:`ContractionRule.update`) as a :class:`Floor` of ``d``'s kind."""
    f = floor() if callable(floor) else floor
    if f is None:
        z = ops.zeros_like(d)
        return Floor(z, z, 0.0)
    if isinstance(f, Floor):
        return Floor(ops.values(f.bound, torch.float64), ops.values(f.unit, torch.float64),
                     f.slack)
    f = ops.values(f, torch.float64)
    return Floor(f, f, 0.0)


def freeze_thresholds(n: int, tol: float, T: int, device, dtype=torch.float64
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`freeze_budget` compares ``n`` candidates with: ``(tol * m / T, m)`` for
    ``m = 1 .. n`` (in ``dtype``, the candidates', and long)."""
    m = torch.arange(1, n + 1, device=device, dtype=dtype)
    return tol * m / T, m.to(torch.long)


def freeze_budget(est: torch.Tensor, tol: float, T: int,
                  thresholds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """How many leading positions may be frozen by the rule of the module doc.

    ``est`` is ``(B, n)``: the error estimate of each of the ``n`` leading candidate positions
    (``inf`` where there is none). Returns ``(B,)`` long: the largest ``m`` with
    ``max(est[:, :m]) <= tol * m / T`` (``0`` if none). ``thresholds``: those of
    :func:`freeze_thresholds` for these ``n``, ``tol`` and ``T``, when the caller keeps them.
    """
    B, n = est.shape
    if n == 0 or tol <= 0:
        return torch.zeros(B, dtype=torch.long, device=est.device)
    limit, m = thresholds if thresholds is not None else \
        freeze_thresholds(n, tol, T, est.device, est.dtype)
    ok = est.cummax(dim=1).values <= limit
    # the largest m where ok holds (ok need not be monotone in m)
    return torch.where(ok, m, 0).amax(dim=1)
