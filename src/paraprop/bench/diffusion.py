"""``paraprop bench diffusion``: exact parallel sampling of diffusion models (ParaDiGMS, ParaTAA).

Models trained here (``paraprop train ddpm``): an MLP denoiser on two moons (the scale of a
diffusion policy: per-call overhead dominates) and a small UNet on the digits. For DDPM with 1000
steps and DDIM with 50 and 100 steps (eta 0 and 1), every method samples the same noise; the
baseline is the diffusers loop ``scheduler.step(model(x, t), t, x)``. Reported per method: the
sequential model calls (iterations), model evaluations per sample, wall time against the
diffusers loop, and the largest deviation from the sequential sample. A last table checks
diffusers' own batched steps (``DDPMParallelScheduler`` / ``DDIMParallelScheduler``) against
their sequential schedulers.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from paraprop.bench.harness import interleaved, machine_info, median  # noqa: E402
from paraprop.bench.plots import save_figure  # noqa: E402
from paraprop.bench.report import markdown_table, text_table, write_results  # noqa: E402
from paraprop.diffusion import sample, step_table  # noqa: E402
from paraprop.training.ddpm import sample_loop, trained_denoiser  # noqa: E402

DESCRIPTION = "diffusion sampling: diffusers loop vs Picard (ParaDiGMS) vs Anderson (ParaTAA)"
TOL = 1e-3
COLUMNS = ["method", "iterations", "model_evals", "time_ms", "speedup", "max_abs_err"]
MEMORY = 3


def chain_rows(model, scheduler, shape, steps: int, *, eta, repeats: int, window: int | None,
               seed: int = 0, desc: str = "") -> tuple[list[dict], dict]:
    """Every method on one chain; rows and the per-iteration curves."""
    kw = {} if eta is None else {"eta": eta}

    def gen():
        return torch.Generator().manual_seed(seed)

    def loop():
        return sample_loop(model, scheduler, shape, steps, seed=seed, eta=eta)

    ref, ref_sol = sample(model, scheduler, shape, num_inference_steps=steps,
                          method="sequential", generator=gen(), **kw)
    specs = {"paraprop sequential": {"method": "sequential"},
             "picard": {"method": "picard", "window": window, "tol": TOL},
             f"anderson (memory {MEMORY})": {"method": "anderson", "memory": MEMORY,
                                             "tol": TOL}}
    if window is None and 64 < steps <= 128:   # the sliding window against the full one
        specs["picard, window 64"] = {"method": "picard", "window": 64, "tol": TOL}

    def runner(spec):
        return lambda: sample(model, scheduler, shape, num_inference_steps=steps,
                              generator=gen(), **spec, **kw)

    cases = {"diffusers loop": loop, **{k: runner(v) for k, v in specs.items()}}
    times = interleaved(cases, repeats=repeats, warmup=1, desc=desc)
    base = median(times["diffusers loop"])
    x_loop = loop()
    rows = [{"method": "diffusers loop", "iterations": steps, "model_evals": steps,
             "time_ms": 1e3 * base, "speedup": 1.0,
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
                     "speedup": base / t, "max_abs_err": float((x - ref).abs().max())})
        if spec["method"] != "sequential":
            curves[rows[-1]["method"]] = {"residual": sol.residuals.tolist(), "error": errs,
                                          "progress": progress}
    return rows, curves


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
    a.set_ylabel("largest absolute difference")
    a.legend(fontsize=7)
    a.grid(True, which="both", alpha=0.3)
    b.axhline(steps, color="grey", ls="--", lw=0.8)
    b.set_xlabel("iteration")
    b.set_ylabel(f"leading steps within {TOL:g} of sequential")
    b.legend(fontsize=7)
    b.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=110)


def parallel_scheduler_rows(steps_list=(50, 100, 1000)) -> list[dict]:
    """diffusers' batched steps (its ParaDiGMS schedulers) against the sequential step, on the
    same inputs and without noise: the largest deviation over all timesteps."""
    from diffusers import (
        DDIMParallelScheduler,
        DDIMScheduler,
        DDPMParallelScheduler,
        DDPMScheduler,
    )

    configs = {
        "leading spacing": {},
        "trailing spacing": {"timestep_spacing": "trailing"},
        "linspace spacing": {"timestep_spacing": "linspace"},
        "Stable Diffusion config": {"steps_offset": 1, "beta_schedule": "scaled_linear",
                                    "beta_start": 0.00085, "beta_end": 0.012},
    }
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, seq_cls, par_cls in (("DDPM", DDPMScheduler, DDPMParallelScheduler),
                                   ("DDIM", DDIMScheduler, DDIMParallelScheduler)):
        for label, cfg in configs.items():
            if name == "DDIM" and label == "Stable Diffusion config":
                cfg = {**cfg, "set_alpha_to_one": False}
            for steps in steps_list:
                if steps >= 1000 and cfg.get("steps_offset"):
                    continue  # its timesteps would run past 999
                seq = seq_cls(clip_sample=False, **cfg)
                par = par_cls(clip_sample=False, **cfg)
                table = step_table(seq, steps)
                par.set_timesteps(steps)
                x = torch.randn(steps, 4, 2, generator=g)
                out = torch.randn(steps, 4, 2, generator=g)
                idx = torch.arange(steps)
                want = table.apply(idx, x, out, torch.zeros_like(x))
                ts = table.timesteps[:, None].expand(steps, 4).reshape(-1)
                extra = {} if name == "DDPM" else {"eta": 0.0}
                got = par.batch_step_no_noise(out.reshape(-1, 2), ts, x.reshape(-1, 2), **extra)
                dev = (got.reshape(steps, 4, 2) - want).abs().amax(dim=(1, 2))
                rows.append({"scheduler": f"{name}ParallelScheduler", "config": label,
                             "steps": steps, "max_abs_err": float(dev.max()),
                             "steps that differ": int((dev > 1e-6).sum()),
                             "reproduces sequential": bool(float(dev.max()) <= 1e-6)})
    return rows


PARALLEL_COLUMNS = ["scheduler", "config", "steps", "max_abs_err", "steps that differ",
                    "reproduces sequential"]


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None) -> dict:
    from diffusers import DDIMScheduler, DDPMScheduler

    repeats = repeats or (1 if quick else 5)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"suite": "diffusion", "machine": machine_info(), "tol": TOL,
               "repeats": repeats, "quick": quick}
    sections = []
    moons, info = trained_denoiser(out_dir, "moons", **({"epochs": 2} if quick else {}))
    moons.requires_grad_(False)
    payload["moons_model"] = info
    chains = [("DDPM", 1000, None, None), ("DDIM", 100, 0.0, None), ("DDIM", 100, 1.0, None),
              ("DDIM", 50, 0.0, None), ("DDIM", 50, 1.0, None)]
    if quick:
        chains = [("DDPM", 100, None, None), ("DDIM", 20, 0.0, None)]
    batch = 16
    for kind, steps, eta, window in chains:
        scheduler = DDPMScheduler(clip_sample=False) if kind == "DDPM" else \
            DDIMScheduler(clip_sample=False)
        label = f"{kind} {steps} steps" + ("" if eta is None else f", eta {eta:g}")
        title = f"MLP denoiser on two moons, batch {batch}, {label}"
        rows, curves = chain_rows(moons, scheduler, (batch, 2), steps, eta=eta,
                                  repeats=repeats, window=window, desc=label)
        print(f"\n{title} (tol={TOL:g})")
        print(text_table(rows, COLUMNS))
        stem = f"diffusion_moons_{kind.lower()}{steps}" + ("" if eta is None else f"_eta{eta:g}")
        plot = curves_plot(out_dir / f"{stem}.png", title, curves, steps)
        sections.append((title, markdown_table(rows, COLUMNS) + f"\n\n![]({plot.name})"))
        payload[stem] = rows

    unet, uinfo = trained_denoiser(out_dir, "digits", **({"epochs": 1} if quick else {}))
    unet.requires_grad_(False)
    payload["digits_model"] = uinfo
    steps = 10 if quick else 50
    title = f"UNet2DModel on the digits (8x8), batch 16, DDIM {steps} steps, eta 0"
    rows, curves = chain_rows(unet, DDIMScheduler(clip_sample=False), (16, 1, 8, 8), steps,
                              eta=0.0, repeats=max(1, repeats // 2), window=None,
                              desc="unet digits")
    print(f"\n{title} (tol={TOL:g})")
    print(text_table(rows, COLUMNS))
    plot = curves_plot(out_dir / "diffusion_digits_ddim.png", title, curves, steps)
    sections.append((title, markdown_table(rows, COLUMNS) + f"\n\n![]({plot.name})"))
    payload["digits_ddim"] = rows

    prow = parallel_scheduler_rows((20,) if quick else (50, 100, 1000))
    print("\ndiffusers' batched steps vs the sequential step (same inputs, no noise)")
    print(text_table(prow, PARALLEL_COLUMNS))
    sections.append(("diffusers' parallel schedulers: batched step vs sequential step",
                     markdown_table(prow, PARALLEL_COLUMNS)))
    payload["parallel_schedulers"] = prow
    write_results(out_dir, "diffusion", payload, sections,
                  "paraprop bench diffusion" + (" --quick" if quick else ""))
    return payload
