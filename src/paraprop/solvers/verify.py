"""The final check of a certificate: one evaluation of ``fn`` at the value, within the budget.

**What is checked.** A solver certifies its value from its own reasoning: a position computed
from final inputs is final (GS-Jacobi, the sliding window, Jacobi-GS), and at ``tol > 0`` a
position may be frozen on an estimate of its error. Both trust the map: that it is triangular,
that its hooks compute ``fn``'s values from the inputs they are given (a window not shifted, a
cache not stale, an update in the order of its index), and that the bounds it states
(``fn.sensitivity``, ``fn.growth``) hold. The solvers whose certificate comes from ``fn``'s own
values (Jacobi, Triangular Anderson, the Newton family, Jacobi-GS on a plain ``fn``) need no
more; for the others the driver spends one evaluation ``y = fn(x)`` on the final value ``x``
(:func:`verify_final`), and compares (:func:`compare`):

* ``tol=0``: ``y == x`` bitwise, which by the triangular structure is the sequential result;
* ``tol > 0``: the residual ``|y - x|`` against what a value within ``tol`` of the sequential
  result ``x*`` can have. With ``e = |x - x*| <= tol`` (the certificate's claim) and ``L`` a
  bound on how much ``fn`` moves a position per unit change of the positions before it (the
  estimates assume ``L <= 1``: an observed contraction, or a map that does not expand
  differences; a stated ``fn.growth`` or ``fn.sensitivity`` may say more),
  ``|fn(x) - x| <= |fn(x) - fn(x*)| + |fn(x*) - x*| + |x* - x| <= L e + e`` in exact arithmetic;
  ``fl(fn(x))`` and ``x* = fl(fn(x*))`` each add half a unit in the last place (together the
  rounding floor ``rho`` of :func:`~paraprop.solvers.rounding.half_ulp_bound` at the sample's
  largest value), and hooks that round differently from ``fn`` up to :data:`ROUNDING_ULPS`
  units. So ``|fn(x) - x| <= (1 + L) tol + rho + a`` per position (``norm="max"``), or for the
  whole sample with ``norm="l2"`` (``rho`` and ``a`` of the sample's l2 norm). An honest map
  whose certificate holds cannot exceed it; the estimates freeze a position only when its error
  fits a share ``tol * m / T`` of ``tol``, so an honest map stays far below it even where it
  expands more than the estimate assumed. A broken promise (a shifted window, a stale cache, an
  update in reversed order or with a duplicated index, a false ``fn.sensitivity``) leaves
  residuals of the size of the values.

**What a residual beyond the bound means** (the first such position ``t``):

* when a hook computed the value, it is asked again for the positions ``t, t + 1`` alone, from
  the same (final) positions, with a fresh cache: if it disagrees with ``fn(x)`` there (by more
  than ``tol`` plus rounding), the hook and ``fn`` disagree: :class:`~paraprop.ProtocolError`
  naming it (shifted, reordered, a duplicated index, ignoring ``start`` or ``index``);
* otherwise, where position ``t`` was certified from final inputs (every position at
  ``tol=0``), its value changed although its inputs are final:
  :class:`~paraprop.NotTriangularError` (``fn`` or its hook reads a later position, a stale
  cache, or a map whose repeated evaluation differs: dropout in train mode);
* where it was frozen on an estimate (``tol > 0``), the estimate's premise failed, or one of
  the causes above: ``converged=False`` with the reason (``stats["not_converged"]``, the
  :class:`~paraprop.ConvergenceError`);
* at ``tol=0``, a difference of rounding only (within :data:`ROUNDING_ULPS` units in the last
  place of the sample's scale: hooks that round differently from ``fn``, or kernels that are
  not deterministic): ``converged=False`` with the reason; a ``tol > 0`` at the rounding level
  accepts it.

**Within the budget** (never more sequential steps than the sequential loop, ``T``): a solver
that certifies at least one position per call has spent at most ``T - 1`` calls whenever a
position is left; at ``T - 1`` calls exactly one is left, and its last call is
:func:`final_step`: one evaluation of ``fn`` that checks every other position and computes the
last one as the sequential loop does (from the final positions, with ``x0``'s value at the last
position). A solver that stops earlier has a call left for :func:`verify_final`.
"""

