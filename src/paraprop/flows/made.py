"""The masked-MADE transforms of nflows and normflows: one pass of their inverse loop, the
inverse with its log|det J| by the part's solve, and the accelerated ``inverse`` both libraries'
parts get (nflows' ``AutoregressiveTransform`` and normflows' ``Autoregressive`` share the
``autoregressive_net`` / ``_elementwise_inverse`` pair: normflows' layers are ports of nflows').
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from paraprop.flows.arguments import functorch_active
from paraprop.flows.gradient import made_pass
from paraprop.flows.part_solve import refuse_random, tracked_solve
from paraprop.flows.passes import check_finite
from paraprop.flows.patches import check_accelerated, patch_name, patch_of


def made_step(part, y, context):
    """One pass of the nflows / normflows inverse loop: ``x -> f_x^{-1}(y)``."""
    return lambda x: part._elementwise_inverse(y, part.autoregressive_net(x, context))[0]


def made_inverse(part, y, context, order, cfg, record, *, where: str = ""):
    """``part.inverse(y, context)`` of an nflows ``AutoregressiveTransform`` or a normflows
    ``Autoregressive``: ``(outputs, logabsdet)`` of the last pass, at the fixed point, in at
    most the library's ``D`` passes (the last one gives both, with the gradient)."""
    passes = math.prod(y.shape[1:])   # the library's loop: one pass per input
    with refuse_random(where, y.device):
        with torch.no_grad():
            run = tracked_solve(made_step(part, y, context), y, order, cfg, passes=passes,
                                where=where)
        if torch.is_grad_enabled():
            outputs, ladj = made_pass(part, y, context, run.x, run.groups)
        else:
            outputs, ladj = part._elementwise_inverse(y, part.autoregressive_net(run.x,
                                                                                context))
    check_finite(outputs, where)
    record(run.solution(outputs.detach(), 1))
    return outputs, ladj


def accelerated_inverse(part, inputs: torch.Tensor, context: torch.Tensor | None,
                        order: Callable[[Any], torch.Tensor] | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``inverse(inputs, context)`` an accelerated nflows ``AutoregressiveTransform`` or
    normflows ``Autoregressive`` gets on its instance: the library's own loop under a
    :mod:`torch.func` transform, else the part checked for stochastic layers now (the mode may
    have changed since :func:`paraprop.flows.accelerate`) and inverted by :func:`made_inverse`
    with the patch's settings, its passes counted against the library's ``D``.

    Arguments:
        part: the patched part (the ``self`` of the bound method).
        inputs, context: as the library's ``inverse`` takes them.
        order: the rank of each feature of ``part`` (``None``: the natural order, nflows').
    """
    patch = patch_of(part)
    if functorch_active():   # torch.func: the library's own loop
        return patch.original(part)(inputs, context)
    check_accelerated(part)
    record = patch.recorder(math.prod(inputs.shape[1:]))
    return made_inverse(part, inputs, context,
                        None if order is None else order(part).to(inputs.device), patch.cfg,
                        record, where=patch_name(part))
