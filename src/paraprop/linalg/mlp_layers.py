"""An ``nn.Sequential`` MLP read as Linear layers and elementwise activation chains: the
parsed structure (cached per model), the activation points of a pass, the argument checks, and the
batched evaluation of all layers at once. Shared by :mod:`paraprop.linalg.mlp_systems` and
:mod:`paraprop.linalg.mlp`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from paraprop import checks
from paraprop.linalg.activations import (
    SUPPORTED,
    WITH_SETTINGS,
    chain_value_and_derivative,
    signature,
)

__all__ = ["ActivationPoints", "activation_points"]


@dataclass(frozen=True)
class ActivationPoints:
    """The points of one pass: what both systems are built from.

    Attributes:
        x: the input ``(B, n_0)``.
        inputs: ``inputs[k]`` is the input of Linear ``k`` (``z_{k-1}``; ``inputs[0]`` is ``x``
            after any leading activations).
        pre: ``pre[k] = y_k``, the output of Linear ``k`` (the activation points).
        output: the model's output ``z_l``.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> x = torch.randn(5, 3)
        >>> pts = paraprop.linalg.activation_points(net, x)
        >>> y0 = net[0](x)
        >>> torch.equal(pts.pre[0], y0), torch.equal(pts.inputs[1], torch.tanh(y0))
        (True, True)
        >>> torch.equal(pts.output, net(x))
        True
    """

    x: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    pre: tuple[torch.Tensor, ...]
    output: torch.Tensor


@dataclass(frozen=True)
class ParsedMLP:
    lead: tuple[tuple, ...]
    linears: tuple[nn.Linear, ...]
    chains: tuple[tuple[tuple, ...], ...]
    in_features: tuple[int, ...]
    out_features: tuple[int, ...]
    # model.parameters() order: per distinct parameter, its (layer, is_weight) occurrences
    slots: tuple[tuple[tuple[int, bool], ...], ...]
    uniform: bool  # every Linear is n x n with the same n


_PARSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def parse_mlp(model) -> ParsedMLP:
    """The Linear layers and activation chains of ``model`` (cached per model while its modules
    and their parameters are the same objects and its activations keep their settings)."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential, got {type(model).__name__}")
    modules = tuple(model)
    hit = _PARSED.get(model)
    if hit is not None and hit[0] == modules and hit[2] == _param_ids(hit[1].linears) and \
            hit[4] == tuple(signature(modules[i]) for i in hit[3]):
        return hit[1]
    lead: list[tuple] = []
    linears: list[nn.Linear] = []
    chains: list[list[tuple]] = []
    for i, m in enumerate(modules):
        if isinstance(m, nn.Linear):
            linears.append(m)
            chains.append([])
        elif isinstance(m, SUPPORTED):
            (chains[-1] if linears else lead).append(signature(m))
        else:
            names = ", ".join(c.__name__ for c in (nn.Linear, *SUPPORTED))
            raise TypeError(f"model[{i}] is {type(m).__name__}; supported modules: {names}")
    if not linears:
        raise ValueError("model must contain at least one nn.Linear")
    interned: dict = {}  # equal chains share one object: grouping compares by identity first
    slots: dict[int, list] = {}
    for k, lin in enumerate(linears):
        for p, is_w in ((lin.weight, True), (lin.bias, False)):
            if p is not None:
                slots.setdefault(id(p), []).append((k, is_w))
    ins = tuple(lin.in_features for lin in linears)
    outs = tuple(lin.out_features for lin in linears)
    parsed = ParsedMLP(tuple(lead), tuple(linears),
                     tuple(interned.setdefault(tuple(c), tuple(c)) for c in chains), ins, outs,
                     tuple(tuple(v) for v in slots.values()),
                     len(set(ins) | set(outs)) == 1)
    # activations with settings (LeakyReLU's slope, GELU's approximation): their signatures are
    # part of the cache key, so changing a setting after a call re-parses the model
    settable = tuple(i for i, m in enumerate(modules) if isinstance(m, WITH_SETTINGS))
    _PARSED[model] = (modules, parsed, _param_ids(parsed.linears), settable,
                      tuple(signature(modules[i]) for i in settable))
    return parsed


def _param_ids(linears) -> tuple:
    """Identity of every Linear's parameters (a replaced weight or bias invalidates the cache)."""
    return tuple((id(lin.weight), id(lin.bias)) for lin in linears)


