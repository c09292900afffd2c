"""Demo part: a DenseNet evaluated by Jacobi-GS over its layers (Song et al. 2021, §5.2)."""

from __future__ import annotations

from pathlib import Path

from paraprop.bench.networks import (
    COLUMNS,
    MEASURE_COLUMNS,
    TOL,
    fig1d,
    network_rows,
    small_densenet,
    threads,
)
from paraprop.bench.report import markdown_table, text_table
from paraprop.training.networks import image_data, split, trained_network

ORDER = 70
TITLE = "Network inference as a recurrence over layers: a DenseNet by Jacobi-GS"


def run(out_dir: Path, *, quick: bool = False) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with threads(1):
        if quick:
            model, name = small_densenet(), "small DenseNet"
            weights = "random initialisation (seed 0)"
        else:
            model, info = trained_network("densenet121", data="digits", steps=20,
                                          cache_dir=out_dir)
            weights, name = info["weights"], "DenseNet-121"
        x, y = image_data("digits", size=32, channels=3)
        _, _, xh, _ = split("digits", x, y)
        rows, meas, extra = network_rows(model, xh[: 4 if quick else 32], name=name,
                                         weights="random" if quick else "trained",
                                         repeats=1 if quick else 3,
                                         exact_images=2 if quick else 4,
                                         profile_repeats=3 if quick else 10)
    png = fig1d(out_dir / "demo_networks_fig1d.png", f"{name} on digits ({weights}); Jacobi-GS",
                extra["curves"], TOL)
    print(f"{name}: {weights}; tol={TOL:g}, {rows[0]['images']} held-out digits, times at "
          "batch 1")
    print(text_table(rows, COLUMNS))
    print(text_table([meas], MEASURE_COLUMNS))
    best = max(r["est_speedup"] for r in rows)
    print(f"Estimated (a worker per block, no overhead): up to {best:.2f}x; measured with "
          f"threads on this machine: {meas['measured_speedup']:.2f}x")
    md = (f"Weights: {weights}.\n\n" + markdown_table(rows, COLUMNS) + "\n\n"
          + markdown_table([meas], MEASURE_COLUMNS)
          + "\n\nEstimated speedup = sum of the per-state times / (iterations x slowest block), "
          "the paper's simulation; the measured one runs the blocks on real threads.\n\n"
          f"![]({png.name})")
    return {"rows": rows + [meas], "sections": [(f"{name} by Jacobi-GS over its layers", md)]}
