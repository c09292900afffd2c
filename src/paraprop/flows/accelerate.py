"""``accelerate``: the flow libraries' own sampling and inverse paths, by early-stopping passes.

:func:`accelerate` finds the autoregressive parts of a zuko, nflows or normflows flow and replaces
their fixed-pass inverse loop, on those instances only, by the solve of
:func:`paraprop.flows.parallel_inverse`. The library's own methods (zuko's ``flow(c).sample`` /
``rsample`` / ``rsample_and_log_prob`` / ``transform.inv``, nflows' ``Flow.sample`` /
``sample_and_log_prob`` / ``transform.inverse``, normflows' ``NormalizingFlow.sample`` /
``inverse`` / ``log_prob`` / ``forward_kld``) then run unchanged around it, and return bitwise
what they returned before at ``tol=0``, with the same gradients (implicit differentiation at the
fixed point, see :mod:`paraprop.flows.gradient`). The class is never modified.

What is checked when: the arguments of :func:`accelerate` at once; the flow's state (train mode
with dropout or another stochastic layer in an autoregressive network) at every accelerated
call, since ``flow.train()`` / ``flow.eval()`` may be switched at any time after
:func:`accelerate`.

Saving and copying: ``pickle`` / ``torch.save`` / ``copy.deepcopy`` of an accelerated flow
copies the flow, not the patch: the copy is the library's plain flow (apply :func:`accelerate`
to it for a handle of its own). The :class:`Accelerated` handle itself refuses to be pickled or
copied.

Settings assigned on the handle after :func:`accelerate` (``handle.tol = 0``) are checked at
once and honoured from the next call on; other attributes of the handle are read-only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

from torch import nn

from paraprop.flows import part_solve, patches
from paraprop.flows.inverse import LIBRARIES

# what each library's autoregressive parts are, for the error message
_PARTS = ("zuko's MaskedAutoregressiveTransform", "nflows' AutoregressiveTransform",
          "normflows' Autoregressive (MaskedAffineAutoregressive, the autoregressive "
          "rational-quadratic splines)")


class Accelerated:
    """The handle :func:`accelerate` returns: ``undo()`` restores the flow; a context manager
    that undoes on exit (also on an exception).

    Settings (assignable; checked as :func:`accelerate` checks them, and honoured from the next
    accelerated call on, by every part): ``method``, ``tol``, ``max_iters``, ``throw``. Every
    other attribute is read-only: assigning one raises ``AttributeError`` naming it.

    Attributes:
        flow: the accelerated flow.
        parts: the patched autoregressive modules (each library's, in module order).
        inversions, passes, library_passes: counters since :func:`accelerate`: autoregressive
            inverses solved, the passes (network evaluations, the final and differentiable
            ones included) they took, and the passes the library's own loops would have taken
            (never fewer: see :func:`paraprop.flows.parallel_inverse`).
        active: ``False`` once undone.
    """

    SETTINGS = ("method", "tol", "max_iters", "throw")
    # the instance's attributes, set through __dict__ (__setattr__ takes the settings only)
    flow: nn.Module
    parts: tuple[nn.Module, ...]
    active: bool
    _cfg: part_solve.Settings
    _counters: patches.Counters

    def __init__(self, flow: nn.Module, parts: Sequence[tuple[ModuleType, nn.Module]],
                 cfg: part_solve.Settings, names: dict[int, str] | None = None):
        d = self.__dict__
        d["flow"], d["parts"] = flow, tuple(p for _, p in parts)
        d["_cfg"], d["_counters"] = cfg, patches.Counters()
        if names is None:
            names = {id(m): name for name, m in flow.named_modules()}
        for adapter, part in parts:
            patches.install(part, adapter.ATTRIBUTE, adapter.accelerated,
                            patches.Patch(cfg, self._counters, adapter.ATTRIBUTE,
                                          where=names.get(id(part), "")))
        d["active"] = True

    # -- the settings: one Settings object shared by every part's patch ----------------------
    @property
    def method(self) -> str:
        """The solve's method (its name); assign a name or a solver object."""
        return self._cfg.solver.name

    @property
    def tol(self) -> float:
        return self._cfg.tol

    @property
    def max_iters(self) -> int | None:
        return self._cfg.max_iters

    @property
    def throw(self) -> bool:
        return self._cfg.throw

    def __setattr__(self, name: str, value) -> None:
        if name not in self.SETTINGS:
            what = ("is not a setting" if not hasattr(self, name) else "is read-only")
            raise AttributeError(
                f"Accelerated.{name} {what}: the settings that may be assigned after "
                f"paraprop.flows.accelerate are {', '.join(self.SETTINGS)} (honoured from the "
                "next accelerated call on); for anything else call undo() and accelerate the "
                "flow again")
        cfg = self._cfg
        new = part_solve.settings(value if name == "method" else cfg.solver,
                                  value if name == "tol" else cfg.tol,
                                  value if name == "max_iters" else cfg.max_iters,
                                  value if name == "throw" else cfg.throw)
        cfg.solver, cfg.tol, cfg.max_iters, cfg.throw = (new.solver, new.tol, new.max_iters,
                                                         new.throw)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Accelerated.{name} cannot be deleted")

    @property
    def inversions(self) -> int:
        return self._counters.inversions

    @property
    def passes(self) -> int:
        return self._counters.passes

    @property
    def library_passes(self) -> int:
        return self._counters.library_passes

    def undo(self) -> None:
        """Restore the library's own methods on every patched part (again: nothing)."""
        for part in self.parts:
            patches.remove(part)
        self.__dict__["active"] = False

    def __reduce__(self):
        raise TypeError(
            "an Accelerated handle (from paraprop.flows.accelerate) cannot be pickled or "
            "copied: it patches live modules. Pickle, torch.save or copy.deepcopy the flow "
            "itself instead: it loads (or copies) as the library's plain flow (call "
            "paraprop.flows.accelerate on the copy for a handle of its own); or call undo() "
            "first")

    def __enter__(self) -> Accelerated:
        return self

    def __exit__(self, *exc) -> Literal[False]:
        self.undo()
        return False

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return (f"Accelerated({type(self.flow).__name__}, {len(self.parts)} autoregressive "
                f"parts, method={self.method!r}, tol={self.tol}, {state})")


def accelerate(flow: nn.Module, *, method="jacobi", tol: float = 0.0,
               max_iters: int | None = None, throw: bool = True) -> Accelerated:
    """Make a flow library's own sampling and inverse use early-stopping parallel passes.

    Every autoregressive part of ``flow`` (zuko's ``MaskedAutoregressiveTransform``, nflows'
    ``AutoregressiveTransform``, normflows' ``Autoregressive`` layers, at any depth of ``flow``)
    has its inverse loop replaced on the instance by the solve of
    :func:`paraprop.flows.parallel_inverse`; everything else, and the class, stays the library's.
    Applied once it stays until ``undo()``; as a context manager it is undone on exit.

    At every accelerated call the autoregressive networks must be deterministic: one in train
    mode with dropout (or another stochastic layer, or a batch norm reading batch statistics)
    is refused with :class:`paraprop.StochasticModelError` (call ``flow.eval()``, or ``undo()``
    to run the library's own loop). Gradients are first order: a second differentiation
    (``create_graph=True`` then another backward, a gradient penalty) raises
    ``NotImplementedError`` instead of returning a wrong value. Pickling, ``torch.save`` and
    ``copy.deepcopy`` copy the plain flow (without the patch); the handle refuses to be pickled.
    Each inverse takes at most the passes of the library's own loop (see
    :func:`paraprop.flows.parallel_inverse`); a NaN or inf the library's loop computes raises
    :class:`paraprop.NonFiniteError` naming the part, the sample and the feature.

    Which calls get faster is where the library runs that loop: sampling for zuko and nflows
    (``flow().sample``, ``rsample``, ``Flow.sample``, ``sample_and_log_prob``) and for normflows'
    autoregressive splines (``NormalizingFlow.sample``); ``log_prob`` / ``inverse`` for
    normflows' ``MaskedAffineAutoregressive``, whose sampling direction is already one pass.

    Arguments:
        flow: a zuko ``Flow``, an nflows ``Flow`` or transform, a normflows ``NormalizingFlow``
            or layer, or any ``nn.Module`` holding such parts.
        method: the :func:`paraprop.solve` method of each inverse (name or solver object;
            default ``"jacobi"``, the library's own passes stopped early).
        tol: error bound of the early stop; ``0`` (default) stops at the bitwise fixed point:
            every result is bitwise the library's.
        max_iters: cap on passes per inverse (default: the exactness bound ``D``).
        throw: raise :class:`paraprop.ConvergenceError` when ``max_iters`` stops an inverse
            first; ``False`` uses the unconverged value.

    Returns:
        An :class:`Accelerated` handle (``undo()``, context manager, pass counters; its
        ``method``, ``tol``, ``max_iters`` and ``throw`` may be assigned later).

    Raises:
        TypeError: ``flow`` is not an ``nn.Module``; bad ``method`` or ``throw`` types.
        ValueError: ``flow`` has no autoregressive part of the three libraries, or is already
            accelerated (undo the earlier handle first); a bad ``method``, ``tol`` or
            ``max_iters``.
        NotImplementedError: a zuko ``MaskedAutoregressiveTransform`` built from an adjacency
            matrix (it has no feature order).
        paraprop.StochasticModelError: (at a call, not here) a stochastic autoregressive
            network.

    Example:
        >>> import zuko
        >>> flow = zuko.flows.MAF(20, transforms=2)
        >>> z = torch.randn(10, 20)
        >>> expected = flow().transform.inv(z)
        >>> with paraprop.flows.accelerate(flow) as handle:
        ...     x = flow().transform.inv(z)          # the library's own call, accelerated
        >>> torch.equal(x, expected), handle.passes < handle.library_passes, handle.active
        (True, True, False)
    """
    cfg = part_solve.settings(method, tol, max_iters, throw)
    if not isinstance(flow, nn.Module):
        raise TypeError(f"flow must be a zuko, nflows or normflows flow (an nn.Module), got "
                        f"{type(flow).__name__}")
    found = []
    named = list(flow.named_modules())   # one walk of the flow, for every library and the names
    modules = [m for _, m in named]
    for name, adapter in LIBRARIES.items():
        if name in sys.modules:   # a flow of a library that is not imported has no such parts
            found += [(adapter, p) for p in adapter.parts(flow, modules)]
    if not found:
        raise ValueError(f"flow has no autoregressive part to accelerate (looked for "
                         f"{'; '.join(_PARTS)}), "
                         f"got {type(flow).__name__}")
    done = [p for _, p in found if patches.is_patched(p)]
    if done:
        raise ValueError(f"flow is already accelerated ({len(done)} of its {len(found)} "
                         "autoregressive parts are patched): call undo() on the earlier "
                         "handle first")
    return Accelerated(flow, found, cfg, names={id(m): n for n, m in named})
