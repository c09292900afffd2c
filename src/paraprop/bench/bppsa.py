"""``paraprop bench bppsa``: back-propagation through time as a scan (BPPSA) vs torch autograd.

Reproduces the experiments of BPPSA (Wang, Bai & Pekhimenko 2020, §4.1-4.2, Fig. 8, Appendix G)
on the CPU, and the Jacobi backward of Song et al. 2021 (§5.1):

1. **Bitstream classification, T sweep** (batch 16): ``x_t ~ Bernoulli(0.05 + 0.1 c)`` for class
   ``c`` of 10, a tanh RNN (hidden 20) read out by a linear layer from the last state,
   cross-entropy, Adam (lr 1e-5). For ``T`` in 10 .. 30000: forward, backward and whole
   training-step times of torch.nn.RNN with autograd and of :class:`paraprop.nn.RNN` (same
   weights, same run, interleaved), with the backward's hidden-state gradients by the native scan
   kernel and by the pure-PyTorch chunked scan.
2. **Batch sweep** at ``T = 1000``: batch 2 .. 256.
3. **GRU at the IRMAS shapes** (synthetic features): ``T`` = 259 / 517 / 1034 with 38 / 24 / 12
   inputs, hidden 20, 11 classes, batch 16 / 32 / 64.
4. **GRU and LSTM, wider** (issue 19): ``T = 1000``, hidden 64, batch 32, 16 inputs, 10
   classes: training steps of :class:`paraprop.nn.GRU` / :class:`paraprop.nn.LSTM` against
   torch.nn.GRU / torch.nn.LSTM with autograd.
5. **Jacobi backward** (Song §5.1): training loss against wall-clock time for the exact scan,
   torch autograd and Jacobi with ``K`` sweeps (a truncated backward) on the bitstream task.

Every figure is a median over interleaved rounds; speedups are ratios of medians from the same
run. Gradient agreement with autograd is checked once per configuration before timing.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn

from paraprop.data import bitstreams
from paraprop.experiments.bppsa import CLASSES, LR, pair
from paraprop.experiments.harness import interleaved, machine_info, median
from paraprop.experiments.plots import plt, save_figure
from paraprop.experiments.report import markdown_table, text_table, write_results
from paraprop.nn import JacobiBackward, ScanBackward
from paraprop.scan import native

DESCRIPTION = ("BPPSA: RNN/GRU/LSTM backward as a scan vs torch autograd (T, batch, GRU, "
               "GRU/LSTM hidden 64, Jacobi)")


T_SWEEP = [10, 30, 100, 300, 1000, 3000, 10000, 30000]


B_SWEEP = [2, 4, 8, 16, 32, 64, 128, 256]


IRMAS = [(259, 38), (517, 24), (1034, 12)]


IRMAS_BATCH = [16, 32, 64]


# GRU and LSTM at T = 1000, hidden 64, batch 32 (issue 19): (T, inputs, hidden, batch)
WIDE = (1000, 16, 64, 32)


def grad_error(ref: nn.Module, mine: nn.Module, x, y) -> float:
    """Max relative difference of all parameter gradients of one step (same weights)."""
    grads = []
    for m in (ref, mine):
        m.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        m.zero_grad()
    return max(float((grads[1][n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
               for n, g in grads[0].items())


class Stepper:
    """One training step, its forward / backward / optimizer parts timed separately."""

    def __init__(self, model: nn.Module, x, y):
        self.model, self.x, self.y = model, x, y
        self.opt = torch.optim.Adam(model.parameters(), lr=LR)
        self.fwd: list[float] = []
        self.bwd: list[float] = []

    def __call__(self):
        self.opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.fwd.append(t1 - t0)
        self.bwd.append(t2 - t1)
        return loss


def measure(models: dict[str, nn.Module], x, y, repeats: int, desc: str) -> dict:
    """Interleaved training steps of every model; medians in ms of forward, backward, step."""
    steppers = {k: Stepper(m, x, y) for k, m in models.items()}
    times = interleaved(steppers, repeats=repeats, warmup=1, desc=desc)
    out = {}
    for k, s in steppers.items():
        out[k] = {"fwd_ms": 1e3 * median(s.fwd[1:]), "bwd_ms": 1e3 * median(s.bwd[1:]),
                  "step_ms": 1e3 * median(times[k])}
    return out


def repeats_for(T: int, batch: int, repeats: int | None) -> int:
    """Fewer rounds where one torch step takes seconds (stated in the report)."""
    if repeats is not None:
        return repeats
    work = T * max(batch, 16)
    return 5 if work <= 16 * 3000 else (3 if work <= 16 * 10000 else 2)


def rnn_row(T: int, batch: int, repeats: int | None, seed: int, chunked: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    x, y = bitstreams(T, batch, generator=g)
    ref, mine = pair("rnn", 1, CLASSES, seed)
    models = {"torch": ref, "scan": mine}
    if chunked:
        models["chunked"] = pair("rnn", 1, CLASSES, seed,
                                 backward=ScanBackward(algorithm="chunked"))[1]
    err = grad_error(ref, mine, x, y)
    reps = repeats_for(T, batch, repeats)
    m = measure(models, x, y, reps, f"rnn T={T} B={batch}")
    row = {"T": T, "batch": batch, "repeats": reps,
           "torch_fwd_ms": m["torch"]["fwd_ms"], "torch_bwd_ms": m["torch"]["bwd_ms"],
           "torch_step_ms": m["torch"]["step_ms"],
           "scan_fwd_ms": m["scan"]["fwd_ms"], "scan_bwd_ms": m["scan"]["bwd_ms"],
           "scan_step_ms": m["scan"]["step_ms"],
           "bwd_speedup": m["torch"]["bwd_ms"] / m["scan"]["bwd_ms"],
           "step_speedup": m["torch"]["step_ms"] / m["scan"]["step_ms"],
           "torch_fwd_share": m["torch"]["fwd_ms"] / m["torch"]["step_ms"],
           "scan_fwd_share": m["scan"]["fwd_ms"] / m["scan"]["step_ms"],
           "grad_rel_err": err}
    if chunked:
        row["chunked_bwd_ms"] = m["chunked"]["bwd_ms"]
        row["chunked_bwd_speedup"] = m["torch"]["bwd_ms"] / m["chunked"]["bwd_ms"]
    return row


def gru_row(T: int, inputs: int, batch: int, repeats: int | None, seed: int, *,
            kind: str = "gru", hidden: int | None = None, classes: int = 11) -> dict:
    """One training-step comparison of ``kind`` (``"gru"`` or ``"lstm"``) with torch's module
    (hidden 20 unless ``hidden``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, batch, inputs, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    ref, mine = pair(kind, inputs, classes, seed, **({"hidden": hidden} if hidden else {}))
    err = grad_error(ref, mine, x, y)
    reps = repeats_for(T, batch, repeats)
    m = measure({"torch": ref, "scan": mine}, x, y, reps, f"{kind} T={T} B={batch}")
    extra = {"kind": kind, "hidden": hidden} if hidden else {}
    return {**extra, "T": T, "inputs": inputs, "batch": batch, "repeats": reps,
            "torch_fwd_ms": m["torch"]["fwd_ms"], "torch_bwd_ms": m["torch"]["bwd_ms"],
            "torch_step_ms": m["torch"]["step_ms"], "scan_fwd_ms": m["scan"]["fwd_ms"],
            "scan_bwd_ms": m["scan"]["bwd_ms"], "scan_step_ms": m["scan"]["step_ms"],
            "bwd_speedup": m["torch"]["bwd_ms"] / m["scan"]["bwd_ms"],
            "step_speedup": m["torch"]["step_ms"] / m["scan"]["step_ms"], "grad_rel_err": err}


def jacobi_curves(T: int, batch: int, steps: int, ks: list[int], lr: float, seed: int) -> dict:
    """Training loss against cumulative step time, per backward method (same batches)."""
    methods = {"torch autograd": {"kind": "torch"}, "scan (exact)": {}}
    methods.update({f"jacobi K={k}": {"backward": JacobiBackward(max_iters=k)} for k in ks})
    curves = {}
    for label, kw in methods.items():
        ref, mine = pair("rnn", 1, CLASSES, seed, **{k: v for k, v in kw.items()
                                                     if k != "kind"})
        model = ref if kw.get("kind") == "torch" else mine
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(seed + 1)
        clock, ts, losses = 0.0, [], []
        for _ in range(steps):
            x, y = bitstreams(T, batch, generator=g)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            clock += time.perf_counter() - t0
            ts.append(clock)
            losses.append(float(loss.detach()))
        curves[label] = {"time_s": ts, "loss": losses}
    return curves


def _smooth(xs: list[float], k: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(xs):
        acc += v - (xs[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def plot_sweep(path: Path, rows: list[dict], key: str, xlabel: str, title: str) -> Path:
    """BPPSA Fig. 8 style: times (log-log) and speedups against T or batch."""
    xs = [r[key] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    ax.loglog(xs, [r["torch_bwd_ms"] for r in rows], "o-", label="torch autograd backward")
    ax.loglog(xs, [r["scan_bwd_ms"] for r in rows], "s-", label="scan backward (native)")
    if "chunked_bwd_ms" in rows[0]:
        ax.loglog(xs, [r["chunked_bwd_ms"] for r in rows], "^-",
                  label="scan backward (PyTorch chunked)")
    ax.loglog(xs, [r["torch_step_ms"] for r in rows], "o--", alpha=0.6, label="torch step")
    ax.loglog(xs, [r["scan_step_ms"] for r in rows], "s--", alpha=0.6, label="scan step")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("median time (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.semilogx(xs, [r["bwd_speedup"] for r in rows], "s-", label="backward")
    ax.semilogx(xs, [r["step_speedup"] for r in rows], "o-", label="training step")
    if "chunked_bwd_speedup" in rows[0]:
        ax.semilogx(xs, [r["chunked_bwd_speedup"] for r in rows], "^-",
                    label="backward, PyTorch chunked")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup over torch autograd")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path, dpi=110)


def plot_gru(path: Path, rows: list[dict], *,
             title: str = "GRU at the IRMAS shapes (hidden 20, synthetic features)",
             ylabel: str = "speedup over torch.nn.GRU autograd") -> Path:
    labels = [f"{r['kind']}\nT={r['T']}\nB={r['batch']}" if "kind" in r
              else f"T={r['T']}\nB={r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows)), 3.8))
    idx = range(len(rows))
    ax.bar([i - 0.2 for i in idx], [r["bwd_speedup"] for r in rows], 0.4, label="backward")
    ax.bar([i + 0.2 for i in idx], [r["step_speedup"] for r in rows], 0.4, label="training step")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(idx), labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


def plot_curves(path: Path, curves: dict, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, c in curves.items():
        ax.plot(c["time_s"], _smooth(c["loss"]), label=label)
    ax.set_xlabel("training wall-clock time (s)")
    ax.set_ylabel("training loss (moving average of 10)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


RNN_COLUMNS = ["T", "batch", "repeats", "torch_fwd_ms", "torch_bwd_ms", "torch_step_ms",
               "scan_fwd_ms", "scan_bwd_ms", "scan_step_ms", "bwd_speedup", "step_speedup",
               "chunked_bwd_ms", "chunked_bwd_speedup", "torch_fwd_share", "scan_fwd_share",
               "grad_rel_err"]


GRU_COLUMNS = ["T", "inputs", "batch", "repeats", "torch_fwd_ms", "torch_bwd_ms",
               "torch_step_ms", "scan_fwd_ms", "scan_bwd_ms", "scan_step_ms", "bwd_speedup",
               "step_speedup", "grad_rel_err"]


WIDE_COLUMNS = ["kind", "T", "inputs", "hidden", "batch", "repeats", "torch_fwd_ms",
                "torch_bwd_ms", "torch_step_ms", "scan_fwd_ms", "scan_bwd_ms", "scan_step_ms",
                "bwd_speedup", "step_speedup", "grad_rel_err"]


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None) -> dict:
    out_dir = Path(out_dir)
    t_start = time.perf_counter()
    t_sweep = [10, 100] if quick else T_SWEEP
    b_sweep = [2, 8] if quick else B_SWEEP
    irmas = [(t // 8, i) for t, i in IRMAS[:1]] if quick else IRMAS
    irmas_batch = [8] if quick else IRMAS_BATCH
    jac_T, jac_steps, jac_ks = (50, 5, [3]) if quick else (1000, 150, [3, 10, 30])
    jac_lr = 3e-3
    sections, plots = [], []
    print(f"native scan kernels: {native.status()}; torch threads: {torch.get_num_threads()}")

    rnn_rows = []
    for T in t_sweep:
        rnn_rows.append(rnn_row(T, 16, repeats, seed=T, chunked=True))
    print("\nRNN bitstream classification, batch 16, hidden 20 (BPPSA §4.1): times in ms")
    print(text_table(rnn_rows, RNN_COLUMNS))
    png = plot_sweep(out_dir / "bppsa_rnn_T.png", rnn_rows, "T", "sequence length T",
                     "RNN backward as a scan: sequence length sweep (batch 16, hidden 20)")
    plots.append(png)
    sections.append(("RNN, sequence length sweep (batch 16, hidden 20)",
                     markdown_table(rnn_rows, RNN_COLUMNS) + f"\n\n![]({png.name})"))

    batch_rows = [rnn_row(1000 if not quick else 100, b, repeats, seed=b, chunked=False)
                  for b in b_sweep]
    print(f"\nRNN, batch sweep at T={batch_rows[0]['T']}: times in ms")
    cols = [c for c in RNN_COLUMNS if not c.startswith("chunked")]
    print(text_table(batch_rows, cols))
    png = plot_sweep(out_dir / "bppsa_rnn_batch.png", batch_rows, "batch", "batch size",
                     f"RNN backward as a scan: batch sweep (T={batch_rows[0]['T']})")
    plots.append(png)
    sections.append((f"RNN, batch sweep (T={batch_rows[0]['T']}, hidden 20)",
                     markdown_table(batch_rows, cols) + f"\n\n![]({png.name})"))

    gru_rows = [gru_row(T, i, b, repeats, seed=T + b) for T, i in irmas for b in irmas_batch]
    print("\nGRU at the IRMAS shapes (BPPSA §4.2, synthetic features): times in ms")
    print(text_table(gru_rows, GRU_COLUMNS))
    png = plot_gru(out_dir / "bppsa_gru.png", gru_rows)
    plots.append(png)
    sections.append(("GRU at the IRMAS shapes (hidden 20, synthetic features)",
                     markdown_table(gru_rows, GRU_COLUMNS) + f"\n\n![]({png.name})"))

    T, inputs, hidden, batch = (WIDE[0] // 10, WIDE[1], WIDE[2], 8) if quick else WIDE
    wide_rows = [gru_row(T, inputs, batch, repeats, seed=T + batch + i, kind=kind,
                         hidden=hidden, classes=CLASSES)
                 for i, kind in enumerate(("gru", "lstm"))]
    title = (f"GRU and LSTM, T={T}, hidden {hidden}, batch {batch} "
             f"({inputs} inputs, synthetic features)")
    print(f"\n{title}: times in ms")
    print(text_table(wide_rows, WIDE_COLUMNS))
    png = plot_gru(out_dir / "bppsa_wide.png", wide_rows,
                   title=f"GRU and LSTM (hidden {hidden}, {inputs} inputs)",
                   ylabel="speedup over torch's module, autograd")
    plots.append(png)
    sections.append((title, markdown_table(wide_rows, WIDE_COLUMNS) + f"\n\n![]({png.name})"))

    curves = jacobi_curves(jac_T, 16, jac_steps, jac_ks, jac_lr, seed=7)
    jac_rows = [{"method": k, "steps": len(c["loss"]), "time_s": c["time_s"][-1],
                 "ms_per_step": 1e3 * c["time_s"][-1] / len(c["loss"]),
                 "first_loss": sum(c["loss"][:10]) / len(c["loss"][:10]),
                 "last_loss": sum(c["loss"][-10:]) / len(c["loss"][-10:])}
                for k, c in curves.items()]
    print(f"\nJacobi backward (Song et al. 2021 §5.1): T={jac_T}, batch 16, Adam lr={jac_lr}")
    jcols = ["method", "steps", "time_s", "ms_per_step", "first_loss", "last_loss"]
    print(text_table(jac_rows, jcols))
    png = plot_curves(out_dir / "bppsa_jacobi.png", curves,
                      f"Bitstreams T={jac_T}: loss vs time, Jacobi backward vs exact")
    plots.append(png)
    sections.append((f"Jacobi backward vs exact (T={jac_T}, batch 16, Adam lr={jac_lr}; "
                     "mean of the first / last 10 step losses)",
                     markdown_table(jac_rows, jcols) + f"\n\n![]({png.name})"))

    took = time.perf_counter() - t_start
    note = (f"Medians of interleaved rounds (torch, scan[, chunked]) after one warm-up round; "
            f"rounds per configuration in the `repeats` column (fewer at large T * batch). "
            f"Forward includes forming the Jacobian factors; backward is `loss.backward()`; "
            f"step adds zero_grad and Adam. Native kernels: {native.status()}. "
            f"Suite time {took:.0f} s.")
    sections.insert(0, ("Method", note))
    print("\n" + note)
    payload = {"suite": "bppsa", "machine": machine_info(), "quick": quick,
               "repeats": repeats, "native": native.status(), "rnn_T": rnn_rows,
               "rnn_batch": batch_rows, "gru": gru_rows, "wide": wide_rows, "jacobi": {
                   "T": jac_T, "lr": jac_lr, "rows": jac_rows, "curves": curves},
               "plots": [p.name for p in plots], "seconds": took}
    goal = targets(payload)
    payload["targets"] = goal
    if goal:
        print("\nIssue targets (2-core CPU):")
        print(text_table(goal, ["target", "measured", "met"]))
        sections.insert(1, ("Targets", markdown_table(goal, ["target", "measured", "met"])))
    cmd = "paraprop bench bppsa" + (" --quick" if quick else "") + (
        f" --repeats {repeats}" if repeats else "")
    write_results(out_dir, "bppsa", payload, sections, cmd)
    return payload


def targets(payload: dict) -> list[dict]:
    """The issue's targets against the measured figures (for docs and the demo)."""
    rows = []
    r1000 = next((r for r in payload["rnn_T"] if r["T"] == 1000), None)
    if r1000:
        rows.append({"target": "RNN T=1000 backward >= 5x", "measured": r1000["bwd_speedup"],
                     "met": r1000["bwd_speedup"] >= 5})
        rows.append({"target": "RNN T=1000 step >= 1.8x", "measured": r1000["step_speedup"],
                     "met": r1000["step_speedup"] >= 1.8})
    g = [r for r in payload["gru"] if r["T"] == 1034]
    if g:
        worst = min(r["bwd_speedup"] for r in g)
        rows.append({"target": "GRU T=1034 backward >= 3x", "measured": worst,
                     "met": worst >= 3})
    for r in payload.get("wide", []):
        if (r["T"], r["inputs"], r["hidden"], r["batch"]) != WIDE:
            continue
        name = f"{r['kind'].upper()} T=1000 H=64 B=32"
        rows.append({"target": f"{name} step >= 5x", "measured": r["step_speedup"],
                     "met": r["step_speedup"] >= 5})
        rows.append({"target": f"{name} gradients within 1e-5", "measured": r["grad_rel_err"],
                     "met": r["grad_rel_err"] <= 1e-5})
    return [r for r in rows if not math.isnan(r["measured"])]

