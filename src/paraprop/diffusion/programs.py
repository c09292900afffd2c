"""Step programs: the schedulers beyond DDPM/DDIM in the form the parallel chain runs, and the
sequential loop of those it cannot run in parallel yet.

:class:`~paraprop.diffusion.chain.DiffusionChain` runs a *step program*: ``N`` steps, each one
model call, with ``timesteps`` (what the model reads per row), ``noisy`` (which steps draw
noise), ``apply(slice, x, out, z)`` (the scheduler step's exact operations on a window of
steps), ``linear_part(split)``, ``output_gains()`` (``|d step / d model output|`` per step, for
the certificate's batch-variance term), and, where ``scales_input`` is true,
``model_input(start, stop, x)`` (``scale_model_input``, applied to the rows before the model
call). :class:`~paraprop.diffusion.schedulers.StepTable` (DDPM/DDIM) is one;
:class:`MarkovProgram` makes one from a *Markov* reader of :mod:`~paraprop.diffusion.readers`:
a reader whose step reads its own input and model output only (``history == 0``, one state
part): ``EulerDiscreteScheduler``, ``EulerAncestralDiscreteScheduler``,
``FlowMatchEulerDiscreteScheduler``, ``LCMScheduler`` and ``DPMSolverMultistepScheduler`` with
``solver_order=1``.

The readers with history (DPM-Solver++ of order 2 and 3, UniPC, Heun) are sampled by
:func:`history_loop`, the diffusers loop through the reader, one model call per iteration;
their parallel windows need the history records in the chain (refused by name until then).
"""

from __future__ import annotations

from typing import Any

import torch

from paraprop.diffusion.readers import Reader, model_output
from paraprop.driver import Outcome, build
from paraprop.result import Result, Solution


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


def refuse_parallel(reader: Reader, method: Any) -> NotImplementedError:
    """The error of a parallel method for a reader with history."""
    if reader.classname == "HeunDiscreteScheduler":
        why = ("its second evaluation of every step reads the first's derivative and input "
               "sample (a record of the step before)")
    elif reader.classname == "UniPCMultistepScheduler":
        why = ("its predictor reads the converted model outputs of earlier steps and its "
               "corrector the corrected sample of the step before")
    else:
        why = (f"its steps read the converted model outputs of the {reader.history} steps "
               "before them")
    return NotImplementedError(
        f"diffusion.sample: method={method!r} is not implemented for {setting(reader)}: {why}, "
        "and the parallel chain does not carry such history records yet; method='sequential' "
        "works (the diffusers loop bit for bit)"
        + (", as does solver_order=1 with every method"
           if reader.classname == "DPMSolverMultistepScheduler" else ""))


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

    scales_input = True

    def __init__(self, reader: Reader):
        if not markov(reader):
            raise ValueError(f"MarkovProgram: {setting(reader)} reads history "
                             f"(history={reader.history}, parts={reader.parts}); a step "
                             "program needs history=0 and one state part")
        self.reader = reader
        self.name = reader.classname
        self.N = reader.K
        self.timesteps = reader.timesteps
        self.noisy_steps = tuple(bool(v) for v in reader.noisy)
        self.noisy = torch.tensor(self.noisy_steps, dtype=torch.bool)
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

    def initial(self, latents: torch.Tensor) -> torch.Tensor:
        """The input of step 0: the latents scaled by ``init_noise_sigma``, as the pipelines
        scale them."""
        return self.reader.initial(latents)[0]


