"""Issue 15: forward-mode fusion must not give silent wrong answers to EMA/SWA, copies, reads.

Forward mode defers each update from ``step()`` to the next forward. Reads through the model
between the two (``AveragedModel.update_parameters(model)``, ``model.parameters()``,
``model.head.weight``, ``copy.deepcopy(model)``, pickling) apply the pending updates first
(``paraprop.optim.reads``); references taken earlier stay stale until ``flush()`` or the next
forward, as documented in ``docs/optim.md``. Everything is float64 and compared with the
unfused optimizer.
"""

from __future__ import annotations

import copy
import io
import os
import sys

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from paraprop.optim import FusionError, fuse
from paraprop.optim.reads import FreshParams, without_applying

sys.path.insert(0, os.path.dirname(__file__))
from test_optim import TinyLM, batches, loss_fn, one_thread  # noqa: E402, F401  (autouse)

STEPS = 8
TIGHT = dict(rtol=1e-14, atol=1e-14)


def make(fused: bool, mode: str = "forward", tied: bool = False, **fuse_kw):
    """A float64 TinyLM and an AdamW (two groups), fused or not."""
    model = TinyLM(tied=tied).double()
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    if fused:
        opt = fuse(opt, model, mode=mode, **({"bucket_numel": 0} | fuse_kw))
    return model, opt


def train_step(model, opt, idx) -> None:
    loss_fn(model, idx).backward()
    opt.step()
    opt.zero_grad()


def assert_params_close(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], **TIGHT, msg=name)


def assert_state_dicts_close(sd0, sd1) -> None:
    assert sd0.keys() == sd1.keys()
    for key in sd0:
        torch.testing.assert_close(sd0[key], sd1[key], **TIGHT, msg=key)


def assert_optimizer_state_close(s0, s1) -> None:
    assert s0["param_groups"] == s1["param_groups"]
    assert s0["state"].keys() == s1["state"].keys()
    for i, st in s0["state"].items():
        assert st.keys() == s1["state"][i].keys()
        for key, v in st.items():
            torch.testing.assert_close(v, s1["state"][i][key], **TIGHT)


def pending(opt) -> bool:
    """Whether an update is deferred (with ``overlap=True`` the thread may have applied all)."""
    return any(b.pending is not None for b in opt.buckets)


# -- EMA / SWA read the parameters right after step() -----------------------------------------
def _ema_run(fused: bool, kind: str, **fuse_kw):
    model, opt = make(fused, tied=fuse_kw.pop("tied", False), **fuse_kw)
    if kind == "ema":
        avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    elif kind == "swa":
        avg = AveragedModel(model)  # equal-weight average (the SWA default)
    else:  # a hand-written EMA over model.parameters()
        avg = [p.detach().clone() for p in model.parameters()]
    for idx in batches(STEPS):
        train_step(model, opt, idx)
        if fused and not opt.overlap:
            assert pending(opt)  # the update is deferred, the EMA must see it anyway
        if kind == "hand":
            with torch.no_grad():
                for e, p in zip(avg, model.parameters(), strict=True):
                    e.lerp_(p, 0.1)
        else:
            avg.update_parameters(model)
    return model, opt, avg


@pytest.mark.parametrize("kind", ["ema", "swa", "hand"])
@pytest.mark.parametrize("fuse_kw", [{}, {"overlap": True}, {"tied": True},
                                     {"bucket_numel": 1 << 14}])
def test_ema_and_swa_after_step_equal_the_unfused_ones(kind, fuse_kw):
    tied = fuse_kw.get("tied", False)
    ref_model, ref_opt, ref_avg = _ema_run(False, kind, tied=tied)
    model, opt, avg = _ema_run(True, kind, **fuse_kw)
    if kind == "hand":
        for e0, e1 in zip(ref_avg, avg, strict=True):
            torch.testing.assert_close(e1, e0, **TIGHT)
    else:
        assert int(avg.n_averaged) == int(ref_avg.n_averaged) == STEPS
        assert_params_close(avg.module, ref_avg.module)
        assert type(avg.module.head._parameters) is dict  # the average is not fused
    opt.flush()
    assert_params_close(model, ref_model)
    assert_optimizer_state_close(opt.state_dict(), ref_opt.state_dict())


