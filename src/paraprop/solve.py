"""``paraprop.solve``: feedforward computation as a nonlinear triangular system.

A computation ``s_t = f_t(s_<t)`` over ``T`` positions is the system ``x = fn(x)`` where position
``t`` of ``fn(x)`` depends only on positions ``< t`` of ``x`` (Song et al. 2021, "Accelerating
Feedforward Computation via Parallel Nonlinear Equation Solving", eq. 2). Its unique solution is
what evaluating the positions one by one produces; Jacobi and the two hybrid solvers reach the
same solution in fewer parallel steps (Algorithms 1-3, Propositions 1-2). For Markov recurrences
(position ``t`` reads position ``t - 1`` only, e.g. :class:`paraprop.Recurrence`) the Newton-type
methods solve one linear recurrence per iteration instead (DEER, quasi-DEER, ELK; see
:mod:`paraprop.solvers.newton`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypedDict

import torch

from paraprop import checks
from paraprop.checks import check_max_iters, check_tol
from paraprop.determinism import require_deterministic
from paraprop.driver import Outcome, run
from paraprop.errors import ConvergenceError, NonFiniteError, NotTriangularError
from paraprop.result import Result, Solution, ensure_converged
from paraprop.solvers import make_solver
from paraprop.solvers.base import State, System
from paraprop.solvers.verify import verify_final

__all__ = [
    "ConvergenceError",
    "NonFiniteError",
    "NotTriangularError",
    "Solution",
    "solve",
]

NORMS = ("max", "l2")


class SolveOptions(TypedDict, total=False):
    """The keyword options of :func:`solve` that an entry point built on it forwards unchanged
    (``**options: Unpack[SolveOptions]``), so that their defaults are :func:`solve`'s alone."""

    tol: float
    norm: str
    max_iters: int | None
    throw: bool
    callback: Callable[[int, torch.Tensor, float | None], None] | None


