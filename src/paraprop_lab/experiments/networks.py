"""Network inference by Jacobi-GS over the layers (Song et al. 2021, §5.2): iterations, accuracy at
the stop and estimated/measured speedups per variant; shared by ``paraprop bench networks`` and the
networks demo part.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from paraprop.networks import (  # noqa: E402
    as_recurrence,
    balanced_blocks,
    jacobi_gs_blocks,
    partition_time,
    profile,
)
from paraprop.networks.evaluate import top5_changes, trace  # noqa: E402
from paraprop.networks.timing import uniform_blocks  # noqa: E402
from paraprop_lab.experiments.harness import interleaved, median, threads  # noqa: E402
from paraprop_lab.experiments.plots import save_figure  # noqa: E402

TOL = 1e-3


COLUMNS = ["network", "weights", "blocks", "iterations", "top5@stop", "settled", "exact",
           "seq_ms_est", "par_ms_est", "est_speedup", "est_speedup_paper"]


MEASURE_COLUMNS = ["network", "weights", "fwd_ms", "fwd_default_threads_ms", "threaded_ms",
                   "threaded_iters", "threaded_top5", "measured_speedup"]


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
        default_threads: also time the forward pass with this many intra-op threads (the
            forward time itself when that is the current number; ``None``: not measured).
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
    workers = os.cpu_count() or 1

    def threaded():
        return jacobi_gs_blocks(one, bal, workers=workers, costs=times.tolist(), tol=tol)

    with torch.no_grad():
        par = threaded()
        measured = interleaved({"forward": lambda: model(x1), "threaded": threaded},
                               repeats=repeats, warmup=1, desc=name)
        if default_threads is not None and default_threads != torch.get_num_threads():
            with threads(default_threads):
                measured["forward (default threads)"] = interleaved(
                    {"f": lambda: model(x1)}, repeats=repeats, warmup=1, desc=name)["f"]
    fwd, thr = median(measured["forward"]), median(measured["threaded"])
    meas = {
        "network": name, "weights": weights, "fwd_ms": 1e3 * fwd, "threaded_ms": 1e3 * thr,
        "threaded_blocks": len(bal), "threaded_iters": par.iterations,
        "threaded_top5": top5_changes(one.output(par.value), one.reference[-1]),
        "measured_speedup": fwd / thr, "workers": par.stats.get("workers", 1),
        "fwd_default_threads_ms": (
            1e3 * median(measured["forward (default threads)"])
            if "forward (default threads)" in measured
            else 1e3 * fwd if default_threads is not None  # the default is what fwd_ms ran with
            else None),
    }
    extra = {"times_ms": (1e3 * times).tolist(), "names": rec.names, "curves": curves,
             "slowest_state": rec.names[int(times.argmax())],
             "slowest_ms": 1e3 * float(times.max())}
    return rows, meas, extra


def fig1d(path: Path, title: str, curves: dict[str, dict], tol: float) -> Path:
    """Fig. 1d style, per variant: top-5 changes (against the sequential output, and against the
    previous iterate) and the forward difference against the estimated time (iterations x the
    slowest block), with the sequential time (the sum of all state times) marked. Every
    iteration is a marker, so a variant that stops after one iteration is a visible point."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = ["tab:red", "tab:green", "tab:purple"]
    seq = 0.0
    for (label, c), color in zip(curves.items(), colors, strict=False):
        ts = [c["unit_ms"] * k for k in range(1, len(c["errors"]) + 1)]
        n = f" ({len(ts)} iteration{'s' if len(ts) != 1 else ''})"
        seq = c["seq_ms"]
        axes[0].plot(ts, c["errors"], "-", marker="o", ms=4, color=color, lw=2,
                     label=f"{label}{n}: against sequential")
        axes[0].plot(ts, c["changes"], ":", marker="x", ms=4, color=color, lw=1.5,
                     label=f"{label}: against the previous iteration")
        axes[1].semilogy(ts, [max(r, 1e-12) for r in c["residuals"]], ":", marker="x", ms=4,
                         color=color,
                         label=f"{label}: change from the previous iteration (all states)")
        axes[1].semilogy(ts, [max(e, 1e-12) for e in c["max_abs_errors"]], "-", marker="o",
                         ms=4, color=color, label=f"{label}{n}: output's difference from "
                                                  "sequential")
    axes[0].set_ylabel("top-5 labels that differ, per image")
    axes[0].set_title("predictions against the sequential ones", fontsize=9)
    axes[1].set_title("layer values against the sequential ones", fontsize=9)
    axes[1].axhline(tol, color="grey", lw=0.8, ls="--", label=f"stopping tolerance {tol:g}")
    axes[1].set_ylabel("largest absolute difference\n(zero drawn at 1e-12)")
    for a in axes:
        a.axvline(seq, color="k", ls="--", lw=1.5, label="sequential (sum of state times)")
        a.set_xlabel("estimated time: iterations x slowest block (ms)")
        a.set_xlim(left=0)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 110), fontsize=9)
    return save_figure(fig, path, dpi=110)


