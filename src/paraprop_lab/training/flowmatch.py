"""``paraprop train flowmatch``: a flow-matching model (rectified flow; Liu et al. 2022, Lipman et
al. 2023) on two moons (an :class:`~paraprop.models.MLPDenoiser`) or the digits (a
:func:`~paraprop.models.denoisers.small_unet`), with a progress bar and a PNG of samples next to
the training data. Needs ``diffusers``.

The convention is diffusers' ``FlowMatchEulerDiscreteScheduler`` (the scheduler of SD3 and Flux):
a data point ``x0`` and noise ``eps ~ N(0, I)`` are joined by the straight line
``x_sigma = (1 - sigma) x0 + sigma eps``, ``sigma`` in ``[0, 1]``; the model reads ``x_sigma``
and the timestep ``sigma * num_train_timesteps`` (1000) and predicts the velocity
``v = eps - x0`` (mean squared error, ``sigma`` uniform). Sampling integrates the ODE from
``sigma = 1`` (pure noise) down to ``0`` with the scheduler's Euler steps
``x_next = x + (sigma_next - sigma) v(x, sigma)``: the plain diffusers loop
(:func:`paraprop_lab.training.ddpm.sample_loop`), ``shift`` 1 by default.

The network is the DDPM job's: :class:`MLPDenoiser` embeds any real timestep (integer or not)
with sinusoids, so the same class serves as a velocity model on the continuous timesteps in
``[0, 1000]``; its output is read as a velocity, not as noise.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from paraprop import checks
from paraprop_lab.training._common import (
    check_out_file,
    default_path,
    fit,
    fit_options,
    image_panel,
    moons_panels,
    n_parameters,
    report_trained,
    results_file,
    save_png,
    subplots,
)
from paraprop_lab.training.ddpm import (
    ddpm_data,
    load_denoiser,
    make_denoiser,
    predict_noise,
    sample_loop,
    save_denoiser,
)

NAME = "flowmatch"
HELP = "train a flow-matching model (rectified flow) on two moons or the digits (needs diffusers)"
DATA = ("moons", "digits")
EPOCHS = {"moons": 300, "digits": 100}   # default epochs of each data set
NUM_TRAIN_TIMESTEPS = 1000               # the scheduler's: timestep = sigma * 1000
DEFAULTS = {"batch_size": 128, "lr": 1e-3, "sample_steps": 50, "shift": 1.0}


def flowmatch_data(data: str, *, n: int | None = None, seed: int = 0) -> torch.Tensor:
    """Training data: ``"moons"`` (``(n, 2)`` standardised, 8000 points by default) or
    ``"digits"`` (``(N, 1, 8, 8)`` in ``[-1, 1]``), as the DDPM job reads them
    (:func:`~paraprop_lab.training.ddpm.ddpm_data`).

    Raises:
        ValueError: unknown ``data`` or a bad ``n``.
    """
    checks.one_of("data", data, DATA)
    return ddpm_data(data, n=n, seed=seed)


def make_velocity_model(data: str, x: torch.Tensor, *, seed: int = 0):
    """A fresh velocity model for ``x``: an :class:`MLPDenoiser` (3 x 128) for moons, a
    :func:`small_unet` for the digits; both read timesteps on the 1000-step scale.

    Raises:
        ValueError: unknown ``data``.
    """
    checks.one_of("data", data, DATA)
    return make_denoiser(data, x, steps=NUM_TRAIN_TIMESTEPS, seed=seed)


def flowmatch_loss(model, x0: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The flow-matching loss of ``model`` on the batch ``x0``: with ``eps ~ N(0, I)`` and
    ``sigma ~ U(0, 1)`` per sample (drawn in that order from the CPU ``generator``, then moved to
    ``x0``'s device), the mean of ``(model(x_sigma, 1000 sigma) - (eps - x0)) ** 2`` over every
    entry, where ``x_sigma = (1 - sigma) x0 + sigma eps``.

    Arguments:
        model: ``model(x, t)`` predicts the velocity (a tensor, or an output with ``.sample``).
        x0: data ``(B, ...)`` in the model's dtype and on its device.
        generator: a CPU generator for the noise and the sigmas.

    Returns:
        The loss, a 0-d tensor (with gradients where the model has them).
    """
    noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
    sigma = torch.rand(len(x0), generator=generator, dtype=x0.dtype).to(x0.device)
    s = sigma.reshape(-1, *([1] * (x0.dim() - 1)))
    x_sigma = (1 - s) * x0 + s * noise
    velocity = predict_noise(model, x_sigma, sigma * NUM_TRAIN_TIMESTEPS)
    return (velocity - (noise - x0)).pow(2).mean()


