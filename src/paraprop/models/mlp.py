"""A deep MLP with orthogonal weights, for the triangular-solve benchmarks and demos."""

from __future__ import annotations

import torch
from torch import nn


def deep_mlp(l: int, width: int, *, act=nn.Tanh, seed: int = 0,
             dtype=torch.float32) -> nn.Sequential:
    """``l`` Linear(width, width) layers, each followed by ``act``; orthogonal weights, zero
    biases (a depth-``l`` network whose gradients stay O(1)). The global random state is left
    as it was (the weights are those of the recorded runs, drawn from a forked state).

    Example:
        >>> net = deep_mlp(4, 8)
        >>> len(net), type(net[1]).__name__
        (8, 'Tanh')
        >>> torch.allclose(net[0].weight @ net[0].weight.T, torch.eye(8), atol=1e-5)
        True
    """
    with torch.random.fork_rng(devices=[]):
        g = torch.manual_seed(seed)
        mods: list[nn.Module] = []
        for _ in range(l):
            lin = nn.Linear(width, width)
            nn.init.orthogonal_(lin.weight, generator=g)
            nn.init.zeros_(lin.bias)
            mods += [lin, act()]
    return nn.Sequential(*mods).to(dtype)
