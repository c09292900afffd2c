"""Classifier-free guidance as the diffusers pipelines compute it, as one model for
:func:`paraprop.diffusion.sample`.

A pipeline with guidance evaluates its denoiser on the latents twice per step, in one call: the
unconditional half and the conditional half concatenated (``torch.cat([latents] * 2)``, with the
negative and the positive prompt embeddings concatenated the same way), then mixes the two
outputs, ``u + guidance_scale * (c - u)``, and with ``guidance_rescale > 0`` rescales the mix to
the conditional output's standard deviation (Lin et al. 2024, section 3.4). :class:`Guided` is
that model: ``Guided(unet, 7.5, cond={...}, uncond={...})(x, t)`` is the guided output for the
rows ``x``, with the same float operations as the pipeline, so the sampler's sequential loop is
the pipeline's loop bit for bit.

The sampler evaluates a window of steps in one call, ``n * B`` rows (step-major: the ``B``
samples of the first step, then of the next, ...). The conditioning tensors hold one row per
sample (``B``); :class:`Guided` tiles them over the rows it is given, so that row ``r`` reads
sample ``r % B``'s conditioning, and concatenates the two halves as the pipeline does.
"""

from __future__ import annotations

from typing import Any

import torch

from paraprop import checks
from paraprop.diffusion.readers import model_output


class Guided(torch.nn.Module):
    """``model`` under classifier-free guidance (see the module doc).

    Arguments:
        model: the denoiser, ``model(x, t, **kwargs)`` returning a tensor, a tuple whose first
            item is the output, or an object with ``.sample`` (diffusers' ``UNet2DConditionModel``
            returns ``UNet2DConditionOutput``).
        guidance_scale: the pipelines' ``guidance_scale`` (a float ``> 1``: at ``<= 1`` the
            pipelines skip guidance, call the model on the conditional half only).
        cond, uncond: the model's keyword arguments of the conditional and the unconditional
            half: tensors with one row per sample (``B``), or dicts of them (``added_cond_kwargs``
            of SDXL); the same keys in both.
        guidance_rescale: the pipelines' ``guidance_rescale`` (``0``: none).
        shared: keyword arguments passed to every call as they are (``cross_attention_kwargs``).

    Example:
        >>> net = lambda x, t, emb: x * emb[:, :1]
        >>> g = Guided(net, 3.0, cond={"emb": torch.full((2, 1), 2.0)},
        ...            uncond={"emb": torch.zeros(2, 1)})
        >>> g(torch.ones(4, 1), torch.zeros(4, dtype=torch.long)).flatten().tolist()   # 0 + 3 * 2
        [6.0, 6.0, 6.0, 6.0]
    """

    def __init__(self, model, guidance_scale: float, *, cond: dict, uncond: dict,
                 guidance_rescale: float = 0.0, shared: dict | None = None):
        super().__init__()
        checks.callable_arg("model", model)
        scale = checks.positive_number("guidance_scale", guidance_scale, finite=True)
        if scale <= 1:
            raise ValueError(f"guidance_scale must be > 1 for classifier-free guidance (the "
                             f"pipelines call the model on the conditional half alone at <= 1: "
                             f"pass that model and its kwargs to sample), got {guidance_scale!r}")
        rescale = checks.nonneg_number("guidance_rescale", guidance_rescale, finite=True)
        for name, value in (("cond", cond), ("uncond", uncond)):
            if not isinstance(value, dict) or not value:
                raise TypeError(f"{name} must be a non-empty dict of the model's keyword "
                                f"arguments, got {type(value).__name__}")
        _same_keys(cond, uncond)
        rows = {_rows(f"cond[{k!r}]", v) for k, v in cond.items()} | \
            {_rows(f"uncond[{k!r}]", v) for k, v in uncond.items()}
        if len(rows) != 1:
            raise ValueError(f"every conditioning tensor must hold one row per sample (the same "
                             f"count), got first dims {sorted(rows)}")
        self.model = model
        self.guidance_scale = guidance_scale
        self.guidance_rescale = rescale
        self.cond, self.uncond = cond, uncond
        self.shared = dict(shared or {})
        self.samples = rows.pop()

    def extra_repr(self) -> str:
        return (f"guidance_scale={self.guidance_scale!r}, "
                f"guidance_rescale={self.guidance_rescale!r}, samples={self.samples}")

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        R, B = x.shape[0], self.samples
        if R % B:
            raise ValueError(f"Guided: {R} rows of x are not whole steps of the {B} samples its "
                             "conditioning holds")
        kwargs: dict[str, Any] = {k: _halves(self.uncond[k], self.cond[k], R // B)
                                  for k in self.cond}
        both = torch.cat([x, x])
        times = torch.cat([t, t]) if t.dim() else t
        out = model_output(self.model(both, times, **kwargs, **self.shared))
        uncond, cond = out.chunk(2)
        # the pipelines' mix, operation for operation
        guided = uncond + self.guidance_scale * (cond - uncond)
        if self.guidance_rescale > 0.0:
            dims = list(range(1, cond.ndim))
            std_cond = cond.std(dim=dims, keepdim=True)
            std_guided = guided.std(dim=dims, keepdim=True)
            rescaled = guided * (std_cond / std_guided)
            guided = self.guidance_rescale * rescaled + (1 - self.guidance_rescale) * guided
        return guided


def _rows(name: str, value) -> int:
    if isinstance(value, dict):
        found = {_rows(f"{name}[{k!r}]", v) for k, v in value.items()}
        if len(found) != 1:
            raise ValueError(f"{name}: every tensor must hold one row per sample, got first "
                             f"dims {sorted(found)}")
        return found.pop()
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        got = "a 0-d tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"{name} must be a tensor with one row per sample (or a dict of them), "
                        f"got {got}")
    return value.shape[0]


def _same_keys(a, b, name: str = "cond") -> None:
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or set(a) != set(b):
            raise ValueError(f"{name}: cond and uncond must hold the same keys, got "
                             f"{sorted(a) if isinstance(a, dict) else type(a).__name__} and "
                             f"{sorted(b) if isinstance(b, dict) else type(b).__name__}")
        for k in a:
            _same_keys(a[k], b[k], f"{name}[{k!r}]")


def _halves(first, second, steps: int):
    """The ``first`` then the ``second`` half, each tiled over ``steps`` steps (the pipelines
    with text put the unconditional half first, DiT the conditional one); ``second=None``:
    ``first`` alone, tiled."""
    if isinstance(first, dict):
        return {k: _halves(first[k], None if second is None else second[k], steps)
                for k in first}
    tile = (steps,) + (1,) * (first.dim() - 1)
    if second is None:
        return first if steps == 1 else first.repeat(tile)
    if steps == 1:
        return torch.cat([first, second])
    return torch.cat([first.repeat(tile), second.repeat(tile)])
