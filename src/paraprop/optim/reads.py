"""Forward mode: a parameter read through its module never shows a value whose update is pending.

Forward-fusion (:mod:`paraprop.optim.forward`) defers each bucket's update from ``step()`` to
the next forward. Code that reads the parameters in between (an EMA of the weights, SWA,
logging, a copy of the model) would see the values from before the step. So while a model is
fused in forward mode, the ``_parameters`` dict of each of its modules is a
:class:`FreshParams`: a ``dict`` that applies the pending update of the parameters it hands out.
That covers every read that goes through the module:

- ``module.weight``: ``nn.Module.__getattr__`` reads ``_parameters[name]``, which applies that
  parameter's bucket (also inside a forward, for a parameter read outside its own module);
- ``parameters()``, ``named_parameters()``, ``state_dict()``, ``load_state_dict()``,
  ``.to()``/``.double()`` and ``AveragedModel.update_parameters(model)`` iterate
  ``_parameters.items()``, which applies the buckets of that module's parameters first;
- ``copy.deepcopy`` (so ``AveragedModel(model)``) and pickling apply every pending update, then
  copy: the copy is an ordinary module with the updated parameters and without the fusion
  (deepcopy drops the fusion hooks; pickling replaces them by :func:`inert_hook`).

Applying an update before the forward that would have applied it is exact: it uses the
gradients and hyperparameters recorded at ``step()``, and nothing else reads them. Only the
overlap with the forward is lost for that step. One enumeration is left alone:
``nn.Module.zero_grad(set_to_none=True)`` (without ``overlap``) only drops ``.grad`` references
(the pending update holds its own), so it keeps the updates fused; with ``set_to_none=False`` it
applies them first and then zeroes the gradients, as the unfused optimizer would see them.

What cannot be caught is a reference taken earlier (``ps = list(model.parameters())`` before
``step()``, ``opt.param_groups[0]["params"]``): read between ``step()`` and the next forward it
holds the old value until the next forward or :meth:`~paraprop.optim.FusedOptimizer.flush`.

Tools that look at storages rather than values (memory accounting) and must not move the
updates out of the next forward read under :func:`without_applying`.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from types import FrameType

from torch import nn

# the per-module hook dicts a fusion engine registers into (deepcopy drops its entries)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
_ZERO_GRAD = nn.Module.zero_grad.__code__
_suspended = 0  # > 0 inside without_applying()


@contextmanager
def without_applying() -> Iterator[None]:
    """Reads through modules inside this block leave pending updates pending (stale values).

    For code that inspects storages, not values, and must not move the updates out of the next
    forward, e.g. counting the bytes alive between two steps. Copies (deepcopy, pickling) still
    apply every update.
    """
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


def inert_hook(*args, **kwargs) -> None:
    """What a fusion hook becomes in a pickled model: does nothing (the copy is not fused)."""


def _inert():
    return inert_hook


class Hook(partial):
    """A hook of a fusion engine; a copy of it (pickle, deepcopy) is :func:`inert_hook`.

    The engine holds a lock and a thread, which cannot be copied; a copied model is not fused.
    """

    def __reduce__(self):
        return (_inert, ())


class FreshParams(dict):
    """A module's ``_parameters`` under forward-mode fusion: reads apply pending updates.

    Attributes:
        engines: the forward engines whose pending updates this module's parameters may have
            (usually one).
    """

    __slots__ = ("engines", "module")

    def __init__(self, params: dict, engine, module: nn.Module):
        super().__init__(params)
        self.engines = [engine]
        self.module = module

    # reads of one parameter: module.weight, getattr, get_parameter
    def __getitem__(self, key):
        p = dict.__getitem__(self, key)
        if _suspended:
            return p
        for eng in self.engines:
            if eng.n_pending or eng.worker is not None:
                eng.ensure_fresh(p)
        return p

    def get(self, key, default=None):
        return self[key] if key in self else default

    # enumerations: parameters(), named_parameters(), state_dict(), _apply(), EMA/SWA updates
    def items(self):
        self._refresh()
        return dict.items(self)

    def values(self):
        self._refresh()
        return dict.values(self)

    def copy(self) -> dict:
        self._refresh()
        return dict.copy(self)

    def _refresh(self) -> None:
        if _suspended:
            return
        for eng in self.engines:
            if not (eng.n_pending or eng.worker is not None):
                continue
            stale = [p for p in dict.values(self) if p is not None and eng.is_pending(p)]
            if not stale or (eng.worker is None and _in_zero_grad_set_to_none()):
                continue
            for p in stale:
                eng.ensure_fresh(p)

    # copies: apply everything, then copy as a plain dict (the copy is not fused)
    def __reduce_ex__(self, protocol):
        for eng in self.engines:
            eng.flush()
        return (dict, (list(dict.items(self)),))

    def __deepcopy__(self, memo):
        for eng in self.engines:
            eng.flush()
        ours = set().union(*(eng.handle_ids() for eng in self.engines))
        _copy_hook_dicts_without(self.module, ours, memo)
        out: dict = {}
        memo[id(self)] = out
        for k, v in dict.items(self):
            out[k] = copy.deepcopy(v, memo)
        return out


def _copy_hook_dicts_without(module: nn.Module, ours: set[int], memo: dict) -> None:
    """Put copies of ``module``'s hook dicts without the entries ``ours`` into ``memo``.

    ``nn.Module`` creates ``_parameters`` before its hook dicts, so a deepcopy of the module
    copies this dict first and then finds the hook dicts in ``memo``: the copied module has the
    user's hooks and none of the fusion's. (Were the order ever different, the fusion hooks would
    be copied as :func:`inert_hook`.)
    """
    for name in _HOOK_DICTS:
        d = module.__dict__.get(name)
        if not isinstance(d, dict) or id(d) in memo or ours.isdisjoint(d):
            continue
        c = type(d)()
        memo[id(d)] = c
        memo.setdefault(id(memo), []).append(d)  # keep d alive, as copy.deepcopy does
        for k, v in d.items():
            if k not in ours:
                c[k] = copy.deepcopy(v, memo)


def _in_zero_grad_set_to_none() -> bool:
    """Whether an ``nn.Module.zero_grad(set_to_none=True)`` call is enumerating parameters."""
    f: FrameType | None = sys._getframe(2)
    for _ in range(8):  # items <- lambda <- _named_members <- named_parameters <- parameters
        if f is None:
            return False
        if f.f_code is _ZERO_GRAD:
            return bool(f.f_locals.get("set_to_none", True))
        f = f.f_back
    return False


def install(model: nn.Module, engine) -> None:
    """Make reads through each module of ``model`` apply ``engine``'s pending updates."""
    for m in model.modules():
        params = m.__dict__.get("_parameters")
        if isinstance(params, FreshParams):
            if engine not in params.engines:
                params.engines.append(engine)
        elif params is not None:
            m.__dict__["_parameters"] = FreshParams(params, engine, m)


def uninstall(model: nn.Module, engine) -> None:
    """Undo :func:`install` (a module's dict turns plain once no engine is left)."""
    for m in model.modules():
        params = m.__dict__.get("_parameters")
        if isinstance(params, FreshParams) and engine in params.engines:
            params.engines.remove(engine)
            if not params.engines:
                m.__dict__["_parameters"] = dict(dict.items(params))
