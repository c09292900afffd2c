"""``paraprop.networks.evaluate``: a network's output by any :func:`paraprop.solve` method.

The forward pass is solved as the triangular system over its states (see
:class:`~paraprop.networks.LayerSystem`); after every iteration the current output is compared
with the sequential output (the error the paper plots in Fig. 1d) and with the previous
iteration's output. The solver itself stops on the forward difference of the whole state, which
needs no reference (Song et al. 2021, §4 and §5.2).
"""

from __future__ import annotations

import dataclasses

import torch

from paraprop import checks
from paraprop.determinism import refuse_random_draws
from paraprop.networks.convert import as_recurrence
from paraprop.networks.layer_system import LayerSystem
from paraprop.networks.partition import jacobi_gs_blocks
from paraprop.solve import Solution, solve
from paraprop.solvers import make_solver

__all__ = ["METRICS", "evaluate", "max_abs", "top5_changes", "trace"]

METRICS = ("top5_changes", "max_abs")


def top5_changes(output: torch.Tensor, reference: torch.Tensor, k: int = 5) -> int:
    """Top-``k`` label changes: entries of the ranked top-``k`` lists that differ.

    For each sample the ``k`` largest outputs are ranked (largest first); every rank whose label
    differs between ``output`` and ``reference`` counts one, summed over samples. Zero means every
    sample has the same top-``k`` labels in the same order. Fewer than ``k`` classes: all ranked.

    Arguments:
        output, reference: scores shaped ``(batch, classes)``.
        k: list length (5 as in the paper).

    Returns:
        The number of changed entries (``0 .. batch * k``).

    Raises:
        ValueError: the shapes differ or are not ``(batch, classes)``.

    Example:
        >>> top5_changes(torch.tensor([[0., 1, 2, 3, 4, 5]]), torch.tensor([[0., 1, 2, 3, 5, 4]]))
        2
    """
    if output.shape != reference.shape or output.dim() != 2:
        raise ValueError(f"top5_changes needs outputs shaped (batch, classes), got "
                         f"{tuple(output.shape)} and {tuple(reference.shape)}")
    k = min(k, output.shape[1])
    ranks = output.topk(k, dim=1).indices
    ref_ranks = reference.topk(k, dim=1).indices
    return int((ranks != ref_ranks).sum())


