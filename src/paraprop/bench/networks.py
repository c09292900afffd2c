"""``paraprop bench networks``: network inference by Jacobi-GS over the layers (Song et al. 2021,
§5.2, Fig. 1d).

For DenseNet-121 and DenseNet-201 (torchvision architectures), a ResNet-18 and a deep MLP, trained
briefly here on the MNIST test set resized to 32x32 (pretrained ImageNet weights cannot be
downloaded; the DenseNets are also run with random weights):

1. Convergence on 100 held-out images: Jacobi-GS with one state per block (each dense layer, with
   its two convolutions, is one block, as in the paper), stopping on the forward difference of the
   whole state (``TOL``); iterations (the most any image took), top-5 label changes at the stop,
   the iteration from which they stay zero, and exactness at the end (``tol=0`` on 8 images:
   bitwise the sequential output).
2. The paper's parallel-time estimate from per-state medians at batch 1 (the paper's setting):
   sequential = sum of all state times, Jacobi-GS = iterations x slowest state. Every state counts
   (stem, transitions, head); the paper's own accounting, which sums and maxes over dense layers
   only, is reported beside it for comparison.
3. Measured wall time at batch 1 on this machine: the plain forward pass vs Jacobi-GS run by
   :class:`~paraprop.layers.ThreadedJacobiGS` (one worker per core) to the same stopping rule,
   interleaved.

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
from paraprop.bench.report import markdown_table, text_table, write_results  # noqa: E402
from paraprop.layers import ThreadedJacobiGS, as_recurrence, estimate_time, profile  # noqa: E402
from paraprop.layers.evaluate import top5_changes, trace  # noqa: E402
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
COLUMNS = ["network", "weights", "states", "iterations", "top5@stop", "settled", "exact",
           "seq_ms_est", "jgs_ms_est", "est_speedup", "est_speedup_paper", "fwd_ms",
           "threaded_ms", "threaded_iters", "measured_speedup"]
MEASURE_COLUMNS = ["network", "weights", "fwd_ms", "fwd_default_threads_ms", "threaded_ms",
                   "solve_ms", "measured_speedup"]


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


def network_row(model, images: torch.Tensor, *, name: str, weights: str, tol: float = TOL,
                repeats: int = 5, exact_images: int = 8, profile_repeats: int = 15,
                default_threads: int | None = None) -> tuple[dict, dict]:
    """Every measurement of one network; returns ``(row, extra)`` (``extra``: the curves).

    Arguments:
        model: the network (eval mode).
        images: the evaluation images (the convergence is over all of them; timing uses the
            first one, batch 1).
        name, weights: labels for the report (which network, which weights).
        tol: forward-difference tolerance of the stopping rule.
        repeats: interleaved timing rounds; ``profile_repeats``: per-state timing rounds.
        exact_images: images solved to ``tol=0`` to check exactness at the end.
        default_threads: also time the forward pass with this many intra-op threads.
    """
    rec = as_recurrence(model)
    system = rec.bind(images)
    sol = trace(system, method="jacobi_gs", block_size=1, tol=tol)
    st = sol.stats
    k = sol.iterations
    exact_sys = rec.bind(images[:exact_images])
    exact = trace(exact_sys, method="jacobi_gs", block_size=1, tol=0.0)

    one = rec.bind(images[:1])
    times = profile(one, repeats=profile_repeats)
    seq = estimate_time(times, method="sequential", iterations=1)
    jgs = estimate_time(times, method="jacobi_gs", block_size=1, iterations=k)
    dense = _dense_states(rec.names)
    paper = None
    if dense:  # the paper's accounting: dense layers only (sum / (iterations x slowest))
        td = times[dense]
        paper = float(td.sum()) / (k * float(td.max()))

    x1 = images[:1]
    par = ThreadedJacobiGS(one, block_size=1, workers=os.cpu_count() or 1,
                           times=times.tolist())
    with torch.no_grad():
        par_out, par_k, _ = par.run(tol=tol)
    cases = {
        "forward": lambda: model(x1),
        "threaded jacobi_gs": lambda: par.run(tol=tol),
        "solve jacobi_gs": lambda: trace_free(one, tol),
    }
    with torch.no_grad():
        measured = interleaved(cases, repeats=repeats, warmup=1, desc=name)
        if default_threads is not None and default_threads != torch.get_num_threads():
            with threads(default_threads):
                measured["forward (default threads)"] = interleaved(
                    {"f": lambda: model(x1)}, repeats=repeats, warmup=1, desc=name)["f"]
    par.close()
    fwd = median(measured["forward"])
    thr = median(measured["threaded jacobi_gs"])
    row = {
        "network": name, "weights": weights, "states": system.T, "iterations": k,
        "top5@stop": st["output_error"], "settled": st["settled"],
        "exact": exact.stats["bitwise_equal"], "exact_iterations": exact.iterations,
        "images": images.shape[0],
        "seq_ms_est": 1e3 * seq, "jgs_ms_est": 1e3 * jgs, "est_speedup": seq / jgs,
        "est_speedup_settled": seq / estimate_time(times, method="jacobi", iterations=st[
            "settled"]) if st["settled"] else None,
        "est_speedup_paper": paper,
        "slowest_state": rec.names[int(times.argmax())], "slowest_ms": 1e3 * float(times.max()),
        "fwd_ms": 1e3 * fwd, "threaded_ms": 1e3 * thr, "threaded_iters": par_k,
        "threaded_top5": top5_changes(one.output(par_out), one.reference[-1]),
        "solve_ms": 1e3 * median(measured["solve jacobi_gs"]),
        "measured_speedup": fwd / thr,
        "fwd_default_threads_ms": (1e3 * median(measured["forward (default threads)"])
                                   if "forward (default threads)" in measured else None),
    }
    per_image = images.shape[0]
    extra = {
        "times_ms": (1e3 * times).tolist(),
        "names": rec.names,
        "errors": [e / per_image for e in st["errors"]],
        "changes": [c / per_image for c in st["changes"]],
        "residuals": sol.residuals.tolist(),
        "max_abs_errors": st["max_abs_errors"],
        "unit_ms": 1e3 * jgs / max(k, 1),
        "seq_ms": 1e3 * seq,
        "sample_iterations": st["sample_iterations"].tolist(),
    }
    return row, extra


def trace_free(system, tol: float):
    """Jacobi-GS through :func:`paraprop.solve` without the error tracing (for timing)."""
    from paraprop.solve import solve

    return solve(system, system.x0, method="jacobi_gs", block_size=1, dim=1, tol=tol)


def fig1d(path: Path, title: str, extra: dict, tol: float) -> Path:
    """Fig. 1d style: top-5 changes (vs sequential, and vs the previous iterate) and the forward
    difference against the estimated time, with the sequential time marked."""
    unit, seq = extra["unit_ms"], extra["seq_ms"]
    ks = range(1, len(extra["errors"]) + 1)
    ts = [unit * k for k in ks]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    ax.plot(ts, extra["errors"], "-", color="tab:red", lw=2, label="difference from sequential")
    ax.plot(ts, extra["changes"], "--", color="tab:blue", lw=2,
            label="change from previous iterate")
    ax.set_ylabel("top-5 label changes per image")
    ax2 = axes[1]
    ax2.semilogy(ts, [max(r, 1e-12) for r in extra["residuals"]], "--", color="tab:blue",
                 label="forward difference (all states)")
    ax2.semilogy(ts, [max(e, 1e-12) for e in extra["max_abs_errors"]], "-", color="tab:red",
                 label="max |output - sequential|")
    ax2.axhline(tol, color="grey", lw=0.8, ls=":", label=f"tol={tol:g}")
    ax2.set_ylabel("max |.| (floor 1e-12)")
    for a in axes:
        a.axvline(seq, color="k", ls="--", lw=1.5, label="sequential (sum of state times)")
        a.set_xlabel("estimated time (ms): iterations x slowest state")
        a.set_xlim(0, max(seq, ts[-1] if ts else seq) * 1.05)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def small_densenet(seed: int = 0):
    """torchvision's DenseNet class at a small configuration (17 states), random weights."""
    torch.manual_seed(seed)
    return torchvision.models.DenseNet(growth_rate=8, block_config=(2, 3, 4, 3),
                                       num_init_features=8, bn_size=2, num_classes=10).eval()


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
        {"name": "DenseNet-121", "arch": "densenet121", "steps": 0, "data": "mnist"},
        {"name": "ResNet-18", "arch": "resnet18", "steps": 80, "data": "mnist"},
        {"name": "MLP 24x256", "arch": "mlp", "steps": 300, "data": "mnist"},
    ]


