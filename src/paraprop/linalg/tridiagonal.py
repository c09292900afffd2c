"""Block tridiagonal systems by cyclic reduction, in ``ceil(log2 n)`` batched levels.

``L_t x_{t-1} + D_t x_t + U_t x_{t+1} = r_t`` for ``t = 0 .. n-1`` (``L_0`` and ``U_{n-1}`` are
ignored). Each level eliminates the odd unknowns from the even equations (Hockney 1965; the
tridiagonal sibling of the bi-diagonal reduction in :mod:`paraprop.linalg.direct`), leaving a
block tridiagonal system of half the size; the odd unknowns then follow in one batched
back-substitution. Without pivoting it is stable for the systems it is used on here: symmetric
positive definite ones (the Levenberg-Marquardt normal equations of :mod:`paraprop.solvers.newton`),
whose Schur complements stay positive definite.

Blocks are dense ``(B, n, F, F)`` or diagonal ``(B, n, F)`` (then every product is elementwise).
"""

from __future__ import annotations

import torch

__all__ = ["tridiagonal_solve"]


def tridiagonal_solve(D: torch.Tensor, L: torch.Tensor, U: torch.Tensor,
                      rhs: torch.Tensor) -> torch.Tensor:
    """Solve ``L_t x_{t-1} + D_t x_t + U_t x_{t+1} = rhs_t`` for all ``t`` at once.

    Arguments:
        D, L, U: ``(B, n, F, F)`` dense blocks or ``(B, n, F)`` diagonal blocks (all three of the
            same form). ``L[:, 0]`` and ``U[:, -1]`` are not used.
        rhs: ``(B, n, F)``.

    Returns:
        ``x``, ``(B, n, F)``.

    Example:
        >>> D = 4 + torch.rand(2, 5, 3); L = torch.rand(2, 5, 3); U = torch.rand(2, 5, 3)
        >>> x = tridiagonal_solve(D, L, U, torch.randn(2, 5, 3))
    """
    if rhs.dim() != 3:
        raise ValueError(f"rhs must have shape (B, n, F), got {tuple(rhs.shape)}")
    dense = D.dim() == 4
    want = (*rhs.shape, rhs.shape[-1]) if dense else tuple(rhs.shape)
    for name, t in (("D", D), ("L", L), ("U", U)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want} for rhs {tuple(rhs.shape)}, "
                             f"got {tuple(t.shape)}")
    return _reduce(D, L, U, rhs, _Dense if dense else _Diag)


class _Diag:
    @staticmethod
    def mm(a, b):
        return a * b

    @staticmethod
    def mv(a, v):
        return a * v

    @staticmethod
    def inv(a):
        return a.reciprocal()


class _Dense:
    @staticmethod
    def mm(a, b):
        return a @ b

    @staticmethod
    def mv(a, v):
        return (a @ v.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def inv(a):
        return torch.linalg.inv(a)


def _reduce(D, L, U, r, k):
    n = r.shape[1]
    if n == 1:
        return k.mv(k.inv(D), r)
    Di = k.inv(D[:, 1::2])                       # odd blocks, no = n // 2 of them
    no, ne = n // 2, (n + 1) // 2
    # even i = 2e couples to odd 2e-1 (index e-1, for e >= 1) and odd 2e+1 (index e, e < no)
    a = k.mm(L[:, 2::2], Di[:, :ne - 1])         # L_i D_{i-1}^{-1}, evens 1..ne-1
    c = k.mm(U[:, 0:2 * no:2], Di)               # U_i D_{i+1}^{-1}, evens 0..no-1
    D2, r2 = D[:, 0::2].clone(), r[:, 0::2].clone()
    L2, U2 = torch.zeros_like(D2), torch.zeros_like(D2)
    Lo, Uo, ro = L[:, 1::2], U[:, 1::2], r[:, 1::2]
    if ne > 1:
        D2[:, 1:] -= k.mm(a, Uo[:, :ne - 1])
        r2[:, 1:] -= k.mv(a, ro[:, :ne - 1])
        L2[:, 1:] = -k.mm(a, Lo[:, :ne - 1])
    D2[:, :no] -= k.mm(c, Lo)
    r2[:, :no] -= k.mv(c, ro)
    m = min(no, ne - 1)                          # evens with an even neighbour on the right
    if m > 0:
        U2[:, :m] = -k.mm(c[:, :m], Uo[:, :m])
    xe = _reduce(D2, L2, U2, r2, k)
    # odd j = 2e+1: x_j = D_j^{-1} (r_j - L_j x_{j-1} - U_j x_{j+1})
    t = ro - k.mv(Lo, xe[:, :no])
    if ne > no:
        t = t - k.mv(Uo, xe[:, 1:no + 1])
    else:
        t = torch.cat([t[:, :-1] - k.mv(Uo[:, :-1], xe[:, 1:]), t[:, -1:]], 1)
    x = torch.empty_like(r)
    x[:, 0::2] = xe
    x[:, 1::2] = k.mv(Di, t)
    return x
