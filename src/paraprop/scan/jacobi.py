"""Jacobi iterations on a linear recurrence (Song et al. 2021, §5.1).

The recurrence ``h_t = A_t h_{t-1} + b_t`` is a block bi-diagonal linear system. A Jacobi sweep
updates every position at once from the previous iterate, ``x_t <- A_t x_{t-1} + b_t``: one
batched matrix-vector product over all ``T`` steps. After ``k`` sweeps positions ``t < k`` are
exact, so ``T`` sweeps give the sequential result; stopping earlier (``max_iters``, ``tol``)
gives an approximation whose error decays with the products of the ``A_t`` (a truncated
back-propagation when the recurrence is a backward pass). The ``tol`` stop is the contraction
estimate of :mod:`paraprop.stopping`: a recurrence that accumulates (``A_t`` near the
identity) is never stopped on a small step.
"""

from __future__ import annotations

import torch

from paraprop import checks
from paraprop.driver import Outcome, run
from paraprop.result import Result, Solution
from paraprop.scan.transitions import canonicalise
from paraprop.stopping import ContractionRule


def jacobi_recurrence(A, b: torch.Tensor, h0: torch.Tensor | None = None, *,
                      reverse: bool = False, max_iters: int | None = None,
                      tol: float = 0.0, throw: bool = False) -> Solution:
    """Solve ``h_t = A_t h_{t-1} + b_t`` (or its reverse) by Jacobi sweeps from ``x = 0``.

    Arguments:
        A, b, h0, reverse: as for :func:`paraprop.scan.linear_recurrence`.
        max_iters: at most this many sweeps; ``None`` means ``T`` (exact).
        tol: stop once the estimated error ``q / (1 - q) * d_k`` and the forward difference
            ``d_k = max |x_k - x_{k-1}|`` are ``<= tol`` (``q``: the observed contraction of
            ``d``); ``0`` stops at an exact fixed point.
        throw: raise :class:`paraprop.ConvergenceError` if ``max_iters`` ends the sweeps
            before convergence. Default ``False``, unlike :func:`paraprop.solve`: a truncated
            Jacobi backward (truncated back-propagation through time) is a deliberate
            approximation, reported by ``converged=False``.

    Returns:
        A :class:`paraprop.Solution` (``method="jacobi"``): ``value`` the last iterate
        ``(*batch, T, H)`` (differentiable by autograd), ``iterations`` the sweeps,
        ``converged`` (the error estimate reached ``tol``, or ``T`` sweeps made it exact),
        ``residuals`` the forward differences, ``stats`` with ``error_estimate``, ``bound``
        (``T``), ``T`` and ``time_s``.

    Raises:
        TypeError / ValueError: as :func:`linear_recurrence`; bad ``max_iters`` or ``tol``.

    Example:
        >>> A = 0.3 * torch.randn(2, 50, 4, 4); b = torch.randn(2, 50, 4)
        >>> r = jacobi_recurrence(A, b, tol=1e-6)
        >>> r.iterations < 50 and r.converged
        True
    """
    checks.check_max_iters(max_iters)
    checks.check_tol(tol)
    checks.boolean("reverse", reverse)
    checks.boolean("throw", throw)
    c = canonicalise(A, b, h0)
    T = c.b.shape[1]
    cap = T if max_iters is None else min(max_iters, T)
    return run(_Sweeps(c, reverse, tol), max_iters=cap, entry="jacobi_recurrence", throw=throw,
               tol=tol, measure="forward difference", user_max_iters=max_iters)


class _Sweeps:
    """Jacobi sweeps on a canonical recurrence (a :class:`paraprop.driver.Method`): shift the
    iterate by one step (``h_prev``), apply every ``A_t`` at once, add ``b``."""

    name = "jacobi"

    def __init__(self, c, reverse: bool, tol: float):
        self.c, self.reverse, self.tol = c, reverse, tol
        bb = c.b
        self.T = bb.shape[1]
        self.start = (c.h0 if c.h0 is not None else torch.zeros_like(bb[:, 0])).unsqueeze(1)
        self.x = torch.zeros_like(bb)
        self.rule = ContractionRule(1, bb.device)
        self.always = torch.ones(1, dtype=torch.bool, device=bb.device)
        self.k = 0
        self.converged = False
        self.estimate = float("inf")

    def stopped(self) -> bool:
        return self.converged

    def step(self) -> float:
        bb, x = self.c.b, self.x
        self.k += 1
        prev = torch.empty_like(bb)   # fresh each sweep: autograd may have saved the last one
        if self.reverse:
            prev[:, :-1], prev[:, -1:] = x[:, 1:], self.start
        else:
            prev[:, 1:], prev[:, :1] = x[:, :-1], self.start
        new = self.c.op.apply(prev).add_(bb)
        res = float(torch.sub(new.detach(), x.detach()).abs_().max()) if new.numel() else 0.0
        self.x = new
        stop, est = self.rule.update(torch.tensor([res], dtype=torch.float64, device=bb.device),
                                     self.tol, self.always)
        if self.k == self.T or bool(stop):
            self.converged = True
            self.estimate = 0.0 if self.k == self.T else float(est)
        return res

    def outcome(self, iterations: int) -> Outcome:
        return Outcome(self.c.user(self.x),
                       Result.successful if self.converged else Result.max_iters_reached,
                       evaluations=iterations, positions=iterations * self.T,
                       sequential_steps=iterations, bound=self.T,
                       error_estimate=self.estimate, stats={"T": self.T})
