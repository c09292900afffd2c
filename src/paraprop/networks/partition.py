"""Jacobi-GS over any partition of a network's states into contiguous blocks (Algorithm 2).

:func:`paraprop.solve` splits the positions into blocks of one length. A network's states differ
in cost (a DenseNet's last transition, a weight-bound 1x1 convolution, takes several dense layers'
time), and the parallel time of one Jacobi-GS iteration is that of its slowest block. So the
blocks here may have any lengths: :func:`balanced_blocks` groups consecutive cheap states until a
time budget is reached, and :func:`jacobi_gs_blocks` iterates Algorithm 2 over that partition.

Semantics (Song et al. 2021, Algorithm 2): in one iteration every block runs in parallel,
computing its states in order; a state reads its own block's new values and every earlier block's
values from the previous iterate. After iteration ``k`` the first ``k`` blocks are exact
(Proposition 2), so at most ``len(blocks)`` iterations give the sequential result. The sequential
driver emulates the parallel blocks by visiting them last to first, so that a block still sees the
previous values of the blocks before it (:class:`paraprop.solvers.JacobiGS` with ``blocks=``);
``workers=`` runs the same iteration's blocks on threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Unpack

import torch

from paraprop import checks
from paraprop.networks.layer_system import LayerSystem
from paraprop.result import Solution
from paraprop.solve import SolveOptions, solve
from paraprop.solvers import JacobiGS
from paraprop.solvers.jacobi_gs import as_ranges

__all__ = ["balanced_blocks", "check_blocks", "jacobi_gs_blocks"]


def balanced_blocks(times, budget: float | None = None) -> list[range]:
    """Group consecutive states into blocks whose summed time stays within ``budget``.

    Walking the states in order, a state joins the current block while the block's time stays
    ``<= budget``, and starts a new block otherwise (a state slower than ``budget`` is a block of
    its own). For a cap on the block time this greedy rule gives the fewest contiguous blocks.

    Arguments:
        times: seconds per state (:func:`~paraprop.networks.profile`).
        budget: the cap; default: the slowest state's time, so that a Jacobi-GS iteration takes
            no longer than a Jacobi one while information moves through several states per block.

    Returns:
        The blocks, as ranges covering ``0 .. T-1`` in order.

    Raises:
        ValueError: empty, negative or non-finite times, or a budget that is not positive.

    Example:
        >>> balanced_blocks([1.0, 1.0, 3.0, 1.0, 2.0])
        [range(0, 2), range(2, 3), range(3, 5)]
    """
    t = torch.as_tensor(times, dtype=torch.float64).flatten()
    if t.numel() == 0 or not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"times must be a non-empty sequence of finite seconds >= 0, got "
                         f"{times!r}")
    cap = float(t.max()) if budget is None else checks.positive_number("budget", budget)
    blocks, lo, acc = [], 0, 0.0
    for i, ti in enumerate(t.tolist()):
        if i > lo and acc + ti > cap:
            blocks.append(range(lo, i))
            lo, acc = i, 0.0
        acc += ti
    blocks.append(range(lo, t.numel()))
    return blocks


def check_blocks(blocks, T: int) -> list[range]:
    """``blocks`` as ranges, after checking they are contiguous and cover ``0 .. T-1`` in order.

    Raises:
        TypeError: ``blocks`` is not a sequence of sequences of ints.
        ValueError: empty blocks, gaps, overlaps or a wrong order (the blocks are shown).
    """
    return as_ranges(blocks, "blocks", T, "states")


def jacobi_gs_blocks(
    system: LayerSystem,
    blocks: Sequence[Sequence[int]],
    *,
    workers: int = 1,
    costs: Sequence[float] | None = None,
    **options: Unpack[SolveOptions],
) -> Solution:
    """Jacobi-GS (Algorithm 2) over any contiguous partition of the states of ``system``.

    :func:`paraprop.solve` with ``method=JacobiGS(blocks=blocks, workers=workers,
    costs=costs)``: the stopping rule,
    per-sample freezing and the checks (non-finite values, triangularity) are the driver's, with
    the positions of the first ``k - 1`` blocks counted as final at iteration ``k``.

    Arguments:
        system: a bound :class:`~paraprop.networks.LayerSystem` (or any ``fn`` with ``update``
            and ``x0`` over ``(batch, T, features)``).
        blocks: the partition (e.g. :func:`balanced_blocks`); ``[[0], [1], ...]`` is Jacobi.
        workers: threads that share each iteration's blocks (the iterates stay bitwise those
            of one thread; see :class:`~paraprop.solvers.JacobiGS`).
        costs: seconds per state (e.g. :func:`~paraprop.networks.profile`) to balance the
            blocks among the workers; default round-robin.
        options: ``tol``, ``norm``, ``max_iters``, ``throw``, ``callback``: passed to
            :func:`paraprop.solve` (its defaults apply).

    Returns:
        A :class:`~paraprop.Solution` (``method="jacobi_gs"``; ``stats["blocks"]`` holds the
        partition, ``stats["bound"]`` is the number of blocks).

    Raises:
        ValueError / TypeError: a bad partition or argument (named, with the value).
        ConvergenceError: not converged within ``max_iters`` and ``throw=True``.
        NonFiniteError, NotTriangularError: as for :func:`paraprop.solve`.

    Example:
        >>> from paraprop.networks import as_recurrence, profile
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
        ...                     nn.Linear(8, 3)).eval()
        >>> system = as_recurrence(net).bind(torch.randn(5, 4))
        >>> sol = jacobi_gs_blocks(system, balanced_blocks(profile(system)), tol=0)
        >>> torch.equal(system.output(sol.value), system.reference[-1])
        True

    Song et al. 2021, Algorithm 2 and Proposition 2.
    """
    x0 = system.x0
    if x0.dim() != 3:
        raise ValueError(f"system.x0 must be shaped (batch, states, features), got "
                         f"{tuple(x0.shape)}")
    blocks = check_blocks(blocks, x0.shape[1])
    method = JacobiGS(blocks=blocks, workers=workers,
                      costs=None if costs is None else [float(c) for c in costs])
    return solve(system, x0, method=method, dim=1, **options)
