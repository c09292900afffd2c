"""Demo part: a GRU's forward pass over a long sequence by Newton's method (DEER) vs torch."""

from __future__ import annotations

from pathlib import Path

import torch

from paraprop.nn import GRU
from paraprop_lab.demos._common import speedup_part
from paraprop_lab.experiments.explain import fewer_passes, pass_cost
from paraprop_lab.experiments.harness import interleaved, median

ORDER = 30
TITLE = "Recurrences by Newton's method: a GRU forward pass at T = 30000 (DEER, quasi-DEER)"
SECONDS = {"quick": 3, "default": 14, "full": 20}
COLUMNS = ["method", "fwd_ms", "speedup", "iterations", "max_abs_err"]
NEWTON = ("newton", "quasi_newton")


def run(out_dir: Path, *, quick: bool = False, full: bool = False) -> dict:
    """Time the forward pass of a GRU (input 1, hidden 8, batch 16; DEER's setup) over
    ``T = 30000`` steps (3000 with ``quick``): torch.nn.GRU's fused sequential kernel against
    :class:`paraprop.nn.GRU` with ``forward="newton"`` and ``"quasi_newton"``, and with
    ``forward="native"`` (the sequential loop in one compiled call), same weights, interleaved
    rounds. ``iterations`` is what each method needed to reach the modules' default tolerance
    (an error estimate of ``paraprop.nn.FORWARD_TOL[torch.float32]``); ``max_abs_err`` is the
    largest difference from torch's states.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    T, batch, hidden = (3000 if quick else 30000), 16, 8
    torch.manual_seed(0)
    ref = torch.nn.GRU(1, hidden)
    x = torch.randn(T, batch, 1)
    variants = {"torch.nn.GRU": ref}
    for method in (*NEWTON, "native"):
        m = GRU(1, hidden, forward=method)
        m.load_state_dict(ref.state_dict())
        variants[method] = m
    outs, iters = {}, {}

    def case(name, model):
        def go():
            with torch.no_grad():
                out, _ = model(x)
            outs[name] = out
            sols = getattr(model, "last_forward", ())       # () for torch's own modules
            iters[name] = sols[0].iterations if sols else T
        return go

    repeats = 1 if quick else 3
    times = interleaved({k: case(k, m) for k, m in variants.items()}, repeats=repeats,
                        warmup=1, desc="demo newton")
    base = median(times["torch.nn.GRU"])
    rows = []
    for name in variants:
        ms = median(times[name])
        rows.append({"method": name, "fwd_ms": 1e3 * ms, "speedup": base / ms,
                     "iterations": iters[name],
                     "max_abs_err": float((outs[name] - outs["torch.nn.GRU"]).abs().max())})
    title = (f"GRU forward, T={T}, batch {batch}, hidden {hidden}, input 1 "
             f"(median of {repeats} interleaved rounds; torch: {T} dependent steps)")
    return speedup_part(out_dir, "demo_newton_forward.png", title, rows, COLUMNS,
                        explain(rows, T), plot_title=title.split(" (")[0],
                        ylabel="speedup of the forward pass over torch.nn.GRU (times faster)")


def explain(rows: list[dict], T: int) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows: Newton
    iterations (each over all ``T`` steps at once) against torch's ``T`` dependent steps, the
    native loop beside them, and where Newton wins when it loses here."""
    base = rows[0]
    winner = max(rows, key=lambda r: r["speedup"])
    newton = [r for r in rows if r["method"] in NEWTON]
    m = max(newton, key=lambda r: r["speedup"])
    why = fewer_passes(
        m["method"], "torch.nn.GRU", speedup=m["speedup"], passes=m["iterations"], steps=T,
        cost=pass_cost(m["fwd_ms"], m["iterations"], base["fwd_ms"], T),
        pass_word="iteration", step_word="GRU step",
        detail=f" (the cell and its Jacobians at all {T} steps, then a linear recurrence)",
        winner=winner["method"], winner_speedup=winner["speedup"])
    native_row = next((r for r in rows if r["method"] == "native"), None)
    if native_row is not None:
        why = why[:-1] + (f"; the native forward, the same {T} sequential steps in one "
                          f"compiled call, runs at {native_row['speedup']:.2f}x.")
    if winner is not m:
        why += (f" Newton wins where one iteration over all {T} steps costs about one step: "
                "on a GPU (`make gpu-check` measures it; docs/gpu.md), not on a 2-core CPU, "
                "where the native loop is the fastest exact forward.")
    headline = (f"{m['method']} {m['iterations']} iterations vs {T} steps, "
                f"{m['speedup']:.2f}x torch.nn.GRU; native loop {native_row['speedup']:.2f}x"
                if native_row is not None else
                f"{m['method']} {m['iterations']} iterations vs {T} steps, "
                f"{m['speedup']:.2f}x torch.nn.GRU")
    return why, headline
