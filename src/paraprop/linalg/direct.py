"""Direct solvers of block bi-diagonal systems: block substitution and cyclic reduction.

Both take right-hand sides laid out as ``(G, Q, N)`` (``G`` the per-sample batch of the system or
1, ``Q`` row vectors per group) and return ``(X, stats)`` with ``X`` in the same layout and
``stats`` holding hardware-independent counters: ``levels`` (dependent parallel steps), ``flops``
(as executed) and ``memory_bytes`` (peak bytes of the buffers the solver allocates, the solution
included).
"""

from __future__ import annotations

import math

import torch

from paraprop.linalg.stacked import StackedSystem
from paraprop.linalg.system import BlockBidiagonal

__all__ = ["cyclic_reduction", "substitution"]


def _group_rows(t: torch.Tensor) -> torch.Tensor:
    """A ``(G, n)`` scaling as ``(G, 1, n)`` so it broadcasts over ``(G, Q, n)``."""
    return t.unsqueeze(1) if t.dim() == 2 else t


def _solve_diag(d, Y: torch.Tensor, method: str):
    """``D^{-1} Y`` for a diagonal block ``d`` (identity, scaling or nested system)."""
    if d is None:
        return Y, {"levels": 1, "flops": 0, "memory_bytes": 0}
    if isinstance(d, BlockBidiagonal):
        G, Q, n = Y.shape
        if d.batch is None and G > 1:  # a shared inner system: every row is a right-hand side
            X, st = _solve(d, Y.reshape(1, G * Q, n), method)
            return X.reshape(G, Q, n), st
        return _solve(d, Y, method)
    return Y / _group_rows(d), {"levels": 1, "flops": Y.numel(), "memory_bytes": 0}


def _solve(system: BlockBidiagonal, R: torch.Tensor, method: str):
    return (cyclic_reduction if method == "cyclic_reduction" else substitution)(system, R)


# -- substitution ---------------------------------------------------------------------------
# Forward (lower) or backward (upper) block substitution, the sequential reference:
#   lower: x_0 = D_0^{-1} r_0,  x_k = D_k^{-1} (r_k - diag(s_{k-1}) M_{k-1} x_{k-1}),  k = 1..l-1
#   upper: the same from x_{l-1} down to x_0 with M_k x_{k+1}.
# Every block waits for its neighbour: l dependent steps (each nested diagonal block adds its own).
def substitution(system: BlockBidiagonal, R: torch.Tensor):
    """Solve by block substitution; ``R`` is ``(G, Q, N)``. Returns ``(X, stats)``."""
    rs = system.split(R)
    xs: dict[int, torch.Tensor] = {}   # the blocks solved so far
    order = range(system.l) if system.lower else range(system.l - 1, -1, -1)
    levels = flops = mem = 0
    Gq = R.shape[0] * R.shape[1]
    for k in order:
        rhs = rs[k]
        j, nb = (k - 1, k - 1) if system.lower else (k, k + 1)
        if 0 <= j < system.l - 1:
            v = system.off[j].matvec(xs[nb])
            s = system.off_scale[j]
            rhs = rhs - (v if s is None else _group_rows(s) * v)
            flops += system.off[j].flops(Gq) + 2 * Gq * system.sizes[k]
        xs[k], st = _solve_diag(system.diag[k], rhs, "substitution")
        levels += st["levels"]
        flops += st["flops"]
        mem = max(mem, st["memory_bytes"] + 2 * rhs.numel() * rhs.element_size())
    X = torch.cat([xs[k] for k in range(system.l)], dim=-1)
    return X, {"levels": levels, "flops": flops,
               "memory_bytes": mem + X.numel() * X.element_size()}


# -- cyclic reduction -----------------------------------------------------------------------
def cyclic_reduction(system: BlockBidiagonal, R: torch.Tensor):
    """Solve by cyclic reduction in ``ceil(log2 l) + 1`` levels; ``R`` is ``(G, Q, N)``.

    Returns ``(X, stats)``; nested systems add ``inner_levels`` and ``outer_levels``.
    """
    if system.nested:
        return _cr_nested(system, R)
    G = R.shape[0]
    S = StackedSystem(system, G, like=R)
    C = S.to_blocks(R)
    T, C, st = _normalise(S, C)
    del S.Mt  # T owns (or replaced) the stacked blocks from here on
    C, st2 = _doubling(T, C, system.lower)
    X = S.from_blocks(C)
    return X, {"levels": 1 + st2["levels"], "flops": st["flops"] + st2["flops"],
               "memory_bytes": st["memory_bytes"] + st2["memory_bytes"]}


def _normalise(S: StackedSystem, C: torch.Tensor):
    """Level 1: divide every block row by its diagonal (independent blocks, one parallel step).

    Row ``k`` becomes ``x_k = c_k + x_{k-+1} @ T_k`` (row vectors) with ``c_k = D_k^{-1} r_k`` and
    ``T_k = -(D_k^{-1} diag(s) M)^T``; the transposed blocks are scaled column-wise, in place.
    """
    l, G, Q, p = C.shape
    esize = C.element_size()
    rows = slice(1, l) if S.lower else slice(0, l - 1)
    a = -S.scale if S.scale is not None else None  # (l-1, G, p): -s_j
    if S.diag is not None:
        dinv = S.diag.reciprocal()
        C = C * dinv.unsqueeze(2)
        a = -dinv[rows] if a is None else a * dinv[rows]
    if a is None:
        T = S.Mt.neg_().unsqueeze(1)  # (l-1, 1, p, p)
    elif G == 1:
        T = S.Mt.mul_(a[:, 0, None, :]).unsqueeze(1)
    else:
        T = S.Mt.unsqueeze(1) * a.unsqueeze(2)  # (l-1, G, p, p), one block per sample
    extra = S.Mt.numel() if G > 1 else 0
    mem = (T.numel() + extra + C.numel()) * esize
    flops = T.numel() + C.numel()
    return T.contiguous(), C, {"flops": flops, "memory_bytes": mem}


