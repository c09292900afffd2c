"""``paraprop train made``: fit a MADE to the digits or MNIST, with a progress bar."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from tqdm import tqdm

from paraprop.data import load_digits, load_mnist
from paraprop.models import MADE

NAME = "made"
HELP = "train a MADE (Germain et al. 2015) on digits or MNIST"


def made_data(data: str, conditional: str, *, mnist_dir=None, seed: int = 0) -> torch.Tensor:
    """Flattened training data for a MADE: dequantized pixels (continuous conditionals) or
    binarized pixels (Bernoulli), shape ``(N, D)``."""
    if data == "digits":
        images, _ = load_digits()
        levels = 17
    elif data == "mnist":
        images, _ = load_mnist(mnist_dir)
        levels = 256
    else:
        raise ValueError(f"unknown data={data!r}; choose 'digits' or 'mnist'")
    x = images.reshape(len(images), -1)
    if conditional == "bernoulli":
        return (x > 0.5).float()
    g = torch.Generator().manual_seed(seed)
    return (torch.round(x * (levels - 1)) + torch.rand(x.shape, generator=g)) / levels


def train_made(model: MADE, x: torch.Tensor, *, epochs: int, batch_size: int = 100,
               lr: float = 1e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Maximum likelihood with Adam; returns the mean negative log-likelihood per dimension
    (nats) of every epoch."""
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    history = []
    steps = math.ceil(len(x) / batch_size)
    bar = tqdm(total=epochs * steps, desc="train made", disable=not progress, leave=False)
    for _ in range(epochs):
        total = 0.0
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            loss = -model.log_prob(x[idx]).mean() / x.shape[1]
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            bar.update()
        history.append(total / len(x))
        bar.set_postfix(nll=f"{history[-1]:.4f}")
    bar.close()
    return history


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", choices=["digits", "mnist"], default="digits")
    p.add_argument("--mnist-dir", default=None, help="directory of the MNIST IDX files")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 512])
    p.add_argument("--conditional", choices=["logistic", "gaussian", "bernoulli"],
                   default="logistic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="checkpoint file (default results/made_DATA.pt)")


def run(args) -> int:
    torch.manual_seed(args.seed)
    x = made_data(args.data, args.conditional, mnist_dir=args.mnist_dir, seed=args.seed)
    model = MADE(x.shape[1], tuple(args.hidden), args.conditional, seed=args.seed)
    hist = train_made(model, x, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                      seed=args.seed)
    out = Path(args.out or f"results/made_{args.data}.pt")
    model.save(out)
    print(f"trained MADE on {args.data} ({len(x)} x {x.shape[1]}), {args.epochs} epochs: "
          f"NLL {hist[0]:.4f} -> {hist[-1]:.4f} nats/dim; saved {out}")
    return 0
