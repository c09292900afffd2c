"""``paraprop bench core``: sequential vs Jacobi vs both hybrids on two triangular systems.

1. A MADE-shaped masked sampling map (D=784, hidden 2x512, batch 100; random weights, fixed
   noise): the structure of autoregressive sampling (Song et al. 2021, §5.3.1).
2. A deep MLP's forward pass as a recurrence over its layers (a Markov chain: each layer sees only
   the previous one, the hardest case for Jacobi; Song et al. 2021, §3).

For each: iterations, function evaluations, positions computed, median time, speedup over the
plain sequential loop (same run), max |value - sequential|, and a convergence plot (forward
difference and true error per iteration).
"""

from __future__ import annotations

from pathlib import Path

from paraprop_lab.experiments import rows_more as _rows
from paraprop_lab.experiments.core import run_problems  # noqa: E402
from paraprop_lab.experiments.harness import machine_info
from paraprop_lab.experiments.report import write_results
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows

DESCRIPTION = "sequential vs Jacobi vs hybrids on a MADE-shaped map and an MLP-depth recurrence"

# its comparison on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("core.triangular_maps", _rows.core_rows, 10)]


@with_device_rows("core", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
    repeats = repeats or (3 if quick else 5)
    tol = 1e-5
    res = run_problems(out_dir, quick=quick, repeats=repeats, tol=tol, name="core")
    payload = {"suite": "core", "machine": machine_info(), "tol": tol, "repeats": repeats,
               "quick": quick, "rows": res["rows"]}
    command = "paraprop bench core" + (" --quick" if quick else "")
    write_results(out_dir, "core", payload, res["sections"], command)
    return payload

