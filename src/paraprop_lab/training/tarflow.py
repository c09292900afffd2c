"""``paraprop train tarflow``: a TarFlow (Zhai et al. 2024) on the digits or MNIST, by maximum
likelihood on the images plus Gaussian noise of ``noise_std`` (as in the paper), with Adam, a
progress bar, and a PNG of samples next to the checkpoint.

The defaults train in a few minutes on a 2-core CPU: the digits (8x8) in patches of 2 (``T = 16``
patches of 4 values), MNIST (28x28, the 10,000 test images) in patches of 4 (``T = 49`` patches
of 16 values), 8 blocks of one transformer layer of width 64 each (MNIST: about 4 minutes).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from paraprop import checks
from paraprop.models.tarflow import TarFlow
from paraprop_lab.training._common import (
    add_data_arguments,
    check_out_file,
    default_path,
    fit,
    image_panel,
    n_parameters,
    report_trained,
    save_png,
    signed_images,
    subplots,
)

NAME = "tarflow"
HELP = "train a TarFlow (transformer autoregressive flow, Zhai et al. 2024) on digits or MNIST"
DATA = ("digits", "mnist")
EPOCHS = {"digits": 60, "mnist": 12}
PATCH = {"digits": 2, "mnist": 4}
DEFAULTS = {"blocks": 8, "layers": 1, "width": 64, "heads": 4, "noise_std": 0.05,
            "batch_size": 128, "lr": 1e-3}
OUT_DIR = Path("results/models")


def tarflow_data(data: str, *, mnist_dir=None, n: int | None = None) -> torch.Tensor:
    """Training images ``(N, 1, S, S)`` float32 in ``[-1, 1]`` (the first ``n``, or all).

    Raises:
        ValueError: unknown ``data`` or a bad ``n``.
    """
    checks.one_of("data", data, DATA)
    checks.positive_int("n", n, allow_none=True)
    return signed_images(data, mnist_dir=mnist_dir, n=n)


def train_tarflow(model: TarFlow, x: torch.Tensor, *, epochs: int, batch_size: int = 128,
                  lr: float = 1e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Maximum likelihood on ``x + noise_std * N(0, I)`` with Adam.

    Arguments:
        model: the flow (its ``noise_std`` sets the noise); left in eval mode.
        x: images ``(N, C, S, S)`` in ``[-1, 1]``, the model's dtype and device.
        epochs, batch_size, lr: the Adam loop (:func:`paraprop_lab.training._common.fit`).
        seed: seed of the shuffling and of the noise (the global random state is not used).
        progress: show a tqdm progress bar.

    Returns:
        The mean negative log-likelihood of every epoch, in nats per dimension.

    Raises:
        ValueError: ``epochs`` or ``batch_size`` below 1.
    """
    g = torch.Generator().manual_seed(seed + 1)
    D = x[0].numel()

    def loss(xb: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(xb.shape, generator=g, dtype=xb.dtype).to(xb.device)
        return -model.log_prob(xb + model.noise_std * noise).mean() / D

    return fit(model, x, loss, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
               progress=progress, desc="train tarflow", label="nll")


def checkpoint_name(data: str, epochs: int, *, seed: int = 0, n: int | None = None,
                    **settings) -> str:
    """``tarflow_{data}_e{epochs}.pt``, with a tag for every setting off its default, e.g.
    ``tarflow_mnist_e8.pt`` or ``tarflow_digits_e1_w32_n64.pt``."""
    tags = [("p", settings.get("patch_size", PATCH[data]), PATCH[data]), ("s", seed, 0),
            ("n", n, None)]
    short = {"blocks": "K", "layers": "l", "width": "w", "heads": "h", "noise_std": "sd",
             "batch_size": "b", "lr": "lr"}
    tags += [(short[k], settings.get(k, v), v) for k, v in DEFAULTS.items()]
    return f"tarflow_{data}_e{epochs}" + "".join(
        f"_{k}{v:g}" if isinstance(v, float) else f"_{k}{v}" for k, v, d in tags if v != d) \
        + ".pt"


def trained_tarflow(data: str, *, out_dir: str | Path = OUT_DIR, epochs: int | None = None,
                    seed: int = 0, n: int | None = None, mnist_dir=None, progress: bool = True,
                    **settings) -> tuple[TarFlow, dict]:
    """A trained TarFlow for ``data``: the checkpoint of the same settings in ``out_dir``
    (:func:`checkpoint_name`), or one trained now and saved there (with its PNG of samples).

    Arguments:
        data: ``"digits"`` or ``"mnist"``.
        out_dir: directory of the checkpoints (default ``results/models``).
        epochs: training epochs (``None``: :data:`EPOCHS` of ``data``).
        seed: seed of the initialisation, shuffling and noise.
        n: train on the first ``n`` images only (``None``: all).
        mnist_dir: directory of the MNIST IDX files (``None``: the default search).
        progress: show a progress bar.
        settings: ``patch_size``, ``blocks``, ``layers``, ``width``, ``heads``, ``noise_std``,
            ``batch_size``, ``lr`` (defaults: :data:`PATCH`, :data:`DEFAULTS`).

    Returns:
        ``(model, info)``: the model in eval mode, and ``{"checkpoint", "trained_now"}`` plus
        ``"loss"`` (per epoch, nats per dimension) and ``"png"`` when trained now.

    Raises:
        ValueError / TypeError: unknown ``data`` or setting, a bad value; a file at the
            checkpoint path that is not a TarFlow checkpoint.
    """
    checks.one_of("data", data, DATA)
    unknown = set(settings) - {"patch_size", *DEFAULTS}
    if unknown:
        raise TypeError(f"trained_tarflow: unknown setting(s) {sorted(unknown)}; choose from "
                        f"patch_size, {', '.join(DEFAULTS)}")
    epochs = EPOCHS[data] if epochs is None else epochs
    checks.positive_int("epochs", epochs)
    path = Path(out_dir) / checkpoint_name(data, epochs, seed=seed, n=n, **settings)
    if path.exists():
        return TarFlow.load(path), {"checkpoint": str(path), "trained_now": False}
    return _train(data, path, epochs=epochs, seed=seed, n=n, mnist_dir=mnist_dir,
                  progress=progress, settings=settings)


def _train(data: str, path: Path, *, epochs: int, seed: int, n, mnist_dir, progress: bool,
           settings: dict) -> tuple[TarFlow, dict]:
    """Train a fresh model, save it at ``path`` and its PNG of samples next to it."""
    x = tarflow_data(data, mnist_dir=mnist_dir, n=n)
    opts = {**DEFAULTS, "patch_size": PATCH[data], **settings}
    model = TarFlow(x.shape[-1], x.shape[1], opts["patch_size"], opts["blocks"], opts["layers"],
                    opts["width"], opts["heads"], opts["noise_std"], seed=seed)
    hist = train_tarflow(model, x, epochs=epochs, batch_size=opts["batch_size"], lr=opts["lr"],
                         seed=seed, progress=progress)
    model.save(path)
    png = samples_png(path.with_suffix(".png"), model, x, seed=seed)
    return model, {"checkpoint": str(path), "trained_now": True, "loss": hist, "png": str(png)}


def samples_png(path: str | Path, model: TarFlow, x: torch.Tensor, *, seed: int = 0,
                n: int = 16, temperatures: tuple[float, ...] = (1.0, 0.7)) -> Path:
    """A PNG of ``n`` training images beside ``n`` samples at each of ``temperatures`` (Jacobi,
    ``tol=0``: the exact inverse; the same noise at every temperature). Returns ``path``."""
    path = Path(path)
    cols = 1 + len(temperatures)
    fig, axes = subplots(1, cols, figsize=(4.5 * cols, 4.6))
    panels = [(x[:n], "training images")]
    for t in temperatures:
        images, sol = model.sample(n, method="jacobi", tol=0, temperature=t,
                                   generator=torch.Generator().manual_seed(seed))
        panels.append((images, f"samples, temperature {t:g}"))
    for ax, (imgs, title) in zip(axes, panels, strict=True):
        image_panel(ax, imgs[:, :1], title)
    fig.suptitle(f"TarFlow: {len(model.blocks)} blocks, T={model.T} patches of {model.P} values")
    return save_png(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, choices=DATA, default="digits", epochs=EPOCHS)
    p.add_argument("--patch-size", type=int, default=None,
                   help="default: " + ", ".join(f"{k} {v}" for k, v in PATCH.items()))
    for key in ("blocks", "layers", "width", "heads", "batch_size"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=DEFAULTS[key])
    p.add_argument("--noise-std", type=float, default=DEFAULTS["noise_std"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--n", type=int, default=None, help="training images (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="checkpoint (default: results/models/"
                   "tarflow_DATA_eEPOCHS.pt, tagged with the settings off their defaults)")


def run(args) -> int:
    start = time.perf_counter()
    settings = {k: getattr(args, k) for k in DEFAULTS}
    if args.patch_size is not None:
        settings["patch_size"] = args.patch_size
    epochs = EPOCHS[args.data] if args.epochs is None else args.epochs
    checks.positive_int("epochs", epochs)
    name = checkpoint_name(args.data, epochs, seed=args.seed, n=args.n, **settings)
    out = check_out_file(default_path(args.out, OUT_DIR / name), example=name)
    model, info = _train(args.data, out, epochs=epochs, seed=args.seed, n=args.n,
                         mnist_dir=args.mnist_dir, progress=True, settings=settings)
    cfg = model.config
    return report_trained(
        f"TarFlow on {args.data}: T={model.T} patches of {model.P} values, {cfg['blocks']} "
        f"blocks x {cfg['layers']} layers, width {cfg['width']}, {n_parameters(model)} "
        f"parameters, {epochs} epochs", info["loss"], [out, info["png"]],
        seconds=time.perf_counter() - start)
