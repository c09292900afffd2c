"""The optional hooks of a triangular map, declared as protocols, with the promises they make.

:func:`paraprop.solve` needs only ``fn(x)``. A map may also offer the hooks below; each one lets
a solver compute less, and each comes with a promise the solver relies on. The solvers do not
trust the promises: they check the cheap ones on the way and the result at the end
(:mod:`paraprop.solvers.verify`), and a broken promise ends in
:class:`paraprop.ProtocolError` (naming the hook), :class:`paraprop.NotTriangularError`, or
``converged=False``, never in a silently different result.

Layout: ``x`` is the caller's tensor ``(*batch, *positions, *features)``; ``B`` is the product
of the batch dims, ``T`` of the positions (flattened in row-major order), ``F`` of the features.

Every hook promises, besides its own promise:

* **it does not modify ``x``** (nor any tensor the solver passed in), and
* **it computes ``fn``'s values**: the values it returns for a position are those ``fn(x)`` has
  at that position, computed from the same inputs (bitwise, where ``tol=0`` is to be bitwise
  the sequential result: see ``docs/solve.md``).

The hooks are looked up by name (``getattr``); the classes here document them and support
``isinstance`` checks (``isinstance(fn, SupportsWindow)``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["HOOKS", "SupportsGrowth", "SupportsLinearize", "SupportsNewtonStep",
           "SupportsPropose", "SupportsSensitivity", "SupportsUpdate", "SupportsWindow",
           "TriangularMap"]


@runtime_checkable
class TriangularMap(Protocol):
    """``fn(x)``: a tensor shaped like ``x``, same dtype, where position ``t`` depends only on
    the positions ``< t`` of ``x`` (autoregressive along the solve's ``dim``), and on nothing
    else that changes between calls (no dropout, no batch statistics: ``model.eval()``).

    It must return a new tensor (not ``x`` itself) and leave ``x`` unchanged.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class SupportsUpdate(Protocol):
    """``fn.update(x, index)``: the flat positions ``index`` (a 1-D long tensor, increasing)
    of ``fn(x)``, shape ``(*batch, len(index), *features)``, in the order of ``index``.

    Used by :class:`~paraprop.solvers.Sequential` (one position per call, the reference
    loop), :class:`~paraprop.solvers.JacobiGS`, and by :class:`~paraprop.solvers.GSJacobi` and
    :class:`~paraprop.solvers.SlidingJacobi` when there is no ``window``. Promise: the values
    are ``fn(x)[..., index, ...]``, whatever ``index`` holds, computed with the same
    operations as ``fn`` (otherwise ``tol=0`` cannot be bitwise: the verification reports it).
    With several positions, in the order of ``index``, each once.
    """

    def update(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class SupportsWindow(Protocol):
    """``fn.window(x, start, stop, cache)`` returns ``(values, cache)``: ``values`` are the
    flat positions ``[start, stop)`` of ``fn(x)``, shape ``(*batch, stop - start,
    *features)``; ``cache`` is anything, handed back on the next call (``None`` at first).

    The cached-prefix protocol of :class:`~paraprop.solvers.SlidingJacobi` and
    :class:`~paraprop.solvers.GSJacobi`. The solver promises that the positions ``< start``
    of ``x`` are final (they will not change again), so ``fn`` may keep in ``cache`` what they
    contribute (a transformer's keys and values) and compute the window alone. ``fn``
    promises that the values depend on ``x`` and ``start`` as ``fn(x)`` does: a cache entry
    is used only for positions that were final when it was made (a cache of a position that
    later changed is stale), and the values are those of positions ``start .. stop - 1``,
    in order, not shifted.
    """

    def window(self, x: torch.Tensor, start: int, stop: int,
               cache: Any) -> tuple[torch.Tensor, Any]: ...


@runtime_checkable
class SupportsPropose(Protocol):
    """``fn.propose(x, final)``: ``None``, or a tensor shaped like ``x`` (same dtype) whose
    values replace the positions that are not final; ``final`` ``(B,)`` long: the positions
    ``< final[b]`` of sample ``b`` are final.

    Called by :class:`~paraprop.solvers.SlidingJacobi` after each sweep (Jacobi decoding's
    n-gram guesses). The guesses never change the result (a position is accepted only when
    its inputs reproduce it). Promise: ``x`` is not modified (return a new tensor), and the
    guesses are finite (a NaN guess reaches earlier positions through masked weights:
    :class:`~paraprop.ProtocolError`).
    """

    def propose(self, x: torch.Tensor, final: torch.Tensor) -> torch.Tensor | None: ...


@runtime_checkable
class SupportsSensitivity(Protocol):
    """``fn.sensitivity``: ``None`` or a tensor of ``B * T`` values (``(B, T)``): how much a
    change at position ``i`` moves the later positions (``lam_i``; NaN: unknown, taken as 1).

    Read by :class:`~paraprop.solvers.SlidingJacobi` at ``tol > 0`` for a tighter freeze
    estimate. Promise: it is an upper bound of the map's sensitivity. It cannot be checked
    cheaply on the way; it affects only ``tol > 0`` certificates, whose final check
    (:mod:`paraprop.solvers.verify`) catches its effect: a residual ``|fn(x) - x|`` beyond what a
    value within ``tol`` can have (``tol=0`` is verified bitwise).
    """

    sensitivity: torch.Tensor | None


@runtime_checkable
class SupportsGrowth(Protocol):
    """``fn.growth``: ``None`` or a tensor of ``B * T`` values (``(B, T)``): how much an
    error at each position grows by the end of the chain (``>= 1`` for expanding maps).

    Read by :class:`~paraprop.solvers.SlidingJacobi` at ``tol > 0``: a freeze must fit its
    share of ``tol`` after that growth (a value below 1 counts as 1: the certificate bounds
    every position's error, not only the last one's); the final check allows a residual of
    ``growth[t - 1] / growth[t]`` (the step's gain) per unit of error. Promise: an upper bound,
    as for ``sensitivity``.
    """

    growth: torch.Tensor | None


@runtime_checkable
class SupportsLinearize(Protocol):
    """A Markov recurrence for the Newton family (``fn.markov = True``, e.g.
    :class:`paraprop.Recurrence`): ``fn.linearize(x, lo, form)`` returns ``(y, J)``, the
    values ``fn(x)`` at positions ``[lo, T)`` ``(B, T - lo, F)`` and the Jacobians
    ``d fn_t / d x_{t-1}`` there (``form="dense"``: ``(B, T - lo, F, F)``, ``"diag"``: their
    diagonals ``(B, T - lo, F)``, ``"any"``: either, or a factored form the scan accepts).

    Promise: ``y`` are ``fn``'s values (position ``t`` reads position ``t - 1`` only).
    """

    markov: bool

    def linearize(self, x: torch.Tensor, lo: int, form: str) -> tuple[torch.Tensor, Any]: ...


@runtime_checkable
class SupportsNewtonStep(Protocol):
    """``fn.newton_step(x, lo, form)``: the undamped Newton step fused (ParaGRU, ParaLSTM):
    ``(y, trial)``, both ``(B, T - lo, F)``, with ``y = fn(x)`` at ``[lo, T)`` and ``trial =
    x + delta`` there, ``delta`` the solution of ``delta_t = J_t delta_{t-1} + y_t - x_t``;
    or ``None`` for a ``form`` it does not fuse.

    Promise: the same values the driver would compute from :class:`SupportsLinearize`.
    """

    def newton_step(self, x: torch.Tensor, lo: int,
                    form: str) -> tuple[torch.Tensor, torch.Tensor] | None: ...


# the hooks as the messages name them
HOOKS = {
    "fn": "fn(x)",
    "update": "fn.update(x, index)",
    "window": "fn.window(x, start, stop, cache)",
    "propose": "fn.propose(x, final)",
    "sensitivity": "fn.sensitivity",
    "growth": "fn.growth",
    "linearize": "fn.linearize(x, lo, form)",
    "newton_step": "fn.newton_step(x, lo, form)",
}
