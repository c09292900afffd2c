"""Demo part: back-propagation through deep MLPs as an upper triangular system (Naumov 2017),
solved by cyclic reduction in ceil(log2 l) + 1 levels, with autograd's gradients."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch

from paraprop.linalg import activation_points, mlp_backward
from paraprop.models import deep_mlp
from paraprop_lab.experiments.explain import fewer_passes, pass_cost
from paraprop_lab.experiments.harness import interleaved, median, threads
from paraprop_lab.experiments.report import markdown_table, text_table

ORDER = 35
TITLE = "Back-propagation as a triangular system: cyclic reduction in log2(l) + 1 levels"
SECONDS = {"quick": 1, "default": 2, "full": 2}
COLUMNS = ["l", "width", "batch", "autograd_ms", "cr_ms", "speedup", "cr_levels",
           "sequential_levels", "grad_rel_err_f64"]


def row(l: int, width: int, batch: int, repeats: int) -> dict:
    net = deep_mlp(l, width)
    params = list(net.parameters())
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
    xg = x.clone().requires_grad_()
    out = net(xg)
    pts = activation_points(net, x)
    times = interleaved(
        {"autograd": lambda: torch.autograd.grad(out, [xg, *params], g, retain_graph=True),
         "cr": lambda: mlp_backward(net, x, g, points=pts)},
        repeats=repeats, warmup=1, desc=f"demo l={l}")
    _, sol = mlp_backward(net, x, g, points=pts)
    net64 = copy.deepcopy(net).double()
    x64 = x.double().requires_grad_()
    ref = torch.autograd.grad(net64(x64), [x64, *net64.parameters()], g.double())
    ours, _ = mlp_backward(net64, x.double(), g.double())
    err = max(float((a - b).norm() / b.norm()) for a, b in zip([ours[0], *ours[1]], ref,
                                                               strict=True))
    ta, tc = median(times["autograd"]), median(times["cr"])
    return {"l": l, "width": width, "batch": batch, "autograd_ms": 1e3 * ta, "cr_ms": 1e3 * tc,
            "speedup": ta / tc, "cr_levels": sol.stats["levels"], "sequential_levels": l,
            "grad_rel_err_f64": err, "log2_bound": math.ceil(math.log2(l)) + 1}


def run(out_dir: Path, *, quick: bool = False) -> dict:
    depths = [16, 64] if quick else [16, 64, 256, 1024]
    with threads(1):  # see paraprop_lab.bench.triangular.run: parallel regions stall on a busy host
        rows = [row(l, 16, 1, repeats=2 if quick else 5) for l in depths]
    title = ("tanh MLPs of width 16, batch 1, 1 thread: backward from the points of a pass, "
             "autograd vs cyclic reduction")
    print(title)
    print(text_table(rows, COLUMNS))
    why, headline = explain(rows)
    print(why)
    return {"rows": rows, "sections": [(title, markdown_table(rows, COLUMNS) + "\n\n" + why)],
            "why": why, "headline": headline, "plots": []}


def explain(rows: list[dict]) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows: cyclic
    reduction's levels against autograd's ``l`` sequential steps, at the deepest ``l``, and
    the depths where the other method won."""
    deep = rows[-1]
    l = deep["l"]
    why = fewer_passes(
        "cyclic reduction", "autograd", speedup=deep["speedup"], passes=deep["cr_levels"],
        steps=l, cost=pass_cost(deep["cr_ms"], deep["cr_levels"], deep["autograd_ms"], l),
        pass_word="level", step_word="autograd step",
        detail=" (batched products of the layers' Jacobians)")
    why = why[:-1] + f" at l = {l}"
    other = [r for r in rows[:-1] if (r["speedup"] > 1) != (deep["speedup"] > 1)]
    if other:
        won = "wins" if other[0]["speedup"] > 1 else "loses"
        why += (f"; it {won} at l = " + ", ".join(str(r["l"]) for r in other) + " ("
                + ", ".join(f"{r['speedup']:.2f}x" for r in other) + f"): {other[0]['cr_levels']}"
                f" levels against {other[0]['l']} steps")
    headline = (f"cyclic reduction {deep['cr_levels']} levels vs {l} steps, "
                f"{deep['speedup']:.2f}x autograd at l={l}")
    return why + ".", headline
