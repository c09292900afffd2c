"""The sequential scan: ``T - 1`` dependent combines, the reference every other algorithm equals.

For linear recurrences the step is ``h_t = A_t h_{t-1} + b_t`` (a matrix-vector product, no
matrix-matrix products: the least work of all methods). Here it is a Python loop of ``T`` small
PyTorch steps (``method="sequential"``); :mod:`paraprop.scan.native` runs the same loop in one C
call on the CPU (``method="native"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from paraprop.scan.transitions import Op

Leaves = list[torch.Tensor]


def scan(leaves: Leaves, combine: Callable[[Leaves, Leaves], Leaves], dim: int) -> Leaves:
    """Inclusive scan along ``dim``: ``y_0 = x_0``, ``y_i = combine(y_{i-1}, x_i)``."""
    n = leaves[0].shape[dim]
    acc = [x.narrow(dim, 0, 1) for x in leaves]
    outs = [[a] for a in acc]
    for i in range(1, n):
        acc = combine(acc, [x.narrow(dim, i, 1) for x in leaves])
        for o, a in zip(outs, acc, strict=True):
            o.append(a)
    return [torch.cat(o, dim) for o in outs]


def recurrence(op: Op, b: torch.Tensor, h0: torch.Tensor | None, reverse: bool) -> torch.Tensor:
    """All states of ``h_t = A_t h_prev + b_t`` in ``T`` PyTorch steps; ``b`` ``(N, T, H)``,
    ``h0`` ``(N, H)`` or None (:mod:`paraprop.scan.native` runs the same loop in one C call)."""
    N, T, H = b.shape
    out = torch.empty_like(b)
    order: Sequence[int] = range(T - 1, -1, -1) if reverse else range(T)
    h = h0
    for t in order:
        h = b[:, t] if h is None else op.at(t).apply(h) + b[:, t]
        out[:, t] = h
    return out