from __future__ import annotations

import math

import torch

from paraprop.errors import NotTriangularError, ProtocolError
from paraprop.solvers.base import NONDETERMINISTIC, State, last_from_x0
from paraprop.solvers.protocols import HOOKS
from paraprop.solvers.rounding import half_ulp_bound
from paraprop.solvers.triangular import System

__all__ = ["ROUNDING_ULPS", "compare", "final_step", "loose_share", "verify_final"]

# a difference of at most this many units in the last place (of the sample's largest value) is
# taken as rounding, not as a broken map
ROUNDING_ULPS = 16


def verify_final(system: System, state: State, tol: float = 0.0, norm: str = "max"
                 ) -> str | None:
    """Check the final value ``state.x`` against one evaluation of ``fn`` (:func:`compare`).

    Returns ``None`` when it holds, or the reason it does not where that is not an error
    (the solve is then not converged). Raises :class:`~paraprop.ProtocolError` or
    :class:`~paraprop.NotTriangularError` (see the module doc).
    """
    x = state.x
    return compare(system, state, x, system.evaluate(x), tol, norm)


def final_step(system: System, state: State, tol: float, norm: str) -> None:
    """The last call the budget leaves (``T - 1`` calls spent, so every sample still iterating
    has all positions but the last final): one evaluation of ``fn`` at the iterate, with ``x0``'s
    value at the last position of those samples, as the sequential loop's last step has it.
    It checks every position but those last ones (:func:`compare`; the samples that stopped
    earlier, all their positions), and gives the last ones ``fn``'s values. Ends the solve;
    the outcome is in ``state.check`` and ``state.reason``."""
    x, act, T = state.x, state.active, system.T
    before = x[:, T - 1].clone()
    last_from_x0(system, state)
    y = system.evaluate(x)
    index = torch.arange(T - 1, T, device=x.device)
    # position T - 1 of those samples is computed from final inputs by fn: a NaN there is the
    # sequential loop's own
    system.keep_finite(y[:, T - 1:], before[:, None], T - 1, index, act, x=x, hook="fn")
    rows = torch.ones(x.shape[0], T, dtype=torch.bool, device=x.device)
    rows[:, T - 1] = ~act
    reason = compare(system, state, x, y, tol, norm, rows)
    x[:, T - 1] = torch.where(act[:, None], y[:, T - 1], before)
    change = (x[:, T - 1] - before).abs().amax(dim=1) if norm == "max" else \
        torch.linalg.vector_norm(x[:, T - 1] - before, dim=1)
    state.residual = torch.where(act, change, torch.zeros_like(change)).max()
    state.sample_iterations += act
    state.active = torch.zeros_like(act)
    state.finished = True
    state.check = "evaluation" if reason is None else "failed"
    state.reason = reason
    stats = state.stats
    stats["finished_sequentially"] = stats.get("finished_sequentially", 0) + 1


