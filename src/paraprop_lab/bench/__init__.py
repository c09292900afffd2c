"""Benchmark suites: ``paraprop bench SUITE``.

A suite is a module of this package that defines ``DESCRIPTION`` (one line) and
``run(out_dir: pathlib.Path, *, quick: bool, repeats: int | None, device=None) -> dict``; it
measures with :mod:`paraprop_lab.experiments` (the timing harness, the report writer and the
measurements it shares with ``paraprop demo``) and writes ``SUITE.json``, ``SUITE.md`` and PNG
plots under ``out_dir``. ``device`` (``None``: the CPU) is where it measures: a suite with a
GPU row lists it in ``DEVICE_ROWS`` (:class:`paraprop_lab.experiments.rows.RowSpec`) and runs it
there (reported as ``SUITE_cuda``: its CPU run decorated by
:func:`paraprop_lab.experiments.rows_report.with_device_rows`); one without refuses any device but
the CPU, saying why (:func:`paraprop_lab.experiments.rows_report.cpu_only`).
``gpu`` runs every suite's ``DEVICE_ROWS`` side by side (``make gpu-check``,
:mod:`paraprop_lab.bench.gpu_check`). New suites are found by name, nothing to register.
Nothing in the lab imports ``bench`` but the CLI, and nothing in the library imports the lab:
it is a leaf.
"""

from __future__ import annotations

import importlib
import pkgutil

_NOT_SUITES = {"collect", "gpu_check"}


def suites() -> dict[str, str]:
    """Name -> one-line description of every available suite."""
    out = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name in _NOT_SUITES:
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if callable(getattr(mod, "run", None)):
            out[info.name] = getattr(mod, "DESCRIPTION", "")
    return dict(sorted(out.items()))


def load(name: str):
    """The suite module ``name``; ``ValueError`` naming the known suites otherwise."""
    known = suites()
    if name not in known:
        raise ValueError(f"unknown benchmark suite {name!r}; available: {', '.join(known)}")
    return importlib.import_module(f"{__name__}.{name}")
