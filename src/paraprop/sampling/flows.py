"""Drop-in parallel inverses for the autoregressive transforms of nflows and zuko.

Both libraries invert a masked autoregressive transform ``y = f(x)`` with a fixed number of
passes ``x <- f_x^{-1}(y)`` starting from zeros (``D`` passes for a fully autoregressive
transform). That loop is Jacobi iteration on the triangular system ``x = h(x) := f_x^{-1}(y)``
(Song et al. 2021, §3); :func:`parallel_inverse` runs the same iteration through
:func:`paraprop.solve` and stops as soon as the iterate is a fixed point, which for a triangular
``h`` is the exact inverse, bitwise the library's result.
"""

from __future__ import annotations

import torch

from paraprop.solve import Solution, solve


def parallel_inverse(transform, y: torch.Tensor, *, context: torch.Tensor | None = None,
                     tol: float = 0.0, max_iters: int | None = None
                     ) -> tuple[torch.Tensor, list[Solution]]:
    """Invert ``transform`` at ``y`` with early-stopping Jacobi passes.

    Supported: zuko's ``AutoregressiveTransform`` (as built by ``MaskedAutoregressiveTransform``,
    affine or spline univariates) and ``ComposedTransform`` of such and other transforms (a zuko
    ``Flow``'s ``.transform``); nflows' autoregressive transforms (``MaskedAffineAutoregressive
    Transform``, the piecewise spline variants) and ``CompositeTransform``. Other parts of a
    composition are inverted by their own ``inverse``.

    Arguments:
        transform: the forward transform ``y = f(x)``.
        y: the points to invert, ``(N, D)``.
        context: conditioning input for nflows transforms (zuko transforms are already bound).
        tol: forward-difference tolerance; ``0`` (default) stops at the bitwise fixed point,
            i.e. returns exactly what the library's inverse returns.
        max_iters: cap on passes per transform (default: ``D``, the exactness bound).

    Returns:
        ``(x, solutions)``: the preimage and one :class:`paraprop.Solution` per autoregressive
        transform inverted (``.evaluations`` is the number of passes it needed).

    Raises:
        TypeError: a transform of neither library.
        NotImplementedError: a zuko transform defined by an adjacency matrix without an order.

    Example:
        >>> flow = zuko.flows.MAF(5, transforms=2)
        >>> x, sols = parallel_inverse(flow().transform, torch.randn(8, 5))
    """
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"y must be a tensor of shape (N, D), got {shape}")
    sols: list[Solution] = []
    with torch.no_grad():
        x = _inverse(transform, y, context, tol, max_iters, sols)
    return x, sols


def _inverse(t, y, context, tol, max_iters, sols):
    mod = type(t).__module__
    if mod.startswith("zuko"):
        return _zuko(t, y, tol, max_iters, sols)
    if mod.startswith("nflows"):
        return _nflows(t, y, context, tol, max_iters, sols)
    raise TypeError(f"transform must be a zuko or nflows transform, got {type(t).__name__}")


def _run(h, y, order, tol, max_iters, sols):
    """Solve ``x = h(x)`` in the order given by ``order`` (rank of each feature)."""
    if order is None or torch.equal(order, torch.arange(len(order), device=order.device)):
        sol = solve(h, torch.zeros_like(y), method="jacobi", tol=tol, max_iters=max_iters)
        sols.append(sol)
        return sol.value
    perm = torch.argsort(order, stable=True)  # position k of the solve is feature perm[k]
    inv = torch.argsort(perm)

    def hp(xp):
        return h(xp.index_select(-1, inv)).index_select(-1, perm)

    sol = solve(hp, torch.zeros_like(y), method="jacobi", tol=tol, max_iters=max_iters)
    sols.append(sol)
    return sol.value.index_select(-1, inv)


def _zuko(t, y, tol, max_iters, sols):
    from zuko.transforms import AutoregressiveTransform, ComposedTransform

    if isinstance(t, ComposedTransform):
        for part in reversed(t.transforms):
            y = _zuko(part, y, tol, max_iters, sols)
        return y
    if not isinstance(t, AutoregressiveTransform):
        return t.inv(y)
    lazy = getattr(getattr(t.meta, "func", None), "__self__", None)
    order = getattr(lazy, "order", None)
    if order is None:
        raise NotImplementedError("zuko AutoregressiveTransform without a feature order (built "
                                  "from an adjacency matrix) is not supported")
    return _run(lambda x: t.meta(x).inv(y), y, order.to(y.device), tol, max_iters, sols)


def _nflows(t, y, context, tol, max_iters, sols):
    from nflows.transforms import CompositeTransform
    from nflows.transforms.autoregressive import AutoregressiveTransform

    if isinstance(t, CompositeTransform):
        for part in reversed(list(t._transforms)):
            y = _nflows(part, y, context, tol, max_iters, sols)
        return y
    if not isinstance(t, AutoregressiveTransform):
        return t.inverse(y, context)[0]

    def h(x):
        return t._elementwise_inverse(y, t.autoregressive_net(x, context))[0]

    # nflows' MADE gives input i the degree i + 1: the natural order.
    return _run(h, y, None, tol, max_iters, sols)
