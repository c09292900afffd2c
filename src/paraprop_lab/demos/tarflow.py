"""Demo part: a TarFlow on the digits, sampled by the KV-cached loop and by Jacobi-type
solvers, with the deviation from the exact sequential solve."""

from __future__ import annotations

from pathlib import Path

import torch

from paraprop_lab.demos._common import frozen, part_model, part_result
from paraprop_lab.experiments.explain import fewer_passes, pass_cost
from paraprop_lab.experiments.plots import plt, save_figure
from paraprop_lab.experiments.tarflow import COLUMNS, method_rows

ORDER = 45
TITLE = "TarFlow: inverting transformer flow blocks as triangular systems"
SECONDS = {"quick": 3, "default": 4, "full": 240}


def run(out_dir: Path, *, quick: bool = False, full: bool = False) -> dict:
    from paraprop_lab.training.tarflow import tarflow_data, trained_tarflow

    flow, info, full = part_model(
        "tarflow", out_dir, quick=quick, full=full,
        train=lambda: frozen(trained_tarflow("digits", out_dir=out_dir / "models",
                                             **({"epochs": 1, "n": 64} if quick else {}),
                                             progress=not quick)))
    if quick or full:
        samples = Path(info["checkpoint"]).with_suffix(".png")  # the training job's figure
    else:
        samples = samples_figure(out_dir / "demo_tarflow_samples.png", flow,
                                 tarflow_data("digits"))
    rows, _ = method_rows(flow, 1, repeats=1 if quick else 3, desc="demo tarflow")
    title = f"TarFlow on the digits ({flow.T} patches, {len(flow.blocks)} blocks), batch 1"
    return part_result(
        title, rows, COLUMNS, explain(rows, flow.T), [samples] if samples.is_file() else [],
        heading=f"{title}; speedup against the KV-cached loop, max_abs_err against the exact "
        "solve", model={k: v for k, v in info.items() if k != "loss"})


def samples_figure(path: Path, flow, x: torch.Tensor, n: int = 16) -> Path:
    """``n`` training images beside ``n`` samples of the flow at temperatures 1 and 0.7
    (Jacobi with ``tol=0``: the exact inverse; the same noise at both temperatures)."""
    from paraprop_lab.training._common import image_panel

    panels = [(x[:n], "training images")]
    for t in (1.0, 0.7):
        images, _ = flow.sample(n, method="jacobi", tol=0, temperature=t,
                                generator=torch.Generator().manual_seed(0))
        panels.append((images, f"samples, temperature {t:g}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.6))
    for ax, (imgs, title) in zip(axes, panels, strict=True):
        image_panel(ax, imgs[:, :1].detach(), title)
    fig.suptitle(f"TarFlow on the digits: {len(flow.blocks)} blocks, {flow.T} patches of "
                 f"{flow.P} values; samples by the exact inverse", fontsize=11, y=1.03)
    return save_figure(fig, path, dpi=100)


def explain(rows: list[dict], T: int | None = None) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows: a solver's
    transformer passes over all patches against the KV-cached loop's one-patch calls; where the
    cached loop's plan wins, also where the parallel solvers win instead (``T`` patches)."""
    base = rows[0]
    fewer = [r for r in rows if r["model_calls"] < base["model_calls"] and r["converged"]] \
        or rows[1:]
    winner = max(rows, key=lambda r: r["speedup"])
    m = winner if winner in fewer else max(fewer, key=lambda r: r["speedup"])
    why = fewer_passes(
        m["method"], "the KV-cached loop", speedup=m["speedup"], passes=m["model_calls"],
        steps=base["model_calls"],
        cost=pass_cost(m["time_ms"], m["model_calls"], base["time_ms"], base["model_calls"]),
        step_word="cached call", detail=" (a transformer pass over a block's patches)",
        winner="the KV-cached loop" if winner is base else winner["method"],
        winner_speedup=winner["speedup"])
    if T is not None and (winner is base or winner["plan"] == base["plan"]):
        why += (f" Jacobi-type solvers win where a pass over all {T} patches of a block costs "
                "about one cached call: on a GPU, or at batch 1 on longer images (MNIST's 49 "
                "patches in `paraprop bench tarflow`).")
    headline = (f"{m['method']}: {m['model_calls']} passes vs {base['model_calls']} cached "
                f"calls, {m['speedup']:.2f}x the KV-cached loop")
    return why, headline
