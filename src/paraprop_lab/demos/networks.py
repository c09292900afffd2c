"""Demo part: a DenseNet evaluated by Jacobi-GS over its layers (Song et al. 2021, §5.2).

A DenseNet of torchvision's class at a small configuration (growth rate 12, dense blocks of 3, 6,
12 and 8 layers: 34 states) is trained briefly on the digits resized to 32x32, so that the part
stays within half a minute (about 13 s of CPU time); ``paraprop bench networks`` runs
DenseNet-121 and DenseNet-201 themselves.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paraprop.models import small_densenet
from paraprop_lab.experiments.explain import fewer_passes, pass_cost, plural
from paraprop_lab.experiments.harness import threads
from paraprop_lab.experiments.networks import COLUMNS, MEASURE_COLUMNS, TOL, fig1d, network_rows
from paraprop_lab.experiments.report import markdown_table, text_table
from paraprop_lab.training.networks import accuracy, image_data, split, train_network

ORDER = 70
REQUIRES = ("torchvision",)  # the DenseNet class
TITLE = "Network inference as a recurrence over layers: a DenseNet by Jacobi-GS"
SECONDS = {"quick": 3, "default": 7, "full": 7}
STEPS = 60


def run(out_dir: Path, *, quick: bool = False) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    x, y = image_data("digits", size=32, channels=3)
    xt, yt, xh, yh = split("digits", x, y)
    default_threads = torch.get_num_threads()
    with threads(1):
        if quick:
            model, name = small_densenet(), "small DenseNet (growth 8, blocks 2-3-4-3)"
            weights = "random initialisation (seed 0)"
        else:
            model = small_densenet(growth_rate=12, block_config=(3, 6, 12, 8),
                                   num_init_features=24, bn_size=4)
            name = "small DenseNet (growth 12, blocks 3-6-12-8)"
            train_network(model, xt, yt, steps=STEPS, batch_size=64, desc="train densenet")
            weights = (f"trained here: {STEPS} Adam steps of 64 on {len(xt)} digits (32x32), "
                       f"held-out accuracy {accuracy(model, xh, yh):.3f}")
        rows, meas, extra = network_rows(model, xh[: 4 if quick else 32], name=name,
                                         weights="random" if quick else "trained",
                                         repeats=1 if quick else 3,
                                         exact_images=2 if quick else 4,
                                         profile_repeats=3 if quick else 10,
                                         default_threads=default_threads)
    png = fig1d(out_dir / "demo_networks_fig1d.png",
                f"{name} on the digits, {weights}: Jacobi-GS over the layers", extra["curves"],
                TOL)
    print(f"{name}: {weights}; tol={TOL:g}, {rows[0]['images']} held-out digits, times at "
          "batch 1")
    print(text_table(rows, COLUMNS))
    print(NOTE)
    print(text_table([meas], MEASURE_COLUMNS))
    best = max(r["est_speedup"] for r in rows)
    print(f"Estimated (a worker per block, no overhead): up to {best:.2f}x; measured with "
          f"threads on this machine: {meas['measured_speedup']:.2f}x")
    why, headline = explain(rows, meas)
    print(why)
    md = (f"Weights: {weights}.\n\n" + markdown_table(rows, COLUMNS) + "\n\n" + NOTE + "\n\n"
          + markdown_table([meas], MEASURE_COLUMNS)
          + "\n\nEstimated speedup = sum of the per-state times / (iterations x slowest block), "
          "the paper's simulation; the measured one runs the blocks on real threads.\n\n"
          f"{why}\n\n![]({png.name})")
    return {"rows": rows + [meas], "sections": [(f"{name} by Jacobi-GS over its layers", md)],
            "why": why, "headline": headline, "plots": [png]}


NOTE = ("est_speedup_paper is the paper's accounting (dense layers only, one per block); it is "
        "'-' for the balanced blocks, which group several states.")


def explain(rows: list[dict], meas: dict) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows: the threaded
    Jacobi-GS run's iterations against the forward pass's layer steps, what one iteration cost
    here, and the estimate with a worker per block."""
    states = rows[0]["states"]
    best = max(rows, key=lambda r: r["est_speedup"])
    why = fewer_passes(
        "Jacobi-GS on threads", "the plain forward pass", speedup=meas["measured_speedup"],
        passes=meas["threaded_iters"], steps=states,
        cost=pass_cost(meas["threaded_ms"], meas["threaded_iters"], meas["fwd_ms"], states),
        pass_word="iteration", step_word="layer step",
        detail=f" ({meas['threaded_blocks']} blocks on {meas['workers']} threads)")
    why = why[:-1] + (f"; with a worker per block and no overhead it would run at "
                      f"{best['est_speedup']:.2f}x ({best['iterations']} "
                      f"{plural('iteration', best['iterations'])} of the slowest block): a "
                      "machine with a core per block.")
    headline = (f"Jacobi-GS {meas['threaded_iters']} "
                f"{plural('iteration', meas['threaded_iters'])} over {states} layers; estimated "
                f"{best['est_speedup']:.2f}x, measured {meas['measured_speedup']:.2f}x")
    return why, headline
