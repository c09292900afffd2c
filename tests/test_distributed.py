"""paraprop.distributed: 2 gloo processes on localhost give the single-process results."""

import json
import os
import time

import pytest
import torch

from paraprop.distributed import (
    DistLink,
    LayerParallelStack,
    layer_range,
    partitioned_forward,
    spawn,
)
from paraprop.multigrid import ParallelResidualStack
from paraprop.multigrid.examples import mlp_blocks

# depth, layers per rank (None: even), levels, coarsening, relax, cycles
CONFIGS = [
    (16, None, 2, 4, "FCF", 2),
    (23, [4, 19], 3, 2, "F", 3),  # uneven split
    (23, [21, 2], 2, 4, "FCF", 3),  # rank 1 owns no coarse point
    (30, [13, 17], 3, 3, "FCF", None),  # to convergence (N // c cycles)
]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _compare(rank, configs):
    """Forward, backward and the partitioned baseline against one process, per config."""
    out = []
    for depth, sizes, levels, c, relax, cycles in configs:
        blocks = mlp_blocks(depth, 5, kind="iid", gain=1.5, seed=depth, dtype=torch.float64)
        x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        h = 1.5 / depth
        a, b = layer_range(depth, sizes)
        stack = LayerParallelStack(blocks[a:b], h, depth=depth, sizes=sizes, levels=levels,
                                   coarsening=c, relax=relax, max_cycles=cycles, timeout=30)
        xin = x.clone().requires_grad_(True)
        y = stack(x if rank else xin)
        if stack.is_last:
            (y ** 2).sum().backward()
        else:
            y.backward(torch.zeros_like(y))
        one = ParallelResidualStack(blocks, h, levels=levels, coarsening=c, relax=relax,
                                    max_cycles=cycles)
        xr = x.clone().requires_grad_(True)
        one.zero_grad()
        yr = one(xr)
        (yr ** 2).sum().backward()
        mine = [p.grad for p in stack.blocks.parameters()]
        ref = [p.grad for blk in one.blocks[a:b] for p in blk.parameters()]
        part = partitioned_forward(blocks[a:b], x, h, timeout=30)
        out.append({
            "y": _rel(y, yr) if stack.is_last else 0.0,
            "grads": max(_rel(g, r) for g, r in zip(mine, ref, strict=True)),
            "gx": _rel(xin.grad, xr.grad) if rank == 0 else 0.0,
            "partitioned": _rel(part, one.serial_forward(x)) if stack.is_last else 0.0,
            "residuals": stack.last_stats["forward"]["residuals"],
            "ref_residuals": one.last_stats["forward"]["residuals"],
            "messages": stack.last_stats["forward"]["messages"],
        })
    try:
        LayerParallelStack(mlp_blocks(3, 5), 0.1, depth=16)
    except ValueError as e:
        out.append(str(e))
    return out


def _compare_and_time(rank, configs, out):
    """:func:`_compare`, then the torchrun benchmark worker (``python -m paraprop.distributed``)
    in the same processes (it finds the process group already initialised)."""
    from paraprop.distributed.__main__ import main

    res = _compare(rank, configs)
    code = main(["--depth", "32", "--width", "4", "--batch", "2", "--levels", "2",
                 "--repeats", "1", "--out", out, "--save-output", out + ".pt"])
    return res, code


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path):
    out = str(tmp_path / "bench.json")
    results = spawn(_compare_and_time, 2, CONFIGS, out, timeout=240, threads=1)
    for rank, (res, code) in enumerate(results):
        assert code == 0
        for cfg, r in zip(CONFIGS, res[:-1], strict=True):
            for key in ("y", "grads", "gx", "partitioned"):
                assert r[key] <= 1e-12, (rank, cfg, key, r[key])
            assert r["residuals"] == pytest.approx(r["ref_residuals"], rel=1e-9, abs=1e-14)
            assert (r["messages"] > 0) == (rank == 0)  # only rank 0 has a right neighbour
        a, b = layer_range(16, rank=rank, world=2)
        assert res[-1] == (f"rank {rank} owns layers [{a}, {b}) of depth=16, so it needs "
                           f"{b - a} blocks, got 3")
    converged = results[1][0][3]["residuals"]
    assert converged[-1] <= 1e-13
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["world"] == 2 and record["layers_per_rank"] == [[0, 16], [16, 32]]
    assert len(record["times"]["mgrit"]) == 1 and record["link"]["latency_s"] > 0
    y = torch.load(out + ".pt")
    one = ParallelResidualStack(mlp_blocks(32, 4, kind="iid", seed=0), 1 / 32, levels=2,
                                max_cycles=2)
    with torch.no_grad():
        ref = one(torch.randn(2, 4, generator=torch.Generator().manual_seed(1)))
    assert _rel(y, ref) <= 1e-6


def _peer_fails(rank, mode):
    """Rank 1 dies (or hangs) before the solve; rank 0 must raise a clear error in time."""
    blocks = mlp_blocks(16, 3, dtype=torch.float64)
    if rank == 1:
        if mode == "dies":
            os._exit(1)
        # join the input broadcast, then never send a C-point
        torch.distributed.broadcast(torch.zeros(2, 3, dtype=torch.float64), 0)
        time.sleep(2.5)
        os._exit(0)
    stack = LayerParallelStack(blocks[:8], 0.1, depth=16, timeout=1)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            stack(torch.randn(2, 3, dtype=torch.float64))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e), time.perf_counter() - t0
    return "no error", "", time.perf_counter() - t0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_dead_or_hung_rank_gives_a_clear_error(mode):
    results = spawn(_peer_fails, 2, mode, timeout=90, threads=1, group_timeout=10,
                    allow_errors=True)
    name, msg, waited = results[0]
    assert name == "PeerError"
    assert msg.startswith("rank 0 (forward): ") and "died or hangs" in msg
    if mode == "hangs":  # rank 0 waits for rank 1 in vain (normally in the first all-reduce)
        assert "failed after at most 1 s" in msg
    assert waited < 10


def test_needs_an_initialised_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        LayerParallelStack(mlp_blocks(4, 2), 0.1, depth=4)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        DistLink([0])


def test_layer_range():
    assert layer_range(10, rank=0, world=3) == (0, 4)
    assert layer_range(10, [3, 7], rank=1, world=2) == (3, 10)
    with pytest.raises(ValueError, match="must be 2 positive ints summing to 10"):
        layer_range(10, [3, 3], rank=0, world=2)
