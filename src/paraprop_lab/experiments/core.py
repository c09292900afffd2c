"""The core comparison: sequential vs Jacobi vs both hybrids on two triangular systems (a MADE-
shaped masked map and an MLP-depth recurrence); shared by ``paraprop bench core`` and the demo's
first part.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from paraprop.models import LayerChain, MaskedAffineMap
from paraprop.solvers import GSJacobi, JacobiGS
from paraprop_lab.experiments.compare import COLUMNS, MethodSpec, compare
from paraprop_lab.experiments.explain import fewer_passes, pass_cost
from paraprop_lab.experiments.plots import convergence_plot
from paraprop_lab.experiments.report import markdown_table, text_table


def made_problem(features: int, hidden: tuple[int, ...], batch: int, seed: int = 0):
    """The masked sampling map with fixed noise; returns ``(fn, x0, plain)``."""
    m = MaskedAffineMap(features, hidden, seed=seed).requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    m.bind(torch.randn(batch, features, generator=g))
    x0 = torch.zeros(batch, features)

    def ancestral():  # the ordinary sampler: one position per network evaluation
        x = torch.zeros(batch, features)
        with torch.no_grad():
            for d in range(features):
                x[:, d : d + 1] = m.update(x, torch.tensor([d]))
        return x

    return m, x0, ancestral


def chain_problem(depth: int, width: int, batch: int, seed: int = 0):
    """The layer recurrence of a tanh MLP; returns ``(fn, x0, plain)`` (``dim=-2``)."""
    c = LayerChain(depth, width, seed=seed).requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    u = torch.randn(batch, width, generator=g)
    c.bind(u)
    return c, torch.zeros(batch, depth, width), lambda: c.forward_sequential(u)


def methods_for(T: int) -> list[MethodSpec]:
    """Jacobi and both hybrids, with the block sizes the suite uses.

    Jacobi-GS: ``ceil(T / 8)``-long blocks (8 blocks run in parallel, each sequential inside);
    GS-Jacobi: ``ceil(T / 16)``-long blocks solved one after another by Jacobi.
    """
    return [
        MethodSpec("jacobi", {"method": "jacobi"}),
        MethodSpec("jacobi_gs", {"method": JacobiGS(block_size=math.ceil(T / 8))}),
        MethodSpec("gs_jacobi", {"method": GSJacobi(block_size=math.ceil(T / 16))}),
    ]


def problems(quick: bool) -> list[dict]:
    if quick:
        return [
            {"name": "made-64", "desc": "MADE-shaped map, D=64 (8x8), hidden 2x128, batch 100",
             "make": lambda: made_problem(64, (128, 128), 100), "dim": -1},
            {"name": "mlp-chain-512", "desc": "tanh MLP, depth 512, width 8, batch 16",
             "make": lambda: chain_problem(512, 8, 16), "dim": -2},
        ]
    return [
        {"name": "made-784", "desc": "MADE-shaped map, D=784, hidden 2x512, batch 100",
         "make": lambda: made_problem(784, (512, 512), 100), "dim": -1},
        {"name": "mlp-chain-256", "desc": "tanh MLP, depth 256, width 32, batch 64",
         "make": lambda: chain_problem(256, 32, 64), "dim": -2},
        {"name": "mlp-chain-4096", "desc": "tanh MLP, depth 4096, width 8, batch 8",
         "make": lambda: chain_problem(4096, 8, 8), "dim": -2},
    ]


def why(rows: list[dict]) -> str:
    """Which method won one problem's rows (from :func:`~paraprop_lab.experiments.compare.compare`)
    and why: its sweeps against the plain loop's steps, and what a sweep costs here."""
    by = {r["method"]: r for r in rows}
    plain = by["plain loop"]
    T = plain["iterations"]
    winner = max(rows, key=lambda r: r["speedup"])
    parallel = [r for r in rows if r["method"] not in ("plain loop", "sequential")]
    m = winner if winner in parallel else max(parallel, key=lambda r: r["speedup"])
    per = m["positions"] / max(m["iterations"], 1)
    return fewer_passes(
        m["method"], "the plain loop", speedup=m["speedup"], passes=m["iterations"], steps=T,
        cost=pass_cost(m["time_ms"], m["iterations"], plain["time_ms"], T),
        pass_word="sweep", step_word="loop step",
        detail=f" ({per:.0f} of the {T} positions at once)" if round(per) < T
        else f" (all {T} positions at once)",
        winner="the plain loop" if winner is plain else winner["method"],
        winner_speedup=winner["speedup"])


def headline(problem: str, rows: list[dict]) -> str:
    """``made-64: jacobi 2.06x the loop (11 sweeps vs 64 steps)``: the best parallel method."""
    best = max((r for r in rows if r["method"] not in ("plain loop", "sequential")),
               key=lambda r: r["speedup"])
    T = rows[0]["iterations"]
    return (f"{problem}: {best['method']} {best['speedup']:.2f}x the loop "
            f"({best['iterations']} sweeps vs {T} steps)")


def run_problems(out_dir: Path, *, quick: bool, repeats: int, tol: float, name: str) -> dict:
    """Run every problem; print and return ``{"rows", "sections", "plots", "why", "headline"}``
    (``why``: one sentence per problem, one per line)."""
    all_rows, sections, plots, whys, heads = [], [], [], [], []
    for p in problems(quick):
        fn, x0, plain = p["make"]()
        T = x0.shape[p["dim"]]
        rows, curves = compare(fn, x0, methods_for(T), dim=p["dim"], tol=tol, plain=plain,
                               repeats=repeats, desc=p["name"])
        print(f"\n{p['desc']} (tol={tol:g}, speedup over the plain sequential loop)")
        print(text_table(rows, COLUMNS))
        whys.append(why(rows))
        heads.append(headline(p["name"], rows))
        print(whys[-1])
        png = convergence_plot(out_dir / f"{name}_{p['name']}_convergence.png",
                               f"{p['desc']}: convergence", curves, tol=tol)
        plots.append(png)
        sections.append((p["desc"], markdown_table(rows, COLUMNS) + "\n\n" + whys[-1]
                         + f"\n\n![]({png.name})"))
        all_rows += [{"problem": p["name"], **r} for r in rows]
    return {"rows": all_rows, "sections": sections, "plots": plots, "why": "\n".join(whys),
            "headline": "; ".join(heads)}

