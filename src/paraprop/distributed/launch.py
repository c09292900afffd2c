"""Start ``world`` local processes joined in a gloo (or nccl) group and collect their results.

For tests, benchmarks and demos on one machine; production runs use
``torchrun --nproc_per_node=N``. Each child initialises ``torch.distributed`` on a free localhost
port, calls ``fn(rank, *args)`` and sends back its (picklable) result or its error. The parent
waits at most ``timeout`` seconds, then kills what is left: a dead or hung child makes
:func:`spawn` raise, it never blocks forever.
"""

from __future__ import annotations

import datetime as _dt
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

__all__ = ["SpawnError", "free_port", "spawn"]


class SpawnError(RuntimeError):
    """A child process failed, died or did not finish in time (the message says which)."""


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, backend, threads, group_timeout, fn, args, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=_dt.timedelta(seconds=group_timeout))
        out = fn(rank, *args)
        results.put((rank, True, out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def spawn(fn: Callable, world: int, *args, timeout: float = 120.0, backend: str = "gloo",
          threads: int | None = None, group_timeout: float = 60.0, allow_errors: bool = False
          ) -> list:
    """Run ``fn(rank, *args)`` in ``world`` fresh processes joined in one process group.

    Arguments:
        fn: a module-level (picklable) function; its return value must be picklable.
        world: the number of processes.
        timeout: seconds to wait for all results.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        threads: torch threads per process (``None``: cores // world, at least 1).
        group_timeout: the process group's own timeout (collectives, rendezvous).
        allow_errors: return failed ranks' error text (``"ERROR: ..."``) instead of raising.

    Returns:
        The results in rank order.

    Raises:
        SpawnError: a child raised (unless ``allow_errors``), died, or the time ran out.

    Example (``fn`` must live in an importable module; guard the call with
    ``if __name__ == "__main__":`` in scripts)::

        def world_size(rank):
            return torch.distributed.get_world_size()

        spawn(world_size, 2)   # [2, 2]
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, threads, group_timeout,
                                              fn, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SpawnError(f"ranks {sorted(set(range(world)) - set(got))} did not finish "
                                 f"within {timeout:g} s")
            try:
                r, ok, out = results.get(timeout=min(left, 1.0))
                got[r] = (ok, out)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in got and p.exitcode is not None]
                if dead:
                    # give a late result a moment to arrive through the queue
                    try:
                        r, ok, out = results.get(timeout=2.0)
                        got[r] = (ok, out)
                        continue
                    except queue.Empty:
                        pass
                    codes = {r: procs[r].exitcode for r in dead}
                    for r in dead:
                        got[r] = (False, f"process died with exit code {codes[r]}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = {r: out for r, (ok, out) in got.items() if not ok}
    if errors and not allow_errors:
        msg = "; ".join(f"rank {r}: {str(e).splitlines()[0]}" for r, e in sorted(errors.items()))
        detail = "\n".join(str(e) for e in errors.values())
        raise SpawnError(f"{msg}\n{detail}")
    return [got[r][1] if got[r][0] else f"ERROR: {got[r][1]}" for r in range(world)]
