"""Parts of ``paraprop demo``, the main job.

A part is a module of this package defining ``ORDER`` (int, running order), ``TITLE`` and
``run(out_dir: pathlib.Path, *, quick: bool = False, full: bool = False) -> dict``; later
capabilities add their own module. The dict holds ``rows`` and ``sections`` (``(heading,
markdown)`` pairs for ``demo.md``), ``why`` (the sentence that ends the part: which method won on
this machine and why, computed from the part's own measurements; where the method loses here,
also where it wins instead), ``headline`` (the part's figure for the closing summary) and
``plots`` (the PNGs it wrote).

The demo has three modes (:data:`MODES`):

- ``default`` (``paraprop demo``): a few minutes. Models that take minutes to train come from
  the checkpoints shipped in :mod:`paraprop_lab.weights` (:mod:`paraprop_lab.demos._weights`);
  everything else is built or trained in seconds.
- ``full`` (``paraprop demo --full``): the long version, which trains every model it shows (with
  progress lines) and times at the larger sizes.
- ``quick`` (``paraprop demo --quick``): a smoke run at tiny sizes, for tests; its figures show
  nothing.

A part may define ``SECONDS``, its wall time per mode as measured on a 2-core CPU, from which
the demo says up front how long it will take; and ``REQUIRES``, the optional modules it
needs (a part whose module is missing is skipped with a note).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

SUMMARY_COLUMNS = ["part", "seconds", "headline", "plots"]
MODES = ("quick", "default", "full")


def parts() -> list:
    """The demo part modules, in running order."""
    mods = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
            if not m.name.startswith("_")]
    return sorted((m for m in mods if callable(getattr(m, "run", None))),
                  key=lambda m: (getattr(m, "ORDER", 100), m.__name__))


def missing_requirements(part) -> list[str]:
    """The optional modules a part names in ``REQUIRES`` that are not installed."""
    return [m for m in getattr(part, "REQUIRES", ()) if importlib.util.find_spec(m) is None]


# the extra of pyproject.toml that installs each optional module a part may need
EXTRAS = {"torchvision": "vision", "transformers": "transformers", "diffusers": "diffusion",
          "zuko": "flows", "nflows": "flows", "normflows": "flows"}


def skip_note(missing: list[str]) -> str:
    """``skipped: needs zuko (pip install 'paraprop[flows]')``."""
    extras = sorted({EXTRAS.get(m, "dev") for m in missing})
    return (f"skipped: needs {', '.join(missing)} (pip install "
            f"'paraprop[{','.join(extras)}]')")


def expected_seconds(part, mode: str) -> float:
    """The part's wall time in ``mode`` as measured on a 2-core CPU, from its ``SECONDS`` (0 for
    a part that states none)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return float(getattr(part, "SECONDS", {}).get(mode, 0.0))


def run_part(part, out_dir: Path, mode: str) -> dict:
    """``part.run`` in ``mode``: ``quick=True`` for ``quick``; ``full=True`` for ``full`` (a part
    whose ``run`` takes no ``full`` has one version, run with ``quick=False``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    kw = {"quick": mode == "quick"}
    if mode == "full" and "full" in inspect.signature(part.run).parameters:
        kw["full"] = True
    return part.run(out_dir, **kw)


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
