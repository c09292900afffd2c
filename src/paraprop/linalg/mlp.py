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

import torch
from torch import nn

from paraprop import checks
from paraprop.driver import Outcome, build, run
from paraprop.linalg.activations import (
    chain_value_and_derivative,
)
from paraprop.linalg.entry import DEFAULT_TOL, check_solver_args, solve
from paraprop.linalg.mlp_layers import (
    ActivationPoints,
    activation_points,
    chain_groups,
    check_grad_output,
    check_input,
    check_points,
    linear_batched,
    parse_mlp,
    per_layer,
)
from paraprop.linalg.mlp_systems import NegOnes, backward_system, forward_only, gradients
from paraprop.result import Result, Solution

__all__ = ["mlp_backward", "mlp_forward"]


def mlp_backward(model: nn.Sequential, x: torch.Tensor, grad_output: torch.Tensor, *,
                 method: str = "cyclic_reduction", points: ActivationPoints | None = None,
                 tol: float | None = None, max_iters: int | None = None, throw: bool = True
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
        throw: raise :class:`~paraprop.ConvergenceError` when an iterative method stops
            unconverged; ``False`` returns the gradients of the last iterate with
            ``solution.converged`` ``False``.

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
        ConvergenceError: an iterative method did not converge and ``throw=True``.

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
    checks.boolean("throw", throw)
    parsed = parse_mlp(model)
    x = check_input(x, parsed)
    grad_output = check_grad_output(grad_output, parsed, x)
    if points is not None:
        check_points(points, parsed, x)
    if x.shape[0] == 0:  # an empty batch: zero gradients, as autograd gives
        check_solver_args(method, tol, max_iters)
        grads = (torch.zeros_like(x), [torch.zeros_like(p.detach()) for p in model.parameters()])
        N = sum(parsed.out_features)
        out = Outcome(x.new_zeros(0, N), Result.successful, evaluations=0, sequential_steps=0,
                      error_estimate=0.0, stats={"levels": 0, "flops": 0, "memory_bytes": 0,
                                                 "l": len(parsed.linears), "N": N})
        return grads, build(method, out, iterations=0, time_s=0.0)
    with torch.no_grad():
        if points is None:
            points = activation_points(model, x)
        l = len(parsed.linears)
        groups = chain_groups(parsed.chains, list(points.pre))
        bwd, b_rhs = backward_system(parsed, x, groups, per_layer(groups, l, 2), grad_output,
                                      NegOnes(x))
    sol = solve(bwd, b_rhs, method=method, tol=tol, max_iters=max_iters, throw=throw)
    with torch.no_grad():
        grad_input, params = gradients(parsed, points, sol.value, list(bwd.sizes))
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
    parsed = parse_mlp(model)
    x = check_input(x, parsed)
    l = len(parsed.linears)
    check_solver_args(method, None, None)
    tol = DEFAULT_TOL.get(x.dtype, 1e-6) if tol is None else tol
    checks.nonneg_number("tol", tol, allow_none=True)  # None: the default above
    checks.positive_int("max_iters", max_iters, allow_none=True)
    checks.boolean("throw", throw)
    if points is not None:
        check_points(points, parsed, x)
    cap = l if max_iters is None else max_iters
    start = time.perf_counter()
    if x.shape[0] == 0:  # an empty batch: an empty output, nothing to solve
        if points is None:
            points = activation_points(model, x)
        out = Outcome(points.output, Result.successful, evaluations=0, sequential_steps=0,
                      bound=l, error_estimate=0.0,
                      stats={"levels": 0, "solve_levels": 0, "flops": 0, "points": points,
                             "layer_evaluations": 0})
        return build(method, out, iterations=0, time_s=time.perf_counter() - start)
    if points is None:
        # the sequential pass (l dependent layer evaluations) gives the points; the solve then
        # reproduces its output, so the counters include both
        points = activation_points(model, x)
        with torch.no_grad():
            fwd, rhs = forward_only(parsed, x, points)
        sol = solve(fwd, rhs, method=method)
        z = fwd.split(sol.value)
        levels = l + sol.stats["levels"]
        out = Outcome(z[-1], Result.successful, evaluations=levels, sequential_steps=levels,
                      bound=l, error_estimate=0.0,
                      stats={"levels": levels, "solve_levels": sol.stats["levels"],
                             "flops": sol.stats["flops"], "points": points,
                             "layer_evaluations": l})
        return build(method, out, iterations=1, time_s=time.perf_counter() - start)
    with torch.no_grad():
        return run(_Newton(parsed, x, points, method, tol), max_iters=cap, entry="mlp_forward",
                   throw=throw, tol=tol, user_max_iters=max_iters,
                   measure="change of the points (the Newton step; tol is relative to "
                           "max(1, max |points|))")


class _Newton:
    """Newton's method on the forward system (a :class:`paraprop.driver.Method`): each
    iteration solves the lower system linearised at the current points, then evaluates every
    layer at once at the new inputs; exact after ``l`` iterations."""

    def __init__(self, parsed, x: torch.Tensor, points: ActivationPoints, method: str,
                 tol: float):
        self.name = method
        self.parsed, self.x, self.points, self.method, self.tol = parsed, x, points, method, tol
        self.l = len(parsed.linears)
        self.z0, _ = chain_value_and_derivative(parsed.lead, x)
        self.levels = self.solve_levels = self.flops = 0
        self.it = 0
        self.converged = False

    def stopped(self) -> bool:
        return self.converged

    def step(self) -> float:
        parsed = self.parsed
        self.it += 1
        fwd, rhs = forward_only(parsed, self.x, self.points)
        sol = solve(fwd, rhs, method=self.method)
        self.solve_levels += sol.stats["levels"]
        self.levels += sol.stats["levels"] + 1  # + the batched evaluation of all layers
        self.flops += sol.stats["flops"]
        z = fwd.split(sol.value)
        inputs = (self.z0, *z[:-1])
        pre = linear_batched(parsed.linears, inputs)
        change = max(float((a - b).abs().max()) for a, b in zip(pre, self.points.pre,
                                                                strict=True))
        scale = max(1.0, max(float(y.abs().max()) for y in pre))
        output, _ = chain_value_and_derivative(parsed.chains[-1], pre[-1])
        self.points = ActivationPoints(self.x, tuple(inputs), tuple(pre), output)
        self.converged = change <= self.tol * scale or self.it >= self.l
        return change

    def outcome(self, iterations: int) -> Outcome:
        return Outcome(
            self.points.output,
            Result.successful if self.converged else Result.max_iters_reached,
            evaluations=self.levels, sequential_steps=self.levels, bound=self.l,
            stats={"levels": self.levels, "solve_levels": self.solve_levels,
                   "flops": self.flops, "points": self.points,
                   "layer_evaluations": iterations * self.l})

