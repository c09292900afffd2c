"""paraprop.multigrid: converged MGRIT equals serial propagation (Kirby et al. 2020, Alg. 1)."""

import contextlib

import pytest
import torch
from torch import nn

import paraprop
from paraprop.errors import PeerError
from paraprop.models.blocks import ConvBlock, conv_blocks, mlp_blocks
from paraprop.multigrid import (
    AdjointStepper,
    ForwardStepper,
    Hierarchy,
    UncheckedResultWarning,
    mgrit,
    residual_norm,
    split_layers,
)
from paraprop.multigrid.threads import run_threads

# (allowed max |mgrit - serial| relative to max |serial|, solve tolerance) per dtype.
TOL = {torch.float64: (1e-12, 1e-13), torch.float32: (1e-5, 1e-6)}


def serial_states(blocks, x, h):
    """The reference, written out: u_{n+1} = u_n + h F_n(u_n), every state kept."""
    out = [x]
    with torch.no_grad():
        for b in blocks:
            out.append(out[-1] + h * b(out[-1]))
    return torch.stack(out)


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


CONFIGS = [  # depth, levels, coarsening, relax: odd depths, depths not divisible by c
    (16, 2, 4, "FCF"), (17, 2, 4, "FCF"), (19, 2, 3, "F"), (9, 2, 2, "FCF"), (33, 2, 5, "F"),
    (23, 3, 2, "FCF"), (31, 3, 3, "F"), (67, 3, 4, "FCF"), (50, 3, (3, 2), "F"),
    (41, 4, 2, "FCF"),
]


@pytest.mark.parametrize("mode", ["vmap", "loop", "hook"])
@pytest.mark.parametrize("depth,levels,c,relax", CONFIGS)
def test_converged_mgrit_equals_serial(depth, levels, c, relax, mode, device):
    """vmap over stacked parameters, a loop over blocks, or the blocks' batched_forward."""
    dtype = torch.float64
    blocks = [b.to(device) for b in mlp_blocks(depth, 6, kind="iid", gain=1.5, seed=depth,
                                                dtype=dtype, fast=mode == "hook")]
    x = torch.randn(3, 6, dtype=dtype, generator=torch.Generator().manual_seed(1)).to(device)
    h = 2.0 / depth
    hier = Hierarchy.build(depth, levels=levels, coarsening=c)
    res = mgrit(ForwardStepper(blocks, batched=mode != "loop"), x, hier, h, relax=relax,
                max_iters=hier.exact_cycles(), tol=TOL[dtype][1])
    ref = serial_states(blocks, x, h)
    assert res.converged and res.residuals[-1] <= TOL[dtype][1]
    assert rel_err(res.value, ref) <= TOL[dtype][0]
    # the recorded residual is the residual of the returned states
    assert residual_norm(ForwardStepper(blocks), res.value, h, x) <= 10 * TOL[dtype][1]


@pytest.mark.parametrize("depth,levels,c,relax", [(21, 2, 4, "FCF"), (30, 3, 3, "F")])
def test_exact_after_the_cycle_bound_without_tol(depth, levels, c, relax):
    """In exact arithmetic every cycle makes one more C-point exact: N // c cycles suffice."""
    blocks = mlp_blocks(depth, 4, kind="iid", gain=2.0, seed=3, dtype=torch.float64)
    x = torch.randn(2, 4, dtype=torch.float64)
    hier = Hierarchy.build(depth, levels=levels, coarsening=c)
    res = mgrit(ForwardStepper(blocks), x, hier, 1.0 / depth, relax=relax,
                max_iters=hier.exact_cycles(), tol=None)
    assert res.iterations == hier.exact_cycles() == depth // c
    assert rel_err(res.value, serial_states(blocks, x, 1.0 / depth)) <= 1e-12


