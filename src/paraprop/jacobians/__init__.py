"""Analytic transposed Jacobians: CSR for convolution, ReLU, max-pooling, linear and flatten
layers (BPPSA, §3.3-3.4, Table 1, Appendix D), dense for the RNN and GRU cells (Appendix E).

``transposed_jacobian(layer, x)`` takes **one sample** (no batch dim) and returns ``J^T`` of
shape ``(x.numel(), layer(x).numel())`` with ``J^T[i, j] = d layer(x)_j / d x_i``. For a batch,
call it once per sample: the CSR pattern is cached per layer configuration (see
:mod:`paraprop.jacobians.patterns`), so each further sample only fills ``values``.

:mod:`paraprop.jacobians.bppsa` (imported on first use) back-propagates through a chain of
layers as a scan of these Jacobians (BPPSA) and analyses the scan's FLOPs.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.nn import functional as F

from paraprop.jacobians import patterns
from paraprop.jacobians.cells import gru_cell, rnn_cell

__all__ = ["SUPPORTED", "bppsa", "patterns", "pattern_of", "transposed_jacobian"]

SUPPORTED = (nn.Conv2d, nn.ReLU, nn.MaxPool2d, nn.Linear, nn.Flatten, nn.RNNCell, nn.GRUCell)


def __getattr__(name: str):
    if name == "bppsa":  # imported on first use: it imports this package
        return importlib.import_module("paraprop.jacobians.bppsa")
    raise AttributeError(f"module 'paraprop.jacobians' has no attribute {name!r}")


def _pair(v) -> tuple[int, int]:
    return tuple(v) if isinstance(v, tuple | list) else (v, v)


def pattern_of(layer: nn.Module, x: torch.Tensor) -> tuple[patterns.Pattern, tuple[int, ...]]:
    """The cached CSR pattern of ``layer``'s transposed Jacobian at inputs shaped like ``x``,
    and the output shape (one sample).

    Example:
        >>> conv, x = nn.Conv2d(1, 2, 3), torch.randn(1, 5, 5)
        >>> pattern, out_shape = pattern_of(conv, x)
        >>> pattern.shape, out_shape            # J^T is (x.numel(), conv(x).numel())
        ((25, 18), (2, 3, 3))
        >>> pattern_of(conv, x)[0] is pattern   # cached per layer configuration
        True
    """
    _check(layer, x)
    if isinstance(layer, nn.Conv2d):
        pad = layer.padding
        if isinstance(pad, str):
            raise ValueError(f"{layer}: string padding {pad!r} is not supported; give numbers")
        return patterns.conv2d(tuple(x.shape), tuple(layer.weight.shape), _pair(layer.stride),
                               _pair(pad), _pair(layer.dilation))
    if isinstance(layer, nn.MaxPool2d):
        return patterns.max_pool2d(tuple(x.shape), _pair(layer.kernel_size),
                                   _pair(layer.stride or layer.kernel_size),
                                   _pair(layer.padding), _pair(layer.dilation),
                                   bool(layer.ceil_mode))
    if isinstance(layer, nn.ReLU):
        return patterns.diagonal(x.numel()), tuple(x.shape)
    if isinstance(layer, nn.Flatten):
        return patterns.diagonal(x.numel()), (x.numel(),)
    if isinstance(layer, nn.Linear):
        return patterns.dense(layer.in_features, layer.out_features), (layer.out_features,)
    raise TypeError(_unsupported(layer))


def transposed_jacobian(layer: nn.Module, x, *, drop_zero_weights: bool = False
                        ) -> torch.Tensor:
    """The transposed Jacobian of ``layer`` at ``x`` (one sample).

    Arguments:
        layer: ``nn.Conv2d`` (any kernel, stride, padding, dilation; ``groups=1``),
            ``nn.ReLU``, ``nn.MaxPool2d``, ``nn.Linear``, ``nn.Flatten`` (CSR results), or
            ``nn.RNNCell`` / ``nn.GRUCell`` (dense, w.r.t. the hidden state; ``x`` is then the
            pair ``(input, hidden)``).
        drop_zero_weights: for convolutions and linear layers, leave the entries of exactly
            zero weights out of the pattern (pruned networks, BPPSA §5.3).
        x: the layer's input, one sample: ``(C, H, W)`` for convolution and pooling, ``(F,)``
            for linear layers, any shape for ReLU and Flatten.

    Returns:
        ``torch.sparse_csr_tensor`` of shape ``(x.numel(), y.numel())`` (dense ``(H, H)`` for
        the cells).

    Raises:
        TypeError: an unsupported layer (named).
        ValueError: an input of the wrong shape, or an unsupported option (groups, string
            padding), named with the value.

    Example:
        >>> conv = nn.Conv2d(3, 8, 3, padding=1)
        >>> JT = transposed_jacobian(conv, torch.randn(3, 10, 10))
        >>> JT.shape
        torch.Size([300, 800])
    """
    if isinstance(layer, nn.RNNCell):
        return rnn_cell(layer, *_pair_input(layer, x))
    if isinstance(layer, nn.GRUCell):
        return gru_cell(layer, *_pair_input(layer, x))
    pat, _ = pattern_of(layer, x)
    if drop_zero_weights and isinstance(layer, nn.Conv2d):
        pat = patterns.without_zero_weights(pat, layer.weight)
    elif drop_zero_weights and isinstance(layer, nn.Linear):
        pat = patterns.without_zero_weights(pat, layer.weight.t())
    source = pat.on(x.device)[3]
    if isinstance(layer, nn.Conv2d):
        values = layer.weight.detach().flatten().index_select(0, source)
    elif isinstance(layer, nn.ReLU):
        values = (x.detach().flatten() > 0).to(x.dtype)
    elif isinstance(layer, nn.Flatten):
        values = torch.ones(x.numel(), dtype=x.dtype, device=x.device)
    elif isinstance(layer, nn.Linear):
        values = layer.weight.detach().t().flatten().index_select(0, source)
    else:  # max-pooling: 1 where the input is its window's argmax
        assert isinstance(layer, nn.MaxPool2d)   # pattern_of refused every other layer
        _, idx = F.max_pool2d(x.detach()[None], layer.kernel_size, layer.stride,
                              layer.padding, layer.dilation, layer.ceil_mode,
                              return_indices=True)
        C, H, W = x.shape
        arg = (idx[0] + torch.arange(C, device=x.device).view(-1, 1, 1) * H * W).flatten()
        _, col, row, _ = pat.on(x.device)
        values = (row == arg.index_select(0, col)).to(x.dtype)
    return pat.csr(values)


def _check(layer, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor (one sample), got {type(x).__name__}")
    if isinstance(layer, nn.Conv2d | nn.MaxPool2d) and x.dim() != 3:
        raise ValueError(f"{type(layer).__name__} expects one sample (C, H, W), got shape "
                         f"{tuple(x.shape)}")
    if isinstance(layer, nn.Conv2d):
        if layer.padding_mode != "zeros":
            raise ValueError(f"{layer}: padding_mode={layer.padding_mode!r} is not supported "
                             "(zeros only)")
        if layer.groups != 1:
            raise ValueError(f"{layer}: groups={layer.groups} is not supported (groups=1 only)")
        if x.shape[0] != layer.in_channels:
            raise ValueError(f"{layer}: input has {x.shape[0]} channels, expected "
                             f"{layer.in_channels}")
    if isinstance(layer, nn.Linear) and tuple(x.shape) != (layer.in_features,):
        raise ValueError(f"{layer}: expects one sample ({layer.in_features},), got shape "
                         f"{tuple(x.shape)}")
    if isinstance(layer, nn.MaxPool2d) and layer.return_indices:
        raise ValueError(f"{layer}: return_indices=True is not supported")


def _pair_input(layer, x):
    if not isinstance(x, tuple | list) or len(x) != 2:
        got = type(x).__name__ + (f" of length {len(x)}" if isinstance(x, tuple | list) else "")
        raise TypeError(f"{type(layer).__name__}: x must be the pair (input, hidden), got {got}")
    return x


def _unsupported(layer) -> str:
    names = ", ".join(c.__name__ for c in SUPPORTED)
    return (f"no analytic transposed Jacobian for {type(layer).__name__} ({layer}); supported: "
            f"{names}")
