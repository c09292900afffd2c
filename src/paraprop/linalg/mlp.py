"""An MLP's forward and backward propagation as block bi-diagonal systems (Naumov 2017, §2-3).

For ``nn.Sequential`` of ``l`` Linear layers, each followed by a (possibly empty) chain of
elementwise activations ``f_k``, with ``y_k = W_k z_{k-1} + b_k`` and ``z_k = f_k(y_k)``:

* backward propagation (eq. 14/19) is the upper system in ``u_k = dL/dy_k``::

      u_k - E_k W_{k+1}^T u_{k+1} = 0   (k < l),      u_l = E_l g,      E_k = diag f_k'(y_k)

* forward propagation (eq. 13/18), linearised at activation points ``y*_k`` (the tangent
  ``f_k(y) ~ D_k y + e_k`` with ``D_k = diag f_k'(y*_k)``, ``e_k = f_k(y*_k) - D_k y*_k``, exact
  at ``y*``), is the lower system in ``z_k``::

      z_k - D_k W_k z_{k-1} = D_k b_k + e_k   (k > 1),      z_1 = D_1 (W_1 z_0 + b_1) + e_1

The scalings sit in the off-diagonal blocks and the diagonal is the identity, so ReLU's zero
derivatives leave the systems nonsingular. With the points of the same input the forward system
reproduces the pass; with the points of a previous pass (the paper's §2 remark) the solve is a
Newton step, iterated by :func:`mlp_forward` to the fixed point.
"""

from __future__ import annotations

import time
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
from paraprop.linalg.driver import DEFAULT_TOL, check_solver_args, solve
from paraprop.linalg.operators import MatrixOperator
from paraprop.linalg.system import BlockBidiagonal
from paraprop.result import Solution, ensure_converged

__all__ = ["ActivationPoints", "MLPSystems", "activation_points", "from_mlp", "mlp_backward",
           "mlp_forward"]


@dataclass(frozen=True)
class ActivationPoints:
    """The points of one pass: what both systems are built from.

    Attributes:
        x: the input ``(B, n_0)``.
        inputs: ``inputs[k]`` is the input of Linear ``k`` (``z_{k-1}``; ``inputs[0]`` is ``x``
            after any leading activations).
        pre: ``pre[k] = y_k``, the output of Linear ``k`` (the activation points).
        output: the model's output ``z_l``.
    """

    x: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    pre: tuple[torch.Tensor, ...]
    output: torch.Tensor


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
    """

    points: ActivationPoints
    forward: BlockBidiagonal
    forward_rhs: torch.Tensor
    backward: BlockBidiagonal
    backward_rhs: torch.Tensor | None
    derivatives: tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class _Parsed:
    lead: tuple[tuple, ...]
    linears: tuple[nn.Linear, ...]
    chains: tuple[tuple[tuple, ...], ...]
    in_features: tuple[int, ...]
    out_features: tuple[int, ...]
    # model.parameters() order: per distinct parameter, its (layer, is_weight) occurrences
    slots: tuple[tuple[tuple[int, bool], ...], ...]
    uniform: bool  # every Linear is n x n with the same n


_PARSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _parse(model) -> _Parsed:
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
    parsed = _Parsed(tuple(lead), tuple(linears),
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


def _check_input(x, parsed: _Parsed, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    n0 = parsed.linears[0].in_features
    if x.dim() != 2 or x.shape[1] != n0:
        raise ValueError(f"{name} must have shape (B, {n0}), got {tuple(x.shape)}")
    w = parsed.linears[0].weight
    if x.dtype != w.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the model has {w.dtype}")
    if torch.device(x.device) != torch.device(w.device):
        raise TypeError(f"{name} is on {x.device} but the model is on {w.device}")
    _check_finite(x, name)
    return x.detach()


def _check_finite(t: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` and its first NaN or inf entry."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} must be finite; entry {idx} of shape {tuple(t.shape)} is "
                         f"{float(t[idx])}")


def _groups(keys: list) -> dict:
    if keys and all(k == keys[0] for k in keys):
        return {keys[0]: list(range(len(keys)))}
    out: dict = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return out


def _chain_groups(chains, tensors) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """Every layer's chain evaluated in one batched call per distinct chain and width (a deep
    MLP has one or two): ``[(layer indices, stacked values, stacked derivatives or None)]``."""
    out = []
    for (chain, _), idx in _groups([(c, t.shape[-1]) for c, t in zip(chains, tensors,
                                                                       strict=True)]).items():
        v, d = chain_value_and_derivative(chain, torch.stack([tensors[i] for i in idx]))
        out.append((idx, v, d))
    return out


def _per_layer(groups, l: int, which: int) -> list:
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
    parsed = _parse(model)
    x = _check_input(x, parsed)
    with torch.no_grad():
        z, _ = chain_value_and_derivative(parsed.lead, x)
        inputs, pre = [], []
        for lin, chain in zip(parsed.linears, parsed.chains, strict=True):
            inputs.append(z)
            y = torch.nn.functional.linear(z, lin.weight, lin.bias)
            pre.append(y)
            z, _ = chain_value_and_derivative(chain, y)
    return ActivationPoints(x, tuple(inputs), tuple(pre), z)


def _check_points(points, parsed: _Parsed, x: torch.Tensor) -> None:
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

    Example (Naumov 2017, eq. 13-14):
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
        >>> x = torch.randn(5, 3, dtype=torch.float64)
        >>> S = from_mlp(net, x, grad_output=torch.ones(5, 2, dtype=torch.float64))
        >>> z = solve(S.forward, S.forward_rhs).value
        >>> torch.allclose(S.forward.split(z)[-1], net(x))
        True
    """
    parsed = _parse(model)
    x = _check_input(x, parsed)
    if points is None:
        points = activation_points(model, x)
    else:
        _check_points(points, parsed, x)
    if grad_output is not None:
        grad_output = _check_grad_output(grad_output, parsed, x)
    with torch.no_grad():
        return _build(parsed, x, points, grad_output)


