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
from paraprop.nn import JacobiBackward, ScanBackward
from paraprop.scan import native
from paraprop_lab.experiments import rows_recurrent as _rows
from paraprop_lab.experiments.bppsa import CLASSES, Stepper, pair
from paraprop_lab.experiments.harness import interleaved, machine_info, matmul_rate, median
from paraprop_lab.experiments.plots import plt, save_figure
from paraprop_lab.experiments.report import markdown_table, text_table, write_results
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows

DESCRIPTION = ("BPPSA: RNN/GRU/LSTM backward as a scan vs torch autograd (T, batch, GRU, "
               "GRU/LSTM hidden 64, Jacobi)")

# the headline rows on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("bppsa.rnn", _rows.bppsa_rows("rnn"), 10),
               RowSpec("bppsa.gru", _rows.bppsa_rows("gru"), 8),
               RowSpec("bppsa.lstm", _rows.bppsa_rows("lstm"), 8),
               RowSpec("bppsa.forward_choice", _rows.rnn_forward_choice, 25)]


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


def three_models(kind: str, inputs: int, classes: int, seed: int, **size) -> dict:
    """torch's classifier (``"torch"``) and ours with torch's forward kernel (``"scan"``) and
    with ``forward="native"`` (``"native"``), identical weights."""
    ref, mine = pair(kind, inputs, classes, seed, **size)
    return {"torch": ref, "scan": mine,
            "native": pair(kind, inputs, classes, seed, forward="native", **size)[1]}


