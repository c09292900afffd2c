"""``paraprop train made``: fit a MADE to the digits or MNIST, with a progress bar."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from paraprop.models import MADE
from paraprop_lab.training._common import (
    add_data_arguments,
    fit,
    fit_options,
    load_images,
    report_trained,
    results_file,
)

NAME = "made"
HELP = "train a MADE (Germain et al. 2015) on digits or MNIST"


def made_data(data: str, conditional: str, *, mnist_dir=None, seed: int = 0) -> torch.Tensor:
    """Flattened training data for a MADE: dequantized pixels (continuous conditionals) or
    binarized pixels (Bernoulli), shape ``(N, D)``."""
    images, levels = load_images(data, mnist_dir=mnist_dir)
    x = images.reshape(len(images), -1)
    if conditional == "bernoulli":
        return (x > 0.5).float()
    g = torch.Generator().manual_seed(seed)
    return (torch.round(x * (levels - 1)) + torch.rand(x.shape, generator=g)) / levels


def train_made(model: MADE, x: torch.Tensor, *, epochs: int, batch_size: int = 100,
               lr: float = 1e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Maximum likelihood with Adam; returns the mean negative log-likelihood per dimension
    (nats) of every epoch.

    Raises:
        ValueError: ``epochs`` or ``batch_size`` below 1.
    """
    return fit(model, x, lambda xb: -model.log_prob(xb).mean() / x.shape[1], epochs=epochs,
               batch_size=batch_size, lr=lr, seed=seed, progress=progress, desc="train made",
               label="nll")


def trained_made(out_dir: Path, data: str, *, hidden=(512, 512), epochs: int = 20,
                 seed: int = 0) -> tuple[MADE, dict]:
    """Train (or reuse the checkpoint ``out_dir/made_DATA_HIDDEN_eEPOCHS.pt``, e.g.
    ``made_digits_512x512_e20.pt``, of the same config) a MADE."""
    path = out_dir / f"made_{data}_{'x'.join(map(str, hidden))}_e{epochs}.pt"
    if path.exists():
        model = MADE.load(path)
        return model.requires_grad_(False), {"checkpoint": str(path), "trained_now": False}
    x = made_data(data, "logistic", seed=seed)
    model = MADE(x.shape[1], hidden, "logistic", seed=seed)
    hist = train_made(model, x, epochs=epochs, seed=seed)
    model.save(path)
    return model.requires_grad_(False), {"checkpoint": str(path), "trained_now": True,
                                         "nll_per_dim": hist}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, choices=["digits", "mnist"], default="digits", epochs=20)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 512])
    p.add_argument("--conditional", choices=["logistic", "gaussian", "bernoulli"],
                   default="logistic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="checkpoint file (default results/made_DATA.pt)")


def run(args) -> int:
    out = results_file(args, "made")
    torch.manual_seed(args.seed)
    x = made_data(args.data, args.conditional, mnist_dir=args.mnist_dir, seed=args.seed)
    model = MADE(x.shape[1], tuple(args.hidden), args.conditional, seed=args.seed)
    hist = train_made(model, x, **fit_options(args))
    model.save(out)
    return report_trained(f"MADE on {args.data} ({len(x)} x {x.shape[1]}), {args.epochs} epochs",
                          hist, [out])
