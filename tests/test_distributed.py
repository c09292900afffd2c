"""paraprop.distributed: 2 gloo processes on localhost give the single-process results."""

import copy
import json
import os
import time

import pytest
import torch
from torch import nn

from paraprop.distributed import (
    DistLink,
    LayerParallelStack,
    init_from_env,
    layer_range,
    partitioned_forward,
    spawn,
)
from paraprop.distributed.layer_parallel import _describe
from paraprop.models.blocks import mlp_blocks
from paraprop.multigrid import ParallelResidualStack, UncheckedResultWarning

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
                                   coarsening=c, relax=relax, max_iters=cycles, tol=None,
                                   timeout=30)
        xin = x.clone().requires_grad_(True)
        y = stack(x if rank else xin)
        if stack.is_last:
            (y ** 2).sum().backward()
        else:
            y.backward(torch.zeros_like(y))
        # separate copies: the reference's gradients must not land on (or wipe) the stack's
        one = ParallelResidualStack(copy.deepcopy(blocks), h, levels=levels, coarsening=c,
                                    relax=relax, max_iters=cycles, tol=None)
        xr = x.clone().requires_grad_(True)
        yr = one(xr)
        (yr ** 2).sum().backward()
        mine = [p.grad for p in stack.blocks.parameters()]
        ref = [p.grad for blk in one.blocks[a:b] for p in blk.parameters()]
        assert all(p is not q for p, q in zip(stack.parameters(), one.blocks[a:b].parameters(),
                                              strict=True))
        part = partitioned_forward(blocks[a:b], x, h, timeout=30)
        out.append({
            "y": _rel(y, yr) if stack.is_last else 0.0,
            "grads": max(_rel(g, r) for g, r in zip(mine, ref, strict=True)),
            "gx": _rel(xin.grad, xr.grad) if rank == 0 else 0.0,
            "partitioned": _rel(part, one.serial_forward(x)) if stack.is_last else 0.0,
            "residuals": stack.last_forward.residuals.tolist(),
            "ref_residuals": one.last_forward.residuals.tolist(),
            "messages": stack.last_forward.stats["messages"],
        })
    try:
        LayerParallelStack(mlp_blocks(3, 5), 0.1, depth=16)
    except ValueError as e:
        out.append(str(e))
    return out


def _reused_blocks(rank):
    """Blocks used at several depths of each rank: each rank's gradients are the sums over its
    own uses; summed over the ranks (an all-reduce) they are the single process's."""
    base = mlp_blocks(3, 4, kind="iid", gain=1.5, seed=5, dtype=torch.float64)
    depth, h = 20, 0.1
    blocks = [base[i % 3] for i in range(depth)]
    x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    a, b = layer_range(depth, [9, 11])
    stack = LayerParallelStack(blocks[a:b], h, depth=depth, sizes=[9, 11], coarsening=2,
                               max_iters=None, tol=None, timeout=30)
    y = stack(x)
    y.backward(2 * y if stack.is_last else torch.zeros_like(y))  # loss: sum(u_N ** 2)
    mine = []
    for p in (p for blk in base for p in blk.parameters()):
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.distributed.all_reduce(g)
        mine.append(g)
    ref_base = copy.deepcopy(base)
    one = ParallelResidualStack([ref_base[i % 3] for i in range(depth)], h, coarsening=2,
                                max_iters=None, tol=None)
    one(x).square().sum().backward()
    ref = [p.grad for blk in ref_base for p in blk.parameters()]
    return max(_rel(g, r) for g, r in zip(mine, ref, strict=True))


def _compare_and_time(rank, configs, out):
    """:func:`_compare` and :func:`_reused_blocks`, then the torchrun benchmark worker
    (``python -m paraprop.distributed``) in the same processes (it finds the process group
    already initialised)."""
    from paraprop.distributed.__main__ import main

    res = _compare(rank, configs)
    reused = _reused_blocks(rank)
    code = main(["--depth", "32", "--width", "4", "--batch", "2", "--levels", "2",
                 "--repeats", "1", "--out", out, "--save-output", out + ".pt"])
    return res, reused, code


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path):
    out = str(tmp_path / "bench.json")
    results = spawn(_compare_and_time, 2, CONFIGS, out, timeout=240, threads=1)
    for rank, (res, reused, code) in enumerate(results):
        assert code == 0
        assert reused <= 1e-12, (rank, reused)
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
    with pytest.warns(UncheckedResultWarning, match="max_iters=2 runs a fixed number"):
        one = ParallelResidualStack(mlp_blocks(32, 4, kind="iid", seed=0), 1 / 32, levels=2,
                                    max_iters=2, tol=None)
    with torch.no_grad():
        ref = one(torch.randn(2, 4, generator=torch.Generator().manual_seed(1)))
    assert _rel(y, ref) <= 1e-6


