"""BPPSA over chains of layers: back-propagation as a scan of sparse transposed Jacobians.

Back-propagation through a chain ``y = f_{L-1}(... f_0(x))`` computes ``g_L = dl/dy`` and
``g_i = J_i^T g_{i+1}``: the inclusive scan of ``[g_L, J_{L-1}^T, ..., J_0^T]`` under
``a ⋄ b = b a`` (BPPSA, "Scaling Back-propagation by Parallel Scan Algorithm", eq. 3, Algorithm
1). The Jacobians come from :mod:`paraprop.jacobians` in CSR form. The scan is Blelloch's tree
(written recursively): the up-sweep combines neighbouring pairs, level by level, the down-sweep
hands every prefix to the odd positions below it. ``levels`` caps the tree as in BPPSA §5.3:
beyond that many levels the remaining prefix is scanned sequentially (deep levels multiply
large, dense-ish products that a plain linear scan avoids).

:func:`analyze` records, per scan step, the combines, their FLOPs and the nnz of their results,
next to the per-operator FLOPs of ordinary back-propagation (BPPSA Fig. 10).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from paraprop.jacobians import transposed_jacobian

__all__ = ["ScanStats", "analyze", "backward", "combine_flops", "record"]


@dataclass
class ScanStats:
    """Per-step record of a scan: ``steps[k] = {"level", "phase", "combines", "flops",
    "max_flops", "max_nnz"}`` (``phase``: up, linear, down); ``critical_flops`` is the sum of
    each step's largest combine, the work on the critical path with one worker per combine."""

    steps: list[dict] = field(default_factory=list)

    def record(self, level: int, phase: str, flops: list[int], nnz: list[int]) -> None:
        if flops:
            self.steps.append({"level": level, "phase": phase, "combines": len(flops),
                               "flops": sum(flops), "max_flops": max(flops),
                               "max_nnz": max(nnz)})

    @property
    def critical_flops(self) -> int:
        return sum(s["max_flops"] for s in self.steps if s["phase"] != "linear") + sum(
            s["flops"] for s in self.steps if s["phase"] == "linear")


def _nnz(t: torch.Tensor) -> int:
    return int(t._nnz()) if t.layout == torch.sparse_csr else t.numel()


def combine_flops(a: torch.Tensor, b: torch.Tensor) -> int:
    """Multiply-adds x2 of ``b @ a`` (sparse or dense, ``a`` a matrix or a vector)."""
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


def _scan(xs: list, levels: int | None, level: int, stats: ScanStats | None) -> list:
    """Inclusive scan of ``xs`` under ``_combine``; Blelloch's tree for ``levels`` levels."""
    n = len(xs)
    if n == 1:
        return list(xs)
    if levels is not None and level >= levels:  # the capped top: a linear scan
        out, flops, nnz = [xs[0]], [], []
        for x in xs[1:]:
            if stats is not None:
                flops.append(combine_flops(out[-1], x))
            out.append(_combine(out[-1], x))
            nnz.append(_nnz(out[-1]))
        if stats is not None:
            stats.record(level, "linear", flops, nnz)
        return out
    # up-sweep: neighbouring pairs, all at once
    pairs = [_combine(xs[2 * i], xs[2 * i + 1]) for i in range(n // 2)]
    if stats is not None:
        stats.record(level, "up", [combine_flops(xs[2 * i], xs[2 * i + 1]) for i in range(n // 2)],
                     [_nnz(p) for p in pairs])
    sub = _scan(pairs, levels, level + 1, stats)
    # down-sweep: odd positions are the pair prefixes; even ones combine the previous prefix
    out = [xs[0]]
    flops, nnz = [], []
    for i in range(1, n):
        if i % 2 == 1:
            out.append(sub[i // 2])
        else:
            if stats is not None:
                flops.append(combine_flops(sub[i // 2 - 1], xs[i]))
            out.append(_combine(sub[i // 2 - 1], xs[i]))
            nnz.append(_nnz(out[-1]))
    if stats is not None:
        stats.record(level, "down", flops, nnz)
    return out


def record(layers: Sequence[nn.Module], x: torch.Tensor) -> tuple[list[torch.Tensor],
                                                                   torch.Tensor]:
    """Run a chain on one sample (each layer sees ``a[None]``, a batch of one) and return the
    input of every layer and the output."""
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
             stats: ScanStats | None = None, drop_zero_weights: bool = False
             ) -> list[torch.Tensor]:
    """The gradient w.r.t. the input of every layer, by a Blelloch scan (BPPSA).

    Arguments:
        layers: a chain of layers supported by :func:`paraprop.jacobians.transposed_jacobian`.
        activations: ``activations[i]`` is the input of ``layers[i]`` (one sample, no batch
            dim), as recorded in a forward pass.
        grad_output: gradient of the loss w.r.t. the last layer's output (one sample).
        levels: tree levels run as a tree (BPPSA §5.3); ``None``: all of them (``ceil(log2
            (L + 1))``); ``0``: a linear scan, i.e. ordinary back-propagation.
        stats: a :class:`ScanStats` to fill with the per-step FLOPs and nnz.
        drop_zero_weights: leave pruned (exactly zero) weights out of the Jacobians' patterns.

    Returns:
        ``[g_0, ..., g_{L-1}]``: ``g_i`` shaped like ``activations[i]``.

    Raises:
        TypeError / ValueError: unsupported layers, mismatched lengths or shapes.

    Example:
        >>> net = [nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 2)]
        >>> acts, y = record(net, torch.randn(1, 8, 8))
        >>> grads = backward(net, acts, torch.ones(2))
    """
    jts = _jacobians(layers, activations, drop_zero_weights)
    return _scan_backward(layers, activations, jts, grad_output, levels, stats)


def _scan_backward(layers, activations, jts, grad_output, levels, stats):
    if levels is not None and (not isinstance(levels, int) or levels < 0):
        raise ValueError(f"levels must be a non-negative int or None, got {levels!r}")
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
        prefixes = _scan(elems, levels, 0, stats)
    grads = prefixes[1:][::-1]  # prefix k is the gradient w.r.t. the input of layer L - k
    return [g.reshape(a.shape) for g, a in zip(grads, activations, strict=True)]


def analyze(layers: Sequence[nn.Module], activations: Sequence[torch.Tensor], *,
            levels: int | None = None, drop_zero_weights: bool = False) -> dict:
    """FLOPs and nnz of every BPPSA scan step vs the per-operator FLOPs of back-propagation.

    Returns ``{"steps": [...], "critical_flops", "bp": [per-layer dict], "bp_total_flops",
    "bp_max_flops"}``; a BP operator costs ``2 nnz(J_i^T)`` (its VJP as a sparse
    matrix-vector product) and, for convolutions and linear layers, also its dense FLOPs
    (``drop_zero_weights`` as in :func:`backward`).
    """
    stats = ScanStats()
    with torch.no_grad():
        x_out = layers[-1](activations[-1][None])[0]
    jts = _jacobians(layers, activations, drop_zero_weights)
    _scan_backward(layers, activations, jts, torch.ones_like(x_out), levels, stats)
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
    return {"steps": stats.steps, "critical_flops": stats.critical_flops, "bp": bp,
            "bp_total_flops": sum(b["sparse_flops"] for b in bp),
            "bp_max_flops": max(b["sparse_flops"] for b in bp)}
