"""Demo part: a diffusion model on two moons, sampled by the diffusers loop and in parallel."""

from __future__ import annotations

from pathlib import Path

from paraprop_lab.demos import _weights
from paraprop_lab.experiments.diffusion import COLUMNS, TOL, chain_rows, curves_plot
from paraprop_lab.experiments.explain import fewer_passes, pass_cost
from paraprop_lab.experiments.report import markdown_table, text_table

ORDER = 40
REQUIRES = ("diffusers",)
TITLE = "Diffusion sampling: the diffusers loop's sample in far fewer sequential model calls"
SECONDS = {"quick": 5, "default": 13, "full": 900}


def run(out_dir: Path, *, quick: bool = False, full: bool = False) -> dict:
    from diffusers import DDPMScheduler

    from paraprop_lab.training.ddpm import trained_denoiser

    out_dir.mkdir(parents=True, exist_ok=True)
    if not (quick or full) and _weights.path("ddpm") is None:
        print(f"{_weights.describe('ddpm')}: missing here, so this part trains the --full "
              "model instead")
        full = True
    if quick or full:
        model, info = trained_denoiser(out_dir, "moons", **({"epochs": 2} if quick else {}))
        model.requires_grad_(False)
    else:
        model = _weights.load("ddpm")
        info = {"checkpoint": str(_weights.path("ddpm")), "trained_now": False,
                "command": _weights.CHECKPOINTS["ddpm"]["command"]}
        print(_weights.describe("ddpm"))
    steps = 100 if quick else 1000
    title = f"MLP denoiser on two moons, batch 16, DDPM {steps} steps"
    rows, curves = chain_rows(model, DDPMScheduler(clip_sample=False), (16, 2), steps,
                              eta=None, repeats=1 if quick else 3, window=None,
                              desc="demo diffusion")
    print(f"{title}; tol={TOL:g}; speedup over the diffusers loop, same noise")
    print(text_table(rows, COLUMNS))
    why, headline = explain(rows, steps)
    print(why)
    plot = curves_plot(out_dir / "demo_diffusion.png", title, curves, steps)
    md = markdown_table(rows, COLUMNS) + "\n\n" + why + f"\n\n![]({plot.name})"
    return {"rows": rows, "sections": [(title, md)], "model": info, "why": why,
            "headline": headline, "plots": [plot]}


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
