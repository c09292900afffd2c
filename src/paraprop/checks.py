"""The shared argument checks of paraprop.

Each check returns the value it was given when that value is acceptable, and otherwise raises
with a message that names the argument and shows the bad value, in one style across the library::

    tol must be a number >= 0, got -1
    max_iters must be a positive int or None, got 0
    unknown method='x'; choose one of a, b

``bool`` is neither an int nor a number here (``True`` is a flag, not a count). The int and
number checks raise ``ValueError`` for a value of the wrong type as well as for one out of range
(the message says what is accepted); :func:`boolean` and :func:`callable_arg` raise
``TypeError``. ``name`` is the argument as the caller wrote it; a prefix such as
``"JacobiGS: block_size"`` names its owner too.
"""

from __future__ import annotations

import math
from typing import TypeGuard

import torch

__all__ = [
    "boolean",
    "callable_arg",
    "check_max_iters",
    "check_tol",
    "finite",
    "is_int",
    "is_number",
    "nonneg_int",
    "nonneg_number",
    "one_of",
    "positive_int",
    "positive_number",
    "same_kind",
]


def is_int(value) -> TypeGuard[int]:
    """Whether ``value`` is an int (a ``bool`` is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """Whether ``value`` is an int or a float (a ``bool`` is not)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _or_none(allow_none: bool) -> str:
    return " or None" if allow_none else ""


def positive_int(name: str, value, *, minimum: int = 1, allow_none: bool = False):
    """``value`` if it is an int ``>= minimum`` (or ``None`` with ``allow_none``).

    Raises:
        ValueError: otherwise, e.g. ``max_iters must be a positive int or None, got 0`` or
            (``minimum=2``) ``coarsening must be an int >= 2, got 2.5``.
    """
    if value is None and allow_none:
        return None
    if not is_int(value) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}{_or_none(allow_none)}, got {value!r}")
    return value


def nonneg_int(name: str, value, *, allow_none: bool = False):
    """``value`` if it is an int ``>= 0`` (or ``None`` with ``allow_none``).

    Raises:
        ValueError: otherwise, e.g. ``levels must be an int >= 0, got -1``.
    """
    return positive_int(name, value, minimum=0, allow_none=allow_none)


def _number(name: str, value, *, positive: bool, finite: bool, allow_none: bool):
    if value is None and allow_none:
        return None
    ok = is_number(value) and (value > 0 if positive else value >= 0)  # NaN fails both
    if not ok or (finite and not math.isfinite(value)):
        what = ("a finite number" if finite else "a number") + (" > 0" if positive else " >= 0")
        raise ValueError(f"{name} must be {what}{_or_none(allow_none)}, got {value!r}")
    return value


def nonneg_number(name: str, value, *, finite: bool = False, allow_none: bool = False):
    """``value`` if it is an int or float ``>= 0`` (not NaN; finite with ``finite``).

    Raises:
        ValueError: otherwise, e.g. ``tol must be a number >= 0, got -1``.
    """
    return _number(name, value, positive=False, finite=finite, allow_none=allow_none)


def positive_number(name: str, value, *, finite: bool = False, allow_none: bool = False):
    """``value`` if it is an int or float ``> 0`` (not NaN; finite with ``finite``).

    Raises:
        ValueError: otherwise, e.g. ``timeout must be a finite number > 0, got 0``.
    """
    return _number(name, value, positive=True, finite=finite, allow_none=allow_none)


def boolean(name: str, value, *, allow_none: bool = False):
    """``value`` if it is a ``bool`` (or ``None`` with ``allow_none``).

    Raises:
        TypeError: otherwise, e.g. ``throw must be a bool, got 'yes'``.
    """
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool{_or_none(allow_none)}, got {value!r}")
    return value


def callable_arg(name: str, value, *, allow_none: bool = False):
    """``value`` if it is callable (or ``None`` with ``allow_none``).

    Raises:
        TypeError: otherwise, naming the type (a value's repr may be large), e.g.
            ``fn must be callable, got int``.
    """
    if value is None and allow_none:
        return None
    if not callable(value):
        raise TypeError(f"{name} must be callable{_or_none(allow_none)}, "
                        f"got {type(value).__name__}")
    return value


def method_name(value, names, name: str = "method") -> str:
    """``value`` if it is one of the method ``names`` (a str).

    Raises:
        TypeError: not a str (nor a solver object, which the caller handles first), e.g.
            ``method must be one of jacobi, sequential or a solver object from
            paraprop.solvers, got int``.
        ValueError: an unknown name.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {', '.join(names)} or a solver object from "
                        f"paraprop.solvers, got {type(value).__name__}")
    return one_of(name, value, names)


def window_option(window, method, takes):
    """``window`` (``None`` or a positive int) of an entry point whose named methods ``takes``
    slide a window over the positions; one rule for every such entry point (decoding,
    diffusion). A window of at least all the positions is Jacobi on all of them. ``method``: the
    method's name, or ``None`` for a solver object.

    Raises:
        ValueError: a window with a solver object (it carries its own) or with a named method
            that slides none, e.g. ``window is an option of 'jacobi', 'gs_jacobi', not of
            method='sequential', got window=4``.

    Example:
        >>> window_option(None, "sequential", ("jacobi",)) is None
        True
        >>> window_option(8, None, ("jacobi",))
        Traceback (most recent call last):
        ValueError: window configures the named methods ('jacobi'); a solver object ...
    """
    window = positive_int("window", window, allow_none=True)
    if window is None:
        return None
    names = ", ".join(repr(m) for m in takes)
    if method is None:
        raise ValueError(f"window configures the named methods ({names}); a solver object "
                         f"carries its own settings, got window={window!r}")
    if method not in takes:
        raise ValueError(f"window is an option of {names}, not of method={method!r}, got "
                         f"window={window!r}")
    return window


def one_of(name: str, value, choices):
    """``value`` if it is one of ``choices`` (of the same type: ``True`` is not ``1``).

    Raises:
        ValueError: otherwise, e.g. ``unknown method='x'; choose one of a, b``.
    """
    if not any(isinstance(value, type(c)) and isinstance(value, bool) == isinstance(c, bool)
               and value == c for c in choices):
        raise ValueError(f"unknown {name}={value!r}; choose one of "
                         f"{', '.join(str(c) for c in choices)}")
    return value


def check_tol(tol, name: str = "tol"):
    """``tol`` if it is a number ``>= 0`` (the stopping tolerance of the iterative solvers)."""
    return nonneg_number(name, tol)


def check_max_iters(max_iters, name: str = "max_iters"):
    """``max_iters`` if it is ``None`` or an int ``>= 1`` (the iteration cap of the solvers)."""
    return positive_int(name, max_iters, allow_none=True)


def finite(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` if every entry is finite; else ``ValueError`` naming ``name`` and its first NaN or
    inf entry (``x must be finite; entry (0, 2) of shape (4, 3) is nan``)."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} must be finite; entry {idx} of shape {tuple(t.shape)} is "
                         f"{float(t[idx])}")
    return t


def same_kind(name: str, t: torch.Tensor, ref: torch.Tensor, owner: str) -> torch.Tensor:
    """``t`` if it has the dtype and the device of ``ref``; else ``TypeError`` naming both
    (``x has dtype torch.float32 but the model has torch.float64``, ``x is on cuda:0 but the
    model is on cpu``). ``owner`` names what ``ref`` belongs to (``"the model"``)."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {owner} has {ref.dtype}")
    if torch.device(t.device) != torch.device(ref.device):
        raise TypeError(f"{name} is on {t.device} but {owner} is on {ref.device}")
    return t
