"""Errors raised by :mod:`paraprop.optim` when a fused update cannot be exact."""

from __future__ import annotations


class FusionError(RuntimeError):
    """A fused optimizer met a use it cannot make exact, and refuses instead of guessing.

    Raised at run time: a parameter read or given a gradient while its update was still pending
    (forward mode), a gradient read after the update fused into backward consumed it (backward
    mode: global-norm clipping, ``GradScaler``, a second ``backward()`` before ``step()``).
    Wrong arguments to :func:`paraprop.optim.fuse` raise ``ValueError``/``TypeError`` instead.

    Example:
        >>> model = nn.Linear(4, 1)
        >>> opt = paraprop.optim.fuse(torch.optim.SGD(model.parameters(), lr=0.1), model,
        ...                           mode="backward")
        >>> model(torch.randn(8, 4)).sum().backward()      # the update ran inside backward
        >>> nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        Traceback (most recent call last):
        paraprop.optim.errors.FusionError: linalg_vector_norm.default read the gradient of ...
    """
