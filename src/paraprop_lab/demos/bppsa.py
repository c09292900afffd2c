"""Demo part: the backward pass of an RNN at T = 1000 as a scan (BPPSA) vs torch autograd."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from paraprop.data import bitstreams
from paraprop.nn import JacobiBackward, ScanBackward
from paraprop.scan import native
from paraprop_lab.demos._common import speedup_part
from paraprop_lab.experiments.bppsa import CLASSES, pair
from paraprop_lab.experiments.harness import interleaved, median

ORDER = 30
TITLE = "Back-propagation as a scan: an RNN's backward pass at T = 1000 (BPPSA)"
COLUMNS = ["method", "bwd_ms", "speedup", "grad_rel_err", "note"]


def run(out_dir: Path, *, quick: bool = False) -> dict:
    """Time ``loss.backward()`` of one bitstream batch (T=1000, batch 16, hidden 20).

    Methods: torch.nn.RNN autograd (the baseline), :class:`paraprop.nn.RNN` with the native
    scan, with the pure-PyTorch chunked scan, and with Jacobi sweeps (``K = 30``: a truncated
    backward whose error is reported, Song et al. 2021 §5.1). Every method starts from the same
    weights and the same batch; ``grad_rel_err`` is the largest relative difference of any
    parameter gradient from autograd's.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    T, batch = 1000, 16
    g = torch.Generator().manual_seed(0)
    x, y = bitstreams(T, batch, generator=g)
    ref, scan = pair("rnn", 1, CLASSES, seed=0)
    variants = {
        "torch autograd": (ref, "baseline"),
        "scan (native)": (scan, f"native kernels: {native.status()}"),
        "scan (PyTorch chunked)": (pair("rnn", 1, CLASSES, 0,
                                        backward=ScanBackward(algorithm="chunked"))[1],
                                   "no native code"),
        "jacobi K=30": (pair("rnn", 1, CLASSES, 0,
                             backward=JacobiBackward(max_iters=30))[1],
                        "truncated: 30 sweeps"),
    }
    grads, bwd = {}, {k: [] for k in variants}
    for name, (model, _) in variants.items():
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}

    def case(name, model):
        def go():
            model.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            t0 = time.perf_counter()
            loss.backward()
            bwd[name].append(time.perf_counter() - t0)
        return go

    interleaved({k: case(k, m) for k, (m, _) in variants.items()},
                repeats=2 if quick else 7, warmup=1, desc="demo bppsa")
    base = median(bwd["torch autograd"][1:])
    rows = []
    for name, (_, note) in variants.items():
        ms = median(bwd[name][1:])
        err = max(float((grads[name][n] - r).abs().max() / r.abs().max().clamp_min(1e-30))
                  for n, r in grads["torch autograd"].items())
        rows.append({"method": name, "bwd_ms": 1e3 * ms, "speedup": base / ms,
                     "grad_rel_err": err, "note": note})
    title = (f"RNN bitstream classification, T={T}, batch {batch}, hidden 20: backward pass "
             f"(median of {2 if quick else 7} interleaved rounds)")
    return speedup_part(out_dir, "demo_bppsa_backward.png", title, rows, COLUMNS,
                        explain(rows, T, sweeps=30), plot_title=title.split(":")[0],
                        ylabel="speedup of the backward pass over torch autograd (times faster)")


def explain(rows: list[dict], T: int, *, sweeps: int) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows (in the order of
    ``run``'s variants: autograd, native scan, chunked scan, Jacobi with ``sweeps`` sweeps)."""
    autograd, native_scan, chunked, jacobi = rows
    how = {
        autograd["method"]: f"autograd runs the {T} backward steps one after another, a few "
                            "small operator calls each",
        native_scan["method"]: (f"one compiled call runs the same {T} steps, without "
                                f"autograd's {T} rounds of small operator calls"
                                if native.available() else
                                f"native kernels are unavailable ({native.status()}), so it "
                                "ran the PyTorch scan"),
        chunked["method"]: f"it batches the {T} steps into a few large tensor operations",
        jacobi["method"]: f"its {sweeps} sweeps each cover all {T} steps at once",
    }
    winner = max(rows, key=lambda r: r["speedup"])
    if winner is autograd:
        second = max(rows[1:], key=lambda r: r["speedup"])
        why = (f"On this machine, torch autograd wins: {how[autograd['method']]}, and the best "
               f"alternative, {second['method']}, runs at {second['speedup']:.2f}x")
    else:
        why = (f"On this machine, {winner['method']} wins ({winner['speedup']:.2f}x torch "
               f"autograd): {how[winner['method']]}")
    if winner is not jacobi:
        why += (f"; Jacobi's {sweeps} sweeps over all {T} steps ({sweeps}x the arithmetic of "
                f"one backward pass) run at {jacobi['speedup']:.2f}x")
    headline = f"{winner['method']}: backward {winner['speedup']:.2f}x torch autograd at T={T}"
    return why + ".", headline
