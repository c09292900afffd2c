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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from paraprop.errors import ConvergenceError, NonFiniteError, NotTriangularError
from paraprop.solvers import METHODS, make_solver
from paraprop.solvers.base import State, System

__all__ = [
    "ConvergenceError",
    "NonFiniteError",
    "NotTriangularError",
    "Solution",
    "solve",
]

NORMS = ("max", "l2")


@dataclass(frozen=True)
class Solution:
    """The result of :func:`solve`.

    Attributes:
        value: the solution, shaped like ``x0``.
        method: the method's name.
        iterations: parallel sweeps taken (the most any sample took).
        evaluations: calls of ``fn`` (or of ``fn.update``); each is one sequential step.
        converged: every sample reached ``tol`` or the exactness bound of its method.
        residuals: the forward difference ``||x_k - x_{k-1}||`` after each iteration (max over
            the samples still iterating), a 1-D float64 tensor; empty for ``"sequential"``.
        stats: hardware-independent counters and the wall time: ``positions`` (positions
            computed, the work), ``sequential_steps``, ``bound`` (iterations that guarantee the
            exact result), ``sample_iterations`` (per sample, shaped like the batch dims),
            ``T``, ``block_size``, ``time_s``; the Newton-type methods add ``jacobian`` (the
            form used), ``resets`` (diverging steps replaced by the Jacobi update), ``damping``
            for the ELK methods, and with a plain ``fn`` also ``jvps``.
    """

    value: torch.Tensor
    method: str
    iterations: int
    evaluations: int
    converged: bool
    residuals: torch.Tensor
    stats: dict = field(default_factory=dict)


def solve(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    *,
    method: str = "jacobi",
    dim: int | tuple[int, ...] = -1,
    tol: float = 1e-5,
    norm: str = "max",
    max_iters: int | None = None,
    block_size: int | None = None,
    damping: float | None = None,
    throw: bool = True,
    callback: Callable[[int, torch.Tensor, float], None] | None = None,
) -> Solution:
    """Solve the triangular system ``x = fn(x)`` along ``dim``.

    Arguments:
        fn: maps a tensor shaped like ``x0`` to one of the same shape and dtype, autoregressive
            along ``dim``: position ``t`` of ``fn(x)`` depends only on positions ``< t`` of ``x``.
            Optionally an object with ``update(x, index)`` returning only the flat positions
            ``index`` (shape ``(*batch, len(index), *trailing)``); the sequential and hybrid
            solvers then compute just those positions.
        x0: the initial guess (finite values; zeros are typical). Dims before ``dim`` are
            independent samples, each stopping on its own; dims after ``dim`` are the values of
            one position.
        method: ``"sequential"`` (the reference: ``T`` dependent steps), ``"jacobi"``
            (Algorithm 1), ``"jacobi_gs"`` (Algorithm 2), ``"gs_jacobi"`` (Algorithm 3), or for
            Markov recurrences ``"newton"`` (DEER: exact Jacobians), ``"quasi_newton"`` (their
            diagonals), ``"elk"`` (damped Newton, ELK's Kalman filter) and ``"quasi_elk"`` (the
            same on the diagonals). The Newton-type
            methods take the Jacobians ``d fn_t / d x_{t-1}`` from a
            :class:`paraprop.Recurrence` (analytic for torch RNN/GRU cells), or, for a plain
            ``fn`` assumed Markov along ``dim``, by one forward-mode product per feature.
            They stop a sample when its residual ``|fn(x) - x|`` is ``<= tol`` and return
            ``fn(x)`` for it.
        dim: the autoregressive dim, or consecutive dims taken together in row-major order,
            e.g. ``(-2, -1)`` for pixels in raster order.
        tol: a sample stops when its forward difference is ``<= tol``; ``0`` iterates to a
            bitwise fixed point. Independently of ``tol``, every method stops at its exactness
            bound (``T`` sweeps for Jacobi), where its value equals the sequential result.
        norm: ``"max"`` (largest absolute change) or ``"l2"``, per sample.
        max_iters: cap on iterations; ``None`` means the method's exactness bound.
        block_size: block length for ``"jacobi_gs"`` and ``"gs_jacobi"`` (required there).
        damping: ``"elk"`` and ``"quasi_elk"`` only: ELK's ``lambda > 0`` (default ``1e-2``):
            the inverse variance with which the filter holds each step at zero; ``lambda -> 0``
            is Newton.
        throw: raise :class:`ConvergenceError` if ``max_iters`` ends the solve before
            convergence; with ``False`` the unconverged :class:`Solution` is returned.
        callback: called as ``callback(iteration, value, residual)`` after each iteration;
            ``value`` is the current iterate (do not modify it).

    Returns:
        A :class:`Solution`. With a :class:`paraprop.Recurrence` whose inputs, ``h0`` or
        parameters require grad, ``value`` is differentiable (implicit differentiation at the
        solution, whatever the method); otherwise it carries no graph.

    Raises:
        ValueError / TypeError: bad arguments (the message names the argument and value).
        NotTriangularError: a position changed after all positions it may depend on were final.
        NonFiniteError: ``fn`` produced NaN or inf (iteration, sample and position named).
        ConvergenceError: not converged within ``max_iters`` and ``throw=True``.

    Example:
        >>> W = torch.randn(8, 8).tril(-1) * 0.3
        >>> fn = lambda x: torch.tanh(x @ W.T + 1.0)
        >>> sol = paraprop.solve(fn, torch.zeros(4, 8), method="jacobi", tol=0)
        >>> ref = paraprop.solve(fn, torch.zeros(4, 8), method="sequential")
        >>> torch.equal(sol.value, ref.value), sol.iterations <= 8
        (True, True)
    """
    dims = _validate(fn, x0, method, dim, tol, norm, max_iters, block_size, callback)
    if damping is not None:
        if method not in ("elk", "quasi_elk"):
            raise ValueError(f"damping is only used by method='elk' or 'quasi_elk', not "
                             f"method={method!r}")
        if isinstance(damping, bool) or not isinstance(damping, int | float) or not damping > 0:
            raise ValueError(f"damping must be a number > 0, got {damping!r}")
    solver = make_solver(method, block_size, damping)
    system = System(fn, x0.shape, x0.dtype, dims)
    device = x0.device
    state = State(
        x=system.canon(x0).clone(),
        active=torch.ones(system.B, dtype=torch.bool, device=device),
        sample_iterations=torch.zeros(system.B, dtype=torch.long, device=device),
    )
    bound = solver.bound(system)
    cap = bound if max_iters is None else max_iters
    residuals: list[float] = []
    iterations = 0
    start = time.perf_counter()
    with torch.no_grad():
        solver.init(system, state)
        while not state.finished and iterations < cap:
            iterations += 1
            system.iteration = iterations
            solver.step(system, state, tol, norm)
            if state.residual is not None:
                residuals.append(state.residual)
            if callback is not None:
                callback(iterations, system.user(state.x), state.residual)
    elapsed = time.perf_counter() - start

    sol = Solution(
        value=system.user(state.x),
        method=solver.name,
        iterations=iterations,
        evaluations=system.evaluations,
        converged=state.finished,
        residuals=torch.tensor(residuals, dtype=torch.float64),
        stats={
            "positions": system.positions,
            "sequential_steps": system.evaluations,
            "bound": bound,
            "sample_iterations": state.sample_iterations.reshape(system.batch_shape).cpu(),
            "T": system.T,
            "block_size": block_size,
            "time_s": elapsed,
            **state.extra.get("stats", {}),
        },
    )
    if getattr(fn, "markov", False) and callable(getattr(fn, "attach", None)):
        sol = dataclasses.replace(sol, value=fn.attach(sol.value))
    if not sol.converged and throw:
        raise ConvergenceError(
            f"method={method!r} did not converge within max_iters={max_iters} iterations "
            f"(last forward difference {residuals[-1] if residuals else float('nan'):.3g} > "
            f"tol={tol}); pass throw=False to "
            "inspect the unconverged Solution",
            solution=sol,
        )
    return sol


