"""Demo part: a diffusion model on two moons, sampled by the diffusers loop and in parallel."""

from __future__ import annotations

from pathlib import Path

from paraprop_lab.demos._common import frozen, part_model, part_result
from paraprop_lab.experiments.diffusion import COLUMNS, TOL, chain_rows, curves_plot
from paraprop_lab.experiments.explain import fewer_passes, pass_cost

ORDER = 40
REQUIRES = ("diffusers",)
TITLE = "Diffusion sampling: the diffusers loop's sample in far fewer sequential model calls"
SECONDS = {"quick": 5, "default": 13, "full": 900}


def run(out_dir: Path, *, quick: bool = False, full: bool = False) -> dict:
    from diffusers import DDPMScheduler

    from paraprop_lab.training.ddpm import trained_denoiser

    model, info, full = part_model(
        "ddpm", out_dir, quick=quick, full=full,
        train=lambda: frozen(trained_denoiser(out_dir, "moons",
                                              **({"epochs": 2} if quick else {}))))
    steps = 100 if quick else 1000
    title = f"MLP denoiser on two moons, batch 16, DDPM {steps} steps"
    rows, curves = chain_rows(model, DDPMScheduler(clip_sample=False), (16, 2), steps,
                              eta=None, repeats=1 if quick else 3, window=None,
                              desc="demo diffusion")
    plot = curves_plot(out_dir / "demo_diffusion.png", title, curves, steps)
    return part_result(title, rows, COLUMNS, explain(rows, steps), [plot],
                       heading=f"{title}; tol={TOL:g}; speedup over the diffusers loop, same "
                       "noise", model=info)


def explain(rows: list[dict], steps: int) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows: the parallel
    samplers' iterations (one batched model call over the window each) against the loop's
    sequential steps."""
    base = rows[0]
    winner = max(rows, key=lambda r: r["speedup"])
    parallel = [r for r in rows if r["iterations"] < steps]
    m = winner if winner in parallel else max(parallel, key=lambda r: r["speedup"])
    why = fewer_passes(
        m["method"], "the diffusers loop", speedup=m["speedup"], passes=m["iterations"],
        steps=steps, cost=pass_cost(m["time_ms"], m["iterations"], base["time_ms"], steps),
        pass_word="iteration", step_word="loop step",
        detail=f" ({m['model_evals'] / m['iterations']:.0f} model evaluations in one batch)",
        winner="the diffusers loop" if winner is base else winner["method"],
        winner_speedup=winner["speedup"])
    if winner is not m and m["speedup"] <= 1:
        why += (f" Parallel sampling wins where one batched call over "
                f"{m['model_evals'] / m['iterations']:.0f} steps costs about one loop step: on a "
                "GPU (ParaDiGMS, Shih et al. 2023); this CPU computes the batch's rows at about "
                "the cost of as many loop steps.")
    headline = (f"{m['method']} {m['iterations']} iterations vs {steps} steps, "
                f"{m['speedup']:.2f}x the diffusers loop")
    if winner is not m:
        headline += f"; fastest: {winner['method']} ({winner['speedup']:.2f}x)"
    return why, headline