def rnn_row(T: int, batch: int, repeats: int | None, seed: int, chunked: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    x, y = bitstreams(T, batch, generator=g)
    models = three_models("rnn", 1, CLASSES, seed)
    ref, mine, fast = models.values()
    if chunked:
        models["chunked"] = pair("rnn", 1, CLASSES, seed,
                                 backward=ScanBackward(method="chunked"))[1]
    err = max(grad_error(ref, mine, x, y), grad_error(ref, fast, x, y))
    reps = repeats_for(T, batch, repeats)
    m = measure(models, x, y, reps, f"rnn T={T} B={batch}")
    row = {"T": T, "batch": batch, "repeats": reps,
           "torch_fwd_ms": m["torch"]["fwd_ms"], "torch_bwd_ms": m["torch"]["bwd_ms"],
           "torch_step_ms": m["torch"]["step_ms"],
           "scan_fwd_ms": m["scan"]["fwd_ms"], "scan_bwd_ms": m["scan"]["bwd_ms"],
           "scan_step_ms": m["scan"]["step_ms"],
           "bwd_speedup": m["torch"]["bwd_ms"] / m["scan"]["bwd_ms"],
           "step_speedup": m["torch"]["step_ms"] / m["scan"]["step_ms"],
           **native_columns(m),
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
    models = three_models(kind, inputs, classes, seed, **({"hidden": hidden} if hidden else {}))
    ref, mine, fast = models.values()
    err = max(grad_error(ref, mine, x, y), grad_error(ref, fast, x, y))
    reps = repeats_for(T, batch, repeats)
    m = measure(models, x, y, reps, f"{kind} T={T} B={batch}")
    extra = {"kind": kind, "hidden": hidden} if hidden else {}
    return {**extra, "T": T, "inputs": inputs, "batch": batch, "repeats": reps,
            "torch_fwd_ms": m["torch"]["fwd_ms"], "torch_bwd_ms": m["torch"]["bwd_ms"],
            "torch_step_ms": m["torch"]["step_ms"], "scan_fwd_ms": m["scan"]["fwd_ms"],
            "scan_bwd_ms": m["scan"]["bwd_ms"], "scan_step_ms": m["scan"]["step_ms"],
            "bwd_speedup": m["torch"]["bwd_ms"] / m["scan"]["bwd_ms"],
            "step_speedup": m["torch"]["step_ms"] / m["scan"]["step_ms"], **native_columns(m),
            "grad_rel_err": err}


def native_columns(m: dict) -> dict:
    """The ``forward="native"`` model's times and its step speedup over torch's."""
    return {"native_fwd_ms": m["native"]["fwd_ms"], "native_bwd_ms": m["native"]["bwd_ms"],
            "native_step_ms": m["native"]["step_ms"],
            "native_step_speedup": m["torch"]["step_ms"] / m["native"]["step_ms"]}


def step_macs(kind: str, T: int, batch: int, inputs: int, hidden: int) -> int:
    """Multiply-adds of one training step of a one-layer ``kind``: the input and the hidden
    products of the forward, then the hidden products again, ``dW_ih`` and ``dW_hh`` in the
    backward (the inputs are data: no input gradient), the classifier head left out. What any
    implementation must compute."""
    G = {"rnn": 1, "gru": 3, "lstm": 4}[kind] * hidden
    return T * batch * G * (2 * inputs + 3 * hidden)


def peer_row(kind: str, T: int, inputs: int, hidden: int, batch: int, repeats: int,
             seed: int) -> dict:
    """One layer's forward (no graph) and forward + backward (``loss = sum(out * G)``, the
    gradients of every weight) by torch's module with autograd, by ``paraprop.nn`` with
    ``forward="native"`` and the scan backward, and by the jitted JAX ``lax.scan`` peer
    (:mod:`paraprop_lab.experiments.jax_peers`), interleaved; ``jax_*`` are NaN without JAX."""
    from paraprop_lab.experiments import jax_peers
    from paraprop_lab.experiments.bppsa import MODULES

    torch.manual_seed(seed)
    theirs, ours = MODULES[kind]
    ref = theirs(inputs, hidden)
    mine = ours(inputs, hidden, forward="native")
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(T, batch, inputs)
    G = torch.randn(T, batch, hidden)

    def forward(m):
        def run():
            with torch.no_grad():
                m(x)
        return run

    def train(m):
        def run():
            m.zero_grad(set_to_none=True)
            (m(x)[0] * G).sum().backward()
        return run

    fwd = {"torch": forward(ref), "native": forward(mine)}
    trn = {"torch": train(ref), "native": train(mine)}
    if jax_peers.available():
        peer = jax_peers.peer(ref)
        fwd["jax"] = peer.runner(x)
        trn["jax"] = peer.runner(x, train=True, weights_out=G)
    tf = interleaved(fwd, repeats=repeats, warmup=1, desc=f"{kind} forward")
    tt = interleaved(trn, repeats=repeats, warmup=1, desc=f"{kind} forward+backward")
    ms = {k: 1e3 * median(v) for k, v in tf.items()}
    mt = {k: 1e3 * median(v) for k, v in tt.items()}
    nan = float("nan")
    row = {"kind": kind, "T": T, "inputs": inputs, "hidden": hidden, "batch": batch,
           "torch_fwd_ms": ms["torch"], "native_fwd_ms": ms["native"],
           "jax_fwd_ms": ms.get("jax", nan), "torch_train_ms": mt["torch"],
           "native_train_ms": mt["native"], "jax_train_ms": mt.get("jax", nan)}
    row["native_vs_torch_train"] = row["torch_train_ms"] / row["native_train_ms"]
    row["native_vs_jax_fwd"] = row["jax_fwd_ms"] / row["native_fwd_ms"]
    row["native_vs_jax_train"] = row["jax_train_ms"] / row["native_train_ms"]
    return row


def long_forward_row(T: int, hidden: int, batch: int, repeats: int, seed: int) -> dict:
    """A long GRU's forward (no graph, input 1): torch's kernel, ``forward="native"``,
    ``forward="newton"`` (DEER, default tolerance) and the JAX ``lax.scan`` peer, interleaved;
    what ``forward="auto"`` chooses between."""
    from paraprop.nn import GRU
    from paraprop_lab.experiments import jax_peers

    torch.manual_seed(seed)
    ref = nn.GRU(1, hidden)
    x = torch.randn(T, batch, 1)
    mods = {"torch": ref}
    for name in ("native", "newton"):
        mods[name] = GRU(1, hidden, forward=name)
        mods[name].load_state_dict(ref.state_dict())
    outs: dict = {}

    def forward(name, m):
        def run():
            with torch.no_grad():
                outs[name] = m(x)[0]
        return run

    cases = {k: forward(k, m) for k, m in mods.items()}
    if jax_peers.available():
        cases["jax"] = jax_peers.peer(ref).runner(x)
    t = interleaved(cases, repeats=repeats, warmup=1, desc=f"gru forward T={T}")
    ms = {k: 1e3 * median(v) for k, v in t.items()}
    nan = float("nan")
    return {"kind": "gru", "T": T, "hidden": hidden, "batch": batch, "repeats": repeats,
            "torch_ms": ms["torch"], "native_ms": ms["native"], "newton_ms": ms["newton"],
            "jax_ms": ms.get("jax", nan), "native_vs_jax": ms.get("jax", nan) / ms["native"],
            "native_vs_newton": ms["newton"] / ms["native"],
            "native_vs_torch": ms["torch"] / ms["native"],
            "native_err": float((outs["native"] - outs["torch"]).abs().max()),
            "newton_err": float((outs["newton"] - outs["torch"]).abs().max())}


def limit_row(row: dict, kind: str, hidden: int, rate: float) -> dict:
    """A training-step row against its physical limit: the step's multiply-adds
    (:func:`step_macs`) at the machine's measured matrix-product ``rate``."""
    macs = step_macs(kind, row["T"], row["batch"], row.get("inputs", 1), hidden)
    limit = 1e3 * macs / rate
    return {"kind": kind, "T": row["T"], "batch": row["batch"], "hidden": hidden,
            "gmacs": macs / 1e9, "rate_gmacs_per_s": rate / 1e9, "limit_ms": limit,
            "torch_step_ms": row["torch_step_ms"], "native_step_ms": row["native_step_ms"],
            "torch_over_limit": row["torch_step_ms"] / limit,
            "native_over_limit": row["native_step_ms"] / limit,
            "max_step_speedup": row["torch_step_ms"] / limit}


def load_row(T: int, batch: int, repeats: int, seed: int) -> dict:
    """The RNN's training step (torch autograd, the scan backward behind torch's forward, and
    ``forward="native"``) measured quietly and then while a second process keeps one core
    busy (:func:`paraprop_lab.experiments.harness.busy_core`, started and stopped here)."""
    from paraprop_lab.experiments.harness import busy_core

    g = torch.Generator().manual_seed(seed)
    x, y = bitstreams(T, batch, generator=g)
    models = three_models("rnn", 1, CLASSES, seed)
    quiet = measure(models, x, y, repeats, f"rnn T={T} quiet")
    with busy_core(seconds=300):
        busy = measure(models, x, y, repeats, f"rnn T={T} one core busy")
    row = {"T": T, "batch": batch, "repeats": repeats, "threads": torch.get_num_threads()}
    for label, m in (("quiet", quiet), ("loaded", busy)):
        row[f"{label}_torch_bwd_ms"] = m["torch"]["bwd_ms"]
        row[f"{label}_scan_bwd_ms"] = m["scan"]["bwd_ms"]
        row[f"{label}_bwd_speedup"] = m["torch"]["bwd_ms"] / m["scan"]["bwd_ms"]
        row[f"{label}_native_step_speedup"] = m["torch"]["step_ms"] / m["native"]["step_ms"]
    return row


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
    fig, (times, speedups) = plt.subplots(1, 2, figsize=(11, 4))
    # (axes, how, column, style, label, alpha); the chunked columns only where rows have them
    lines = [(times.loglog, "torch_bwd_ms", "o-", "torch autograd backward", None),
             (times.loglog, "scan_bwd_ms", "s-", "scan backward (native)", None),
             (times.loglog, "chunked_bwd_ms", "^-", "scan backward (PyTorch chunked)", None),
             (times.loglog, "torch_step_ms", "o--", "torch step", 0.6),
             (times.loglog, "scan_step_ms", "s--", "scan step", 0.6),
             (speedups.semilogx, "bwd_speedup", "s-", "backward", None),
             (speedups.semilogx, "step_speedup", "o-", "training step", None),
             (speedups.semilogx, "chunked_bwd_speedup", "^-", "backward, PyTorch chunked", None)]
    for draw, column, style, label, alpha in lines:
        if not column.startswith("chunked") or column in rows[0]:
            draw(xs, [r[column] for r in rows], style, label=label, alpha=alpha)
    speedups.axhline(1.0, color="grey", lw=0.8)
    for ax, ylabel, fontsize in ((times, "median time (ms)", 7),
                                 (speedups, "speedup over torch autograd", 8)):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=fontsize)
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
               "chunked_bwd_ms", "chunked_bwd_speedup", "native_fwd_ms", "native_bwd_ms",
               "native_step_ms", "native_step_speedup", "torch_fwd_share", "scan_fwd_share",
               "grad_rel_err"]


