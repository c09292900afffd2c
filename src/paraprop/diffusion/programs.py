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
``solver_order=1``; :class:`HistoryProgram` one from a reader whose steps read the records of
earlier steps (DPM-Solver++ of order 2-3, UniPC, Heun).
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
        self._take(reader)

    def _take(self, reader: Reader) -> None:
        """What every step program keeps of its reader: the reader, the scheduler's name, the
        steps, the timesteps the model reads, which steps add noise, and the device."""
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


# the readers with history whose steps run in the chain (HistoryProgram): their records are
# one tensor shaped like the sample (Heun's: two, its first evaluation's derivative and input
# sample; UniPC's states have a second part, the corrected sample)
HISTORY_PARALLEL = ("DPMSolverMultistepScheduler", "UniPCMultistepScheduler",
                    "HeunDiscreteScheduler")


def history_parallel(reader: Reader) -> bool:
    """Whether ``reader`` reads history the chain carries (:class:`HistoryProgram`)."""
    return reader.classname in HISTORY_PARALLEL and reader.history > 0


class HistoryProgram(MarkovProgram):
    """A reader whose step ``s`` reads the *records* of the ``history`` steps before it
    (DPM-Solver++ of order 2 and 3: the converted model outputs ``m_{s-1}``, ``m_{s-2}``) as a
    step program. The chain evaluates a window's steps and, where the records before the
    window are not certified, the ``history`` steps before it in the same model call, so that
    position ``s + 1`` is ``step_s(X_s, model(X_s), X_{s-1}, model(X_{s-1}), ...)``: a
    function of earlier positions only (lower triangular), bitwise the loop's step where its
    inputs are the loop's. A state of ``parts > 1`` (UniPC: ``[x_s, corrected x_{s-1}]``, the
    corrected sample a value step ``s - 1`` computed) is a position's ``(B, parts * R)``
    values, the model reading part 0 (``R`` values per sample). A step's records of several
    tensors (Heun: the first evaluation's derivative and input sample, read by the second) are
    one ``(n, B, record_parts * R)`` tensor in the chain, the reader's tensors side by side.

    Example:
        >>> from diffusers import DPMSolverMultistepScheduler
        >>> from paraprop.diffusion import readers
        >>> p = HistoryProgram(readers.reader(DPMSolverMultistepScheduler(), 6))
        >>> p.N, p.history
        (6, 1)
    """

    def __init__(self, reader: Reader):
        if not history_parallel(reader):
            raise ValueError(f"HistoryProgram: {setting(reader)} is not read in parallel "
                             f"(history={reader.history}, parts={reader.parts}); supported: "
                             f"{', '.join(HISTORY_PARALLEL)} with history (DPM-Solver++ of "
                             "solver_order 2 or 3, UniPC of any order, Heun)")
        self._take(reader)
        self.history = reader.history
        self.parts = reader.parts
        # tensors per step's records (each shaped like the sample)
        self.record_parts = len(reader.records_like(torch.zeros(1, 1)))
        self._gains: tuple[torch.Tensor, torch.Tensor] | None = None

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, B, parts * R)`` -> the reader's states ``(n, parts, B, R)``."""
        n, B = x.shape[:2]
        return x.reshape(n, B, self.parts, -1).transpose(1, 2)

    def model_input(self, start: int, stop: int, x: torch.Tensor) -> torch.Tensor:
        """``scale_model_input`` of part 0 of the states ``x`` ``(n, B, parts * R)``."""
        return self.reader.model_input(start, stop, self._split(x))

    def _pack(self, rec: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The reader's records (``record_parts`` tensors ``(n, B, R)``) as one
        ``(n, B, record_parts * R)``."""
        return rec[0] if len(rec) == 1 else torch.cat(rec, dim=-1)

    def _unpack(self, past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`_pack`'s inverse."""
        if self.record_parts == 1:
            return (past,)
        return past.tensor_split(self.record_parts, dim=-1)

    def records(self, start: int, stop: int, x: torch.Tensor, out: torch.Tensor
                ) -> torch.Tensor:
        """The records ``(n, B, record_parts * R)`` of the steps ``[start, stop)`` from their
        states ``x`` ``(n, B, parts * R)`` and model outputs ``out`` ``(n, B, R)``."""
        return self._pack(self.reader.records(start, stop, self._split(x), out))

    def apply_history(self, index: slice, x: torch.Tensor, out: torch.Tensor,
                      z: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The states after the steps ``index`` ``(n, B, parts * R)`` and their records
        ``(n, B, record_parts * R)`` from the states ``x``, the model outputs ``out``, the
        noise ``z`` and ``past``: the records of the ``min(history, index.start)`` steps
        before ``index.start``."""
        new, rec = self.reader.step(index.start, index.stop, self._split(x), out,
                                    self._unpack(past), z)
        n, B = x.shape[:2]
        return new.transpose(1, 2).reshape(n, B, -1), self._pack(rec)

    def apply(self, index: slice, x: torch.Tensor, out: torch.Tensor,
              z: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{self.name}: a step reads the records of the steps before it; "
                        "use apply_history")

    def _derive(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``|d step_s / d out_s|`` and ``sum_j |d step_s / d out_{s-j}|`` (``j = 0 ..
        history``; each the largest over the state's parts), in float64 from the reader's own
        step at small model outputs ``2**-30`` divided back out (the step is linear in the
        model outputs for a fixed sample, and the division by a power of two is exact; small,
        so that a clipping step (Heun's ``clip_sample``) clips nothing, as the gain without
        clipping bounds the one with it)."""
        if self._gains is None:
            h = self.history
            own, total = torch.zeros(self.N, dtype=torch.float64), \
                torch.zeros(self.N, dtype=torch.float64)
            f64, dev = torch.float64, self.device
            unit = 2.0**-30
            zero = torch.zeros(1, 1, self.parts, dtype=f64, device=dev)   # (every part)
            one = torch.full((1, 1, 1), unit, dtype=f64, device=dev)
            z = torch.zeros(1, 1, 1, dtype=torch.float32, device=self.device)
            for s in range(self.N):
                hp = min(h, s)
                past = torch.zeros(hp, 1, self.record_parts, dtype=f64, device=dev)
                y, _ = self.apply_history(slice(s, s + 1), zero, one, z, past)
                own[s] = total[s] = float(y.abs().max()) / unit
                for j in range(hp):   # the record of step s - hp + j at a unit output
                    rec = past.clone()
                    rec[j] = self.records(s - hp + j, s - hp + j + 1, zero, one)[0]
                    y, _ = self.apply_history(slice(s, s + 1), zero, one * 0, z, rec)
                    total[s] += float(y.abs().max()) / unit
            self._gains = (own, total)
        return self._gains

    def output_gains(self) -> torch.Tensor:
        """``(N,)`` float64: ``sum_j |d step_s / d out_{s-j}|`` over the model outputs step
        ``s`` reads (its own and its history's): how far a difference of every model output
        moves the step (the certificate's batch-variance term)."""
        return self._derive()[1]

    def own_output_gains(self) -> torch.Tensor:
        """``(N,)`` float64: ``|d step_s / d out_s|``, its own model output's only."""
        return self._derive()[0]


def refuse_split(name: str, split: str) -> NotImplementedError:
    """The error of a Picard split a reader's program has no linear part for."""
    return NotImplementedError(
        f"diffusion.sample: split={split!r} is not implemented for {name}: its step has no "
        "linear part derived (split='eps' is DDPM's and DDIM's); use split='identity'")


__all__ = ["HistoryProgram", "MarkovProgram", "StepProgram", "history_parallel", "markov",
           "refuse_split", "setting"]