def check_input(x, parsed: ParsedMLP, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    n0 = parsed.linears[0].in_features
    if x.dim() != 2 or x.shape[1] != n0:
        raise ValueError(f"{name} must have shape (B, {n0}), got {tuple(x.shape)}")
    checks.same_kind(name, x, parsed.linears[0].weight, "the model")
    return checks.finite(name, x).detach()


def group_by(keys: list) -> dict:
    if keys and all(k == keys[0] for k in keys):
        return {keys[0]: list(range(len(keys)))}
    out: dict = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return out


def chain_groups(chains, tensors) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """Every layer's chain evaluated in one batched call per distinct chain and width (a deep
    MLP has one or two): ``[(layer indices, stacked values, stacked derivatives or None)]``."""
    out = []
    for (chain, _), idx in group_by([(c, t.shape[-1]) for c, t in zip(chains, tensors,
                                                                       strict=True)]).items():
        v, d = chain_value_and_derivative(chain, torch.stack([tensors[i] for i in idx]))
        out.append((idx, v, d))
    return out


def per_layer(groups, l: int, which: int) -> list:
    """Per-layer views of the stacked values (``which=1``) or derivatives (``which=2``)."""
    out: list = [None] * l
    for g in groups:
        if g[which] is not None:
            for i, t in zip(g[0], g[which].unbind(0), strict=True):
                out[i] = t
    return out


def activation_points(model: nn.Sequential, x: torch.Tensor) -> ActivationPoints:
    """Run the forward pass once (no graph) and record its activation points.

    Arguments:
        model: ``nn.Sequential`` of Linear layers and ReLU, Tanh, Sigmoid, LeakyReLU, GELU or
            Identity.
        x: the input ``(B, in_features)``.

    Returns:
        :class:`ActivationPoints`; ``points.output`` equals ``model(x)``.

    Raises:
        TypeError / ValueError: unsupported modules, bad shapes, dtypes or devices, a
            non-finite ``x`` (named).

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> pts = activation_points(net, torch.randn(5, 3))
        >>> len(pts.pre), pts.output.shape
        (2, torch.Size([5, 2]))
    """
    parsed = parse_mlp(model)
    x = check_input(x, parsed)
    with torch.no_grad():
        z, _ = chain_value_and_derivative(parsed.lead, x)
        inputs, pre = [], []
        for lin, chain in zip(parsed.linears, parsed.chains, strict=True):
            inputs.append(z)
            y = torch.nn.functional.linear(z, lin.weight, lin.bias)
            pre.append(y)
            z, _ = chain_value_and_derivative(chain, y)
    return ActivationPoints(x, tuple(inputs), tuple(pre), z)


def check_points(points, parsed: ParsedMLP, x: torch.Tensor) -> None:
    if not isinstance(points, ActivationPoints):
        raise TypeError(f"points must be ActivationPoints, got {type(points).__name__}")
    if len(points.pre) != len(parsed.linears):
        raise ValueError(f"points has {len(points.pre)} layers but the model has "
                         f"{len(parsed.linears)} Linear layers")
    B = x.shape[0]
    if [y.shape for y in points.pre] != [(B, n) for n in parsed.out_features]:
        for k, (y, n) in enumerate(zip(points.pre, parsed.out_features, strict=True)):
            if tuple(y.shape) != (B, n):
                raise ValueError(f"points.pre[{k}] has shape {tuple(y.shape)}, expected "
                                 f"({B}, {n})")


def check_grad_output(grad_output, parsed: ParsedMLP, x: torch.Tensor) -> torch.Tensor:
    out = parsed.linears[-1].out_features
    if not isinstance(grad_output, torch.Tensor):
        raise TypeError(f"grad_output must be a torch.Tensor, got {type(grad_output).__name__}")
    if tuple(grad_output.shape) != (x.shape[0], out):
        raise ValueError(f"grad_output must have shape ({x.shape[0]}, {out}), got "
                         f"{tuple(grad_output.shape)}")
    checks.same_kind("grad_output", grad_output, x, "x")
    checks.finite("grad_output", grad_output)
    return grad_output.detach()


def linear_batched(linears, inputs) -> list[torch.Tensor]:
    """``y_k = W_k z_{k-1} + b_k`` for every layer, one batched product per group of equal
    shapes (all layers in one parallel step)."""
    out: list = [None] * len(linears)
    keys = [(tuple(lin.weight.shape), lin.bias is not None) for lin in linears]
    for (_, has_b), idx in group_by(keys).items():
        W = torch.stack([linears[k].weight for k in idx])
        Z = torch.stack([inputs[k] for k in idx])
        Y = torch.bmm(Z, W.transpose(1, 2))
        if has_b:
            Y = Y + torch.stack([linears[k].bias for k in idx]).unsqueeze(1)
        for j, k in enumerate(idx):
            out[k] = Y[j]
    return out

