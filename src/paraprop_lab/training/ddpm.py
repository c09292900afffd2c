"""``paraprop train ddpm``: a denoising diffusion model (Ho et al. 2020) on two moons (an
:class:`~paraprop.models.MLPDenoiser`), the digits or MNIST (a :func:`~paraprop.models.small_unet`),
with a progress bar and a PNG of samples next to the training data. Needs ``diffusers``.

The loss is the DDPM one (Ho et al. 2020, Algorithm 1, eq. 14): draw ``t`` uniformly from the
``steps`` training timesteps and ``eps ~ N(0, I)``, noise the data to
``sqrt(abar_t) x + sqrt(1 - abar_t) eps`` (``DDPMScheduler.add_noise``, linear betas), and
regress the model's output on ``eps`` (mean squared error).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from paraprop import checks
from paraprop.data import make_moons
from paraprop.models.denoisers import MLPDenoiser, load_unet, save_unet, small_unet
from paraprop_lab.progress import progress as progress_bar
from paraprop_lab.training._common import (
    add_data_arguments,
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
    signed_images,
    subplots,
)

NAME = "ddpm"
HELP = "train a diffusion model (DDPM) on two moons, the digits or MNIST (needs diffusers)"
DATA = ("moons", "digits", "mnist")
EPOCHS = {"moons": 300, "digits": 100, "mnist": 10}  # default epochs of each data set
MOONS = 8000                                          # default number of moons points
DEFAULTS = {"steps": 1000, "batch_size": 128, "lr": 1e-3}


def ddpm_data(data: str, *, mnist_dir=None, n: int | None = None, seed: int = 0) -> torch.Tensor:
    """Training data of a diffusion model.

    Arguments:
        data: ``"moons"``, ``"digits"`` (8x8, 1797 images) or ``"mnist"`` (28x28, the files in
            ``mnist_dir``).
        mnist_dir: directory of the MNIST IDX files (``None``: the default search).
        n: number of samples (``None``: 8000 moons points, or every image); images are the
            first ``n``.
        seed: seed of the moons points (the images do not depend on it).

    Returns:
        Moons ``(n, 2)`` standardised, or images ``(N, 1, S, S)`` scaled to ``[-1, 1]``;
        float32.

    Raises:
        ValueError: unknown ``data`` or a bad ``n``.
    """
    checks.one_of("data", data, DATA)
    checks.positive_int("n", n, allow_none=True)
    if data == "moons":
        return make_moons(MOONS if n is None else n, seed=seed)
    return signed_images(data, mnist_dir=mnist_dir, n=n)


def make_denoiser(data: str, x: torch.Tensor, *, steps: int = 1000, seed: int = 0):
    """A fresh denoiser for ``x``: an :class:`MLPDenoiser` for moons (3 x 128, trained for
    ``steps`` timesteps), a :func:`small_unet` for images.

    Raises:
        ValueError: unknown ``data``.
    """
    checks.one_of("data", data, DATA)
    if data == "moons":
        return MLPDenoiser(dim=x.shape[1], num_train_timesteps=steps, seed=seed)
    return small_unet(x.shape[-1], x.shape[1], seed=seed)


def predict_noise(model, x: torch.Tensor, t, **kwargs) -> torch.Tensor:
    """``model(x, t, **kwargs)`` as a tensor (a diffusers model returns an output object with
    ``.sample``)."""
    out = model(x, t, **kwargs)
    return out.sample if hasattr(out, "sample") else out


def train_ddpm(model, x: torch.Tensor, *, steps: int = 1000, epochs: int, batch_size: int = 128,
               lr: float = 1e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Fit ``model`` to ``x`` with the DDPM noise-prediction loss and Adam.

    Arguments:
        model: ``model(x_t, t)`` predicts the noise (an :class:`MLPDenoiser` or a
            ``UNet2DModel``); left in eval mode.
        x: training data ``(N, ...)`` in the model's dtype and on its device.
        steps: training timesteps (``num_train_timesteps`` of the ``DDPMScheduler``).
        epochs: passes over ``x``.
        batch_size: samples per Adam step.
        lr: Adam's learning rate.
        seed: seed of the shuffling, the timesteps and the noise (the global random state is
            not used).
        progress: show a tqdm progress bar.

    Returns:
        The mean loss of every epoch.

    Raises:
        ValueError: ``steps``, ``epochs`` or ``batch_size`` below 1, or ``x`` not a
            floating-point tensor with a batch dimension.
    """
    from diffusers import DDPMScheduler

    checks.positive_int("steps", steps)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        what = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else \
            type(x).__name__
        raise ValueError(f"x must be a floating-point tensor (N, ...), got {what}")
    scheduler = DDPMScheduler(num_train_timesteps=steps)
    g = torch.Generator().manual_seed(seed + 1)

    def loss(xb: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(xb.shape, generator=g, dtype=xb.dtype).to(xb.device)
        t = torch.randint(0, steps, (len(xb),), generator=g).to(xb.device)
        return (predict_noise(model, scheduler.add_noise(xb, noise, t), t) - noise).pow(2).mean()

    return fit(model, x, loss, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
               progress=progress, desc="train ddpm", label="loss")


def save_denoiser(model, path: str | Path) -> None:
    """Save an :class:`MLPDenoiser` or a ``UNet2DModel`` (the checkpoint records which)."""
    if isinstance(model, MLPDenoiser):
        model.save(path)
    else:
        save_unet(model, path)


def load_denoiser(data: str, path: str | Path):
    """The denoiser of ``data`` saved at ``path`` by :func:`save_denoiser`, in eval mode."""
    checks.one_of("data", data, DATA)
    return MLPDenoiser.load(path).eval() if data == "moons" else load_unet(path)


def checkpoint_name(data: str, epochs: int, *, seed: int = 0, steps: int = 1000,
                    batch_size: int = 128, lr: float = 1e-3, n: int | None = None) -> str:
    """``ddpm_{data}_e{epochs}.pt``, with a tag for every setting off its default, e.g.
    ``ddpm_moons_e150.pt`` or ``ddpm_moons_e2_T100_s3.pt``."""
    tags = [("T", steps, DEFAULTS["steps"]), ("s", seed, 0), ("b", batch_size,
            DEFAULTS["batch_size"]), ("lr", lr, DEFAULTS["lr"]), ("n", n, None)]
    return f"ddpm_{data}_e{epochs}" + "".join(f"_{k}{v:g}" if isinstance(v, float) else
                                             f"_{k}{v}" for k, v, d in tags if v != d) + ".pt"


def trained_denoiser(out_dir: str | Path, data: str, *, epochs: int | None = None,
                     seed: int = 0, steps: int = 1000, batch_size: int = 128, lr: float = 1e-3,
                     n: int | None = None, mnist_dir=None, progress: bool = True):
    """A trained denoiser for ``data``: the checkpoint of the same settings in ``out_dir``
    (:func:`checkpoint_name`, e.g. ``ddpm_moons_e150.pt``), or one trained now and saved there.

    Arguments:
        out_dir: directory of the checkpoints.
        data: ``"moons"``, ``"digits"`` or ``"mnist"``.
        epochs: training epochs (``None``: the default of ``data``, :data:`EPOCHS`).
        seed, steps, batch_size, lr, n, mnist_dir, progress: as in :func:`ddpm_data` and
            :func:`train_ddpm`.

    Returns:
        ``(model, info)``: the model in eval mode, and ``{"checkpoint", "trained_now"}`` plus
        ``"loss"`` (per epoch) when trained now.

    Raises:
        ValueError: unknown ``data`` or a bad setting; a file at the checkpoint path that is
            not a checkpoint of that model.
    """
    checks.one_of("data", data, DATA)
    epochs = EPOCHS[data] if epochs is None else epochs
    checks.positive_int("epochs", epochs)
    path = Path(out_dir) / checkpoint_name(data, epochs, seed=seed, steps=steps,
                                           batch_size=batch_size, lr=lr, n=n)
    if path.exists():
        return load_denoiser(data, path), {"checkpoint": str(path), "trained_now": False}
    x = ddpm_data(data, mnist_dir=mnist_dir, n=n, seed=seed)
    model = make_denoiser(data, x, steps=steps, seed=seed)
    hist = train_ddpm(model, x, steps=steps, epochs=epochs, batch_size=batch_size, lr=lr,
                      seed=seed, progress=progress)
    save_denoiser(model, path)
    return model.eval(), {"checkpoint": str(path), "trained_now": True, "loss": hist}


def sample_loop(model, scheduler, shape: tuple[int, ...], num_inference_steps: int, *,
                seed: int = 0, eta: float | None = None, progress: bool = False) -> torch.Tensor:
    """Samples of the plain diffusers loop: ``x_T ~ N(0, I)``, then
    ``x = scheduler.step(model(x, t), t, x, generator=g).prev_sample`` for every timestep.

    Arguments:
        model: the denoiser (its first parameter gives the dtype and device).
        scheduler: a diffusers scheduler (``DDPMScheduler``, ``DDIMScheduler``, ...).
        shape: shape of the batch.
        num_inference_steps: passed to ``scheduler.set_timesteps``.
        seed: seed of the starting noise and of the noise of the steps (a CPU generator).
        eta: passed to ``scheduler.step`` when given (DDIM's ``eta``).
        progress: show a tqdm progress bar.

    Returns:
        The samples, shape ``shape``.
    """
    p = next(model.parameters())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=p.dtype).to(p.device)
    scheduler.set_timesteps(num_inference_steps)
    kw = {} if eta is None else {"eta": eta}
    with torch.no_grad():
        for t in progress_bar(scheduler.timesteps, desc="sample", unit="steps",
                            disable=not progress):
            x = scheduler.step(predict_noise(model, x, t), t, x, generator=g, **kw).prev_sample
    return x