def test_float32_converges_to_serial(device):
    blocks = [b.to(device) for b in mlp_blocks(40, 8, seed=2)]
    x = torch.randn(4, 8).to(device)
    hier = Hierarchy.build(40, levels=3, coarsening=3)
    res = mgrit(ForwardStepper(blocks), x, hier, 0.05, max_iters=20, tol=TOL[torch.float32][1])
    assert res.converged
    assert rel_err(res.value, serial_states(blocks, x, 0.05)) <= TOL[torch.float32][0]


def test_zero_residual_from_the_serial_solution():
    depth, c = 26, 4
    blocks = mlp_blocks(depth, 5, kind="iid", seed=4, dtype=torch.float64)
    x = torch.randn(3, 5, dtype=torch.float64)
    ref = serial_states(blocks, x, 0.1)
    hier = Hierarchy.build(depth, levels=3, coarsening=(c, 2))
    with pytest.warns(UncheckedResultWarning, match="max_iters=2 runs a fixed number"):
        res = mgrit(ForwardStepper(blocks), x, hier, 0.1, init=ref[c::c], max_iters=2, tol=None)
    assert all(r <= 1e-14 for r in res.residuals.tolist())
    assert rel_err(res.value, ref) <= 1e-14


def test_one_level_is_serial_propagation():
    blocks = mlp_blocks(13, 4, seed=5, dtype=torch.float64)
    x = torch.randn(2, 4, dtype=torch.float64)
    res = mgrit(ForwardStepper(blocks), x, Hierarchy.build(13, levels=1, coarsening=4), 0.3)
    assert res.residuals.tolist() == [] and res.iterations == 0 and res.converged
    assert rel_err(res.value, serial_states(blocks, x, 0.3)) <= 1e-15
    assert res.evaluations == 13


def test_tol_stops_early_and_history_decreases():
    blocks = mlp_blocks(64, 8, seed=6, dtype=torch.float64)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    hier = Hierarchy.build(64, levels=2, coarsening=4)
    res = mgrit(ForwardStepper(blocks), x, hier, 1 / 64, max_iters=50, tol=1e-8)
    assert res.converged and res.iterations < 16
    r = res.residuals.tolist()
    # it stops on the error estimate (not on the residual), at the first cycle where it holds
    assert res.stats["error_estimate"] <= 1e-8
    assert float((res.value - serial_states(blocks, x, 1 / 64)).abs().max()) <= 1e-8
    shorter = mgrit(ForwardStepper(blocks), x, hier, 1 / 64, max_iters=res.iterations - 1,
                    tol=1e-8, throw=False)
    # one cycle fewer: the rule (estimate <= tol and last change <= tol) did not hold yet
    assert not shorter.converged
    assert shorter.stats["error_estimate"] > 1e-8 or shorter.stats["changes"][-1] > 1e-8
    assert all(b < a for a, b in zip(r, r[1:], strict=False))
    assert 0 < res.stats["convergence_factor"] < 1
    capped = mgrit(ForwardStepper(blocks), x, hier, 1 / 64, max_iters=1, tol=1e-8, throw=False)
    assert capped.iterations == 1 and capped.converged is False
    assert capped.result is paraprop.Result.max_iters_reached
    with pytest.warns(UncheckedResultWarning, match="not checked"):
        unchecked = mgrit(ForwardStepper(blocks), x, hier, 1 / 64, max_iters=1, tol=None)
    assert unchecked.iterations == 1 and unchecked.converged is False  # tol=None: not checked
    assert unchecked.stats["checked"] is False
    assert unchecked.result is paraprop.Result.unchecked and not res.stats.get("not_converged")
    assert res.result is paraprop.Result.successful


def test_convergence_does_not_depend_on_depth():
    """Cycles to reach 1e-9 stay within +-1 from 64 to 1024 layers (Kirby et al. Fig. 4)."""
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cycles = []
    for depth in (64, 256, 1024):
        blocks = mlp_blocks(depth, 8, kind="smooth", seed=0, dtype=torch.float64)
        hier = Hierarchy.build(depth, levels=3, coarsening=4)
        res = mgrit(ForwardStepper(blocks), x, hier, 1.0 / depth, max_iters=15, tol=1e-9)
        assert res.converged
        cycles.append(res.iterations)
    assert max(cycles) - min(cycles) <= 2, cycles


