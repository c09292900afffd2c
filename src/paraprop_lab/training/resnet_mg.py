"""``paraprop train resnet-mg``: a convolutional ResNet trained with MGRIT forward and backward.

The network of Kirby et al. (2020, §4, MNIST): an opening convolution, ``depth`` residual
convolution layers ``u <- u + h relu(conv3x3(u))`` solved by FAS/MGRIT
(:class:`paraprop.multigrid.ParallelResidualStack`, ``cycles`` V-cycles forward and on the
adjoint), and a linear head. ``--serial`` trains the same network (same seed, same batches) with
exact serial propagation and back-propagation, the reference.

Example:
    paraprop train resnet-mg --data digits --depth 32 --cycles 2
    paraprop train resnet-mg --data mnist --depth 32 --cycles 2 --epochs 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from paraprop import checks
from paraprop.data import IDXError, load_digits, load_mnist
from paraprop.models.blocks import ConvBlock
from paraprop.multigrid import ParallelResidualStack
from paraprop_lab.progress import progress as progress_bar
from paraprop_lab.training._common import check_out_file

NAME = "resnet-mg"
HELP = "a ResNet whose layers are solved by nonlinear multigrid (MGRIT), forward and backward"

__all__ = ["HELP", "NAME", "ResNetMG", "add_arguments", "load_data", "run", "train"]


class ResNetMG(nn.Module):
    """Opening conv -> ``depth`` residual conv layers (MGRIT) -> linear head.

    Arguments:
        image_size: input height = width (8 for digits, 28 for MNIST).
        depth: residual layers.
        channels: channels of the residual layers.
        final_time: ``T``; the step size is ``h = T / depth``.
        stride: stride of the opening convolution (2 halves the image).
        **mg: keyword arguments of :class:`ParallelResidualStack` (``levels=1``: serial).
    """

    def __init__(self, image_size: int, depth: int, channels: int = 4, final_time: float = 1.0,
                 stride: int = 1, classes: int = 10, **mg):
        super().__init__()
        self.open = nn.Conv2d(1, channels, 3, padding=1, stride=stride)
        side = (image_size - 1) // stride + 1
        self.stack = ParallelResidualStack([ConvBlock(channels) for _ in range(depth)],
                                           final_time / depth, **mg)
        self.head = nn.Linear(channels * side * side, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        u = torch.relu(self.open(images[:, None]))
        return self.head(self.stack(u).flatten(1))


def load_data(name: str, *, mnist_dir: str | None = None, seed: int = 0,
              test_fraction: float = 0.2):
    """``(train_x, train_y, test_x, test_y, split)`` for ``"digits"`` or ``"mnist"``.

    MNIST uses the official training and test files when the training files are present;
    when they are missing (not when they are corrupt), it splits the official test set (10,000
    images, a seeded ``1 - test_fraction`` : ``test_fraction`` split), which is what the shared
    data directory holds. ``split`` says which was used.

    Raises:
        ValueError: unknown data set.
        paraprop.data.IDXError: missing test files, or any corrupt file.
    """
    if name == "digits":
        x, y = load_digits()
        source = "digits"
    elif name == "mnist":
        try:
            tx, ty = load_mnist(mnist_dir, split="train")
        except IDXError as e:
            if not str(e).endswith("no such file"):
                raise  # a corrupt or truncated file is an error, not a reason to fall back
            x, y = load_mnist(mnist_dir, split="test")
            source = "MNIST t10k files (no training files)"
        else:
            vx, vy = load_mnist(mnist_dir, split="test")
            return tx, ty, vx, vy, "MNIST official train / t10k files"
    else:
        raise ValueError(f"unknown data set {name!r}; choose 'digits' or 'mnist'")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(len(x) * test_fraction))
    te, tr = perm[:n_test], perm[n_test:]
    split = (f"{source}, seeded split (seed {seed}): {len(tr)} train / {n_test} test")
    return x[tr], y[tr], x[te], y[te], split


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 500) -> float:
    correct = 0
    for i in range(0, len(x), batch):
        correct += int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum())
    return 100.0 * correct / len(x)


def train(*, data: str = "digits", depth: int = 32, cycles: int = 2, levels: int = 2,
          coarsening: int = 4, channels: int = 4, epochs: int = 2, batch_size: int = 32,
          lr: float = 0.01, final_time: float = 1.0, seed: int = 0, serial: bool = False,
          backward: str = "adjoint", warm_start: bool = False, mnist_dir: str | None = None,
          progress: bool = True) -> dict:
    """Train and return the history (per-epoch loss and test accuracy, MG statistics).

    Arguments:
        data: ``"digits"`` or ``"mnist"``.
        depth, channels, final_time: the network (``h = final_time / depth``).
        cycles, levels, coarsening, backward, warm_start: MGRIT settings (``serial``: exact
            serial propagation, ``levels=1``).
        epochs, batch_size, lr, seed: training (Adam; the seed fixes weights and batch order).
        progress: show a tqdm bar per epoch.

    Raises:
        ValueError: bad sizes (e.g. too few layers for the levels), unknown data set, or
            (:class:`paraprop.data.IDXError`) missing or corrupt MNIST files.
    """
    for name, v in (("depth", depth), ("cycles", cycles), ("epochs", epochs),
                    ("batch_size", batch_size), ("channels", channels)):
        checks.positive_int(name, v)
    tx, ty, vx, vy, split = load_data(data, mnist_dir=mnist_dir, seed=seed)
    torch.manual_seed(seed)
    mg = {"levels": 1} if serial else {"levels": levels, "coarsening": coarsening,
                                       "max_iters": cycles, "tol": None,
                                       "backward": backward,
                                       "warm_start": warm_start}
    model = ResNetMG(tx.shape[-1], depth, channels, final_time,
                     stride=2 if tx.shape[-1] > 16 else 1, **mg)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    history = {"config": {"data": data, "depth": depth, "cycles": None if serial else cycles,
                          "levels": 1 if serial else levels, "coarsening": coarsening,
                          "channels": channels, "epochs": epochs, "batch_size": batch_size,
                          "lr": lr, "final_time": final_time, "seed": seed,
                          "backward": backward, "split": split, "train_size": len(tx),
                          "test_size": len(vx)},
               "epochs": []}
    for epoch in range(1, epochs + 1):
        model.train()
        perm = torch.randperm(len(tx), generator=gen)
        t0, total, count, residuals = time.perf_counter(), 0.0, 0, []
        bar = progress_bar(range(0, len(tx), batch_size), desc=f"epoch {epoch}/{epochs}",
                           unit="batches", disable=not progress)
        for i in bar:
            idx = perm[i : i + batch_size]
            loss = nn.functional.cross_entropy(model(tx[idx]), ty[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
            fwd = model.stack.last_forward
            if fwd is not None and fwd.residuals.numel():
                residuals.append(float(fwd.residuals[-1]))
            bar.set_postfix(loss=f"{total / count:.3f}")
        train_time = time.perf_counter() - t0
        model.eval()
        row = {"epoch": epoch, "loss": total / count, "test_acc": accuracy(model, vx, vy),
               "train_s": train_time,
               "mean_final_residual": sum(residuals) / len(residuals) if residuals else 0.0}
        history["epochs"].append(row)
        if progress:
            print(f"epoch {epoch}: loss {row['loss']:.4f}, test accuracy {row['test_acc']:.2f}%,"
                  f" {train_time:.1f} s" + ("" if serial else
                                           f", mean MG residual {row['mean_final_residual']:.2e}"))
    history["model"] = model
    return history


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", choices=["digits", "mnist"], default="digits")
    p.add_argument("--depth", type=int, default=32, help="residual layers (default 32)")
    p.add_argument("--cycles", type=int, default=2, help="MGRIT V-cycles per solve (default 2)")
    p.add_argument("--levels", type=int, default=2, help="MGRIT levels (default 2)")
    p.add_argument("--coarsening", type=int, default=4, help="coarsening factor (default 4)")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    p.add_argument("--final-time", type=float, default=1.0, help="T; step size h = T / depth")
    p.add_argument("--backward", choices=["adjoint", "serial"], default="adjoint")
    p.add_argument("--warm-start", action="store_true", help="start from the last solution")
    p.add_argument("--serial", action="store_true",
                   help="train with exact serial propagation instead (the reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mnist-dir", default=None, help="MNIST IDX directory")
    p.add_argument("--out", default=None, help="write the history as JSON here")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: small batched kernels run best on one "
                        "thread of a shared 2-core CPU; 0 keeps torch's default)")


def run(args) -> int:
    if args.threads < 0:
        print(f"paraprop train resnet-mg: --threads must be >= 0, got {args.threads}",
              file=sys.stderr)
        return 2
    try:
        if args.out is not None:
            check_out_file(args.out, example="history.json")
    except (ValueError, OSError) as e:
        print(f"paraprop train resnet-mg: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        hist = train(data=args.data, depth=args.depth, cycles=args.cycles, levels=args.levels,
                     coarsening=args.coarsening, channels=args.channels, epochs=args.epochs,
                     batch_size=args.batch_size, lr=args.lr, final_time=args.final_time,
                     seed=args.seed, serial=args.serial, backward=args.backward,
                     warm_start=args.warm_start, mnist_dir=args.mnist_dir)
    except (ValueError, OSError) as e:
        print(f"paraprop train resnet-mg: {e}", file=sys.stderr)
        return 2
    hist.pop("model")
    if args.out is not None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(hist, indent=2) + "\n")
        print(f"history written to {args.out}")
    return 0
