"""Noise-prediction networks ``eps(x, t)`` for the diffusion benchmarks (Ho et al. 2020).

:class:`MLPDenoiser` is an MLP for low-dimensional data (two moons), the scale of a diffusion
policy; :func:`small_unet` builds a small diffusers ``UNet2DModel`` for 8x8 or 28x28 images.
Both take a noisy batch and its timesteps and return the predicted noise; sampling them is the
triangular system that :mod:`paraprop.diffusion` solves in parallel. ``diffusers`` (the
``diffusion`` extra) is imported only by the UNet functions.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from paraprop import checks
from paraprop.models.checkpoint import Checkpointed, load_checkpoint, save_checkpoint

_REFERENCE_STEPS = 1000  # timesteps are embedded as if the schedule had this many


def timestep_embedding(t: torch.Tensor, dim: int, *, max_period: float = 10000.0,
                       scale: float = 1.0) -> torch.Tensor:
    """Sinusoidal features of the timesteps (Vaswani et al. 2017, §3.5; Ho et al. 2020, App. B).

    Feature ``k < dim/2`` is ``sin(s t w_k)`` and feature ``dim/2 + k`` is ``cos(s t w_k)``, with
    ``s = scale`` and the
    frequencies ``w_k = max_period ** (-k / (dim/2))`` spread geometrically from 1 down to
    ``1/max_period``. Computed in float64 (float32 on MPS, which lacks float64), so a float32 and
    a float64 model see the same features up to rounding.

    Arguments:
        t: timesteps, shape ``(N,)``, integer or floating point.
        dim: number of features (even).
        max_period: the longest period.
        scale: factor applied to ``t`` (in the wide dtype) before the sinusoids.

    Returns:
        The features, shape ``(N, dim)``, float64 (float32 on MPS).

    Raises:
        ValueError: ``dim`` is not an even positive int, or ``t`` is not 1-D.

    Example:
        >>> from paraprop.models.denoisers import timestep_embedding
        >>> timestep_embedding(torch.tensor([0, 10]), 4)[0].tolist()
        [0.0, 0.0, 1.0, 1.0]
    """
    checks.positive_int("dim", dim)
    if dim % 2:
        raise ValueError(f"dim must be even (sine and cosine pairs), got {dim}")
    if t.dim() != 1:
        raise ValueError(f"t must be 1-D (one timestep per row), got shape {tuple(t.shape)}")
    wide = torch.float32 if t.device.type == "mps" else torch.float64
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device, dtype=wide)
                      * (-math.log(max_period) / half))
    t = t.to(wide) if scale == 1.0 else t.to(wide) * scale
    angle = t[:, None] * freqs[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=1)


class MLPDenoiser(Checkpointed, nn.Module):
    """``eps(x, t)`` for ``x`` of shape ``(N, dim)``: an MLP (SiLU) on ``x`` concatenated with a
    sinusoidal embedding of the timestep.

    The timestep is read relative to the training schedule: ``t`` is embedded as
    ``t * 1000 / num_train_timesteps``, so the same frequencies cover the schedule whatever its
    length (with the default 1000 timesteps, ``t`` itself).

    Arguments:
        dim: features of a sample.
        hidden: width of every hidden layer.
        layers: number of hidden layers.
        embed: size of the timestep embedding (even).
        num_train_timesteps: length of the noise schedule the model is trained for (the
            ``num_train_timesteps`` of the diffusers scheduler); kept in :attr:`config`.
        seed: seed of the weight initialisation (the global random state is not touched).

    Raises:
        ValueError: a size that is not a positive int, an odd ``embed``, or a negative ``seed``.

    Example:
        >>> net = paraprop.models.MLPDenoiser(dim=2, hidden=16, layers=2)
        >>> net(torch.randn(5, 2), torch.tensor([999, 500, 10, 0, 3])).shape
        torch.Size([5, 2])
        >>> net(torch.randn(5, 2), 7).shape
        torch.Size([5, 2])
    """

    def __init__(self, dim: int = 2, hidden: int = 128, layers: int = 3, embed: int = 32,
                 num_train_timesteps: int = 1000, seed: int = 0):
        super().__init__()
        for name, value in (("dim", dim), ("hidden", hidden), ("layers", layers),
                            ("embed", embed), ("num_train_timesteps", num_train_timesteps)):
            checks.positive_int(name, value)
        if embed % 2:
            raise ValueError(f"embed must be even (sine and cosine pairs), got {embed}")
        checks.nonneg_int("seed", seed)
        self._config = {"dim": dim, "hidden": hidden, "layers": layers, "embed": embed,
                        "num_train_timesteps": num_train_timesteps, "seed": seed}
        self.dim, self.embed = dim, embed
        self.time_scale = _REFERENCE_STEPS / num_train_timesteps
        sizes = [dim + embed] + [hidden] * layers
        mods: list[nn.Module] = []
        for i, o in zip(sizes, sizes[1:], strict=False):
            mods += [nn.utils.skip_init(nn.Linear, i, o), nn.SiLU()]
        mods.append(nn.utils.skip_init(nn.Linear, sizes[-1], dim))
        self.net = nn.Sequential(*mods)
        # torch's default Linear initialisation, drawn from a generator of its own
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    bound = 1.0 / math.sqrt(layer.in_features)
                    layer.weight.uniform_(-bound, bound, generator=g)
                    layer.bias.uniform_(-bound, bound, generator=g)

    @property
    def config(self) -> dict:
        """The constructor's arguments (a copy): ``MLPDenoiser(**model.config)`` rebuilds the
        architecture."""
        return dict(self._config)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        """The predicted noise.

        Arguments:
            x: noisy samples, shape ``(N, dim)``, in the model's dtype.
            t: the timestep: a Python int or float, a 0-d tensor (the same for every row), or a
                1-D tensor of length ``N`` (one per row); integer or floating point.

        Returns:
            The predicted noise, shaped like ``x``.

        Raises:
            ValueError: ``x`` or ``t`` of the wrong shape, or ``x`` of another dtype than the
                model's.
            TypeError: ``x`` not a tensor, or ``t`` not a number or a real tensor.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor of shape (N, {self.dim}), got "
                            f"{type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"x must have shape (N, {self.dim}), got {tuple(x.shape)}")
        weight = self.net[0].weight
        if x.dtype != weight.dtype:
            raise ValueError(f"x must have the model's dtype {weight.dtype}, got {x.dtype}")
        t = _timesteps(t, x.shape[0], x.device)
        n = self._config["num_train_timesteps"]
        if not t.is_floating_point() and t.numel() and 0 <= int(t.min()) and int(t.max()) < n:
            # the features of every training timestep, computed once: a sampler calls the
            # model with the same timesteps many times (same values as computing them per row)
            key = (x.dtype, x.device)
            if getattr(self, "_table_key", None) != key:
                steps = torch.arange(n, device=x.device)
                self._table = timestep_embedding(steps, self.embed,
                                                 scale=self.time_scale).to(x.dtype)
                self._table_key = key
            emb = self._table.index_select(0, t)
        else:
            emb = timestep_embedding(t, self.embed, scale=self.time_scale).to(x.dtype)
        return self.net(torch.cat([x, emb], dim=1))



