"""Newton-type solvers for Markov recurrences ``x_t = f_t(x_{t-1})`` (DEER, quasi-DEER, ELK).

Linearising ``fn`` at the iterate ``x`` turns the nonlinear system into a *linear* recurrence for
the step ``delta`` (Lim et al. 2023, "Parallelizing non-linear sequential models over the
sequence length", DEER):

    delta_t = J_t delta_{t-1} + r_t,     r = fn(x) - x,     J_t = d fn_t / d x_{t-1},

solved in parallel by :func:`paraprop.scan.linear_recurrence`; ``x + delta`` is the Newton
iterate. ``"newton"`` uses the exact Jacobians (dense, or the factored form of the analytic GRU
and RNN cells), ``"quasi_newton"`` only their diagonals (quasi-DEER, Gonzalez et al. 2024: a
diagonal recurrence, cheaper per iteration, linear instead of quadratic convergence), and
``"elk"`` damps the exact step Levenberg-Marquardt style (ELK, Gonzalez et al. 2024): the step
minimises ``sum_t |delta_t - J_t delta_{t-1} - r_t|^2 + lambda |delta_t|^2``, a symmetric positive
definite block tridiagonal system solved by cyclic reduction in ``ceil(log2 T)`` batched levels
(:func:`paraprop.linalg.tridiagonal_solve`; the same minimiser ELK computes with a parallel
Kalman smoother). The step is always taken, as in ELK; ``lambda`` adapts per sample, shrinking
(x 1/3) while the merit ``|fn(x) - x|^2`` falls and growing (x 4) when it rises, so that steps
near the solution become Newton steps (quadratic convergence) and steps that overshoot get
damped. (A classic accept/reject rule does not fit here: fixing the exact prefix changes the
merit of every trial, so it would reject good steps.)

Guarantees shared by the three (and by Jacobi): after iteration ``k`` the positions ``< k`` hold
the sequential result, because position ``k - 1`` is set to ``fn(x)_{k-1}``, computed from an
exact prefix. Those positions are frozen and the work shrinks to the suffix, so at most ``T``
iterations are needed. A sample stops when its residual ``|fn(x) - x|`` is ``<= tol`` and keeps
``fn(x)``. A step that overflows (Newton can diverge) is replaced by the Jacobi update for that
sample and counted in ``stats["resets"]``; it never reaches the result.
"""

from __future__ import annotations

import torch

from paraprop.errors import NonFiniteError, NotTriangularError
from paraprop.scan import linear_recurrence
from paraprop.solvers.base import State, System, verify_fixed_point

FORMS = {"newton": "any", "quasi_newton": "diag", "elk": "dense"}
SHRINK, GROW = 1 / 3, 4.0       # Levenberg-Marquardt damping after a falling / rising merit
LAM_MIN, LAM_MAX = 1e-12, 1e12


class Newton:
    """One class for ``"newton"``, ``"quasi_newton"`` and ``"elk"`` (see the module doc)."""

    def __init__(self, name: str, damping: float | None = None):
        self.name = name
        self.form = FORMS[name]
        self.damping = 1.0 if damping is None else float(damping)

    def bound(self, system: System) -> int:
        return system.T

    def init(self, system: System, state: State) -> None:
        self.access = _access(system)
        ex = state.extra
        ex["lo"] = 0                # positions < lo are exact for every active sample
        ex["stats"] = {"resets": 0, "jacobian": self.form}
        if self.name == "elk":
            ex["lam"] = torch.full((system.B,), self.damping, dtype=torch.float64,
                                   device=state.x.device)
            ex["stats"].update(increases=0, damping=self.damping)

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        ex = state.extra
        lo, T, x, act = ex["lo"], system.T, state.x, state.active
        y, J = self.access.linearize(x, lo, self.form, state, tol)
        if not self.access.markov:
            ex["stats"]["jvps"] = self.access.jvps
        try:
            system.check_finite(y, torch.arange(lo, T, device=y.device))
        except NonFiniteError as e:
            if lo == 0 and system.iteration == 1:
                raise
            raise NonFiniteError(f"{e}; the iterate came from a {self.name} step, which can "
                                 "diverge: try method='elk' (damped) or 'jacobi'") from None
        r = y - x[:, lo:]
        if norm == "max":
            res = r.abs().amax(dim=(1, 2))
        else:
            res = torch.linalg.vector_norm(r.reshape(r.shape[0], -1), dim=1)
        res = torch.where(act, res, torch.zeros_like(res))
        done = act & (res <= tol)
        cont = act & ~done
        state.sample_iterations += act.long()
        state.residual = float(res.max())
        seg = x[:, lo:]
        if bool(cont.any()):
            if self.name == "elk":
                trial = self._elk(ex, x, r, J, lo)
            else:
                trial = linear_recurrence(J, r).add_(seg)
            bad = _non_finite_rows(trial) & cont
            if bool(bad.any()):     # a diverging step: the Jacobi update keeps the guarantees
                ex["stats"]["resets"] += int(bad.sum())
                trial = torch.where(bad[:, None, None], y, trial)
            trial[:, 0] = y[:, 0]   # exact: computed from the exact prefix
            if bool(cont.all()):
                seg.copy_(trial)
            else:
                seg.copy_(torch.where(cont[:, None, None], trial,
                                      torch.where(done[:, None, None], y, seg)))
        elif bool(done.any()):
            seg.copy_(torch.where(done[:, None, None], y, seg))
        state.active = cont
        ex["lo"] = lo + 1
        state.finished = not bool(cont.any()) or lo + 1 >= T
        if lo + 1 >= T and bool(cont.any()) and not self.access.markov:
            verify_fixed_point(system, state, 0, system.evaluate(state.x), tol)

    def _elk(self, ex, x, r, J, lo):
        """The damped step from the current iterate. ``lambda`` adapts per sample: it shrinks
        when the merit ``sum |fn(x) - x|^2`` (over the positions after the first free one) fell
        since the last iteration, and grows when it rose; the step is always taken (as in ELK),
        the exact prefix guarantees termination whatever the damping."""
        # The merit skips position lo: its residual measures the jump made by fixing the exact
        # value at lo - 1 (the same fix would make every comparison including it unfair).
        sq = (r * r).sum(dim=2)                                  # (B, n) per position
        prev = ex.get("prev_sq")
        lam = ex["lam"]
        if prev is not None:                                     # lo advanced by exactly one
            rose = sq[:, 1:].sum(dim=1) > prev[:, 2:].sum(dim=1)
            lam = torch.where(rose, lam * GROW, lam * SHRINK).clamp_(LAM_MIN, LAM_MAX)
            ex["stats"]["increases"] += int(rose.sum())
        ex["prev_sq"], ex["lam"] = sq, lam
        return x[:, lo:] + _lm_step(J, r, lam.to(r.dtype))


