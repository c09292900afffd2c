"""A window's batched model call split across ``torch.distributed`` ranks (as ParaDiGMS spreads
its window over GPUs).

Every rank runs the same solve on the same data; only the model rows of each iteration are
divided: rank ``r`` evaluates a contiguous share of them, and one ``all_gather`` gives every rank
all the outputs. The iterates, the stopping decisions and the result are therefore the same on
every rank. Start the processes with ``torchrun`` (or :func:`paraprop.distributed.spawn`) and pass
``shard=True`` (or a process group) to :func:`paraprop.diffusion.sample`.
"""

from __future__ import annotations

import torch

from paraprop.distributed.comm import DEFAULT_TIMEOUT_S, DistLink


def shares(rows: int, world: int) -> list[int]:
    """Rows per rank: as equal as possible, the first ranks taking one more."""
    base, extra = divmod(rows, world)
    return [base + (r < extra) for r in range(world)]


def sharded_evaluate(group=None, *, timeout: float = DEFAULT_TIMEOUT_S):
    """``evaluate(fn, x, t)`` for :class:`~paraprop.diffusion.DiffusionChain`: this rank's share
    of the rows of ``x`` through ``fn``, then all shares gathered in order (through
    :class:`paraprop.distributed.DistLink`: a rank that dies or hangs makes the others raise
    :class:`~paraprop.distributed.PeerError` after ``timeout`` seconds, never hang).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard: torch.distributed is not initialised; start the processes "
                           "with torchrun (or paraprop.distributed.spawn) and call "
                           "init_process_group first, or pass shard=None")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    link = DistLink(list(range(world)), timeout=timeout, group=group, what="diffusion shard")

    def evaluate(fn, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sizes = shares(x.shape[0], world)
        lo = sum(sizes[:rank])
        hi = lo + sizes[rank]
        mine = fn(x[lo:hi], t[lo:hi], slice(lo, hi)) if hi > lo else x[:0]
        width = max(sizes)
        buf = torch.zeros((width, *x.shape[1:]), dtype=x.dtype, device=x.device)
        buf[: hi - lo] = mine
        parts = link.gather(buf)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])

    return evaluate
