"""``parallel_inverse``: a flow library's own inverse, by early-stopping Jacobi passes.

zuko, nflows and normflows invert a masked autoregressive transform ``y = f(x)`` with a fixed
number of passes ``x <- f_x^{-1}(y)`` starting from zeros (``D`` passes for a fully
autoregressive transform). That loop is Jacobi iteration on the triangular system
``x = h(x) := f_x^{-1}(y)`` (Song et al. 2021, §3); :func:`parallel_inverse` runs the same
iteration through :func:`paraprop.solve` and stops as soon as the iterate is a fixed point,
which for a triangular ``h`` is the exact inverse, bitwise the library's result.

The arguments are validated once, before any pass: ``y`` and ``context`` must have the dtype and
device of the transform's parameters, ``y`` its number of features and ``context`` the number of
context features its autoregressive networks were built with.
"""

from __future__ import annotations

import time

import torch

from paraprop.flows import arguments, nflows_parts, normflows_parts, part_solve, zuko_parts
from paraprop.result import Solution

# the adapter of each library, by the top-level package of the object's class
LIBRARIES = {m.LIBRARY: m for m in (zuko_parts, nflows_parts, normflows_parts)}


def library_of(obj) -> str | None:
    """``"zuko"``, ``"nflows"`` or ``"normflows"``: the library that defines ``obj``'s class."""
    name = type(obj).__module__.split(".")[0]
    return name if name in LIBRARIES else None


def parallel_inverse(transform, y: torch.Tensor, *, context: torch.Tensor | None = None,
                     method="jacobi", tol: float = 0.0, max_iters: int | None = None,
                     throw: bool = True) -> tuple[torch.Tensor, Solution]:
    """Invert ``transform`` at ``y`` with early-stopping Jacobi passes.

    Returns what the library's own inverse returns (bitwise at ``tol=0``): zuko's
    ``transform.inv(y)``, nflows' ``transform.inverse(y, context)[0]``, normflows'
    ``flow.inverse(y)[0]``. Supported:

    - zuko: ``AutoregressiveTransform`` (as built by ``MaskedAutoregressiveTransform``, affine
      ``MAF`` or spline ``NSF``, any feature order and ``passes``) and ``ComposedTransform`` of
      such and other transforms; a ``Flow`` (or lazy transform) ``flow`` is inverted as
      ``flow(context).transform``, a ``NormalizingFlow`` (``flow(c)``) as its ``.transform``.
    - nflows: the autoregressive transforms (``MaskedAffineAutoregressiveTransform``, the
      piecewise spline variants) and ``CompositeTransform``; a ``Flow`` as its transform, with
      ``context`` passed through the flow's embedding net (as its ``sample`` does).
    - normflows: ``MaskedAffineAutoregressive``, the spline transform
      ``MaskedPiecewiseRationalQuadraticAutoregressive`` (the ``.mprqat`` of
      ``AutoregressiveRationalQuadraticSpline`` and its circular variant, whose own ``inverse``
      is one pass: their loop is their ``forward``, i.e. ``parallel_inverse(layer.mprqat, z)``
      is ``layer(z)[0]``), ``Composite``, and ``NormalizingFlow`` /
      ``ConditionalNormalizingFlow`` (layers in reverse order).

    Other parts of a composition are inverted by their own inverse. With gradients enabled the
    result is differentiable like the library's (implicit differentiation at the fixed point,
    through the final pass; first-order gradients); under ``torch.no_grad()`` it carries no
    graph. Each autoregressive transform takes at most the passes of the library's own loop
    (its ``D``, or zuko's ``passes``), the final and the differentiable pass included: a
    method whose next pass could exceed them is stopped, and the library's loop finishes from
    the features proven exact (see :class:`paraprop.flows.passes.Passes`).

    Arguments:
        transform: the forward transform ``y = f(x)``, or a flow (see above).
        y: the points to invert, ``(N, D)``, in the dtype and on the device of the transform's
            parameters.
        context: conditioning input ``(N, C)`` of an nflows transform or flow, a normflows
            layer or ``ConditionalNormalizingFlow``, or a zuko ``Flow`` / lazy transform;
            ``None`` for a zuko transform (already bound to its context) and for unconditional
            transforms.
        method: the :func:`paraprop.solve` method for each autoregressive transform, by name or
            as a solver object (default ``"jacobi"``: the library's own passes, stopped early);
            the Newton family is refused (the systems are not Markov).
        tol: error bound of the early stop (see :func:`paraprop.solve`); ``0`` (default) stops
            at the bitwise fixed point, i.e. returns exactly what the library's inverse returns.
        max_iters: cap on passes per transform (default: ``D``, the exactness bound).
        throw: raise :class:`paraprop.ConvergenceError` if ``max_iters`` stops a transform
            first; ``False`` returns the unconverged result.

    Returns:
        ``(x, solution)``: the preimage and one :class:`paraprop.Solution` for the whole
        inverse: ``iterations`` and ``evaluations`` summed over the autoregressive transforms
        (``evaluations`` is the number of passes, the final one included), ``converged`` when
        all converged, ``stats["parts"]`` the Solution of each transform in the order they were
        inverted (its ``stats``: ``library_passes``, ``groups``, ``finished_by`` -- ``"solver"``,
        ``"exact prefix"`` or ``"budget"`` -- and ``fallback_passes``).

    Raises:
        TypeError: a transform of none of the three libraries; ``y`` or ``context`` not a
            tensor or of another dtype than the transform's parameters; ``throw`` not a bool.
        ValueError: ``y`` or ``context`` of the wrong shape or on another device than the
            transform's parameters; a context missing for a conditional transform or given to
            an unconditional one (or to a zuko transform, already bound to its context); an
            unknown or a Newton-family ``method``, a negative ``tol``, a ``max_iters`` < 1.
        NotImplementedError: a zuko transform defined by an adjacency matrix without an order.
        paraprop.NonFiniteError: the library's own loop computes a NaN or inf (from final
            features, or in one of its passes): the part, the sample and the feature named,
            for every method.

    Example:
        >>> import zuko
        >>> from paraprop.flows import parallel_inverse
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
    cfg = part_solve.settings(method, tol, max_iters, throw)
    arguments.refuse_functorch()
    lib = library_of(transform)
    if lib is None:
        raise TypeError(f"transform must be a zuko, nflows or normflows transform or flow, got "
                        f"{type(transform).__name__}")
    sols: list[Solution] = []
    start = time.perf_counter()
    x = LIBRARIES[lib].inverse(transform, y, context, cfg, sols.append)
    return x, part_solve.combine(sols, cfg.solver.name, x, time.perf_counter() - start)