def build(cfg: dict, out_dir: Path) -> tuple[torch.nn.Module, str, torch.Tensor]:
    """The model, the sentence saying which weights it has, and the held-out images."""
    arch, data = cfg["arch"], cfg["data"]
    if arch == "small_densenet":
        model = small_densenet()
    elif arch == "mlp_small":
        model = make_network("mlp", size=32, depth=6, width=32)
    elif cfg["steps"] > 0:
        model, info = trained_network(arch, data=data, steps=cfg["steps"], cache_dir=out_dir)
        weights = info["weights"] + ("" if info["trained_now"] else " (checkpoint reused)")
    else:
        model = make_network(arch)
    if cfg["steps"] == 0:
        weights = "random initialisation (seed 0)"
    channels = 1 if arch in ("mlp", "mlp_small") else input_channels(arch)
    x, y = image_data(data, size=32, channels=channels)
    _, _, xh, _ = split(data, x, y)
    return model, weights, xh


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None) -> dict:
    repeats = repeats or (1 if quick else 5)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    default_threads = torch.get_num_threads()
    n_images = 8 if quick else 100
    rows, sections, curves = [], [], {}
    with threads(1):
        machine = machine_info()
        for cfg in configs(quick):
            model, weights, xh = build(cfg, out_dir)
            short = "trained" if cfg["steps"] else "random"
            row, extra = network_row(model, xh[:n_images], name=cfg["name"], weights=short,
                                     repeats=repeats, exact_images=2 if quick else 8,
                                     profile_repeats=3 if quick else 15,
                                     default_threads=None if quick else default_threads)
            row["weights_detail"] = weights
            rows.append(row)
            tag = f"{cfg['arch']}_{short}"
            curves[tag] = extra
            png = fig1d(out_dir / f"networks_{tag}_fig1d.png",
                        f"{cfg['name']} ({weights}); Jacobi-GS, {row['images']} images, "
                        f"tol={TOL:g}", extra, TOL)
            sections.append((f"{cfg['name']}, {short} weights",
                             f"Weights: {weights}.\n\nStates: {row['states']}; slowest state "
                             f"{row['slowest_state']} ({row['slowest_ms']:.3f} ms at batch 1)."
                             f"\n\n![]({png.name})"))
            print(f"\n{cfg['name']}: {weights}")
    print(f"\nJacobi-GS over the layers (one state per block), tol={TOL:g}, {n_images} images; "
          "times at batch 1, 1 intra-op thread")
    print(text_table(rows, COLUMNS))
    summary = markdown_table(rows, COLUMNS)
    notes = (
        "`iterations`: Jacobi-GS iterations until the forward difference of every state is "
        f"<= {TOL:g} (the most any image took); `top5@stop`: top-5 label changes against the "
        "sequential output there, summed over the images; `settled`: the iteration from which they "
        "stay 0; `exact`: bitwise equal to the sequential output at the end (tol=0, 8 images). "
        "`seq_ms_est` / `jgs_ms_est`: the paper's estimate from per-state medians at batch 1 "
        "(sum of all states / iterations x slowest state), `est_speedup` their ratio; "
        "`est_speedup_paper`: the same with the paper's accounting (dense layers only). "
        "`fwd_ms`: the plain forward pass, measured; `threaded_ms`: Jacobi-GS on one thread per "
        "core to the same stopping rule, measured (`threaded_iters` iterations); "
        "`measured_speedup`: fwd_ms / threaded_ms.")
    sections.insert(0, ("Summary", summary + "\n\n" + notes))
    meas = markdown_table(rows, MEASURE_COLUMNS)
    sections.insert(1, ("Measured wall times at batch 1 (this machine)", meas + "\n\n"
                        "`fwd_default_threads_ms`: the forward pass with the default intra-op "
                        f"threads ({default_threads}); `solve_ms`: paraprop.solve's Jacobi-GS "
                        "(one thread, all states in turn)."))
    payload = {"suite": "networks", "machine": machine, "tol": TOL, "repeats": repeats,
               "quick": quick, "images": n_images, "load_average": os.getloadavg(),
               "default_threads": default_threads, "rows": rows, "curves": curves}
    write_results(out_dir, "networks", payload, sections,
                  "paraprop bench networks" + (" --quick" if quick else ""))
    return payload
