"""Drop-in parallel inverses for the autoregressive transforms of nflows and zuko.

Both libraries invert a masked autoregressive transform ``y = f(x)`` with a fixed number of
passes ``x <- f_x^{-1}(y)`` starting from zeros (``D`` passes for a fully autoregressive
transform). That loop is Jacobi iteration on the triangular system ``x = h(x) := f_x^{-1}(y)``
(Song et al. 2021, §3); :func:`parallel_inverse` runs the same iteration through
:func:`paraprop.solve` and stops as soon as the iterate is a fixed point, which for a triangular
``h`` is the exact inverse, bitwise the library's result.

The arguments are validated once, before any pass: ``y`` and ``context`` must have the dtype and
device of the transform's parameters, ``y`` its number of features and ``context`` the number of
context features its autoregressive networks were built with.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from paraprop.checks import check_max_iters, check_tol
from paraprop.result import Solution
from paraprop.solve import solve
from paraprop.solvers import make_solver


def parallel_inverse(transform, y: torch.Tensor, *, context: torch.Tensor | None = None,
                     method="jacobi", tol: float = 0.0, max_iters: int | None = None,
                     throw: bool = True) -> tuple[torch.Tensor, Solution]:
    """Invert ``transform`` at ``y`` with early-stopping Jacobi passes.

    Supported: zuko's ``AutoregressiveTransform`` (as built by ``MaskedAutoregressiveTransform``,
    affine or spline univariates) and ``ComposedTransform`` of such and other transforms (a zuko
    ``Flow``'s ``.transform``); nflows' autoregressive transforms (``MaskedAffineAutoregressive
    Transform``, the piecewise spline variants) and ``CompositeTransform``. Other parts of a
    composition are inverted by their own ``inverse``.

    A flow is accepted in place of its transform, with the library's own meaning: a zuko
    ``Flow`` (or lazy transform) ``flow`` is inverted as ``flow(context).transform``, a zuko
    ``NormalizingFlow`` (``flow(c)``) as its ``.transform``, an nflows ``Flow`` as its transform
    with ``context`` passed through the flow's embedding net (as its ``sample`` does).

    Arguments:
        transform: the forward transform ``y = f(x)``, or a flow (see above).
        y: the points to invert, ``(N, D)``, in the dtype and on the device of the transform's
            parameters.
        context: conditioning input ``(N, C)`` of an nflows transform or flow, or of a zuko
            ``Flow`` / lazy transform; ``None`` for a zuko transform (already bound to its
            context) and for unconditional transforms.
        method: the :func:`paraprop.solve` method for each autoregressive transform, by name or
            as a solver object (default ``"jacobi"``: the library's own passes, stopped early).
        tol: error bound of the early stop (see :func:`paraprop.solve`); ``0`` (default) stops
            at the bitwise fixed point, i.e. returns exactly what the library's inverse returns.
        max_iters: cap on passes per transform (default: ``D``, the exactness bound).
        throw: raise :class:`paraprop.ConvergenceError` if ``max_iters`` stops a transform
            first; ``False`` returns the unconverged result.

    Returns:
        ``(x, solution)``: the preimage and one :class:`paraprop.Solution` for the whole
        inverse: ``iterations`` and ``evaluations`` summed over the autoregressive transforms
        (``evaluations`` is the number of passes), ``converged`` when all converged,
        ``stats["parts"]`` the Solution of each transform in the order they were inverted.

    Raises:
        TypeError: a transform of neither library; ``y`` or ``context`` not a tensor or of
            another dtype than the transform's parameters.
        ValueError: ``y`` or ``context`` of the wrong shape or on another device than the
            transform's parameters; a context missing for a conditional transform or given to
            an unconditional one (or to a zuko transform, already bound to its context).
        NotImplementedError: a zuko transform defined by an adjacency matrix without an order.

    Example:
        >>> import zuko
        >>> flow = zuko.flows.MAF(5, transforms=2)
        >>> y = torch.randn(8, 5)
        >>> x, sol = parallel_inverse(flow().transform, y)
        >>> x2, sol = parallel_inverse(flow, y)   # the same
        >>> torch.equal(x, flow().transform.inv(y)), torch.equal(x2, x), len(sol.stats["parts"])
        (True, True, 2)
    """
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"y must be a tensor of shape (N, D), got {shape}")
    if not y.is_floating_point():
        raise TypeError(f"y must have a floating-point dtype, got {y.dtype}")
    if context is not None and not isinstance(context, torch.Tensor):
        raise TypeError(f"context must be a torch.Tensor or None, got {type(context).__name__}")
    solver = make_solver(method)
    check_tol(tol)
    check_max_iters(max_iters)
    mod = type(transform).__module__
    sols: list[Solution] = []
    start = time.perf_counter()

    def run(h, y0):
        sol = solve(h, torch.zeros_like(y0), method=solver, tol=tol, max_iters=max_iters,
                    throw=throw)
        sols.append(sol)
        return sol.value

    with torch.no_grad():
        if mod.startswith("zuko"):
            transform = _zuko_bind(transform, y, context)
            _zuko_check(transform, y)
            x = _zuko(transform, y, run)
        elif mod.startswith("nflows"):
            transform, context = _nflows_bind(transform, y, context)
            _nflows_check(transform, y, context)
            x = _nflows(transform, y, context, run)
        else:
            raise TypeError(f"transform must be a zuko or nflows transform, got "
                            f"{type(transform).__name__}")
    return x, combine(sols, solver.name, x, time.perf_counter() - start)


def combine(parts: list[Solution], method: str, value: torch.Tensor, time_s: float) -> Solution:
    """One Solution for solves run one after another (e.g. the transforms of a flow)."""
    return Solution(
        value=value, method=method,
        iterations=sum(p.iterations for p in parts),
        evaluations=sum(p.evaluations for p in parts),
        converged=all(p.converged for p in parts),
        residuals=torch.cat([p.residuals for p in parts]) if parts
        else torch.empty(0, dtype=torch.float64),
        stats={"parts": parts, "positions": sum(p.stats.get("positions", 0) for p in parts),
               "error_estimate": sum(p.stats.get("error_estimate", 0.0) for p in parts),
               "time_s": time_s})


# -- validation -------------------------------------------------------------------------------
def _reference(module) -> torch.Tensor | None:
    """The first floating-point parameter of ``module`` (``None``: it has none)."""
    if not isinstance(module, nn.Module):
        return None
    return next((p for p in module.parameters() if p.is_floating_point()), None)


def _check_like(name: str, t: torch.Tensor, ref: torch.Tensor | None, what: str) -> None:
    """``t`` must have the dtype and device of ``ref`` (the parameters of ``what``)."""
    if ref is None:
        return
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of the {what}'s parameters, {ref.dtype}, "
                        f"got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the device of the {what}'s parameters, "
                         f"{ref.device}, got {t.device}")


def _check_features(y: torch.Tensor, features: int | None, what: str) -> None:
    if features is not None and y.shape[-1] != features:
        raise ValueError(f"y must have shape (N, {features}) ({features} features, as the "
                         f"{what}), got {tuple(y.shape)}")


def _zuko_bind(t, y, context):
    """A zuko transform from a zuko Flow, lazy transform or transform."""
    from torch.distributions import Transform
    from zuko.distributions import NormalizingFlow

    try:
        from zuko.lazy import Flow, LazyDistribution, LazyTransform
    except ImportError:  # zuko < 1.2
        from zuko.flows.core import Flow, LazyDistribution, LazyTransform

    if isinstance(t, Flow | LazyTransform):
        if context is not None:
            _check_like("context", context, _reference(t), "flow")
        return t.transform(context) if isinstance(t, Flow) else t(context)
    if isinstance(t, LazyDistribution):
        raise TypeError(f"transform must be a zuko Flow, lazy transform or transform, got the "
                        f"distribution {type(t).__name__} (it has no transform)")
    if isinstance(t, NormalizingFlow):  # flow(c): the transform is bound to c
        t = t.transform
    if not isinstance(t, Transform):
        raise TypeError(f"transform must be a zuko or nflows transform, got {type(t).__name__}")
    if context is not None:
        raise ValueError("context must be None with a zuko transform, which is already bound "
                         "to its context: pass the flow itself with context=..., or "
                         f"flow(context).transform without it (got context of shape "
                         f"{tuple(context.shape)})")
    return t


def _zuko_parts(t):
    from zuko.transforms import AutoregressiveTransform, ComposedTransform

    if isinstance(t, ComposedTransform):
        for part in t.transforms:
            yield from _zuko_parts(part)
    elif isinstance(t, AutoregressiveTransform):
        yield t


def _zuko_check(t, y):
    """``y`` and the bound context of every autoregressive part against its network."""
    for part in _zuko_parts(t):
        meta = part.meta
        lazy = getattr(getattr(meta, "func", None), "__self__", None)
        if not isinstance(lazy, nn.Module):
            continue
        order = getattr(lazy, "order", None)
        features = len(order) if isinstance(order, torch.Tensor) else None
        _check_features(y, features, "flow")
        ref = _reference(lazy)
        _check_like("y", y, ref, "flow")
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
        _check_like("context", c, ref, "flow")
        try:
            ok = torch.broadcast_shapes(c.shape[:-1], y.shape[:-1]) == y.shape[:-1]
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"context must have shape (N, {n_ctx}) with N = {y.shape[0]} "
                             f"(the rows of y) or 1, got {tuple(c.shape)}")


def _nflows_bind(t, y, context):
    """An nflows transform and its context from an nflows Flow or transform."""
    from nflows.transforms import Transform

    inner = getattr(t, "_transform", None)
    if not isinstance(t, Transform) and isinstance(inner, Transform):  # an nflows Flow
        if context is not None:
            _check_like("context", context, _reference(t), "flow")
            embed = getattr(t, "_embedding_net", None)
            if embed is not None:
                context = embed(context)
        return inner, context
    if not isinstance(t, Transform):
        raise TypeError(f"transform must be a zuko or nflows transform, got {type(t).__name__}")
    return t, context


def _nflows_parts(t):
    from nflows.transforms import CompositeTransform
    from nflows.transforms.autoregressive import AutoregressiveTransform

    if isinstance(t, CompositeTransform):
        for part in t._transforms:
            yield from _nflows_parts(part)
    elif isinstance(t, AutoregressiveTransform):
        yield t


def _nflows_check(t, y, context):
    ref = _reference(t)
    _check_like("y", y, ref, "transform")
    if context is not None:
        _check_like("context", context, ref, "transform")
    for part in _nflows_parts(t):
        net = part.autoregressive_net
        first = getattr(net, "initial_layer", None)
        _check_features(y, getattr(first, "in_features", None), "transform")
        ctx_layer = getattr(net, "context_layer", None)
        n_ctx = getattr(ctx_layer, "in_features", None)
        name = type(part).__name__
        if n_ctx is None:
            if context is not None:
                raise ValueError(f"context must be None: {name} was built without "
                                 f"context_features, got context of shape "
                                 f"{tuple(context.shape)}")
            continue
        if context is None:
            raise ValueError(f"context is needed: {name} takes {n_ctx} context features; "
                             f"pass context of shape ({y.shape[0]}, {n_ctx})")
        if tuple(context.shape) != (y.shape[0], n_ctx):
            raise ValueError(f"context must have shape ({y.shape[0]}, {n_ctx}) (the rows of y, "
                             f"the context features of {name}), got {tuple(context.shape)}")


# -- inversion --------------------------------------------------------------------------------
def _ordered(h, y, order, run):
    """Solve ``x = h(x)`` in the order given by ``order`` (rank of each feature)."""
    if order is None or torch.equal(order, torch.arange(len(order), device=order.device)):
        return run(h, y)
    perm = torch.argsort(order, stable=True)  # position k of the solve is feature perm[k]
    inv = torch.argsort(perm)

    def hp(xp):
        return h(xp.index_select(-1, inv)).index_select(-1, perm)

    return run(hp, y).index_select(-1, inv)


def _zuko(t, y, run):
    from zuko.transforms import AutoregressiveTransform, ComposedTransform

    if isinstance(t, ComposedTransform):
        for part in reversed(t.transforms):
            y = _zuko(part, y, run)
        return y
    if not isinstance(t, AutoregressiveTransform):
        return t.inv(y)
    lazy = getattr(getattr(t.meta, "func", None), "__self__", None)
    order = getattr(lazy, "order", None)
    if order is None:
        raise NotImplementedError("zuko AutoregressiveTransform without a feature order (built "
                                  "from an adjacency matrix) is not supported")
    return _ordered(lambda x: t.meta(x).inv(y), y, order.to(y.device), run)


def _nflows(t, y, context, run):
    from nflows.transforms import CompositeTransform
    from nflows.transforms.autoregressive import AutoregressiveTransform

    if isinstance(t, CompositeTransform):
        for part in reversed(list(t._transforms)):
            y = _nflows(part, y, context, run)
        return y
    if not isinstance(t, AutoregressiveTransform):
        return t.inverse(y, context)[0]

    def h(x):
        return t._elementwise_inverse(y, t.autoregressive_net(x, context))[0]

    # nflows' MADE gives input i the degree i + 1: the natural order.
    return _ordered(h, y, None, run)
