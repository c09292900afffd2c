"""BPPSA's synthetic bitstream classification task (Wang et al. 2020, §4.1)."""

from __future__ import annotations

import torch


def bitstreams(T: int, batch: int, *, generator: torch.Generator, classes: int = 10):
    """BPPSA's synthetic task: ``x_t ~ Bernoulli(0.05 + 0.1 c)``, ``c`` the label (0..9).

    Returns ``(x, y)`` with ``x`` ``(T, batch, 1)`` float32 bits and ``y`` ``(batch,)`` labels.

    Example:
        >>> x, y = bitstreams(1000, 4, generator=torch.Generator().manual_seed(0), classes=4)
        >>> x.shape, y.shape
        (torch.Size([1000, 4, 1]), torch.Size([4]))
        >>> bool(((x.mean(0).squeeze(1) - (0.05 + 0.1 * y)).abs() < 0.05).all())   # P(1)
        True
    """
    y = torch.randint(0, classes, (batch,), generator=generator)
    p = (0.05 + 0.1 * y.float()).expand(T, batch)
    return torch.bernoulli(p, generator=generator).unsqueeze(-1), y