def _validate(fn, x0, method, dim, tol, norm, max_iters, block_size, callback) -> tuple[int, int]:
    """Check every argument once; return the normalised (first, last) autoregressive dims."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(x0, torch.Tensor):
        raise TypeError(f"x0 must be a torch.Tensor, got {type(x0).__name__}")
    if not x0.is_floating_point():
        raise TypeError(f"x0 must have a floating-point dtype, got {x0.dtype}")
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"unknown method={method!r}; choose one of {', '.join(METHODS)}")
    if norm not in NORMS:
        raise ValueError(f"unknown norm={norm!r}; choose one of {', '.join(NORMS)}")
    if isinstance(tol, bool) or not isinstance(tol, int | float) or not tol >= 0:
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    if max_iters is not None and (
        isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 1
    ):
        raise ValueError(f"max_iters must be a positive int or None, got {max_iters!r}")
    if method in ("jacobi_gs", "gs_jacobi"):
        if block_size is None:
            raise ValueError(f"block_size is required for method={method!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    elif block_size is not None:
        raise ValueError(f"block_size is only used by the hybrid methods, not method={method!r}")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable, got {type(callback).__name__}")
    dims = _normalise_dims(dim, x0.dim())
    if x0.numel() == 0:
        raise ValueError(f"x0 must not be empty, got shape {tuple(x0.shape)}")
    if not bool(torch.isfinite(x0).all()):
        raise ValueError("x0 must be finite (NaN or inf would leak through masked weights)")
    return dims


def _normalise_dims(dim, ndim: int) -> tuple[int, int]:
    raw = dim if isinstance(dim, tuple) else (dim,)
    if not raw or not all(isinstance(d, int) and not isinstance(d, bool) for d in raw):
        raise TypeError(f"dim must be an int or a non-empty tuple of ints, got {dim!r}")
    out = []
    for d in raw:
        if not -ndim <= d < ndim:
            raise ValueError(f"dim={dim!r} is out of range for x0 with {ndim} dims")
        out.append(d % ndim)
    if any(b != a + 1 for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"dim={dim!r} must name consecutive dims in increasing order")
    return out[0], out[-1]
