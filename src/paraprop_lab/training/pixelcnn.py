"""``paraprop train pixelcnn``: fit a gated PixelCNN to the digits or MNIST."""

from __future__ import annotations

import argparse
import math

import torch

from paraprop.models import PixelCNN
from paraprop_lab.training._common import (
    add_data_arguments,
    fit,
    fit_options,
    load_images,
    report_trained,
    results_file,
)

NAME = "pixelcnn"
HELP = "train a gated PixelCNN (discretized logistic mixture) on digits or MNIST"


def pixel_data(data: str, *, mnist_dir=None) -> tuple[torch.Tensor, int]:
    """Images ``(N, 1, S, S)`` on the grid of ``levels`` values in ``[-1, 1]``, and ``levels``."""
    images, levels = load_images(data, mnist_dir=mnist_dir)
    q = levels - 1
    x = torch.round(images * q) / q * 2 - 1
    return x[:, None], levels


def train_pixelcnn(model: PixelCNN, x: torch.Tensor, *, epochs: int, batch_size: int = 64,
                   lr: float = 2e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Maximum likelihood with Adam; returns bits per dimension of every epoch.

    Raises:
        ValueError: ``epochs`` or ``batch_size`` below 1.
    """
    dims = x[0].numel() * math.log(2)
    return fit(model, x, lambda xb: -model.log_prob(xb).mean() / dims, epochs=epochs,
               batch_size=batch_size, lr=lr, seed=seed, progress=progress,
               desc="train pixelcnn", label="bpd")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, choices=["digits", "mnist"], default="digits", epochs=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--mixtures", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="checkpoint (default results/pixelcnn_DATA.pt)")


def run(args) -> int:
    out = results_file(args, "pixelcnn")
    x, levels = pixel_data(args.data, mnist_dir=args.mnist_dir)
    model = PixelCNN(1, x.shape[-1], hidden=args.hidden, layers=args.layers,
                     mixtures=args.mixtures, levels=levels, seed=args.seed)
    hist = train_pixelcnn(model, x, **fit_options(args))
    model.save(out)
    return report_trained(f"PixelCNN on {args.data} ({len(x)} images), {args.epochs} epochs",
                          hist, [out], loss="", unit="bits/dim", digits=3)