def train_flowmatch(model, x: torch.Tensor, *, epochs: int, batch_size: int = 128,
                    lr: float = 1e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Fit ``model`` to ``x`` with the flow-matching loss (:func:`flowmatch_loss`) and Adam.

    Arguments:
        model: ``model(x_sigma, t)`` predicts the velocity (an :class:`MLPDenoiser` or a
            ``UNet2DModel``); left in eval mode.
        x: training data ``(N, ...)`` in the model's dtype and on its device.
        epochs: passes over ``x``.
        batch_size: samples per Adam step.
        lr: Adam's learning rate.
        seed: seed of the shuffling, the sigmas and the noise (the global random state is not
            used).
        progress: show a tqdm progress bar.

    Returns:
        The mean loss of every epoch.

    Raises:
        ValueError: ``epochs`` or ``batch_size`` not a positive int, ``lr`` not a finite
            number > 0, or ``x`` not a floating-point tensor with a batch dimension.
    """
    checks.positive_int("epochs", epochs)
    checks.positive_int("batch_size", batch_size)
    checks.positive_number("lr", lr, finite=True)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        what = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else \
            type(x).__name__
        raise ValueError(f"x must be a floating-point tensor (N, ...), got {what}")
    g = torch.Generator().manual_seed(seed + 1)
    return fit(model, x, lambda xb: flowmatch_loss(model, xb, g), epochs=epochs,
               batch_size=batch_size, lr=lr, seed=seed, progress=progress,
               desc="train flowmatch", label="loss")


def load_velocity_model(data: str, path: str | Path):
    """The velocity model of ``data`` saved at ``path`` (by this job), in eval mode.

    Raises:
        ValueError: unknown ``data``; a file that is not a checkpoint of that model.
        FileNotFoundError: no file at ``path``.
    """
    checks.one_of("data", data, DATA)
    return load_denoiser(data, path)


def checkpoint_name(data: str, epochs: int, *, seed: int = 0, batch_size: int = 128,
                    lr: float = 1e-3, n: int | None = None) -> str:
    """``flowmatch_{data}_e{epochs}.pt``, with a tag for every setting off its default, e.g.
    ``flowmatch_moons_e300.pt`` or ``flowmatch_moons_e2_s3_n256.pt``."""
    tags = [("s", seed, 0), ("b", batch_size, DEFAULTS["batch_size"]),
            ("lr", lr, DEFAULTS["lr"]), ("n", n, None)]
    return f"flowmatch_{data}_e{epochs}" + "".join(
        f"_{k}{v:g}" if isinstance(v, float) else f"_{k}{v}"
        for k, v, d in tags if v != d) + ".pt"


def trained_flowmatch(out_dir: str | Path, data: str, *, epochs: int | None = None,
                      seed: int = 0, batch_size: int = 128, lr: float = 1e-3,
                      n: int | None = None, progress: bool = True):
    """As :func:`paraprop_lab.training.ddpm.trained_denoiser`, for a velocity model of
    ``"moons"`` or ``"digits"``: the checkpoint of the same settings in ``out_dir``
    (:func:`checkpoint_name`), or one trained now (:func:`train_flowmatch`) and saved there;
    ``(model, info)``. ``ValueError`` for unknown ``data``, a bad setting or a file there that
    is not such a checkpoint."""
    checks.one_of("data", data, DATA)
    epochs = EPOCHS[data] if epochs is None else epochs
    checks.positive_int("epochs", epochs)
    path = Path(out_dir) / checkpoint_name(data, epochs, seed=seed, batch_size=batch_size,
                                           lr=lr, n=n)
    if path.exists():
        return load_velocity_model(data, path), {"checkpoint": str(path), "trained_now": False}
    x = flowmatch_data(data, n=n, seed=seed)
    model = make_velocity_model(data, x, seed=seed)
    hist = train_flowmatch(model, x, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
                           progress=progress)
    save_denoiser(model, path)
    return model.eval(), {"checkpoint": str(path), "trained_now": True, "loss": hist}


def flowmatch_scheduler(shift: float = 1.0):
    """diffusers' ``FlowMatchEulerDiscreteScheduler`` of this job's models (1000 training
    timesteps) with ``shift``.

    Raises:
        ValueError: ``shift`` not a finite number > 0.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    checks.positive_number("shift", shift, finite=True)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=shift)


