"""The one result type of every iterative method in paraprop, and the one way to report failure.

Both cores return a :class:`Solution`: the nonlinear one (:func:`paraprop.solve` and the
adapters built on it: sampling, flows, networks, multigrid) and the linear one
(:func:`paraprop.linalg.solve`, :func:`paraprop.scan.jacobi_recurrence`). Functions that return
a value together with how it was obtained return ``(value, Solution)``. :func:`ensure_converged`
is the single place that turns an unconverged result into :class:`~paraprop.ConvergenceError`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from paraprop.errors import ConvergenceError

__all__ = ["Result", "Solution", "ensure_converged"]


class Result(enum.Enum):
    """Why an iterative method stopped: the result code of every :class:`Solution`
    (``solution.result``), with its message as the value. ``Solution.converged`` is
    ``result is Result.successful``; the other codes say why the value is not certified.
    (Failures that no value survives raise instead, whatever ``throw`` says:
    :class:`~paraprop.NonFiniteError`, :class:`~paraprop.NotTriangularError`,
    :class:`~paraprop.StochasticModelError`, :class:`~paraprop.ProtocolError`.)

    Example:
        >>> W = torch.randn(6, 6).tril(-1)
        >>> fn = lambda x: torch.tanh(x @ W.T + 1)
        >>> paraprop.solve(fn, torch.zeros(6), method="jacobi").result
        <Result.successful: "within the method's stated bound of the sequential result">
        >>> sol = paraprop.solve(fn, torch.zeros(6), method="jacobi", max_iters=2, throw=False)
        >>> sol.result is paraprop.Result.max_iters_reached, sol.converged
        (True, False)
    """

    successful = "within the method's stated bound of the sequential result"
    max_iters_reached = "max_iters ended the run before the stopping rule certified the value"
    not_certified = ("the stopping rule or the final check could not certify the value within "
                     "tol (a value at the rounding floor of its dtype, a tol=0 value that is not "
                     "bitwise the sequential one, or a final check that failed)")
    unchecked = ("a fixed number of iterations ran and nothing checked the value (tol=None, "
                 "or a cycle count below the exactness bound)")


@dataclass(frozen=True, init=False)
class Solution:
    """The result of an iterative solve.

    Attributes:
        value: the solution (for :func:`paraprop.solve`, shaped like ``x0``).
        method: the method's name.
        iterations: parallel sweeps (or cycles) taken: the most any sample took.
        evaluations: calls of ``fn`` (or of ``fn.update`` / ``fn.window``); each is one
            sequential step.
        result: the :class:`Result` code: :attr:`Result.successful` only when the value is
            within the method's stated bound of the sequential result (the error estimate of
            its stopping rule is ``<= tol``, or the method reached its exactness bound);
            otherwise why not (``max_iters_reached``, ``not_certified``, ``unchecked``).
        residuals: the convergence measure after each iteration (max over the samples still
            iterating), a 1-D float64 tensor: the forward difference ``||x_k - x_{k-1}||`` for
            the Jacobi family, the Newton step for the Newton family; empty for
            ``"sequential"``.
        stats: hardware-independent counters and the wall time (``time_s``); each entry point
            documents its own keys. Common ones: ``positions`` (positions computed, the work),
            ``sequential_steps``, ``bound`` (iterations that guarantee the exact result),
            ``sample_iterations``, ``error_estimate`` (the stopping rule's estimate of
            ``max |value - sequential|`` when it stopped; ``0.0`` at the exactness bound),
            ``not_converged`` (the reason, where the entry point knows more than the code).

    ``converged`` (``result is Result.successful``) and ``message`` derive from ``result``.
    The constructor takes ``result``, or for the entry points not yet ported to codes the
    boolean ``converged`` (``False`` reads as ``unchecked`` when ``stats["checked"]`` is
    ``False``, else ``max_iters_reached``); both at once must agree.

    Example:
        >>> W = torch.randn(6, 6).tril(-1)
        >>> sol = paraprop.solve(lambda x: torch.tanh(x @ W.T + 1), torch.zeros(6),
        ...                      method="jacobi", tol=0)
        >>> sol.converged, sol.method, sol.iterations <= 6, sol.value.shape
        (True, 'jacobi', True, torch.Size([6]))
        >>> sol.message
        "within the method's stated bound of the sequential result"
    """

    value: torch.Tensor
    method: str
    iterations: int
    evaluations: int
    residuals: torch.Tensor
    stats: dict
    result: Result

    def __init__(self, value: torch.Tensor, method: str, iterations: int, evaluations: int,
                 converged: bool | None = None, residuals: torch.Tensor | None = None,
                 stats: dict | None = None, *, result: Result | None = None):
        stats = {} if stats is None else stats
        if result is None:
            if converged is None:
                raise TypeError("Solution needs result= (a paraprop.Result) or converged=")
            result = (Result.successful if converged else Result.unchecked
                      if stats.get("checked") is False else Result.max_iters_reached)
        elif not isinstance(result, Result):
            raise TypeError(f"result must be a paraprop.Result, got {result!r}")
        elif converged is not None and bool(converged) != (result is Result.successful):
            raise ValueError(f"converged={converged} contradicts result={result.name}")
        if residuals is None:
            residuals = torch.zeros(0, dtype=torch.float64)
        for name, v in (("value", value), ("method", method), ("iterations", iterations),
                        ("evaluations", evaluations), ("residuals", residuals),
                        ("stats", stats), ("result", result)):
            object.__setattr__(self, name, v)

    @property
    def converged(self) -> bool:
        """``True`` only when the value is within the method's stated bound of the sequential
        result (``result is Result.successful``)."""
        return self.result is Result.successful

    @property
    def message(self) -> str:
        """What :attr:`result` means for this run (with the entry point's reason, where it
        gave one in ``stats["not_converged"]``)."""
        reason = self.stats.get("not_converged")
        return f"{self.result.value}: {reason}" if reason else self.result.value


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

    Example:
        >>> sol = paraprop.Solution(torch.zeros(3), "jacobi", iterations=2, evaluations=2,
        ...                         result=paraprop.Result.max_iters_reached)
        >>> paraprop.result.ensure_converged(sol, False, entry="mine", max_iters=2, tol=0) is sol
        True
        >>> paraprop.result.ensure_converged(sol, True, entry="mine", max_iters=2, tol=0)
        Traceback (most recent call last):
        paraprop.errors.ConvergenceError: mine: method='jacobi' did not converge within ...
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