def test_mixed_architectures_and_conv_states():
    """A loop for blocks of different classes; vmap over conv blocks with image states."""
    mixed = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) if i % 2 else nn.Linear(4, 4)
             for i in range(14)]
    mixed = [m.double() for m in mixed]
    x = torch.randn(2, 4, dtype=torch.float64)
    st = ForwardStepper(mixed, batched=False)
    res = mgrit(st, x, Hierarchy.build(14, levels=2, coarsening=3), 0.1, max_iters=10,
                tol=1e-13)
    assert rel_err(res.value, serial_states(mixed, x, 0.1)) <= 1e-12
    convs = conv_blocks(12, 3, act="tanh", dtype=torch.float64)
    img = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    res = mgrit(ForwardStepper(convs), img, Hierarchy.build(12, levels=2, coarsening=4), 0.1,
                max_iters=10, tol=1e-13)
    assert rel_err(res.value, serial_states(convs, img, 0.1)) <= 1e-12


@pytest.mark.parametrize("sizes,levels,c,relax", [
    ([8, 8], 2, 4, "FCF"),
    ([5, 12], 2, 4, "F"),
    ([2, 1, 14], 2, 4, "FCF"),  # ranks that own no coarse point
    ([3, 11, 1, 25], 3, 2, "FCF"),
    ([1, 2, 3, 34], 3, 3, "F"),
])
def test_ranks_in_threads_equal_one_process(sizes, levels, c, relax):
    """The multi-rank code path (ghosts, uneven splits) gives the single-process iterates."""
    depth = sum(sizes)
    blocks = mlp_blocks(depth, 5, kind="iid", seed=7, dtype=torch.float64)
    x = torch.randn(3, 5, dtype=torch.float64)
    hier = Hierarchy.build(depth, levels=levels, coarsening=c)
    with pytest.warns(UncheckedResultWarning, match="max_iters=3 runs a fixed number"):
        one = mgrit(ForwardStepper(blocks), x, hier, 1.5 / depth, relax=relax, max_iters=3,
                    tol=None)
    parts = split_layers(depth, len(sizes), sizes)

    def rank(r, link):
        a, b = parts[r]
        return mgrit(ForwardStepper(blocks[a:b], a), x, hier, 1.5 / depth, relax=relax,
                     max_iters=3, tol=None, link=link, parts=parts, me=r)

    with pytest.warns(UncheckedResultWarning, match="max_iters=3 runs a fixed number"):
        outs = run_threads(len(sizes), rank, timeout=30)   # every rank warns
    states = torch.cat([outs[0].value] + [o.value[1:] for o in outs[1:]])
    assert rel_err(states, one.value) <= 1e-13
    for o in outs:
        assert o.residuals.tolist() == pytest.approx(one.residuals.tolist(), rel=1e-10,
                                                     abs=1e-15)


