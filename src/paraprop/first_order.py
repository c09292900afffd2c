"""First-order gradients that refuse a second differentiation with a message, not a wrong answer.

paraprop's backward passes (the scan backward of :mod:`paraprop.nn`, the implicit gradients of
:mod:`paraprop.flows`) compute gradients without a graph of their own computation. Under
``create_graph=True`` torch would differentiate the result as if it were a constant of that
computation and return a wrong second derivative; :func:`refuse_second_order` gives such
gradients a node that raises ``NotImplementedError`` instead.
"""

from __future__ import annotations

import torch


class _SecondOrderRefused(torch.autograd.Function):
    """Carries first-order gradients; differentiating them again raises NotImplementedError."""

    @staticmethod
    def forward(ctx, message, count, *tensors):
        ctx.message = message
        return tuple(g.clone() for g in tensors[:count])

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(ctx.message)


def refuse_second_order(message: str, *grads: torch.Tensor,
                        anchors: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, ...]:
    """``grads`` (the same values), each carrying a node that raises
    ``NotImplementedError(message)`` when differentiated: for a backward that runs with a graph
    wanted (``torch.is_grad_enabled()`` inside it) but computes its gradients without one.

    Arguments:
        message: what the error says.
        grads: the gradients, computed without a graph.
        anchors: tensors whose graphs the gradients came from (e.g. the incoming gradient of a
            hook, which has a graph under ``create_graph=True``): the refusing node hangs from
            them too, so that a second differentiation with respect to what they depend on
            reaches it (without them the gradients would look independent of those inputs).
    """
    leaves = [g.detach().requires_grad_() for g in grads]
    linked = [a for a in anchors if a.requires_grad]
    return _SecondOrderRefused.apply(message, len(leaves), *leaves, *linked)