def _check_grad_output(grad_output, parsed: _Parsed, x: torch.Tensor) -> torch.Tensor:
    out = parsed.linears[-1].out_features
    if not isinstance(grad_output, torch.Tensor):
        raise TypeError(f"grad_output must be a torch.Tensor, got {type(grad_output).__name__}")
    if tuple(grad_output.shape) != (x.shape[0], out):
        raise ValueError(f"grad_output must have shape ({x.shape[0]}, {out}), got "
                         f"{tuple(grad_output.shape)}")
    if grad_output.dtype != x.dtype:
        raise TypeError(f"grad_output has dtype {grad_output.dtype} but x has {x.dtype}")
    if torch.device(grad_output.device) != torch.device(x.device):
        raise TypeError(f"grad_output is on {grad_output.device} but x is on {x.device}")
    _check_finite(grad_output, "grad_output")
    return grad_output.detach()


def _build(parsed: _Parsed, x, points: ActivationPoints, grad_output) -> MLPSystems:
    l = len(parsed.linears)
    groups = _chain_groups(parsed.chains, list(points.pre))
    D = _per_layer(groups, l, 2)
    neg_one = _NegOnes(x)
    fwd, fwd_rhs = _forward_system(parsed, x, points, _per_layer(groups, l, 1), D, neg_one)
    bwd, b_rhs = _backward_system(parsed, x, groups, D, grad_output, neg_one)
    return MLPSystems(points, fwd, fwd_rhs, bwd, b_rhs, tuple(D))


class _NegOnes(dict):
    """``-1`` scalings ``(n,)`` for layers without activation, made once per width on demand."""

    def __init__(self, x: torch.Tensor):
        super().__init__()
        self.kw = {"dtype": x.dtype, "device": x.device}

    def __missing__(self, n: int) -> torch.Tensor:
        t = self[n] = -torch.ones(n, **self.kw)
        return t


