"""Iterative solvers of block bi-diagonal systems: Jacobi and diagonally preconditioned BiCGStab.

Both see the system through :class:`Layout`, which gives ``A x``, the scalar diagonal and
per-right-hand-side inner products in the layout the solver runs in: stacked, padded blocks for
flat systems (one batched product per ``A x``), the flat vector for nested ones.
"""

from __future__ import annotations

import torch

from paraprop.errors import NonFiniteError
from paraprop.linalg.stacked import StackedSystem
from paraprop.linalg.system import BlockBidiagonal

__all__ = ["Layout", "bicgstab", "jacobi"]


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
            self.d = system.point_diagonal().unsqueeze(1)  # (G', 1, N)
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
def jacobi(system: BlockBidiagonal, R: torch.Tensor, tol: float, max_iters: int):
    """Solve by Jacobi sweeps; ``R`` is ``(G, Q, N)``. Returns ``(X, info)``."""
    L = Layout(system, R)
    G, Q = L.shape_gq
    bound = system.depth
    b = L.b
    bnorm = L.norm(b)
    x = torch.zeros_like(b)
    done = torch.zeros(G, Q, dtype=torch.bool, device=b.device)
    sample_it = torch.zeros(G, Q, dtype=torch.long)
    residuals: list[float] = []
    it = 0
    while it < max_iters:
        it += 1
        x_new = L.solve_diag(b - L.off(x))
        diff = x_new - x
        rel = _relative(L.norm(diff if L.d is None else L.d * diff), bnorm)
        _check_finite(rel, "jacobi", it)
        residuals.append(float(rel.max()))
        x = x_new
        newly = ~done & (rel <= tol)
        sample_it[newly.cpu()] = it
        done |= newly
        if bool(done.all()) or it >= bound:
            break
    exact = it >= bound
    sample_it[~done.cpu()] = it if exact else 0
    converged = bool(done.all()) or exact
    info = {"iterations": it, "evaluations": it, "converged": converged,
            "residuals": residuals, "X": L.finish(x), "bound": bound,
            "levels": it, "flops": it * (L.flops_matvec + 2 * b.numel()),
            "memory_bytes": 4 * b.numel() * b.element_size(),
            "sample_iterations": sample_it}
    return info


# BiCGStab (van der Vorst 1992) with the diagonal preconditioner K = D, Naumov 2017 eq. 38-41.
# One iteration: a BiCG step along the preconditioned search direction p (alpha), then a
# one-dimensional residual minimisation along K^{-1} s (omega); two products with A. Every
# right-hand side runs its own scalars; a finished one keeps its iterate (alpha = omega = 0). A
# breakdown (rho = 0) restarts that right-hand side with the shadow residual set to r.
def bicgstab(system: BlockBidiagonal, R: torch.Tensor, tol: float, max_iters: int):
    """Solve by preconditioned BiCGStab; ``R`` is ``(G, Q, N)``. Returns ``(X, info)``."""
    L = Layout(system, R)
    G, Q = L.shape_gq
    b = L.b
    bc = L.bc
    bnorm = L.norm(b)
    x = torch.zeros_like(b)
    r = b.clone()
    rhat = b.clone()
    p = torch.zeros_like(b)
    v = torch.zeros_like(b)
    ones = torch.ones(G, Q, dtype=b.dtype, device=b.device)
    rho_old, alpha, omega = ones.clone(), ones.clone(), ones.clone()
    active = _relative(bnorm, bnorm) > tol  # b = 0 -> x = 0, done
    sample_it = torch.zeros(G, Q, dtype=torch.long)
    residuals: list[float] = []
    breakdowns = 0
    it = 0

    def safe(num, den, mask):
        ok = mask & (den != 0)
        return torch.where(ok, num / torch.where(ok, den, 1), 0)

    while bool(active.any()) and it < max_iters:
        it += 1
        rho = L.dot(rhat, r)
        brk = active & (rho == 0)
        if bool(brk.any()):
            breakdowns += int(brk.sum())
            rhat = torch.where(bc(brk), r, rhat)
            rho = torch.where(brk, L.dot(r, r), rho)
        beta = safe(rho, rho_old, active & ~brk) * safe(alpha, omega, active & ~brk)
        p = r + bc(beta) * (p - bc(omega) * v)
        y = L.solve_diag(p)
        v = L.matvec(y)
        alpha = safe(rho, L.dot(rhat, v), active)
        x = x + bc(alpha) * y
        s = r - bc(alpha) * v
        half = active & (_relative(L.norm(s), bnorm) <= tol)
        z = L.solve_diag(s)
        t = L.matvec(z)
        omega = safe(L.dot(t, s), L.dot(t, t), active & ~half)
        x = x + bc(omega) * z
        r = s - bc(omega) * t
        rho_old = torch.where(active, rho, rho_old)
        rel = _relative(L.norm(r), bnorm)
        _check_finite(rel, "bicgstab", it)
        rel = torch.where(half, torch.zeros_like(rel), rel)
        residuals.append(float(torch.where(active, rel, 0).max()))
        newly = active & (half | (rel <= tol))
        sample_it[newly.cpu()] = it
        active &= ~newly
    true_res = _relative(L.norm(b - L.matvec(x)), bnorm)
    info = {"iterations": it, "evaluations": 2 * it, "converged": not bool(active.any()),
            "residuals": residuals, "X": L.finish(x), "bound": max_iters,
            "levels": 2 * it, "flops": it * (2 * L.flops_matvec + 14 * b.numel()),
            "memory_bytes": 9 * b.numel() * b.element_size(),
            "sample_iterations": sample_it, "breakdowns": breakdowns,
            "true_residual": float(true_res.max()) if true_res.numel() else 0.0}
    return info
