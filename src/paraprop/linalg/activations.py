"""Elementwise activations and their derivatives: the diagonal scalings ``D^(k)``, ``E^(k)``.

Naumov 2017 (eq. 20-21) collects the activation derivatives of layer ``k`` at the points of a
pass in a diagonal matrix. This module evaluates a chain of elementwise activations and the
derivative of the chain (the product of the derivatives) at given pre-activations.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SUPPORTED", "WITH_SETTINGS", "chain_value_and_derivative", "signature"]

SUPPORTED = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.GELU, nn.Identity)
# the activations whose signature depends on their settings (the others: on their type alone)
WITH_SETTINGS = (nn.LeakyReLU, nn.GELU)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def signature(act: nn.Module) -> tuple:
    """A hashable description of an activation (type and parameters)."""
    if isinstance(act, nn.LeakyReLU):
        return ("leaky_relu", float(act.negative_slope))
    if isinstance(act, nn.GELU):
        return ("gelu", act.approximate)
    return (type(act).__name__,)


def _value_and_derivative(sig: tuple, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kind = sig[0]
    if kind == "ReLU":
        return torch.relu(y), (y > 0).to(y.dtype)
    if kind == "leaky_relu":
        slope = sig[1]
        return F.leaky_relu(y, slope), torch.full_like(y, slope).masked_fill_(y > 0, 1.0)
    if kind == "Tanh":
        out = torch.tanh(y)
        return out, 1 - out * out
    if kind == "Sigmoid":
        out = torch.sigmoid(y)
        return out, out * (1 - out)
    if kind == "gelu" and sig[1] == "tanh":
        inner = _SQRT_2_OVER_PI * (y + 0.044715 * y ** 3)
        th = torch.tanh(inner)
        d = 0.5 * (1 + th) + 0.5 * y * (1 - th * th) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * y * y)
        return F.gelu(y, approximate="tanh"), d
    if kind == "gelu":
        cdf = 0.5 * (1 + torch.erf(y * _INV_SQRT_2))
        pdf = torch.exp(-0.5 * y * y) * _INV_SQRT_2PI
        return F.gelu(y), cdf + y * pdf
    if kind == "Identity":
        return y, torch.ones_like(y)
    raise TypeError(f"unsupported activation {kind!r}")  # pragma: no cover - parse rejects it


def chain_value_and_derivative(chain: tuple[tuple, ...], y: torch.Tensor):
    """``(f(y), f'(y))`` for ``f = f_m o ... o f_1`` given by activation signatures.

    Returns ``(y, None)`` for an empty chain (the identity, no scaling).
    """
    if not chain:
        return y, None
    value, deriv = y, None
    for sig in chain:
        value, d = _value_and_derivative(sig, value)
        deriv = d if deriv is None else deriv * d
    return value, deriv
