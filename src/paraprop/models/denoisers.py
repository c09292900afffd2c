"""Noise-prediction networks for the diffusion benchmarks: an MLP for low-dimensional data (the
scale of a diffusion policy) and a small diffusers ``UNet2DModel`` for images."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from paraprop import checks
from paraprop.models.made import load_checkpoint


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of the timesteps ``t`` (``(N,)``): ``(N, dim)``, ``dim`` even."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device,
                                                           dtype=torch.float64) / half)
    angle = t.to(torch.float64)[:, None] * freqs[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=1)


class MLPDenoiser(torch.nn.Module):
    """``eps(x, t)`` for ``x`` of shape ``(N, dim)``: an MLP on ``x`` and a sinusoidal embedding
    of the timestep.

    Arguments:
        dim: features of a sample.
        hidden: width of the hidden layers.
        layers: number of hidden layers.
        embed: size of the timestep embedding (even).
        seed: initialisation seed.

    Example:
        >>> net = paraprop.models.MLPDenoiser(dim=2, hidden=16, layers=2)
        >>> net(torch.randn(5, 2), torch.tensor([999, 500, 10, 0, 3])).shape
        torch.Size([5, 2])
    """

    def __init__(self, dim: int = 2, hidden: int = 128, layers: int = 3, embed: int = 32,
                 seed: int = 0):
        super().__init__()
        checks.positive_int("dim", dim)
        checks.positive_int("hidden", hidden)
        checks.positive_int("layers", layers)
        checks.positive_int("embed", embed)
        if embed % 2:
            raise ValueError(f"embed must be even (sine and cosine pairs), got {embed}")
        self.config = {"dim": dim, "hidden": hidden, "layers": layers, "embed": embed,
                       "seed": seed}
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            mods: list[torch.nn.Module] = []
            width = dim + embed
            for _ in range(layers):
                mods += [torch.nn.Linear(width, hidden), torch.nn.SiLU()]
                width = hidden
            mods.append(torch.nn.Linear(width, dim))
            self.net = torch.nn.Sequential(*mods)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        """The predicted noise, shaped like ``x``; ``t`` is an int, a 0-d tensor or one timestep
        per row of ``x``."""
        dim = self.config["dim"]
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (N, {dim}), got {got}")
        t = torch.as_tensor(t, device=x.device)
        if t.dim() == 0:
            t = t.expand(x.shape[0])
        if t.shape != (x.shape[0],):
            raise ValueError(f"t must be a scalar or have shape ({x.shape[0]},) (one timestep "
                             f"per row of x), got {tuple(t.shape)}")
        emb = timestep_embedding(t, self.config["embed"]).to(x.dtype)
        return self.net(torch.cat([x, emb], dim=1))

    def save(self, path: str | Path) -> None:
        """Save the config and state dict (``MLPDenoiser.load`` rebuilds the model)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"kind": "MLPDenoiser", "config": self.config,
                    "state_dict": self.state_dict()}, path)

    @classmethod
    def load(cls, path: str | Path, map_location="cpu") -> MLPDenoiser:
        """The model saved by :meth:`save` at ``path`` (errors name the file)."""
        return load_checkpoint(cls, "MLPDenoiser", path, map_location)


def small_unet(sample_size: int, channels: int = 1, *, widths=(16, 32), seed: int = 0):
    """A small diffusers ``UNet2DModel`` (needs the ``diffusion`` extra): two resolution levels,
    one ResNet block each, group norm over 8 groups."""
    from diffusers import UNet2DModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return UNet2DModel(sample_size=sample_size, in_channels=channels,
                           out_channels=channels, block_out_channels=tuple(widths),
                           layers_per_block=1, norm_num_groups=8,
                           down_block_types=("DownBlock2D",) * len(widths),
                           up_block_types=("UpBlock2D",) * len(widths))


def save_unet(model, path: str | Path) -> None:
    """Save a ``UNet2DModel``'s config and weights in one torch file."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"kind": "UNet2DModel", "config": dict(model.config),
                "state_dict": model.state_dict()}, path)


def load_unet(path: str | Path, map_location="cpu"):
    """The ``UNet2DModel`` saved by :func:`save_unet` (built from its config: no download)."""
    from diffusers import UNet2DModel

    ckpt = torch.load(path, map_location=map_location, weights_only=False)
    if not isinstance(ckpt, dict) or ckpt.get("kind") != "UNet2DModel":
        raise ValueError(f"{path}: not a UNet2DModel checkpoint written by save_unet")
    model = UNet2DModel.from_config(ckpt["config"])
    model.load_state_dict(ckpt["state_dict"])
    return model
