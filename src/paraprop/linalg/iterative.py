"""Iterative solvers of block bi-diagonal systems: Jacobi and diagonally preconditioned BiCGStab.

Both see the system through :class:`Layout`, which gives ``A x``, the scalar diagonal and
per-right-hand-side inner products in the layout the solver runs in: stacked, padded blocks for
flat systems (one batched product per ``A x``), the flat vector for nested ones.
"""

from __future__ import annotations

import torch

from paraprop.driver import Outcome
from paraprop.errors import NonFiniteError
from paraprop.linalg.stacked import StackedSystem
from paraprop.linalg.system import BlockBidiagonal
from paraprop.result import Result

__all__ = ["BiCGStab", "Jacobi", "Layout"]


class Layout:
    """The system and right-hand sides ``(G, Q, N)`` in the layout an iterative solver uses.

    Attributes:
        b: the right-hand sides (fresh buffer); ``d``: the scalar diagonal (broadcasts), or
        ``None`` for the identity.
    """

    def __init__(self, system: BlockBidiagonal, R: torch.Tensor):
        self.system = system
        G, Q, _ = R.shape
        self.shape_gq = (G, Q)
        if system.nested:
            self.S = None
            self.b = R.clone()
            self.d: torch.Tensor | None = system.point_diagonal().unsqueeze(1)  # (G', 1, N)
            self._sum_dims: tuple[int, ...] = (-1,)
            self.flops_matvec = _nested_flops(system, G * Q)
        else:
            self.S = StackedSystem(system, G, like=R)
            self.b = self.S.to_blocks(R)
            self.d = self.S.diag_rows()  # (l, G, 1, p) or None
            self._sum_dims = (0, 3)
            self.flops_matvec = self.S.matvec_flops(Q)

    def off(self, X: torch.Tensor) -> torch.Tensor:
        """``(A - diag(A)) X``."""
        if self.S is None:
            return self.system._matvec(X, with_diag=False)
        return self.S.matvec_off(X)

    def matvec(self, X: torch.Tensor) -> torch.Tensor:
        Y = self.off(X)
        return Y + (X if self.d is None else self.d * X)

    def solve_diag(self, X: torch.Tensor) -> torch.Tensor:
        return X if self.d is None else X / self.d

    def dot(self, X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
        """Inner product per right-hand side: ``(G, Q)``."""
        return (X * Y).sum(self._sum_dims)

    def norm(self, X: torch.Tensor) -> torch.Tensor:
        return self.dot(X, X).sqrt()

    def bc(self, v: torch.Tensor) -> torch.Tensor:
        """A ``(G, Q)`` scalar per right-hand side, shaped to broadcast against vectors."""
        return v.unsqueeze(-1) if self.S is None else v.unsqueeze(0).unsqueeze(-1)

    def finish(self, X: torch.Tensor) -> torch.Tensor:
        """Back to ``(G, Q, N)``."""
        return X if self.S is None else self.S.from_blocks(X)


def _nested_flops(system: BlockBidiagonal, vectors: int) -> int:
    f = sum(op.flops(vectors) for op in system.off) + vectors * system.N
    return f + sum(_nested_flops(d, vectors) for d in system.diag if isinstance(d, BlockBidiagonal))


def _relative(res: torch.Tensor, bnorm: torch.Tensor) -> torch.Tensor:
    return torch.where(bnorm > 0, res / torch.where(bnorm > 0, bnorm, 1), res)


def _check_finite(rel: torch.Tensor, method: str, it: int) -> None:
    if not bool(torch.isfinite(rel).all()):
        bad = [int(i) for i in (~torch.isfinite(rel)).nonzero()[0]]
        raise NonFiniteError(f"method={method!r}: the residual became NaN or inf at iteration "
                             f"{it} (right-hand side {tuple(bad)} in (group, column) order)")


# Jacobi (Naumov 2017, eq. 36-37): split A = D + (A - D) with D the scalar diagonal and iterate
#   x_{i+1} = D^{-1} (r - (A - D) x_i),  x_0 = 0.
# The iteration matrix -D^{-1}(A - D) is strictly block triangular, hence nilpotent: the error
# vanishes after `depth` sweeps (l for a flat system), where the iterate equals substitution's.
# D (x_{i+1} - x_i) = r - A x_i, so each sweep also yields the previous iterate's residual.
class Jacobi:
    """Jacobi sweeps on ``A X = R`` (``R``: ``(G, Q, N)``), a :class:`paraprop.driver.Method`;
    ``value`` of its outcome is ``(G, Q, N)``."""

    name = "jacobi"

    def __init__(self, system: BlockBidiagonal, R: torch.Tensor, tol: float):
        self.L = L = Layout(system, R)
        G, Q = L.shape_gq
        self.tol, self.bound = tol, system.depth
        self.bnorm = L.norm(L.b)
        self.x = torch.zeros_like(L.b)
        self.done = torch.zeros(G, Q, dtype=torch.bool, device=L.b.device)
        self.sample_it = torch.zeros(G, Q, dtype=torch.long)
        self.it = 0
        self.finished = False

    def stopped(self) -> bool:
        return self.finished

    def step(self) -> float:
        L = self.L
        self.it += 1
        x_new = L.solve_diag(L.b - L.off(self.x))
        diff = x_new - self.x
        rel = _relative(L.norm(diff if L.d is None else L.d * diff), self.bnorm)
        _check_finite(rel, self.name, self.it)
        self.x = x_new
        newly = ~self.done & (rel <= self.tol)
        self.sample_it[newly.cpu()] = self.it
        self.done |= newly
        self.finished = bool(self.done.all()) or self.it >= self.bound
        return float(rel.max())

    def outcome(self, iterations: int) -> Outcome:
        L, it = self.L, iterations
        exact = it >= self.bound
        self.sample_it[~self.done.cpu()] = it if exact else 0
        converged = bool(self.done.all()) or exact
        return Outcome(
            L.finish(self.x), Result.successful if converged else Result.max_iters_reached,
            evaluations=it, positions=it * L.system.l, sequential_steps=it, bound=self.bound,
            stats={"levels": it, "flops": it * (L.flops_matvec + 2 * L.b.numel()),
                   "memory_bytes": 4 * L.b.numel() * L.b.element_size(),
                   "sample_iterations": self.sample_it})


# BiCGStab (van der Vorst 1992) with the diagonal preconditioner K = D, Naumov 2017 eq. 38-41.
# One iteration: a BiCG step along the preconditioned search direction p (alpha), then a
# one-dimensional residual minimisation along K^{-1} s (omega); two products with A. Every
# right-hand side runs its own scalars; a finished one keeps its iterate (alpha = omega = 0). A
# breakdown (rho = 0) restarts that right-hand side with the shadow residual set to r.
class BiCGStab:
    """Preconditioned BiCGStab on ``A X = R`` (``R``: ``(G, Q, N)``), a
    :class:`paraprop.driver.Method`; ``value`` of its outcome is ``(G, Q, N)``."""

    name = "bicgstab"

    def __init__(self, system: BlockBidiagonal, R: torch.Tensor, tol: float, max_iters: int):
        self.L = L = Layout(system, R)
        G, Q = L.shape_gq
        b = L.b
        self.tol, self.max_iters = tol, max_iters
        self.bnorm = L.norm(b)
        self.x = torch.zeros_like(b)
        self.r, self.rhat = b.clone(), b.clone()
        self.p, self.v = torch.zeros_like(b), torch.zeros_like(b)
        ones = torch.ones(G, Q, dtype=b.dtype, device=b.device)
        self.rho_old, self.alpha, self.omega = ones.clone(), ones.clone(), ones.clone()
        self.active = _relative(self.bnorm, self.bnorm) > tol  # b = 0 -> x = 0, done
        self.sample_it = torch.zeros(G, Q, dtype=torch.long)
        self.breakdowns = 0
        self.it = 0

    def stopped(self) -> bool:
        return not bool(self.active.any())

    def step(self) -> float:
        L, bc, active, tol = self.L, self.L.bc, self.active, self.tol
        self.it += 1

        def safe(num, den, mask):
            ok = mask & (den != 0)
            return torch.where(ok, num / torch.where(ok, den, 1), 0)

        r = self.r
        rho = L.dot(self.rhat, r)
        brk = active & (rho == 0)
        if bool(brk.any()):
            self.breakdowns += int(brk.sum())
            self.rhat = torch.where(bc(brk), r, self.rhat)
            rho = torch.where(brk, L.dot(r, r), rho)
        beta = safe(rho, self.rho_old, active & ~brk) * safe(self.alpha, self.omega,
                                                            active & ~brk)
        self.p = r + bc(beta) * (self.p - bc(self.omega) * self.v)
        y = L.solve_diag(self.p)
        self.v = L.matvec(y)
        self.alpha = safe(rho, L.dot(self.rhat, self.v), active)
        self.x = self.x + bc(self.alpha) * y
        s = r - bc(self.alpha) * self.v
        half = active & (_relative(L.norm(s), self.bnorm) <= tol)
        z = L.solve_diag(s)
        t = L.matvec(z)
        self.omega = safe(L.dot(t, s), L.dot(t, t), active & ~half)
        self.x = self.x + bc(self.omega) * z
        self.r = s - bc(self.omega) * t
        self.rho_old = torch.where(active, rho, self.rho_old)
        rel = _relative(L.norm(self.r), self.bnorm)
        _check_finite(rel, self.name, self.it)
        rel = torch.where(half, torch.zeros_like(rel), rel)
        measure = float(torch.where(active, rel, 0).max())
        newly = active & (half | (rel <= tol))
        self.sample_it[newly.cpu()] = self.it
        self.active = active & ~newly
        return measure

    def outcome(self, iterations: int) -> Outcome:
        L, it, b = self.L, iterations, self.L.b
        true_res = _relative(L.norm(b - L.matvec(self.x)), self.bnorm)
        converged = not bool(self.active.any())
        return Outcome(
            L.finish(self.x), Result.successful if converged else Result.max_iters_reached,
            evaluations=2 * it, positions=2 * it * L.system.l, sequential_steps=2 * it,
            bound=self.max_iters,
            stats={"levels": 2 * it, "flops": it * (2 * L.flops_matvec + 14 * b.numel()),
                   "memory_bytes": 9 * b.numel() * b.element_size(),
                   "sample_iterations": self.sample_it, "breakdowns": self.breakdowns,
                   "true_residual": float(true_res.max()) if true_res.numel() else 0.0})
