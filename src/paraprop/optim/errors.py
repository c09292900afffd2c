"""Errors raised by :mod:`paraprop.optim` when a fused update cannot be exact."""

from __future__ import annotations


class FusionError(RuntimeError):
    """A fused optimizer met a use it cannot make exact, and refuses instead of guessing.

    Raised at run time: a parameter read or given a gradient while its update was still pending
    (forward mode), a gradient read after the update fused into backward consumed it (backward
    mode: global-norm clipping, ``GradScaler``, a second ``backward()`` before ``step()``).
    Wrong arguments to :func:`paraprop.optim.fuse` raise ``ValueError``/``TypeError`` instead.
    """
