"""Demo part: optimizer fusion on the digits: the same training, bit for bit, step shares timed.

A small convolutional network is trained on the 8x8 digits with Adam five ways, in turns of four
steps each (so all see the same machine load): the plain optimizer, forward- and backward-fusion,
each also with its updates on a background thread (``overlap=True``; forward+overlap waits for
its thread at the end of each turn). After training,
parameters and optimizer state are compared bit for bit with the plain run, and the median
forward / backward / optimizer time per step is reported (a fused update is timed inside the
forward or backward pass that carries it).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from paraprop.data import load_digits
from paraprop.optim import fuse
from paraprop_lab.experiments.explain import num
from paraprop_lab.experiments.harness import median
from paraprop_lab.experiments.report import markdown_table, text_table

ORDER = 60
TITLE = "Optimizer fusion: the optimizer step inside forward or backward, the same model"
SECONDS = {"quick": 2, "default": 4, "full": 4}

MODES = ("unfused", "forward", "forward+overlap", "backward", "backward+overlap")
COLUMNS = ["mode", "steps", "final_loss", "test_acc", "bitwise_equal", "forward_ms",
           "backward_ms", "optimizer_ms", "step_ms", "opt_share", "speedup"]


def digits_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4, 128), nn.ReLU(), nn.Linear(128, 10))


def _same(a: nn.Module, b: nn.Module, sa: dict, sb: dict) -> bool:
    same = all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values(), strict=True))
    for i, st in sa["state"].items():
        same &= all(torch.equal(v, sb["state"][i][k]) for k, v in st.items())
    return bool(same)


def run(out_dir: Path, *, quick: bool = False) -> dict:
    steps, batch = (16, 32) if quick else (120, 32)
    images, labels = load_digits()
    x, y = images.unsqueeze(1), labels
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    g = torch.Generator().manual_seed(0)
    order = torch.randint(0, len(x_train), (steps, batch), generator=g)

    runs = {}
    for mode in MODES:
        model = digits_cnn()
        opt = torch.optim.Adam(model.parameters(), lr=2e-3)
        if mode != "unfused":
            opt = fuse(opt, model, mode=mode.split("+")[0], overlap="overlap" in mode)
        runs[mode] = {"model": model, "opt": opt, "phases": [], "loss": None}

    block = 4
    for start in range(0, steps, block):  # blocks of steps in turn: A B C D E, A B C D E, ...
        for mode, r in runs.items():
            for s in range(start, min(start + block, steps)):
                idx = order[s]
                t0 = time.perf_counter()
                loss = F.cross_entropy(r["model"](x_train[idx]), y_train[idx])
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                r["opt"].step()
                r["opt"].zero_grad()
                if mode == "forward+overlap" and s == min(start + block, steps) - 1:
                    r["opt"].flush()  # its thread must not run on into the next mode's block
                t3 = time.perf_counter()
                r["phases"].append((t1 - t0, t2 - t1, t3 - t2))
                r["loss"] = float(loss.detach())

    rows = []
    ref = runs["unfused"]
    ref_state = ref["opt"].state_dict()
    warm = max(1, steps // 10)
    for mode, r in runs.items():
        state = r["opt"].state_dict()  # applies a pending forward-mode update first
        model = r["model"].eval()
        with torch.no_grad():
            acc = float((model(x_test).argmax(1) == y_test).float().mean())
        fwd, bwd, opt_t = (median([p[i] for p in r["phases"][warm:]]) * 1e3 for i in range(3))
        step_ms = median([sum(p) for p in r["phases"][warm:]]) * 1e3
        row = {"mode": mode, "steps": steps, "final_loss": r["loss"], "test_acc": acc,
               "bitwise_equal": _same(ref["model"], model, ref_state, state),
               "forward_ms": fwd, "backward_ms": bwd, "optimizer_ms": opt_t, "step_ms": step_ms,
               "opt_share": opt_t / (fwd + bwd + opt_t),
               "speedup": rows[0]["step_ms"] / step_ms if rows else 1.0}
        rows.append(row)
        if mode != "unfused":
            r["opt"].unfuse()

    title = (f"Adam on the digits (small CNN, batch {batch}, {steps} steps): plain vs fused, "
             "trained in turns")
    print(title)
    print(text_table(rows, COLUMNS))
    why, headline = explain(rows)
    print(why)
    note = ("`bitwise_equal`: parameters, buffers and Adam state equal bit for bit to the plain "
            "run. Times are medians per step on this machine; a fused update is counted in the "
            "forward (forward mode) or backward (backward modes) column, `optimizer_ms` is what "
            "`step()` + `zero_grad()` still cost and `opt_share` its share of the step.")
    md = markdown_table(rows, COLUMNS) + "\n\n" + note + "\n\n" + why
    return {"rows": rows, "sections": [(title, md)], "why": why, "headline": headline,
            "plots": []}


def explain(rows: list[dict]) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows: the optimizer's
    share of a plain step bounds what fusion can save; what the fastest fused mode saved in
    ``step()`` against what its forward and backward gained."""
    plain = rows[0]
    fused = max(rows[1:], key=lambda r: r["speedup"])
    bound = plain["optimizer_ms"]
    saved = plain["optimizer_ms"] - fused["optimizer_ms"]
    grew = (fused["forward_ms"] + fused["backward_ms"]) - (plain["forward_ms"]
                                                           + plain["backward_ms"])
    same = all(r["bitwise_equal"] for r in rows)
    change = f"grew by {num(grew)}" if grew >= 0 else f"shrank by {num(-grew)}"
    share = (f"Adam's step is {plain['opt_share']:.0%} of a plain training step here "
             f"({num(bound)} of {num(plain['step_ms'])} ms), the most fusion can save; "
             f"{fused['mode']} moved {num(saved)} ms out of step() and its forward + backward "
             f"{change} ms")
    if fused["speedup"] > 1:
        why = f"On this machine, fused {fused['mode']} wins ({fused['speedup']:.2f}x): {share}"
    else:
        why = (f"On this machine, the plain optimizer wins (the fastest fused mode, "
               f"{fused['mode']}, runs at {fused['speedup']:.2f}x): {share}")
    why += ", with bit for bit the same training." if same else \
        "; the fused training is NOT bit for bit the same."
    if fused["speedup"] <= 1.02:
        why += (" Fusion pays where the optimizer's step is a large share of a training step: "
                "many parameter tensors at a small batch, as in the MLP rows of `paraprop bench "
                "fusion`, or with overlap where a core is idle.")
    headline = (f"optimizer {plain['opt_share']:.0%} of a step; {fused['mode']} fused "
                f"{fused['speedup']:.2f}x, " + ("bitwise equal" if same else "NOT bitwise equal"))
    return why, headline