def max_abs(output: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference between ``output`` and ``reference`` (a ``metric`` of
    :func:`evaluate`).

    Example:
        >>> max_abs(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
        0.5
    """
    return float((output - reference).abs().max())


_METRIC_FNS = {"top5_changes": top5_changes, "max_abs": max_abs}


def trace(system: LayerSystem, *, method, tol: float,
          norm: str = "max", max_iters: int | None = None, throw: bool = True,
          metric: str = "top5_changes", blocks=None) -> Solution:
    """Solve ``system`` and record the output error after every iteration.

    Arguments:
        system: a bound :class:`LayerSystem`; its ``reference`` is the sequential evaluation.
        method, tol, norm, max_iters, throw: as for :func:`paraprop.solve` (a name or a solver
            object).
        metric: ``"top5_changes"`` or ``"max_abs"``.
        blocks: a partition of the states for ``method="jacobi_gs"`` instead of a block size
            (solved by :func:`~paraprop.networks.jacobi_gs_blocks`).

    Returns:
        The :class:`~paraprop.Solution`, its ``stats`` extended by ``metric``, ``errors`` (the
        metric against the sequential output after each iteration), ``changes`` (the metric
        against the previous iteration's output, the first against the initial guess's),
        ``max_abs_errors`` (per iteration), ``settled`` (the first iteration from which the
        metric stays 0, ``None`` if it never does), ``reference`` (the sequential output),
        ``output_error`` / ``max_abs_error`` / ``bitwise_equal`` (of the returned output) and
        ``names`` (the states).

    Raises:
        The errors of :func:`paraprop.solve` or :func:`~paraprop.networks.jacobi_gs_blocks`.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
        ...                     nn.Linear(16, 10)).eval()
        >>> sol = trace(as_recurrence(net).bind(torch.randn(8, 4)), method="jacobi", tol=0)
        >>> sol.stats["errors"]  # top-5 label changes (of 8 samples) after each iteration
        [32, 31, 0]

    Song et al. 2021, §5.2 and Fig. 1d.
    """
    ref = system.reference[-1]
    fn = _METRIC_FNS[metric]
    errors: list[float] = []
    changes: list[float] = []
    abs_errors: list[float] = []
    prev = [system.output(system.x0)]

    def record(k, value, residual):
        out = system.output(value)
        errors.append(fn(out, ref))
        abs_errors.append(max_abs(out, ref))
        changes.append(fn(out, prev[0]))
        prev[0] = out

    with refuse_random_draws(system.x0.device, (
            "networks.evaluate: a layer drew random numbers during the solve (torch's global "
            f"generator on {system.x0.device} moved: torch.randn_like, dropout, ... in a "
            "forward): the network gives another value at every evaluation, so there is no "
            "forward pass to reproduce (expected every layer a fixed function of its input). "
            "Call model.eval() if it draws only in training mode, or remove the random "
            "operation")):
        if blocks is not None:
            sol = jacobi_gs_blocks(system, blocks, tol=tol, norm=norm, max_iters=max_iters,
                                   throw=throw, callback=record)
        else:
            sol = solve(system, system.x0, method=method, dim=1, tol=tol, norm=norm,
                        max_iters=max_iters, throw=throw, callback=record)
    out = system.output(sol.value)
    settled = len(errors) + 1
    while settled > 1 and errors[settled - 2] == 0:
        settled -= 1
    stats = {
        **sol.stats,
        "metric": metric,
        "errors": errors,
        "changes": changes,
        "max_abs_errors": abs_errors,
        "settled": settled if settled <= len(errors) else None,
        "reference": ref,
        "output_error": fn(out, ref),
        "max_abs_error": max_abs(out, ref),
        "bitwise_equal": bool(torch.equal(out, ref)),
        "names": system.recurrence.names,
    }
    return dataclasses.replace(sol, stats=stats)


def evaluate(
    model,
    x: torch.Tensor,
    *,
    method="jacobi_gs",
    tol: float = 1e-4,
    norm: str = "max",
    metric: str = "top5_changes",
    max_iters: int | None = None,
    throw: bool = True,
    blocks=None,
) -> tuple[torch.Tensor, Solution]:
    """Evaluate ``model(x)`` as a triangular system over its layer outputs.

    Arguments:
        model: anything :func:`~paraprop.networks.as_recurrence` accepts (eval mode), or a
            :class:`~paraprop.networks.LayerRecurrence`.
        x: the input batch (leading batch dim; samples stop independently).
        method: any :func:`paraprop.solve` method, by name or as a solver object:
            ``"jacobi_gs"`` (default; Algorithm 2), ``"jacobi"``, ``"gs_jacobi"`` or
            ``"sequential"``. Here the names of the two hybrids mean blocks of one state (every
            state, e.g. one dense layer with its two convolutions, is its own block, as in the
            paper's DenseNet experiment); pass ``JacobiGS(block_size=k)`` for others.
        tol: stop when the estimated error of the whole state (all layer outputs) is
            ``<= tol`` (see :func:`paraprop.solve`); ``0`` iterates to a bitwise fixed point,
            which is the sequential result.
            Every method stops at its exactness bound anyway.
        norm: ``"max"`` or ``"l2"`` (of the forward difference, per sample).
        metric: the error recorded per iteration against the sequential output:
            ``"top5_changes"`` (:func:`top5_changes`; needs outputs ``(batch, classes)``) or
            ``"max_abs"``.
        max_iters, throw: as for :func:`paraprop.solve`.
        blocks: for ``method="jacobi_gs"``, any partition of the states into contiguous blocks
            instead of equal ones (e.g. :func:`~paraprop.networks.balanced_blocks` of the
            per-state times), solved by :func:`~paraprop.networks.jacobi_gs_blocks` (Algorithm 2).

    Returns:
        ``(output, solution)``: the network output at the stopping point and the
        :class:`~paraprop.Solution` over the padded state ``(batch, states, features)``, whose
        ``stats`` hold the per-iteration ``errors``, ``changes``, ``max_abs_errors``, the
        ``settled`` iteration and the sequential ``reference`` output (see :func:`trace`).

    Raises:
        TypeError / ValueError: bad arguments (named, with the value), a model that cannot be
            turned into a recurrence (:class:`~paraprop.networks.UnsupportedModuleError`), an
            output that the metric cannot rank; the errors of :func:`paraprop.solve`.

    Example:
        >>> import torchvision        # a small DenseNet; densenet121() works the same, slower
        >>> net = torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2, 2, 2),
        ...                                   num_init_features=16, num_classes=10).eval()
        >>> x = torch.randn(4, 3, 32, 32)
        >>> out, sol = evaluate(net, x, tol=0)
        >>> torch.equal(out, net(x)), sol.stats["settled"] <= sol.iterations
        (True, True)

    Song et al. 2021, "Accelerating Feedforward Computation via Parallel Nonlinear Equation
    Solving", §5.2 and Fig. 1d.
    """
    checks.one_of("metric", metric, METRICS)
    solver = make_solver(method)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if blocks is not None and method != "jacobi_gs":
        raise ValueError(f"blocks is only used by method='jacobi_gs' (by name), got "
                         f"method={method!r}")
    if isinstance(method, str) and method in ("jacobi_gs", "gs_jacobi"):
        solver = type(solver)(block_size=1)
    rec = as_recurrence(model)
    system = rec.bind(x)
    if metric == "top5_changes" and system.reference[-1].dim() != 2:
        raise ValueError(f"metric='top5_changes' needs network outputs shaped (batch, classes), "
                         f"got {tuple(system.reference[-1].shape)}; use metric='max_abs'")
    sol = trace(system, method=solver, tol=tol, norm=norm,
                max_iters=max_iters, throw=throw, metric=metric, blocks=blocks)
    return system.output(sol.value), sol
