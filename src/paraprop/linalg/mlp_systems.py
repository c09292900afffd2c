"""The two block bi-diagonal systems of an MLP (Naumov 2017, eq. 13/18 and 14/19), built at
activation points, and the parameter gradients read from the backward solution. See
:mod:`paraprop.linalg.mlp` for the equations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paraprop.linalg.activations import (
    chain_value_and_derivative,
)
from paraprop.linalg.mlp_layers import (
    ActivationPoints,
    ParsedMLP,
    activation_points,
    chain_groups,
    check_grad_output,
    check_input,
    check_points,
    group_by,
    parse_mlp,
    per_layer,
)
from paraprop.linalg.operators import MatrixOperator
from paraprop.linalg.system import BlockBidiagonal

__all__ = ["MLPSystems", "from_mlp"]


@dataclass(frozen=True)
class MLPSystems:
    """The systems of :func:`from_mlp`.

    Attributes:
        points: the activation points they are built at.
        forward, forward_rhs: the lower system in ``z_1..z_l`` and its right-hand side ``(B, N)``.
        backward, backward_rhs: the upper system in ``u_k = dL/dy_k`` and its right-hand side
            (``None`` unless ``grad_output`` was given).
        derivatives: ``f_k'(y_k)`` per layer ``(B, n_k)`` (``None`` for a layer without
            activation).

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        >>> x = torch.randn(5, 3, dtype=torch.float64)
        >>> S = from_mlp(net, x, grad_output=torch.ones(5, 2, dtype=torch.float64))
        >>> u = paraprop.linalg.solve(S.backward, S.backward_rhs).value   # u_k = dL/dy_k
        >>> y0 = net[0](x).detach().requires_grad_()                      # autograd's u_0
        >>> net[2](torch.tanh(y0)).sum().backward()
        >>> torch.allclose(S.backward.split(u)[0], y0.grad)
        True
    """

    points: ActivationPoints
    forward: BlockBidiagonal
    forward_rhs: torch.Tensor
    backward: BlockBidiagonal
    backward_rhs: torch.Tensor | None
    derivatives: tuple[torch.Tensor | None, ...]


def from_mlp(model: nn.Sequential, x: torch.Tensor, *, grad_output: torch.Tensor | None = None,
             points: ActivationPoints | None = None) -> MLPSystems:
    """Forward (lower) and backward (upper) block bi-diagonal systems of an MLP.

    Arguments:
        model: ``nn.Sequential`` of Linear layers and elementwise activations.
        x: the input ``(B, in_features)``.
        grad_output: ``dL/d output`` ``(B, out_features)``; builds ``backward_rhs``.
        points: activation points to linearise at (default: those of ``model(x)``). Points of
            another pass give the Newton linearisation used by :func:`mlp_forward`.

    Returns:
        :class:`MLPSystems`. Solving ``forward`` gives ``z_1..z_l`` (the last block is the
        output); solving ``backward`` gives ``u_k = dL/dy_k``.

    Raises:
        TypeError / ValueError: unsupported modules, shapes, dtypes or devices, a non-finite
            ``x`` or ``grad_output`` (named).

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
        >>> x = torch.randn(5, 3, dtype=torch.float64)
        >>> S = from_mlp(net, x, grad_output=torch.ones(5, 2, dtype=torch.float64))
        >>> z = paraprop.linalg.solve(S.forward, S.forward_rhs).value   # Naumov 2017, eq. 13
        >>> torch.allclose(S.forward.split(z)[-1], net(x))
        True
    """
    parsed = parse_mlp(model)
    x = check_input(x, parsed)
    if points is None:
        points = activation_points(model, x)
    else:
        check_points(points, parsed, x)
    if grad_output is not None:
        grad_output = check_grad_output(grad_output, parsed, x)
    with torch.no_grad():
        return build_systems(parsed, x, points, grad_output)


def build_systems(parsed: ParsedMLP, x, points: ActivationPoints, grad_output) -> MLPSystems:
    l = len(parsed.linears)
    groups = chain_groups(parsed.chains, list(points.pre))
    D = per_layer(groups, l, 2)
    neg_one = NegOnes(x)
    fwd, fwd_rhs = forward_system(parsed, x, points, per_layer(groups, l, 1), D, neg_one)
    bwd, b_rhs = backward_system(parsed, x, groups, D, grad_output, neg_one)
    return MLPSystems(points, fwd, fwd_rhs, bwd, b_rhs, tuple(D))


class NegOnes(dict):
    """``-1`` scalings ``(n,)`` for layers without activation, made once per width on demand."""

    def __init__(self, x: torch.Tensor):
        super().__init__()
        self.kw: dict[str, Any] = {"dtype": x.dtype, "device": x.device}

    def __missing__(self, n: int) -> torch.Tensor:
        t = self[n] = -torch.ones(n, **self.kw)
        return t


def backward_system(parsed: ParsedMLP, x, groups, D, grad_output, neg_one: NegOnes):
    """Block (k, k+1) = -E_k W_{k+1}^T, identity diagonal; right-hand side E_l g in the last
    block. ``groups``/``D``: the chain groups of all ``l`` layers and the per-layer derivatives
    (:func:`chain_groups`, :func:`per_layer`). When layers 1..l-1 share one activation chain
    and width (a deep MLP), their scalings are kept stacked."""
    lins, l = parsed.linears, len(parsed.linears)
    B = x.shape[0]
    sizes = [lin.out_features for lin in lins]
    weights = [lin.weight for lin in lins[1:]]  # block (k, k+1) is W_{k+1}^T
    d_last = D[-1]
    # E_l only scales the right-hand side: per-sample blocks only if some E_k, k < l, exists
    batch = B if any(d is not None for d in D[:-1]) else None
    first = list(range(l - 1))
    stacked = [g for g in groups if g[2] is not None and g[0][:l - 1] == first]
    if l > 1 and stacked:  # indices ascend, so rows :l-1 are layers 0..l-2
        bwd = BlockBidiagonal._trusted(False, None, [None] * l, None, sizes, batch, x.dtype,
                                       x.device, stacked_scale=-stacked[0][2][:l - 1],
                                       transposed_weights=weights, nested=False)
    else:
        b_scale = [neg_one[sizes[k]] if D[k] is None else -D[k] for k in range(l - 1)]
        bwd = BlockBidiagonal._trusted(False, None, [None] * l, b_scale, sizes, batch, x.dtype,
                                       x.device, transposed_weights=weights, nested=False)
    b_rhs = None
    if grad_output is not None:
        b_rhs = torch.zeros(B, sum(sizes), dtype=x.dtype, device=x.device)
        b_rhs[:, -sizes[-1]:] = grad_output if d_last is None else d_last * grad_output
    return bwd, b_rhs


def forward_only(parsed: ParsedMLP, x, points: ActivationPoints):
    """The forward system and its right-hand side alone (what each round of
    :func:`mlp_forward` needs); the inputs are trusted."""
    l = len(parsed.linears)
    groups = chain_groups(parsed.chains, list(points.pre))
    return forward_system(parsed, x, points, per_layer(groups, l, 1), per_layer(groups, l, 2),
                           NegOnes(x))


def forward_system(parsed, x, points, values, D, neg_one: NegOnes):
    """Block (k, k-1) = -D_k W_k; right-hand side D_k b_k + e_k (plus D_1 W_1 z_0 in block 1)."""
    lins, l = parsed.linears, len(parsed.linears)
    B = x.shape[0]
    sizes = [lin.out_features for lin in lins]
    # D_1 only scales the right-hand side: per-sample blocks only if some D_k, k > 1, exists
    batch = B if any(d is not None for d in D[1:]) else None
    z0, _ = chain_value_and_derivative(parsed.lead, x)
    f_off = [MatrixOperator(lins[k].weight) for k in range(1, l)]
    f_scale = [neg_one[sizes[k]] if D[k] is None else -D[k] for k in range(1, l)]
    rhs = []
    for k in range(l):
        b = lins[k].bias
        if k == 0:
            base = torch.nn.functional.linear(z0, lins[0].weight, b)
        elif b is None:
            base = torch.zeros(B, sizes[k], dtype=x.dtype, device=x.device)
        else:
            base = b.expand(B, sizes[k])
        rhs.append(base if D[k] is None else D[k] * base + (values[k] - D[k] * points.pre[k]))
    fwd = BlockBidiagonal._trusted(True, f_off, [None] * l, f_scale, sizes, batch, x.dtype,
                                   x.device)
    return fwd, torch.cat(rhs, dim=-1)


def gradients(parsed: ParsedMLP, points: ActivationPoints, value: torch.Tensor,
               sizes: list[int]):
    """``grad_input`` and the parameter gradients from ``u = (dL/dy_1, ..., dL/dy_l)``,
    all layers' weight gradients in one batched product per group of equal shapes."""
    lins, l = parsed.linears, len(parsed.linears)
    B = value.shape[0]
    gW: dict[int, torch.Tensor] = {}   # layer -> its weight's gradient
    gb: dict[int, torch.Tensor] = {}   # layer -> its bias's gradient
    if parsed.uniform:
        Us = value.reshape(B, l, sizes[0]).transpose(0, 1)  # (l, B, n), a view
        Xs = torch.stack(points.inputs)
        gW = dict(enumerate(torch.bmm(Us.transpose(1, 2), Xs).unbind(0)))
        gb = dict(enumerate(Us.sum(1).unbind(0)))
        u0 = Us[0]
    else:
        U = list(torch.split(value, sizes, dim=-1))
        for _, idx in group_by([(parsed.out_features[k], parsed.in_features[k])
                               for k in range(l)]).items():
            Us = torch.stack([U[k] for k in idx])
            Xs = torch.stack([points.inputs[k] for k in idx])
            for j, (w, b) in enumerate(zip(torch.bmm(Us.transpose(1, 2), Xs).unbind(0),
                                           Us.sum(1).unbind(0), strict=True)):
                gW[idx[j]], gb[idx[j]] = w, b
        u0 = U[0]
    params = []
    for occ in parsed.slots:  # model.parameters() order; a shared Linear's gradients summed
        g = None
        for k, is_w in occ:
            t = gW[k] if is_w else gb[k]
            g = t if g is None else g + t
        params.append(g)
    grad_input = u0 @ lins[0].weight
    if parsed.lead:
        _, d = chain_value_and_derivative(parsed.lead, points.x)
        grad_input = grad_input * d
    return grad_input, params

