"""Two interleaved half circles ("two moons"), drawn here: no download, no scikit-learn call."""

from __future__ import annotations

import math

import torch

from paraprop import checks


def make_moons(n: int, *, noise: float = 0.05, seed: int = 0) -> torch.Tensor:
    """``n`` points on two interleaved half circles with Gaussian noise, standardised.

    The upper moon is the unit half circle ``(cos a, sin a)``, the lower one
    ``(1 - cos a, 1/2 - sin a)``, with ``a`` uniform in ``[0, pi]``; ``n // 2`` points fall on
    the upper moon, in random order (every prefix holds both moons). Noise of standard deviation
    ``noise`` is added before each coordinate is standardised to zero mean and unit variance.
    Drawn in float64 from a generator of its own (the global random state is not touched).

    Arguments:
        n: number of points (at least 2).
        noise: standard deviation of the Gaussian noise, in the units of the unit circle.
        seed: seed of the generator; the same seed gives the same points.

    Returns:
        The points, shape ``(n, 2)``, float32.

    Raises:
        ValueError: ``n`` not an int >= 2, ``noise`` not a finite number >= 0, or ``seed``
            not an int >= 0.

    Example:
        >>> x = paraprop.data.make_moons(100, seed=1)
        >>> x.shape, x.dtype
        (torch.Size([100, 2]), torch.float32)
    """
    if not checks.is_int(n) or n < 2:
        raise ValueError(f"n must be an int >= 2, got {n!r}")
    checks.nonneg_number("noise", noise, finite=True)
    checks.nonneg_int("seed", seed)
    g = torch.Generator().manual_seed(seed)
    upper = torch.randperm(n, generator=g) < n // 2
    a = torch.rand(n, generator=g, dtype=torch.float64) * math.pi
    x = torch.where(upper, a.cos(), 1 - a.cos())
    y = torch.where(upper, a.sin(), 0.5 - a.sin())
    pts = torch.stack([x, y], dim=1)
    pts = pts + noise * torch.randn(n, 2, generator=g, dtype=torch.float64)
    pts = (pts - pts.mean(0)) / pts.std(0)
    return pts.float()
