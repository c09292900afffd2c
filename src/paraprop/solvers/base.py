"""The solver protocol of :func:`paraprop.solve`, and the rules every solver's step shares.

A solver (:class:`Solver`: ``bound``, ``init``, ``step``) works on the system ``x = fn(x)`` in its
canonical layout (:class:`~paraprop.solvers.triangular.System`) and keeps the iterate and the
per-sample bookkeeping in :class:`State`. :func:`accept` is the shared rule that turns freshly
computed values into the next iterate with per-sample stopping; :func:`settle` ends an iteration,
:func:`check_final` refuses a final position that moved.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paraprop.errors import NotTriangularError
from paraprop.solvers.rounding import rounding_floor_arrays
from paraprop.solvers.triangular import System
from paraprop.stopping import ContractionRule

# the other common cause of a position that moves although its inputs are final
NONDETERMINISTIC = ("or fn's repeated evaluation differs (a module in train mode with dropout or "
                    "batch statistics: call model.eval())")


@dataclass
class State:
    """The iterate and the per-sample bookkeeping of one solve: the fields that the driver,
    :func:`accept`, :func:`settle` and the final check (:mod:`paraprop.solvers.verify`) share,
    and in ``own`` the solver's private state, a dataclass its ``init`` makes."""

    x: torch.Tensor  # (B, T, F), owned by the solver
    active: torch.Tensor  # (B,) bool: samples still iterating
    sample_iterations: torch.Tensor  # (B,) long: sweeps each sample took part in
    residual: float | torch.Tensor | None = math.inf  # convergence measure of the last iteration
    finished: bool = False
    # whether every sample is still iterating, and how many are (None: not counted yet, all);
    # kept by accept and settle
    all_active: bool = True
    n_active: int | None = None
    # the solver's own counters and settings, reported in Solution.stats
    stats: dict[str, Any] = field(default_factory=dict)
    # (B,) long: the first position each sample froze on an error estimate (T: none; None: the
    # solver freezes nothing on an estimate), read by the final check
    # (paraprop.solvers.verify) to tell a broken map from a failed estimate
    estimated_from: torch.Tensor | None = None
    # for the final check at tol > 0 (paraprop.solvers.verify): a callable giving the (B, T)
    # gain of a position per unit change of the earlier ones (None: 1), and what the freeze
    # estimates rely on, a string or a callable giving one (None: the observed contraction)
    gain: Callable[[], torch.Tensor | None] | None = None
    premise: str | Callable[[], str] | None = None
    # the solver's private state (a dataclass of its own, made by its init)
    own: Any = None
    # the per-sample contraction estimate, and the (B,) float64 error estimate where a sample
    # stopped (0 elsewhere), made by __post_init__
    rule: ContractionRule = field(init=False)
    estimate: torch.Tensor = field(init=False)
    # the final value was already checked against fn by the solver's own evaluations (its
    # certificate comes from fn's values); otherwise the driver spends one evaluation on it
    # (paraprop.solvers.verify)
    verified: bool = False
    # set by paraprop.solvers.verify.final_step, which checks the value in the budget's last
    # call: "evaluation" or "failed", and why it failed (converged=False)
    check: str | None = None
    reason: str | None = None
    # (B, T) float64: each position's change in the previous sweep, kept by accept(...,
    # chain=True) at tol > 0 for the accumulation check (_accumulated, which counts the stops
    # it held back in stats["held"])
    changes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        B, device = self.active.shape[0], self.active.device
        self.rule = ContractionRule(B, device)
        self.estimate = torch.zeros(B, dtype=torch.float64, device=device)


class Solver:
    """The protocol of a solver of :func:`paraprop.solve`, with the defaults most solvers share.

    A solver is a small object carrying its settings (:func:`paraprop.solvers.is_solver`
    accepts any object with these members; subclassing is optional):

    - ``name``: the method's name (``Solution.method``);
    - ``hooks``: the optional hooks of ``fn`` it calls (keys of
      :data:`~paraprop.solvers.protocols.HOOKS`), declared by every solver;
    - ``bound(system)``: the iterations that guarantee the sequential result (here ``T``: each
      iteration makes at least one more position final);
    - ``init(system, state)``: its private state into ``state.own``, before the first
      iteration;
    - ``step(system, state, tol, norm)``: one iteration, updating ``state`` (the iterate, the
      active samples, ``finished``; :func:`accept` and :func:`settle` do the common part).
    """

    name: str
    hooks: tuple[str, ...]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def bound(self, system: System) -> int:
        return system.T

    def init(self, system: System, state: State) -> None:
        raise NotImplementedError

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        raise NotImplementedError


