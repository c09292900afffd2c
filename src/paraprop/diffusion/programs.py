"""Step programs: what the parallel chain runs, and the Markov readers in that form.

:class:`~paraprop.diffusion.chain.DiffusionChain` runs a *step program* (:class:`StepProgram`):
``N`` steps, each one model call, with ``timesteps`` (what the model reads per row), ``noisy``
(which steps draw noise), ``apply(slice, x, out, z)`` (the scheduler step's exact operations on
a window of steps), ``linear_part(split)``, ``output_gains()`` (``|d step / d model output|``
per step, for the certificate's batch-variance term), and ``model_input(start, stop, x)``
(``scale_model_input``, applied to the rows before the model call where ``scales_input``).
:class:`~paraprop.diffusion.schedulers.StepTable` (DDPM/DDIM) is one; :class:`MarkovProgram`
makes one from a *Markov* reader of :mod:`~paraprop.diffusion.readers`, a reader whose step
reads its own input and model output only (``history == 0``, one state part):
``EulerDiscreteScheduler``, ``EulerAncestralDiscreteScheduler``,
``FlowMatchEulerDiscreteScheduler``, ``LCMScheduler`` and ``DPMSolverMultistepScheduler`` with
``solver_order=1``. The readers with history run sequentially
(:mod:`~paraprop.diffusion.history`).
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from paraprop.diffusion.readers import Reader


class StepProgram(Protocol):
    """What :class:`~paraprop.diffusion.chain.DiffusionChain` runs (see the module doc)."""

    scales_input: ClassVar[bool]   # whether model_input scales the rows (scale_model_input)

    @property
    def N(self) -> int: ...

    @property
    def timesteps(self) -> torch.Tensor: ...   # (N,): what the model reads, per row

    def to(self, device) -> StepProgram: ...

    def linear_part(self, split: str) -> torch.Tensor: ...

    def model_input(self, start: int, stop: int, x: torch.Tensor) -> torch.Tensor: ...

    def apply(self, index: slice, x: torch.Tensor, out: torch.Tensor,
              z: torch.Tensor) -> torch.Tensor: ...


def markov(reader: Reader) -> bool:
    """Whether ``reader``'s step reads its own input and model output only."""
    return reader.history == 0 and reader.parts == 1


def setting(reader: Reader) -> str:
    """The scheduler and the setting that makes its reader read history (for messages)."""
    cfg = reader.config
    name = reader.classname
    if name in ("DPMSolverMultistepScheduler", "UniPCMultistepScheduler"):
        return f"{name} with solver_order={cfg.solver_order}"
    return name


class MarkovProgram:
    """A Markov reader (:func:`markov`) as a step program for
    :class:`~paraprop.diffusion.chain.DiffusionChain` (see the module doc): the chain's windows
    ``(n, B, F)`` are the reader's states of one part, its model input is the reader's
    ``scale_model_input``, its step the reader's step.

    Example:
        >>> from diffusers import FlowMatchEulerDiscreteScheduler
        >>> from paraprop.diffusion import readers
        >>> p = MarkovProgram(readers.reader(FlowMatchEulerDiscreteScheduler(shift=3.0), 4))
        >>> p.N, p.scales_input, p.linear_part("identity").tolist()
        (4, True, [1.0, 1.0, 1.0, 1.0])
        >>> [round(g, 4) for g in p.output_gains().tolist()]   # |dt| of each Euler step
        [0.1423, 0.2555, 0.5932, 0.0089]
    """

    scales_input: ClassVar[bool] = True

    def __init__(self, reader: Reader):
        if not markov(reader):
            raise ValueError(f"MarkovProgram: {setting(reader)} reads history "
                             f"(history={reader.history}, parts={reader.parts}); a step "
                             "program needs history=0 and one state part")
        self.reader = reader
        self.name = reader.classname
        self.N = reader.K
        self.timesteps = reader.timesteps
        self.noisy = torch.tensor([bool(v) for v in reader.noisy], dtype=torch.bool)
        self.device = reader.device

    def to(self, device) -> MarkovProgram:
        """This program, for samples on ``device`` (the device its reader was made for: the
        scheduler keeps some of its state there)."""
        device = torch.device(device)
        if device.type != self.device.type or (
                device.index is not None and self.device.index is not None
                and device.index != self.device.index):
            raise ValueError(f"{self.name}: samples on {device}, but the reader was made for "
                             f"{self.device} (make it with device={device})")
        return self

    def linear_part(self, split: str) -> torch.Tensor:
        """``a = 1`` for ``split="identity"``; ``"eps"`` is refused: a reader's step has no
        linear part derived here."""
        if split != "identity":
            raise refuse_split(self.name, split)
        return torch.ones(self.N, dtype=torch.float32)

    def model_input(self, start: int, stop: int, x: torch.Tensor) -> torch.Tensor:
        """``scale_model_input`` of the steps ``[start, stop)`` on ``x`` ``(n, B, F)``."""
        return self.reader.model_input(start, stop, x[:, None])

    def apply(self, index: slice, x: torch.Tensor, out: torch.Tensor,
              z: torch.Tensor) -> torch.Tensor:
        """``x_{s+1}`` for the steps ``index`` (a slice) from ``x``, the model outputs ``out``
        and the noise ``z`` (each ``(n, B, F)``): the reader's step."""
        new, _ = self.reader.step(index.start, index.stop, x[:, None], out, (), z)
        return new[:, 0]

    def output_gains(self) -> torch.Tensor:
        """``(N,)`` float64: ``|d step_s / d model output|`` (:meth:`Reader.output_gains`)."""
        gains = self.reader.output_gains()
        assert gains is not None, "a Markov reader derives its output gains"
        return gains


def refuse_split(name: str, split: str) -> NotImplementedError:
    """The error of a Picard split a reader's program has no linear part for."""
    return NotImplementedError(
        f"diffusion.sample: split={split!r} is not implemented for {name}: its step has no "
        "linear part derived (split='eps' is DDPM's and DDIM's); use split='identity'")


__all__ = ["MarkovProgram", "StepProgram", "markov", "refuse_split", "setting"]
