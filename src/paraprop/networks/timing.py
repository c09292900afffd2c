"""Parallel-time estimates from measured per-state times (Song et al. 2021, §5.2, Fig. 1d).

The paper estimates what Jacobi-GS would take with enough parallel workers and no parallel
overhead: measure how long every state (a dense layer, a residual block, ...) takes in an ordinary
forward pass (repeated runs, median), then

- sequential time = the sum of all state times;
- one Jacobi iteration = the slowest state (all states at once);
- one Jacobi-GS iteration with blocks = the slowest block, each block running its states in order.

These are simulations, not measurements: ``JacobiGS(blocks=..., workers=...)`` measures the
real parallel execution on the machine at hand, which the reports show separately.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from paraprop import checks
from paraprop.networks.layer_system import LayerSystem

__all__ = ["estimate_time", "partition_time", "profile", "uniform_blocks"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def profile(system: LayerSystem, *, repeats: int = 5, warmup: int = 1) -> torch.Tensor:
    """Median wall time of every state of ``system``, in seconds.

    Each round evaluates every state once, in order, from the sequential states (so every layer
    sees its real inputs), timing each state on its own (synchronising an accelerator around
    it); ``warmup`` untimed rounds come first.

    Arguments:
        system: a bound :class:`~paraprop.networks.LayerSystem`.
        repeats: timed rounds (the median is taken over them).
        warmup: untimed rounds first.

    Returns:
        A float64 tensor ``(T,)`` of median seconds per state.

    Raises:
        ValueError: ``repeats < 1`` or ``warmup < 0``.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        >>> system = paraprop.networks.as_recurrence(net).bind(torch.randn(8, 4))
        >>> times = profile(system, repeats=5)
        >>> times.shape, bool(times.min() > 0)
        (torch.Size([2]), True)
        >>> total = float(times.sum())  # the sequential time, as the paper estimates it
    """
    checks.positive_int("repeats", repeats)
    checks.nonneg_int("warmup", warmup)
    rec, ref, u = system.recurrence, system.reference, system.input
    fetch = lambda i: u if i < 0 else ref[i]  # noqa: E731
    samples = torch.zeros(repeats, system.T, dtype=torch.float64)
    for r in range(warmup + repeats):
        for t in range(system.T):
            _sync(system.device)
            t0 = time.perf_counter()
            rec.run_step(t, fetch)
            _sync(system.device)
            if r >= warmup:
                samples[r - warmup, t] = time.perf_counter() - t0
    return samples.median(dim=0).values


def uniform_blocks(T: int, block_size: int) -> list[range]:
    """Contiguous blocks of ``block_size`` states (the last may be shorter)."""
    checks.positive_int("block_size", block_size)
    return [range(lo, min(T, lo + block_size)) for lo in range(0, T, block_size)]


def _times(times) -> torch.Tensor:
    t = torch.as_tensor(times, dtype=torch.float64).flatten()
    if t.numel() == 0 or not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"times must be a non-empty sequence of finite seconds >= 0, got "
                         f"{times!r}")
    return t


def _iterations(iterations) -> int:
    return checks.nonneg_int("iterations", iterations)


def estimate_time(times, *, method: str, iterations: int, block_size: int | None = None
                  ) -> float:
    """Estimated wall time of ``iterations`` iterations of ``method`` with unlimited workers.

    Arguments:
        times: seconds per state (:func:`profile`).
        method: ``"sequential"`` (the sum, ``iterations`` ignored), ``"jacobi"`` (iterations x
            slowest state), ``"jacobi_gs"`` (iterations x one sweep through the offsets of the
            blocks of ``block_size``: :func:`paraprop.solve` updates offset ``j`` of every block
            at once, from the newest values, so a sweep takes ``sum_j max_blocks t[block, j]``;
            with ``block_size=1`` it is the slowest state) or ``"gs_jacobi"`` (iterations x
            slowest state, an upper bound: each iteration is one Jacobi sweep of one block).
        iterations: the parallel iterations the solve took (``Solution.iterations``).
        block_size: the block length for ``"jacobi_gs"`` (required there).

    Returns:
        Seconds.

    Raises:
        ValueError: an unknown method, negative or non-finite times, bad ``iterations`` or
            ``block_size``.

    Example:
        >>> estimate_time([1.0, 2.0, 3.0], method="jacobi", iterations=2)
        6.0
    """
    t = _times(times)
    k = _iterations(iterations)
    checks.one_of("method", method, ("sequential", "jacobi", "jacobi_gs", "gs_jacobi"))
    if method == "sequential":
        return float(t.sum())
    if method in ("jacobi", "gs_jacobi"):
        return k * float(t.max())
    if block_size is None:  # method == "jacobi_gs"
        raise ValueError("block_size is required for method='jacobi_gs'")
    blocks = uniform_blocks(t.numel(), block_size)
    b = len(blocks[0])
    sweep = sum(max(float(t[blk[j]]) for blk in blocks if j < len(blk)) for j in range(b))
    return k * sweep


def partition_time(times, blocks: Sequence[Sequence[int]], iterations: int) -> float:
    """The general schedule: ``iterations`` x the slowest block of any partition.

    Every block runs its states in order on its own worker while the blocks run in parallel
    (Algorithm 2 with independent blocks); one iteration takes the slowest block's time.

    Arguments:
        times: seconds per state.
        blocks: a partition of the states ``0 .. T-1`` (each exactly once).
        iterations: parallel iterations.

    Returns:
        Seconds.

    Raises:
        ValueError: ``blocks`` is not a partition of the states, or bad times / iterations.

    Example:
        >>> partition_time([1.0, 2.0, 3.0], [[0, 1], [2]], iterations=2)
        6.0
    """
    t = _times(times)
    k = _iterations(iterations)
    flat = sorted(i for blk in blocks for i in blk)
    if flat != list(range(t.numel())):
        raise ValueError(f"blocks must partition the states 0..{t.numel() - 1} (each once), got "
                         f"{[list(b) for b in blocks]}")
    return k * max(float(t[list(blk)].sum()) for blk in blocks if len(blk))


def speedup(sequential: float, parallel: float) -> float:
    """``sequential / parallel`` (``inf`` for a zero parallel time)."""
    return sequential / parallel if parallel > 0 else math.inf
