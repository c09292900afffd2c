"""``paraprop train cfg``: a class-conditional diffusion model on the digits, for classifier-free
guidance (Ho & Salimans 2022): a :func:`~paraprop.models.small_unet` with a class embedding
(``num_class_embeds = 11``: the ten digits and the null class 10), trained with the DDPM loss
(as ``paraprop train ddpm``) on the labels, each replaced by the null class with probability
``drop`` so that the same model predicts the conditional and the unconditional noise. Needs
``diffusers`` (and scikit-learn for the digits).

:func:`guided` is the model a pipeline samples with guidance, as
:class:`paraprop.diffusion.Guided` (the unconditional half on the null class, the conditional
half on the labels); the PNG holds DDIM samples of the diffusers loop, one row per digit.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from paraprop import checks
from paraprop.data import load_digits
from paraprop.models.denoisers import load_unet, save_unet, small_unet
from paraprop_lab.training._common import (
    check_out_file,
    default_path,
    fit,
    image_panel,
    n_parameters,
    report_trained,
    save_png,
    subplots,
)
from paraprop_lab.training.ddpm import predict_noise, sample_loop

NAME = "cfg"
HELP = "train a class-conditional diffusion model on the digits, for classifier-free guidance"
CLASSES = 10          # digits; label CLASSES is the null class
DEFAULTS = {"epochs": 100, "steps": 1000, "batch_size": 128, "lr": 1e-3, "drop": 0.1,
            "guidance": 3.0}


def digits_with_labels(n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits ``(N, 1, 8, 8)`` in ``[-1, 1]`` (float32) and their labels ``(N,)``: the
    first ``n``, or all 1797."""
    checks.positive_int("n", n, allow_none=True)
    images, labels = load_digits()
    x = images[:, None] * 2 - 1
    return (x, labels) if n is None else (x[:n], labels[:n])


def make_model(seed: int = 0):
    """A fresh class-conditional :func:`small_unet` for the 8x8 digits."""
    return small_unet(8, 1, seed=seed, classes=CLASSES)


def train_cfg(model, x: torch.Tensor, labels: torch.Tensor, *, steps: int = 1000, epochs: int,
              batch_size: int = 128, lr: float = 1e-3, drop: float = 0.1, seed: int = 0,
              progress: bool = True) -> list[float]:
    """Fit ``model`` with the DDPM noise-prediction loss on ``(x, labels)``, each label replaced
    by the null class with probability ``drop``; returns the mean loss of every epoch.

    Raises:
        ValueError: ``drop`` outside ``[0, 1)``, mismatched ``x`` and ``labels``, or a bad
            count (named).
    """
    from diffusers import DDPMScheduler

    checks.positive_int("steps", steps)
    drop = float(drop)
    if not 0 <= drop < 1:
        raise ValueError(f"drop must be in [0, 1) (the share of labels replaced by the null "
                         f"class), got {drop!r}")
    if len(x) != len(labels):
        raise ValueError(f"x and labels must hold the same number of samples, got {len(x)} and "
                         f"{len(labels)}")
    scheduler = DDPMScheduler(num_train_timesteps=steps)
    g = torch.Generator().manual_seed(seed + 1)

    def loss(idx: torch.Tensor) -> torch.Tensor:
        i = idx[:, 0].long()
        xb, yb = x[i], labels[i]
        yb = torch.where(torch.rand(len(i), generator=g) < drop, CLASSES, yb)
        noise = torch.randn(xb.shape, generator=g, dtype=xb.dtype)
        t = torch.randint(0, steps, (len(i),), generator=g)
        out = predict_noise(model, scheduler.add_noise(xb, noise, t), t, class_labels=yb)
        return (out - noise).pow(2).mean()

    index = torch.arange(len(x), dtype=torch.float32)[:, None]   # fit shuffles the indices
    return fit(model, index, loss, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
               progress=progress, desc="train cfg", label="loss")


def guided(model, labels: torch.Tensor, scale: float):
    """The guided model of a pipeline for ``labels`` ``(B,)``: the unconditional half on the
    null class, the conditional half on ``labels`` (:class:`paraprop.diffusion.Guided`)."""
    from paraprop.diffusion import Guided

    labels = labels.long()
    return Guided(model, scale, cond={"class_labels": labels},
                  uncond={"class_labels": torch.full_like(labels, CLASSES)})


def samples_png(path, model, *, scale: float, steps: int = 1000, seed: int = 0,
                per_class: int = 4):
    """A PNG of DDIM samples (50 steps) of the diffusers loop with guidance ``scale``: one
    column per digit, ``per_class`` rows."""
    from diffusers import DDIMScheduler

    labels = torch.arange(CLASSES).repeat(per_class)
    net = guided(model, labels, scale)
    s = sample_loop(net, DDIMScheduler(num_train_timesteps=steps), (len(labels), 1, 8, 8),
                    min(50, steps), seed=seed)
    fig, axes = subplots(1, 1, figsize=(6, 3))
    image_panel(axes, s, f"guidance {scale:g}, DDIM {min(50, steps)} steps: 0 .. 9 per row")
    return save_png(fig, Path(path))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"],
                   help="training timesteps, num_train_timesteps (default 1000)")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--drop", type=float, default=DEFAULTS["drop"],
                   help="share of labels replaced by the null class (default 0.1)")
    p.add_argument("--guidance", type=float, default=DEFAULTS["guidance"],
                   help="guidance scale of the samples in the figure (default 3)")
    p.add_argument("--n", type=int, default=None, help="training images (default: all 1797)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="checkpoint (default results/cfg_digits.pt)")
    p.add_argument("--png", default=None, help="figure of samples (default: next to --out)")


def run(args) -> int:
    start = time.perf_counter()
    checks.positive_int("epochs", args.epochs)
    checks.positive_int("steps", args.steps)
    scale = checks.positive_number("guidance", args.guidance, finite=True)
    if scale <= 1:
        raise ValueError(f"guidance must be > 1 (classifier-free guidance), got {args.guidance}")
    if not 0 <= args.drop < 1:
        raise ValueError(f"drop must be in [0, 1), got {args.drop}")
    out = check_out_file(default_path(args.out, "results/cfg_digits.pt"),
                         example="cfg_digits.pt")
    png = check_out_file(default_path(args.png, out.with_suffix(".png")),
                         "--out" if args.png is None else "--png", example="cfg_digits.png")
    x, labels = digits_with_labels(args.n)
    model = make_model(args.seed)
    hist = train_cfg(model, x, labels, steps=args.steps, epochs=args.epochs,
                     batch_size=args.batch_size, lr=args.lr, drop=args.drop, seed=args.seed)
    save_unet(model, out)
    trained = time.perf_counter() - start
    samples_png(png, model.eval(), scale=scale, steps=args.steps, seed=args.seed)
    return report_trained(
        f"class-conditional DDPM on the digits ({len(x)} x 1x8x8, 10 classes + null, label "
        f"drop {args.drop:g}), UNet2DModel {n_parameters(model)} parameters, {args.epochs} "
        f"epochs", hist, [out, png], loss="loss", unit="", seconds=trained)


def load(path):
    """The model saved by this job at ``path``, in eval mode."""
    return load_unet(path)
