"""``paraprop bench gpu``: the papers' headline rows on one device, side by side in one run.

Every suite that has device rows lists them in ``DEVICE_ROWS``
(:class:`paraprop_lab.experiments.rows.RowSpec`); this suite runs all of them in :data:`ORDER` (the
cheap rows first, so that a short window measures as many targets as it can) and writes one
report, ``gpu.json`` / ``gpu.md`` / ``gpu.png``. Without ``--quick`` it measures at the GPU sizes
of issue 28's targets and needs CUDA; with ``--quick`` the same rows run at tiny sizes on
whatever device there is (the CPU here: the smoke run of ``make gpu-check DEVICE=cpu``).
``make gpu-check`` (:mod:`paraprop_lab.bench.gpu_check`) runs these rows in a child process with a
time budget, after an environment report and ``pytest -m gpu``.
"""

from __future__ import annotations

import math
from pathlib import Path

from paraprop_lab.experiments.device import record, resolve
from paraprop_lab.experiments.rows import Context, RowSpec, run_specs
from paraprop_lab.experiments.rows_report import write

DESCRIPTION = "the papers' headline rows on a GPU (make gpu-check): every suite's device rows"

# issue 28's targets, cheap and central first (ParaGRU, the longest, after decoding and
# diffusion: on the first GPU run it took the time of every row after it); then the
# measurements for the auto settings; then the suites without a GPU target
ORDER = ["scan.bandwidth", "newton.gru_forward", "bppsa.rnn", "bppsa.gru", "bppsa.lstm",
         "made.jacobi", "pixelcnn.gs_jacobi", "decoding.greedy", "diffusion.picard",
         "pararnn.gru", "tarflow.sampling", "scan.algorithm", "bppsa.forward_choice",
         "pararnn.lstm", "core.triangular_maps", "flows.maf_sample",
         "triangular.mlp_backward", "multigrid.forward"]


def specs(only: list[str] | None = None) -> list[RowSpec]:
    """Every suite's device rows in :data:`ORDER` (rows not named there after, by name);
    ``only``: the rows whose name or suite is listed.

    Raises:
        ValueError: a name in ``only`` that is neither a row nor a suite with rows.
    """
    from paraprop_lab import bench

    found: dict[str, RowSpec] = {}
    for name in bench.suites():
        if name != "gpu":
            for spec in getattr(bench.load(name), "DEVICE_ROWS", []):
                found[spec.name] = spec
    names = [n for n in ORDER if n in found] + sorted(set(found) - set(ORDER))
    if only:
        suites = {n.split(".", 1)[0] for n in names}
        unknown = [o for o in only if o not in found and o not in suites]
        if unknown:
            raise ValueError(f"unknown device rows {unknown}; rows: {', '.join(names)} (or a "
                             f"suite: {', '.join(sorted(suites))})")
        names = [n for n in names if n in only or n.split(".", 1)[0] in only]
    return [found[n] for n in names]


def context(device, *, quick: bool, repeats: int | None, deadline: float = math.inf
            ) -> Context:
    """The rows' context: ``device`` (``None``: CUDA where present), GPU sizes or tiny ones.

    Raises:
        ValueError: GPU sizes asked for on the CPU (they would run for hours there).
    """
    dev = resolve(device, default="auto")
    if dev.type == "cpu" and not quick:
        raise ValueError("paraprop bench gpu measures at GPU sizes and needs a CUDA device "
                         "(torch sees none here); --quick runs the same rows at tiny sizes on "
                         "the CPU (make gpu-check DEVICE=cpu)")
    return Context(dev, "tiny" if quick else "gpu", repeats, deadline=deadline)


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None, device=None,
        only: list[str] | None = None) -> dict:
    ctx = context(device, quick=quick, repeats=repeats)
    records = list(run_specs(specs(only), ctx))
    cmd = "paraprop bench gpu" + (" --quick" if quick else "") + (
        f" --repeats {repeats}" if repeats else "")
    return write(Path(out_dir), "gpu", records, record(ctx.device), cmd,
                 payload={"quick": quick, "repeats": repeats, "scale": ctx.scale})
