"""torchvision's DenseNet at a small configuration (imported lazily: torchvision is optional)."""

from __future__ import annotations

import torch


def small_densenet(seed: int = 0, *, growth_rate: int = 8, block_config=(2, 3, 4, 3),
                   num_init_features: int = 8, bn_size: int = 2) -> torch.nn.Module:
    """torchvision's DenseNet class at a small configuration (by default 17 states), random
    weights (seeded), eval mode.

    Example:
        >>> import torchvision                  # the vision extra: skipped without it
        >>> net = small_densenet()
        >>> net(torch.randn(1, 3, 32, 32)).shape, net.training
        (torch.Size([1, 10]), False)
        >>> len(paraprop.networks.as_recurrence(net).steps)
        17
    """
    import torchvision

    torch.manual_seed(seed)
    return torchvision.models.DenseNet(growth_rate=growth_rate, block_config=tuple(block_config),
                                       num_init_features=num_init_features, bn_size=bn_size,
                                       num_classes=10).eval()
