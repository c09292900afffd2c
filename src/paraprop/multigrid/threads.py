"""Run a multi-rank solve inside one process, one thread per rank (no torch.distributed).

:class:`QueueLink` implements the :class:`paraprop.multigrid.vcycle.Link` protocol with queues
and a barrier. It runs the exact code path of a layer-parallel solve across ranks (ghost
exchange, uneven splits, ranks without coarse points) in a test or a demo without starting
processes, and it drives the cost model's event clock (:mod:`paraprop.multigrid.cost`).

When a rank fails, :func:`run_threads` puts a poison message on every queue and breaks the
barrier, so the other ranks stop at their next receive or all-reduce (raising
:class:`paraprop.PeerError`) instead of waiting for the timeout; the failing rank's error is
re-raised.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from paraprop.errors import PeerError

__all__ = ["QueueLink", "run_threads"]

_POISON = "poison"  # the tag of the message run_threads sends when a rank failed


class QueueLink:
    """The link of rank ``me`` among ``world`` threads (create them with :func:`run_threads`)."""

    def __init__(self, me: int, world: int, queues: dict, barrier: threading.Barrier,
                 board: list, timeout: float):
        self.me, self.world = me, world
        self._queues, self._barrier, self._board = queues, barrier, board
        self.timeout = timeout
        self.messages = 0

    def send(self, tensor: torch.Tensor, dest: int, tag: int) -> None:
        self.messages += 1
        self._queues[(self.me, dest)].put((tag, tensor.detach().clone()))

    def recv(self, like: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        try:
            got, t = self._queues[(src, self.me)].get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"rank {self.me}: nothing from rank {src} within "
                               f"{self.timeout} s (tag {tag})") from None
        if got == _POISON:
            raise PeerError(f"rank {self.me}: rank {t} failed (waiting for rank {src}, "
                             f"tag {tag})")
        if got != tag:
            raise RuntimeError(f"rank {self.me}: expected tag {tag} from rank {src}, got {got}")
        return t

    def sum(self, value: float | list[float]) -> float | list[float]:
        """The sum over all ranks of ``value`` (a float, or elementwise a list of floats)."""
        self._board[self.me] = value
        try:
            self._barrier.wait(self.timeout)
            if isinstance(value, list | tuple):
                total = [sum(col) for col in zip(*self._board, strict=True)]
            else:
                total = sum(self._board)
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise PeerError(f"rank {self.me}: the all-reduce was abandoned (a rank failed or "
                             f"did not arrive within {self.timeout} s)") from None
        return total

    def flush(self) -> None:
        pass


def run_threads(world: int, fn: Callable[[int, QueueLink], object], *, timeout: float = 60.0
                ) -> list:
    """Call ``fn(rank, link)`` in ``world`` threads; return their results in rank order.

    Arguments:
        world: the number of ranks (threads).
        fn: called as ``fn(rank, link)``.
        timeout: seconds any receive or all-reduce waits for a rank that neither answers nor
            fails.

    Raises:
        The exception of the rank that failed first (the others are stopped by a poison
        message on every queue and a broken barrier, not by the timeout).
    """
    queues: dict[tuple[int, int], queue.Queue] = {(i, j): queue.Queue() for i in range(world)
                                                  for j in range(world)}
    barrier = threading.Barrier(world)
    board = [0.0] * world
    results: list = [None] * world
    errors: list = [None] * world

    def work(r: int) -> None:
        try:
            results[r] = fn(r, QueueLink(r, world, queues, barrier, board, timeout))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e
            if not isinstance(e, PeerError):
                for (_, dest), q in queues.items():
                    if dest != r:
                        q.put((_POISON, r))
            barrier.abort()

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None and not isinstance(e, PeerError | threading.BrokenBarrierError):
            raise e
    for e in errors:
        if e is not None:
            raise e
    return results
