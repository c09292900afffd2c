"""Parts of ``paraprop demo``, the main job.

A part is a module of this package defining ``ORDER`` (int, running order), ``TITLE`` and
``run(out_dir: pathlib.Path, *, quick: bool) -> dict``; later capabilities add their own module.
The dict holds ``rows`` and ``sections`` (``(heading, markdown)`` pairs for ``demo.md``),
``why`` (the sentence that ends the part: which method won on this machine and why, computed
from the part's own measurements), ``headline`` (the part's figure for the closing summary) and
``plots`` (the PNGs it wrote).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from pathlib import Path

SUMMARY_COLUMNS = ["part", "headline", "plots"]


def parts() -> list:
    """The demo part modules, in running order."""
    mods = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
            if not m.name.startswith("_")]
    return sorted((m for m in mods if callable(getattr(m, "run", None))),
                  key=lambda m: (getattr(m, "ORDER", 100), m.__name__))


def missing_requirements(part) -> list[str]:
    """The optional modules a part names in ``REQUIRES`` that are not installed."""
    return [m for m in getattr(part, "REQUIRES", ()) if importlib.util.find_spec(m) is None]


def summary_row(name: str, result: dict, out_dir: Path) -> dict:
    """One row of the closing summary: the part, its headline and its PNGs (relative to
    ``out_dir``); also its closing sentence (``why``, in ``demo.json``, not in the table)."""
    plots = []
    for p in map(Path, result.get("plots", [])):
        try:
            plots.append(str(p.relative_to(out_dir)))
        except ValueError:
            plots.append(str(p))
    return {"part": name, "headline": result.get("headline", "(no headline)"),
            "plots": ", ".join(plots) or "(no plot)", "why": result.get("why", "")}