def _backward_system(parsed: _Parsed, x, groups, D, grad_output, neg_one: _NegOnes):
    """Block (k, k+1) = -E_k W_{k+1}^T, identity diagonal; right-hand side E_l g in the last
    block. ``groups``/``D``: the chain groups of all ``l`` layers and the per-layer derivatives
    (:func:`_chain_groups`, :func:`_per_layer`). When layers 1..l-1 share one activation chain
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


def _forward_only(parsed: _Parsed, x, points: ActivationPoints):
    """The forward system and its right-hand side alone (what each round of
    :func:`mlp_forward` needs); the inputs are trusted."""
    l = len(parsed.linears)
    groups = _chain_groups(parsed.chains, list(points.pre))
    return _forward_system(parsed, x, points, _per_layer(groups, l, 1), _per_layer(groups, l, 2),
                           _NegOnes(x))


def _forward_system(parsed, x, points, values, D, neg_one: _NegOnes):
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


def _gradients(parsed: _Parsed, points: ActivationPoints, value: torch.Tensor,
               sizes: list[int]):
    """``grad_input`` and the parameter gradients from ``u = (dL/dy_1, ..., dL/dy_l)``,
    all layers' weight gradients in one batched product per group of equal shapes."""
    lins, l = parsed.linears, len(parsed.linears)
    B = value.shape[0]
    gW: list = [None] * l
    gb: list = [None] * l
    if parsed.uniform:
        Us = value.reshape(B, l, sizes[0]).transpose(0, 1)  # (l, B, n), a view
        Xs = torch.stack(points.inputs)
        gW = torch.bmm(Us.transpose(1, 2), Xs).unbind(0)
        gb = Us.sum(1).unbind(0)
        u0 = Us[0]
    else:
        U = list(torch.split(value, sizes, dim=-1))
        for _, idx in _groups([(parsed.out_features[k], parsed.in_features[k])
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


def mlp_backward(model: nn.Sequential, x: torch.Tensor, grad_output: torch.Tensor, *,
                 method: str = "cyclic_reduction", points: ActivationPoints | None = None,
                 tol: float | None = None, max_iters: int | None = None
                 ) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], Solution]:
    """Gradients of an MLP by solving its backward (upper) system (Naumov 2017, eq. 14/19).

    Arguments:
        model: ``nn.Sequential`` of Linear layers and ReLU, Tanh, Sigmoid, LeakyReLU, GELU or
            Identity.
        x: the input ``(B, in_features)``.
        grad_output: ``dL/d model(x)``, ``(B, out_features)``.
        method: any of :data:`paraprop.linalg.METHODS`; ``"cyclic_reduction"`` takes
            ``ceil(log2 l) + 1`` levels for ``l`` Linear layers.
        points: activation points of this input (:func:`activation_points`); computed when
            ``None`` (one sequential forward pass without a graph).
        tol, max_iters: for the iterative methods (see :func:`paraprop.linalg.solve`).

    Returns:
        ``((grad_input, grad_params), solution)``: ``dL/dx`` ``(B, in_features)`` and the
        gradients of ``model.parameters()`` in that order, equal to autograd's, and the
        :class:`~paraprop.Solution` of the backward system (``value``: the adjoints
        ``u_k = dL/dy_k``, concatenated).

    Raises:
        TypeError / ValueError: unsupported modules, bad shapes, dtypes or devices, a
            non-finite ``x`` or ``grad_output``, bad solver options (as
            :func:`paraprop.linalg.solve`: ``tol``/``max_iters`` with a direct method)
            (named); an empty batch gives zero gradients, as autograd does;
        ConvergenceError: an iterative method did not converge.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        >>> x, g = torch.randn(4, 3).double(), torch.ones(4, 1).double()
        >>> (gx, gp), sol = mlp_backward(net, x, g)
        >>> ref = torch.autograd.grad(net(x.requires_grad_()), [x, *net.parameters()], g)
        >>> all(torch.allclose(a, b) for a, b in zip([gx, *gp], ref))
        True
    """
    if grad_output is None:
        raise ValueError("grad_output is required (dL/d model(x), shape (B, out_features))")
    parsed = _parse(model)
    x = _check_input(x, parsed)
    grad_output = _check_grad_output(grad_output, parsed, x)
    if points is not None:
        _check_points(points, parsed, x)
    if x.shape[0] == 0:  # an empty batch: zero gradients, as autograd gives
        check_solver_args(method, tol, max_iters)
        grads = (torch.zeros_like(x), [torch.zeros_like(p.detach()) for p in model.parameters()])
        N = sum(parsed.out_features)
        st = {"levels": 0, "flops": 0, "memory_bytes": 0, "time_s": 0.0,
              "l": len(parsed.linears), "N": N}
        return grads, Solution(x.new_zeros(0, N), method, 0, 0, True,
                               torch.zeros(0, dtype=torch.float64), st)
    with torch.no_grad():
        if points is None:
            points = activation_points(model, x)
        l = len(parsed.linears)
        groups = _chain_groups(parsed.chains, list(points.pre))
        bwd, b_rhs = _backward_system(parsed, x, groups, _per_layer(groups, l, 2), grad_output,
                                      _NegOnes(x))
    sol = solve(bwd, b_rhs, method=method, tol=tol, max_iters=max_iters)
    with torch.no_grad():
        grad_input, params = _gradients(parsed, points, sol.value, list(bwd.sizes))
    return (grad_input, params), sol


