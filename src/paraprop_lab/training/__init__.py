"""Training jobs: ``paraprop train NAME``.

A job is a module of this package defining ``NAME`` (the CLI name, e.g. ``"made"``), ``HELP`` (one
line), ``add_arguments(parser)`` and ``run(args) -> int``; the CLI finds it, nothing to register.
"""

from __future__ import annotations

import importlib
import pkgutil


def jobs() -> dict:
    """CLI name -> job module."""
    out = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "NAME") and callable(getattr(mod, "run", None)):
            out[mod.NAME] = mod
    return dict(sorted(out.items()))
