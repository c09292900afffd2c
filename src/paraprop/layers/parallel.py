"""Real parallel execution of Jacobi-GS over a network's states, with threads.

The parallel-time estimate (:mod:`paraprop.layers.timing`) assumes unlimited workers and no
overhead. This module measures what the same iteration actually takes on the machine at hand:
the states of one Jacobi-GS step are split among worker threads (PyTorch operators release the
GIL, so the threads' kernels run at the same time), each thread computes its share one state
after another, and the step ends when all are done.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from paraprop.layers.recurrence import LayerSystem

__all__ = ["ThreadedJacobiGS"]


class ThreadedJacobiGS:
    """Jacobi-GS over a :class:`~paraprop.layers.LayerSystem` on a pool of threads.

    The iterates are those of ``paraprop.solve(system, system.x0, method="jacobi_gs",
    block_size=block_size, dim=1)``: one iteration updates offset ``j`` of every block at once,
    for ``j = 0 .. block_size-1``, each from the newest values (``block_size=1`` is Jacobi). The
    states of one offset are shared among ``workers`` threads, balanced by ``times`` when given
    (longest first, each to the least loaded thread), else round-robin. It stops when the forward
    difference (largest absolute change over the whole batch) is ``<= tol``, or at the exactness
    bound ``ceil(T / block_size)``; unlike :func:`paraprop.solve` it has no per-sample stopping.

    Arguments:
        system: the bound system.
        block_size: states per block (``>= 1``).
        workers: threads (default: the CPU count).
        intra_op_threads: PyTorch threads inside each worker (default 1: the workers are the
            parallelism).
        times: optional seconds per state (:func:`~paraprop.layers.profile`) to balance the work.

    Raises:
        ValueError: a bad ``block_size``, ``workers``, ``intra_op_threads`` or ``times``.

    Example:
        >>> with ThreadedJacobiGS(system, workers=2) as par:
        ...     x, iterations, residuals = par.run(tol=1e-4)
        >>> out = system.output(x)

    Song et al. 2021, Algorithm 2 (Jacobi-GS).
    """

    def __init__(self, system: LayerSystem, *, block_size: int = 1, workers: int | None = None,
                 intra_op_threads: int = 1, times=None):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if workers is None:
            workers = os.cpu_count() or 1
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if (isinstance(intra_op_threads, bool) or not isinstance(intra_op_threads, int)
                or intra_op_threads < 1):
            raise ValueError(f"intra_op_threads must be a positive int, got {intra_op_threads!r}")
        if times is not None:
            times = [float(t) for t in times]
            if len(times) != system.T:
                raise ValueError(f"times must have one entry per state ({system.T}), got "
                                 f"{len(times)}")
        self.system = system
        self.block_size = min(block_size, system.T)
        self.workers = workers
        self.intra_op_threads = intra_op_threads
        self.bound = math.ceil(system.T / self.block_size)
        # offset j of every block: states j, j + b, j + 2b, ...; each split among the workers
        self.groups = [_share(list(range(j, system.T, self.block_size)), workers, times)
                       for j in range(self.block_size)]
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> ThreadedJacobiGS:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Start the worker threads (``run`` does it when needed)."""
        if self._pool is None:
            n = self.intra_op_threads
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="paraprop-layers",
                                            initializer=torch.set_num_threads, initargs=(n,))

    def close(self) -> None:
        """Stop the worker threads."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _compute(self, states: list[int], work: torch.Tensor) -> torch.Tensor:
        s = self.system
        out = work.new_zeros(s.B, len(states), s.F)
        with torch.no_grad():
            for j, t in enumerate(states):
                out[:, j, : s.sizes[t]] = s.compute(t, work)
        return out

    @torch.no_grad()
    def run(self, *, tol: float = 0.0, max_iters: int | None = None
            ) -> tuple[torch.Tensor, int, list[float]]:
        """Iterate from the zero guess; returns ``(x, iterations, forward_differences)``.

        Arguments:
            tol: stop when the forward difference is ``<= tol`` (``0``: a bitwise fixed point).
            max_iters: cap on iterations (default: the exactness bound).

        Raises:
            ValueError: a negative ``tol`` or a bad ``max_iters``.
        """
        if isinstance(tol, bool) or not isinstance(tol, int | float) or not tol >= 0:
            raise ValueError(f"tol must be a number >= 0, got {tol!r}")
        if max_iters is not None and (isinstance(max_iters, bool)
                                      or not isinstance(max_iters, int) or max_iters < 1):
            raise ValueError(f"max_iters must be a positive int or None, got {max_iters!r}")
        self.open()
        cap = self.bound if max_iters is None else min(max_iters, self.bound)
        x = self.system.x0
        residuals: list[float] = []
        k = 0
        while k < cap:
            k += 1
            work = x.clone()
            for shares in self.groups:
                futures = [(idx, self._pool.submit(self._compute, idx, work)) for idx in shares]
                done = [(idx, f.result()) for idx, f in futures]  # the offset's barrier
                for idx, vals in done:
                    work.index_copy_(1, torch.tensor(idx, device=work.device), vals)
            residuals.append(float((work - x).abs().max()))
            x = work
            if residuals[-1] <= tol:
                break
        return x, k, residuals


def _share(states: list[int], workers: int, times) -> list[list[int]]:
    """Split ``states`` among at most ``workers`` threads, each share kept in order."""
    n = min(workers, len(states))
    if times is None:
        shares = [states[i::n] for i in range(n)]
    else:
        load = [0.0] * n
        shares = [[] for _ in range(n)]
        for t in sorted(states, key=lambda s: -times[s]):
            w = min(range(n), key=load.__getitem__)
            shares[w].append(t)
            load[w] += times[t]
        shares = [sorted(s) for s in shares]
    return [s for s in shares if s]