def compare(system: System, state: State, x: torch.Tensor, y: torch.Tensor, tol: float,
            norm: str, rows: torch.Tensor | None = None) -> str | None:
    """Compare the value ``x`` with ``y = fn(x)`` (both ``(B, T, F)``) on the positions
    ``rows`` (``(B, T)`` bool; ``None``: all), as the module doc says. Returns ``None`` or the
    reason the value is not certified (no error); raises for a broken map.

    A difference beyond the bound but within half the digits of the values
    (:func:`loose_share`) is not taken for a broken map: a hook whose rounding a step amplifies
    (``tanh(30 * W x)`` rounds its argument at the scale of ``30 * W x``) differs from ``fn`` by
    that much, and a broken one by the size of the values. It is not certified either
    (``converged=False``)."""
    B, T = x.shape[0], x.shape[1]
    eps = torch.finfo(x.dtype).eps
    yabs = torch.nan_to_num(y.abs(), nan=0.0, posinf=0.0)
    if norm == "max" or tol == 0:
        scale = yabs.reshape(B, -1).amax(1).to(torch.float64)
    else:
        scale = torch.linalg.vector_norm(yabs.reshape(B, -1).to(torch.float64), dim=1)
    allow = ROUNDING_ULPS * eps * scale
    loose = loose_share(x.dtype) * scale
    r = _per_position(y, x, "max" if tol == 0 else norm)               # (B, T) float64
    L = None
    if tol == 0:
        differs = (y != x).any(dim=2)   # (B, T); NaN differs
        if rows is not None:
            differs &= rows
        if not bool(differs.any()):
            return None
        bound = allow[:, None].expand(B, T)
        over = differs & (r > bound)
        if not bool(over.any()):
            b, t = _first(differs)
            return (f"fn(x) at the final value differs from it by rounding only (at most "
                    f"{float(r[differs].max()):.3g}; first at position "
                    f"{system.unravel_position(t)} of sample {system.unravel_sample(b)}), so "
                    f"tol=0 cannot certify it bitwise: {_rounding_causes(system)}; pass tol > 0 "
                    "to accept a difference at the rounding level")
        gross = over & (r > bound + loose[:, None])
    else:
        gain = state.gain
        L = gain() if callable(gain) else None
        L = torch.ones(B, T, dtype=torch.float64, device=x.device) if L is None else \
            L.to(x.device)
        if norm == "max":
            m = torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).reshape(B, -1).amax(1)
            rho = half_ulp_bound(m.to(torch.float64), x.dtype)
            bound = tol * (1 + L) + (rho + allow)[:, None]              # (B, T)
            over = r > bound
            gross = r > bound + loose[:, None]
        else:
            xl = torch.linalg.vector_norm(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
                                          .reshape(B, -1).to(torch.float64), dim=1)
            total = (r if rows is None else torch.where(rows, r, 0.0)).pow(2).sum(1).sqrt()
            per_sample = tol * (1 + L.amax(1)) + eps * xl + allow
            bound = (per_sample / math.sqrt(T))[:, None].expand(B, T)
            over = (total > per_sample)[:, None] & (r > bound)
            gross = (total > per_sample + loose)[:, None] & \
                (r > ((per_sample + loose) / math.sqrt(T))[:, None])
        if rows is not None:
            over &= rows
        if not bool(over.any()):
            return None
    if rows is not None:
        gross &= rows
    if not bool(gross.any()):
        b, t = _first(over)
        what = ("rounding (16 units in the last place)" if tol == 0 else
                f"a value within tol={tol} of the sequential result can")
        return (f"fn(x) at the final value differs from it by up to {float(r[over].max()):.3g} "
                f"(first at position {system.unravel_position(t)} of sample "
                f"{system.unravel_sample(b)}), more than {what} ({float(bound[b, t]):.3g} there)"
                f" but little against the values (half their digits: {float(loose[b]):.3g}): "
                f"{_rounding_causes(system)}, with the rounding amplified inside a step, or a "
                "hook or map that breaks its promise by little; the value is not certified")
    b, t = _first(gross)
    return _blame(system, state, x, y, b, t, tol, allow + loose, float(r[b, t]),
                  float(bound[b, t]), 1.0 if L is None else float(L[b, t]))


def loose_share(dtype: torch.dtype) -> float:
    """Half the digits of ``dtype`` (``sqrt(eps)``): a difference from ``fn`` within this share
    of the values is taken for amplified rounding, not for a broken map (:func:`compare`)."""
    return math.sqrt(torch.finfo(dtype).eps)


