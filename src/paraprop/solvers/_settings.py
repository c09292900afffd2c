"""Validation of solver settings (shared by the solver classes)."""

from __future__ import annotations


def positive_int_or_none(name: str, value, owner: str):
    """``value`` if it is ``None`` or an int ``>= 1``, else a ``ValueError`` naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int or None, got {value!r}")
    return value


def positive_float(name: str, value, owner: str) -> float:
    """``float(value)`` if it is a number ``> 0``, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{owner}: {name} must be a number > 0, got {value!r}")
    return float(value)
