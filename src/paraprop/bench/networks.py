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
   balanced blocks run by :class:`~paraprop.networks.ThreadedJacobiGS` (one worker per core) to the
   same stopping rule, interleaved.

Timings use one intra-op thread (the shared 2-core machine runs other jobs; oversubscribed OpenMP
regions make small kernels erratic); the forward pass with the default threads is timed too.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402

from paraprop.bench.harness import interleaved, machine_info, median  # noqa: E402
from paraprop.bench.plots import save_figure  # noqa: E402
from paraprop.bench.report import markdown_table, text_table, write_results  # noqa: E402
from paraprop.networks import (  # noqa: E402
    ThreadedJacobiGS,
    as_recurrence,
    balanced_blocks,
    partition_time,
    profile,
)
from paraprop.networks.evaluate import top5_changes, trace  # noqa: E402
from paraprop.networks.timing import uniform_blocks  # noqa: E402
from paraprop.training.networks import (  # noqa: E402
    image_data,
    input_channels,
    make_network,
    split,
    trained_network,
)

DESCRIPTION = ("DenseNet-121/201, ResNet-18, deep MLP by Jacobi-GS over layers: iterations to zero "
               "top-5 changes, estimated speedup, measured time")
TOL = 1e-3
COLUMNS = ["network", "weights", "blocks", "iterations", "top5@stop", "settled", "exact",
           "seq_ms_est", "par_ms_est", "est_speedup", "est_speedup_paper"]
MEASURE_COLUMNS = ["network", "weights", "fwd_ms", "fwd_default_threads_ms", "threaded_ms",
                   "threaded_iters", "threaded_top5", "measured_speedup"]


