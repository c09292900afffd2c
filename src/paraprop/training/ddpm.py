"""``paraprop train ddpm``: a denoising diffusion model (Ho et al. 2020) on two moons (an MLP),
the digits or MNIST (a small ``UNet2DModel``), with a progress bar and a PNG of samples."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from paraprop.data import make_moons
from paraprop.models.denoisers import MLPDenoiser, load_unet, save_unet, small_unet
from paraprop.training._common import fit, load_images

NAME = "ddpm"
HELP = "train a diffusion model (DDPM) on two moons, the digits or MNIST (needs diffusers)"
DATA = ("moons", "digits", "mnist")
EPOCHS = {"moons": 150, "digits": 100, "mnist": 10}


def ddpm_data(data: str, *, mnist_dir=None, n: int | None = None, seed: int = 0) -> torch.Tensor:
    """Training data: moons ``(n, 2)`` standardised (default 8000 points), or images scaled to
    ``[-1, 1]`` shaped ``(N, 1, S, S)``."""
    if data == "moons":
        return make_moons(n or 8000, seed=seed)
    images, _ = load_images(data, mnist_dir=mnist_dir)
    x = images[:, None] * 2 - 1
    return x[:n] if n else x


def make_model(data: str, x: torch.Tensor, seed: int = 0):
    if data == "moons":
        return MLPDenoiser(dim=x.shape[1], seed=seed)
    return small_unet(x.shape[-1], x.shape[1], seed=seed)


def _eps(model, x, t):
    out = model(x, t)
    return out.sample if hasattr(out, "sample") else out


def train_ddpm(model, x: torch.Tensor, *, steps: int = 1000, epochs: int, batch_size: int = 128,
               lr: float = 1e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """The DDPM noise-prediction loss (mean squared error of the predicted noise) with Adam;
    returns the mean loss of every epoch."""
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(num_train_timesteps=steps)
    g = torch.Generator().manual_seed(seed + 1)

    def loss(xb):
        noise = torch.randn(xb.shape, generator=g)
        t = torch.randint(0, steps, (len(xb),), generator=g)
        return (_eps(model, scheduler.add_noise(xb, noise, t), t) - noise).pow(2).mean()

    return fit(model, x, loss, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
               progress=progress, desc="train ddpm", label="loss")


def save_model(model, path: Path) -> None:
    if isinstance(model, MLPDenoiser):
        model.save(path)
    else:
        save_unet(model, path)


def load_model(data: str, path: Path):
    return MLPDenoiser.load(path) if data == "moons" else load_unet(path)


def trained_denoiser(out_dir: Path, data: str, *, epochs: int | None = None, seed: int = 0,
                     mnist_dir=None, progress: bool = True):
    """The denoiser for ``data`` from ``out_dir/ddpm_{data}_e{epochs}.pt``, trained and saved
    first if missing; returns ``(model, info)``."""
    if data not in DATA:
        raise ValueError(f"unknown data={data!r}; choose one of {', '.join(DATA)}")
    epochs = epochs or EPOCHS[data]
    path = Path(out_dir) / f"ddpm_{data}_e{epochs}.pt"
    if path.exists():
        return load_model(data, path).eval(), {"checkpoint": str(path), "trained_now": False}
    x = ddpm_data(data, mnist_dir=mnist_dir, seed=seed)
    model = make_model(data, x, seed)
    hist = train_ddpm(model, x, epochs=epochs, seed=seed, progress=progress)
    save_model(model, path)
    return model.eval(), {"checkpoint": str(path), "trained_now": True, "loss": hist}


def samples_png(path: Path, model, data: str, x: torch.Tensor, *, seed: int = 0) -> Path:
    """Samples of the diffusers loop (DDPM 1000 steps for moons, DDIM 50 for images) next to
    the training data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from diffusers import DDIMScheduler, DDPMScheduler

    moons = data == "moons"
    scheduler = DDPMScheduler(clip_sample=False) if moons else DDIMScheduler()
    scheduler.set_timesteps(1000 if moons else 50)
    g = torch.Generator().manual_seed(seed)
    n = 1000 if moons else 16
    s = torch.randn((n, *x.shape[1:]), generator=g)
    with torch.no_grad():
        for t in scheduler.timesteps:
            s = scheduler.step(_eps(model, s, t), t, s, generator=g).prev_sample
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    if moons:
        for ax, pts, title in ((axes[0], x[:n], "training data"), (axes[1], s, "samples")):
            ax.scatter(pts[:, 0], pts[:, 1], s=3)
            ax.set_title(title)
            ax.set_xlabel("first coordinate")
            ax.set_ylabel("second coordinate")
    else:
        for ax, imgs, title in ((axes[0], x[:16], "training images"), (axes[1], s, "samples")):
            grid = (imgs.clamp(-1, 1) + 1) / 2
            side = grid.shape[-1]
            tiled = grid[:16, 0].reshape(4, 4, side, side).permute(0, 2, 1, 3).reshape(
                4 * side, 4 * side)
            ax.imshow(tiled.numpy(), cmap="gray", vmin=0, vmax=1)
            ax.set_title(title)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(f"DDPM on {data}: training data and samples of the diffusers loop")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", choices=list(DATA), default="moons")
    p.add_argument("--mnist-dir", default=None, help="directory of the MNIST IDX files")
    p.add_argument("--epochs", type=int, default=None,
                   help="default: " + ", ".join(f"{k} {v}" for k, v in EPOCHS.items()))
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=1000, help="training timesteps")
    p.add_argument("--n", type=int, default=None, help="training points (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="checkpoint (default results/ddpm_DATA.pt)")
    p.add_argument("--png", default=None, help="samples figure (default next to --out)")


def run(args) -> int:
    x = ddpm_data(args.data, mnist_dir=args.mnist_dir, n=args.n, seed=args.seed)
    model = make_model(args.data, x, args.seed)
    epochs = args.epochs or EPOCHS[args.data]
    hist = train_ddpm(model, x, steps=args.steps, epochs=epochs, batch_size=args.batch_size,
                      lr=args.lr, seed=args.seed)
    out = Path(args.out or f"results/ddpm_{args.data}.pt")
    save_model(model, out)
    png = samples_png(Path(args.png) if args.png else out.with_suffix(".png"), model.eval(),
                      args.data, x, seed=args.seed)
    print(f"trained DDPM on {args.data} ({len(x)} samples), {epochs} epochs: loss "
          f"{hist[0]:.4f} -> {hist[-1]:.4f}; saved {out} and {png}")
    return 0
