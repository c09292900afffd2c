"""A diffusion chain sampled by the diffusers loop, Picard (ParaDiGMS) and Anderson (ParaTAA),
measured side by side; shared by ``paraprop bench diffusion`` and the diffusion demo part.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from paraprop.diffusion import sample  # noqa: E402
from paraprop_lab.experiments.harness import (  # noqa: E402
    interleaved,
    median,
    model_seconds,
)
from paraprop_lab.experiments.plots import save_figure  # noqa: E402
from paraprop_lab.training.ddpm import sample_loop  # noqa: E402

TOL = 1e-3


COLUMNS = ["method", "iterations", "model_evals", "time_ms", "speedup", "model_ms", "ceiling",
           "max_abs_err"]
# what the two columns of the model's own time mean, for the tables' notes
MODEL_TIME_NOTE = (
    "`model_ms`: the time inside the model's forward passes (their share of the fastest of 3 "
    "runs after the timed ones, by forward hooks, times `time_ms`); `ceiling`: the loop's time "
    "over it, the speedup a method with these model calls would reach if everything around the "
    "model cost nothing (the loop's own ceiling is what its scheduler steps cost)")


MEMORY = 3


def chain_rows(model, scheduler, shape, steps: int, *, eta, repeats: int, window: int | None,
               seed: int = 0, desc: str = "") -> tuple[list[dict], dict]:
    """Every method on one chain; rows and the per-iteration curves."""
    kw = {} if eta is None else {"eta": eta}
    specs = {"paraprop sequential": {"method": "sequential"},
             "picard": {"method": "picard", "window": window, "tol": TOL},
             f"anderson (memory {MEMORY})": {"method": "anderson", "memory": MEMORY,
                                             "tol": TOL}}
    if window is None and 64 < steps <= 128:   # the sliding window against the full one
        specs["picard, window 64"] = {"method": "picard", "window": 64, "tol": TOL}

    def loop():
        return sample_loop(model, scheduler, shape, steps, seed=seed, eta=eta)

    return _measured(model, scheduler, shape, steps, loop, specs, kw, repeats=repeats,
                     seed=seed, desc=desc)


def _measured(model, scheduler, shape, steps: int, loop, specs: dict, kw: dict, *,
              repeats: int, seed: int, desc: str) -> tuple[list[dict], dict]:
    """The diffusers ``loop`` and ``sample`` with every spec of ``specs`` on the same noise,
    timed interleaved: one row each (the loop first), and the curves of the parallel ones."""

    def gen():
        return torch.Generator().manual_seed(seed)

    ref, ref_sol = sample(model, scheduler, shape, num_inference_steps=steps,
                          method="sequential", generator=gen(), **kw)

    def runner(spec):
        return lambda: sample(model, scheduler, shape, num_inference_steps=steps,
                              generator=gen(), **spec, **kw)

    cases = {"diffusers loop": loop, **{k: runner(v) for k, v in specs.items()}}
    times = interleaved(cases, repeats=repeats, warmup=1, desc=desc)
    base = median(times["diffusers loop"])
    inside = model_seconds(model, cases, times, repeats=min(3, repeats))
    x_loop = loop()
    calls = ref_sol.stats["model_calls"]   # the loop's model calls (Heun's: 2 steps - 1)
    rows = [{"method": "diffusers loop", "iterations": calls, "model_evals": calls,
             "time_ms": 1e3 * base, "speedup": 1.0, "model_ms": 1e3 * inside["diffusers loop"],
             "ceiling": base / inside["diffusers loop"],
             "max_abs_err": float((x_loop - ref).abs().max())}]
    curves = {}
    traj_ref = ref_sol.value
    for label, spec in specs.items():
        errs, progress = [], []

        def cb(k, traj, r, errs=errs, progress=progress):
            dev = (traj - traj_ref).abs().flatten(2).amax(dim=(0, 2))   # per step
            errs.append(float(dev[-1]))
            progress.append(int((dev <= TOL).cumprod(0).sum()))

        x, sol = sample(model, scheduler, shape, num_inference_steps=steps, generator=gen(),
                        callback=cb if spec["method"] != "sequential" else None, **spec, **kw)
        t = median(times[label])
        rows.append({"method": label if spec["method"] != "picard" else
                     f"picard (window {sol.stats['window']})",
                     "iterations": sol.iterations,
                     "model_evals": sol.stats["model_evaluations"], "time_ms": 1e3 * t,
                     "speedup": base / t, "model_ms": 1e3 * inside[label],
                     "ceiling": base / inside[label],
                     "max_abs_err": float((x - ref).abs().max())})
        if spec["method"] != "sequential":
            curves[rows[-1]["method"]] = {"residual": sol.residuals.tolist(), "error": errs,
                                          "progress": progress}
    return rows, curves


# -- the schedulers people run (issue 31): Euler, DPM-Solver++, UniPC, ... ----------------------

SCHEDULER_COLUMNS = ["scheduler", "steps", *COLUMNS]


def pipeline_loop(model, scheduler, shape, steps: int, *, seed: int = 0) -> torch.Tensor:
    """The pipelines' denoising loop, written with diffusers alone: latents from one CPU
    generator scaled by ``init_noise_sigma``, then ``scheduler.step(model(
    scheduler.scale_model_input(x, t), t), t, x, generator=g)`` for every timestep (the
    generator where ``step`` takes one). A scheduler without ``init_noise_sigma`` and
    ``scale_model_input`` (``FlowMatchEulerDiscreteScheduler``: its noise is the sample at
    sigma 1) gets neither, as in the SD3 and Flux pipelines. For DDPM/DDIM it is
    :func:`sample_loop`'s loop."""
    from diffusers.utils.torch_utils import randn_tensor

    p = next(model.parameters())
    g = torch.Generator().manual_seed(seed)
    scheduler.set_timesteps(steps, device=p.device)
    x = randn_tensor(shape, generator=g, device=p.device, dtype=p.dtype)
    if hasattr(scheduler, "init_noise_sigma"):
        x = x * scheduler.init_noise_sigma
    scaled = hasattr(scheduler, "scale_model_input")
    step_kw = {"generator": g} if "generator" in inspect.signature(scheduler.step).parameters \
        else {}
    with torch.no_grad():
        for t in scheduler.timesteps:
            out = model(scheduler.scale_model_input(x, t) if scaled else x, t)
            x = scheduler.step(out, t, x, **step_kw).prev_sample
    return x


