"""Newton-type solvers for Markov recurrences ``x_t = f_t(x_{t-1})`` (DEER, quasi-DEER, ELK).

Linearising ``fn`` at the iterate ``x`` turns the nonlinear system into a *linear* recurrence for
the step ``delta`` (Lim et al. 2023, "Parallelizing non-linear sequential models over the
sequence length", DEER):

    delta_t = J_t delta_{t-1} + r_t,     r = fn(x) - x,     J_t = d fn_t / d x_{t-1},

solved in parallel by :func:`paraprop.scan.linear_recurrence`; ``x + delta`` is the Newton
iterate. ``"newton"`` uses the exact Jacobians (dense, or the factored form of the analytic GRU
and RNN cells), ``"quasi_newton"`` only their diagonals (quasi-DEER, Gonzalez et al. 2024: a
diagonal recurrence, cheaper per iteration, linear instead of quadratic convergence), and
``"elk"`` damps the exact step (ELK, Gonzalez et al. 2024, "Towards scalable and stable
parallelization of nonlinear RNNs"): the step is the Kalman-filtered mean of the linearised
recurrence seen as a linear Gaussian model whose states are observed at zero with variance
``1 / lambda`` (the filter form of the authors' reference code), computed by the parallel Kalman
filter of Sarkka and Garcia-Fernandez (2021), one associative scan
(:mod:`paraprop.solvers.kalman`). ``lambda -> 0`` is Newton;
larger ``lambda`` damps each step by its accumulated uncertainty, most where products of
Jacobians grow and Newton's linear recurrence overflows. ``"quasi_elk"`` runs the same filter on
the diagonal Jacobians of ``"quasi_newton"`` (quasi-ELK: elementwise, as cheap as quasi-DEER).

Guarantees shared by the three (and by Jacobi): after iteration ``k`` the positions ``< k`` hold
the sequential result, because position ``k - 1`` is set to ``fn(x)_{k-1}``, computed from an
exact prefix. Those positions are frozen and the work shrinks to the suffix, so at most ``T``
iterations are needed. A sample stops on an estimate of its error, never on the residual
``|fn(x) - x|`` (which does not bound it): exact Newton on the size of its step, the others on
the contraction of successive steps (:mod:`paraprop.stopping`). A step that overflows
(Newton can diverge) is replaced by the Jacobi update for that sample and counted in
``stats["resets"]``; it never reaches the result.

A :class:`paraprop.Recurrence` may also offer ``newton_step(x, lo, form)``: the undamped step's
values ``y = fn(x)`` and ``trial = x + delta`` at positions ``[lo, T)`` computed together (the
cell, its Jacobians and the linear recurrence in one blocked pass, as ParaGRU's and ParaLSTM's
recurrences do), or ``None`` for a form it does not fuse; the checks and the stopping rule that
follow are the same either way. How ``fn``'s values and Jacobians are read (those hooks, or
forward-mode products on a plain ``fn``) is :mod:`paraprop.solvers.linearize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paraprop import checks
from paraprop.scan import linear_recurrence
from paraprop.solvers.base import Solver, State, last_from_x0, sync
from paraprop.solvers.kalman import kalman_step
from paraprop.solvers.linearize import FullAccess, MarkovAccess, choose_access
from paraprop.solvers.rounding import half_ulp_bound, rounding_floor
from paraprop.solvers.triangular import System
from paraprop.stopping import Floor

FORMS = {"newton": "any", "quasi_newton": "diag", "elk": "dense", "quasi_elk": "diag"}
DEFAULT_DAMPING = 1e-2


@dataclass(slots=True)
class _NewtonState:
    access: MarkovAccess | FullAccess   # how fn's values and Jacobians are had (linearize)
    index: torch.Tensor       # arange(T)
    lo: int = 0               # positions < lo are exact for every active sample
    # the steps that took fn(x) instead (a Python int, then a device scalar once one did)
    resets: int | torch.Tensor = 0
    # one array of x's size for the residual, made at the first step (see _work)
    work: torch.Tensor | None = None


class _NewtonFamily(Solver):
    """The shared implementation of :class:`Newton`, :class:`QuasiNewton`, :class:`ELK` and
    :class:`QuasiELK` (see the module doc).

    Stopping: exact Newton stops a sample when its step ``||delta||`` is ``<= tol`` (the step
    is the linearised error of the iterate, accumulation included). The approximate and damped
    steps estimate the error by the contraction of successive steps
    (:class:`~paraprop.stopping.ContractionRule`), plus the step itself, since a
    stopping sample returns ``fn(x)`` rather than the next iterate.
    """

    name = "newton"
    # the optional hooks of fn this solver calls (paraprop.solvers.protocols): the
    # Jacobian-free Markov access of fn.linearize / fn.newton_step where fn has them (else fn)
    hooks: tuple[str, ...] = ("linearize", "newton_step")
    damped = False

    def __init__(self, damping: float | None = None):
        self.form = FORMS[self.name]
        self.damping = (DEFAULT_DAMPING if damping is None
                        else float(checks.positive_number(f"{type(self).__name__}: damping",
                                                          damping)))

    def __repr__(self) -> str:
        extra = f"damping={self.damping!r}" if self.damped else ""
        return f"{type(self).__name__}({extra})"

    def init(self, system: System, state: State) -> None:
        state.own = _NewtonState(choose_access(system, self.name),
                                 torch.arange(system.T, device=state.x.device))
        state.stats = {"resets": 0, "jacobian": self.form}
        # it stops only where fn(x) == x bitwise (tol=0), or at the bound by the exact prefix
        # (whose last iteration computes the last position from the final ones)
        state.verified = True
        if self.damped:
            state.stats["damping"] = self.damping

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        ex: _NewtonState = state.own
        access = ex.access
        lo, T, x, act = ex.lo, system.T, state.x, state.active
        if lo == T - 1 and not access.markov:
            # the last iteration the budget allows (T evaluations, as the sequential loop):
            # position T - 1 is computed from the final positions as that loop's last step
            # does, with x0's value there; the evaluation checks every other position
            last_from_x0(system, state)
        fused = None if self.damped else access.newton_step(x, lo, self.form)
        if fused is None:
            y, J = access.linearize(x, lo, self.form, state, tol)
        else:
            y, trial = fused
        if isinstance(access, FullAccess):   # (not access.markov)
            state.stats["jvps"] = access.jvps
        state.sample_iterations += act.long()
        seg = x[:, lo:]
        if fused is None:
            r = torch.sub(y, seg, out=_work(ex, x, lo))
            if self.damped:
                trial = self._elk(x, r, J, lo)
            else:
                trial = linear_recurrence(J, r).add_(seg)
        # One synchronisation for two checks. NaN or inf in fn's values: position lo is
        # computed from the exact prefix, so there it is the map's (NonFiniteError); later
        # positions come from a diverging iterate, keep their old values, and the sample takes
        # fn(x) for this step. NaN or inf in the step (a diverging Newton step): the sample
        # takes fn(x), the Jacobi update, which keeps the guarantees (a reset).
        flags = sync(~torch.isfinite(trial.sum(dim=(1, 2))).all(),
                     ~torch.isfinite(y.sum()) if access.markov else system.nonfinite)
        system.nonfinite = bool(flags[1])
        y, kept = system.keep_finite(y, seg, lo, ex.index[lo:], act, x=x,
                                     hook="fn" if not access.markov else
                                     "linearize" if fused is None else "newton_step")
        bad = torch.zeros_like(act)
        if flags[0] or kept is not None:
            if flags[0]:
                bad = ~torch.isfinite(trial).flatten(1).all(1) & act
            if kept is not None:
                bad = bad | (kept.any(dim=1) & act)
            trial = torch.where(bad[:, None, None], y, trial)
            ex.resets = state.stats["resets"] = ex.resets + bad.sum()
        trial[:, 0] = y[:, 0]   # exact: computed from the exact prefix
        if norm == "max":
            size = _max_difference(trial, seg)
        else:
            delta = trial - seg
            size = torch.linalg.vector_norm(delta.reshape(delta.shape[0], -1), dim=1)
        size = torch.where(act, size, torch.zeros_like(size)).to(torch.float64)
        # the residual max |fn(x) - x| (0: x is a bitwise fixed point, the sequential result)
        # and the values' scale, for the rounding floor, in one pass
        resid, scale = _max_difference(y, seg, scale=True)
        fixed = act & ~bad & (resid == 0)
        if norm == "max":
            scale = scale.to(torch.float64)
            unit = scale * torch.finfo(y.dtype).eps
            floor = Floor(half_ulp_bound(scale, y.dtype, unit), unit, torch.finfo(y.dtype).eps / 2)
        else:
            floor = rounding_floor(y, norm)
        if self.form == "any" and not self.damped and access.markov:
            # the step bounds the error of the iterate, fn(x) adds one rounding at most
            est = (size + floor.bound) / (1 - floor.slack)
            stop = act & (est <= tol) & ~bad
            held = act & ~stop & (size <= tol) & ~bad & ~fixed
            state.rule.blocked = torch.maximum(state.rule.blocked,
                                               torch.where(held, floor.bound, 0.0).amax())
        else:
            stop, est = state.rule.update(size, tol, act, floor=floor)
            # A stopping sample keeps fn(x), a value the cell produces (ReLU outputs stay
            # >= 0), not the new iterate that `est` is about: fn(x) is within about
            # |delta| + est of the solution (times the Lipschitz constant of a step, ~1 on a
            # map that accumulates small steps), so that sum is what must fit tol. A step of
            # 0 certifies only with a residual of 0 (a step below the rounding of x is none).
            est = est + size
            stop = stop & ~bad & (est <= tol) & ((size > 0) | fixed)
        # a bitwise fixed point is the sequential result (estimate 0); a step that vanished
        # while fn(x) != x takes fn(x) (the Jacobi update) instead
        stop = stop | fixed
        est = torch.where(fixed, torch.zeros_like(est), est)
        take_y = stop | (act & (size == 0) & ~fixed)
        n_y, n_act, n_cont = sync(take_y.sum(), act.sum(), (act & ~stop).sum())
        if n_act == act.numel():
            if n_y:
                torch.where(take_y[:, None, None], y, trial, out=seg)
            else:
                seg.copy_(trial)
        else:               # (trial is this step's own array: overwritten in place)
            if n_y:
                torch.where(take_y[:, None, None], y, trial, out=trial)
            torch.where(act[:, None, None], trial, seg, out=seg)
        state.estimate = torch.where(stop, est, state.estimate)
        state.residual = size.max()
        cont = act & ~stop
        state.active = cont
        ex.lo = lo + 1
        state.finished = n_cont == 0 or lo + 1 >= T

    def _elk(self, x, r, J, lo):
        """The damped step from ``x``: ``delta_lo = r_lo`` (the exact value at ``lo``), then the
        filtered means of ``delta_t = J_t delta_{t-1} + r_t + q_t`` observed as ``0 = delta_t +
        v_t`` (``q ~ N(0, I)``, ``v ~ N(0, I / lambda)``), in float64 (the covariances grow
        like the Jacobian products where the linearisation is unstable)."""
        wide = torch.float64 if r.dtype in (torch.float32, torch.float16, torch.bfloat16) \
            and r.device.type != "mps" else r.dtype
        step = kalman_step(J.to(wide), r.to(wide), self.damping)
        return x[:, lo:] + step.to(r.dtype)


def _work(ex: _NewtonState, x: torch.Tensor, lo: int) -> torch.Tensor:
    """A ``(B, T - lo, F)`` array for the residual, carved from one array of ``x``'s size kept
    for the whole solve (on a CPU a fresh array costs a page fault per 4 KB, every iteration)."""
    if ex.work is None:
        ex.work = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    B, T, F = x.shape
    return ex.work[:B * (T - lo) * F].view(B, T - lo, F)


# Values per chunk of :func:`_max_difference` on a CPU: the chunk's difference stays in cache.
DIFFERENCE_CHUNK = 1 << 18


def _max_difference(a: torch.Tensor, b: torch.Tensor, *, scale: bool = False):
    """``(B,)``: ``max |a - b|`` per sample of ``(B, n, F)`` arrays (NaN where one is), chunk by
    chunk along the positions on a CPU (the exact maximum, without a ``B n F`` temporary); with
    ``scale``, also ``max |a|`` per sample, from the same pass."""
    B, n, F = a.shape
    step = n if a.device.type != "cpu" else max(1, DIFFERENCE_CHUNK // max(1, B * F))
    if step >= n:
        diff = (a - b).abs_().amax(dim=(1, 2))
        return (diff, a.abs().amax(dim=(1, 2))) if scale else diff
    buf = a.new_empty(B, step, F)
    out = big = None
    for t0 in range(0, n, step):
        t1 = min(n, t0 + step)
        m = torch.sub(a[:, t0:t1], b[:, t0:t1], out=buf[:, :t1 - t0]).abs_().amax(dim=(1, 2))
        out = m if out is None else torch.maximum(out, m)
        if scale:
            m = torch.abs(a[:, t0:t1], out=buf[:, :t1 - t0]).amax(dim=(1, 2))
            big = m if big is None else torch.maximum(big, m)
    return (out, big) if scale else out



class Newton(_NewtonFamily):
    """DEER (Lim et al. 2023): Newton's method with the exact Jacobians ``d fn_t / d x_{t-1}``,
    one parallel linear recurrence per iteration; quadratic convergence. Stops on the size of
    the Newton step.

    Example:
        >>> u, A = torch.randn(1, 64, 4), 0.3 * torch.randn(4, 4)
        >>> def fn(h):                          # h_t = tanh(A h_{t-1} + u_t), h_{-1} = 0
        ...     prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        ...     return torch.tanh(prev @ A.T + u)
        >>> x0 = torch.zeros(1, 64, 4)                      # (batch, T, H): positions on dim -2
        >>> ref = paraprop.solve(fn, x0, method="sequential", dim=-2)
        >>> sol = paraprop.solve(fn, x0, method=paraprop.solvers.Newton(), dim=-2)
        >>> sol.method, sol.converged, sol.iterations < 64
        ('newton', True, True)
        >>> bool((sol.value - ref.value).abs().max() < 1e-5)    # float32's default tol
        True
    """

    name = "newton"

    def __init__(self):
        super().__init__()


class QuasiNewton(_NewtonFamily):
    """Quasi-DEER (Gonzalez et al. 2024): the diagonals of the Jacobians only (an elementwise
    recurrence, cheaper per iteration, linear convergence). Stops on the contraction estimate of
    its steps.

    Example:
        >>> rec = paraprop.Recurrence(torch.nn.GRUCell(2, 4), torch.randn(3, 50, 2),
        ...                           torch.zeros(3, 4))        # a GRU over 50 steps
        >>> sol = paraprop.solve(rec, torch.zeros(3, 50, 4), dim=1,
        ...                      method=paraprop.solvers.QuasiNewton())
        >>> sol.method, sol.converged, sol.stats["jacobian"]
        ('quasi_newton', True, 'diag')
    """

    name = "quasi_newton"

    def __init__(self):
        super().__init__()


class ELK(_NewtonFamily):
    """ELK (Gonzalez et al. 2024): the Newton step damped by a Kalman filter whose states are
    observed at zero with precision ``damping`` (lambda); ``damping -> 0`` is Newton.

    Arguments:
        damping: lambda ``> 0`` (default ``1e-2``).

    Example:
        >>> rec = paraprop.Recurrence(torch.nn.RNNCell(1, 8), torch.randn(2, 40, 1),
        ...                           torch.zeros(2, 8))        # an Elman RNN over 40 steps
        >>> sol = paraprop.solve(rec, torch.zeros(2, 40, 8), dim=1,
        ...                      method=paraprop.solvers.ELK(damping=1e-3))
        >>> sol.method, sol.converged, sol.stats["damping"]
        ('elk', True, 0.001)
    """

    name = "elk"
    damped = True


class QuasiELK(_NewtonFamily):
    """Quasi-ELK: ELK's filter on the diagonal Jacobians of :class:`QuasiNewton`.

    Arguments:
        damping: lambda ``> 0`` (default ``1e-2``).

    Example:
        >>> seq = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Tanh())
        >>> rec = paraprop.Recurrence(lambda u, h: seq(h + u), torch.randn(1, 30, 5),
        ...                           torch.zeros(1, 5))        # any cell, plain Jacobians
        >>> sol = paraprop.solve(rec, torch.zeros(1, 30, 5), dim=1,
        ...                      method=paraprop.solvers.QuasiELK())
        >>> sol.method, sol.converged
        ('quasi_elk', True)
    """

    name = "quasi_elk"
    damped = True


__all__ = ["ELK", "FORMS", "Newton", "QuasiELK", "QuasiNewton"]
