"""``paraprop bench multigrid``: layer-parallel ResNets by nonlinear multigrid (Kirby et al. 2020).

1. Fig. 4: MGRIT residual per V-cycle for residual MLPs of depth 64, 256, 1024 and 4096
   (float64; weights smooth in depth or independent per layer; 3 levels, c = 4, FCF): the
   cycles to reach 1e-9 should not depend on depth.
2. One process: MGRIT forward (2 cycles, batched relaxation) against the plain serial forward of
   a 1024-layer, width-16 residual MLP, interleaved; ``vmap`` over stacked parameters, the
   blocks' own ``batched_forward`` kernel, and an unbatched loop.
3. torchrun with 1 and 2 gloo ranks: layer-parallel MGRIT against model partitioning (each run
   interleaves the two; runs alternate 1, 2, 1, 2 ranks), and the 2-rank result against 1 rank.
4. Cost model (Fig. 6-7 style): per-layer times of a compute-heavy convolution layer measured
   here, the gloo link measured in (3), and :func:`paraprop.multigrid.simulate` for 4 to 64
   workers on a 4096-layer network.
5. Training: test accuracy per epoch, MGRIT (2 cycles, forward and adjoint) against exact
   serial training with the same seed (MNIST when available, else the digits).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.func import functional_call, vjp, vmap

import paraprop_lab.experiments.plots  # noqa: F401  (selects matplotlib's headless backend)
from paraprop.data import find_mnist_dir
from paraprop.models.blocks import ConvBlock, mlp_blocks
from paraprop.multigrid import (
    CostModel,
    ForwardStepper,
    Hierarchy,
    ParallelResidualStack,
    mgrit,
    simulate,
)
from paraprop_lab.experiments import rows_more as _rows
from paraprop_lab.experiments.harness import interleaved, machine_info, median
from paraprop_lab.experiments.report import markdown_table, text_table, write_results
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows

DESCRIPTION = ("MGRIT: residual per cycle vs depth, batched MG vs serial forward, torchrun "
               "ranks vs model partitioning, simulated speedups, training accuracy")

# its comparison on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("multigrid.forward", _rows.multigrid_rows, 10)]


def _plt():
    """pyplot, imported after :mod:`paraprop_lab.experiments.plots` selected the headless
    backend."""
    import matplotlib.pyplot as plt

    return plt


def _print(title: str, rows: list[dict], cols: list[str]) -> str:
    print(f"\n{title}")
    print(text_table(rows, cols))
    return markdown_table(rows, cols)


# -- 1. residual per cycle (Fig. 4) -------------------------------------------------------------
def residual_study(out_dir: Path, quick: bool) -> dict:
    depths = [64, 256] if quick else [64, 256, 1024, 4096]
    x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rows, curves = [], {}
    for kind in ("smooth", "iid"):
        for depth in depths:
            blocks = mlp_blocks(depth, 16, kind=kind, seed=0, dtype=torch.float64, fast=True)
            hier = Hierarchy.build(depth, levels=3, coarsening=4)
            res = mgrit(ForwardStepper(blocks), x, hier, 1.0 / depth, relax="FCF",
                        max_iters=15, tol=1e-11, throw=False)
            r = res.residuals.tolist()
            k9 = next((i for i, v in enumerate(r) if v <= 1e-9), None)
            factor = (r[k9] / r[0]) ** (1 / k9) if k9 else float("nan")
            rows.append({"weights": kind, "depth": depth, "cycles_to_1e-9": k9,
                         "residual_0": r[0], "residual_2": r[2] if len(r) > 2 else r[-1],
                         "factor": factor})
            curves[(kind, depth)] = r
    spread = {}
    for kind in ("smooth", "iid"):
        ks = [r["cycles_to_1e-9"] for r in rows if r["weights"] == kind]
        ok = all(k is not None for k in ks) and max(ks) - min(ks) <= 2
        spread[kind] = {"cycles": ks, "met": ok}
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, kind in zip(axes, ("smooth", "iid"), strict=True):
        for depth in depths:
            r = [max(v, 1e-17) for v in curves[(kind, depth)]]
            ax.semilogy(range(len(r)), r, marker=".", label=f"depth {depth}")
        ax.axhline(1e-9, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("V-cycle")
        ax.set_title("weights varying smoothly in depth" if kind == "smooth" else
                     "independent weights per layer")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("residual norm (distance from\nthe serial solution's equations)")
    axes[1].legend(fontsize=8)
    fig.suptitle("MGRIT residual per V-cycle (3 levels, coarsening 4, FCF relaxation, T=1), "
                 "cf. Kirby et al. Fig. 4")
    fig.tight_layout()
    png = out_dir / "multigrid_residuals.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    cols = ["weights", "depth", "cycles_to_1e-9", "residual_0", "residual_2", "factor"]
    md = _print("Residual per cycle vs depth (width 16, batch 8, float64, 3 levels, c=4, FCF)",
                rows, cols)
    note = "; ".join(f"{k}: cycles {v['cycles']} -> {'met' if v['met'] else 'NOT met'}"
                     for k, v in spread.items())
    print(f"target (same cycles +-1 at every depth): {note}")
    return {"rows": rows, "target": spread, "md": md + f"\n\nTarget: {note}.\n\n![]({png.name})"}


# -- 2. one process: batched MG forward vs serial forward ---------------------------------------
def forward_study(out_dir: Path, quick: bool, repeats: int) -> dict:
    depth = 256 if quick else 1024
    batches = [8] if quick else [8, 32]
    two = {"max_iters": 2, "tol": None}  # 2 V-cycles, not checked (the timed setting)
    rows = []
    for batch in batches:
        x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(2))
        plain = mlp_blocks(depth, 16, kind="iid", seed=0)
        fast = mlp_blocks(depth, 16, kind="iid", seed=0, fast=True)
        h = 1.0 / depth
        nets = {
            "MG vmap (3 lv, c=4, FCF)": ParallelResidualStack(plain, h, levels=3, **two),
            "MG batched_forward (3 lv, c=4, FCF)": ParallelResidualStack(fast, h, levels=3,
                                                                        **two),
            "MG batched_forward (3 lv, c=4, F)": ParallelResidualStack(fast, h, levels=3,
                                                                      relax="F", **two),
            "MG batched_forward (2 lv, c=4, FCF)": ParallelResidualStack(fast, h, levels=2,
                                                                        **two),
        }
        if not quick:
            nets["MG loop, unbatched (3 lv, c=4, FCF)"] = ParallelResidualStack(
                plain, h, levels=3, batched=False, **two)
        ref = nets["MG vmap (3 lv, c=4, FCF)"]

        def serial(ref=ref, x=x):
            with torch.no_grad():
                return ref.serial_forward(x)

        cases = {"serial forward": serial}
        for name, net in nets.items():
            def run(net=net, x=x):
                with torch.no_grad():
                    return net(x)
            cases[name] = run
        times = interleaved(cases, repeats=repeats, warmup=1, desc=f"forward B={batch}")
        y_ref = serial()
        base = median(times["serial forward"])
        for name, ts in times.items():
            row = {"batch": batch, "method": name, "time_ms": 1e3 * median(ts),
                   "speedup": base / median(ts)}
            if name in nets:
                y = cases[name]()
                st = nets[name].last_forward
                row.update(cycles=st.iterations, residual=float(st.residuals[-1]),
                           max_abs_err=float((y - y_ref).abs().max()))
            rows.append(row)
    cols = ["batch", "method", "time_ms", "speedup", "cycles", "residual", "max_abs_err"]
    md = _print(f"MG forward (2 cycles) vs serial forward, depth {depth}, width 16, "
                f"{torch.get_num_threads()} thread(s), interleaved medians of {repeats}", rows,
                cols)
    plt = _plt()
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "serial forward"]
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.45 * len(methods) * len(batches)))
    height = 0.8 / len(batches)
    for i, batch in enumerate(batches):
        sp = {r["method"]: r["speedup"] for r in rows if r["batch"] == batch}
        ys = [k + i * height for k in range(len(methods))]
        ax.barh(ys, [sp[m] for m in methods], height=height, label=f"batch {batch}")
        for y, m in zip(ys, methods, strict=True):
            ax.text(sp[m], y, f" {sp[m]:.2f}", va="center", fontsize=8)
    ax.set_yticks([k + 0.4 - height / 2 for k in range(len(methods))], methods, fontsize=8)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("speedup over the serial forward pass (times faster; same run, interleaved)")
    ax.set_title(f"MG forward, 2 cycles, vs serial: depth {depth}, width 16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = out_dir / "multigrid_forward.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    best = {b: max(r["speedup"] for r in rows if r["batch"] == b and r["method"].startswith(
        "MG batched_forward (3 lv, c=4, FCF)")) for b in batches}
    return {"rows": rows, "depth": depth, "best_fcf_speedup": best,
            "md": md + f"\n\n![]({png.name})"}


# -- 3. torchrun: 1 and 2 gloo ranks, MGRIT vs model partitioning -------------------------------
def _torchrun(n: int, args: list[str], out: Path, timeout: float) -> dict:
    # --standalone: a c10d rendezvous on localhost:0 whose store the workers share, so no
    # port is picked in advance (a bind-close-reuse "free port" could be taken meanwhile)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "paraprop.distributed", *args, "--out", str(out),
           "--save-output", str(out.with_suffix(".pt"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun --nproc_per_node={n} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def torchrun_study(quick: bool, repeats: int) -> dict:
    depth = 256 if quick else 1024
    args = ["--depth", str(depth), "--width", "16", "--batch", "8", "--levels", "3",
            "--coarsening", "4", "--cycles", "2", "--repeats", str(repeats), "--fast",
            "--threads", "1"]
    order = [2] if quick else [1, 2, 1, 2]
    runs: dict[int, list[dict]] = {1: [], 2: []}
    outputs: dict[int, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, n in enumerate(order):
            out = Path(tmp) / f"run{i}_{n}.json"
            try:
                rec = _torchrun(n, args, out, timeout=300)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"torchrun with {n} rank(s) failed: {e}")
                return {"rows": [], "error": str(e), "md": f"torchrun failed: `{e}`"}
            runs[n].append(rec)
            outputs[n] = torch.load(out.with_suffix(".pt"), weights_only=True)
    # the same network in this process (one rank, no torch.distributed)
    one = ParallelResidualStack(mlp_blocks(depth, 16, kind="iid", seed=0, fast=True),
                                1.0 / depth, levels=3, coarsening=4, max_iters=2, tol=None)
    with torch.no_grad():
        y_one = one(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
    rel = {f"{n} ranks vs one process": float((y - y_one).norm() / y_one.norm())
           for n, y in outputs.items()}
    rows = []
    for n in sorted(k for k in runs if runs[k]):
        mg = statistics.median(t for r in runs[n] for t in r["times"]["mgrit"])
        part = statistics.median(t for r in runs[n] for t in r["times"]["partitioned"])
        rows.append({"ranks": n, "layers_per_rank": str(runs[n][0]["layers_per_rank"]),
                     "threads_per_rank": runs[n][0]["threads"], "runs": len(runs[n]),
                     "mgrit_ms": 1e3 * mg, "partitioned_ms": 1e3 * part,
                     "partitioned/mgrit": part / mg,
                     "rank0_wait_ms": 1e3 * statistics.median(r["wait_s_rank0"]
                                                              for r in runs[n]),
                     "residual_after_2": runs[n][0]["residuals"][-1]})
    link = runs[2][0].get("link", {})
    cols = ["ranks", "layers_per_rank", "threads_per_rank", "runs", "mgrit_ms",
            "partitioned_ms", "partitioned/mgrit", "rank0_wait_ms", "residual_after_2"]
    md = _print(f"torchrun, gloo on localhost: depth {depth}, width 16, batch 8, 3 levels, c=4,"
                f" FCF, 2 cycles; runs in the order {order} ranks, each interleaving MGRIT and "
                f"model partitioning ({repeats} rounds)", rows, cols)
    worst = max(rel.values())
    summary = "; ".join(f"{k}: relative difference of u_N {v:.2e}" for k, v in rel.items())
    summary += (f" (target <= 1e-6: {'met' if worst <= 1e-6 else 'NOT met'}). gloo link: "
                f"latency {link.get('latency_s', float('nan')) * 1e6:.0f} us, bandwidth "
                f"{link.get('bandwidth_Bps', float('nan')) / 1e9:.2f} GB/s.")
    if len(rows) == 2:
        summary += (f" MGRIT forward, 2 ranks vs 1 rank: "
                    f"{rows[0]['mgrit_ms'] / rows[1]['mgrit_ms']:.2f}x (medians over runs, "
                    "separate processes).")
    summary += (" rank0_wait_ms: time rank 0 spent blocked on receives and all-reduces in "
                "its last MGRIT solve.")
    print(summary)
    return {"rows": rows, "rel_diff": rel, "link": link, "runs": runs,
            "md": md + "\n\n" + summary}


# -- 4. cost model -------------------------------------------------------------------------------
def measure_layer(channels: int, side: int, batch: int, repeats: int, group: int) -> dict:
    """Per-layer times of ``u + h relu(conv3x3(u))``: forward, adjoint VJP, parameter VJP, the
    VJP of both at once (the final adjoint relaxation's step) and the ordinary backward, timed
    interleaved (the fastest round of each), and the concurrency of ``group`` layers batched by
    ``vmap`` (``group`` single-layer times over one batched time)."""
    blk = ConvBlock(channels)
    u = torch.randn(batch, channels, side, side)
    lam = torch.randn_like(u)
    params = {k: v.detach() for k, v in blk.named_parameters()}
    uu = u.clone().requires_grad_(True)
    stacked = {k: v.expand(group, *v.shape).contiguous() for k, v in params.items()}
    vf = vmap(lambda p, x: functional_call(blk, p, (x,)))
    us = u.expand(group, *u.shape).contiguous()

    def forward():
        with torch.no_grad():
            return u + 0.1 * blk(u)

    def backprop():
        blk(uu).backward(lam)

    def batched():
        with torch.no_grad():
            return vf(stacked, us)

    times = interleaved({
        "forward": forward,
        "adjoint": lambda: vjp(blk, u)[1](lam),
        "param_grad": lambda: vjp(lambda p: functional_call(blk, p, (u,)), params)[1](lam),
        "fused": lambda: vjp(lambda y, p: functional_call(blk, p, (y,)), u, params)[1](lam),
        "forward+backward": backprop,
        "batched": batched,
    }, repeats=repeats, warmup=1, desc="layer times")
    # The cost model wants each kernel's own cost: the fastest of the interleaved rounds is
    # the least disturbed by other jobs on a shared machine.
    best = {k: min(v) for k, v in times.items()}
    t_f = best["forward"]
    return {"forward_s": t_f, "adjoint_s": best["adjoint"], "param_grad_s": best["param_grad"],
            "fused_s": best["fused"], "backprop_s": max(best["forward+backward"] - t_f, t_f),
            "params": sum(p.numel() for p in params.values()),
            "state_bytes": u.numel() * u.element_size(),
            "concurrency": group * t_f / best["batched"], "group": group}


def cost_study(out_dir: Path, quick: bool, link: dict) -> dict:
    channels, side, batch = (64, 8, 2) if quick else (236, 8, 4)
    depth = 1024 if quick else 4096
    workers = [4, 8, 16] if quick else [4, 8, 16, 32, 64]
    meas = measure_layer(channels, side, batch, 3 if quick else 9, 16)
    lat = link.get("latency_s", 50e-6)
    bw = link.get("bandwidth_Bps", 1e9)
    # A worker relaxes its intervals one by one when batching does not pay (concurrency < 1).
    base = CostModel(forward_s=meas["forward_s"], adjoint_s=meas["adjoint_s"],
                     param_grad_s=meas["param_grad_s"], backprop_s=meas["backprop_s"],
                     latency_s=lat, bandwidth_Bps=bw, message_bytes=meas["state_bytes"],
                     concurrency=max(1.0, meas["concurrency"]), fused_s=meas["fused_s"])
    measured = "measured (this CPU)"
    assumed = "assumed 4 (GPU streams)"
    configs = [  # label, levels, relaxation, concurrency
        (measured, 4, "FCF", base.concurrency),
        (measured, 5, "FCF", base.concurrency),
        (measured, 4, "F", base.concurrency),
        (measured, 5, "F", base.concurrency),
        (assumed, 4, "FCF", 4.0),
    ]
    rows = []
    for label, levels, relax, conc in configs:
        for w in workers:
            m = dataclasses.replace(base, concurrency=conc)
            r = simulate(depth, w, m, levels=levels, coarsening=4, cycles=2, relax=relax)
            rows.append({"concurrency": label, "levels": levels, "relax": relax, "workers": w,
                         "conc": round(m.concurrency, 2), "mgrit_s": r["mgrit_s"],
                         "partition_s": r["partition_s"],
                         "speedup_vs_partition": r["speedup_vs_partition"],
                         "speedup_vs_serial": r["speedup_vs_serial"]})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, levels, relax, _ in configs:
        pts = [r for r in rows if r["concurrency"] == label and r["levels"] == levels
               and r["relax"] == relax]
        ax.plot([r["workers"] for r in pts], [r["speedup_vs_partition"] for r in pts],
                marker="o", label=f"{label}, {levels} lv, {relax}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(10.0, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("predicted speedup over model partitioning")
    ax.set_title(f"Cost model, {depth} layers, training step, 2 cycles")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    png = out_dir / "multigrid_cost_model.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    cols = ["concurrency", "levels", "relax", "workers", "conc", "mgrit_s", "partition_s",
            "speedup_vs_partition", "speedup_vs_serial"]
    md = _print(f"Cost model (simulate), {depth} layers of conv3x3 {channels} ch on {batch}x"
                f"{channels}x{side}x{side} ({meas['params']} parameters per layer), training",
                rows, cols)
    at_max = {f"{r['concurrency']}, {r['levels']} lv, {r['relax']}": r["speedup_vs_partition"]
              for r in rows if r["workers"] == workers[-1]}
    meas_md = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in meas.items() if k.endswith("_s"))
    note = (f"Measured per layer: {meas_md}; batched concurrency of {meas['group']} layers on "
            f"this CPU: {meas['concurrency']:.2f}; link latency {lat * 1e6:.0f} us, bandwidth "
            f"{bw / 1e9:.2f} GB/s ({'measured with gloo' if link else 'assumed'}).")
    note += (f" At {workers[-1]} workers: " + "; ".join(
        f"{k} {v:.1f}x" for k, v in at_max.items())
        + " (target >= 10x with measured times: "
        + ("met by " + ", ".join(k for k, v in at_max.items() if v >= 10 and k.startswith(
            measured)) if any(v >= 10 and k.startswith(measured) for k, v in at_max.items())
           else "NOT met") + ").")
    print(note)
    return {"rows": rows, "measured": meas, "at_max_workers": at_max, "workers": workers,
            "md": md + "\n\n" + note + f"\n\n![]({png.name})"}


# -- 5. training ---------------------------------------------------------------------------------
def training_study(out_dir: Path, quick: bool) -> dict:
    from paraprop_lab.training.resnet_mg import train

    mnist = find_mnist_dir() is not None and not quick
    cfg = ({"data": "mnist", "depth": 32, "epochs": 1, "batch_size": 64, "channels": 4}
           if mnist else {"data": "digits", "depth": 24 if quick else 32,
                          "epochs": 1 if quick else 3, "batch_size": 128 if quick else 64,
                          "channels": 4})
    hist = {}
    for name, serial in (("serial", True), ("MG 2 cycles", False)):
        try:
            h = train(**cfg, cycles=2, levels=2, coarsening=4, serial=serial, seed=0,
                      progress=False)
        except (OSError, ValueError) as e:
            return {"rows": [], "error": str(e), "md": f"training failed: `{e}`"}
        h.pop("model")
        hist[name] = h
    rows = []
    for a, b in zip(hist["serial"]["epochs"], hist["MG 2 cycles"]["epochs"], strict=True):
        rows.append({"epoch": a["epoch"], "serial_acc": a["test_acc"],
                     "mg_acc": b["test_acc"], "diff_points": b["test_acc"] - a["test_acc"],
                     "serial_loss": a["loss"], "mg_loss": b["loss"], "serial_s": a["train_s"],
                     "mg_s": b["train_s"], "mg_residual": b["mean_final_residual"]})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for name in hist:
        ep = hist[name]["epochs"]
        ax.plot([e["epoch"] for e in ep], [e["test_acc"] for e in ep], marker="o", label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{cfg['data']}: depth {cfg['depth']}, MG vs serial (same seed)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    png = out_dir / "multigrid_training.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    c = hist["serial"]["config"]
    cols = ["epoch", "serial_acc", "mg_acc", "diff_points", "serial_loss", "mg_loss",
            "serial_s", "mg_s", "mg_residual"]
    md = _print(f"Training {cfg['data']} ({c['split']}), "
                f"depth {cfg['depth']}, {cfg['channels']} channels, Adam, batch "
                f"{cfg['batch_size']}; MG: 2 levels, c=4, FCF, 2 cycles forward and adjoint",
                rows, cols)
    diff = abs(rows[0]["diff_points"])
    note = (f"After epoch 1: |MG - serial| = {diff:.2f} points (target <= 0.5 on MNIST: "
            f"{'met' if diff <= 0.5 else 'NOT met'}{'' if mnist else '; digits run, not MNIST'}"
            "). Epoch times are single runs, not interleaved.")
    print(note)
    return {"rows": rows, "config": cfg, "history": hist, "mnist": mnist,
            "md": md + "\n\n" + note + f"\n\n![]({png.name})"}


@with_device_rows("multigrid", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
    """Run the suite; writes ``multigrid.json``, ``multigrid.md`` and PNGs under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    repeats = repeats or (3 if quick else 7)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small batched kernels: one thread, like the serial baseline
    t0 = time.perf_counter()
    try:
        machine = machine_info()
        res = residual_study(out_dir, quick)
        fwd = forward_study(out_dir, quick, repeats)
        tr = torchrun_study(quick, max(2, repeats // 2) if quick else repeats)
        cost = cost_study(out_dir, quick, tr.get("link", {}))
        train = training_study(out_dir, quick)
    finally:
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - t0
    sections = [
        ("Residual per cycle vs depth (Fig. 4)", res["md"]),
        ("One process: batched MG forward vs serial forward", fwd["md"]),
        ("torchrun: 1 vs 2 gloo ranks, MGRIT vs model partitioning", tr["md"]),
        ("Cost model: simulated speedups (Fig. 6-7 style)", cost["md"]),
        ("Training: MG (2 cycles) vs serial", train["md"]),
    ]
    payload = {"suite": "multigrid", "machine": machine, "quick": quick, "repeats": repeats,
               "threads": 1, "elapsed_s": elapsed,
               "residuals": {"rows": res["rows"], "target": res["target"]},
               "forward": {"rows": fwd["rows"], "best_fcf_speedup": fwd["best_fcf_speedup"]},
               "torchrun": {k: v for k, v in tr.items() if k != "md"},
               "cost_model": {"rows": cost["rows"], "measured": cost["measured"],
                              "at_max_workers": cost["at_max_workers"]},
               "training": {"rows": train["rows"], "config": train.get("config"),
                            "mnist": train.get("mnist"),
                            "history": {k: v["epochs"] for k, v in
                                        train.get("history", {}).items()}}}
    command = "paraprop bench multigrid" + (" --quick" if quick else "")
    write_results(out_dir, "multigrid", payload, sections, command)
    print(f"\nmultigrid suite: {elapsed:.0f} s")
    return payload
