"""diffusers' ``DiTPipeline`` loop, as :func:`paraprop.diffusion.accelerate` reads it.

``DiTPipeline.__call__`` differs from the text pipelines' loops in what :class:`~paraprop.
diffusion.pipeline_run.Run` reads at the denoiser's first call:

- it keeps ``guidance_scale`` in its call's local variables (it sets no attribute of the
  pipeline): :class:`DiTLoop` reads it from the running ``DiTPipeline.__call__`` frame, found by
  its code object (a pipeline whose loop is other code is not DiT's loop: it falls through);
- its guidance and learned-sigma arithmetic is
  :class:`~paraprop.diffusion.dit_guidance.DiTGuided` (the conditional half first);
- it steps both guidance halves, ``2 B`` rows, and keeps the first ``B``;
- it gives ``scheduler.step`` the sample ``scale_model_input`` returned (not the latents before
  it): the same loop as the others' only where ``scale_model_input`` is the identity (DDIM, DDPM,
  LCM, DPM-Solver); for the schedulers that scale (Euler, Euler ancestral) it falls through;
- it passes ``scheduler.step`` no generator: the schedulers that draw step noise draw it from the
  global RNG, which falls through (:meth:`Run._step_noise`);
- it calls the transformer with ``return_dict`` left ``True`` (the output is rebuilt around the
  served tensor).
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import torch

from paraprop import checks
from paraprop.diffusion.dit_guidance import DiTGuided
from paraprop.diffusion.pipeline_calls import Call, FallThrough, half, has_rows

NAME = "DiTPipeline"
_FRAMES = 64   # how far up the stack the pipeline's call is looked for


def dit_class(pipe) -> type | None:
    """diffusers' ``DiTPipeline`` class where ``pipe`` is one (or of a subclass), else ``None``
    (the name and module are read: this module does not import diffusers)."""
    for cls in type(pipe).__mro__:
        if cls.__name__ == NAME and cls.__module__.startswith("diffusers."):
            return cls
    return None


class DiTLoop:
    """What ``DiTPipeline``'s loop does around its transformer (see the module doc), for one
    accelerated pipeline.

    Example:
        >>> import types
        >>> DiTLoop.of(types.SimpleNamespace()) is None   # not a DiTPipeline
        True
    """

    name = NAME

    def __init__(self, cls: type):
        self.code = inspect.unwrap(cls.__dict__["__call__"]).__code__
        self.guidance_scale: float | None = None
        self.channels: int | None = None
        self.learned_sigma = False

    @classmethod
    def of(cls, pipe) -> DiTLoop | None:
        """The loop of ``pipe`` where it is a ``DiTPipeline``, else ``None``."""
        found = dit_class(pipe)
        return None if found is None else cls(found)

    def _call_locals(self) -> dict[str, Any]:
        frame: types.FrameType | None = sys._getframe(1)
        for _ in range(_FRAMES):
            if frame is None:
                break
            if frame.f_code is self.code:
                return dict(frame.f_locals)
            frame = frame.f_back
        raise FallThrough(f"the transformer was not called from {NAME}.__call__ (its "
                          "guidance_scale is read from that call)")

    def start(self, denoiser, call: Call) -> bool:
        """Read the running call's ``guidance_scale`` and check the denoiser's arguments;
        whether guidance is on (raises :class:`FallThrough` with the reason where paraprop
        does not solve the run)."""
        local = self._call_locals()
        scale, B = local.get("guidance_scale"), local.get("batch_size")
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise FallThrough(f"{NAME}'s guidance_scale is a {type(scale).__name__}, not an int "
                              "or a float")
        channels, learned = _channels(denoiser)
        if channels is None:
            raise FallThrough(f"the transformer {type(denoiser).__name__} has no integer "
                              "config.in_channels and config.out_channels")
        cfg = bool(scale > 1)
        rows = call.x.shape[0]
        if not checks.is_int(B) or rows != (2 * B if cfg else B):
            raise FallThrough(f"{NAME} called its transformer on {rows} rows, not "
                              f"{'2 x ' if cfg else ''}batch_size={B!r}")
        if not has_rows(call.kwargs.get("class_labels"), rows):
            raise FallThrough(f"{NAME} called its transformer without class_labels of {rows} "
                              "rows")
        self.guidance_scale, self.channels, self.learned_sigma = scale, channels, learned
        return cfg

    def model(self, inner, call: Call, cfg: bool, B: int) -> DiTGuided:
        """The model :func:`~paraprop.diffusion.sample` evaluates: ``inner`` (the recording
        denoiser, called with ``2 n B`` rows under guidance: the conditional half of the
        window's steps, then the unconditional half) under DiT's guidance."""
        scale, channels, learned = self.guidance_scale, self.channels, self.learned_sigma
        assert scale is not None and channels is not None, "start() reads them first"
        per_sample = {k: v for k, v in call.kwargs.items() if has_rows(v, 2 * B if cfg else B)}
        shared = {k: v for k, v in call.kwargs.items() if k not in per_sample}
        if any(isinstance(v, torch.Tensor) for v in shared.values()):
            names = sorted(k for k, v in shared.items() if isinstance(v, torch.Tensor))
            raise FallThrough(f"{NAME}'s transformer argument(s) {names} are tensors without "
                              "one row per sample")
        if not cfg:
            return DiTGuided(inner, scale, channels=channels, learned_sigma=learned,
                             cond=per_sample, shared=shared)
        return DiTGuided(inner, scale, channels=channels, learned_sigma=learned,
                         cond=half(per_sample, B, 0), uncond=half(per_sample, B, 1),
                         shared=shared)

    def check_scaling(self, scheduler_name: str, model_input, dtype: torch.dtype) -> None:
        """Fall through where the scheduler's ``scale_model_input`` is not the identity at
        every step (``model_input(probe)``: the reader's scaling of a probe of ones, one row
        per step): ``DiTPipeline`` steps from the scaled sample."""
        probe = model_input(dtype)
        if probe is not None and not bool((probe == 1).all()):
            raise FallThrough(f"{scheduler_name}.scale_model_input scales the latents, and "
                              f"{NAME} passes the scaled sample to scheduler.step: paraprop's "
                              "step programs step from the latents before the scaling")


def _channels(denoiser) -> tuple[int | None, bool]:
    """``(in_channels, learned_sigma)`` as ``DiTPipeline`` reads them from the transformer's
    config (``learned_sigma``: ``out_channels // 2 == in_channels``)."""
    config = getattr(denoiser, "config", None)
    c_in, c_out = getattr(config, "in_channels", None), getattr(config, "out_channels", None)
    if not checks.is_int(c_in) or not checks.is_int(c_out):
        return None, False
    return c_in, c_out // 2 == c_in


__all__ = ["DiTLoop", "dit_class"]
