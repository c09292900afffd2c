"""``paraprop bench scan``: the diagonal linear scan by every method, against the copy.

``h_t = a_t * h_{t-1} + b_t`` (elementwise; the linear recurrence of the Newton forward, of
ParaGRU / ParaLSTM and of every diagonal backward) by each method of
:func:`paraprop.scan.linear_recurrence`, as a fraction of the bandwidth of a plain copy of the
same data measured in the same run: the scan reads ``a`` and ``b`` and writes ``h``, so a scan at
the copy's bandwidth is at the physical limit. Then each method at the shapes the recurrent
modules run, with ``method="auto"`` timed beside them: the measurement that sets ``auto`` on
this device. The same rows run on a GPU (``device="cuda"``, ``make gpu-check``) at the issue's
size, ``(B, D, T) = (8, 1536, 65536)``, where the Triton kernel's target is 70% of the copy.
"""

from __future__ import annotations

from pathlib import Path

from paraprop_lab.experiments import rows_recurrent as _rows
from paraprop_lab.experiments.device import resolve
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import device_suite

DESCRIPTION = "diagonal linear scan: every method vs the copy bandwidth; what auto should pick"

DEVICE_ROWS = [RowSpec("scan.bandwidth", _rows.scan_bandwidth, 40),
               RowSpec("scan.algorithm", _rows.scan_choice, 25)]


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None,
        device: str | None = None) -> dict:
    """The rows on ``device`` (default the CPU; ``quick``: tiny sizes), reported as
    ``scan_cpu`` / ``scan_cuda`` (``.json``, ``.md``, ``.png``)."""
    return device_suite(Path(out_dir), "scan", DEVICE_ROWS, resolve(device), quick=quick,
                        repeats=repeats)
