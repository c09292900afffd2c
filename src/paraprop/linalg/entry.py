"""``paraprop.linalg.solve``: one entry point for every block bi-diagonal solver."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch

from paraprop import checks
from paraprop.driver import Outcome, build, run
from paraprop.errors import NonFiniteError
from paraprop.linalg.direct import cyclic_reduction, substitution
from paraprop.linalg.iterative import BiCGStab, Jacobi
from paraprop.linalg.system import BlockBidiagonal
from paraprop.result import Result, Solution

__all__ = ["DIRECT", "ITERATIVE", "METHODS", "check_solver_args", "solve"]

DIRECT = ("substitution", "cyclic_reduction")
ITERATIVE = ("jacobi", "bicgstab")
METHODS = DIRECT + ITERATIVE
DEFAULT_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2,
               torch.bfloat16: 1e-2}


def solve(
    system: BlockBidiagonal,
    rhs,
    *,
    method: str = "cyclic_reduction",
    tol: float | None = None,
    max_iters: int | None = None,
    throw: bool = True,
) -> Solution:
    """Solve the block bi-diagonal system ``A x = rhs``.

    Arguments:
        system: a :class:`BlockBidiagonal` (lower: forward propagation, upper: backward).
        rhs: ``(N,)``, ``(B, N)`` or a list of ``l`` blocks ``(n_k,)``/``(B, n_k)``; a
            per-sample system (``system.batch == B``) needs ``(B, N)``.
        method: ``"substitution"`` (sequential, ``l`` dependent steps), ``"cyclic_reduction"``
            (``ceil(log2 l) + 1`` levels, Naumov 2017 eq. 23-35), ``"jacobi"`` (eq. 36-37) or
            ``"bicgstab"`` (diagonally preconditioned, eq. 38-41).
        tol: iterative methods only: stop when the relative residual ``||r - A x|| / ||r||`` of
            every right-hand side is ``<= tol`` (Jacobi: of the previous iterate, whose sweep
            gives it for free). ``None``: ``1e-12`` in float64, ``1e-5`` in float32.
        max_iters: iterative methods only: cap on iterations. ``None``: the system's ``depth``
            for Jacobi (``l`` sweeps for a flat system; exact there), ``max(2 N, 20)`` for
            BiCGStab (in exact arithmetic it would need at most ``N``; rounding can stall it).
        throw: raise :class:`~paraprop.errors.ConvergenceError` when an iterative method stops
            unconverged; with ``False`` the unconverged :class:`~paraprop.Solution` is returned.

    Returns:
        A :class:`~paraprop.Solution` whose ``value`` has the shape of ``rhs`` (flat ``(N,)`` or
        ``(B, N)``; ``system.split`` gives the blocks). ``iterations``: levels (direct) or
        iterations; ``evaluations``: dependent steps (levels, or products with ``A``);
        ``residuals``: relative residual per iteration (max over right-hand sides; empty for
        direct methods). ``stats``: ``levels`` (sequential steps), ``flops``, ``memory_bytes``
        (peak bytes the solver allocates, solution included), ``time_s``, ``l``, ``N`` and, for
        iterative methods, ``bound``, ``sample_iterations`` (``(B,)``), ``breakdowns`` and
        ``true_residual`` (BiCGStab); nested systems add ``inner_levels``/``outer_levels``.

    Raises:
        TypeError / ValueError: bad arguments (named, with the bad value or shape), a singular
            diagonal (the block and entry named).
        NonFiniteError: the solution or a residual became NaN or inf.
        ConvergenceError: an iterative method did not converge and ``throw=True``.

    Example:
        >>> W = [torch.randn(4, 4, dtype=torch.float64) for _ in range(7)]
        >>> A = BlockBidiagonal(W, lower=True)
        >>> r = torch.randn(3, A.N, dtype=torch.float64)
        >>> sol = solve(A, r, method="cyclic_reduction")
        >>> sol.stats["levels"], torch.allclose(A.matvec(sol.value), r)
        (4, True)
    """
    system, R, out_shape = _validate(system, rhs, method, tol, max_iters, throw)
    if method in DIRECT:
        start = time.perf_counter()
        fn = substitution if method == "substitution" else cyclic_reduction
        with torch.no_grad():
            X, st = fn(system, R)
        out = _Shaped.finish(Outcome(X, Result.successful, evaluations=st["levels"],
                                     sequential_steps=st["levels"], bound=st["levels"],
                                     error_estimate=0.0, stats=st), method, out_shape, system)
        return build(method, out, iterations=st["levels"], time_s=time.perf_counter() - start)
    tol = DEFAULT_TOL.get(system.dtype, 1e-6) if tol is None else float(tol)
    user_max_iters = max_iters
    if max_iters is None:
        max_iters = system.depth if method == "jacobi" else max(2 * system.N, 20)
    with torch.no_grad():
        inner = Jacobi(system, R, tol) if method == "jacobi" else \
            BiCGStab(system, R, tol, max_iters)
        return run(_Shaped(inner, out_shape, system), max_iters=max_iters,
                   entry="linalg.solve", throw=throw, tol=tol, measure="relative residual",
                   user_max_iters=user_max_iters if user_max_iters is not None else max_iters)


class _Shaped:
    """A linear method whose outcome comes back in the shape of ``rhs`` (finite, or
    :class:`~paraprop.NonFiniteError`), with the system's size in its stats."""

    def __init__(self, inner, out_shape: tuple, system: BlockBidiagonal):
        self.inner, self.out_shape, self.system = inner, out_shape, system
        self.name = inner.name
        self.stopped, self.step = inner.stopped, inner.step

    def outcome(self, iterations: int) -> Outcome:
        return self.finish(self.inner.outcome(iterations), self.name, self.out_shape,
                           self.system)

    @staticmethod
    def finish(out: Outcome, method: str, out_shape: tuple, system) -> Outcome:
        out.value = out.value.reshape(out_shape)
        if not bool(torch.isfinite(out.value).all()):
            raise NonFiniteError(f"method={method!r} produced NaN or inf (the system is too "
                                 "badly conditioned for this dtype, or its blocks overflow in "
                                 "products)")
        if "sample_iterations" in out.stats:
            out.stats["sample_iterations"] = out.stats["sample_iterations"].reshape(
                out_shape[:-1])
        out.stats.update({"l": system.l, "N": system.N})
        return out