def _non_finite_rows(t: torch.Tensor) -> torch.Tensor:
    """``(B,)``: samples of ``t`` ``(B, n, F)`` holding NaN or inf (one reduction when none do)."""
    sums = t.sum(dim=(1, 2))
    if bool(torch.isfinite(sums).all()):
        return torch.zeros_like(sums, dtype=torch.bool)
    return ~torch.isfinite(t).flatten(1).all(1)


def _lm_step(J: torch.Tensor, r: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``argmin_delta sum_t |delta_t - J_t delta_{t-1} - r_t|^2 + lam |delta_t|^2`` with
    ``delta_{-1} = 0``: the normal equations are block tridiagonal,
    ``D_t = (1 + lam) I + J_{t+1}^T J_{t+1}``, ``L_t = -J_t``, ``U_t = -J_{t+1}^T``,
    ``rhs_t = r_t - J_{t+1}^T r_{t+1}``."""
    from paraprop.linalg.tridiagonal import tridiagonal_solve  # linalg imports paraprop.solve

    B, n, H = r.shape
    eye = torch.eye(H, dtype=r.dtype, device=r.device)
    JT = J.transpose(-1, -2)
    D = (1 + lam)[:, None, None, None] * eye
    D = D.expand(B, n, H, H).clone()
    rhs = r.clone()
    if n > 1:
        D[:, :-1] += JT[:, 1:] @ J[:, 1:]
        rhs[:, :-1] -= (JT[:, 1:] @ r[:, 1:, :, None]).squeeze(-1)
    L = -J
    U = torch.zeros_like(J)
    U[:, :-1] = -JT[:, 1:]
    return tridiagonal_solve(D, L, U, rhs)


class _MarkovAccess:
    """``fn`` is a :class:`paraprop.Recurrence` (or follows its ``linearize`` protocol):
    values and Jacobians of the suffix only."""

    markov = True

    def __init__(self, system: System):
        self.system = system

    def linearize(self, x, lo, form, state, tol):
        y, J = self.system.fn.linearize(x, lo, form)
        self.system.evaluations += 1
        self.system.positions += x.shape[1] - lo
        return y, J


class _FullAccess:
    """Any triangular ``fn``: full evaluations, and the sub-diagonal Jacobian blocks by one
    forward-mode product per feature with the tangent ``e_j`` at every position (exact for a
    Markov ``fn``; for other triangular maps a row-sum approximation that keeps the exactness
    bound, since the residual is always the true one)."""

    markov = False

    def __init__(self, system: System):
        self.system = system
        self.jvps = 0   # forward-mode products for the Jacobians, each about one evaluation

    def linearize(self, x, lo, form, state, tol):
        system = self.system
        y = system.evaluate(x)
        if lo > 0:   # the exact prefix must not move: otherwise fn is not triangular
            moved = ((y[:, :lo] - x[:, :lo]).abs().amax(dim=2) > tol) & state.active[:, None]
            if bool(moved.any()):
                b, t = (int(i) for i in moved.nonzero()[0])
                raise NotTriangularError(
                    f"fn is not autoregressive along dim: position "
                    f"{system.unravel_position(t)} of sample {system.unravel_sample(b)} changed "
                    f"at iteration {system.iteration} although every position it may depend on "
                    "was already final; some position depends on itself or on a later one")
        return y[:, lo:], self._jacobian(x, lo, form)

    def _jacobian(self, x, lo, form):
        system = self.system
        Fn = system.F

        def f(z):
            return system.canon(system.fn(system.user(z)))

        cols = []
        for j in range(Fn):
            v = torch.zeros_like(x)
            v[..., j] = 1
            with torch.enable_grad():
                _, out = torch.func.jvp(f, (x,), (v,))
            cols.append(out[:, lo:])
        self.jvps += Fn
        if form == "diag":
            return torch.stack([c[..., j] for j, c in enumerate(cols)], -1)
        return torch.stack(cols, -1)   # [b, t, i, j] = d fn_{t,i} / d x_{t-1,j}


def _access(system: System):
    fn = system.fn
    if getattr(fn, "markov", False) and callable(getattr(fn, "linearize", None)):
        want = (system.B, system.T, system.F)
        got = (getattr(fn, "B", None), getattr(fn, "T", None), getattr(fn, "H", None))
        if got != want:
            raise ValueError(
                f"the Recurrence has (batch, T, H) = {got} but x0 and dim give {want}; pass x0 "
                "of shape rec.shape and dim=-2")
        return _MarkovAccess(system)
    return _FullAccess(system)


__all__ = ["FORMS", "Newton"]
