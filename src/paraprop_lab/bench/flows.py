"""``paraprop bench flows``: the flow libraries' own sampling, with and without
:func:`paraprop.flows.accelerate` (issue 18's target: 20x for a MAF of 784 features, 100 points).

Every row calls the library's own API twice on the same flow with the same seed: as the library
ships it, and inside ``with paraprop.flows.accelerate(flow)`` (``tol=0``; the patch and its undo
are inside the timed call). Both under ``torch.no_grad()``. Reported: the passes of the
autoregressive networks (the library's fixed count and the ones the early stop took), the
median times, their ratio, whether the results are bitwise equal, and whether the ratio meets
the target.

The flows have the libraries' random initial weights (no training): zuko's and nflows' MADE
layers and normflows' ``MaskedAffineAutoregressive`` are randomly initialised (a nontrivial
map); normflows' splines are built with ``init_identity=False`` (their default initialises the
spline to the identity, which any inverse solves in two passes).

normflows puts the loop of ``MaskedAffineAutoregressive`` on the other side: its ``sample`` is
one pass per layer already (nothing to accelerate; the row shows the ratio is ~1 and the result
the same: the target does not apply) and its ``log_prob`` / ``inverse`` run the ``D``-pass loop
(the row that speeds up, held to the target instead).
Its autoregressive splines loop in ``sample``; at 784 features one library pass of their MADE
costs ~0.1 s (200 s for one sample call), so that row uses 64 features.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paraprop.flows import accelerate
from paraprop_lab.experiments import rows_more as _rows
from paraprop_lab.experiments.harness import interleaved, machine_info, median
from paraprop_lab.experiments.report import markdown_table, text_table, write_results
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows

DESCRIPTION = "zuko / nflows / normflows sampling: the library's own vs paraprop.flows.accelerate"

# its comparison on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("flows.maf_sample", _rows.flows_rows, 12)]
TARGET = 20.0     # the ratio for sampling a MAF of 784 features
FEATURES, SAMPLES, LAYERS, HIDDEN = 784, 100, 3, 64
SPLINE_FEATURES = 64
COLUMNS = ["flow", "call", "D", "N", "library passes", "paraprop passes", "library_ms",
           "accelerated_ms", "speedup", "bitwise equal", f"meets {TARGET:g}x"]


def _zuko_maf(d):
    import zuko

    return zuko.flows.MAF(d, transforms=LAYERS)


def _nflows_maf(d):
    from nflows.flows import MaskedAutoregressiveFlow

    return MaskedAutoregressiveFlow(d, HIDDEN, num_layers=LAYERS, num_blocks_per_layer=2).eval()


def _normflows(d, spline=False):
    import normflows as nf

    flows = []
    for _ in range(LAYERS):
        flows.append(nf.flows.AutoregressiveRationalQuadraticSpline(d, 2, HIDDEN,
                                                                    init_identity=False)
                     if spline else nf.flows.MaskedAffineAutoregressive(d, HIDDEN))
        flows.append(nf.flows.LULinearPermute(d))
    return nf.NormalizingFlow(nf.distributions.DiagGaussian(d), flows).eval()


def cases(quick: bool) -> list[tuple]:
    """``(flow label, call label, D, build, call, target row?)``: call(flow, n) -> tensors."""
    d = 16 if quick else FEATURES
    ds = 8 if quick else SPLINE_FEATURES
    return [
        (f"zuko MAF({d}, transforms={LAYERS})", "flow().sample((N,))", d, _zuko_maf,
         lambda f, n: f().sample((n,)), True),
        (f"nflows MaskedAutoregressiveFlow({d}, {HIDDEN}, {LAYERS} layers)", "flow.sample(N)",
         d, _nflows_maf, lambda f, n: f.sample(n), True),
        (f"normflows MAF ({LAYERS} x MaskedAffineAutoregressive({d}, {HIDDEN}) + "
         "LULinearPermute)", "flow.sample(N)", d, _normflows, lambda f, n: f.sample(n), False),
        (f"normflows MAF ({LAYERS} x MaskedAffineAutoregressive({d}, {HIDDEN}) + "
         "LULinearPermute)", "flow.log_prob(x)", d, _normflows,
         lambda f, n: f.log_prob(torch.randn(n, d)), True),
        (f"normflows RQ spline ({LAYERS} x AutoregressiveRationalQuadraticSpline({ds}, 2, "
         f"{HIDDEN}) + LULinearPermute)", "flow.sample(N)", ds,
         lambda k: _normflows(k, spline=True), lambda f, n: f.sample(n), False),
    ]


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple | list) else (out,))
            if isinstance(t, torch.Tensor)]


def row(label: str, call_label: str, d: int, build, call, target: bool, n: int, *,
        repeats: int) -> dict:
    """Time ``call(flow, n)`` as the library ships it and accelerated; one table row."""
    torch.manual_seed(0)
    flow = build(d)

    def library():
        torch.manual_seed(1)
        return call(flow, n)

    def accelerated():
        with accelerate(flow):
            return library()

    with torch.no_grad():
        expected = _tensors(library())
        with accelerate(flow) as handle:
            got = _tensors(library())
        times = interleaved({"library": library, "accelerated": accelerated}, repeats=repeats,
                            warmup=1, desc=f"{label}: {call_label}")
    lib, acc = median(times["library"]), median(times["accelerated"])
    ratio = lib / acc
    equal = len(expected) == len(got) and all(torch.equal(a, b)
                                               for a, b in zip(expected, got, strict=True))
    return {"flow": label, "call": call_label, "D": d, "N": n,
            "library passes": handle.library_passes, "paraprop passes": handle.passes,
            "library_ms": 1e3 * lib, "accelerated_ms": 1e3 * acc, "speedup": ratio,
            "bitwise equal": bool(equal),
            f"meets {TARGET:g}x": (ratio >= TARGET) if target else "n/a",
            "times_s": times}


@with_device_rows("flows", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
    repeats = repeats or (1 if quick else 5)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = 10 if quick else SAMPLES
    rows = [row(*case, n, repeats=repeats) for case in cases(quick)]
    title = (f"Flow libraries' own calls, {n} points, random initial weights, tol=0 "
             f"({'quick: small flows' if quick else 'the issue-18 target rows'})")
    print(f"\n{title}")
    print(text_table(rows, COLUMNS))
    payload = {"suite": "flows", "machine": machine_info(), "repeats": repeats, "quick": quick,
               "target": TARGET, "rows": rows}
    write_results(out_dir, "flows", payload, [(title, markdown_table(rows, COLUMNS))],
                  "paraprop bench flows" + (" --quick" if quick else ""))
    return payload
