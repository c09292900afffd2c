"""The final check of a ``tol=0`` certificate: one evaluation of ``fn`` at the value.

At ``tol=0`` a solver promises the sequential result bitwise. By the triangular structure a
bitwise fixed point ``x = fn(x)`` is that result (position ``0`` is ``fn``'s constant, position
``1`` is computed from it, and so on), so a fixed point is what the certificate needs. Jacobi,
Triangular Anderson, the Newton family and Jacobi-GS on a plain ``fn`` stop only on a sweep of
``fn`` that reproduced the iterate bitwise, or verify at their bound: their own evaluations are
the check. GS-Jacobi, the sliding window, and Jacobi-GS with ``fn.update`` certify positions by
reasoning (a position computed from final inputs is final), with values from the hooks: that
reasoning trusts the map to be triangular and its hooks to compute ``fn``'s values, so the driver
spends one evaluation of ``fn`` on the final value (:func:`verify_final`):

* bitwise equal: the certificate stands (``stats["verification"] == "evaluation"``);
* different by more than rounding: an error. When the solver's hook, asked again with a fresh
  cache for the first such position, reproduces the solver's value, the hook and ``fn``
  disagree (:class:`~paraprop.ProtocolError` naming the hook: shifted, reordered, a hook that
  ignores ``start`` or ``index``). Otherwise the value changed although its inputs are final
  (:class:`~paraprop.NotTriangularError`: ``fn`` or its hook reads a later position, a stale
  cache, or a map whose repeated evaluation differs: dropout in train mode);
* different by rounding only (within :data:`ROUNDING_ULPS` units in the last place of the
  sample's scale; the hooks round differently from ``fn``, or kernels that are not
  deterministic): ``converged=False``, with the reason in ``stats["not_converged"]`` and in the
  :class:`~paraprop.ConvergenceError` message. ``tol > 0`` accepts such differences.
"""

from __future__ import annotations

import torch

from paraprop.errors import NotTriangularError, ProtocolError
from paraprop.solvers.base import NONDETERMINISTIC, State, System
from paraprop.solvers.protocols import HOOKS

__all__ = ["ROUNDING_ULPS", "verify_final"]

# a difference of at most this many units in the last place (of the sample's largest value) is
# taken as rounding, not as a broken map
ROUNDING_ULPS = 16


def verify_final(system: System, state: State) -> str | None:
    """Check ``fn(x) == x`` bitwise at the final value ``state.x`` (one evaluation).

    Returns ``None`` when it holds, or the reason it does not when the difference is within
    rounding (the solve is then not converged). Raises :class:`~paraprop.ProtocolError` or
    :class:`~paraprop.NotTriangularError` for larger differences (see the module doc).
    """
    x = state.x
    y = system.evaluate(x)
    differs = (y != x).any(dim=2)  # (B, T); NaN differs
    if not bool(differs.any()):
        return None
    diff = torch.nan_to_num((y - x).abs().amax(dim=2).to(torch.float64), nan=float("inf"))
    scale = torch.nan_to_num(y.abs(), nan=0.0, posinf=0.0).reshape(system.B, -1).amax(1)
    allow = ROUNDING_ULPS * torch.finfo(x.dtype).eps * scale.to(torch.float64)
    gross = differs & (diff > allow[:, None])
    if not bool(gross.any()):
        b, t = _first(differs)
        return (f"fn(x) at the final value differs from it by rounding only (at most "
                f"{float(diff.max()):.3g}; first at position {system.unravel_position(t)} of "
                f"sample {system.unravel_sample(b)}), so tol=0 cannot certify it bitwise: "
                f"{_rounding_causes(system)}; pass tol > 0 to accept a difference at the "
                "rounding level")
    b, t = _first(gross)
    where = (f"position {system.unravel_position(t)} of sample {system.unravel_sample(b)} "
             f"(fn(x) gives {_show(y[b, t])}, the solver certified {_show(x[b, t])})")
    hook = "window" if "window" in system.used else "update" if "update" in system.used else None
    if hook is not None:
        again = _recompute(system, hook, x, t)
        if torch.equal(again[b], x[b, t]):
            raise ProtocolError(
                f"{HOOKS[hook]} and fn(x) disagree at {where}: asked again for that position "
                "alone, from the same final positions, the hook returns the certified value. A "
                "hook must compute fn's values at exactly the positions asked for (not shifted, "
                "not reordered, not ignoring start or index)")
        stale = " or fn.window served values from a stale cache," if hook == "window" else ""
        raise NotTriangularError(
            f"the value certified as final at {where} is not what fn or {HOOKS[hook]} give "
            "now from the same final positions: fn is not autoregressive along dim (some "
            f"position depends on itself or on a later one),{stale} {NONDETERMINISTIC}")
    raise NotTriangularError(
        f"the value certified as final at {where} is not what fn gives now from the same final "
        "positions: fn is not autoregressive along dim (some position depends on itself or on a "
        f"later one), {NONDETERMINISTIC}")


def _recompute(system: System, hook: str, x: torch.Tensor, t: int) -> torch.Tensor:
    """Position ``t`` by ``hook`` alone, with a fresh cache: ``(B, F)``."""
    xu = system.user(x)
    if hook == "window":
        out = system.fn.window(xu, t, t + 1, None)
        vals = out[0] if isinstance(out, tuple) else out
    else:
        vals = system.fn.update(xu, torch.tensor([t], device=x.device))
    return vals.reshape(system.B, system.F)


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