# Recursive doubling ("odd-even" decoupling, Naumov 2017 eq. 23-35 in the bi-diagonal case).
# Rows are x_k = c_k + x_{k-s} @ T_k (lower; upper: x_{k+s}) with stride s = 1. Substituting the
# row of x_{k-s} into row k gives x_k = (c_k + c_{k-s} @ T_k) + x_{k-2s} @ (T_{k-s} @ T_k): the
# same form with stride 2s, so the unknowns split into 2s independent chains. Every row updates in
# parallel; after ceil(log2 l) levels no row depends on another and c_k = x_k. Rows with k < s
# are final, so level s updates l - s vectors and l - 2s blocks. Both updates run in place, in
# two chunks through one half-size buffer: the solver never holds more than 1.5x the blocks.
def _doubling(T: torch.Tensor, C: torch.Tensor, lower: bool):
    l, G, Q, p = C.shape
    esize = C.element_size()
    levels = flops = 0
    h = math.ceil((l - 1) / 2)  # chunk length: half the largest update
    tmp = T.new_empty(h, G, p, p)   # (h = 0 for a single block)
    peak = tmp.numel()
    s = 1
    while s < l:
        m = l - s
        # vectors: row k gets c_{k-+s} @ T_k. Chunks are ordered so that no row is written
        # before the chunk that reads it (lower: from the top down; upper: from the bottom up).
        chunks = [(a, min(a + h, m)) for a in range(0, m, h)]
        for a, b in (reversed(chunks) if lower else chunks):
            src = C[a:b] if lower else C[s + a : s + b]
            dst = C[s + a : s + b] if lower else C[a:b]
            if Q == 1:  # row vector times matrix: a broadcast product beats 1 x p gemms
                prod = torch.mul(T[a:b], src.transpose(-1, -2), out=tmp[: b - a])
                dst += prod.sum(-2, keepdim=True)
            else:
                upd = torch.bmm(src.reshape(-1, Q, p), T[a:b].reshape(-1, p, p))
                dst += upd.reshape(b - a, G, Q, p)
                peak = max(peak, tmp.numel() + upd.numel())
        flops += 2 * m * G * Q * p * p
        levels += 1
        # blocks: T'_i = T_i @ T_{i+s} (lower) or T_{i+s} @ T_i (upper), written in place in
        # increasing index order (a chunk reads only indices at or above its own)
        n2 = l - 2 * s
        if n2 > 0:
            for a in range(0, n2, h):
                b = min(a + h, n2)
                out = tmp[: b - a].reshape((b - a) * G, p, p)
                A1 = T[a:b].reshape((b - a) * G, p, p)
                A2 = T[a + s : b + s].reshape((b - a) * G, p, p)
                torch.bmm(A1, A2, out=out) if lower else torch.bmm(A2, A1, out=out)
                T[a:b] = out.reshape(b - a, G, p, p)
            flops += 2 * n2 * G * p ** 3
        s *= 2
    return C, {"levels": levels, "flops": flops, "memory_bytes": peak * esize}


# Nested systems (the RNN system of eq. 23-24): the diagonal blocks D_k are block bi-diagonal
# systems themselves. Level set 1 inverts them all at once (they are independent), by cyclic
# reduction on their own blocks: c_k = D_k^{-1} r_k and the dense T_k = -(D_k^{-1} diag(s) M)^T,
# whose columns are right-hand sides of the inner system. The outer system then has the identity
# diagonal and dense blocks, and the doubling above finishes it in ceil(log2 l) levels.
def _cr_nested(system: BlockBidiagonal, R: torch.Tensor):
    G, Q, _ = R.shape
    l, sizes = system.l, system.sizes
    P = max(sizes)
    rs = system.split(R)
    C = R.new_zeros(l, G, Q, P)
    T = R.new_zeros(max(l - 1, 0), G, P, P)
    inner_levels = 0
    flops = 0
    inner_mem = 0
    for k in range(l):
        ck, st = _solve_diag(system.diag[k], rs[k], "cyclic_reduction")
        C[k, :, :, : sizes[k]] = ck
        inner_levels = max(inner_levels, st["levels"])
        flops += st["flops"]
        inner_mem = max(inner_mem, st["memory_bytes"])
    for j, op in enumerate(system.off):
        r = j + 1 if system.lower else j
        rows, cols = op.shape
        Xt = op.dense().T.expand(G, cols, rows)  # rows of Xt: columns of diag(s) M
        s = system.off_scale[j]
        if s is not None:
            Xt = Xt * s.reshape(-1, 1, rows)
        Yt, st = _solve_diag(system.diag[r], Xt.contiguous(), "cyclic_reduction")
        T[j, :, :cols, :rows] = -Yt
        inner_levels = max(inner_levels, st["levels"])
        flops += st["flops"] + Xt.numel()
        inner_mem = max(inner_mem, st["memory_bytes"])
    C, st = _doubling(T, C, system.lower)
    X = torch.cat([C[k, :, :, :n] for k, n in enumerate(sizes)], dim=-1)
    esize = R.element_size()
    return X, {"levels": inner_levels + st["levels"], "inner_levels": inner_levels,
               "outer_levels": st["levels"], "flops": flops + st["flops"],
               "memory_bytes": (T.numel() + C.numel()) * esize + max(inner_mem,
                                                                     st["memory_bytes"])}
