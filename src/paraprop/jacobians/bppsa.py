"""BPPSA over chains of layers: back-propagation as a scan of sparse transposed Jacobians.

Back-propagation through a chain ``y = f_{L-1}(... f_0(x))`` computes ``g_L = dl/dy`` and
``g_i = J_i^T g_{i+1}``: the inclusive scan of ``[g_L, J_{L-1}^T, ..., J_0^T]`` under
``a ⋄ b = b a`` (BPPSA, "Scaling Back-propagation by Parallel Scan Algorithm", eq. 3, Algorithm
1). The Jacobians come from :func:`paraprop.jacobians.transposed_jacobian` in CSR form; the
scan is :func:`paraprop.scan.ragged_scan` (Blelloch's tree over a list of sparse and dense
matrices; ``levels`` caps the tree as in BPPSA §5.3).

:func:`backward` returns the gradients and a :class:`~paraprop.Solution` whose ``stats`` record,
per scan step, the combines, their FLOPs and the nnz of their results; :func:`analyze` sets them
next to the per-operator FLOPs of ordinary back-propagation (BPPSA Fig. 10).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from paraprop.driver import Outcome, build
from paraprop.jacobians import transposed_jacobian
from paraprop.result import Result, Solution
from paraprop.scan.ragged import ragged_scan

__all__ = ["analyze", "backward", "combine_flops", "record"]


def _nnz(t: torch.Tensor) -> int:
    return int(t._nnz()) if t.layout == torch.sparse_csr else t.numel()


def combine_flops(a: torch.Tensor, b: torch.Tensor) -> int:
    """Multiply-adds x2 of ``b @ a`` (sparse or dense, ``a`` a matrix or a vector).

    Example:
        >>> combine_flops(torch.randn(3, 4), torch.randn(2, 3))   # 2 * (2 * 3) * 4
        48
        >>> combine_flops(torch.randn(3), torch.randn(2, 3))      # a matrix-vector product
        12
    """
    if a.dim() == 1:
        return 2 * _nnz(b)
    if b.layout == torch.sparse_csr and a.layout == torch.sparse_csr:
        # sum over k of nnz(column k of b) * nnz(row k of a)
        col_counts = torch.bincount(b.col_indices(), minlength=b.shape[1])
        row_counts = a.crow_indices().diff()
        return 2 * int((col_counts * row_counts).sum())
    return 2 * _nnz(b) * a.shape[1]  # every stored entry of b meets a dense row of a


def _combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a ⋄ b = b a`` (``a`` the earlier element of the scan)."""
    if b.layout != torch.sparse_csr and a.layout == torch.sparse_csr:
        a = a.to_dense()  # dense @ sparse is not supported; the cells' Jacobians are small
    return b @ a