def scheduler_rows(model, name: str, make, shape, steps: int, *, repeats: int,
                   seed: int = 0) -> list[dict]:
    """One scheduler at ``steps`` steps: the pipelines' loop (:func:`pipeline_loop`), paraprop's
    sequential sample, ``picard`` (its default window) and ``anderson`` at :data:`TOL`; rows
    with ``scheduler`` and ``steps`` added (every scheduler with a reader runs in parallel).

    Arguments:
        model: the denoiser (an epsilon model; a velocity model for flow matching).
        name: the scheduler's label in the rows.
        make: zero-argument callable returning a fresh scheduler; one for the loop, one for
            paraprop, so neither reads the other's state.
    """
    specs = {"paraprop sequential": {"method": "sequential"},
             "picard": {"method": "picard", "tol": TOL},
             f"anderson (memory {MEMORY})": {"method": "anderson", "memory": MEMORY,
                                             "tol": TOL}}
    looped, sampled = make(), make()

    def loop():
        return pipeline_loop(model, looped, shape, steps, seed=seed)

    rows, _ = _measured(model, sampled, shape, steps, loop, specs, {}, repeats=repeats,
                        seed=seed, desc=f"{name} {steps}")
    for row in rows:
        row.update(scheduler=name, steps=steps)
    return rows


def curves_plot(path: Path, title: str, curves: dict, steps: int) -> Path:
    """Left: distance of the last step to the sequential sample, and the stopping rule's
    residual, per iteration. Right: leading steps within tolerance of the sequential
    trajectory, per iteration (the window's progress)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (name, c) in enumerate(curves.items()):
        color = f"C{i}"
        a.semilogy([max(v, 1e-12) for v in c["error"]], color=color, marker=".",
                   label=f"{name}: error of the sample")
        a.semilogy([max(v, 1e-12) for v in c["residual"]], color=color, ls=":",
                   label=f"{name}: change per iteration")
        b.plot(range(1, len(c["progress"]) + 1), c["progress"], color=color, marker=".",
               label=name)
    a.axhline(TOL, color="grey", ls="--", lw=0.8, label=f"tolerance {TOL:g}")
    a.set_xlabel("iteration (one batched model call each)")
    a.set_ylabel("largest absolute difference\n(zero drawn at 1e-12)")
    a.set_title("the sample against the sequential one", fontsize=9)
    a.legend(fontsize=7)
    a.grid(True, which="both", alpha=0.3)
    b.axhline(steps, color="grey", ls="--", lw=0.8)
    b.set_xlabel("iteration (one batched model call each)")
    b.set_ylabel(f"leading steps within {TOL:g}\nof the sequential trajectory")
    b.set_title(f"steps already final (of {steps})", fontsize=9)
    b.legend(fontsize=7)
    b.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=110)

