"""MADE masks (Germain et al. 2015, "MADE: Masked Autoencoder for Distribution Estimation") and the
masked linear layer they multiply."""

from __future__ import annotations

import torch
from torch import nn


def made_degrees(features: int, hidden: tuple[int, ...],
                 order: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Degrees of the MADE units (Germain et al. 2015): inputs get their order ``1..D``, hidden
    units a degree in ``[1, D-1]`` (cycled, deterministic), so output ``d`` sees inputs ``< d``."""
    if order is None:
        order = torch.arange(1, features + 1)
    degrees = [order]
    for h in hidden:
        degrees.append(torch.arange(h) % max(features - 1, 1) + 1)
    return degrees


def made_masks(features: int, hidden: tuple[int, ...],
               order: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Masks (out, in) of every layer of a MADE; the last one is strictly autoregressive."""
    deg = made_degrees(features, hidden, order=order)
    masks = [(d_out[:, None] >= d_in[None, :]).float() for d_in, d_out in zip(deg, deg[1:],
                                                                              strict=False)]
    masks.append((deg[0][:, None] > deg[-1][None, :]).float())
    return masks


class MaskedLinear(nn.Linear):
    """``nn.Linear`` whose weight is multiplied by a fixed 0/1 mask (out, in)."""

    def __init__(self, in_features: int, out_features: int, mask: torch.Tensor):
        super().__init__(in_features, out_features)
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias)
