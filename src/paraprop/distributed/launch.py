"""Start ``world`` local processes joined in a gloo (or nccl) group and collect their results.

For tests, benchmarks and demos on one machine; production runs use
``torchrun --nproc_per_node=N``. The children meet through a file rendezvous
(``init_method="file://..."`` in a fresh temporary directory), so no TCP port is picked in
advance and two concurrent :func:`spawn` calls cannot collide. Each child calls
``fn(rank, *args)`` and sends back its (picklable) result or its error. The parent waits at
most ``timeout`` seconds, then kills what is left: a dead or hung child makes :func:`spawn`
raise, it never blocks forever.
"""

from __future__ import annotations

import datetime as _dt
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

__all__ = ["SpawnError", "spawn"]


class SpawnError(RuntimeError):
    """A child process failed, died or did not finish in time (the message says which).

    Example:
        >>> spawn(pow, 1, -1)           # rank 0 computes pow(0, -1)
        Traceback (most recent call last):
        paraprop.distributed.launch.SpawnError: rank 0: ZeroDivisionError: ...
    """


def _entry(rank, world, rendezvous, backend, threads, group_timeout, fn, args, results):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank,
                                world_size=world, timeout=_dt.timedelta(seconds=group_timeout))
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

    Example:
        ``fn`` must live in an importable module (a builtin here), and a script guards the
        call with ``if __name__ == "__main__":``.

        >>> results = spawn(pow, 2, -1, allow_errors=True)   # pow(rank, -1), ranks 0 and 1
        >>> results[0].splitlines()[0], results[1]
        ('ERROR: ZeroDivisionError: 0.0 cannot be raised to a negative power', 1.0)
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="paraprop-spawn-") as tmp:
        # the store's file must not exist yet; it lives (and dies) with this directory
        rendezvous = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(r, world, rendezvous, backend, threads,
                                                  group_timeout, fn, args, results),
                             daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        got = _collect(procs, results, world, timeout)
    errors = {r: out for r, (ok, out) in got.items() if not ok}
    if errors and not allow_errors:
        msg = "; ".join(f"rank {r}: {str(e).splitlines()[0]}" for r, e in sorted(errors.items()))
        detail = "\n".join(str(e) for e in errors.values())
        raise SpawnError(f"{msg}\n{detail}")
    return [got[r][1] if got[r][0] else f"ERROR: {got[r][1]}" for r in range(world)]


def _collect(procs, results, world: int, timeout: float) -> dict[int, tuple[bool, object]]:
    """Every rank's ``(ok, result)``; kills what is left after ``timeout`` seconds."""
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
    return got
