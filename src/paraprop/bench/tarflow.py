"""``paraprop bench tarflow``: exact parallel sampling of a TarFlow (transformer autoregressive
flow, Zhai et al. 2024) trained here (``paraprop train tarflow``) on the digits and on MNIST.

Every method inverts the same latents (batch 16). The baseline is the usual sampler: one
transformer call per patch with keys and values cached (``sequential_cached``). Reported per
method: transformer calls, the iterations of each block's inversion (block order), wall time
and ratio against the baseline, and the largest deviation of the images from the exact
sequential solve (``method="sequential"``, full passes; images in ``[-1, 1]``).
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
from paraprop.solvers import GSJacobi, SlidingJacobi  # noqa: E402
from paraprop.training.tarflow import trained_tarflow  # noqa: E402

DESCRIPTION = "TarFlow sampling: KV-cached sequential loop vs Jacobi, GS-Jacobi, auto plan"
TOL = 1e-5
BATCH = 16
COLUMNS = ["method", "tol", "model_calls", "iterations_per_block", "time_ms", "speedup",
           "max_abs_err", "converged"]


def method_rows(flow, *, repeats: int, desc: str) -> tuple[list[dict], dict]:
    """Every method on the same latents; rows, and each block's Jacobi residuals."""
    ref_w = flow.blocks[0].out.weight
    z = torch.randn(BATCH, flow.channels, flow.image_size, flow.image_size,
                    generator=torch.Generator().manual_seed(0), dtype=ref_w.dtype)
    T = flow.T
    window = max(8, T // 4)
    specs = {
        "sequential, KV cache": ("sequential_cached", 0.0),
        "jacobi": ("jacobi", TOL),
        "jacobi, tol 0": ("jacobi", 0.0),
        f"sliding jacobi (window {window})": (SlidingJacobi(window), TOL),
        f"gs-jacobi (blocks of {window})": (GSJacobi(window), TOL),
        "auto (calibrated per block)": ("auto", TOL),
    }
    with torch.no_grad():
        exact, _ = flow.inverse(z, method="sequential", tol=0.0)
        flow.inverse(z, method="auto", tol=TOL)            # calibrate once, outside the timing

        def runner(method, tol):
            return lambda: flow.inverse(z, method=method, tol=tol)

        times = interleaved({k: runner(*v) for k, v in specs.items()}, repeats=repeats,
                            warmup=1, desc=desc)
        base = median(times["sequential, KV cache"])
        rows, curves = [], {}
        for label, (method, tol) in specs.items():
            x, sol = flow.inverse(z, method=method, tol=tol)
            t = median(times[label])
            rows.append({"method": label, "tol": tol, "model_calls": sol.stats["model_calls"],
                         "iterations_per_block": " ".join(str(b.iterations)
                                                          for b in sol.stats["blocks"]),
                         "time_ms": 1e3 * t, "speedup": base / t,
                         "max_abs_err": float((x - exact).abs().max()),
                         "converged": sol.converged,
                         "plan": " ".join(sol.stats["methods"])})
            if label == "jacobi, tol 0":
                curves = {k: b.residuals.tolist() for k, b in enumerate(sol.stats["blocks"])}
    return rows, curves


def residual_plot(path: Path, title: str, curves: dict) -> Path:
    """The change per Jacobi sweep of each block's inversion (tol 0, run to the fixed point)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for k, r in curves.items():
        ax.semilogy(range(1, len(r) + 1), [max(v, 1e-17) for v in r], marker=".",
                    label=f"block {k}" + (" (inverted first)" if k == len(curves) - 1 else ""))
    ax.axhline(TOL, color="grey", ls="--", lw=0.8, label=f"tol {TOL:g}")
    ax.set_xlabel("Jacobi sweep (one transformer pass over all patches)")
    ax.set_ylabel("largest change of a patch value\n(0 shown at 1e-17)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None) -> dict:
    repeats = repeats or (1 if quick else 5)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"suite": "tarflow", "machine": machine_info(), "tol": TOL, "batch": BATCH,
               "repeats": repeats, "quick": quick}
    sections = []
    for data in (("digits",) if quick else ("digits", "mnist")):
        kw = {"epochs": 1, "n": 64} if quick else {}
        flow, info = trained_tarflow(data, out_dir=out_dir / "models", **kw)
        flow.requires_grad_(False)
        payload[f"{data}_model"] = {k: v for k, v in info.items() if k != "loss"}
        rows, curves = method_rows(flow, repeats=repeats, desc=f"tarflow {data}")
        cfg = flow.config
        title = (f"TarFlow on {data} ({cfg['image_size']}x{cfg['image_size']}, {flow.T} patches "
                 f"of {flow.P}, {cfg['blocks']} blocks x {cfg['layers']} layers, width "
                 f"{cfg['width']}), batch {BATCH}")
        print(f"\n{title}")
        print(text_table(rows, COLUMNS))
        png = residual_plot(out_dir / f"tarflow_{data}.png", title, curves)
        sections.append((title, markdown_table(rows, COLUMNS) + f"\n\n![]({png.name})"))
        payload[data] = rows
    write_results(out_dir, "tarflow", payload, sections,
                  "paraprop bench tarflow" + (" --quick" if quick else ""))
    return payload