def solve(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    *,
    method="jacobi",
    dim: int | tuple[int, ...] = -1,
    tol: float = 1e-5,
    norm: str = "max",
    max_iters: int | None = None,
    throw: bool = True,
    callback: Callable[[int, torch.Tensor, float | None], None] | None = None,
) -> Solution:
    """Solve the triangular system ``x = fn(x)`` along ``dim``.

    Arguments:
        fn: maps a tensor shaped like ``x0`` to one of the same shape and dtype, autoregressive
            along ``dim``: position ``t`` of ``fn(x)`` depends only on positions ``< t`` of ``x``.
            Optionally an object with the hooks of :mod:`paraprop.solvers.protocols`:
            ``update(x, index)`` returning only the flat positions ``index`` (shape
            ``(*batch, len(index), *trailing)``; the sequential and hybrid solvers then compute
            just those positions), ``window(x, start, stop, cache)`` returning ``(values,
            cache)`` for the positions ``[start, stop)`` given that the positions ``< start``
            are final (the cached-prefix protocol of :class:`~paraprop.solvers.SlidingJacobi`
            and :class:`~paraprop.solvers.GSJacobi`), ``propose``, ``sensitivity``,
            ``growth``. Their promises (leave ``x`` unchanged, compute ``fn``'s values) are
            checked, not trusted.
        x0: the initial guess (finite values; zeros are typical). Dims before ``dim`` are
            independent samples, each stopping on its own; dims after ``dim`` are the values of
            one position. The solution does not depend on ``x0``, so no gradient flows to it.
        method: a name, with the defaults of its solver class in :mod:`paraprop.solvers`:
            ``"sequential"`` (the reference: ``T`` dependent steps), ``"jacobi"``
            (Algorithm 1), ``"jacobi_gs"`` (Algorithm 2), ``"gs_jacobi"`` (Algorithm 3),
            ``"sliding_jacobi"``, or for Markov recurrences ``"newton"`` (DEER: exact
            Jacobians), ``"quasi_newton"`` (their diagonals), ``"elk"`` (damped Newton, ELK's
            Kalman filter) and ``"quasi_elk"``; or a configured solver object such as
            ``JacobiGS(block_size=4)``, ``SlidingJacobi(window=64)`` or ``ELK(damping=1e-3)``.
            The Newton-type methods take the Jacobians ``d fn_t / d x_{t-1}`` from a
            :class:`paraprop.Recurrence` (analytic for torch RNN/GRU cells), or, for a plain
            ``fn`` assumed Markov along ``dim``, by one forward-mode product per feature.
        dim: the autoregressive dim, or consecutive dims taken together in row-major order,
            e.g. ``(-2, -1)`` for pixels in raster order.
        tol: a sample stops early only when its estimated distance to the sequential result is
            ``<= tol`` (``norm`` over the sample): the contraction estimate for the Jacobi family,
            the Newton step for Newton, each with the dtype's rounding floor added (see
            ``docs/solve.md``); ``0`` iterates to a bitwise fixed point of ``fn``. The methods
            that certify with ``fn.window`` / ``fn.update`` check the value by one evaluation of
            ``fn`` before ``converged=True``, at every ``tol`` (bitwise at ``0``; above, against
            what a value within ``tol`` can have: :mod:`paraprop.solvers.verify`).
            Independently of ``tol``, every method stops at its exactness bound (``T`` sweeps for
            Jacobi), where its value equals the sequential result, and no method takes more
            calls of ``fn`` in sequence than the sequential loop (``T``), the check included.
        norm: ``"max"`` (largest absolute change) or ``"l2"``, per sample.
        max_iters: cap on iterations; ``None`` means the method's exactness bound.
        throw: raise :class:`ConvergenceError` if ``max_iters`` ends the solve before
            convergence; with ``False`` the unconverged :class:`Solution` is returned.
        callback: called as ``callback(iteration, value, residual)`` after each iteration;
            ``value`` is the current iterate (do not modify it); ``residual`` is ``None``
            where the iteration has no forward difference (``"sequential"``).

    Returns:
        A :class:`Solution`; ``stats["error_estimate"]`` is the largest estimated error of a
        sample (``0`` where the bound or a bitwise fixed point was reached). With a
        :class:`paraprop.Recurrence` whose inputs, ``h0`` or parameters require grad, ``value``
        is differentiable (implicit differentiation at the solution, whatever the method);
        otherwise it carries no graph.

    Raises:
        ValueError / TypeError: bad arguments (the message names the argument and value).
        NotTriangularError: a position changed after all positions it may depend on were final,
            or ``fn(x)`` differs from a value certified from final inputs (the message names the
            other common cause: a module in train mode with dropout).
        ProtocolError: a hook broke its promise (modified ``x``, disagrees with ``fn``, returned
            the wrong kind of value); the message names the hook.
        StochasticModelError: ``fn`` is a module in train mode with stochastic layers.
        NonFiniteError: ``fn`` produced NaN or inf from final positions (iteration, sample and
            position named); one computed from iterates that are not final keeps the old value.
        ConvergenceError: not converged and ``throw=True``: ``max_iters`` ended it, or the final
            check did not certify the value (at ``tol=0`` ``fn(x)`` differs from it by rounding;
            at ``tol > 0`` by more than a value within ``tol`` can, where it was frozen on an
            estimate); the message says which.

    Example:
        >>> W = torch.randn(8, 8).tril(-1) * 0.3
        >>> fn = lambda x: torch.tanh(x @ W.T + 1.0)
        >>> sol = paraprop.solve(fn, torch.zeros(4, 8), method="jacobi", tol=0)
        >>> ref = paraprop.solve(fn, torch.zeros(4, 8), method="sequential")
        >>> bool((sol.value - ref.value).abs().max() < 1e-6), sol.iterations <= 8
        (True, True)
    """
    dims = _validate(fn, x0, dim, tol, norm, max_iters, callback)
    solver = make_solver(method)
    system = System(fn, x0.shape, x0.dtype, dims, device=x0.device)
    system.initial = system.canon(x0.detach())
    with torch.no_grad():
        run_ = _Solve(solver, system, tol, norm, max_iters)
        cap = run_.bound if max_iters is None else max_iters
        report = None if callback is None else \
            lambda k, r: callback(k, system.user(run_.state.x), None if r is None else float(r))
        sol = run(run_, max_iters=cap, entry="solve", throw=False, tol=tol, callback=report)
    attach = getattr(fn, "attach", None)
    if getattr(fn, "markov", False) and callable(attach):
        sol = dataclasses.replace(sol, value=attach(sol.value))
    return ensure_converged(sol, throw, entry="solve", max_iters=max_iters, tol=tol,
                            last=float(sol.residuals[-1]) if len(sol.residuals) else None,
                            measure="convergence measure", reason=sol.stats.get("not_converged"))


