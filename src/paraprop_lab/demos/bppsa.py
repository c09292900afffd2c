"""Demo part: training an RNN at T = 1000, with back-propagation as a scan (BPPSA) and the
native forward, against torch.nn.RNN and autograd."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from paraprop.data import bitstreams
from paraprop.nn import JacobiBackward, ScanBackward
from paraprop.scan import native
from paraprop_lab.demos._common import speedup_part
from paraprop_lab.experiments.bppsa import CLASSES, Stepper, pair
from paraprop_lab.experiments.harness import interleaved, median

ORDER = 15
TITLE = "Training an RNN at T = 1000: the backward pass as a scan (BPPSA), the forward native"
SECONDS = {"quick": 2, "default": 5, "full": 30}
COLUMNS = ["method", "fwd_ms", "bwd_ms", "step_ms", "speedup", "bwd_speedup", "grad_rel_err",
           "note"]


def run(out_dir: Path, *, quick: bool = False, full: bool = False) -> dict:
    """Time training steps (forward, ``loss.backward()``, Adam) of one bitstream batch (T=1000,
    batch 16, hidden 20; ``--quick``: T=100).

    Methods: torch.nn.RNN with autograd (the baseline); :class:`paraprop.nn.RNN` with
    ``forward="native"`` (one compiled call for the forward states, the scan backward); with
    torch's own forward kernel and the native scan backward; with the pure-PyTorch chunked scan
    backward; and with Jacobi sweeps (``K = 30``: a truncated backward whose error is reported,
    Song et al. 2021 §5.1). Every method starts from the same weights and the same batch;
    ``grad_rel_err`` is the largest relative difference of any parameter gradient from
    autograd's (before any step).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    T, batch = (100 if quick else 1000), 16
    g = torch.Generator().manual_seed(0)
    x, y = bitstreams(T, batch, generator=g)
    kn = f"native kernels: {native.status()}"
    variants = {
        "torch.nn.RNN + autograd": (pair("rnn", 1, CLASSES, 0)[0], "baseline"),
        "paraprop.nn.RNN, native forward + scan": (
            pair("rnn", 1, CLASSES, 0, forward="native")[1], kn),
        "scan backward (native)": (pair("rnn", 1, CLASSES, 0)[1],
                                   "torch's forward kernel; " + kn),
        "scan backward (PyTorch chunked)": (
            pair("rnn", 1, CLASSES, 0, backward=ScanBackward(method="chunked"))[1],
            "torch's forward kernel; no native code"),
        "jacobi backward K=30": (
            pair("rnn", 1, CLASSES, 0, backward=JacobiBackward(max_iters=30))[1],
            "truncated: 30 sweeps"),
    }
    grads = {}
    for name, (model, _) in variants.items():
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
    steps = {k: Stepper(m, x, y) for k, (m, _) in variants.items()}
    repeats = 1 if quick else 5 if full else 3
    times = interleaved(steps, repeats=repeats, warmup=1, desc="demo rnn training")
    base = steps["torch.nn.RNN + autograd"]
    b_bwd = median(base.bwd[1:])
    b_step = median(times["torch.nn.RNN + autograd"])
    rows = []
    ref = grads["torch.nn.RNN + autograd"]
    for name, (_, note) in variants.items():
        s = steps[name]
        fwd, bwd, step = median(s.fwd[1:]), median(s.bwd[1:]), median(times[name])
        err = max(float((grads[name][n] - r).abs().max() / r.abs().max().clamp_min(1e-30))
                  for n, r in ref.items())
        rows.append({"method": name, "fwd_ms": 1e3 * fwd, "bwd_ms": 1e3 * bwd,
                     "step_ms": 1e3 * step, "speedup": b_step / step, "bwd_speedup": b_bwd / bwd,
                     "grad_rel_err": err, "note": note})
    title = (f"RNN bitstream classification, T={T}, batch {batch}, hidden 20: one Adam "
             f"training step (median of {repeats} interleaved rounds; speedup of the step, "
             "bwd_speedup of the backward pass alone)")
    return speedup_part(out_dir, "demo_rnn_training.png", title, rows, COLUMNS,
                        explain(rows, T, sweeps=30), plot_title=title.split(":")[0],
                        ylabel="speedup of a training step over torch.nn.RNN + autograd "
                               "(times faster)")


def explain(rows: list[dict], T: int, *, sweeps: int) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows (in the order of
    ``run``'s variants: torch, native forward + scan, scan backward native, chunked, Jacobi with
    ``sweeps`` sweeps)."""
    torch_row, nat, scan_nat, chunked, jacobi = rows
    how = {
        torch_row["method"]: f"autograd runs the {T} backward steps one after another, a few "
                             "small operator calls each",
        nat["method"]: (f"one compiled call computes the {T} forward states and one the "
                        f"backward scan, without {T} rounds of small operator calls each way"
                        if native.available() else
                        f"native kernels are unavailable ({native.status()}), so it ran the "
                        "PyTorch paths"),
        scan_nat["method"]: f"its backward runs the {T} steps in one compiled call",
        chunked["method"]: f"its backward batches the {T} steps into a few large tensor "
                           "operations",
        jacobi["method"]: f"its {sweeps} sweeps each cover all {T} steps at once",
    }
    winner = max(rows, key=lambda r: r["speedup"])
    if winner is torch_row:
        second = max(rows[1:], key=lambda r: r["speedup"])
        why = (f"On this machine, torch.nn.RNN wins: {how[torch_row['method']]}, and the best "
               f"alternative, {second['method']}, runs at {second['speedup']:.2f}x")
        why += (". It wins where the scan's one call replaces more sequential work: longer "
                "sequences (the backward at T=30000 in `paraprop bench bppsa`) or a GPU")
    else:
        why = (f"On this machine, {winner['method']} wins ({winner['speedup']:.2f}x the training "
               f"step of torch.nn.RNN + autograd): {how[winner['method']]}")
    best_bwd = max(rows[1:], key=lambda r: r["bwd_speedup"])
    why += (f"; the backward pass alone is {best_bwd['bwd_speedup']:.2f}x autograd's with "
            f"{best_bwd['method']}")
    if winner is not jacobi:
        why += (f", and Jacobi's {sweeps} sweeps over all {T} steps ({sweeps}x the arithmetic "
                f"of one backward pass) run at {jacobi['bwd_speedup']:.2f}x")
    headline = (f"{winner['method']}: training step {winner['speedup']:.2f}x torch at T={T}; "
                f"backward {best_bwd['bwd_speedup']:.2f}x autograd")
    return why + ".", headline
