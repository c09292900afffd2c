"""DiT's model output as diffusers' ``DiTPipeline`` forms it, as one model for
:func:`paraprop.diffusion.sample`.

``DiTPipeline`` (Peebles & Xie 2023, class-conditional) differs from the text pipelines'
classifier-free guidance (:class:`~paraprop.diffusion.guidance.Guided`) in four ways, all kept:

- the batch is the *conditional* half first (the class labels), then the unconditional half
  (the null class, ``1000``);
- the mix ``u + guidance_scale * (c - u)`` covers the first ``in_channels`` channels of the
  transformer's output only (the noise prediction); the channels after them (the learned
  variance) stay each half's own;
- with a learned sigma (``out_channels // 2 == in_channels``) the scheduler reads the first
  ``in_channels`` channels (the noise prediction); otherwise the whole output;
- guidance is on where ``guidance_scale > 1`` (the pipeline's test); below, the transformer sees
  the conditional half alone.

The pipeline then steps both halves (their model outputs equal in the mixed channels) and keeps
the first: the trajectory is the conditional half's, and its model output is the first half's
rows of the above. :class:`DiTGuided` computes those rows, with the same float operations
(copies aside: ``cat`` and ``split`` move bits), so the sampler's sequential loop is the
pipeline's loop bit for bit. A window of ``n`` steps holds ``n * B`` rows, step-major, and the
class labels are tiled over them as :class:`~paraprop.diffusion.guidance.Guided` tiles its
conditioning.
"""

from __future__ import annotations

from typing import Any

import torch

from paraprop import checks
from paraprop.diffusion.guidance import _halves, _rows, _same_keys
from paraprop.diffusion.readers import model_output


class DiTGuided(torch.nn.Module):
    """``model`` (a ``DiTTransformer2DModel``) under DiT's guidance (see the module doc).

    Arguments:
        model: ``model(x, t, **kwargs)`` returning a tensor, a tuple whose first item is the
            output, or an object with ``.sample`` (``Transformer2DModelOutput``).
        guidance_scale: the pipeline's ``guidance_scale`` (an int or float; guidance is on
            where it is ``> 1``).
        channels: the latents' channels (the transformer's ``in_channels``): the channels the
            guidance mixes.
        learned_sigma: whether the output carries a learned variance after them
            (``out_channels // 2 == in_channels``): the model output is then its first
            ``channels`` channels.
        cond: the model's keyword arguments of the conditional half (``class_labels``), one row
            per sample (``B``).
        uncond: those of the unconditional half (the null class): required where
            ``guidance_scale > 1``, refused below (the pipeline has no unconditional half
            there).
        shared: keyword arguments passed to every call as they are.

    Raises:
        ValueError / TypeError: a bad ``guidance_scale`` or ``channels``; ``uncond`` given or
            missing against ``guidance_scale``; conditioning that is not one row per sample.

    Example:
        >>> net = lambda x, t, class_labels: torch.cat([x * class_labels[:, None], -x], dim=1)
        >>> g = DiTGuided(net, 3.0, channels=1, learned_sigma=True,
        ...               cond={"class_labels": torch.tensor([2.0])},
        ...               uncond={"class_labels": torch.tensor([0.0])})
        >>> g(torch.ones(1, 1), torch.zeros(1)).tolist()   # 0 + 3 * (2 - 0); the sigma dropped
        [[6.0]]
    """

    def __init__(self, model, guidance_scale: float, *, channels: int, learned_sigma: bool,
                 cond: dict, uncond: dict | None = None, shared: dict | None = None):
        super().__init__()
        checks.callable_arg("model", model)
        if not checks.is_number(guidance_scale):
            raise TypeError(f"guidance_scale must be an int or a float (DiTPipeline's), got "
                            f"{type(guidance_scale).__name__}")
        self.guided = bool(guidance_scale > 1)   # DiTPipeline's test, as it writes it
        if self.guided and uncond is None:
            raise ValueError(f"guidance_scale={guidance_scale!r} > 1 turns guidance on: uncond "
                             "(the null class's arguments) is required")
        if not self.guided and uncond is not None:
            raise ValueError(f"guidance_scale={guidance_scale!r} <= 1: DiTPipeline has no "
                             "unconditional half there, so uncond must be None")
        checks.positive_int("channels", channels)
        checks.boolean("learned_sigma", learned_sigma)
        halves = (("cond", cond),) + ((("uncond", uncond),) if uncond is not None else ())
        for name, value in halves:
            if not isinstance(value, dict) or not value:
                raise TypeError(f"{name} must be a non-empty dict of the model's keyword "
                                f"arguments, got {type(value).__name__}")
        if uncond is not None:
            _same_keys(cond, uncond)
        rows = {_rows(f"{name}[{k!r}]", v) for name, value in halves for k, v in value.items()}
        if len(rows) != 1:
            raise ValueError(f"every conditioning tensor must hold one row per sample (the same "
                             f"count), got first dims {sorted(rows)}")
        self.model = model
        self.guidance_scale = guidance_scale
        self.channels, self.learned_sigma = channels, learned_sigma
        self.cond, self.uncond = cond, uncond
        self.shared = dict(shared or {})
        self.samples = rows.pop()

    def extra_repr(self) -> str:
        return (f"guidance_scale={self.guidance_scale!r}, channels={self.channels}, "
                f"learned_sigma={self.learned_sigma}, samples={self.samples}")

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        R, B, C = x.shape[0], self.samples, self.channels
        if R % B:
            raise ValueError(f"DiTGuided: {R} rows of x are not whole steps of the {B} samples "
                             "its conditioning holds")
        steps = R // B
        if not self.guided:
            kwargs: dict[str, Any] = {k: _halves(v, None, steps) for k, v in self.cond.items()}
            noise_pred = model_output(self.model(x, t, **kwargs, **self.shared))
        else:
            assert self.uncond is not None
            # the conditional half first, then the null class, as DiTPipeline concatenates
            kwargs = {k: _halves(self.cond[k], self.uncond[k], steps) for k in self.cond}
            both = torch.cat([x, x])
            times = torch.cat([t, t]) if t.dim() else t
            out = model_output(self.model(both, times, **kwargs, **self.shared))
            eps, rest = out[:, :C], out[:, C:]
            cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
            half_eps = uncond_eps + self.guidance_scale * (cond_eps - uncond_eps)
            # the pipeline's cat([half_eps, half_eps]) then cat([eps, rest], dim=1): the
            # first half's rows are half_eps beside the conditional half's own other channels
            noise_pred = torch.cat([half_eps, rest[:R]], dim=1)
        if self.learned_sigma:
            model_out, _ = torch.split(noise_pred, C, dim=1)
            return model_out
        return noise_pred


__all__ = ["DiTGuided"]
