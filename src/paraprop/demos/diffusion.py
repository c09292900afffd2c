"""Demo part: a diffusion model on two moons, sampled by the diffusers loop and in parallel."""

from __future__ import annotations

from pathlib import Path

from paraprop.experiments.diffusion import COLUMNS, TOL, chain_rows, curves_plot
from paraprop.experiments.report import markdown_table, text_table

ORDER = 25
TITLE = "Diffusion sampling: the diffusers loop's sample in far fewer sequential model calls"


def run(out_dir: Path, *, quick: bool = False) -> dict:
    from diffusers import DDPMScheduler

    from paraprop.training.ddpm import trained_denoiser

    out_dir.mkdir(parents=True, exist_ok=True)
    model, info = trained_denoiser(out_dir, "moons", **({"epochs": 2} if quick else {}))
    model.requires_grad_(False)
    steps = 100 if quick else 1000
    title = f"MLP denoiser on two moons, batch 16, DDPM {steps} steps"
    rows, curves = chain_rows(model, DDPMScheduler(clip_sample=False), (16, 2), steps,
                              eta=None, repeats=1 if quick else 3, window=None,
                              desc="demo diffusion")
    print(f"{title}; tol={TOL:g}; speedup over the diffusers loop, same noise")
    print(text_table(rows, COLUMNS))
    plot = curves_plot(out_dir / "demo_diffusion.png", title, curves, steps)
    md = markdown_table(rows, COLUMNS) + f"\n\n![]({plot.name})"
    return {"rows": rows, "sections": [(title, md)], "model": info}