def _cost(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> dict:
    return {"flops": combine_flops(a, b), "nnz": _nnz(out)}


def _critical(steps: list[dict], key: str | None) -> int:
    """The critical path with one worker per combine: the largest combine of every tree step
    plus every combine of the linear part (``key=None``: count the dependent combines)."""
    if key is None:
        return sum(s["combines"] if s["phase"] == "linear" else 1 for s in steps)
    return sum(s[key] if s["phase"] == "linear" else s["max_" + key] for s in steps)


def record(layers: Sequence[nn.Module], x: torch.Tensor) -> tuple[list[torch.Tensor],
                                                                   torch.Tensor]:
    """Run a chain on one sample (each layer sees ``a[None]``, a batch of one) and return the
    input of every layer and the output.

    Example:
        >>> layers = [nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)]
        >>> acts, out = record(layers, torch.randn(4))
        >>> [tuple(a.shape) for a in acts], tuple(out.shape)
        ([(4,), (3,), (3,)], (2,))
    """
    acts, h = [], x
    with torch.no_grad():
        for layer in layers:
            acts.append(h)
            h = layer(h[None])[0]
    return acts, h


def _jacobians(layers: Sequence[nn.Module], activations: Sequence[torch.Tensor],
               drop_zero_weights: bool = False) -> list:
    if len(layers) != len(activations):
        raise ValueError(f"{len(layers)} layers but {len(activations)} activations (one input "
                         "per layer)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        return [transposed_jacobian(layer, a, drop_zero_weights=drop_zero_weights)
                for layer, a in zip(layers, activations, strict=True)]


def backward(layers: Sequence[nn.Module], activations: Sequence[torch.Tensor],
             grad_output: torch.Tensor, *, levels: int | None = None,
             drop_zero_weights: bool = False) -> tuple[list[torch.Tensor], Solution]:
    """The gradient w.r.t. the input of every layer, by a Blelloch scan (BPPSA).

    Arguments:
        layers: a chain of layers supported by :func:`paraprop.jacobians.transposed_jacobian`.
        activations: ``activations[i]`` is the input of ``layers[i]`` (one sample, no batch
            dim), as recorded in a forward pass.
        grad_output: gradient of the loss w.r.t. the last layer's output (one sample).
        levels: tree levels run as a tree (BPPSA §5.3); ``None``: all of them (``floor(log2
            (L + 1))``); ``0``: a linear scan, i.e. ordinary back-propagation.
        drop_zero_weights: leave pruned (exactly zero) weights out of the Jacobians' patterns.

    Returns:
        ``(grads, solution)``: ``grads = [g_0, ..., g_{L-1}]``, ``g_i`` shaped like
        ``activations[i]``, and the :class:`~paraprop.Solution` of the scan, a direct
        computation: ``value`` the gradients flattened and concatenated in layer order;
        ``method`` ``"blelloch"`` (``"sequential"`` for ``levels=0``); ``iterations`` =
        ``evaluations`` = the dependent steps (one per up- or down-sweep, one per combine of
        the linear part); ``converged`` ``True``; no residuals; ``stats``: ``steps`` (one
        record per scan step, ``{"level", "phase", "combines", "flops", "max_flops", "nnz",
        "max_nnz"}``, as :func:`paraprop.scan.ragged_scan` records them; ``phase``: up,
        linear, down), ``combines`` and ``flops`` (totals), ``critical_flops`` (the largest
        combine of every tree step plus the linear part: the work on the critical path with
        one worker per combine), ``L`` (layers) and ``time_s``.

    Raises:
        TypeError / ValueError: unsupported layers, mismatched lengths or shapes, a bad
            ``levels``.

    Example:
        >>> net = [nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 2)]
        >>> acts, y = record(net, torch.randn(1, 8, 8))
        >>> grads, sol = backward(net, acts, torch.ones(2))
        >>> [tuple(g.shape) for g in grads][:2], sol.iterations
        ([(1, 8, 8), (4, 6, 6)], 4)
    """
    start = time.perf_counter()
    jts = _jacobians(layers, activations, drop_zero_weights)
    return _scan_backward(layers, activations, jts, grad_output, levels, start)


def _scan_backward(layers, activations, jts, grad_output, levels, start):
    n_out = jts[-1].shape[1]
    if grad_output.numel() != n_out:
        raise ValueError(f"grad_output has {grad_output.numel()} elements, the last layer's "
                         f"output has {n_out}")
    for i in range(len(jts) - 1):
        if jts[i].shape[1] != jts[i + 1].shape[0]:
            raise ValueError(f"layer {i} ({type(layers[i]).__name__}) outputs "
                             f"{jts[i].shape[1]} values but layer {i + 1} takes "
                             f"{jts[i + 1].shape[0]}")
    elems = [grad_output.detach().flatten()] + jts[::-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        prefixes, steps = ragged_scan(elems, _combine, levels=levels, cost=_cost)
    # prefix k is the gradient w.r.t. the input of layer L - k
    grads = [g.reshape(a.shape) for g, a in zip(prefixes[1:][::-1], activations, strict=True)]
    depth = _critical(steps, None)
    stats = {"steps": steps, "combines": sum(s["combines"] for s in steps),
             "flops": sum(s["flops"] for s in steps), "critical_flops": _critical(steps, "flops"),
             "L": len(jts), "time_s": time.perf_counter() - start}
    time_s = stats.pop("time_s")
    out = Outcome(torch.cat([g.flatten() for g in grads]), Result.successful, evaluations=depth,
                  sequential_steps=depth, error_estimate=0.0, stats=stats)
    sol = build("sequential" if levels == 0 else "blelloch", out, iterations=depth,
                time_s=time_s)
    return grads, sol


def analyze(layers: Sequence[nn.Module], activations: Sequence[torch.Tensor], *,
            levels: int | None = None, drop_zero_weights: bool = False) -> dict:
    """FLOPs and nnz of every BPPSA scan step vs the per-operator FLOPs of back-propagation.

    Returns ``{"steps": [...], "critical_flops", "bp": [per-layer dict], "bp_total_flops",
    "bp_max_flops"}`` (``steps`` and ``critical_flops`` as in :func:`backward`'s
    ``Solution.stats``); a BP operator costs ``2 nnz(J_i^T)`` (its VJP as a sparse
    matrix-vector product) and, for convolutions and linear layers, also its dense FLOPs
    (``drop_zero_weights`` as in :func:`backward`).

    Example:
        >>> layers = [nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)]
        >>> report = analyze(layers, record(layers, torch.randn(4))[0])
        >>> [b["nnz"] for b in report["bp"]], report["bp_total_flops"]   # J^T: 4x3, 3x3 diag, 3x2
        ([12, 3, 6], 42)
    """
    start = time.perf_counter()
    with torch.no_grad():
        x_out = layers[-1](activations[-1][None])[0]
    jts = _jacobians(layers, activations, drop_zero_weights)
    _, sol = _scan_backward(layers, activations, jts, torch.ones_like(x_out), levels, start)
    bp = []
    for layer, a, jt in zip(layers, activations, jts, strict=True):
        sparse_flops = 2 * _nnz(jt)
        dense = None
        if isinstance(layer, nn.Conv2d):
            with torch.no_grad():
                out = layer(a[None])[0]
            k = math.prod(layer.kernel_size)
            dense = 2 * layer.in_channels * k * out.numel()
        elif isinstance(layer, nn.Linear):
            dense = 2 * layer.in_features * layer.out_features
        bp.append({"layer": type(layer).__name__, "nnz": _nnz(jt), "sparse_flops": sparse_flops,
                   "dense_flops": dense if dense is not None else sparse_flops})
    return {"steps": sol.stats["steps"], "critical_flops": sol.stats["critical_flops"], "bp": bp,
            "bp_total_flops": sum(b["sparse_flops"] for b in bp),
            "bp_max_flops": max(b["sparse_flops"] for b in bp)}