class _Solve:
    """One :func:`solve` as a :class:`paraprop.driver.Method`: the solver object's ``step``
    on the system's state, and its final check (:mod:`paraprop.solvers.verify`) at the end."""

    def __init__(self, solver, system: System, tol: float, norm: str, max_iters: int | None):
        initial = system.initial
        assert initial is not None   # set by solve() before the driver runs
        device = initial.device
        self.solver, self.system, self.tol, self.norm = solver, system, tol, norm
        self.max_iters = max_iters
        self.name = solver.name
        self.state = State(
            x=initial.clone(),
            active=torch.ones(system.B, dtype=torch.bool, device=device),
            sample_iterations=torch.zeros(system.B, dtype=torch.long, device=device),
        )
        self.bound = solver.bound(system)
        self.iterations = 0

    def init(self) -> None:
        self.solver.init(self.system, self.state)

    def stopped(self) -> bool:
        return bool(self.state.finished)

    def step(self):
        self.iterations += 1
        self.system.iteration = self.iterations
        self.solver.step(self.system, self.state, self.tol, self.norm)
        return self.state.residual

    def outcome(self, iterations: int) -> Outcome:
        state, system, solver, tol = self.state, self.system, self.solver, self.tol
        converged = bool(state.finished)
        reason, checked = None, "none"
        result = Result.successful if converged else Result.max_iters_reached
        if converged and solver.name != "sequential":
            if state.check is not None:   # the budget's last call checked it (final_step)
                checked, reason = state.check, state.reason
            elif state.verified:          # its certificate comes from fn's own values
                checked = "iterations"
            else:                         # one evaluation of fn at the value (solvers.verify)
                reason = verify_final(system, state, tol, self.norm)
                checked = "evaluation" if reason is None else "failed"
            converged = reason is None
            if not converged:
                result = Result.not_certified
        floor = float(state.rule.blocked)
        if not converged and reason is None and floor > 0:
            reason = (f"max_iters={self.max_iters} ended it before a certificate, and the error "
                      f"estimate could not certify tol={tol} earlier in {system.dtype}: the "
                      f"steps or the estimate were at the rounding floor of the values "
                      f"({floor:.3g} at their scale), so only a bitwise fixed point or the "
                      "exactness bound certifies it; pass max_iters=None (the bound) or a "
                      "larger tol")
        own: dict[str, Any] = {
            k: (v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v)
            for k, v in state.stats.items()}
        steps = own.pop("sequential_steps", system.evaluations)
        return Outcome(
            system.user(state.x), result, evaluations=system.evaluations,
            positions=system.positions, sequential_steps=steps, bound=self.bound,
            error_estimate=float(state.estimate.max()) if converged else float("inf"),
            stats={"sample_iterations": state.sample_iterations.reshape(system.batch_shape).cpu(),
                   "T": system.T, "verification": checked, "rounding_floor": floor,
                   "kept_non_finite": system.kept, **own},
            reason=reason)


def _validate(fn, x0, dim, tol, norm, max_iters, callback) -> tuple[int, int]:
    """Check every argument once; return the normalised (first, last) autoregressive dims."""
    checks.callable_arg("fn", fn)
    require_deterministic(fn, argument="fn", entry="solve")
    if not isinstance(x0, torch.Tensor):
        raise TypeError(f"x0 must be a torch.Tensor, got {type(x0).__name__}")
    if not x0.is_floating_point():
        raise TypeError(f"x0 must have a floating-point dtype, got {x0.dtype}")
    checks.one_of("norm", norm, NORMS)
    check_tol(tol)
    check_max_iters(max_iters)
    checks.callable_arg("callback", callback, allow_none=True)
    dims = normalise_dims(dim, x0.dim())
    if x0.numel() == 0:
        raise ValueError(f"x0 must not be empty, got shape {tuple(x0.shape)}")
    # a finite sum means finite entries (NaN and inf propagate); the full check (a boolean
    # array of x0's size) only where the sum is not, e.g. where it overflows
    if not bool(torch.isfinite(x0.sum())) and not bool(torch.isfinite(x0).all()):
        raise ValueError("x0 must be finite (NaN or inf would leak through masked weights)")
    return dims


def normalise_dims(dim, ndim: int) -> tuple[int, int]:
    raw = dim if isinstance(dim, tuple) else (dim,)
    if not raw or not all(checks.is_int(d) for d in raw):
        raise TypeError(f"dim must be an int or a non-empty tuple of ints, got {dim!r}")
    out = []
    for d in raw:
        if not -ndim <= d < ndim:
            raise ValueError(f"dim={dim!r} is out of range for x0 with {ndim} dims")
        out.append(d % ndim)
    if any(b != a + 1 for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"dim={dim!r} must name consecutive dims in increasing order")
    return out[0], out[-1]
