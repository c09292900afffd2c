"""Residual branches used by the tests, the benchmark, the demo and the training job.

- :class:`TanhBlock`: ``F(u) = tanh(W u + b)`` on vectors (a residual MLP layer).
- :class:`ConvBlock`: ``F(u) = act(conv3x3(u))`` on images, channels kept (Kirby et al.'s MNIST
  layer, a convolution and a nonlinearity per residual step).
- :func:`mlp_blocks`: a deep residual MLP whose weights are either drawn independently per layer
  (``"iid"``) or vary smoothly with depth (``"smooth"``: linear interpolation between a few
  random anchor layers, the discretisation of an ODE with smooth ``theta(t)``, the setting in
  which MGRIT's convergence does not depend on depth).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["ConvBlock", "FastTanhBlock", "TanhBlock", "conv_blocks", "mlp_blocks"]


class TanhBlock(nn.Module):
    """``tanh(W u + b)``: maps ``(..., width)`` to the same shape."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(u))


class FastTanhBlock(TanhBlock):
    """:class:`TanhBlock` with ``batched_forward``: ``K`` layers at once by one ``baddbmm``
    (used by :class:`paraprop.multigrid.ForwardStepper` instead of ``vmap``)."""

    @staticmethod
    def batched_forward(params: dict, buffers: dict, x: torch.Tensor) -> torch.Tensor:
        w, b = params["linear.weight"], params["linear.bias"]
        k, width = x.shape[0], x.shape[-1]
        y = torch.baddbmm(b.unsqueeze(1), x.reshape(k, -1, width), w.transpose(1, 2))
        return torch.tanh(y).reshape(x.shape[:-1] + (w.shape[1],))


class ConvBlock(nn.Module):
    """``act(conv3x3(u))`` with ``channels`` in and out, padding 1: keeps ``(N, C, H, W)``."""

    def __init__(self, channels: int, act: str = "relu"):
        super().__init__()
        if act not in ("relu", "tanh"):
            raise ValueError(f"act must be 'relu' or 'tanh', got {act!r}")
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = act

    def extra_repr(self) -> str:
        return f"act={self.act!r}"

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        y = self.conv(u)
        return torch.relu(y) if self.act == "relu" else torch.tanh(y)


def mlp_blocks(depth: int, width: int, *, kind: str = "smooth", gain: float = 1.0,
               anchors: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32,
               fast: bool = False) -> list[TanhBlock]:
    """``depth`` :class:`TanhBlock` layers with weights of standard deviation
    ``gain / sqrt(width)`` and biases of 0.1.

    Arguments:
        kind: ``"iid"`` (independent weights per layer) or ``"smooth"`` (linear interpolation
            in depth between ``anchors`` random layers).
        seed: seed of the weight generator (the same seed gives the same weights).
        dtype: parameter dtype.
        fast: make :class:`FastTanhBlock` layers (same weights, a hand-batched kernel).
    """
    if kind not in ("iid", "smooth"):
        raise ValueError(f"kind must be 'iid' or 'smooth', got {kind!r}")
    if depth < 1 or width < 1 or anchors < 2:
        raise ValueError(f"need depth >= 1, width >= 1, anchors >= 2; got {depth}, {width}, "
                         f"{anchors}")
    g = torch.Generator().manual_seed(seed)
    count = depth if kind == "iid" else anchors
    w = torch.randn(count, width, width, generator=g, dtype=torch.float64) * gain \
        / math.sqrt(width)
    b = torch.randn(count, width, generator=g, dtype=torch.float64) * 0.1
    if kind == "smooth":
        t = torch.linspace(0, anchors - 1, depth, dtype=torch.float64) if depth > 1 \
            else torch.zeros(1, dtype=torch.float64)
        i = t.floor().long().clamp(max=anchors - 2)
        f = (t - i)[:, None]
        w = (1 - f[..., None]) * w[i] + f[..., None] * w[i + 1]
        b = (1 - f) * b[i] + f * b[i + 1]
    blocks = []
    for n in range(depth):
        blk = (FastTanhBlock if fast else TanhBlock)(width).to(dtype)
        with torch.no_grad():
            blk.linear.weight.copy_(w[n])
            blk.linear.bias.copy_(b[n])
        blocks.append(blk)
    return blocks


def conv_blocks(depth: int, channels: int, *, act: str = "relu", seed: int = 0,
                dtype: torch.dtype = torch.float32) -> list[ConvBlock]:
    """``depth`` :class:`ConvBlock` layers with PyTorch's default initialisation (seeded)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return [ConvBlock(channels, act).to(dtype) for _ in range(depth)]
