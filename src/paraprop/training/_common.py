"""What the MADE and PixelCNN training jobs share: the data switch and the Adam loop."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tqdm import tqdm

from paraprop.data import load_digits, load_mnist


def load_images(data: str, *, mnist_dir=None) -> tuple[torch.Tensor, int]:
    """Images ``(N, S, S)`` in ``[0, 1]`` and their number of grey levels (17 for the digits,
    256 for MNIST)."""
    if data == "digits":
        return load_digits()[0], 17
    if data == "mnist":
        return load_mnist(mnist_dir)[0], 256
    raise ValueError(f"unknown data={data!r}; choose 'digits' or 'mnist'")


def fit(model: torch.nn.Module, x: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor], *,
        epochs: int, batch_size: int, lr: float, seed: int, progress: bool, desc: str,
        label: str) -> list[float]:
    """Adam on ``loss(batch)`` over shuffled mini-batches of ``x``; returns the mean loss of every
    epoch (shown as ``label`` in the progress bar). The model is left in eval mode."""
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    history = []
    steps = math.ceil(len(x) / batch_size)
    bar = tqdm(total=epochs * steps, desc=desc, disable=not progress, leave=False)
    model.train()
    for _ in range(epochs):
        total = 0.0
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            value = loss(x[idx])
            opt.zero_grad()
            value.backward()
            opt.step()
            total += value.item() * len(idx)
            bar.update()
        history.append(total / len(x))
        bar.set_postfix({label: f"{history[-1]:.4f}"})
    bar.close()
    model.eval()
    return history
