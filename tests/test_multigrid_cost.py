"""paraprop.multigrid.simulate: the event model replays the solver's work and critical path."""

import dataclasses

import pytest
import torch

from paraprop.models.blocks import mlp_blocks
from paraprop.multigrid import (
    CostModel,
    ForwardStepper,
    Hierarchy,
    UncheckedResultWarning,
    mgrit,
    simulate,
)

MODEL = CostModel(forward_s=1e-3, adjoint_s=2e-3, param_grad_s=2e-3, backprop_s=2e-3,
                  latency_s=1e-5, bandwidth_Bps=1e9, message_bytes=4096)


def test_one_level_is_model_partitioning():
    """Serial propagation across ranks is exactly the partitioned chain."""
    for workers in (1, 3, 8):
        r = simulate(64, workers, MODEL, levels=1, training=False)
        assert r["mgrit_s"] == pytest.approx(64 * 1e-3 + (workers - 1) * MODEL.message_s)
        assert r["mgrit_s"] == pytest.approx(r["partition_s"])


@pytest.mark.parametrize("concurrency", [1, 1000])
def test_one_worker_costs_the_solvers_work(concurrency):
    """With one worker the time is the solver's layer evaluations (or its sequential calls,
    when every batched call costs one layer)."""
    depth, hier = 96, Hierarchy.build(96, levels=3, coarsening=4)
    st = ForwardStepper(mlp_blocks(depth, 3))
    with pytest.warns(UncheckedResultWarning, match="max_iters=2 runs a fixed number"):
        mgrit(st, torch.randn(2, 3), hier, 0.01, max_iters=2, tol=None)
    model = dataclasses.replace(MODEL, concurrency=concurrency)
    r = simulate(depth, 1, model, levels=3, coarsening=4, cycles=2, training=False)
    work = st.counts.evaluations if concurrency == 1 else st.counts.calls
    assert r["mgrit_s"] == pytest.approx(work * 1e-3)
    assert r["messages"] == 0


def test_more_workers_help_when_compute_dominates():
    model = dataclasses.replace(MODEL, latency_s=0.0, message_bytes=0)
    speedups = [simulate(1024, w, model, levels=3)["speedup_vs_partition"]
                for w in (1, 4, 16, 64)]
    assert speedups[0] < speedups[1] < 1 < speedups[2] < speedups[3]
    # with one worker, model partitioning is serial training
    r = simulate(1024, 1, model, levels=3)
    assert r["partition_s"] == pytest.approx(r["serial_s"])


def test_latency_costs_time():
    slow = dataclasses.replace(MODEL, latency_s=1e-3)
    a = simulate(256, 8, MODEL, levels=3)
    b = simulate(256, 8, slow, levels=3)
    assert b["mgrit_s"] > a["mgrit_s"] and b["partition_s"] > a["partition_s"]


def test_errors():
    with pytest.raises(ValueError, match="unknown relax='C'; choose one of F, FCF"):
        simulate(64, 2, MODEL, relax="C")
    with pytest.raises(ValueError, match="cycles must be a positive int, got 0"):
        simulate(64, 2, MODEL, cycles=0)
    with pytest.raises(ValueError, match="3 layers cannot be split over 4 ranks"):
        simulate(3, 4, MODEL, levels=1)
    with pytest.raises(ValueError, match="needs at least 16 layers"):
        simulate(8, 2, MODEL, levels=3)


def test_cost_model_validation_and_fractional_concurrency():
    with pytest.raises(ValueError, match="forward_s must be a number >= 0, got -1"):
        dataclasses.replace(MODEL, forward_s=-1)
    with pytest.raises(ValueError, match="concurrency must be > 0, got 0"):
        dataclasses.replace(MODEL, concurrency=0)
    with pytest.raises(ValueError, match="bandwidth_Bps must be > 0"):
        dataclasses.replace(MODEL, bandwidth_Bps=0)
    with pytest.raises(ValueError, match="fused_s must be a number >= 0 or None, got -1"):
        dataclasses.replace(MODEL, fused_s=-1)
    # batching slower than one layer at a time (concurrency < 1) costs more than the loop
    slow = simulate(256, 1, dataclasses.replace(MODEL, concurrency=0.5), training=False)
    loop = simulate(256, 1, MODEL, training=False)
    assert slow["mgrit_s"] > loop["mgrit_s"]


def test_fused_gradient_sweep_replaces_the_parameter_pass():
    """With fused_s, the adjoint's last relaxation costs fused_s per step and no separate
    parameter sweep follows (one worker: the difference is exactly the work that moved)."""
    fused = dataclasses.replace(MODEL, fused_s=3e-3)
    depth = 64
    a = simulate(depth, 1, MODEL, levels=2, coarsening=4, cycles=2)
    b = simulate(depth, 1, fused, levels=2, coarsening=4, cycles=2)
    # the final relaxation steps every layer once: 64 steps at 3 ms instead of 2 ms, and the
    # 64 parameter VJPs at 2 ms are gone
    assert b["mgrit_s"] == pytest.approx(a["mgrit_s"] + depth * (3e-3 - 2e-3) - depth * 2e-3)
