"""Demo part: a trained MADE sampled by ancestral sampling and by Jacobi, the same sample.

Default: the MADE (hidden 128 x 128) trained on MNIST that ships with the lab (784 pixels, so
784 ancestral steps; :mod:`paraprop_lab.demos._weights`); ``--full``: a MADE 512 x 512 trained
here on the digits (30 epochs); ``--quick``: 64 x 64 on the digits, 3 epochs.
"""

from __future__ import annotations

from pathlib import Path

from paraprop_lab.demos._common import part_model, part_result
from paraprop_lab.experiments.explain import fewer_passes, pass_cost
from paraprop_lab.experiments.made import COLUMNS, TOL, image_grid, sampling_rows
from paraprop_lab.experiments.plots import convergence_plot
from paraprop_lab.training.made import trained_made

ORDER = 10
TITLE = "Autoregressive sampling: a trained MADE, the same sample in far fewer passes"
SECONDS = {"quick": 3, "default": 14, "full": 200}


def run(out_dir: Path, *, quick: bool = False, full: bool = False) -> dict:
    hidden, epochs = ((64, 64), 3) if quick else ((512, 512), 30)
    model, info, full = part_model(
        "made", out_dir, quick=quick, full=full,
        train=lambda: trained_made(out_dir, "digits", hidden=hidden, epochs=epochs))
    if quick or full:
        data, what = "digits", f"{epochs} epochs"
    else:
        data, what = "MNIST", "20 epochs, the shipped checkpoint"
        hidden = tuple(model.config["hidden"])
    rows, extra = sampling_rows(model, 100, repeats=1 if quick else 3 if full else 2,
                                hybrids=quick or full, desc="demo made")
    side = int(round(model.features ** 0.5))
    title = (f"MADE (hidden layers {' and '.join(map(str, hidden))}) on {data} "
             f"(D={model.features}), {what}, 100 samples")
    conv = convergence_plot(out_dir / "demo_made_convergence.png", title, extra["curves"], tol=TOL)
    grid = image_grid(out_dir / "demo_made_samples.png", extra["ref"], extra["iterates"], side,
                      f"MADE on {data}: Jacobi iterates become the ancestral samples")
    return part_result(title, rows, COLUMNS, explain(rows), [conv, grid],
                       heading=f"{title}; tol={TOL:g}; speedup over ancestral sampling, same "
                       "noise", model=info)


def explain(rows: list[dict]) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows. The oracle stop
    (which needs the answer in advance) is shown but never the winner."""
    base = rows[0]
    D = base["evaluations"]
    real = [r for r in rows if "oracle" not in r["method"]]
    winner = max(real, key=lambda r: r["speedup"])
    m = winner if winner is not base else max(real[1:], key=lambda r: r["speedup"])
    evals = m["evaluations"] / max(m["iterations"], 1)
    why = fewer_passes(
        m["method"], "ancestral sampling", speedup=m["speedup"], passes=m["iterations"],
        steps=D, cost=pass_cost(m["time_ms"], m["iterations"], base["time_ms"], D),
        step_word="ancestral step",
        detail=(f" (one network evaluation for all {D} pixels)" if evals == 1
                else f" ({evals:.3g} network evaluations)"),
        winner="ancestral sampling" if winner is base else winner["method"],
        winner_speedup=winner["speedup"])
    jac = next(r for r in rows if r["method"] == "jacobi (online stop)")
    headline = (f"Jacobi {jac['iterations']} passes vs {D} ancestral steps, "
                f"{jac['speedup']:.2f}x ancestral sampling")
    return why, headline