GRU_COLUMNS = ["T", "inputs", "batch", "repeats", "torch_fwd_ms", "torch_bwd_ms",
               "torch_step_ms", "scan_fwd_ms", "scan_bwd_ms", "scan_step_ms", "bwd_speedup",
               "step_speedup", "native_step_ms", "native_step_speedup", "grad_rel_err"]


WIDE_COLUMNS = ["kind", "T", "inputs", "hidden", "batch", "repeats", "torch_fwd_ms",
                "torch_bwd_ms", "torch_step_ms", "scan_fwd_ms", "scan_bwd_ms", "scan_step_ms",
                "bwd_speedup", "step_speedup", "native_fwd_ms", "native_bwd_ms",
                "native_step_ms", "native_step_speedup", "grad_rel_err"]


PEER_COLUMNS = ["kind", "T", "inputs", "hidden", "batch", "torch_fwd_ms", "native_fwd_ms",
                "jax_fwd_ms", "torch_train_ms", "native_train_ms", "jax_train_ms",
                "native_vs_torch_train", "native_vs_jax_fwd", "native_vs_jax_train"]


LIMIT_COLUMNS = ["kind", "T", "batch", "hidden", "gmacs", "rate_gmacs_per_s", "limit_ms",
                 "torch_step_ms", "native_step_ms", "torch_over_limit", "native_over_limit",
                 "max_step_speedup"]


