"""Demo part: feedforward computations solved as triangular systems by every method."""

from __future__ import annotations

from pathlib import Path

from paraprop_lab.experiments.core import run_problems

ORDER = 42
TITLE = "Feedforward computation as a triangular system: every method, the sequential result"
SECONDS = {"quick": 2, "default": 2, "full": 15}
WHERE = ("Where the parallel methods win instead: where one sweep costs fewer loop steps than it "
         "replaces, with more positions per sweep (a MADE on 784 pixels, as in `paraprop bench "
         "core` and `paraprop bench made`) or on a GPU, where a sweep over all positions costs "
         "about one loop step.")


def run(out_dir: Path, *, quick: bool = False, full: bool = False) -> dict:
    """Two toy triangular systems (a MADE-shaped masked map, D=64, and the layer recurrence of
    a tanh MLP, depth 512) by the plain loop, ``solve``'s sequential method, Jacobi and both
    hybrids (``paraprop bench core`` runs the larger ones)."""
    res = run_problems(out_dir, quick=True, repeats=1 if quick else 3 if full else 2, tol=1e-5,
                       name="demo")
    best: dict[str, float] = {}
    for r in res["rows"]:
        if r["method"] not in ("plain loop", "sequential"):
            best[r["problem"]] = max(best.get(r["problem"], 0.0), r["speedup"])
    if any(s <= 1 for s in best.values()):
        print(WHERE)
        res["why"] += "\n" + WHERE
    return res