def test_hierarchy_and_split():
    h = Hierarchy.build(100, levels=3, coarsening=4)
    assert h.sizes == (100, 25, 6) and h.strides == (1, 4, 16) and h.exact_cycles() == 25
    assert Hierarchy.build(7, levels=1, coarsening=4).sizes == (7,)
    assert split_layers(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_layers(10, 2, [3, 7]) == [(0, 3), (3, 10)]


@pytest.mark.parametrize("kwargs,match", [
    ({"n_steps": 10, "levels": 2, "coarsening": 1}, "coarsening must be an int >= 2, got 1"),
    ({"n_steps": 10, "levels": 3, "coarsening": 4}, "needs at least 16 layers, got 10"),
    ({"n_steps": 10, "levels": 0, "coarsening": 4}, "levels must be a positive int, got 0"),
    ({"n_steps": 0, "levels": 2, "coarsening": 4}, "number of layers must be a positive int"),
    ({"n_steps": 40, "levels": 3, "coarsening": (4,)}, "must have levels - 1 = 2 entries"),
])
def test_hierarchy_errors(kwargs, match):
    kw = dict(kwargs)
    n = kw.pop("n_steps")
    with pytest.raises(ValueError, match=match):
        Hierarchy.build(n, **kw)


def test_hierarchy_type_and_split_errors():
    with pytest.raises(ValueError, match="coarsening must be an int >= 2, got 2.5"):
        Hierarchy.build(10, levels=2, coarsening=2.5)
    with pytest.raises(ValueError, match="3 layers cannot be split over 4 ranks"):
        split_layers(3, 4)
    with pytest.raises(ValueError, match="must be 2 positive ints summing to 10"):
        split_layers(10, 2, [5, 4])


def test_shape_changing_block_is_named():
    blocks = [ConvBlock(2) for _ in range(7)] + [nn.Conv2d(2, 3, 3, padding=1)]
    with pytest.raises(ValueError, match=r"block 7 maps a state of shape \(1, 2, 4, 4\) to "
                                         r"\(1, 3, 4, 4\); residual blocks must keep the shape"):
        mgrit(ForwardStepper(blocks, batched=False), torch.randn(1, 2, 4, 4),
              Hierarchy.build(8, levels=2, coarsening=2), 0.1)
    wide = [nn.Linear(4, 5) for _ in range(8)]
    with pytest.raises(ValueError, match="must keep the shape"):
        mgrit(ForwardStepper(wide), torch.randn(2, 4), Hierarchy.build(8, levels=2,
                                                                        coarsening=2), 0.1)


def test_bad_init_shape():
    blocks = mlp_blocks(8, 3)
    with pytest.raises(ValueError, match=r"init must have shape \(2, 2, 3\)"):
        mgrit(ForwardStepper(blocks), torch.randn(2, 3), Hierarchy.build(8, levels=2,
                                                                          coarsening=4),
              0.1, init=torch.zeros(3, 2, 3))


@pytest.mark.parametrize("kwargs,err,match", [
    ({"step_size": -0.1}, ValueError, "step_size must be a finite number > 0, got -0.1"),
    ({"relax": "FF"}, ValueError, "unknown relax='FF'; choose one of F, FCF"),
    ({"max_iters": -1}, ValueError, "max_iters must be an int >= 0 or None, got -1"),
    ({"tol": float("nan")}, ValueError, "tol must be a number >= 0 or None, got nan"),
    ({"c_weight": 0}, ValueError, r"c_weight must be a number in \(0, 2\], got 0"),
    ({"parts": [(0, 3), (4, 8)]}, ValueError, "must be contiguous non-empty ranges"),
    ({"parts": [(0, 8)], "me": 1}, ValueError, "me=1 must index parts"),
    ({"x": torch.ones(2, 3, dtype=torch.long)}, TypeError, "floating-point torch.Tensor"),
    ({"hierarchy": 2}, TypeError, "hierarchy must be a Hierarchy"),
])
def test_mgrit_argument_errors(kwargs, err, match):
    args = {"x": torch.randn(2, 3), "hierarchy": Hierarchy.build(8, levels=2, coarsening=2),
            "step_size": 0.1, **kwargs}
    with pytest.raises(err, match=match):
        mgrit(ForwardStepper(mlp_blocks(8, 3)), args.pop("x"), args.pop("hierarchy"),
              args.pop("step_size"), **args)


@pytest.mark.parametrize("mode", ["vmap", "loop", "hook"])
@pytest.mark.parametrize("levels,c,relax,cycles", [
    (1, 2, "F", 1), (2, 4, "FCF", 2), (3, 2, "F", 3), (2, 3, "FCF", 0)])
def test_gradients_accumulated_in_the_final_relaxation(mode, levels, c, relax, cycles):
    """The final adjoint relaxation's parameter cotangents equal a separate pass over the
    returned adjoint states (after any number of cycles, converged or not)."""
    depth, h = 23, 0.08
    blocks = mlp_blocks(depth, 4, kind="iid", seed=9, dtype=torch.float64,
                        fast=mode == "hook")
    x = torch.randn(3, 4, dtype=torch.float64)
    states = serial_states(blocks, x, h)
    g = torch.randn(3, 4, dtype=torch.float64)
    hier = Hierarchy.build(depth, levels=levels, coarsening=c)

    def stepper():
        return AdjointStepper(blocks, 0, depth, states, batched=mode != "loop")

    # fewer cycles than the exactness bound (one level: one cycle is the serial pass)
    with (pytest.warns(UncheckedResultWarning, match=f"max_iters={cycles} runs a fixed number")
          if levels > 1 else contextlib.nullcontext()):
        res = mgrit(stepper(), g, hier, h, relax=relax, max_iters=cycles, tol=None, collect=True)
    grads = res.stats["parameter_grads"]
    assert grads is not None and len(grads) == depth
    ref = stepper().parameter_grads(res.value[:-1].flip(0), h)
    for got, want in zip(grads, ref, strict=True):
        for k in want:
            assert float((got[k] - want[k]).abs().max()) <= 1e-13
    with_tol = mgrit(stepper(), g, hier, h, max_iters=2, tol=1e-3, throw=False, collect=True)
    assert (with_tol.stats["parameter_grads"] is None) == (levels > 1)  # not known to be final


def test_threads_check_message_tags():
    def rank(r, link):
        if r == 0:
            link.send(torch.zeros(2), 1, tag=1)
        else:
            link.recv(torch.zeros(2), 0, tag=2)

    with pytest.raises(RuntimeError, match="rank 1: expected tag 2 from rank 0, got 1"):
        run_threads(2, rank, timeout=30)


@pytest.mark.parametrize("wait", ["recv", "sum"])
def test_a_failing_thread_releases_the_others(wait):
    """The failing rank's error comes back at once; the waiting ranks stop on the poison
    message (or the broken barrier) instead of running into the timeout."""
    stopped = []

    def rank(r, link):
        if r == 1:
            raise ValueError("rank 1 broke")
        try:
            if wait == "recv":
                link.recv(torch.zeros(2), 1, tag=0)
            else:
                link.sum(1.0)
        except PeerError as e:
            stopped.append(str(e))
            raise

    with pytest.raises(ValueError, match="rank 1 broke"):
        run_threads(3, rank, timeout=30)
    assert len(stopped) == 2
    if wait == "recv":
        assert all(m.endswith("rank 1 failed (waiting for rank 1, tag 0)") for m in stopped)
    else:
        assert all("the all-reduce was abandoned" in m for m in stopped)


def test_coarsest_level_has_no_c_points():
    """The coarsest level is solved serially: asking it for C-points is an error that says so."""
    from paraprop.multigrid.hierarchy import local_levels

    levels = local_levels(Hierarchy.build(16, levels=2, coarsening=4), [(0, 16)], 0)
    assert levels[0].factor == 4 and list(levels[0].owned_c_points()) == [4, 8, 12, 16]
    with pytest.raises(ValueError, match=r"level 1 is the coarsest: it has no coarsening "
                                         r"factor and no C-points"):
        levels[1].owned_c_points()


@pytest.mark.parametrize("batched", [True, False])
def test_end_collect_without_begin_collect_is_refused(batched):
    blocks = mlp_blocks(3, 4, seed=0)
    states = torch.randn(4, 2, 4)
    adjoint = AdjointStepper(blocks, 0, 3, states, batched=batched)
    with pytest.raises(RuntimeError, match=r"end_collect: nothing is being collected; call "
                                           r"begin_collect\(\) before the final relaxation"):
        adjoint.end_collect()
    adjoint.begin_collect()
    adjoint.step(0, 1, 3, torch.randn(3, 2, 4), 0.5)
    assert len(adjoint.end_collect()) == 3
