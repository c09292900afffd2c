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

from paraprop_lab.experiments import rows_sampling as _rows
from paraprop_lab.experiments.harness import machine_info  # noqa: E402
from paraprop_lab.experiments.plots import save_figure  # noqa: E402
from paraprop_lab.experiments.report import markdown_table, text_table, write_results  # noqa: E402
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows
from paraprop_lab.experiments.tarflow import COLUMNS, TOL, method_rows  # noqa: E402
from paraprop_lab.training.tarflow import trained_tarflow  # noqa: E402

DESCRIPTION = "TarFlow sampling: KV-cached sequential loop vs Jacobi, GS-Jacobi, auto plan"

# the headline rows on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("tarflow.sampling", _rows.tarflow_rows, 20)]


BATCH = 16


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


@with_device_rows("tarflow", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
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