def history_loop(reader: Reader, model, x_init: torch.Tensor, z: torch.Tensor,
                 model_kwargs: dict, evaluate=None) -> torch.Tensor:
    """The diffusers loop through ``reader`` (any reader, history included), one model call of
    the ``B`` rows per iteration, the model reading ``scale_model_input`` and one timestep per
    row. ``x_init``: the input of step 0 ``(B, ...)``; ``z``: every step's noise
    ``(K, B, ...)``. Returns the states ``(B, K, ...)`` (part 0: the samples)."""
    B = x_init.shape[0]
    state = torch.stack([x_init] * reader.parts)[None]
    past = tuple(r[:0] for r in reader.records_like(x_init[None]))
    per_row = {k for k, v in model_kwargs.items()
               if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == B}
    states = []
    for k in range(reader.K):
        x_in = reader.model_input(k, k + 1, state)[0]
        t = reader.timesteps[k: k + 1].repeat_interleave(B)

        def fn(xx, tt, rows=slice(None)):
            kw = {n: (v[rows] if n in per_row else v) for n, v in model_kwargs.items()}
            return model_output(model(xx, tt, **kw), xx)

        out = (fn(x_in, t) if evaluate is None else evaluate(fn, x_in, t))[None]
        state, rec = reader.step(k, k + 1, state, out, past, z[k: k + 1])
        if reader.history:
            past = tuple(torch.cat([p, r])[-reader.history:]
                         for p, r in zip(past, rec, strict=True))
        states.append(state[0, 0])
    return torch.stack(states, dim=1)


def check_mu(scheduler, mu) -> float | None:
    """``mu`` for ``set_timesteps``: read only with ``use_dynamic_shifting=True`` (refused
    otherwise, never ignored)."""
    name = type(scheduler).__name__
    dynamic = bool(scheduler.config.get("use_dynamic_shifting", False))
    if mu is None:
        if dynamic:
            raise ValueError(f"mu: {name} with use_dynamic_shifting=True needs mu (the "
                             "pipelines compute it from the image size), got mu=None")
        return None
    if not dynamic:
        raise ValueError(f"mu: {name} reads mu only with use_dynamic_shifting=True (its "
                         f"set_timesteps would ignore it), got mu={mu!r}")
    if isinstance(mu, bool) or not isinstance(mu, int | float):
        raise TypeError(f"mu must be a float, got {type(mu).__name__}")
    return float(mu)


def refuse_split(name: str, split: str) -> NotImplementedError:
    """The error of a Picard split a reader's program has no linear part for."""
    return NotImplementedError(
        f"diffusion.sample: split={split!r} is not implemented for {name}: its step has no "
        "linear part derived (split='eps' is DDPM's and DDIM's); use split='identity'")


def refuse_ddim_options(scheduler, eta, use_clipped_model_output) -> None:
    """Refuse DDIM's step options for a scheduler that has none (never ignored)."""
    name = type(scheduler).__name__
    if eta is not None:
        raise ValueError(f"eta is an option of DDIMScheduler; {name} has no eta, got "
                         f"eta={eta!r}")
    if use_clipped_model_output:
        raise ValueError(f"use_clipped_model_output is an option of DDIMScheduler; {name} has "
                         "none, got True")


def loop_solution(traj: torch.Tensor, N: int, B: int, split: str, time_s: float) -> Solution:
    """The Solution of the diffusers loop itself (a reader with history, sequentially)."""
    stats = {
        "model_calls": N, "model_evaluations": N, "max_rows": B, "steps": N, "T": N,
        "split": split, "passes": 0, "fallback_steps": N,
        "sample_iterations": torch.full((B,), N, dtype=torch.long), "window": 1,
        "certificate": "bitwise", "bitwise": torch.ones(B, dtype=torch.bool),
        "rounding_floor": 0.0, "tol_resolvable": True, "loop_bitwise": True,
    }
    out = Outcome(traj, Result.successful, evaluations=N, positions=N, sequential_steps=N,
                  bound=N, error_estimate=0.0, stats=stats)
    return build("sequential", out, iterations=N,
                 residuals=torch.zeros(0, dtype=torch.float64), time_s=time_s)


__all__ = ["MarkovProgram", "check_mu", "history_loop", "loop_solution", "markov",
           "refuse_ddim_options", "refuse_parallel", "refuse_split"]
