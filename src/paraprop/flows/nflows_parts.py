"""nflows: binding a flow to its context, checking the arguments, walking the transform.

nflows' transforms map data to noise; ``Flow.sample`` / ``sample_and_log_prob`` map noise back
with ``transform.inverse(noise, context)``, where a ``CompositeTransform`` inverts its parts in
reverse order and an ``AutoregressiveTransform`` runs ``D`` passes of its MADE. :func:`accelerated`
replaces that ``inverse`` on the instance; every caller (``sample``, ``sample_and_log_prob``,
``transform.inverse``, an ``InverseTransform``'s forward) then runs the early-stopping solve.
nflows' MADE gives input ``i`` the degree ``i + 1``: the natural order.
"""

from __future__ import annotations

import math

from torch import nn

from paraprop.flows import arguments, made, part_solve

LIBRARY = "nflows"


# -- parallel_inverse -----------------------------------------------------------------------------
def inverse(t, y, context, cfg, record):
    """``t.inverse(y, context)[0]`` of an nflows transform, or of an nflows ``Flow``'s transform
    with ``context`` passed through its embedding net (as ``Flow.sample`` does)."""
    root = t
    t, context = _bind(t, context)
    _check(t, y, context)
    arguments.check_parts(root, _solved(t))
    return _walk(t, y, context, cfg, record, arguments.part_names(root))


def _bind(t, context):
    from nflows.transforms import Transform

    inner = getattr(t, "_transform", None)
    if not isinstance(t, Transform) and isinstance(inner, Transform):  # an nflows Flow
        if context is not None:
            arguments.check_like("context", context, arguments.reference(t), "flow")
            embed = getattr(t, "_embedding_net", None)
            if embed is not None:
                context = embed(context)
        return inner, context
    if not isinstance(t, Transform):
        raise TypeError(f"transform must be an nflows Flow or transform, got "
                        f"{type(t).__name__}")
    return t, context


def _check(t, y, context):
    ref = arguments.reference(t)
    arguments.check_like("y", y, ref, "transform")
    if context is not None:
        arguments.check_like("context", context, ref, "transform")
    for part in parts(t):
        net = part.autoregressive_net
        arguments.check_features(
            y, getattr(getattr(net, "initial_layer", None), "in_features", None), "transform")
        n_ctx = getattr(getattr(net, "context_layer", None), "in_features", None)
        arguments.check_context_rows(y, context, n_ctx, type(part).__name__)


def _solved(t):
    """The autoregressive transforms :func:`_walk` solves (others run their own inverse)."""
    from nflows.transforms import CompositeTransform
    from nflows.transforms.autoregressive import AutoregressiveTransform

    return arguments.composed_parts(
        t, lambda m: m._transforms if isinstance(m, CompositeTransform) else None,
        lambda m: isinstance(m, AutoregressiveTransform))


def _walk(t, y, context, cfg, record, names):
    from nflows.transforms import CompositeTransform
    from nflows.transforms.autoregressive import AutoregressiveTransform

    if isinstance(t, CompositeTransform):
        for part in reversed(list(t._transforms)):
            y = _walk(part, y, context, cfg, record, names)
        return y
    if not isinstance(t, AutoregressiveTransform):
        return t.inverse(y, context)[0]
    return part_solve.invert_part(made.made_step(t, y, context), y, None, cfg, record,
                                  passes=math.prod(y.shape[1:]),
                                  where=arguments.part_name(names, t))


# -- accelerate -----------------------------------------------------------------------------------
def parts(root: nn.Module, modules=None) -> list[nn.Module]:
    """The autoregressive transforms of ``root`` (``modules``: ``root.modules()``, when the
    caller has them already)."""
    from nflows.transforms.autoregressive import AutoregressiveTransform

    return [m for m in (root.modules() if modules is None else modules)
            if isinstance(m, AutoregressiveTransform)]


ATTRIBUTE = "inverse"   # patched on each part's instance


def accelerated(self, inputs, context=None):
    """``AutoregressiveTransform.inverse`` by the early-stopping solve (bound to the instance;
    nflows' MADE orders the features naturally)."""
    return made.accelerated_inverse(self, inputs, context, None)
