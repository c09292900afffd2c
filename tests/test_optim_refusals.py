"""Optimizer fusion: refusals (every error message), state_dict round trips, stale reads, DDP."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from paraprop.optim import FusedOptimizer, FusionError, fuse
from paraprop.optim.backward import ConsumedGrad

sys.path.insert(0, os.path.dirname(__file__))
from test_optim import (  # noqa: E402
    TinyLM,
    assert_same,
    batches,
    loss_fn,
    make_optimizer,
    one_thread,  # noqa: F401  (autouse fixture)
    train,
)


def _step(model, opt, idx):
    loss_fn(model, idx).backward()
    opt.step()
    opt.zero_grad()


# -- arguments --------------------------------------------------------------------------------
def test_lbfgs_is_refused():
    model = TinyLM()
    with pytest.raises(ValueError, match="LBFGS cannot be fused"):
        fuse(torch.optim.LBFGS(model.parameters()), model)


@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_closure_is_refused(mode):
    model = TinyLM()
    opt = fuse(torch.optim.SGD(model.parameters(), lr=0.1), model, mode=mode)
    with pytest.raises(ValueError, match="closures are not supported"):
        opt.step(lambda: loss_fn(model, batches(1)[0]))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(mode="sideways"), ValueError, "unknown mode='sideways'; choose one of forward, backward"),
    (dict(accumulation_steps=0), ValueError, "accumulation_steps must be a positive int, got 0"),
    (dict(accumulation_steps=2.0), ValueError,
     "accumulation_steps must be a positive int, got 2.0"),
    (dict(accumulation_steps=True), ValueError,
     "accumulation_steps must be a positive int, got True"),
    (dict(bucket_numel=-1), ValueError, "bucket_numel must be an int >= 0, got -1"),
    (dict(bucket_numel="8"), ValueError, "bucket_numel must be an int >= 0, got '8'"),
    (dict(overlap=1), TypeError, "overlap must be a bool, got 1"),
])
def test_bad_arguments(kwargs, error, match):
    model = TinyLM()
    with pytest.raises(error, match=match):
        fuse(torch.optim.SGD(model.parameters(), lr=0.1), model, **kwargs)


def test_bad_types_and_double_fusion():
    model = TinyLM()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got list"):
        fuse([sgd], model)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        fuse(sgd, lambda x: x)
    fused = fuse(sgd, model)
    with pytest.raises(TypeError, match="already a FusedOptimizer"):
        fuse(fused, model)
    with pytest.raises(ValueError, match="already fused; call unfuse"):
        fuse(sgd, model)
    assert fused.unfuse() is sgd
    fuse(sgd, model, mode="backward")  # allowed again after unfuse()


def test_optimizer_with_step_hooks_is_refused_hooks_on_fused_run_once_per_step():
    model = TinyLM()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = sgd.register_step_post_hook(lambda *a: None)
    with pytest.raises(ValueError, match="step pre/post hooks"):
        fuse(sgd, model)
    handle.remove()
    opt = fuse(sgd, model)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o)))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o)))
    for idx in batches(3):
        _step(model, opt, idx)
    assert calls == [("pre", opt), ("post", opt)] * 3


def test_fused_optimizer_cannot_be_pickled():
    model = TinyLM()
    opt = fuse(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(TypeError, match="cannot be pickled; save state_dict"):
        opt.__getstate__()


# -- what backward mode cannot do exactly -------------------------------------------------------
def _backward_model():
    model = TinyLM()
    opt = fuse(torch.optim.Adam(model.parameters(), lr=1e-2), model, mode="backward")
    return model, opt


def test_backward_mode_refuses_global_norm_clipping():
    model, opt = _backward_model()
    loss_fn(model, batches(1)[0]).backward()
    with pytest.raises(FusionError, match="has already consumed.*clipping"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(FusionError, match="read the gradient of parameter 'emb.weight'"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
    with pytest.raises(FusionError, match="already consumed"):
        model.head.weight.grad.norm()


def test_backward_mode_refuses_grad_scaler():
    model, opt = _backward_model()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(model, batches(1)[0])).backward()
    with pytest.raises(FusionError, match="already consumed.*GradScaler"):
        scaler.step(opt)
    # with accumulation the scaler is caught at its first step(), before any update ran
    model = TinyLM()
    opt = fuse(torch.optim.Adam(model.parameters()), model, mode="backward", accumulation_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(model, batches(1)[0])).backward()
    with pytest.raises(FusionError, match=r"GradScaler cannot be exact in mode='backward'"):
        scaler.step(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_forward_mode_refuses_grad_scaler_with_accumulation_steps():
    model = TinyLM()
    opt = fuse(torch.optim.Adam(model.parameters()), model, accumulation_steps=2)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(model, batches(1)[0])).backward()
    with pytest.raises(FusionError, match="accumulation_steps > 1 would unscale"):
        scaler.step(opt)


def test_backward_mode_refuses_second_backward_before_step():
    model, opt = _backward_model()
    idx = batches(1)[0]
    loss_fn(model, idx).backward()
    opt.zero_grad()  # gradients dropped, but the update of the first backward already ran
    with pytest.raises(FusionError, match="a second backward\\(\\) ran before step\\(\\)"):
        loss_fn(model, idx).backward()


def test_backward_mode_refuses_accumulating_into_consumed_gradients():
    model, opt = _backward_model()
    idx = batches(1)[0]
    loss_fn(model, idx).backward()
    opt.step()  # no zero_grad(): the next backward would add to consumed gradients
    with pytest.raises(FusionError, match="already consumed"):
        loss_fn(model, idx).backward()


def test_backward_mode_releases_gradients():
    model, opt = _backward_model()
    loss_fn(model, batches(1)[0]).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(isinstance(g, ConsumedGrad) and g.shape == p.shape
               for g, p in zip(grads, model.parameters(), strict=True))
    assert "ConsumedGrad(param='emb.weight'" in repr(model.emb.weight.grad)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.zero_grad(set_to_none=False)  # nothing to zero: stays None, as torch.optim does


def test_backward_mode_updates_inside_backward():
    model, opt = _backward_model()
    before = model.head.weight.detach().clone()
    loss_fn(model, batches(1)[0]).backward()
    assert not torch.equal(model.head.weight, before)  # before step() was even called


# -- forward mode: stale reads are errors, not silent ----------------------------------------
class LateFunctional(nn.Module):
    """Reads ``proj``'s parameters functionally only from the third forward on (after the trace).

    ``held=True``: through references kept since construction, which nothing can intercept;
    ``held=False``: as ``self.proj.weight``, which applies the pending update on the spot.
    """

    def __init__(self, held: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 2)
        self.held = (self.proj.weight, self.proj.bias) if held else None  # a plain attribute
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.a(x)
        if self.calls >= 3:
            w, b = self.held or (self.proj.weight, self.proj.bias)
            return torch.nn.functional.linear(h, w, b)
        return self.proj(h)


def test_forward_mode_stale_read_raises():
    model = LateFunctional()
    opt = fuse(torch.optim.SGD(model.parameters(), lr=0.1), model, bucket_numel=0)
    x = torch.randn(3, 4)
    with pytest.raises(FusionError, match="parameter 'proj.weight' received a new gradient"):
        for _ in range(4):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()


def test_forward_mode_read_through_the_module_is_never_stale():
    x = torch.randn(3, 4)
    models = []
    for fused in (False, True):
        model = LateFunctional(held=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if fused:
            opt = fuse(opt, model, bucket_numel=0)
        for _ in range(4):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        models.append((model, opt.state_dict()))
    assert_same(*models)
    assert [b.name for b in opt.buckets] == ["<root>", "a", "proj"]  # nothing had to move


def test_forward_mode_first_forward_finds_parameters_read_outside_their_module():
    model = LateFunctional()
    model.calls = 2  # functional from the first forward on
    opt = fuse(torch.optim.SGD(model.parameters(), lr=0.1), model, bucket_numel=0)
    x = torch.randn(3, 4)
    for _ in range(3):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt.buckets[0].names == ["proj.weight", "proj.bias"]
    assert [b.name for b in opt.buckets] == ["<root>", "a"]


def test_forward_mode_model_state_dict_and_flush_apply_pending_updates():
    model = TinyLM()
    opt = fuse(torch.optim.SGD(model.parameters(), lr=0.1), model)
    ref_model = TinyLM()
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    idx = batches(1)[0]
    _step(model, opt, idx)
    _step(ref_model, ref, idx)
    bias = opt.param_groups[0]["params"][-1]  # a reference, not a read through the module
    assert not torch.equal(bias, ref_model.head.bias)  # still pending
    sd = model.state_dict()  # flushes first
    assert torch.equal(sd["head.bias"], ref_model.head.bias)
    _step(model, opt, idx)
    _step(ref_model, ref, idx)
    opt.flush()
    assert torch.equal(model.head.bias, ref_model.head.bias)


# -- state_dict round trips between fused and plain optimizers ---------------------------------
@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize("name", ["adam", "sgd", "adagrad"])
def test_state_dict_round_trips(name, mode):
    data = batches(10)

    def run(first_fused: bool, second_fused: bool):
        model = TinyLM()
        opt = make_optimizer(name, model)
        if first_fused:
            opt = fuse(opt, model, mode=mode)
        for idx in data[:5]:
            _step(model, opt, idx)
        msd, osd = model.state_dict(), opt.state_dict()
        model = TinyLM(seed=7)  # different weights, overwritten by the checkpoint
        opt = make_optimizer(name, model)
        if second_fused:
            opt = fuse(opt, model, mode=mode)
        model.load_state_dict(msd)
        opt.load_state_dict(osd)
        for idx in data[5:]:
            _step(model, opt, idx)
        return model, opt.state_dict()

    ref = run(False, False)
    for first, second in ((True, False), (False, True), (True, True)):
        assert_same(ref, run(first, second))


def test_state_dict_equals_plain_optimizer_state_dict():
    ref = train("adam", feature="plain", steps=5)
    got = train("adam", mode="forward", feature="plain", steps=5)
    assert ref[1]["param_groups"] == got[1]["param_groups"]
    assert_same(ref, got)


def test_add_param_group_rebuilds_buckets():
    model = TinyLM()
    extra = nn.Linear(3, 3)
    opt = fuse(torch.optim.SGD(model.parameters(), lr=0.1), model)
    _step(model, opt, batches(1)[0])
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.5})
    assert len(opt.param_groups) == 2
    assert opt.buckets[0].names == ["param_groups[1][0]", "param_groups[1][1]"]  # not in model


# -- DistributedDataParallel with 2 gloo processes ---------------------------------------------
def _ddp_worker(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}",
                                         rank=rank, world_size=world)
    try:
        data = batches(8, seed=10 + rank)  # each rank its own shard

        def run(fused: bool):
            model = nn.parallel.DistributedDataParallel(TinyLM())
            opt = make_optimizer("adam", model.module)
            if fused:
                opt = fuse(opt, model, mode="forward")
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            for idx in data:
                loss_fn(model, idx).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
                sched.step()
            return model.module, opt.state_dict()

        assert_same(run(False), run(True))
        model = nn.parallel.DistributedDataParallel(TinyLM())
        with pytest.raises(ValueError, match="mode='backward' with DistributedDataParallel"):
            fuse(torch.optim.SGD(model.parameters(), lr=0.1), model, mode="backward")
        with pytest.raises(ValueError, match=r"under torch.distributed \(world size 2\)"):
            fuse(torch.optim.SGD(model.parameters(), lr=0.1), model.module, mode="backward")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_ddp_forward_mode_exact_backward_mode_refused(tmp_path):
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)


def test_fused_optimizer_is_an_optimizer_for_schedulers():
    model = TinyLM()
    opt = fuse(torch.optim.SGD(model.parameters(), lr=1.0), model)
    assert isinstance(opt, FusedOptimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        sched.step()  # the same warning as for a plain optimizer
    _step(model, opt, batches(1)[0])
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.25


class SignSGD(torch.optim.Optimizer):
    """A user-written per-parameter optimizer (with state): any such optimizer can be fused."""

    def __init__(self, params, lr=0.01, fail_at=None):
        super().__init__(params, {"lr": lr})
        self.fail_at = fail_at

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["n"] = st.get("n", 0) + 1
                if st["n"] == self.fail_at:
                    raise RuntimeError("custom step failed")
                p.add_(p.grad.sign(), alpha=-group["lr"] / st["n"])


@pytest.mark.parametrize("fuse_kw", [dict(mode="forward"), dict(mode="backward"),
                                     dict(mode="backward", overlap=True)])
def test_custom_per_parameter_optimizer(fuse_kw):
    def run(fused):
        model = TinyLM()
        opt = SignSGD(model.parameters())
        if fused:
            opt = fuse(opt, model, bucket_numel=0, **fuse_kw)
        for idx in batches(6):
            _step(model, opt, idx)
        return model, opt.state_dict()

    assert_same(run(False), run(True))


def test_overlap_worker_errors_surface_in_backward():
    model = TinyLM()
    opt = fuse(SignSGD(model.parameters(), fail_at=2), model, mode="backward", overlap=True)
    _step(model, opt, batches(1)[0])
    with pytest.raises(RuntimeError, match="custom step failed"):
        loss_fn(model, batches(1)[0]).backward()