LONG_COLUMNS = ["kind", "T", "hidden", "batch", "repeats", "torch_ms", "native_ms", "newton_ms",
                "jax_ms", "native_vs_jax", "native_vs_newton", "native_vs_torch", "native_err",
                "newton_err"]


LOAD_COLUMNS = ["T", "batch", "repeats", "threads", "quiet_torch_bwd_ms", "quiet_scan_bwd_ms",
                "quiet_bwd_speedup", "loaded_torch_bwd_ms", "loaded_scan_bwd_ms",
                "loaded_bwd_speedup", "quiet_native_step_speedup", "loaded_native_step_speedup"]


@with_device_rows("bppsa", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
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

    # the physical limit: each step's multiply-adds at the measured matrix-product rate
    limit_rows = []
    r1000 = next((r for r in rnn_rows if r["T"] == (100 if quick else 1000)), rnn_rows[-1])
    for kind, row, hid in (("rnn", r1000, 20), *((r["kind"], r, r["hidden"])
                                                 for r in wide_rows)):
        G = {"rnn": 1, "gru": 3, "lstm": 4}[kind] * hid
        rate = matmul_rate(row["T"] * row["batch"], hid, G)
        limit_rows.append(limit_row(row, kind, hid, rate))
    title = "The physical limit: each training step's multiply-adds at the measured rate"
    print(f"\n{title}")
    print(text_table(limit_rows, LIMIT_COLUMNS))
    sections.append((title, markdown_table(limit_rows, LIMIT_COLUMNS)))

    peer_specs = [("rnn", 1000, 1, 20, 16), ("gru", WIDE[0], WIDE[1], WIDE[2], WIDE[3]),
                  ("lstm", WIDE[0], WIDE[1], WIDE[2], WIDE[3])]
    if quick:
        peer_specs = [(k, T // 10, i, h, min(b, 8)) for k, T, i, h, b in peer_specs]
    peer_rows = [peer_row(k, T, i, h, b, repeats or 5, seed=11 + n)
                 for n, (k, T, i, h, b) in enumerate(peer_specs)]
    title = ("One layer, forward and forward + backward: torch, paraprop (native forward, "
             "scan backward) and JAX lax.scan")
    print(f"\n{title}: times in ms")
    print(text_table(peer_rows, PEER_COLUMNS))
    sections.append((title, markdown_table(peer_rows, PEER_COLUMNS)))

    long_rows = [long_forward_row(1000 if quick else 100000, 8, 16, repeats or 3, seed=13)]
    title = "A long GRU forward (hidden 8, input 1): native loop, Newton (DEER) and JAX"
    print(f"\n{title}: times in ms")
    print(text_table(long_rows, LONG_COLUMNS))
    sections.append((title, markdown_table(long_rows, LONG_COLUMNS)))

    load = [load_row(100 if quick else 1000, 16, repeats or 5, seed=5)]
    title = "RNN under load: a second process keeps one core busy"
    print(f"\n{title}: times in ms")
    print(text_table(load, LOAD_COLUMNS))
    sections.append((title, markdown_table(load, LOAD_COLUMNS)))

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
               "rnn_batch": batch_rows, "gru": gru_rows, "wide": wide_rows,
               "limit": limit_rows, "peers": peer_rows, "long_forward": long_rows,
               "load": load, "jacobi": {
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
    if r1000 and "native_step_speedup" in r1000:
        rows.append({"target": "RNN T=1000 step, forward='native', >= 8x",
                     "measured": r1000["native_step_speedup"],
                     "met": r1000["native_step_speedup"] >= 8})
    for r in payload.get("peers", []):
        if (r["kind"], r["T"], r["batch"], r["hidden"]) == ("rnn", 1000, 16, 20):
            rows.append({"target": "RNN T=1000 forward+backward faster than JAX (ratio >= 1)",
                         "measured": r["native_vs_jax_train"],
                         "met": r["native_vs_jax_train"] >= 1})
    for r in payload.get("wide", []):
        if (r["T"], r["inputs"], r["hidden"], r["batch"]) != WIDE:
            continue
        name = f"{r['kind'].upper()} T=1000 H=64 B=32"
        best = max(r["step_speedup"], r.get("native_step_speedup", 0.0))
        rows.append({"target": f"{name} step >= 5x", "measured": best, "met": best >= 5})
        rows.append({"target": f"{name} gradients within 1e-5", "measured": r["grad_rel_err"],
                     "met": r["grad_rel_err"] <= 1e-5})
    for r in payload.get("long_forward", []):
        if r["T"] == 100000:
            rows.append({"target": "GRU H=8 T=100000 B=16 forward at least as fast as JAX",
                         "measured": r["native_vs_jax"], "met": r["native_vs_jax"] >= 1})
    for r in payload.get("load", []):
        if r["T"] == 1000:
            rows.append({"target": "RNN T=1000 backward under load >= 3x",
                         "measured": r["loaded_bwd_speedup"],
                         "met": r["loaded_bwd_speedup"] >= 3})
    return [r for r in rows if not math.isnan(r["measured"])]