def mlp_forward(model: nn.Sequential, x: torch.Tensor, *, points: ActivationPoints | None = None,
                method: str = "cyclic_reduction", tol: float | None = None,
                max_iters: int | None = None, throw: bool = True) -> Solution:
    """Forward propagation by the lower system (Naumov 2017, eq. 13/18 and the §2 remark).

    With ``points=None`` the points of this very pass are used (one sequential pass records them)
    and one solve reproduces the output. With the points of a *previous* pass (other weights or
    inputs, e.g. the last training step) each iteration solves the system linearised at the
    current points (a Newton step on the layer equations), re-evaluates all pre-activations
    ``y_k = W_k z_{k-1} + b_k`` at once, and stops when they change by at most
    ``tol * max(1, max|y|)``. Layer ``k`` is exact after ``k`` iterations, so at most ``l``
    iterations are needed.

    Arguments:
        model, x: as for :func:`activation_points`.
        points: starting activation points (same shapes), or ``None``.
        method: the solver of each linear system (any of :data:`~paraprop.linalg.METHODS`).
        tol: stopping tolerance on the change of the points (``None``: 1e-12 in float64,
            1e-5 in float32).
        max_iters: cap on iterations (``None``: ``l``).
        throw: raise ``ConvergenceError`` if ``max_iters`` ends it unconverged.

    Returns:
        A :class:`~paraprop.Solution`: ``value`` the output ``(B, out_features)``,
        ``iterations`` the linearise-and-solve rounds, ``evaluations`` the sequential levels in
        total (``stats["levels"]``: per round the solve's levels plus one for the batched layer
        evaluation; with ``points=None`` the ``l`` layers of the pass plus the solve's levels),
        ``residuals`` the max change of the points per round; ``stats``: ``solve_levels`` (the
        solves' levels alone), ``flops`` (of the solves), ``layer_evaluations`` (Linear layers
        evaluated: ``l`` per round, or ``l`` for the pass), ``time_s`` and ``points``, the final
        :class:`ActivationPoints` (feed them to the next call, or to :func:`mlp_backward`).

    Raises:
        TypeError / ValueError: unsupported modules, bad shapes, ``method``, ``tol``,
            ``max_iters`` or ``throw``, a non-finite ``x``;
        ConvergenceError: not at the fixed point after ``max_iters`` and ``throw=True``.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        >>> x = torch.randn(4, 3).double()
        >>> old = activation_points(net, x)
        >>> with torch.no_grad():
        ...     _ = net[0].weight.add_(0.01)
        >>> sol = mlp_forward(net, x, points=old)
        >>> torch.allclose(sol.value, net(x)), sol.iterations <= 2
        (True, True)
    """
    parsed = _parse(model)
    x = _check_input(x, parsed)
    l = len(parsed.linears)
    check_solver_args(method, None, None)
    tol = DEFAULT_TOL.get(x.dtype, 1e-6) if tol is None else tol
    checks.nonneg_number("tol", tol, allow_none=True)  # None: the default above
    checks.positive_int("max_iters", max_iters, allow_none=True)
    checks.boolean("throw", throw)
    if points is not None:
        _check_points(points, parsed, x)
    cap = l if max_iters is None else max_iters
    start = time.perf_counter()
    if x.shape[0] == 0:  # an empty batch: an empty output, nothing to solve
        if points is None:
            points = activation_points(model, x)
        st = {"levels": 0, "solve_levels": 0, "flops": 0, "points": points,
              "time_s": time.perf_counter() - start, "layer_evaluations": 0}
        return Solution(points.output, method, 0, 0, True, torch.zeros(0, dtype=torch.float64), st)
    if points is None:
        # the sequential pass (l dependent layer evaluations) gives the points; the solve then
        # reproduces its output, so the counters include both
        points = activation_points(model, x)
        with torch.no_grad():
            fwd, rhs = _forward_only(parsed, x, points)
        sol = solve(fwd, rhs, method=method)
        z = fwd.split(sol.value)
        st = {"levels": l + sol.stats["levels"], "solve_levels": sol.stats["levels"],
              "flops": sol.stats["flops"], "points": points,
              "time_s": time.perf_counter() - start, "layer_evaluations": l}
        return Solution(z[-1], method, 1, l + sol.stats["levels"], True,
                        torch.zeros(0, dtype=torch.float64), st)
    with torch.no_grad():
        z0, _ = chain_value_and_derivative(parsed.lead, x)
    levels = solve_levels = flops = 0
    residuals: list[float] = []
    converged = False
    it = 0
    with torch.no_grad():
        while it < cap:
            it += 1
            fwd, rhs = _forward_only(parsed, x, points)
            sol = solve(fwd, rhs, method=method)
            solve_levels += sol.stats["levels"]
            levels += sol.stats["levels"] + 1  # + the batched evaluation of all layers
            flops += sol.stats["flops"]
            z = fwd.split(sol.value)
            inputs = (z0, *z[:-1])
            pre = _linear_batched(parsed.linears, inputs)
            change = max(float((a - b).abs().max()) for a, b in zip(pre, points.pre,
                                                                    strict=True))
            scale = max(1.0, max(float(y.abs().max()) for y in pre))
            residuals.append(change)
            output, _ = chain_value_and_derivative(parsed.chains[-1], pre[-1])
            points = ActivationPoints(x, tuple(inputs), tuple(pre), output)
            if not change <= tol * scale and it < l:
                continue
            converged = True
            break
    st = {"levels": levels, "solve_levels": solve_levels, "flops": flops, "points": points,
          "time_s": time.perf_counter() - start, "layer_evaluations": it * l}
    out = Solution(points.output, method, it, levels, converged,
                   torch.tensor(residuals, dtype=torch.float64), st)
    return ensure_converged(out, throw, entry="mlp_forward", max_iters=max_iters, tol=tol,
                            measure="relative change of the points (the Newton step)",
                            last=residuals[-1] / scale if residuals else None)


def _linear_batched(linears, inputs) -> list[torch.Tensor]:
    """``y_k = W_k z_{k-1} + b_k`` for every layer, one batched product per group of equal
    shapes (all layers in one parallel step)."""
    out: list = [None] * len(linears)
    keys = [(tuple(lin.weight.shape), lin.bias is not None) for lin in linears]
    for (_, has_b), idx in _groups(keys).items():
        W = torch.stack([linears[k].weight for k in idx])
        Z = torch.stack([inputs[k] for k in idx])
        Y = torch.bmm(Z, W.transpose(1, 2))
        if has_b:
            Y = Y + torch.stack([linears[k].bias for k in idx]).unsqueeze(1)
        for j, k in enumerate(idx):
            out[k] = Y[j]
    return out