@contextlib.contextmanager
def threads(n: int):
    """Run with ``n`` intra-op threads, restoring the setting after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _dense_states(names: list[str]) -> list[int]:
    return [t for t, n in enumerate(names) if ".denselayer" in n]


def variant_row(rec, images: torch.Tensor, times: torch.Tensor, blocks: list[range], *,
                tol: float, exact_images: int) -> tuple[dict, dict]:
    """Convergence and the estimate of Jacobi-GS over ``blocks``; ``(row, curves)``."""
    system = rec.bind(images)
    sol = trace(system, method="jacobi_gs", tol=tol, blocks=blocks)
    st = sol.stats
    k = sol.iterations
    exact = trace(rec.bind(images[:exact_images]), method="jacobi_gs",
                  tol=0.0, blocks=blocks)
    seq = float(times.sum())
    par = partition_time(times, blocks, k)
    singles = all(len(b) == 1 for b in blocks)
    dense = _dense_states(rec.names)
    paper = None
    if dense and singles:  # the paper's accounting: dense layers only, sum / (k x slowest)
        td = times[dense]
        paper = float(td.sum()) / (k * float(td.max()))
    row = {
        "blocks": len(blocks) if not singles else f"{len(blocks)} (1 state each)",
        "n_blocks": len(blocks), "iterations": k, "top5@stop": st["output_error"],
        "settled": st["settled"], "exact": exact.stats["bitwise_equal"],
        "exact_iterations": exact.iterations, "images": images.shape[0],
        "seq_ms_est": 1e3 * seq, "par_ms_est": 1e3 * par, "est_speedup": seq / par,
        "est_speedup_settled": (seq / partition_time(times, blocks, st["settled"])
                                if st["settled"] else None),
        "est_speedup_paper": paper,
        "max_abs_error@stop": st["max_abs_error"],
        "sample_iterations_max": int(st["sample_iterations"].max()),
        "sample_iterations_median": float(st["sample_iterations"].float().median()),
    }
    n = images.shape[0]
    curves = {
        "errors": [e / n for e in st["errors"]], "changes": [c / n for c in st["changes"]],
        "residuals": sol.residuals.tolist(), "max_abs_errors": st["max_abs_errors"],
        "unit_ms": 1e3 * par / max(k, 1), "seq_ms": 1e3 * seq,
        "blocks": [[b.start, b.stop] for b in blocks],
    }
    return row, curves


def network_rows(model, images: torch.Tensor, *, name: str, weights: str, tol: float = TOL,
                 repeats: int = 5, exact_images: int = 4, profile_repeats: int = 15,
                 default_threads: int | None = None) -> tuple[list[dict], dict, dict]:
    """Every measurement of one network: ``(variant_rows, measured_row, extra)``.

    Two Jacobi-GS variants: one state per block (each dense layer with its two convolutions a
    block, as in the paper) and time-balanced blocks (:func:`~paraprop.networks.balanced_blocks`
    with the slowest state as the budget). Per-state times are medians at batch 1 (the paper's
    setting); the convergence is over all ``images``; the measured run uses the first image.

    Arguments:
        model: the network (eval mode).
        images: the evaluation images.
        name, weights: labels for the report.
        tol: forward-difference tolerance of the stopping rule.
        repeats: interleaved timing rounds; ``profile_repeats``: per-state timing rounds.
        exact_images: images solved to ``tol=0`` to check exactness at the end.
        default_threads: also time the forward pass with this many intra-op threads.
    """
    rec = as_recurrence(model)
    one = rec.bind(images[:1])
    times = profile(one, repeats=profile_repeats)
    variants = {"one state per block": uniform_blocks(one.T, 1)}
    balanced = balanced_blocks(times)
    if len(balanced) < one.T:  # otherwise the same partition
        variants["balanced"] = balanced
    rows, curves = [], {}
    for label, blocks in variants.items():
        row, c = variant_row(rec, images, times, blocks, tol=tol, exact_images=exact_images)
        rows.append({"network": name, "weights": weights, "variant": label, "states": one.T,
                     **row})
        curves[label] = c

    x1 = images[:1]
    bal = variants.get("balanced", variants["one state per block"])
    par = ThreadedJacobiGS(one, blocks=bal, workers=os.cpu_count() or 1, times=times.tolist())
    with torch.no_grad():
        par_out, par_k, _ = par.run(tol=tol)
        measured = interleaved({"forward": lambda: model(x1), "threaded": lambda: par.run(tol=tol)},
                               repeats=repeats, warmup=1, desc=name)
        if default_threads is not None and default_threads != torch.get_num_threads():
            with threads(default_threads):
                measured["forward (default threads)"] = interleaved(
                    {"f": lambda: model(x1)}, repeats=repeats, warmup=1, desc=name)["f"]
    par.close()
    fwd, thr = median(measured["forward"]), median(measured["threaded"])
    meas = {
        "network": name, "weights": weights, "fwd_ms": 1e3 * fwd, "threaded_ms": 1e3 * thr,
        "threaded_blocks": len(bal), "threaded_iters": par_k,
        "threaded_top5": top5_changes(one.output(par_out), one.reference[-1]),
        "measured_speedup": fwd / thr, "workers": par.workers,
        "fwd_default_threads_ms": (1e3 * median(measured["forward (default threads)"])
                                   if "forward (default threads)" in measured else None),
    }
    extra = {"times_ms": (1e3 * times).tolist(), "names": rec.names, "curves": curves,
             "slowest_state": rec.names[int(times.argmax())],
             "slowest_ms": 1e3 * float(times.max())}
    return rows, meas, extra


def fig1d(path: Path, title: str, curves: dict[str, dict], tol: float) -> Path:
    """Fig. 1d style, per variant: top-5 changes (against the sequential output, and against the
    previous iterate) and the forward difference against the estimated time (iterations x the
    slowest block), with the sequential time (the sum of all state times) marked."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["tab:red", "tab:green", "tab:purple"]
    seq = 0.0
    for (label, c), color in zip(curves.items(), colors, strict=False):
        ts = [c["unit_ms"] * k for k in range(1, len(c["errors"]) + 1)]
        seq = c["seq_ms"]
        axes[0].plot(ts, c["errors"], "-", color=color, lw=2, label=f"{label}: vs sequential")
        axes[0].plot(ts, c["changes"], ":", color=color, lw=1.5,
                     label=f"{label}: vs previous iterate")
        axes[1].semilogy(ts, [max(r, 1e-12) for r in c["residuals"]], ":", color=color,
                         label=f"{label}: forward difference (all states)")
        axes[1].semilogy(ts, [max(e, 1e-12) for e in c["max_abs_errors"]], "-", color=color,
                         label=f"{label}: max |output - sequential|")
    axes[0].set_ylabel("top-5 label changes per image")
    axes[1].axhline(tol, color="grey", lw=0.8, ls="--", label=f"tol={tol:g}")
    axes[1].set_ylabel("max |.| (floor 1e-12)")
    for a in axes:
        a.axvline(seq, color="k", ls="--", lw=1.5, label="sequential (sum of state times)")
        a.set_xlabel("estimated time (ms)")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path, dpi=110)


def small_densenet(seed: int = 0, *, growth_rate: int = 8, block_config=(2, 3, 4, 3),
                   num_init_features: int = 8, bn_size: int = 2) -> torch.nn.Module:
    """torchvision's DenseNet class at a small configuration (by default 17 states), random
    weights (seeded), eval mode."""
    torch.manual_seed(seed)
    return torchvision.models.DenseNet(growth_rate=growth_rate, block_config=tuple(block_config),
                                       num_init_features=num_init_features, bn_size=bn_size,
                                       num_classes=10).eval()


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


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None) -> dict:
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
