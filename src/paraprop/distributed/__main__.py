"""``torchrun --nproc_per_node=N -m paraprop.distributed``: time layer-parallel MGRIT against
model partitioning on a residual MLP (used by ``paraprop bench multigrid``).

Every rank builds the same seeded ``depth``-layer, ``width``-wide residual MLP and keeps its
contiguous share of the layers. Each round times, interleaved, one layer-parallel MGRIT forward
pass (a fixed ``--cycles`` V-cycles, ``tol=None``: not checked against the serial result) and
one model-partitioned forward pass; a round's time is the
slowest rank's. With two or more ranks a ping-pong between ranks 0 and 1 measures the link's
latency and bandwidth. Rank 0 writes the JSON record; the last rank saves ``u_N``.

Example:
    torchrun --nproc_per_node=2 -m paraprop.distributed --depth 1024 --out /tmp/r2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paraprop.distributed.comm import init_from_env
from paraprop.distributed.layer_parallel import (
    LayerParallelStack,
    layer_range,
    partitioned_forward,
)
from paraprop.models.blocks import mlp_blocks


def _max_over_ranks(t: float) -> float:
    v = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return float(v)


def _timed(fn) -> tuple[float, object]:
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return _max_over_ranks(time.perf_counter() - t0), out


def ping_pong(nbytes: int, rounds: int = 20) -> float:
    """Median round-trip time between ranks 0 and 1 for a message of ``nbytes``."""
    rank = dist.get_rank()
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    times = []
    for _ in range(rounds + 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paraprop.distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=1024)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--coarsening", type=int, default=4)
    p.add_argument("--relax", choices=["F", "FCF"], default="FCF")
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fast", action="store_true", help="blocks with a batched_forward kernel")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: cores // ranks)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", required=True, help="JSON record (written by rank 0)")
    p.add_argument("--save-output", default=None, help="torch.save u_N here (last rank)")
    args = p.parse_args(argv)

    rank = init_from_env("gloo", timeout=args.timeout)
    world = dist.get_world_size()
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    blocks = mlp_blocks(args.depth, args.width, kind="iid", seed=0, fast=args.fast)
    a, b = layer_range(args.depth)
    h = 1.0 / args.depth
    stack = LayerParallelStack(blocks[a:b], h, depth=args.depth, levels=args.levels,
                               coarsening=args.coarsening, relax=args.relax,
                               max_iters=args.cycles, tol=None, timeout=args.timeout)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"mgrit": [], "partitioned": []}
    y = None
    with torch.no_grad():
        for r in range(args.repeats + 1):  # the first round warms up
            t_mg, y = _timed(lambda: stack(x))
            t_part, _ = _timed(lambda: partitioned_forward(stack.blocks, x, h,
                                                           timeout=args.timeout))
            if r:
                times["mgrit"].append(t_mg)
                times["partitioned"].append(t_part)
    link = {}
    if world >= 2:
        state_bytes = x.numel() * x.element_size()
        small, large = ping_pong(8), ping_pong(max(state_bytes, 1 << 20))
        latency = small / 2
        link = {"latency_s": latency, "bandwidth_Bps": max(state_bytes, 1 << 20)
                / max(large / 2 - latency, 1e-12), "state_bytes": state_bytes}
    if rank == world - 1 and args.save_output:
        torch.save(y, args.save_output)
    fwd = stack.last_forward
    assert fwd is not None      # the forward above ran
    record = {"world": world, "threads": threads, "config": vars(args), "times": times,
              "median_s": {k: statistics.median(v) for k, v in times.items()},
              "residuals": fwd.residuals.tolist(), "messages_rank0": fwd.stats["messages"],
              "wait_s_rank0": fwd.stats["wait_s"], "time_s_rank0": fwd.stats["time_s"],
              "layers_per_rank": [list(r) for r in stack.parts], "link": link}
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
