"""The readers with history (DPM-Solver++ of order 2 and 3, UniPC, Heun) in
:func:`~paraprop.diffusion.sample` with ``method="sequential"``: their diffusers loop through the
reader, as a Solution; and the refusals of what the readers' schedulers do not implement (DDIM's
step options, a ``mu`` that would be ignored).

In parallel they run through the chain (:class:`~paraprop.diffusion.programs.HistoryProgram`:
the records of the steps before a window are certified ones or evaluated in the window's call;
Heun's records, the first evaluation's derivative and input sample, side by side in one).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from paraprop.diffusion.chain_checks import check_steps_finite
from paraprop.diffusion.readers import Reader, model_output
from paraprop.driver import Outcome, build
from paraprop.result import Result, Solution


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


def loop_solution(reader: Reader, model, x_init: torch.Tensor, z: torch.Tensor,
                  model_kwargs: dict, evaluate, max_iters: int | None,
                  num_inference_steps: int, split: str) -> Solution:
    """The diffusers loop through ``reader`` (:func:`history_loop`) as a Solution, whose value
    is the trajectory ``(B, K, ...)``; where ``max_iters`` is below the loop's ``K`` calls, as
    DDPM's loop, none is made and nothing is certified (``stats["reason"]`` says why)."""
    start = time.perf_counter()
    B, N = x_init.shape[0], reader.K
    reason = None
    if max_iters is not None and max_iters < N:
        reason = (f"the loop needs {N} model calls ({reader.classname}, "
                  f"num_inference_steps={num_inference_steps}), more than "
                  f"max_iters={max_iters}")
        traj = x_init[:, None].expand(B, N, *x_init.shape[1:]).clone()
    else:
        with torch.no_grad():
            traj = history_loop(reader, model, x_init, z, model_kwargs, evaluate)
        check_steps_finite(traj.reshape(B, N, -1))
    ran = reason is None
    calls = N if ran else 0
    stats: dict[str, Any] = {
        "model_calls": calls, "model_evaluations": calls, "max_rows": B if ran else 0,
        "steps": N, "T": N, "split": split, "passes": 0, "fallback_steps": calls,
        "sample_iterations": torch.full((B,), calls, dtype=torch.long), "window": 1,
        "certificate": "bitwise" if ran else None,
        "bitwise": torch.full((B,), ran, dtype=torch.bool),
        "rounding_floor": 0.0, "tol_resolvable": True, "loop_bitwise": True if ran else None,
        "batch_checked_steps": [], "batch_probed_steps": None,
    }
    if reason is not None:
        stats["reason"] = reason
    out = Outcome(traj, Result.successful if ran else Result.not_certified, evaluations=calls,
                  positions=calls, sequential_steps=calls, bound=N,
                  error_estimate=0.0 if ran else float("inf"), stats=stats)
    return build("sequential", out, iterations=calls,
                 residuals=torch.zeros(0, dtype=torch.float64),
                 time_s=time.perf_counter() - start)


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


def refuse_ddim_options(scheduler, eta, use_clipped_model_output) -> None:
    """Refuse DDIM's step options for a scheduler that has none (never ignored)."""
    name = type(scheduler).__name__
    if eta is not None:
        raise ValueError(f"eta is an option of DDIMScheduler; {name} has no eta, got "
                         f"eta={eta!r}")
    if use_clipped_model_output:
        raise ValueError(f"use_clipped_model_output is an option of DDIMScheduler; {name} has "
                         "none, got True")


__all__ = ["check_mu", "history_loop", "loop_solution", "refuse_ddim_options"]