def test_ema_between_backward_and_step_keeps_the_updates_fused():
    """docs/optim.md: averaging before ``step()`` sees what the previous step produced."""
    _, _, ref = _ema_run(False, "ema")
    model, opt = make(True)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for i, idx in enumerate(batches(STEPS)):
        loss_fn(model, idx).backward()  # the forward applied the previous update
        if i:
            assert not pending(opt)  # nothing left to apply: the read costs no fusion
            ema.update_parameters(model)
        opt.step()
        opt.zero_grad()
    ema.update_parameters(model)  # the last step's result
    assert_params_close(ema.module, ref.module)


def test_ema_with_buffers_and_backward_mode():
    """``use_buffers=True`` and backward mode (nothing is ever pending there) work too."""
    runs = []
    for mode in (None, "forward", "backward"):
        model, opt = make(mode is not None, mode=mode or "forward")
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True)
        for idx in batches(STEPS):
            train_step(model, opt, idx)
            ema.update_parameters(model)
        runs.append(ema.module)
    assert_params_close(runs[1], runs[0])
    assert_params_close(runs[2], runs[0])


# -- copies ----------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_deepcopy_is_a_plain_module_with_the_updated_parameters(overlap):
    ref, ref_opt = make(False)
    model, opt = make(True, overlap=overlap)
    seen = []
    model.head.register_forward_hook(lambda m, a, out: seen.append(out.shape))  # a user hook
    data = batches(STEPS)
    for idx in data[:3]:
        train_step(ref, ref_opt, idx)
        train_step(model, opt, idx)
    assert pending(opt) or overlap
    dup = copy.deepcopy(model)
    assert not pending(opt)  # the copy flushed the original first
    assert_params_close(dup, ref)
    assert_params_close(model, ref)
    # the copy is an ordinary module: plain dicts, no fusion hooks, the user's hook kept
    for m in dup.modules():
        assert type(m._parameters) is dict
        assert not m._forward_pre_hooks
    assert not dup._forward_hooks and not dup._forward_hooks_always_called
    assert len(dup.head._forward_hooks) == 1
    calls = len(seen)
    dup(data[0][:, :-1])
    assert len(seen) == calls + 1
    # both go on independently: the copy with its own plain optimizer, the original fused
    dup_opt = torch.optim.SGD(dup.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(dup, dup_opt, data[3])
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    for idx in data[3:]:
        train_step(ref, ref_opt, idx)
        train_step(model, opt, idx)
    opt.flush()
    assert_params_close(model, ref)
    assert_optimizer_state_close(opt.state_dict(), ref_opt.state_dict())


def test_deepcopy_of_a_submodule_and_averaged_model_construction():
    ref, ref_opt = make(False)
    model, opt = make(True)
    idx = batches(1)[0]
    train_step(ref, ref_opt, idx)
    train_step(model, opt, idx)
    head = copy.deepcopy(model.head)
    torch.testing.assert_close(head.weight, ref.head.weight, **TIGHT)
    assert not head._forward_pre_hooks and type(head._parameters) is dict
    swa = AveragedModel(model)  # deepcopy inside, then averages from the copy
    assert_params_close(swa.module, ref)


def test_pickled_model_has_the_updated_parameters_and_inert_hooks():
    ref, ref_opt = make(False)
    model, opt = make(True)
    idx = batches(1)[0]
    train_step(ref, ref_opt, idx)
    train_step(model, opt, idx)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert_params_close(loaded, ref)
    assert type(loaded.head._parameters) is dict
    torch.testing.assert_close(loaded(idx[:, :-1]), ref(idx[:, :-1]), **TIGHT)


def test_the_fused_optimizer_itself_is_not_copied():
    model, opt = make(True)
    with pytest.raises(TypeError, match="cannot be pickled; save state_dict"):
        copy.deepcopy(opt)


# -- state_dict ------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_state_dicts_after_flush_equal_the_unfused_run(overlap):
    ref, ref_opt = make(False)
    model, opt = make(True, overlap=overlap)
    for idx in batches(STEPS):
        train_step(ref, ref_opt, idx)
        train_step(model, opt, idx)
    assert pending(opt) or overlap
    opt.flush()
    assert not pending(opt)
    assert_state_dicts_close(model.state_dict(), ref.state_dict())
    assert_optimizer_state_close(opt.state_dict(), ref_opt.state_dict())


# -- other reads between step() and the next forward (docs/optim.md, "Reading parameters") -----
def test_parameters_listing_after_step_is_updated_and_reading_twice_applies_once():
    ref, ref_opt = make(False)
    model, opt = make(True)
    data = batches(4)
    for idx in data[:2]:
        train_step(ref, ref_opt, idx)
        train_step(model, opt, idx)
    first = [p.detach().clone() for p in model.parameters()]  # applies the pending updates
    assert not pending(opt)
    second = [p.detach().clone() for p in model.parameters()]  # a second read: no new update
    for a, b, r in zip(first, second, ref.parameters(), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r, **TIGHT)
    for idx in data[2:]:  # training goes on exactly
        train_step(ref, ref_opt, idx)
        train_step(model, opt, idx)
    opt.flush()
    assert_params_close(model, ref)


def test_attribute_read_applies_only_that_module():
    ref, ref_opt = make(False)
    model, opt = make(True)
    idx = batches(1)[0]
    train_step(ref, ref_opt, idx)
    train_step(model, opt, idx)
    torch.testing.assert_close(model.head.weight, ref.head.weight, **TIGHT)
    by_name = {b.name: b for b in opt.buckets}
    assert by_name["head"].pending is None
    assert by_name["norm"].pending is not None  # the rest stays fused into the next forward
    assert dict(model.mix[0].named_parameters()).keys() == {"weight", "bias"}
    assert by_name["mix.0"].pending is None and by_name["mix.2"].pending is not None


def test_references_taken_before_step_are_stale_until_flush_or_forward():
    """The documented limit: a tensor held from before ``step()`` is the parameter itself, and
    reading it does not go through the model. It holds the old value until the next forward or
    ``flush()``; if a stale value takes part in a forward, the next ``step()`` raises."""
    ref, ref_opt = make(False)
    model, opt = make(True)
    held = opt.param_groups[0]["params"]  # the optimizer's own references
    idx = batches(1)[0]
    old = [p.detach().clone() for p in held]
    train_step(ref, ref_opt, idx)
    train_step(model, opt, idx)
    for p, o in zip(held, old, strict=True):
        assert torch.equal(p, o)  # stale: the update is still pending
    opt.flush()
    for p, r in zip(held, ref_opt.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(p, r, **TIGHT)

    # a stale value used in a forward that skips the module: refused at the next step
    model, opt = make(True)
    weight = model.head.weight
    train_step(model, opt, idx)
    h = model.norm(model.emb(idx))
    (h @ weight.T).sum().backward()  # head's update is still pending: weight read stale
    with pytest.raises(FusionError, match="parameter 'head.weight' received a new gradient"):
        opt.step()


def test_model_zero_grad_keeps_updates_fused_and_exact():
    for set_to_none in (True, False):
        ref, ref_opt = make(False)
        model, opt = make(True)
        for idx in batches(4):
            for m, o in ((ref, ref_opt), (model, opt)):
                loss_fn(m, idx).backward()
                o.step()
                m.zero_grad(set_to_none=set_to_none)
            # set_to_none=True only drops references: the updates stay pending (fused);
            # set_to_none=False zeroes the gradients the updates use: they are applied first
            assert pending(opt) is set_to_none
        opt.flush()
        assert_params_close(model, ref)
        assert_optimizer_state_close(opt.state_dict(), ref_opt.state_dict())


def test_without_applying_leaves_the_updates_pending():
    model, opt = make(True)
    idx = batches(1)[0]
    old = model.head.weight.detach().clone()
    train_step(model, opt, idx)
    with without_applying():  # e.g. counting the bytes alive between two steps
        assert sum(p.numel() for p in model.parameters()) > 0
        assert torch.equal(model.head.weight, old)  # stale, as asked
    assert pending(opt)
    assert not torch.equal(model.head.weight, old)  # outside: applied on read


def test_gradient_zeroed_in_place_through_held_references_is_refused():
    model, opt = make(True)
    held = list(model.parameters())
    loss_fn(model, batches(1)[0]).backward()
    opt.step()
    for p in held:
        p.grad.zero_()
    with pytest.raises(FusionError, match="was modified in place after step"):
        opt.flush()


def test_two_fused_optimizers_on_one_model_and_unfuse():
    ref = TinyLM().double()
    model = TinyLM().double()

    def opts(m, fused):
        a = torch.optim.Adam(m.emb.parameters(), lr=1e-2)
        b = torch.optim.SGD([p for n, p in m.named_parameters() if not n.startswith("emb")],
                            lr=0.1)
        return (fuse(a, m), fuse(b, m)) if fused else (a, b)

    ref_opts, model_opts = opts(ref, False), opts(model, True)
    ema_ref = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for idx in batches(4):
        for m, os_, e in ((ref, ref_opts, ema_ref), (model, model_opts, ema)):
            loss_fn(m, idx).backward()
            for o in os_:
                o.step()
                o.zero_grad()
            e.update_parameters(m)
    assert_params_close(ema.module, ema_ref.module)
    assert len(model.head._parameters.engines) == 2
    assert isinstance(model.head._parameters, FreshParams)
    for o in model_opts:
        o.unfuse()
    assert type(model.head._parameters) is dict and not model.head._forward_pre_hooks
    assert_params_close(model, ref)


# -- settings assigned after fusing (issue 27, item 5) ------------------------------------------
@pytest.mark.parametrize("attr,value", [("mode", "backward"), ("bucket_numel", 100),
                                        ("overlap", True), ("model", torch.nn.Linear(2, 2))])
def test_fixed_settings_refuse_assignment_with_the_way_to_change_them(attr, value):
    model, opt = make(True)
    before = getattr(opt, attr)
    with pytest.raises(AttributeError, match=rf"FusedOptimizer.{attr} is fixed when the "
                                             rf"optimizer is fused .* assigning {attr}=.* would "
                                             r"be ignored. Call opt.unfuse\(\) and fuse it again"):
        setattr(opt, attr, value)
    assert getattr(opt, attr) is before
    ref_model, ref_opt = make(False)
    for idx in batches(3):                   # still the unfused result
        train_step(model, opt, idx)
        train_step(ref_model, ref_opt, idx)
    opt.flush()
    assert_params_close(model, ref_model)


def test_accumulation_steps_assigned_between_updates_is_honoured():
    model, opt = make(True)
    ref_model, ref_opt = make(False)
    data = batches(STEPS)
    for i, idx in enumerate(data):
        if i == 2:
            opt.accumulation_steps = 2       # between updates: the next windows are of 2
        loss_fn(model, idx).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(ref_model, idx).backward()
        if i < 2 or i % 2 == 1:
            ref_opt.step()
            ref_opt.zero_grad()
    opt.flush()
    assert_params_close(model, ref_model)


def test_accumulation_steps_assignment_is_checked():
    _, opt = make(True, accumulation_steps=3)
    with pytest.raises(ValueError, match="accumulation_steps must be a positive int, got 0"):
        opt.accumulation_steps = 0
    with pytest.raises(ValueError, match="accumulation_steps must be a positive int, got 2.0"):
        opt.accumulation_steps = 2.0
    model = opt.model
    loss_fn(model, batches(1)[0]).backward()
    opt.step()                               # 1 of 3 accumulated
    with pytest.raises(ValueError, match=r"accumulation_steps cannot change inside an "
                                         r"accumulation window \(1 of 3 backward passes "
                                         r"accumulated\); .*expected 3 until then, got 2\)"):
        opt.accumulation_steps = 2
    assert opt.accumulation_steps == 3
