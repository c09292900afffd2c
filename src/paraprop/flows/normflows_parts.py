"""normflows: checking the arguments, walking a flow, the autoregressive layers.

normflows' layers map latents to data in ``forward`` and back in ``inverse``;
``NormalizingFlow.sample`` runs every layer's ``forward``, ``inverse`` / ``log_prob`` /
``forward_kld`` every layer's ``inverse`` in reverse order. The autoregressive layers are
ports of nflows': an ``Autoregressive`` module (``MaskedAffineAutoregressive``, and
``MaskedPiecewiseRationalQuadraticAutoregressive``) whose ``inverse`` runs ``D`` passes of its
MADE. Which direction that loop lies on depends on the layer:

- ``MaskedAffineAutoregressive`` is itself the ``Autoregressive`` module: its ``forward``
  (sampling) is one pass, its ``inverse`` (``log_prob``, ``NormalizingFlow.inverse``) the loop;
- ``AutoregressiveRationalQuadraticSpline`` and ``CircularAutoregressiveRationalQuadraticSpline``
  wrap one in ``.mprqat`` the other way round: their ``forward`` (sampling) is
  ``mprqat.inverse``, the loop, and their ``inverse`` one pass of ``mprqat``.

:func:`accelerated` replaces the loop (``Autoregressive.inverse``) on each such module's instance,
so every path that runs it is accelerated and every other path is untouched. A MADE built with
``permute_mask=True`` (the circular spline's default) orders its inputs by a permutation, read
from its output degrees.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paraprop.flows import arguments, made, part_solve

LIBRARY = "normflows"


def _autoregressive():
    from normflows.flows.affine.autoregressive import Autoregressive

    return Autoregressive


def order(part) -> torch.Tensor:
    """The rank of each input of ``part``'s MADE (``degree - 1``): its output degrees repeat each
    input's degree ``multiplier`` times in a row (normflows' ``tile``)."""
    net = part.autoregressive_net
    features = net.initial_layer.in_features
    degrees = net.final_layer.degrees
    return degrees[:: len(degrees) // features] - 1


# -- parallel_inverse -----------------------------------------------------------------------------
def inverse(t, y, context, cfg, record):
    """``t.inverse(y)[0]`` (``t.inverse(y, context=context)[0]`` with a context) of a normflows
    ``NormalizingFlow`` or layer."""
    from normflows.core import ConditionalNormalizingFlow, NormalizingFlow
    from normflows.flows import Flow

    if not isinstance(t, NormalizingFlow | Flow):
        raise TypeError(f"transform must be a normflows NormalizingFlow or flow layer, got "
                        f"{type(t).__name__}")
    if isinstance(t, NormalizingFlow) and not isinstance(t, ConditionalNormalizingFlow):
        if context is not None:
            raise ValueError(f"context must be None: a normflows NormalizingFlow takes no "
                             f"context (a ConditionalNormalizingFlow does), got context of "
                             f"shape {tuple(context.shape)}")
        _check(t, y, None, contexts=False)
    else:
        _check(t, y, context, contexts=True)
    arguments.check_parts(t, _solved(t))
    return _walk(t, y, context, cfg, record, arguments.part_names(t))


def _check(t, y, context, *, contexts: bool):
    ref = arguments.reference(t)
    arguments.check_like("y", y, ref, "flow")
    if context is not None:
        arguments.check_like("context", context, ref, "flow")
    for part in t.modules():
        if not isinstance(part, _autoregressive()):
            continue
        net = part.autoregressive_net
        arguments.check_features(y, net.initial_layer.in_features, "flow")
        if contexts:
            n_ctx = getattr(getattr(net, "context_layer", None), "in_features", None)
            arguments.check_context_rows(y, context, n_ctx, type(part).__name__)


def _solved(t):
    """The autoregressive layers :func:`_walk` solves (others run their own inverse)."""
    from normflows.core import NormalizingFlow
    from normflows.flows import Composite

    def members(m):
        return m.flows if isinstance(m, NormalizingFlow) else \
            m._flows if isinstance(m, Composite) else None

    kind = _autoregressive()
    return arguments.composed_parts(t, members, lambda m: isinstance(m, kind))


def _walk(t, y, context, cfg, record, names):
    from normflows.core import NormalizingFlow
    from normflows.flows import Composite

    if isinstance(t, NormalizingFlow):
        for layer in reversed(t.flows):
            y = _walk(layer, y, context, cfg, record, names)
        return y
    if isinstance(t, Composite):
        for layer in reversed(t._flows):
            y = _walk(layer, y, None, cfg, record, names)
        return y
    if isinstance(t, _autoregressive()):
        return part_solve.invert_part(made.made_step(t, y, context), y, order(t).to(y.device),
                                      cfg, record, passes=math.prod(y.shape[1:]),
                                      where=arguments.part_name(names, t))
    return (t.inverse(y) if context is None else t.inverse(y, context=context))[0]


# -- accelerate -----------------------------------------------------------------------------------
def parts(root: nn.Module, modules=None) -> list[nn.Module]:
    """The ``Autoregressive`` modules of ``root`` (``modules``: ``root.modules()``, when the
    caller has them already)."""
    kind = _autoregressive()
    return [m for m in (root.modules() if modules is None else modules) if isinstance(m, kind)]


ATTRIBUTE = "inverse"   # patched on each part's instance


def accelerated(self, inputs, context=None):
    """``Autoregressive.inverse`` by the early-stopping solve (bound to the instance)."""
    return made.accelerated_inverse(self, inputs, context, order)
