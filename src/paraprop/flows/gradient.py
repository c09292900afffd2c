"""The gradient of a part's inverse, by implicit differentiation at the fixed point.

The libraries differentiate through all their passes. paraprop solves without a graph and
attaches the gradient of the fixed point instead (``x* = h(x*; y, θ)`` gives
``dx* = (I - N)^{-1} ∂h``, ``N = ∂h/∂x`` strictly triangular): the final pass ``h(x*)``,
differentiable (the same value, bitwise), whose incoming gradient ``v`` a hook replaces by
``u = (I - N)^{-T} v``, found by the iteration ``u <- v + N^T u`` (exact after ``groups - 1``
steps, or earlier at its bitwise fixed point; :func:`implicit`). nflows / normflows return
log|det J| with the inverse: their final pass hooks the conditionals' parameters instead
(:func:`made_pass`), one network evaluation for both.

First-order gradients only: the hook's products are not themselves differentiated, and under
``create_graph=True`` they carry a node that refuses a second differentiation
(:func:`paraprop.first_order.refuse_second_order`) rather than give a wrong second derivative.
That node hangs from the incoming gradient *and* from the differentiable pass itself, so every
second differentiation reaches it: with respect to the flow's parameters, the inverted points or
the context, whether or not the incoming gradient depends on them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paraprop.first_order import refuse_second_order

SECOND_ORDER = (
    "paraprop.flows computes the gradients of an inverse by implicit differentiation, first "
    "order only: differentiating them again (double backward, create_graph=True followed by "
    "another backward or grad, gradient penalties, hessians) is not supported; for that, run "
    "the library's own inverse: call undo() on the paraprop.flows.accelerate handle (or use "
    "the flow outside its `with` block), or call the library instead of parallel_inverse")


def implicit(h, x_star: torch.Tensor, groups: int) -> torch.Tensor:
    """``h(x_star)`` (bitwise the inverse when ``x_star`` is exact on every group but the
    last) carrying the gradient of the fixed point: the gradient arriving at it is replaced by
    ``(I - N)^{-T} v``, ``N = ∂h/∂x``."""
    out = h(x_star)
    if not out.requires_grad:   # nothing upstream needs a gradient
        return out

    def adjoint(v: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x0 = x_star.detach().requires_grad_(True)
            hx = h(x0)
            u = neumann(v, lambda w: torch.autograd.grad(hx, x0, w, retain_graph=True)[0],
                         groups)
        if torch.is_grad_enabled():   # a graph is wanted (create_graph=True): u has none
            # u depends on v and, through N, on everything `out` depends on (parameters,
            # points, context): the refusing node hangs from both, so that a second
            # differentiation with respect to any of them reaches it (anchored on v alone, a
            # gradient penalty with a constant incoming gradient went silently wrong)
            (u,) = refuse_second_order(SECOND_ORDER, u, anchors=(v, out))
        return u

    out.register_hook(adjoint)
    return out


def neumann(v: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor],
             groups: int) -> torch.Tensor:
    """``u = (I - N^T)^{-1} v`` for ``N`` strictly triangular over ``groups`` groups:
    ``u_k = v + N^T u_{k-1}`` is exact on its last ``k + 1`` groups, so ``u_{groups-1}`` is
    ``u`` (``product(w) = N^T w``); it stops earlier at a bitwise fixed point."""
    u = v
    for _ in range(max(groups - 1, 0)):
        nu = v + product(u)
        if torch.equal(nu, u):
            break
        u = nu
    return u


def made_pass(part, y, context, x_in: torch.Tensor, groups: int):
    """The last pass, differentiable: ``(outputs, logabsdet)`` at ``x_in`` with the gradient of
    the fixed point, in one network evaluation.

    With ``p = net(x)`` the conditionals' parameters and ``x = g(y, p)`` the elementwise inverse,
    the fixed point is ``p* = net(g(y, p*))``, triangular like ``x*``. A hook on ``p`` replaces
    the gradient arriving there (from the outputs and from log|det|) by ``(I - M)^{-T} w``,
    ``M = ∂net/∂x ∂g/∂p`` (:func:`neumann`); ``p``'s own backward then gives the parameters and
    the context their gradients, and the network's input, linked to ``y`` by
    :class:`_Attach`, the part of ``y``'s that runs through ``x*``."""
    net, inverse = part.autoregressive_net, part._elementwise_inverse
    holder: dict = {}
    xq = _Attach.apply(x_in, y, holder, inverse) if y.requires_grad else x_in
    p = net(xq, context)
    holder["p"] = p.detach()
    outputs, ladj = inverse(y, p)
    if not p.requires_grad:
        return outputs, ladj

    def adjoint(w: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x0 = x_in.detach().requires_grad_(True)
            p0 = net(x0, None if context is None else context.detach())
            pl = p0.detach().requires_grad_(True)
            o0 = inverse(y.detach(), pl)[0]

            def product(u):   # M^T u
                (gx,) = torch.autograd.grad(p0, x0, u, retain_graph=True)
                return torch.autograd.grad(o0, pl, gx, retain_graph=True)[0]

            u = neumann(w, product, groups)
        if torch.is_grad_enabled():   # create_graph=True: refuse a second differentiation
            (u,) = refuse_second_order(SECOND_ORDER, u, anchors=(w, p))
        return u

    p.register_hook(adjoint)
    return outputs, ladj


class _Attach(torch.autograd.Function):
    """``x`` (its value) linked to the points ``y``: the gradient arriving at ``x`` goes on to
    ``y`` through ``x = g(y, p)`` at the pass's parameters (``holder["p"]``, set after the
    pass); ``x`` itself gets none (it is a value of the solve, not of the graph)."""

    @staticmethod
    def forward(ctx, x, y, holder, inverse):
        ctx.save_for_backward(y)
        ctx.holder, ctx.inverse = holder, inverse
        return x.detach().clone()

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        with torch.enable_grad():
            yl = y.detach().requires_grad_(True)
            out = ctx.inverse(yl, ctx.holder["p"])[0]
            (gy,) = torch.autograd.grad(out, yl, g)
        if torch.is_grad_enabled():
            (gy,) = refuse_second_order(SECOND_ORDER, gy, anchors=(g, y))
        return None, gy, None, None