def _timesteps(t, n: int, device) -> torch.Tensor:
    """``t`` as a 1-D tensor of ``n`` timesteps on ``device``."""
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"t must hold integer or floating-point timesteps, got {t.dtype}")
    elif checks.is_number(t):
        t = torch.tensor(t)
    else:
        raise TypeError(f"t must be an int, a float or a tensor of timesteps, got "
                        f"{type(t).__name__}")
    if t.dim() == 0:
        t = t.expand(n)
    elif t.shape != (n,):
        raise ValueError(f"t must be a scalar, a 0-d tensor or have shape ({n},) (one "
                         f"timestep per row of x), got shape {tuple(t.shape)}")
    return t.to(device)


def small_unet(sample_size: int, channels: int = 1, *, widths=(32, 64), seed: int = 0,
               classes: int = 0):
    """A small diffusers ``UNet2DModel`` for square images (needs the ``diffusion`` extra).

    One resolution level per entry of ``widths`` (``DownBlock2D`` / ``UpBlock2D``, one ResNet
    block each, the size halved between levels), no middle block and no attention: about 470K
    parameters with the default widths. Group norm uses the largest group count ``<= 8`` that
    divides every width.

    Arguments:
        sample_size: height and width of the images; divisible by ``2 ** (len(widths) - 1)``.
        channels: image channels (in and out).
        widths: channels of each level.
        seed: seed of the weight initialisation (the global random state is restored after).
        classes: ``0`` (unconditional), or the number of classes of a class-conditional model:
            ``model(x, t, class_labels=y)`` with ``y`` in ``0 .. classes``, ``classes`` being
            the null class of classifier-free guidance (``num_class_embeds = classes + 1``).

    Returns:
        A ``diffusers.UNet2DModel`` in training mode; ``model(x, t).sample`` is the predicted
        noise, with ``t`` a 0-d tensor or one timestep per image.

    Raises:
        ValueError: a bad ``sample_size``, ``channels``, ``widths`` or ``seed``.
        ImportError: diffusers is not installed.

    Example:
        >>> unet = small_unet(8, widths=(8, 16))
        >>> unet(torch.randn(2, 1, 8, 8), torch.tensor(3)).sample.shape
        torch.Size([2, 1, 8, 8])
    """
    checks.positive_int("sample_size", sample_size)
    checks.positive_int("channels", channels)
    checks.nonneg_int("seed", seed)
    checks.nonneg_int("classes", classes)
    if not isinstance(widths, tuple | list) or not widths or not all(
            checks.is_int(w) and w >= 1 for w in widths):
        raise ValueError(f"widths must be a non-empty tuple of positive ints, got {widths!r}")
    scale = 2 ** (len(widths) - 1)
    if sample_size % scale:
        raise ValueError(f"sample_size must be divisible by {scale} (halved between the "
                         f"{len(widths)} levels of widths={tuple(widths)}), got {sample_size}")
    common = math.gcd(*widths)
    groups = max(d for d in range(1, 9) if common % d == 0)
    from diffusers import UNet2DModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return UNet2DModel(sample_size=sample_size, in_channels=channels,
                           out_channels=channels, block_out_channels=tuple(widths),
                           layers_per_block=1, norm_num_groups=groups, mid_block_type=None,
                           down_block_types=("DownBlock2D",) * len(widths),
                           up_block_types=("UpBlock2D",) * len(widths),
                           num_class_embeds=classes + 1 if classes else None)


def save_unet(model, path: str | Path) -> None:
    """Save a ``UNet2DModel``'s config and weights in one torch file (:func:`load_unet` reads
    it back without any download).

    Raises:
        TypeError: ``model`` is not a ``diffusers.UNet2DModel``.
    """
    # diffusers.models, not diffusers: the package's __init__ gives type checkers a dummy class
    from diffusers.models import UNet2DModel

    if not isinstance(model, UNet2DModel):
        raise TypeError(f"model must be a diffusers UNet2DModel, got {type(model).__name__}")
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    save_checkpoint("UNet2DModel", config, model.state_dict(), path)


def load_unet(path: str | Path, map_location="cpu"):
    """The ``UNet2DModel`` saved by :func:`save_unet` at ``path``, built from its config
    (``UNet2DModel.from_config``; no download) and put in eval mode.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a UNet2DModel checkpoint written by :func:`save_unet`, or
            its weights do not fit its config; the message names the file.
    """
    from diffusers import UNet2DModel

    def build(**config):
        return UNet2DModel.from_config(config)

    return load_checkpoint(build, "UNet2DModel", path, map_location).eval()
