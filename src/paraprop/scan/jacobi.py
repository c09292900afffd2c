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

import time

import torch

from paraprop import checks
from paraprop.result import Solution, ensure_converged
from paraprop.scan.recurrence import canonicalise
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
    op, bb = c.op, c.b
    T = bb.shape[1]
    cap = T if max_iters is None else min(max_iters, T)
    start = (c.h0 if c.h0 is not None else torch.zeros_like(bb[:, 0])).unsqueeze(1)
    x = torch.zeros_like(bb)
    residuals = []
    converged = False
    rule = ContractionRule(1, bb.device)
    always = torch.ones(1, dtype=torch.bool, device=bb.device)
    estimate = float("inf")
    t0 = time.perf_counter()
    # one sweep: shift the iterate by one step (h_prev), apply every A_t at once, add b
    for k in range(1, cap + 1):
        prev = torch.empty_like(bb)   # fresh each sweep: autograd may have saved the last one
        if reverse:
            prev[:, :-1], prev[:, -1:] = x[:, 1:], start
        else:
            prev[:, 1:], prev[:, :1] = x[:, :-1], start
        new = op.apply(prev).add_(bb)
        res = float(torch.sub(new.detach(), x.detach()).abs_().max()) if new.numel() else 0.0
        residuals.append(res)
        x = new
        stop, est = rule.update(torch.tensor([res], dtype=torch.float64, device=bb.device), tol,
                                always)
        if k == T or bool(stop):
            converged = True
            estimate = 0.0 if k == T else float(est)
            break
    sol = Solution(value=c.user(x), method="jacobi", iterations=len(residuals),
                   evaluations=len(residuals), converged=converged,
                   residuals=torch.tensor(residuals, dtype=torch.float64),
                   stats={"error_estimate": estimate, "bound": T, "T": T,
                          "time_s": time.perf_counter() - t0})
    return ensure_converged(sol, throw, entry="jacobi_recurrence", max_iters=max_iters, tol=tol,
                            measure="forward difference",
                            last=residuals[-1] if residuals else None)