def _blame(system, state, x, y, b, t, tol, allow, r=None, bound=None, L=None):
    """Position ``t`` of sample ``b`` is off by more than the bound: raise, or return the reason
    (see the module doc)."""
    where = (f"position {system.unravel_position(t)} of sample {system.unravel_sample(b)} "
             f"(fn(x) gives {_show(y[b, t])}, the solver certified {_show(x[b, t])})")
    hook = "window" if "window" in system.used else "update" if "update" in system.used else None
    if hook is not None:
        # two positions (a request of one cannot be reordered or duplicated): t and the next,
        # or the one before where t is the last
        n = min(2, system.T)
        lo = min(t, system.T - n)
        again = _recompute(system, hook, x, lo, n)[b]                     # (n, F)
        gap = torch.nan_to_num((again - y[b, lo:lo + n]).abs().to(torch.float64),
                               nan=math.inf).amax(dim=1)
        off = ~(gap <= float(allow[b]) + tol)
        if bool(off.any()):
            j = lo + int(off.nonzero()[0])
            span = ", ".join(str(system.unravel_position(lo + i)) for i in range(n))
            raise ProtocolError(
                f"{HOOKS[hook]} and fn(x) disagree at position {system.unravel_position(j)} "
                f"of sample {system.unravel_sample(b)} (asked again for positions {span} alone, "
                f"from the same final positions, the hook returns {_show(again[j - lo])} there, "
                f"fn(x) gives {_show(y[b, j])}; the solver certified {_show(x[b, t])} at "
                f"{system.unravel_position(t)}). A hook must compute fn's values at exactly the "
                "positions asked for (not shifted, not reordered, not duplicated, not ignoring "
                "start or index)")
    frm = state.estimated_from
    exact = tol == 0 or frm is None or t < int(frm[b])
    stale = " or fn.window served values from a stale cache," if hook == "window" else ""
    if exact:
        what = "fn" if hook is None else f"fn or {HOOKS[hook]}"
        raise NotTriangularError(
            f"the value certified as final at {where} is not what {what} give"
            f"{'s' if hook is None else ''} now from the same final positions: fn is not "
            "autoregressive along dim (some position depends on itself or on a later one),"
            f"{stale} {NONDETERMINISTIC}")
    premise = state.premise
    premise = "the contraction observed on the sweeps" if premise is None else \
        premise() if callable(premise) else premise
    return (f"fn(x) at the final value differs from it at {where} by {r:.3g}, more than a value "
            f"within tol={tol} of the sequential result can ({bound:.3g}: (1 + {L:.3g}) * tol "
            f"plus rounding); that position was frozen on an error estimate, which relies on "
            f"{premise}: the map does not meet it there, or fn is not autoregressive along dim,"
            f"{stale} {NONDETERMINISTIC}; pass tol=0 for a result verified bitwise")


def _per_position(y: torch.Tensor, x: torch.Tensor, norm: str) -> torch.Tensor:
    """``(B, T)`` float64: ``|y - x|`` per position (max or l2 over the features; NaN is
    infinite)."""
    d = (y - x).abs().to(torch.float64)
    d = d.amax(dim=2) if norm == "max" else d.pow(2).sum(2).sqrt()
    return torch.nan_to_num(d, nan=math.inf)


def _recompute(system: System, hook: str, x: torch.Tensor, t: int, n: int) -> torch.Tensor:
    """Positions ``[t, t + n)`` by ``hook`` alone, with a fresh cache: ``(B, n, F)``."""
    xu = system.user(x)
    if hook == "window":
        out = system.fn.window(xu, t, t + n, None)
        vals = out[0] if isinstance(out, tuple) else out
    else:
        vals = system.fn.update(xu, torch.arange(t, t + n, device=x.device))
    return vals.reshape(system.B, n, system.F)


def _first(mask: torch.Tensor) -> tuple[int, int]:
    """``(sample, position)`` of the earliest position set in ``mask`` ``(B, T)``."""
    t = int(mask.any(dim=0).nonzero()[0])
    b = int(mask[:, t].nonzero()[0])
    return b, t


def _show(v: torch.Tensor) -> str:
    vals = v.reshape(-1)[:4].tolist()
    more = ", ..." if v.numel() > 4 else ""
    return "[" + ", ".join(f"{a:.6g}" for a in vals) + more + "]"


def _rounding_causes(system: System) -> str:
    used = sorted(system.used)
    if used:
        names = " and ".join(HOOKS[h] for h in used)
        verb = "round" if len(used) > 1 else "rounds"
        return f"{names} {verb} differently from fn(x), or fn's kernels are not deterministic"
    return "fn's kernels are not deterministic (torch.use_deterministic_algorithms)"