def sync(*values) -> list:
    """Several integer or boolean device scalars (0-d tensors; Python values pass through) on
    the host in one transfer: the one synchronisation of an iteration."""
    idx = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    out = list(values)
    if idx:
        host = torch.stack([values[i].to(torch.int64).reshape(()) for i in idx]).tolist()
        for i, h in zip(idx, host, strict=True):
            out[i] = h
    return out


def accept(system: System, state: State, lo: int, hi: int, new: torch.Tensor, tol: float,
           norm: str, exact: int = 0, budget: float | None = None,
           kept: torch.Tensor | None = None, chain: bool = False) -> None:
    """Write ``new`` into positions ``[lo, hi)`` of the active samples, with per-sample stopping.

    Arguments:
        system, state: the system and the solver state (``state.x`` is updated in place).
        lo, hi: the positions ``new`` holds (canonical layout ``(B, hi - lo, F)``).
        tol, norm: a sample stops when the contraction estimate of its error
            (:class:`~paraprop.stopping.ContractionRule`, with the rounding floor of the
            dtype) and its forward difference are ``<= tol``, or when it did not move at all;
            its values are then frozen.
        exact: the first ``exact`` positions of ``[lo, hi)`` are final already. For an
            autoregressive ``fn`` they cannot move (Song et al. 2021, Prop. 1-2), so a change
            larger than ``tol`` there proves that ``fn`` is not triangular.
        budget: the bound the error estimate must meet (default ``tol``; windowed methods pass
            their share of it).
        kept: ``(B, n)`` bool, the positions where a non-finite value was replaced by the old
            one (:meth:`System.keep_finite`): their samples count as moved.
        chain: ``new`` is ``fn`` of the previous iterate at every position (a Jacobi sweep,
            ``lo = 0``, ``hi = T``): at ``tol > 0`` a stop the contraction estimate allows is
            also checked against the sweep's changes carried along the positions through
            their observed gains (:func:`_accumulated`), which the estimate over whole-sample
            differences cannot see on a map that accumulates small steps.

    Whether a sample stopped is known on the host without a synchronisation of its own
    (``state.rule.stopped``); :func:`settle` reads it.
    """
    old = state.x[:, lo:hi]
    active = state.active
    all_active = state.all_active
    rule = state.rule
    # on the host the (B,) bookkeeping runs on NumPy views (the rule's arithmetic does too)
    host = rule.host_arrays and new.device.type == "cpu"
    a = (new - old).abs_()  # (B, n, F): one pass over the difference serves both checks
    track = chain and tol > 0
    changes = None
    if track:   # each position's change (the sample's max is the max of them, bitwise)
        changes = (a.amax(dim=2) if norm == "max" else
                   torch.linalg.vector_norm(a, dim=2)).to(torch.float64)
    if exact > 0:
        head = a[:, :exact]
        # on the host one reduction answers whether a final position of an active sample
        # moved (NaN moves); the full check names the position
        if not host or not (float(head.amax()) if all_active else _masked_max(
                head.amax(dim=(1, 2)), active)) <= tol:
            check_final(system, head.amax(dim=2), tol, active, lo)
    if norm == "max":
        res = a.amax(dim=(1, 2)) if changes is None else changes.amax(dim=1).to(a.dtype)
    else:
        res = torch.linalg.vector_norm(a.reshape(a.shape[0], -1), dim=1)
    if kept is not None:
        res = torch.where(kept.any(dim=1), torch.full_like(res, math.inf), res)
    if all_active:
        old.copy_(new)
    else:
        torch.where(active[:, None, None], new, old, out=old)
    # the rounding floor of the positions that are not final (those before lo + exact are the
    # sequential values bitwise, and do not move)
    floor = lambda: rounding_floor_arrays(state.x[:, lo + exact:hi], norm)   # noqa: E731
    if host:
        r = _host_array(res)
        if all_active:
            state.sample_iterations += 1
            state.residual = float(r.max())
        else:
            act = active.numpy()
            it = state.sample_iterations.numpy()
            it += act
            state.residual = float(np.where(act, r, 0.0).max())
            # a sample that is not active can neither stop nor be held: an infinite difference
            r = np.where(act, r, np.inf)
        out = rule._update(r, tol, active, budget, None, floor, True, arrays=True)
        prev, state.changes = state.changes, changes
        if out is None or not rule.stopped:   # no sample stopped
            return
        stop, est = out
        if track:
            assert changes is not None
            held = _accumulated(state, changes, prev, torch.from_numpy(np.asarray(stop)),
                                tol if budget is None else budget, norm).numpy()
            if held.any():
                stop = stop & ~held
                state.stats["held"] = state.stats.get("held", 0) + int(held.sum())
                assert rule.n_stopped is not None
                rule.n_stopped -= int(held.sum())
                rule.stopped = rule.n_stopped > 0
                if not rule.stopped:
                    return
        np.copyto(state.estimate.numpy(), est, where=stop)
        state.active = torch.from_numpy(active.numpy() & ~stop)
        assert rule.n_stopped is not None   # the rule counts the stops on the host
        state.n_active = _n_active(state, active) - rule.n_stopped
        return
    if all_active:
        state.sample_iterations += 1
        state.residual = res.max()
    else:
        state.sample_iterations += active
        state.residual = torch.where(active, res, 0.0).max()
        res = torch.where(active, res, math.inf)
    out = rule._update(res, tol, active, budget, None, floor, True)
    prev, state.changes = state.changes, changes
    if out is None or rule.stopped is False:   # no sample stopped (known on the host)
        return
    stop, est = out
    if track:
        assert changes is not None
        held_t = _accumulated(state, changes, prev, stop, tol if budget is None else budget,
                              norm)
        stop = stop & ~held_t
        if rule.n_stopped is not None:
            n_held = int(held_t.sum())
            state.stats["held"] = state.stats.get("held", 0) + n_held
            rule.n_stopped -= n_held
            rule.stopped = rule.n_stopped > 0
    state.estimate = torch.where(stop, est, state.estimate)
    state.active = active & ~stop
    if rule.n_stopped is not None:
        state.n_active = _n_active(state, active) - rule.n_stopped


