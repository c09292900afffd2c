"""The one result type of every iterative method in paraprop, and the one way to report failure.

Both cores return a :class:`Solution`: the nonlinear one (:func:`paraprop.solve` and the
adapters built on it: sampling, flows, networks, multigrid) and the linear one
(:func:`paraprop.linalg.solve`, :func:`paraprop.scan.jacobi_recurrence`). Functions that return
a value together with how it was obtained return ``(value, Solution)``. :func:`ensure_converged`
is the single place that turns an unconverged result into :class:`~paraprop.ConvergenceError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paraprop.errors import ConvergenceError

__all__ = ["Solution", "ensure_converged"]


@dataclass(frozen=True)
class Solution:
    """The result of an iterative solve.

    Attributes:
        value: the solution (for :func:`paraprop.solve`, shaped like ``x0``).
        method: the method's name.
        iterations: parallel sweeps (or cycles) taken: the most any sample took.
        evaluations: calls of ``fn`` (or of ``fn.update`` / ``fn.window``); each is one
            sequential step.
        converged: ``True`` only when the value is within the method's stated bound of the
            sequential result: the error estimate of its stopping rule is ``<= tol``, or the
            method reached its exactness bound. A run that was not checked (a fixed number of
            cycles, ``tol=None``) reports ``False`` and says so in ``stats["checked"]``.
        residuals: the convergence measure after each iteration (max over the samples still
            iterating), a 1-D float64 tensor: the forward difference ``||x_k - x_{k-1}||`` for
            the Jacobi family, the Newton step for the Newton family; empty for
            ``"sequential"``.
        stats: hardware-independent counters and the wall time (``time_s``); each entry point
            documents its own keys. Common ones: ``positions`` (positions computed, the work),
            ``sequential_steps``, ``bound`` (iterations that guarantee the exact result),
            ``sample_iterations``, ``error_estimate`` (the stopping rule's estimate of
            ``max |value - sequential|`` when it stopped; ``0.0`` at the exactness bound).
    """

    value: torch.Tensor
    method: str
    iterations: int
    evaluations: int
    converged: bool
    residuals: torch.Tensor
    stats: dict = field(default_factory=dict)


def ensure_converged(solution: Solution, throw: bool, *, entry: str, max_iters,
                     tol, measure: str = "error estimate", last: float | None = None,
                     hint: str = "", reason: str | None = None) -> Solution:
    """Return ``solution``, or raise :class:`ConvergenceError` if it did not converge and
    ``throw`` is true.

    Arguments:
        solution: the result to check.
        throw: raise on non-convergence (``False``: return the unconverged result).
        entry: the entry point's name for the message, e.g. ``"solve"``.
        max_iters: the cap that ended the run (named in the message).
        tol: the tolerance that was not reached.
        measure: what was compared with ``tol`` (e.g. ``"error estimate"``).
        last: the last value of that measure, if known.
        hint: an extra sentence of advice.
        reason: why the result is not certified, where that is not ``max_iters`` (e.g. a
            ``tol=0`` value that differs from ``fn(x)`` by rounding); it replaces the
            "within max_iters" wording.
    """
    if solution.converged or not throw:
        return solution
    if reason:
        raise ConvergenceError(
            f"{entry}: method={solution.method!r} did not converge: {reason}; "
            f"{hint + '; ' if hint else ''}pass throw=False to inspect the unconverged Solution",
            solution=solution)
    last_txt = "" if last is None else f" (last {measure} {last:.3g} > tol={tol})"
    raise ConvergenceError(
        f"{entry}: method={solution.method!r} did not converge within max_iters={max_iters} "
        f"iterations{last_txt}; {hint + '; ' if hint else ''}pass throw=False to inspect the "
        "unconverged Solution",
        solution=solution,
    )
