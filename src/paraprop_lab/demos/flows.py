"""Demo part: a zuko normalizing flow's own ``sample`` call, as zuko ships it and inside
:func:`paraprop.flows.accelerate`, with bitwise the same samples.

A masked autoregressive flow (MAF) samples feature by feature: zuko's inverse runs its MADE once
per feature and transform (784 x 3 = 2352 network passes for MNIST-sized samples). Under
``accelerate`` the same call solves each inverse by Jacobi sweeps with ``tol=0``, which ends
bitwise at the sequential result, here after a few dozen passes. The flows have the libraries'
random initial weights (no training; a trained flow needs more passes: ``paraprop bench
flows``, ``docs/sampling.md``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from paraprop_lab.experiments.explain import fewer_passes, pass_cost
from paraprop_lab.experiments.harness import interleaved, median
from paraprop_lab.experiments.plots import time_bars
from paraprop_lab.experiments.report import markdown_table, text_table

ORDER = 5
REQUIRES = ("zuko",)
TITLE = "Normalizing flows: zuko's own sample() call, bitwise the same samples, far fewer passes"
SECONDS = {"quick": 2, "default": 11, "full": 40}
COLUMNS = ["method", "D", "N", "library_passes", "paraprop_passes", "library_ms",
           "accelerated_ms", "speedup", "bitwise_equal"]
LAYERS = 3


def _zuko(d: int):
    import zuko

    return zuko.flows.MAF(d, transforms=LAYERS)


def _nflows(d: int):
    from nflows.flows import MaskedAutoregressiveFlow

    return MaskedAutoregressiveFlow(d, 64, num_layers=LAYERS, num_blocks_per_layer=2).eval()


def flow_row(label: str, build, call, d: int, n: int, *, repeats: int) -> dict:
    """Time ``call(flow, n)`` as the library ships it and under ``accelerate`` (same seed,
    interleaved, after one untimed round of each); the samples of the last round are compared
    bit for bit."""
    from paraprop.flows import accelerate

    torch.manual_seed(0)
    flow = build(d)
    last: dict = {}

    def library():
        torch.manual_seed(1)
        last["library"] = call(flow, n)

    def accelerated():
        with accelerate(flow) as handle:
            torch.manual_seed(1)
            last["accelerated"] = call(flow, n)
        last["handle"] = handle

    with torch.no_grad():
        times = interleaved({"library": library, "accelerated": accelerated}, repeats=repeats,
                            warmup=1, desc=f"demo flows, {label}")
    want, got, handle = last["library"], last["accelerated"], last["handle"]
    lib, acc = median(times["library"]), median(times["accelerated"])
    return {"method": label, "D": d, "N": n, "library_passes": handle.library_passes,
            "paraprop_passes": handle.passes, "library_ms": 1e3 * lib,
            "accelerated_ms": 1e3 * acc, "speedup": lib / acc,
            "bitwise_equal": bool(torch.equal(want, got))}


def run(out_dir: Path, *, quick: bool = False, full: bool = False) -> dict:
    """zuko's ``MAF(784, transforms=3)``: ``flow().sample((100,))`` (``--quick``: 16 features,
    10 samples); ``--full`` adds nflows' ``MaskedAutoregressiveFlow`` and more rounds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    d, n = (16, 10) if quick else (784, 100)
    repeats = 1 if quick else 3 if full else 2
    rows = [flow_row(f"zuko MAF({d}, transforms={LAYERS})", _zuko,
                     lambda f, k: f().sample((k,)), d, n, repeats=repeats)]
    if full:
        import importlib.util

        if importlib.util.find_spec("nflows") is not None:
            rows.append(flow_row(f"nflows MAF({d}, {LAYERS} layers)", _nflows,
                                 lambda f, k: f.sample(k), d, n, repeats=repeats))
    title = (f"{n} samples of {d} features, random initial weights, the library's own call vs "
             f"the same call under paraprop.flows.accelerate(flow) (tol=0; median of {repeats})")
    why, headline = explain(rows)
    print(title)
    print(text_table(rows, COLUMNS))
    print(why)
    plot = time_bars(
        out_dir / "demo_flows.png",
        f"Sampling {n} points of a masked autoregressive flow ({d} features, {LAYERS} "
        "transforms): the library's sample() call, as shipped and under accelerate",
        [(r["method"], [("as shipped", r["library_ms"], f"{r['library_passes']} passes"),
                        ("accelerate(flow)", r["accelerated_ms"],
                         f"{r['paraprop_passes']} passes, {r['speedup']:.1f}x, "
                         + ("bitwise equal" if r["bitwise_equal"] else "NOT equal"))])
         for r in rows])
    md = markdown_table(rows, COLUMNS) + "\n\n" + why + f"\n\n![]({plot.name})"
    return {"rows": rows, "sections": [(title, md)], "why": why, "headline": headline,
            "plots": [plot]}


def explain(rows: list[dict]) -> tuple[str, str]:
    """The closing sentence and the headline, from the first row (zuko): the passes of the
    accelerated call against the library's one pass per feature and transform."""
    r = rows[0]
    lib = r["method"].split(" ")[0]
    why = fewer_passes(
        "accelerate(flow)", f"{lib}'s own sample()", speedup=r["speedup"],
        passes=r["paraprop_passes"], steps=r["library_passes"],
        cost=pass_cost(r["accelerated_ms"], r["paraprop_passes"], r["library_ms"],
                       r["library_passes"]),
        step_word="library pass", detail=f" (a MADE over all {r['D']} features)")
    same = "bitwise the same samples" if r["bitwise_equal"] else "NOT the same samples"
    why = why[:-1] + f", with {same}."
    headline = (f"{lib} MAF sample(): {r['speedup']:.1f}x, {r['paraprop_passes']} passes instead "
                f"of {r['library_passes']}, {same}")
    return why, headline