def _accumulated(state: State, r: torch.Tensor, prev: torch.Tensor | None,
                 stop: torch.Tensor, limit: float, norm: str) -> torch.Tensor:
    """``(B,)`` bool: the samples among ``stop`` whose stop the accumulation check holds back.

    A Jacobi sweep's change at position ``t``, ``r_t = |fn(x)_t - x_t|``, is the defect of the
    previous iterate ``x`` there. Its error against the sequential result then obeys ``e_t <=
    r_t + g_t max_{i<t} e_i``, ``g_t`` the gain of position ``t`` per unit change of the earlier
    ones, observed between the last two sweeps (the change at ``t`` over the previous sweep's
    change at ``t - 1``, or, where that is at the rounding level, at the earlier positions:
    the largest ``|fn(x)_t - fn(x')_t| / |x_{t-1} - x'_{t-1}|``; a position whose gain cannot be
    observed takes the sample's largest). A sample may stop only where the largest error this
    recurrence allows (``M``, which also bounds the error of the new iterate ``fn(x)``; with
    ``norm="l2"`` the l2 norm of the positions' bounds), is within ``limit``. The contraction
    estimate over whole-sample differences stops a map that accumulates small steps from a warm
    start with its error spread along the positions (measured: 12.8x ``tol``); this check sees
    the accumulation. Like every observed gain it is
    an estimate, not a proof (``tol=0`` is the bitwise certificate)."""
    out = torch.zeros_like(stop)
    if not bool(stop.any()):
        return out
    if prev is None:   # no gain observed yet: only a bitwise fixed point (no change) stops
        return stop & (r.amax(dim=1) > 0).to(stop.device)
    rows = stop.nonzero()[:, 0]
    rr, pp = r[rows].cpu(), prev[rows].cpu()
    x = state.x[rows.to(state.x.device)]
    eps = torch.finfo(x.dtype).eps
    scale = x.abs().reshape(x.shape[0], -1).amax(1).to(torch.float64).cpu().clamp(min=1e-300)
    noise = (4 * eps * scale)[:, None]
    if norm != "max":
        noise = noise * math.sqrt(x[0, 0].numel())
    B, T = rr.shape
    before = torch.cat([torch.zeros(B, 1, dtype=torch.float64), pp[:, :-1]], dim=1)
    upto = torch.cat([torch.zeros(B, 1, dtype=torch.float64),
                      pp.cummax(dim=1).values[:, :-1]], dim=1)
    den = torch.where(before > noise, before, upto)
    g = torch.where(den > noise, rr / den, torch.where(rr > noise, math.inf, math.nan))
    g[:, 0] = 0.0   # position 0 reads no other position
    top = torch.nan_to_num(g, nan=0.0, posinf=0.0).amax(dim=1, keepdim=True)
    g = torch.where(g.isnan(), torch.maximum(top, torch.ones_like(top)), g)
    M = np.zeros(B)
    ra, ga = rr.numpy(), g.numpy()
    E = np.zeros((B, T))
    with np.errstate(all="ignore"):
        for t in range(T):
            E[:, t] = ra[:, t] + ga[:, t] * M
            M = np.maximum(M, E[:, t])
        # the sample's error in its norm: the largest position's (max), or the positions' l2
        bound = M if norm == "max" else np.sqrt((E * E).sum(axis=1))
    bad = ~(torch.from_numpy(bound) <= limit)
    out[rows.to(out.device)] = bad.to(out.device)
    return out


