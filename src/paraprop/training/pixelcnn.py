"""``paraprop train pixelcnn``: fit a gated PixelCNN to the digits or MNIST."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from tqdm import tqdm

from paraprop.data import load_digits, load_mnist
from paraprop.models import PixelCNN

NAME = "pixelcnn"
HELP = "train a gated PixelCNN (discretized logistic mixture) on digits or MNIST"


def pixel_data(data: str, *, mnist_dir=None) -> tuple[torch.Tensor, int]:
    """Images ``(N, 1, S, S)`` on the grid of ``levels`` values in ``[-1, 1]``, and ``levels``."""
    if data == "digits":
        images, _ = load_digits()
        levels = 17
    elif data == "mnist":
        images, _ = load_mnist(mnist_dir)
        levels = 256
    else:
        raise ValueError(f"unknown data={data!r}; choose 'digits' or 'mnist'")
    q = levels - 1
    x = torch.round(images * q) / q * 2 - 1
    return x[:, None], levels


def train_pixelcnn(model: PixelCNN, x: torch.Tensor, *, epochs: int, batch_size: int = 64,
                   lr: float = 2e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Maximum likelihood with Adam; returns bits per dimension of every epoch."""
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    dims = x[0].numel() * math.log(2)
    history = []
    steps = math.ceil(len(x) / batch_size)
    bar = tqdm(total=epochs * steps, desc="train pixelcnn", disable=not progress, leave=False)
    model.train()
    for _ in range(epochs):
        total = 0.0
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            loss = -model.log_prob(x[idx]).mean() / dims
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            bar.update()
        history.append(total / len(x))
        bar.set_postfix(bpd=f"{history[-1]:.3f}")
    bar.close()
    model.eval()
    return history


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", choices=["digits", "mnist"], default="digits")
    p.add_argument("--mnist-dir", default=None, help="directory of the MNIST IDX files")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--mixtures", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="checkpoint (default results/pixelcnn_DATA.pt)")


def run(args) -> int:
    x, levels = pixel_data(args.data, mnist_dir=args.mnist_dir)
    model = PixelCNN(1, x.shape[-1], hidden=args.hidden, layers=args.layers,
                     mixtures=args.mixtures, levels=levels, seed=args.seed)
    hist = train_pixelcnn(model, x, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                          seed=args.seed)
    out = Path(args.out or f"results/pixelcnn_{args.data}.pt")
    model.save(out)
    print(f"trained PixelCNN on {args.data} ({len(x)} images), {args.epochs} epochs: "
          f"{hist[0]:.3f} -> {hist[-1]:.3f} bits/dim; saved {out}")
    return 0
