"""paraprop.networks timing: the parallel-time estimate (the paper's simulation) and its inputs."""

import pytest
import torch
from torch import nn

from paraprop.networks import (
    as_recurrence,
    estimate_time,
    jacobi_gs_blocks,
    partition_time,
    profile,
)
from paraprop.networks.timing import uniform_blocks
from paraprop.solvers import JacobiGS

TIMES = [1.0, 4.0, 2.0, 3.0, 5.0]


@pytest.mark.parametrize(
    ("method", "iterations", "block_size", "expected"),
    [
        ("sequential", 7, None, 15.0),  # the sum, whatever the iterations
        ("jacobi", 3, None, 15.0),  # 3 x the slowest state (5)
        ("jacobi_gs", 3, 1, 15.0),  # one state per block: Jacobi
        # blocks [1, 4], [2, 3], [5]: offset 0 max(1, 2, 5) = 5, offset 1 max(4, 3) = 4
        ("jacobi_gs", 2, 2, 2 * (5.0 + 4.0)),
        ("jacobi_gs", 1, 5, 15.0),  # one block: the sequential sweep
        ("gs_jacobi", 4, 2, 20.0),  # upper bound: iterations x slowest state
    ],
)
def test_estimate_time_schedules(method, iterations, block_size, expected):
    assert estimate_time(TIMES, method=method, iterations=iterations,
                         block_size=block_size) == pytest.approx(expected)


def test_jacobi_gs_estimate_never_beats_the_slowest_block():
    g = torch.Generator().manual_seed(0)
    times = torch.rand(23, generator=g, dtype=torch.float64).tolist()
    for b in range(1, 24):
        blocks = uniform_blocks(23, b)
        lockstep = estimate_time(times, method="jacobi_gs", iterations=1, block_size=b)
        assert lockstep >= partition_time(times, blocks, 1) - 1e-12
        assert lockstep <= sum(times) + 1e-12


def test_partition_time_any_partition():
    assert partition_time(TIMES, [[0, 1], [2, 3], [4]], 2) == pytest.approx(2 * 5.0)
    assert partition_time(TIMES, [[0, 1, 2, 3, 4]], 1) == pytest.approx(15.0)
    with pytest.raises(ValueError, match="blocks must partition the states 0..4"):
        partition_time(TIMES, [[0, 1], [1, 2, 3, 4]], 1)


def test_estimate_time_errors():
    with pytest.raises(ValueError, match="unknown method='newton'"):
        estimate_time(TIMES, method="newton", iterations=1)
    with pytest.raises(ValueError, match="block_size is required for method='jacobi_gs'"):
        estimate_time(TIMES, method="jacobi_gs", iterations=1)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        estimate_time(TIMES, method="jacobi_gs", iterations=1, block_size=0)
    with pytest.raises(ValueError, match="iterations must be an int >= 0, got -1"):
        estimate_time(TIMES, method="jacobi", iterations=-1)
    with pytest.raises(ValueError, match="times must be a non-empty sequence"):
        estimate_time([1.0, float("nan")], method="jacobi", iterations=1)


def test_profile_measures_every_state():
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 3)).eval()
    system = as_recurrence(model).bind(torch.randn(4, 8))
    times = profile(system, repeats=3, warmup=0)
    assert times.shape == (3,) and times.dtype == torch.float64
    assert bool((times > 0).all())
    with pytest.raises(ValueError, match="repeats must be a positive int, got 0"):
        profile(system, repeats=0)
    with pytest.raises(ValueError, match="warmup must be an int >= 0, got -1"):
        profile(system, warmup=-1)


def test_threaded_executor_validation_and_early_stop():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(12)]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.3)  # a contraction: the forward difference falls fast
    system = as_recurrence(model).bind(torch.randn(3, 6))
    blocks = [[t] for t in range(12)]
    with pytest.raises(ValueError, match="JacobiGS: workers must be a positive int, got 0"):
        JacobiGS(blocks=blocks, workers=0)
    with pytest.raises(ValueError, match="JacobiGS: intra_op_threads must be a positive int"):
        JacobiGS(blocks=blocks, workers=2, intra_op_threads=0)
    with pytest.raises(ValueError, match=r"costs must have one entry per position \(12\), got 2"):
        JacobiGS(blocks=blocks, workers=2, costs=[1.0, 2.0])
    with pytest.raises(ValueError, match="workers > 1 needs blocks"):
        JacobiGS(block_size=2, workers=2)
    with pytest.raises(ValueError, match="tol must be a number >= 0"):
        jacobi_gs_blocks(system, blocks, workers=2, tol=-1)
    sol = jacobi_gs_blocks(system, blocks, workers=2, tol=1e-3)
    assert sol.converged and sol.iterations < 12
    # the driver's certificate, not the last step: the error is within tol
    err = float((system.output(sol.value) - system.reference[-1]).abs().max())
    assert err <= 1e-3
    sol = jacobi_gs_blocks(system, blocks, workers=2, tol=0.0, max_iters=2, throw=False)
    assert sol.iterations == 2 and not sol.converged