def _peer_fails(rank, mode):
    """Rank 1 dies (or hangs) before the solve; rank 0 must raise a clear error in time."""
    blocks = mlp_blocks(16, 3, dtype=torch.float64)
    if rank == 1:
        if mode == "dies":
            os._exit(1)
        # join the input check and the input broadcast, then never send a C-point
        x = torch.zeros(2, 3, dtype=torch.float64)
        desc = _describe(x, False)
        torch.distributed.all_gather([torch.empty_like(desc) for _ in range(2)], desc)
        torch.distributed.broadcast(x, 0)
        time.sleep(2.5)
        os._exit(0)
    stack = LayerParallelStack(blocks[:8], 0.1, depth=16, timeout=1)
    try:
        with torch.no_grad():
            stack(torch.randn(2, 3, dtype=torch.float64))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_dead_or_hung_rank_gives_a_clear_error(mode):
    results = spawn(_peer_fails, 2, mode, timeout=90, threads=1, group_timeout=10,
                    allow_errors=True)
    name, msg = results[0]
    assert name == "PeerError"
    assert msg.startswith("rank 0 (forward): ") and "died or hangs" in msg
    if mode == "hangs":  # rank 0 waits for rank 1 in vain (normally in the first all-reduce)
        assert "failed after at most 1 s" in msg


def test_needs_an_initialised_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        LayerParallelStack(mlp_blocks(4, 2), 0.1, depth=4)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        DistLink([0])


def test_init_from_env_outside_torchrun(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="not launched by torchrun: WORLD_SIZE, MASTER_ADDR, "
                                           "MASTER_PORT unset; run 'torchrun"):
        init_from_env("gloo")


@pytest.mark.parametrize("timeout", [0, -1.0, True, float("inf"), "10"])
def test_distlink_timeout_is_checked_first(timeout):
    with pytest.raises(ValueError, match="timeout must be a finite number > 0, got"):
        DistLink([0], timeout=timeout)


@pytest.mark.parametrize("kwargs,err,match", [
    ({"step_size": 0}, ValueError, "step_size must be a finite number > 0, got 0"),
    ({"relax": "C"}, ValueError, "unknown relax='C'; choose one of F, FCF"),
    ({"backward": "exact"}, ValueError,
     "unknown backward='exact'; choose one of adjoint, serial"),
    ({"max_iters": 0}, ValueError, "max_iters must be a positive int or None, got 0"),
    ({"tol": -1.0}, ValueError, "tol must be a number >= 0 or None, got -1.0"),
    ({"c_weight": 2.5}, ValueError, r"c_weight must be a number in \(0, 2\], got 2.5"),
    ({"timeout": 0}, ValueError, "timeout must be a finite number > 0, got 0"),
    ({"blocks": []}, ValueError, "blocks must not be empty"),
    ({"blocks": [nn.Linear(2, 2), "F"]}, TypeError, r"blocks\[1\] must be an nn.Module, got str"),
    ({"blocks": nn.Linear(2, 2)}, TypeError, "blocks must be a sequence of nn.Module"),
    ({"blocks": [nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))], "batched": True}, ValueError,
     "batched=True needs blocks that share an architecture"),
])
def test_layer_parallel_argument_errors(kwargs, err, match):
    """Arguments are checked before the process group, so no group is needed here."""
    args = {"blocks": mlp_blocks(4, 2), "step_size": 0.1, **kwargs}
    with pytest.raises(err, match=match):
        LayerParallelStack(args.pop("blocks"), args.pop("step_size"), depth=4, **args)


def test_layer_range():
    assert layer_range(10, rank=0, world=3) == (0, 4)
    assert layer_range(10, [3, 7], rank=1, world=2) == (3, 10)
    with pytest.raises(ValueError, match="must be 2 positive ints summing to 10"):
        layer_range(10, [3, 3], rank=0, world=2)


def test_settings_and_block_modes_are_checked_at_every_forward(tmp_path):
    """A world of one gloo process, in this process: settings assigned after construction are
    checked at every forward, batched=True is refused where it cannot be exact, train-mode
    dropout is refused; tol=0 is bitwise the serial network."""
    import torch.distributed as dist

    import paraprop

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        blocks = mlp_blocks(8, 3, kind="iid", seed=2, dtype=torch.float64)
        stack = LayerParallelStack(blocks, 0.1, depth=8, coarsening=2, timeout=20, tol=0)
        x = torch.randn(2, 3, dtype=torch.float64)
        with torch.no_grad():
            y = stack(x)
            u = x
            for b in blocks:
                u = u + 0.1 * b(u)
        assert torch.equal(y, u) and stack.last_forward.converged
        stack.relax = "C"
        with pytest.raises(ValueError, match="unknown relax='C'; choose one of F, FCF"):
            stack(x)
        stack.relax, stack.timeout = "FCF", 0
        with pytest.raises(ValueError, match="timeout must be a finite number > 0, got 0"):
            stack(x)
        stack.timeout = 20
        stack.batched = True
        with pytest.raises(ValueError, match=r"LayerParallelStack: batched=True with tol=0"):
            stack(x)
        stack.batched = None
        blocks[5].add_module("drop", nn.Dropout(0.2))
        stack._params.reset()                 # the candidate list is built once
        with pytest.raises(paraprop.StochasticModelError, match=r"blocks\[5\]\.drop is a "
                                                                r"Dropout in training mode"):
            stack(x)
    finally:
        dist.destroy_process_group()