def draw_samples(model, data: str, shape: tuple[int, ...], *, steps: int = 1000, seed: int = 0,
                 progress: bool = False) -> torch.Tensor:
    """Samples of a denoiser trained by this job: the full DDPM chain of ``steps`` steps for
    moons, DDIM with ``min(50, steps)`` steps (eta 0, clipped to ``[-1, 1]``) for images."""
    from diffusers import DDIMScheduler, DDPMScheduler

    if data == "moons":
        scheduler = DDPMScheduler(num_train_timesteps=steps, clip_sample=False)
        return sample_loop(model, scheduler, shape, steps, seed=seed, progress=progress)
    scheduler = DDIMScheduler(num_train_timesteps=steps)
    return sample_loop(model, scheduler, shape, min(50, steps), seed=seed, progress=progress)


def samples_png(path: str | Path, model, data: str, x: torch.Tensor, *, steps: int = 1000,
                seed: int = 0, progress: bool = False) -> Path:
    """A PNG of samples next to the training data: for moons a scatter of 1000 samples of the
    DDPM chain beside 1000 training points, for images a 4x4 grid of DDIM samples beside 16
    training images.

    Returns:
        ``path``, as a ``Path``.
    """
    path = Path(path)
    moons = data == "moons"
    n = min(1000, len(x)) if moons else 16
    s = draw_samples(model, data, (n, *x.shape[1:]), steps=steps, seed=seed, progress=progress)
    fig, axes = subplots(1, 2, figsize=(9, 4.4))
    if moons:
        moons_panels(axes, x, s, f"DDPM {steps} steps")
    else:
        for ax, imgs, title in ((axes[0], x[:16], "training images"),
                                (axes[1], s, f"samples (DDIM {min(50, steps)} steps)")):
            image_panel(ax, imgs, title)
    fig.suptitle(f"DDPM on {data}: training data and samples of the diffusers loop")
    return save_png(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, choices=DATA, default="moons", epochs=EPOCHS)
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"],
                   help="training timesteps, num_train_timesteps (default 1000)")
    p.add_argument("--n", type=int, default=None,
                   help=f"training samples (default: {MOONS} moons points, or every image)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="checkpoint (default results/ddpm_DATA.pt)")
    p.add_argument("--png", default=None,
                   help="figure of samples (default: next to the checkpoint, ddpm_DATA.png)")


def run(args) -> int:
    start = time.perf_counter()
    out = results_file(args, "ddpm")
    png = check_out_file(default_path(args.png, out.with_suffix(".png")),
                         "--out" if args.png is None else "--png",
                         example=f"ddpm_{args.data}.png")
    x = ddpm_data(args.data, mnist_dir=args.mnist_dir, n=args.n, seed=args.seed)
    checks.positive_int("steps", args.steps)
    model = make_denoiser(args.data, x, steps=args.steps, seed=args.seed)
    epochs = EPOCHS[args.data] if args.epochs is None else args.epochs
    hist = train_ddpm(model, x, steps=args.steps, **fit_options(args, epochs=epochs))
    save_denoiser(model, out)
    trained = time.perf_counter() - start
    png = samples_png(png, model.eval(), args.data, x, steps=args.steps, seed=args.seed,
                      progress=True)
    return report_trained(
        f"DDPM on {args.data} ({len(x)} x {'x'.join(map(str, x.shape[1:]))}), "
        f"{type(model).__name__} {n_parameters(model)} parameters, {epochs} epochs, "
        f"{args.steps} timesteps", hist, [out, png], loss="loss", unit="", seconds=trained)
