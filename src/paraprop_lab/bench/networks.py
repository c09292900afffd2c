"""``paraprop bench networks``: network inference by Jacobi-GS over the layers (Song et al. 2021,
§5.2, Fig. 1d).

For DenseNet-201 and DenseNet-121 (torchvision architectures), a ResNet-18 and a deep MLP, trained
briefly here on the MNIST test set resized to 32x32 (pretrained ImageNet weights cannot be
downloaded; DenseNet-201 is also run with random weights):

1. Convergence on 64 held-out images for two Jacobi-GS partitions: one state per block (each
   dense layer with its two convolutions is a block, as in the paper) and time-balanced blocks.
   The solver stops on the forward difference of the whole state (``TOL``); reported: iterations
   (the most any image took), top-5 label changes at the stop, the iteration from which they stay
   zero, and exactness at the end (``tol=0``: bitwise the sequential output).
2. The paper's parallel-time estimate from per-state medians at batch 1 (the paper's setting):
   sequential = sum of all state times, Jacobi-GS = iterations x slowest block. Every state counts
   (stem, transitions, head); the paper's own accounting, which sums and maxes over the dense
   layers only, is reported beside it.
3. Measured wall time at batch 1 on this machine: the plain forward pass vs Jacobi-GS over the
   balanced blocks run on threads (``jacobi_gs_blocks(..., workers=cores)``, one worker per core)
   to the same stopping rule, interleaved.

Timings use one intra-op thread (the shared 2-core machine runs other jobs; oversubscribed OpenMP
regions make small kernels erratic); the forward pass with the default threads is timed too.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402

from paraprop.models import small_densenet
from paraprop_lab.experiments.harness import (
    machine_info,  # noqa: E402
    threads,
)
from paraprop_lab.experiments.networks import COLUMNS, MEASURE_COLUMNS, TOL, fig1d, network_rows
from paraprop_lab.experiments.report import markdown_table, text_table, write_results  # noqa: E402
from paraprop_lab.experiments.rows_report import cpu_only
from paraprop_lab.training.networks import (  # noqa: E402
    image_data,
    input_channels,
    make_network,
    split,
    trained_network,
)

DESCRIPTION = ("DenseNet-121/201, ResNet-18, deep MLP by Jacobi-GS over layers: iterations to zero "
               "top-5 changes, estimated speedup, measured time")

# no device rows: ``run(device=...)`` refuses any device but the CPU, saying why
CPU_ONLY = ("its parallel measurement runs Jacobi-GS blocks on CPU threads (workers=cores) "
            "and times states at batch 1 on the host")


def configs(quick: bool) -> list[dict]:
    """The networks: ``name``, ``arch``, ``steps`` (0: random weights), ``data``."""
    if quick:
        return [
            {"name": "small DenseNet", "arch": "small_densenet", "steps": 0, "data": "digits"},
            {"name": "MLP 6x32", "arch": "mlp_small", "steps": 0, "data": "digits"},
        ]
    return [
        {"name": "DenseNet-201", "arch": "densenet201", "steps": 80, "data": "mnist"},
        {"name": "DenseNet-201", "arch": "densenet201", "steps": 0, "data": "mnist"},
        {"name": "DenseNet-121", "arch": "densenet121", "steps": 80, "data": "mnist"},
        {"name": "ResNet-18", "arch": "resnet18", "steps": 60, "data": "mnist"},
        {"name": "MLP 24x256", "arch": "mlp", "steps": 300, "data": "mnist"},
    ]


def build(cfg: dict, out_dir: Path) -> tuple[torch.nn.Module, str, torch.Tensor]:
    """The model, the sentence saying which weights it has, and the held-out images."""
    arch, data = cfg["arch"], cfg["data"]
    weights = "random initialisation (seed 0)"
    if arch == "small_densenet":
        model = small_densenet()
    elif arch == "mlp_small":
        model = make_network("mlp", size=32, depth=6, width=32)
    elif cfg["steps"] > 0:
        model, info = trained_network(arch, data=data, steps=cfg["steps"], cache_dir=out_dir)
        weights = info["weights"] + ("" if info["trained_now"] else " (checkpoint reused)")
    else:
        model = make_network(arch)
    channels = 1 if arch in ("mlp", "mlp_small") else input_channels(arch)
    x, y = image_data(data, size=32, channels=channels)
    _, _, xh, _ = split(data, x, y)
    return model, weights, xh


NOTES = (
    "`blocks`: the Jacobi-GS partition, one state per block (each dense layer with its two "
    "convolutions is a block, the paper's setting) or time-balanced blocks (consecutive states "
    "grouped while a block takes no longer than the slowest state). `iterations`: until the "
    "forward difference of every state is <= {tol:g} (the most any image took); `top5@stop`: "
    "top-5 label changes against the sequential output there, summed over the images; "
    "`settled`: the iteration from which they stay 0; `exact`: bitwise equal to the sequential "
    "output at the end (tol=0). `seq_ms_est` / `par_ms_est`: the paper's estimate from per-state "
    "medians at batch 1 (sum of all states / iterations x slowest block); `est_speedup` their "
    "ratio. `est_speedup_paper`: the paper's own accounting, which sums and maxes over the dense "
    "layers only (stem, transitions and head left out; the paper's code computes its 2.1x so), "
    "with the same iterations.")


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None,
        device: str | None = None) -> dict:
    cpu_only("networks", device, CPU_ONLY)
    repeats = repeats or (1 if quick else 4)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    default_threads = torch.get_num_threads()
    n_images = 8 if quick else 64
    rows, measured, sections, extras = [], [], [], {}
    with threads(1):
        machine = machine_info()
        for cfg in configs(quick):
            model, weights, xh = build(cfg, out_dir)
            short = "trained" if cfg["steps"] else "random"
            print(f"\n{cfg['name']}: {weights}")
            vrows, meas, extra = network_rows(
                model, xh[:n_images], name=cfg["name"], weights=short, repeats=repeats,
                exact_images=2 if quick else 4, profile_repeats=3 if quick else 15,
                default_threads=None if quick else default_threads)
            for r in vrows:
                r["weights_detail"] = weights
            rows += vrows
            measured.append(meas)
            tag = f"{cfg['arch']}_{short}"
            extras[tag] = extra
            png = fig1d(out_dir / f"networks_{tag}_fig1d.png",
                        f"{cfg['name']} ({weights}); Jacobi-GS, {n_images} images, tol={TOL:g}",
                        extra["curves"], TOL)
            sections.append((f"{cfg['name']}, {short} weights",
                             f"Weights: {weights}.\n\nStates: {vrows[0]['states']}; slowest "
                             f"state {extra['slowest_state']} ({extra['slowest_ms']:.3f} ms at "
                             f"batch 1).\n\n![]({png.name})"))
    print(f"\nJacobi-GS over the layers, tol={TOL:g}, {n_images} images; estimates from per-state "
          "times at batch 1, 1 intra-op thread")
    print(text_table(rows, COLUMNS))
    print("\nMeasured at batch 1: forward pass vs Jacobi-GS (balanced blocks) on threads")
    print(text_table(measured, MEASURE_COLUMNS))
    sections.insert(0, ("Convergence and the estimated speedup",
                        markdown_table(rows, COLUMNS) + "\n\n" + NOTES.format(tol=TOL)))
    sections.insert(1, ("Measured wall times at batch 1 (this machine)",
                        markdown_table(measured, MEASURE_COLUMNS) + "\n\n"
                        "`threaded_ms`: Jacobi-GS over the balanced blocks with one worker thread "
                        "per core (1 intra-op thread each) to the same stopping rule "
                        "(`threaded_iters` iterations, `threaded_top5` changes at the stop); "
                        "`fwd_ms`: the plain forward pass with 1 intra-op thread; "
                        "`fwd_default_threads_ms`: with the default intra-op threads "
                        f"({default_threads}); `measured_speedup`: fwd_ms / threaded_ms."))
    payload = {"suite": "networks", "machine": machine, "tol": TOL, "repeats": repeats,
               "quick": quick, "images": n_images, "load_average": os.getloadavg(),
               "default_threads": default_threads, "rows": rows, "measured": measured,
               "extra": extras}
    write_results(out_dir, "networks", payload, sections,
                  "paraprop bench networks" + (" --quick" if quick else ""))
    return payload

