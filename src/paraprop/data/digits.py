"""The 8x8 handwritten digits that ship inside scikit-learn (no download)."""

from __future__ import annotations

import torch


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits: images ``(N, 8, 8)`` float32 in ``[0, 1]`` and labels ``(N,)`` int64.

    Example:
        >>> images, labels = load_digits()
        >>> images.shape, float(images.max()), labels[:5].tolist()
        (torch.Size([1797, 8, 8]), 1.0, [0, 1, 2, 3, 4])
    """
    from sklearn.datasets import load_digits as _load

    d = _load()
    images = torch.tensor(d.images, dtype=torch.float32) / 16.0
    return images, torch.tensor(d.target, dtype=torch.long)
