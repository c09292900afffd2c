"""zuko: binding a flow to its context, checking the arguments, walking the transform.

A zuko ``Flow`` is lazy: ``flow(c)`` builds a fresh ``NormalizingFlow`` whose transform holds one
``AutoregressiveTransform`` per ``MaskedAutoregressiveTransform`` module, with
``meta = partial(module.meta, c)`` and ``module.passes`` passes in its ``_inverse``. Sampling
(``sample`` / ``rsample`` / ``rsample_and_log_prob``) maps base draws through ``transform.inv``,
which calls that ``_inverse``. :func:`patch` therefore wraps the module's ``forward`` (on the
instance) so that every transform it builds carries the early-stopping ``_inverse``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from paraprop.flows import arguments, part_solve, patches

LIBRARY = "zuko"


def _lazy_classes():
    try:
        from zuko.lazy import Flow, LazyDistribution, LazyTransform
    except ImportError:  # zuko < 1.2
        from zuko.flows.core import Flow, LazyDistribution, LazyTransform
    return Flow, LazyDistribution, LazyTransform


# -- parallel_inverse -----------------------------------------------------------------------------
def inverse(t, y, context, cfg, record):
    """``t``'s inverse at ``y`` (``t`` a zuko Flow, lazy transform, NormalizingFlow or
    transform); the autoregressive parts solved by ``cfg``."""
    root = t
    t = _bind(t, context)
    _check(t, y)
    arguments.check_parts(root, [m for m in map(_module, _parts(t)) if m is not None])
    names = arguments.part_names(root)
    return _walk(t, y, cfg, record, names)


def _bind(t, context):
    """A zuko transform from a zuko Flow, lazy transform or transform."""
    from torch.distributions import Transform
    from zuko.distributions import NormalizingFlow

    Flow, LazyDistribution, LazyTransform = _lazy_classes()
    if isinstance(t, Flow | LazyTransform):
        if context is not None:
            arguments.check_like("context", context, arguments.reference(t), "flow")
        return t.transform(context) if isinstance(t, Flow) else t(context)
    if isinstance(t, LazyDistribution):
        raise TypeError(f"transform must be a zuko Flow, lazy transform or transform, got the "
                        f"distribution {type(t).__name__} (it has no transform)")
    if isinstance(t, NormalizingFlow):  # flow(c): the transform is bound to c
        t = t.transform
    if not isinstance(t, Transform):
        raise TypeError(f"transform must be a zuko Flow, lazy transform or transform, got "
                        f"{type(t).__name__}")
    if context is not None:
        raise ValueError("context must be None with a zuko transform, which is already bound "
                         "to its context: pass the flow itself with context=..., or "
                         f"flow(context).transform without it (got context of shape "
                         f"{tuple(context.shape)})")
    return t


def _parts(t):
    from zuko.transforms import AutoregressiveTransform, ComposedTransform

    return arguments.composed_parts(
        t, lambda m: m.transforms if isinstance(m, ComposedTransform) else None,
        lambda m: isinstance(m, AutoregressiveTransform))


def _module(t) -> nn.Module | None:
    """The MaskedAutoregressiveTransform module that built the transform ``t``."""
    lazy = getattr(getattr(t.meta, "func", None), "__self__", None)
    return lazy if isinstance(lazy, nn.Module) else None


def _check(t, y):
    """``y`` and the bound context of every autoregressive part against its network."""
    for part in _parts(t):
        lazy = _module(part)
        if lazy is None:
            continue
        order = getattr(lazy, "order", None)
        features = len(order) if isinstance(order, torch.Tensor) else None
        arguments.check_features(y, features, "flow")
        ref = arguments.reference(lazy)
        arguments.check_like("y", y, ref, "flow")
        meta = part.meta
        c = meta.args[0] if isinstance(meta, functools.partial) and meta.args else None
        first = next((m for m in getattr(lazy, "hyper", nn.Sequential()).modules()
                      if isinstance(m, nn.Linear)), None)
        if features is None or first is None:
            continue
        n_ctx = first.in_features - features
        if c is None and n_ctx > 0:
            raise ValueError(f"context is needed: the flow takes {n_ctx} context features; "
                             "pass the flow with context=..., or flow(context).transform")
        if c is None:
            continue
        if n_ctx == 0:
            raise ValueError(f"context must be None: the flow takes no context, got context "
                             f"of shape {tuple(c.shape)}")
        if not isinstance(c, torch.Tensor) or c.dim() < 1 or c.shape[-1] != n_ctx:
            got = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
            raise ValueError(f"context must have shape (N, {n_ctx}) ({n_ctx} context features "
                             f"of the flow), got {got}")
        arguments.check_like("context", c, ref, "flow")
        try:
            ok = torch.broadcast_shapes(c.shape[:-1], y.shape[:-1]) == y.shape[:-1]
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"context must have shape (N, {n_ctx}) with N = {y.shape[0]} "
                             f"(the rows of y) or 1, got {tuple(c.shape)}")


def _walk(t, y, cfg, record, names):
    from zuko.transforms import AutoregressiveTransform, ComposedTransform

    if isinstance(t, ComposedTransform):
        for part in reversed(t.transforms):
            y = _walk(part, y, cfg, record, names)
        return y
    if not isinstance(t, AutoregressiveTransform):
        return t.inv(y)
    lazy = _module(t)
    return _solve(t.meta, _order(lazy), y, cfg, record, passes=t.passes,
                  where=arguments.part_name(names, lazy))


def _order(lazy) -> torch.Tensor:
    order = getattr(lazy, "order", None)
    if not isinstance(order, torch.Tensor):
        raise NotImplementedError("zuko AutoregressiveTransform without a feature order (built "
                                  "from an adjacency matrix) is not supported")
    return order


def _solve(meta, order, y, cfg, record, *, passes, where):
    return part_solve.invert_part(lambda x: meta(x).inv(y), y, order.to(y.device), cfg,
                                  record, passes=passes, where=where)


# -- accelerate -----------------------------------------------------------------------------------
def parts(root: nn.Module, modules=None) -> list[nn.Module]:
    """The MaskedAutoregressiveTransform modules of ``root`` (checked: each has an order;
    ``modules``: ``root.modules()``, when the caller has them already)."""
    from zuko.flows.autoregressive import MaskedAutoregressiveTransform

    found = [m for m in (root.modules() if modules is None else modules)
             if isinstance(m, MaskedAutoregressiveTransform)]
    for m in found:
        if not isinstance(getattr(m, "order", None), torch.Tensor):
            raise NotImplementedError(f"flow contains a zuko MaskedAutoregressiveTransform built "
                                      f"from an adjacency matrix (no feature order): {m}")
    return found


ATTRIBUTE = "forward"   # patched on each part's instance


def accelerated(self, c=None):
    """``MaskedAutoregressiveTransform.forward`` with the early-stopping ``_inverse``: bound to
    the instance in place of the library's (:class:`paraprop.flows.patches.Bound`, so that a deep
    copy of the flow stays bound to its own modules). The network is checked for train-mode
    stochastic layers when the transform is inverted (the mode may change after
    ``accelerate``)."""
    patch = patches.patch_of(self)
    t = patch.original(self)(c)
    meta, passes, order = t.meta, t.passes, self.order

    def _inverse(y: torch.Tensor) -> torch.Tensor:
        if arguments.functorch_active():   # torch.func: the library's own loop
            return type(t)._inverse(t, y)
        patches.check_accelerated(self)
        if y.numel() == 0:   # nothing to solve: one pass gives the (empty) result
            return meta(torch.zeros_like(y)).inv(y)
        return _solve(meta, order, y, patch.cfg, patch.recorder(passes), passes=passes,
                      where=patches.patch_name(self))

    t._inverse = _inverse    # this transform only: zuko builds a fresh one per call
    return t
