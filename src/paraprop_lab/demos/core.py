"""Demo part: feedforward computations solved as triangular systems by every method."""

from __future__ import annotations

from pathlib import Path

from paraprop_lab.experiments.core import run_problems

ORDER = 10
TITLE = "Feedforward computation as a triangular system: every method, the sequential result"


def run(out_dir: Path, *, quick: bool = False) -> dict:
    return run_problems(out_dir, quick=True, repeats=1 if quick else 3, tol=1e-5, name="demo")
