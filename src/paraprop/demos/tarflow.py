"""Demo part: a TarFlow on the digits, sampled by the KV-cached loop and by Jacobi-type
solvers, with the deviation from the exact sequential solve."""

from __future__ import annotations

from pathlib import Path

from paraprop.experiments.report import markdown_table, text_table
from paraprop.experiments.tarflow import COLUMNS, method_rows

ORDER = 28
TITLE = "TarFlow: inverting transformer flow blocks as triangular systems"


def run(out_dir: Path, *, quick: bool = False) -> dict:
    from paraprop.training.tarflow import trained_tarflow

    out_dir.mkdir(parents=True, exist_ok=True)
    flow, info = trained_tarflow("digits", out_dir=out_dir / "models",
                                 **({"epochs": 1, "n": 64} if quick else {}), progress=not quick)
    flow.requires_grad_(False)
    rows, _ = method_rows(flow, 1, repeats=1 if quick else 3, desc="demo tarflow")
    title = f"TarFlow on the digits ({flow.T} patches, {len(flow.blocks)} blocks), batch 1"
    print(f"{title}; speedup against the KV-cached loop, max_abs_err against the exact solve")
    print(text_table(rows, COLUMNS))
    base, jac = rows[0], next(r for r in rows if r["method"] == "jacobi, one chunk")
    cost = (jac["time_ms"] / jac["model_calls"]) / (base["time_ms"] / base["model_calls"])
    why = (f"Jacobi made {jac['model_calls']} transformer passes against the cached loop's "
           f"{base['model_calls']} calls, but a full pass costs {cost:.1f} cached calls here, "
           f"so it ran at {jac['speedup']:.2f}x" + (
               ": the fewer passes won." if jac["speedup"] > 1 else
               ": parallel passes pay where a pass over all patches costs about one call (a "
               "GPU), not here."))
    print(why)
    return {"rows": rows, "sections": [(title, markdown_table(rows, COLUMNS) + "\n\n" + why)],
            "model": {k: v for k, v in info.items() if k != "loss"}}
