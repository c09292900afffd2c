"""The chunked scan: sequential inside chunks, batched across chunks, then a scan of the carries.

Split the ``T`` positions into ``C`` chunks of ``L`` (the last one may be shorter). Step ``j`` of
the in-chunk pass handles position ``j`` of *every* chunk in one batched call, so a pass costs
``L`` calls, not ``T``; the ``C`` chunk carries are scanned sequentially; a fix-up combines each
chunk with the carry of the chunks before it. About ``2 sqrt(2 T)`` batched calls for
``L = sqrt(T / 2)``; the work is that of two sequential scans (Blelloch 1990, scans with fewer
processors than elements; BPPSA's ``Θ(n/p + log p)`` regime with ``p = C`` workers).

For linear recurrences :func:`recurrence` avoids most matrix-matrix products: the in-chunk pass
carries ``[P | y]`` (the chunk's transition product and its zero-start state) as one
``H x (H + 1)`` block per chunk, the carries need ``C`` matrix-vector steps, and the fix-up simply
re-runs each chunk from its true start state (``L`` matrix-vector steps across chunks).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from paraprop.scan import sequential
from paraprop.scan.transitions import Op

Leaves = list[torch.Tensor]


def default_chunk(n: int) -> int:
    """``ceil(sqrt(n / 2))``: balances the two in-chunk passes against the carry scan."""
    return max(1, math.ceil(math.sqrt(n / 2)))


def scan(leaves: Leaves, combine: Callable[[Leaves, Leaves], Leaves], dim: int,
         chunk: int | None = None) -> Leaves:
    """Inclusive scan along ``dim`` by chunks of ``chunk`` positions."""
    n = leaves[0].shape[dim]
    L = min(chunk or default_chunk(n), n)
    C, r = divmod(n, L)
    if C <= 1 and r == 0:
        return sequential.scan(leaves, combine, dim)
    body = [x.narrow(dim, 0, C * L).unflatten(dim, (C, L)) for x in leaves]
    tail = [x.narrow(dim, C * L, r) for x in leaves]

    # 1. local inclusive scans: position j of every chunk in one call (the tail alongside)
    acc = [b.select(dim + 1, 0) for b in body]
    acc_t = [t.narrow(dim, 0, 1) for t in tail] if r else []
    cols, cols_t = [[a] for a in acc], [[a] for a in acc_t]
    for j in range(1, L):
        acc = combine(acc, [b.select(dim + 1, j) for b in body])
        for c, a in zip(cols, acc, strict=True):
            c.append(a)
        if r and j < r:
            acc_t = combine(acc_t, [t.narrow(dim, j, 1) for t in tail])
            for c, a in zip(cols_t, acc_t, strict=True):
                c.append(a)
    local = [torch.stack(c, dim + 1) for c in cols]            # (.., C, L, ..)
    local_t = [torch.cat(c, dim) for c in cols_t]

    # 2. carries: inclusive scan of the chunk totals (sequential: C small calls)
    totals = sequential.scan([x.select(dim + 1, L - 1) for x in local], combine, dim)

    # 3. fix-up: chunk c >= 1 is combined with the total of chunks 0..c-1, all in one call
    outs = []
    if C > 1:
        carry = [t.narrow(dim, 0, C - 1).unsqueeze(dim + 1).expand_as(x.narrow(dim, 1, C - 1))
                 .flatten(dim, dim + 1) for t, x in zip(totals, local, strict=True)]
        fixed = combine(carry, [x.narrow(dim, 1, C - 1).flatten(dim, dim + 1) for x in local])
    for i, x in enumerate(local):
        parts = [x.narrow(dim, 0, 1).flatten(dim, dim + 1)]
        if C > 1:
            parts.append(fixed[i])
        outs.append(parts)
    if r:
        last = [t.narrow(dim, C - 1, 1) for t in totals]
        last = [t.expand_as(lt) if t.shape[dim] != lt.shape[dim] else t
                for t, lt in zip(last, local_t, strict=True)]
        fixed_t = combine(last, local_t)
        for parts, ft in zip(outs, fixed_t, strict=True):
            parts.append(ft)
    return [torch.cat(p, dim) for p in outs]


def recurrence(op: Op, b: torch.Tensor, h0: torch.Tensor | None,
               chunk: int | None = None) -> torch.Tensor:
    """All states of ``h_t = A_t h_{t-1} + b_t`` (forward in time) by chunks.

    ``op`` per-step tensors ``(N|1, T, ...)``, ``b`` ``(N, T, H)``, ``h0`` ``(N, H)`` or None.
    """
    N, T, H = b.shape
    L = min(chunk or default_chunk(T), T)
    C, r = divmod(T, L)
    if C <= 1:
        return sequential.recurrence(op, b, h0, False)
    body = op.map_steps(lambda x: x.narrow(1, 0, C * L).unflatten(1, (C, L)))
    body_b = b.narrow(1, 0, C * L).unflatten(1, (C, L))            # (N, C, L, H)

    def step(j: int) -> Op:
        return body.map_steps(lambda x: x[:, :, j])

    # 1. per chunk, X = [P | y]: P = A_{L-1} ... A_0 (the chunk's transfer matrix) and y its
    #    end state from a zero start, advanced together as one H x (H+1) block per chunk.
    eye = torch.eye(H, dtype=b.dtype, device=b.device).expand(N, C, H, H)
    X = torch.cat([step(0).apply(eye, mat=True), body_b[:, :, 0, :, None]], -1)
    for j in range(1, L):
        X = step(j).apply(X, mat=True)
        X[..., H] += body_b[:, :, j]
    P, y = X[..., :H], X[..., H]

    # 2. carries: e_c = P_c e_{c-1} + y_c is the true state at the end of chunk c (C steps)
    e = h0 if h0 is not None else torch.zeros(N, H, dtype=b.dtype, device=b.device)
    starts = [e]
    for c in range(C):
        e = (P[:, c] @ e.unsqueeze(-1)).squeeze(-1) + y[:, c]
        starts.append(e)
    h = torch.stack(starts[:C], 1)                                  # (N, C, H) chunk starts

    # 3. fix-up: every chunk re-run from its true start, position j of all chunks per call;
    #    the tail (r < L positions) starts from e_{C-1} and rides along.
    out = torch.empty_like(b)
    body_out = out.narrow(1, 0, C * L).unflatten(1, (C, L))
    tail = op.map_steps(lambda x: x.narrow(1, C * L, r))          # (empty when r == 0)
    ht = starts[C]
    for j in range(L):
        h = step(j).apply(h) + body_b[:, :, j]
        body_out[:, :, j] = h
        if j < r:
            ht = tail.at(j).apply(ht) + b[:, C * L + j]
            out[:, C * L + j] = ht
    return out
