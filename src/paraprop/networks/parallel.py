"""Real parallel execution of Jacobi-GS over a network's states, with threads.

The parallel-time estimate (:mod:`paraprop.networks.timing`) assumes a worker per block and no
overhead. This module measures what the same iteration actually takes on the machine at hand: the
blocks of one iteration are shared among worker threads (PyTorch operators release the GIL, so the
threads' kernels run at the same time), each thread runs its blocks state after state, and the
iteration ends when all are done.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from paraprop import checks
from paraprop.networks.blocks import check_blocks
from paraprop.networks.recurrence import LayerSystem
from paraprop.networks.timing import uniform_blocks

__all__ = ["ThreadedJacobiGS"]


class ThreadedJacobiGS:
    """Jacobi-GS (Algorithm 2) over a :class:`~paraprop.networks.LayerSystem` on a pool of threads.

    The iterates are those of :func:`~paraprop.networks.jacobi_gs_blocks` with the same blocks: in
    one iteration every block computes its states in order from its own new values and the
    previous values of the blocks before it (blocks of one state: Jacobi, the iterates of
    ``paraprop.solve(..., method="jacobi")``). The blocks are shared among ``workers`` threads,
    balanced by ``times`` when given (slowest block first, each to the least loaded thread), else
    round-robin. It stops when the forward difference (largest absolute change over the whole
    batch) is ``<= tol``, or after ``len(blocks)`` iterations, where the result is exact; unlike
    :func:`paraprop.solve` it has no per-sample stopping.

    Arguments:
        system: the bound system.
        block_size: states per block, for uniform blocks (default 1).
        blocks: an explicit partition into contiguous blocks instead (e.g.
            :func:`~paraprop.networks.balanced_blocks`).
        workers: threads (default: the CPU count).
        intra_op_threads: PyTorch threads inside each worker (default 1: the workers are the
            parallelism).
        times: optional seconds per state (:func:`~paraprop.networks.profile`) to balance the work.

    Raises:
        ValueError: a bad ``block_size``, ``blocks``, ``workers``, ``intra_op_threads`` or
            ``times``, or both ``block_size`` and ``blocks``.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
        ...                     nn.Linear(16, 2)).eval()
        >>> system = paraprop.networks.as_recurrence(net).bind(torch.randn(8, 4))
        >>> with ThreadedJacobiGS(system, workers=2) as par:
        ...     x, iterations, residuals = par.run(tol=0)
        >>> out = system.output(x)
        >>> torch.equal(out, system.reference[-1]), iterations <= 3
        (True, True)

    Song et al. 2021, Algorithm 2 (Jacobi-GS).
    """

    def __init__(self, system: LayerSystem, *, block_size: int | None = None, blocks=None,
                 workers: int | None = None, intra_op_threads: int = 1, times=None):
        if block_size is not None and blocks is not None:
            raise ValueError("pass block_size or blocks, not both")
        if blocks is None:
            blocks = uniform_blocks(system.T, 1 if block_size is None else block_size)
        self.blocks = check_blocks(blocks, system.T)
        if workers is None:
            workers = os.cpu_count() or 1
        checks.positive_int("workers", workers)
        checks.positive_int("intra_op_threads", intra_op_threads)
        if times is not None:
            times = [float(t) for t in times]
            if len(times) != system.T:
                raise ValueError(f"times must have one entry per state ({system.T}), got "
                                 f"{len(times)}")
        self.system = system
        self.workers = workers
        self.intra_op_threads = intra_op_threads
        self.bound = len(self.blocks)
        cost = [sum(times[t] for t in b) if times else len(b) for b in self.blocks]
        self.shares = _share(self.blocks, cost, workers, balanced=times is not None)
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

    def _run_blocks(self, blocks: list[range], prev: torch.Tensor, work: torch.Tensor) -> None:
        s = self.system
        with torch.no_grad():
            for blk in blocks:
                for t in blk:  # own block: new values in work; earlier blocks: prev
                    work[:, t, : s.sizes[t]] = s.compute(t, work, before=prev, start=blk.start)

    @torch.no_grad()
    def run(self, *, tol: float = 0.0, max_iters: int | None = None
            ) -> tuple[torch.Tensor, int, list[float]]:
        """Iterate from the zero guess; returns ``(x, iterations, forward_differences)``.

        Arguments:
            tol: stop when the forward difference is ``<= tol`` (``0``: a bitwise fixed point).
            max_iters: cap on iterations (default: the exactness bound, ``len(blocks)``).

        Raises:
            ValueError: a negative ``tol`` or a bad ``max_iters``.
        """
        checks.check_tol(tol)
        checks.check_max_iters(max_iters)
        self.open()
        cap = self.bound if max_iters is None else min(max_iters, self.bound)
        x = self.system.x0
        residuals: list[float] = []
        k = 0
        while k < cap:
            k += 1
            work = torch.zeros_like(x)
            futures = [self._pool.submit(self._run_blocks, share, x, work)
                       for share in self.shares]
            for f in futures:  # the iteration's barrier
                f.result()
            residuals.append(float((work - x).abs().max()))
            x = work
            if residuals[-1] <= tol:
                break
        return x, k, residuals


def _share(blocks: list[range], cost: list[float], workers: int, *, balanced: bool
           ) -> list[list[range]]:
    """Split the blocks among at most ``workers`` threads, each share in state order."""
    n = min(workers, len(blocks))
    if not balanced:
        shares = [blocks[i::n] for i in range(n)]
    else:
        load = [0.0] * n
        shares = [[] for _ in range(n)]
        for i in sorted(range(len(blocks)), key=lambda j: -cost[j]):
            w = min(range(n), key=load.__getitem__)
            shares[w].append(blocks[i])
            load[w] += cost[i]
        shares = [sorted(s, key=lambda b: b.start) for s in shares]
    return [s for s in shares if s]

