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
        anchors: every tensor the gradients depend on: the incoming gradient (it has a graph
            under ``create_graph=True``) **and** the inputs of the computation being
            differentiated (a custom Function's ``ctx.saved_tensors``; for a gradient hook,
            the differentiable output it is registered on). The refusing node hangs from
            them, so that a second differentiation with respect to anything they depend on
            reaches it. An omitted one is a silent wrong answer: ``torch.autograd.grad`` of a
            gradient penalty with respect to the weights prunes a node that leads nowhere near
            them, and returns no contribution (``None`` with ``allow_unused=True``) instead of
            raising; the incoming gradient alone is not enough where it is a constant (a loss
            linear in the output).
    """
    leaves = [g.detach().requires_grad_() for g in grads]
    linked = [a for a in anchors if a.requires_grad]
    return _SecondOrderRefused.apply(message, len(leaves), *leaves, *linked)