def draw_samples(model, shape: tuple[int, ...], *, steps: int = 50, shift: float = 1.0,
                 seed: int = 0, progress: bool = False) -> torch.Tensor:
    """Samples of a velocity model: the plain diffusers loop (:func:`sample_loop`) with
    :func:`flowmatch_scheduler` at ``steps`` Euler steps, from the noise of ``seed``.

    Raises:
        ValueError: ``steps`` not a positive int, ``shift`` not a finite number > 0.
    """
    checks.positive_int("steps", steps)
    return sample_loop(model, flowmatch_scheduler(shift), shape, steps, seed=seed,
                       progress=progress)


def samples_png(path: str | Path, model, data: str, x: torch.Tensor, *, steps: int = 50,
                shift: float = 1.0, seed: int = 0, progress: bool = False) -> Path:
    """A PNG of samples next to the training data: for moons a scatter of 1000 samples beside
    1000 training points, for the digits a 4x4 grid of samples beside 16 training images; the
    samples of :func:`draw_samples`.

    Returns:
        ``path``, as a ``Path``.
    """
    checks.one_of("data", data, DATA)
    path = Path(path)
    moons = data == "moons"
    n = min(1000, len(x)) if moons else 16
    s = draw_samples(model, (n, *x.shape[1:]), steps=steps, shift=shift, seed=seed,
                     progress=progress)
    how = f"Euler {steps} steps" + ("" if shift == 1.0 else f", shift {shift:g}")
    fig, axes = subplots(1, 2, figsize=(9, 4.4))
    if moons:
        moons_panels(axes, x, s, how)
    else:
        image_panel(axes[0], x[:16], "training images")
        image_panel(axes[1], s, f"samples ({how})")
    fig.suptitle(f"flow matching on {data}: training data and samples of the diffusers loop")
    return save_png(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", choices=list(DATA), default="moons")
    p.add_argument("--epochs", type=int, default=None,
                   help="default: " + ", ".join(f"{k} {v}" for k, v in EPOCHS.items()))
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--n", type=int, default=None,
                   help="training samples (default: 8000 moons points, or every image)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-steps", type=int, default=DEFAULTS["sample_steps"],
                   help="Euler steps of the samples in the figure (default 50)")
    p.add_argument("--shift", type=float, default=DEFAULTS["shift"],
                   help="the scheduler's shift for the samples in the figure (default 1.0)")
    p.add_argument("--out", default=None,
                   help="checkpoint (default results/flowmatch_DATA.pt)")
    p.add_argument("--png", default=None,
                   help="figure of samples (default: next to the checkpoint, "
                        "flowmatch_DATA.png)")


def run(args) -> int:
    start = time.perf_counter()
    out = results_file(args, "flowmatch")
    png = check_out_file(default_path(args.png, out.with_suffix(".png")),
                         "--out" if args.png is None else "--png",
                         example=f"flowmatch_{args.data}.png")
    # every setting checked before any training
    checks.positive_int("sample_steps", args.sample_steps)
    checks.positive_number("shift", args.shift, finite=True)
    epochs = EPOCHS[args.data] if args.epochs is None else args.epochs
    checks.positive_int("epochs", epochs)
    checks.positive_int("batch_size", args.batch_size)
    checks.positive_number("lr", args.lr, finite=True)
    x = flowmatch_data(args.data, n=args.n, seed=args.seed)
    model = make_velocity_model(args.data, x, seed=args.seed)
    hist = train_flowmatch(model, x, **fit_options(args, epochs=epochs))
    save_denoiser(model, out)
    trained = time.perf_counter() - start
    png = samples_png(png, model.eval(), args.data, x, steps=args.sample_steps,
                      shift=args.shift, seed=args.seed, progress=True)
    return report_trained(
        f"flow matching on {args.data} ({len(x)} x {'x'.join(map(str, x.shape[1:]))}), "
        f"{type(model).__name__} {n_parameters(model)} parameters, {epochs} epochs",
        hist, [out, png], loss="loss", unit="", seconds=trained)
