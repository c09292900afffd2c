"""``paraprop bench tarflow``: exact parallel sampling of a TarFlow (transformer autoregressive
flow, Zhai et al. 2024) trained here (``paraprop train tarflow``) on the digits and on MNIST.

Every method inverts the same latents (batch 16). The baseline is the usual sampler: one
transformer call per patch with keys and values cached (``sequential_cached``). Batches of 1
and 16. Reported per method: transformer calls, the iterations of each block's inversion (block
order), wall time and ratio against the baseline, and the largest deviation of the images from
the exact sequential solve with the same chunking (``method="sequential"``, full passes; images
in ``[-1, 1]``). "one chunk": every pass computes all patches in one product (``chunk=T``), the
fastest setting for full Jacobi passes.
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
           "max_abs_err", "converged", "plan"]


def method_rows(flow, batch: int, *, repeats: int, desc: str) -> tuple[list[dict], dict]:
    """Every method on the same latents; rows, and each block's Jacobi residuals."""
    ref_w = flow.blocks[0].out.weight
    z = torch.randn(batch, flow.channels, flow.image_size, flow.image_size,
                    generator=torch.Generator().manual_seed(0), dtype=ref_w.dtype)
    T = flow.T
    window = max(8, T // 4)
    specs = {   # label: (method, tol, chunk); chunk None is the default, T one chunk a pass
        "sequential, KV cache": ("sequential_cached", 0.0, None),
        "jacobi": ("jacobi", TOL, None),
        "jacobi, one chunk": ("jacobi", TOL, T),
        "jacobi, one chunk, tol 1e-4": ("jacobi", 1e-4, T),
        "jacobi, tol 0": ("jacobi", 0.0, None),
        f"sliding jacobi (window {window})": (SlidingJacobi(window), TOL, None),
        f"gs-jacobi (blocks of {window})": (GSJacobi(window), TOL, None),
        "auto (calibrated per block)": ("auto", TOL, None),
        "auto, one chunk": ("auto", TOL, T),
    }
    with torch.no_grad():
        exact = {c: flow.inverse(z, method="sequential", tol=0.0, chunk=c)[0]
                 for c in {c for _, _, c in specs.values()}}
        for chunk in (None, T):                        # calibrate once, outside the timing
            flow.inverse(z, method="auto", tol=TOL, chunk=chunk)

        def runner(method, tol, chunk):
            return lambda: flow.inverse(z, method=method, tol=tol, chunk=chunk)

        times = interleaved({k: runner(*v) for k, v in specs.items()}, repeats=repeats,
                            warmup=1, desc=desc)
        base = median(times["sequential, KV cache"])
        rows, curves = [], {}
        for label, (method, tol, chunk) in specs.items():
            x, sol = flow.inverse(z, method=method, tol=tol, chunk=chunk)
            t = median(times[label])
            rows.append({"method": label, "tol": tol, "model_calls": sol.stats["model_calls"],
                         "iterations_per_block": " ".join(str(b.iterations)
                                                          for b in sol.stats["blocks"]),
                         "time_ms": 1e3 * t, "speedup": base / t,
                         "max_abs_err": float((x - exact[chunk]).abs().max()),
                         "converged": sol.converged,
                         "plan": _plan_text(sol.stats["methods"])})
            if label == "jacobi, tol 0":
                curves = {k: b.residuals.tolist() for k, b in enumerate(sol.stats["blocks"])}
    return rows, curves


def _plan_text(methods: list[str]) -> str:
    """A per-block plan in a few words, e.g. ``7 x jacobi, sequential_cached``."""
    out, run = [], 1
    for i, m in enumerate(methods):
        if i + 1 < len(methods) and methods[i + 1] == m:
            run += 1
            continue
        out.append(f"{run} x {m}" if run > 1 else m)
        run = 1
    return ", ".join(out)


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
        cfg = flow.config
        for batch in ((1,) if quick else (1, BATCH)):
            rows, curves = method_rows(flow, batch, repeats=repeats,
                                       desc=f"tarflow {data} batch {batch}")
            title = (f"TarFlow on {data} ({cfg['image_size']}x{cfg['image_size']}, {flow.T} "
                     f"patches of {flow.P}, {cfg['blocks']} blocks x {cfg['layers']} layers, "
                     f"width {cfg['width']}), batch {batch}")
            print(f"\n{title}")
            print(text_table(rows, COLUMNS))
            png = residual_plot(out_dir / f"tarflow_{data}_b{batch}.png", title, curves)
            sections.append((title, markdown_table(rows, COLUMNS) + f"\n\n![]({png.name})"))
            payload[f"{data}_b{batch}"] = rows
    write_results(out_dir, "tarflow", payload, sections,
                  "paraprop bench tarflow" + (" --quick" if quick else ""))
    return payload
