"""Parts of ``paraprop demo``, the main job.

A part is a module of this package defining ``ORDER`` (int, running order), ``TITLE`` and
``run(out_dir: pathlib.Path, *, quick: bool) -> dict``; later capabilities add their own module.
"""

from __future__ import annotations

import importlib
import pkgutil


def parts() -> list:
    """The demo part modules, in running order."""
    mods = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
            if not m.name.startswith("_")]
    return sorted((m for m in mods if callable(getattr(m, "run", None))),
                  key=lambda m: (getattr(m, "ORDER", 100), m.__name__))
