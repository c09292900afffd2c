"""The sequential scan: ``T - 1`` dependent combines, the reference every other algorithm equals.

For linear recurrences the step is ``h_t = A_t h_{t-1} + b_t`` (a matrix-vector product, no
matrix-matrix products: the least work of all algorithms). On the CPU the whole loop runs in one
native call when :mod:`paraprop.scan.native` is available; otherwise it is a Python loop of
``T`` small PyTorch steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from paraprop.scan import native
from paraprop.scan.operators import Op

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


def recurrence(op: Op, b: torch.Tensor, h0: torch.Tensor | None, reverse: bool,
               use_native: bool | None) -> torch.Tensor:
    """All states of ``h_t = A_t h_prev + b_t``; ``b`` ``(N, T, H)``, ``h0`` ``(N, H)`` or None.

    ``use_native``: ``None`` uses the native kernel when it can run, ``True`` requires it,
    ``False`` never uses it.
    """
    if use_native is not False and native.supports(b, h0, *op.tensors()):
        return _native(op, b, h0, reverse)
    if use_native:
        raise RuntimeError(
            "native=True but the native scan kernels cannot run here: "
            f"{native.status() if not native.available() else 'they need CPU float32/float64 '}"
            "tensors of one dtype")
    return _torch_loop(op, b, h0, reverse)


def _torch_loop(op: Op, b: torch.Tensor, h0: torch.Tensor | None, reverse: bool) -> torch.Tensor:
    N, T, H = b.shape
    out = torch.empty_like(b)
    order: Sequence[int] = range(T - 1, -1, -1) if reverse else range(T)
    h = h0
    for t in order:
        h = b[:, t] if h is None else op.at(t).apply(h) + b[:, t]
        out[:, t] = h
    return out


def _rows_contiguous(x: torch.Tensor | None, feature_dims: int) -> torch.Tensor | None:
    """``x`` with its trailing ``feature_dims`` dims contiguous (batch/time strides are free)."""
    if x is None:
        return None
    shape, strides = x.shape[-feature_dims:], x.stride()[-feature_dims:]
    expect, ok = 1, True
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size > 1 and stride != expect:
            ok = False
        expect *= size
    return x if ok else x.contiguous()


def _native(op: Op, b: torch.Tensor, h0: torch.Tensor | None, reverse: bool) -> torch.Tensor:
    b = _rows_contiguous(b, 1)
    h0 = _rows_contiguous(h0, 1)
    out = torch.empty_like(b)
    if out.stride(-1) != 1:
        out = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    if op.kind == "dense":
        return native.dense(_rows_contiguous(op.a, 2), b, h0, out, reverse)
    if op.kind == "diag":
        return native.diag(_rows_contiguous(op.a, 1), b, h0, out, reverse)
    if op.kind == "lstm":   # the kernel takes W_hh (transposed steps) or W_hh^T (forward)
        W = (op.W if op.tr else op.W.t()).contiguous()
        return native.lstm(_rows_contiguous(op.s, 1), _rows_contiguous(op.f, 1),
                           _rows_contiguous(op.k, 1), W, op.tr, b, h0, out, reverse)
    LT = op.L.t().contiguous() if op.L is not None else None   # the kernel takes L^T and R^T
    RT = op.R.t().contiguous() if op.R is not None else None
    return native.factored(_rows_contiguous(op.d, 1), _rows_contiguous(op.s, 1), LT, RT, b, h0,
                           out, reverse)
