"""Two interleaved half circles ("two moons"), drawn here: no download, no scikit-learn call."""

from __future__ import annotations

import math

import torch


def make_moons(n: int, *, noise: float = 0.05, seed: int = 0) -> torch.Tensor:
    """``n`` points ``(n, 2)`` float32 on two interleaved half circles with Gaussian noise,
    standardised to zero mean and unit variance per coordinate."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2, got {n!r}")
    g = torch.Generator().manual_seed(seed)
    upper = torch.randperm(n, generator=g) < n // 2      # which moon, in random order
    theta = torch.rand(n, generator=g, dtype=torch.float64) * math.pi
    x = torch.where(upper, theta.cos(), 1 - theta.cos())
    y = torch.where(upper, theta.sin(), 0.5 - theta.sin())
    pts = torch.stack([x, y], dim=1) + noise * torch.randn(n, 2, generator=g, dtype=torch.float64)
    pts = (pts - pts.mean(0)) / pts.std(0)
    return pts.float()