def _validate(system, rhs, method, tol, max_iters, throw):
    """Check every argument once; return the system, the right-hand sides as ``(G, Q, N)`` and
    the shape of the value."""
    if not isinstance(system, BlockBidiagonal):
        raise TypeError(f"system must be a BlockBidiagonal, got {type(system).__name__}")
    check_solver_args(method, tol, max_iters)
    checks.boolean("throw", throw)
    if isinstance(rhs, Sequence) and not isinstance(rhs, torch.Tensor):
        for k, b in enumerate(rhs):
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"rhs[{k}] must be a tensor (one block of a list of blocks), "
                                f"got {type(b).__name__}")
        rhs = system.join(rhs)
    if not isinstance(rhs, torch.Tensor):
        raise TypeError(f"rhs must be a tensor or a list of blocks, got {type(rhs).__name__}")
    if not rhs.is_floating_point():
        raise TypeError(f"rhs must have a floating-point dtype, got {rhs.dtype}")
    if system.dtype is None:  # identities only: take the right-hand side's dtype and device
        system = copy.copy(system)
        system.dtype, system.device = rhs.dtype, rhs.device
    if rhs.dtype != system.dtype:
        raise TypeError(f"rhs has dtype {rhs.dtype} but the system has {system.dtype}")
    if torch.device(rhs.device) != torch.device(system.device):
        raise TypeError(f"rhs is on {rhs.device} but the system is on {system.device}")
    if rhs.dim() not in (1, 2) or rhs.shape[-1] != system.N:
        raise ValueError(f"rhs must have shape (N,) or (B, N) with N={system.N}, got "
                         f"{tuple(rhs.shape)}")
    if system.batch is not None and (rhs.dim() != 2 or rhs.shape[0] != system.batch):
        raise ValueError(f"the system has per-sample blocks for batch {system.batch}, so rhs "
                         f"must have shape ({system.batch}, {system.N}); got {tuple(rhs.shape)}")
    if rhs.numel() == 0:
        raise ValueError(f"rhs must not be empty, got shape {tuple(rhs.shape)}")
    checks.finite("rhs", rhs)
    system.check_nonsingular()
    B = 1 if rhs.dim() == 1 else rhs.shape[0]
    R = rhs.reshape(B, 1, system.N) if system.batch is not None else rhs.reshape(1, B, system.N)
    return system, R, tuple(rhs.shape)


def check_solver_args(method, tol, max_iters) -> None:
    """Check ``method``, ``tol`` and ``max_iters`` as :func:`solve` does (for callers that
    validate before they have a system to solve)."""
    checks.one_of("method", method, METHODS)
    if method in DIRECT:
        if tol is not None:
            raise ValueError(f"tol is only used by the iterative methods, not method={method!r}")
        if max_iters is not None:
            raise ValueError(f"max_iters is only used by the iterative methods, not "
                             f"method={method!r}")
    checks.nonneg_number("tol", tol, allow_none=True)
    checks.positive_int("max_iters", max_iters, allow_none=True)
