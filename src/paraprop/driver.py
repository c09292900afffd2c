"""The one loop of paraprop's iterative methods, and the one place a :class:`Solution` is built.

Every iterative entry point (:func:`paraprop.solve`, :func:`paraprop.linalg.solve`'s Jacobi and
BiCGStab, :func:`paraprop.scan.jacobi_recurrence`, :func:`paraprop.linalg.mlp_forward`'s Newton
iteration) states its method as an object of the :class:`Method` protocol and hands it to
:func:`run`:

- ``init()`` (optional) does the work before the first iteration, timed with the solve;
- ``step()`` runs one iteration and returns its convergence measure (the forward difference,
  the Newton step, the relative residual), or ``None``; a method raises its own
  :class:`~paraprop.NonFiniteError` / :class:`~paraprop.NotTriangularError` there, naming the
  position it found;
- ``stopped()`` says whether its stopping rule certifies the value (or the exactness bound is
  reached), before each iteration;
- ``outcome(iterations)`` runs its final check and returns an :class:`Outcome`: the value, the
  :class:`~paraprop.Result` code, the evaluations, the counters of the common stats schema
  (:data:`COUNTERS`) and the method's own stats.

:func:`run` loops (at most ``max_iters`` iterations), keeps the measures on the device until the
end (one host transfer), times the solve, builds the :class:`Solution` (:func:`build`, the only
constructor call of the library) and applies ``throw`` (:func:`~paraprop.result.ensure_converged`).
Entry points whose result needs no iteration (a direct solve, an empty batch, a composite of
other solutions) call :func:`build` directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from paraprop.result import Result, Solution, ensure_converged

__all__ = ["COUNTERS", "Method", "Outcome", "build", "history", "run"]

# the counters every Solution reports in its stats, under these names (None where a counter
# means nothing for the method, e.g. an error estimate for a residual-based linear solver)
COUNTERS = ("positions", "sequential_steps", "bound", "error_estimate", "time_s")


@dataclass
class Outcome:
    """What a method reports when it stops (see the module doc).

    Attributes:
        value: the solution, in the entry point's layout.
        result: the :class:`~paraprop.Result` code.
        evaluations: dependent calls of the map (sequential steps' worth of work).
        positions: positions (or block rows) computed, the work; ``None`` where not counted.
        sequential_steps: the longest chain of dependent evaluations.
        bound: the iterations that guarantee the exact result (``None``: no such bound).
        error_estimate: the stopping rule's estimate of ``max |value - sequential|`` when it
            stopped (``0.0`` at the bound, ``inf`` unconverged; ``None``: the method has no
            error estimate, only a residual).
        stats: the method's own counters (``sample_iterations``, ``flops``, ...).
        reason: why the value is not certified, where that is more than ``max_iters``.
        residuals: the convergence history, where the method keeps its own (MGRIT records the
            residual before the first cycle too); ``None``: the measures ``step`` returned.
    """

    value: torch.Tensor
    result: Result
    evaluations: int
    positions: int | None = None
    sequential_steps: int | None = None
    bound: int | None = None
    error_estimate: float | None = None
    stats: dict = field(default_factory=dict)
    reason: str | None = None
    residuals: torch.Tensor | None = None


@runtime_checkable
class Method(Protocol):
    """An iterative method on one problem, as :func:`run` drives it."""

    name: str

    # optional: ``init(self) -> None``, the work before the first iteration (timed with the
    # solve); :func:`run` calls it when the method has it

    def stopped(self) -> bool:
        """Whether the stopping rule certifies the current iterate (checked before each
        iteration)."""

    def step(self) -> float | torch.Tensor | None:
        """One iteration; returns its convergence measure (a float or a device scalar)."""

    def outcome(self, iterations: int) -> Outcome:
        """The final check and the result, after ``iterations`` iterations."""


def history(measures: list) -> torch.Tensor:
    """The per-iteration measures (floats or device scalars) as one float64 CPU tensor, with
    one transfer at the end instead of one per iteration."""
    if not measures:
        return torch.zeros(0, dtype=torch.float64)
    if all(isinstance(r, torch.Tensor) for r in measures):
        return torch.stack([r.reshape(()) for r in measures]).to(torch.float64).cpu()
    return torch.tensor([float(r) for r in measures], dtype=torch.float64)


def build(method: str, out: Outcome, *, iterations: int, residuals: torch.Tensor | None = None,
          time_s: float | None = None) -> Solution:
    """The :class:`Solution` of ``out``: the common counters (:data:`COUNTERS`) under their
    names, then the method's own stats."""
    stats: dict[str, Any] = {"positions": out.positions, "sequential_steps": out.sequential_steps,
             "bound": out.bound, "error_estimate": out.error_estimate, "time_s": time_s}
    for k, v in out.stats.items():
        if k in COUNTERS and v is not None and stats[k] is not None and k != "time_s":
            raise ValueError(f"stats[{k!r}] is a common counter; pass it as Outcome.{k}")
        if k not in COUNTERS or stats[k] is None:
            stats[k] = v
    if out.reason:
        stats["not_converged"] = out.reason
    return Solution(out.value, method, iterations, out.evaluations,
                    residuals=history([]) if residuals is None else residuals, stats=stats,
                    result=out.result)


def run(method: Method, *, max_iters: int, entry: str, throw: bool, tol,
        measure: str = "convergence measure", hint: str = "",
        callback: Callable[[int, float | torch.Tensor | None], None] | None = None,
        user_max_iters=None) -> Solution:
    """Drive ``method`` to its stopping rule or ``max_iters`` iterations; the
    :class:`Solution`, or :class:`~paraprop.ConvergenceError` when it did not converge and
    ``throw`` is true.

    Arguments:
        method: the :class:`Method`.
        max_iters: the iteration cap (the entry point's default already applied).
        entry: the entry point's name, for messages (``"linalg.solve"``).
        throw: raise on non-convergence.
        tol: the tolerance, for messages.
        measure: what ``step`` returns, for messages (``"relative residual"``).
        hint: advice added to the error message.
        callback: called after each iteration with ``(iteration, measure)``.
        user_max_iters: the ``max_iters`` the user passed (named in the message; default
            ``max_iters``).
    """
    measures: list = []
    iterations = 0
    start = time.perf_counter()
    init = getattr(method, "init", None)
    if init is not None:
        init()
    while iterations < max_iters and not method.stopped():
        iterations += 1
        r = method.step()
        if r is not None:
            measures.append(r)
        if callback is not None:
            callback(iterations, r)
    out = method.outcome(iterations)
    residuals = history(measures) if out.residuals is None else out.residuals
    sol = build(method.name, out, iterations=iterations, residuals=residuals,
                time_s=time.perf_counter() - start)
    return ensure_converged(sol, throw, entry=entry,
                            max_iters=max_iters if user_max_iters is None else user_max_iters,
                            tol=tol, measure=measure, hint=hint, reason=out.reason,
                            last=float(residuals[-1]) if len(residuals) else None)
