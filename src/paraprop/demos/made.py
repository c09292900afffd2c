"""Demo part: a MADE trained on the digits, sampled by ancestral sampling and by Jacobi."""

from __future__ import annotations

from pathlib import Path

from paraprop.experiments.made import COLUMNS, TOL, image_grid, sampling_rows
from paraprop.experiments.plots import convergence_plot
from paraprop.experiments.report import markdown_table, text_table
from paraprop.training.made import trained_made

ORDER = 20
TITLE = "Autoregressive sampling: a MADE on the digits, the same sample in far fewer passes"


def run(out_dir: Path, *, quick: bool = False) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    hidden, epochs = ((64, 64), 3) if quick else ((512, 512), 30)
    model, info = trained_made(out_dir, "digits", hidden=hidden, epochs=epochs)
    rows, extra = sampling_rows(model, 100, repeats=1 if quick else 3, desc="demo made")
    title = f"MADE {'x'.join(map(str, hidden))} on digits (D=64), {epochs} epochs, 100 samples"
    print(f"{title}; tol={TOL:g}; speedup over ancestral sampling, same noise")
    print(text_table(rows, COLUMNS))
    conv = convergence_plot(out_dir / "demo_made_convergence.png", title, extra["curves"], tol=TOL)
    grid = image_grid(out_dir / "demo_made_samples.png", extra["ref"], extra["iterates"], 8,
                      f"{title}: Jacobi iterates vs ancestral samples")
    md = markdown_table(rows, COLUMNS) + f"\n\n![]({conv.name})\n\n![]({grid.name})"
    return {"rows": rows, "sections": [(title, md)], "model": info}
