"""Demo part: a TarFlow on the digits, sampled by the KV-cached loop and by Jacobi-type
solvers, with the deviation from the exact sequential solve."""

from __future__ import annotations

from pathlib import Path

from paraprop_lab.experiments.explain import fewer_passes, pass_cost
from paraprop_lab.experiments.report import markdown_table, text_table
from paraprop_lab.experiments.tarflow import COLUMNS, method_rows

ORDER = 28
TITLE = "TarFlow: inverting transformer flow blocks as triangular systems"


def run(out_dir: Path, *, quick: bool = False) -> dict:
    from paraprop_lab.training.tarflow import trained_tarflow

    out_dir.mkdir(parents=True, exist_ok=True)
    flow, info = trained_tarflow("digits", out_dir=out_dir / "models",
                                 **({"epochs": 1, "n": 64} if quick else {}), progress=not quick)
    flow.requires_grad_(False)
    rows, _ = method_rows(flow, 1, repeats=1 if quick else 3, desc="demo tarflow")
    title = f"TarFlow on the digits ({flow.T} patches, {len(flow.blocks)} blocks), batch 1"
    print(f"{title}; speedup against the KV-cached loop, max_abs_err against the exact solve")
    print(text_table(rows, COLUMNS))
    why, headline = explain(rows)
    print(why)
    samples = Path(info["checkpoint"]).with_suffix(".png")  # the training job's sample figure
    return {"rows": rows, "sections": [(title, markdown_table(rows, COLUMNS) + "\n\n" + why)],
            "why": why, "headline": headline, "plots": [samples] if samples.is_file() else [],
            "model": {k: v for k, v in info.items() if k != "loss"}}


def explain(rows: list[dict]) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows: a solver's
    transformer passes over all patches against the KV-cached loop's one-patch calls."""
    base = rows[0]
    fewer = [r for r in rows if r["model_calls"] < base["model_calls"] and r["converged"]] \
        or rows[1:]
    winner = max(rows, key=lambda r: r["speedup"])
    m = winner if winner in fewer else max(fewer, key=lambda r: r["speedup"])
    why = fewer_passes(
        m["method"], "the KV-cached loop", speedup=m["speedup"], passes=m["model_calls"],
        steps=base["model_calls"],
        cost=pass_cost(m["time_ms"], m["model_calls"], base["time_ms"], base["model_calls"]),
        step_word="cached call", detail=" (a transformer pass over a block's patches)",
        winner="the KV-cached loop" if winner is base else winner["method"],
        winner_speedup=winner["speedup"])
    headline = (f"{m['method']}: {m['model_calls']} passes vs {base['model_calls']} cached "
                f"calls, {m['speedup']:.2f}x the KV-cached loop")
    return why, headline