def _n_active(state: State, active: torch.Tensor) -> int:
    """The samples iterating before this iteration's stops (all where not counted yet)."""
    return active.numel() if state.n_active is None else state.n_active


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A host tensor's values as a NumPy array (a view; bfloat16, which NumPy lacks, widened)."""
    return (t.to(torch.float64) if t.dtype == torch.bfloat16 else t).numpy()


def _masked_max(v: torch.Tensor, active: torch.Tensor) -> float:
    """``max(v[active])`` of host ``(B,)`` tensors (0 where none), NaN propagating."""
    return float(np.where(active.numpy(), _host_array(v), 0.0).max())


def settle(state: State, at_bound: bool) -> bool:
    """End an iteration with its one synchronisation: the number of samples still iterating.
    Sets ``state.finished`` (none left, or ``at_bound``) and ``state.all_active``; returns
    whether any sample is still iterating. On the host :func:`accept` counts the samples that
    stopped (``state.n_active``), and nothing is read here."""
    B = state.active.numel()
    if state.rule.n_stopped is not None:
        n = B if state.n_active is None else state.n_active
    else:
        n = int(state.active.sum())
    state.n_active = n
    state.all_active = n == B
    state.finished = at_bound or n == 0
    return n > 0


def last_from_x0(system: System, state: State, samples: torch.Tensor | None = None) -> None:
    """Before a call that computes the last position from final inputs (the budget's last:
    ``T`` calls, as the sequential loop): give the last position of ``samples`` (``(B,)``
    bool; default the active ones) ``x0``'s value, which the sequential loop's last step reads
    there. The call's value of that position is then that loop's, even for a map whose last
    position reads itself, which no check within ``T`` calls could see."""
    if system.initial is None:
        return
    T = system.T
    samples = state.active if samples is None else samples
    x = state.x
    x[:, T - 1] = torch.where(samples[:, None], system.initial[:, T - 1], x[:, T - 1])


def check_final(system: System, moved_by: torch.Tensor, tol: float, active: torch.Tensor,
                lo: int = 0) -> None:
    """Raise :class:`NotTriangularError` if a final position moved: ``moved_by`` ``(B, n)`` is
    the change of the final positions ``[lo, lo + n)``; by the triangular structure (Song et al.
    2021, Prop. 1-2) none may move by more than ``tol``."""
    moved = ~(moved_by <= tol) & active[:, None]   # NaN moves
    if bool(moved.any()):
        b, t = (int(i) for i in moved.nonzero()[0])
        raise NotTriangularError(
            f"fn is not autoregressive along dim: position {system.unravel_position(lo + t)} of "
            f"sample {system.unravel_sample(b)} changed at iteration {system.iteration} although "
            "every position it may depend on was already final; some position depends on itself "
            f"or on a later one, {NONDETERMINISTIC}")
