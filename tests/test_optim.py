"""Optimizer fusion: bitwise equality with the unfused optimizer after 20 steps.

The matrix: every supported optimizer (and its for-loop / foreach / fused implementations) x both
modes x the features the issue names (global-norm clipping, gradient accumulation, an LR
scheduler, tied weights, save/resume in the middle, and all of them at once). The reference is
the same loop with the plain optimizer; parameters, buffers and optimizer state must be equal
bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paraprop.optim import FusedOptimizer, FusionError, fuse

STEPS = 20
VOCAB, WIDTH = 11, 8

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05, lr_decay=1e-3)),
    "adadelta": (torch.optim.Adadelta, dict(lr=1.0, weight_decay=1e-3)),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=1e-2)),
    "radam": (torch.optim.RAdam, dict(lr=1e-2)),
}
FUSED_KERNEL = {"sgd", "adam", "adamw", "adagrad"}  # fused=True exists on CPU for these
IMPLS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
FEATURES = ("plain", "clip", "accumulate", "scheduler", "tied", "resume", "all", "all-but-clip")


class TinyLM(nn.Module):
    """Embedding, a residual MLP, LayerNorm and an output layer (optionally tied)."""

    def __init__(self, tied: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(),
                                 nn.Linear(2 * WIDTH, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.mix(h)
        return self.head(self.norm(h))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread avoids waiting on busy cores (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def batches(n: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, 6), generator=g) for _ in range(n)]


def loss_fn(model, idx):
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def param_groups(model):
    """Two groups: weight decay on matrices, none on vectors (exercises group splitting)."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def make_optimizer(name: str, model, impl: str = "for-loop"):
    cls, kw = OPTIMIZERS[name]
    return cls(param_groups(model), **kw, **IMPLS[impl])


def train(name, *, mode=None, impl="for-loop", feature="plain", steps=STEPS, data=None,
          device="cpu", dtype=torch.float32, **fuse_kw):
    """Train TinyLM; returns ``(model, optimizer state_dict)``. ``mode=None``: unfused.

    ``fuse_kw`` go to :func:`fuse`; by default one bucket per module (``bucket_numel=0``), the
    most buckets TinyLM can have. ``device``, ``dtype``: where and in which precision the model
    (and so the optimizer state) lives.
    """
    fuse_kw = {"bucket_numel": 0} | fuse_kw
    every = feature.startswith("all")
    tied = every or feature == "tied"
    k = 2 if every or feature == "accumulate" else 1
    clip = feature in ("clip", "all")
    sched_on = every or feature == "scheduler"
    resume_at = steps // 2 if every or feature == "resume" else None
    data = batches(steps) if data is None else data

    def build(state=None):
        model = TinyLM(tied).to(device, dtype)
        opt = make_optimizer(name, model, impl)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7) if sched_on else None
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
            if sched is not None:
                sched.load_state_dict(state[2])
        if mode is not None:
            opt = fuse(opt, model, mode=mode, accumulation_steps=k, **fuse_kw)
        return model, opt, sched

    model, opt, sched = build()
    for i, idx in enumerate(data):
        if resume_at is not None and i == resume_at:
            state = (model.state_dict(), opt.state_dict(),
                     sched.state_dict() if sched else None)
            model, opt, sched = build(state)
        (loss_fn(model, idx.to(device)) / k).backward()
        last = (i + 1) % k == 0
        if mode is not None or last:  # a fused optimizer is called after every backward
            if clip and last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            if sched is not None and last:
                sched.step()
    return model, opt.state_dict()


def assert_same(ref, got):
    (m0, s0), (m1, s1) = ref, got
    sd0, sd1 = m0.state_dict(), m1.state_dict()
    assert sd0.keys() == sd1.keys()
    for key in sd0:
        assert torch.equal(sd0[key], sd1[key]), f"model {key} differs"
    assert s0["param_groups"] == s1["param_groups"]
    assert s0["state"].keys() == s1["state"].keys()
    for i, st in s0["state"].items():
        assert st.keys() == s1["state"][i].keys()
        for key, v in st.items():
            w = s1["state"][i][key]
            same = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
            assert same, f"optimizer state {i}/{key} differs"


def _cases():
    for name in OPTIMIZERS:
        for mode in ("forward", "backward"):
            for feature in FEATURES:
                if mode == "backward" and feature in ("clip", "all"):
                    continue  # refused in backward mode (tests/test_optim_refusals.py)
                yield name, mode, feature


@pytest.mark.parametrize(("name", "mode", "feature"), list(_cases()))
def test_bitwise_equal_after_20_steps(name, mode, feature):
    ref = train(name, feature=feature)
    got = train(name, mode=mode, feature=feature)
    assert_same(ref, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "fp16"])
@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize(("name", "impl"), [("adamw", "foreach"), ("sgd", "for-loop"),
                                            ("adam", "fused")])
def test_bitwise_in_every_dtype_on_the_device(name, impl, mode, dtype, device):
    """bf16 / fp16 models (parameters, gradients and optimizer state in that dtype), on the
    device fixture: the fused run is the unfused one bit for bit (the same operations of the
    wrapped optimizer in the same precision, bucket by bucket)."""
    if name != "sgd" and dtype == torch.float16:
        pytest.skip("Adam's eps=1e-8 underflows in float16: the unfused run itself is NaN")
    feature = "all" if mode == "forward" else "all-but-clip"
    ref = train(name, impl=impl, feature=feature, steps=8, device=device, dtype=dtype)
    assert all(bool(v.isfinite().all()) for v in ref[0].state_dict().values())
    assert_same(ref, train(name, mode=mode, impl=impl, feature=feature, steps=8, device=device,
                           dtype=dtype))


@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize(("name", "impl"), [(n, i) for n in OPTIMIZERS for i in IMPLS
                                            if i != "for-loop"
                                            and (i != "fused" or n in FUSED_KERNEL)])
def test_foreach_and_fused_implementations(name, impl, mode):
    feature = "all" if mode == "forward" else "all-but-clip"
    assert_same(train(name, impl=impl, feature=feature),
                train(name, mode=mode, impl=impl, feature=feature))


@pytest.mark.parametrize("name", ["adam", "sgd", "rmsprop"])
@pytest.mark.parametrize("fuse_kw", [dict(mode="backward", overlap=True),
                                     dict(mode="forward", overlap=True),
                                     dict(mode="forward", overlap=True, bucket_numel=1 << 14),
                                     dict(mode="backward", bucket_numel=1 << 14),
                                     dict(mode="forward", bucket_numel=100),
                                     dict(mode="forward", bucket_numel=1 << 14)])
def test_merged_buckets_and_overlap(name, fuse_kw):
    feature = "all" if fuse_kw["mode"] == "forward" else "all-but-clip"
    assert_same(train(name, feature=feature), train(name, feature=feature, **fuse_kw))


@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize("cls", [torch.optim.ASGD, torch.optim.Rprop, torch.optim.SparseAdam])
def test_other_per_parameter_optimizers(cls, mode):
    def run(fused):
        model = TinyLM()
        if cls is torch.optim.SparseAdam:  # sparse gradients: an embedding-only model
            model.emb = nn.Embedding(VOCAB, WIDTH, sparse=True)
            opt = cls(model.emb.parameters(), lr=1e-2)
        else:
            opt = cls(model.parameters(), lr=1e-2)
        if fused:
            opt = fuse(opt, model, mode=mode, bucket_numel=0)
        for idx in batches(8):
            loss_fn(model, idx).backward()
            opt.step()
            opt.zero_grad()
        return model, opt.state_dict()

    assert_same(run(False), run(True))


def test_learning_rate_is_snapshotted_at_step():
    """Forward mode applies after scheduler.step(): the recorded LR must be used, not the new."""
    model = TinyLM()
    opt = fuse(torch.optim.SGD(model.parameters(), lr=0.1), model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 10.0 ** -e)
    ref_model = TinyLM()
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    idx = batches(1)[0]
    for m, o in ((model, opt), (ref_model, ref)):
        loss_fn(m, idx).backward()
        o.step()
        o.zero_grad()
    sched.step()  # lr 0.1 -> 0.01 before the pending update is applied
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    opt.flush()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_tensor_learning_rate_with_scheduler():
    def run(mode):
        model = TinyLM()
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
        if mode:
            opt = fuse(opt, model, mode=mode)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        for idx in batches(6):
            loss_fn(model, idx).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        return model, opt.state_dict()

    ref = run(None)
    for mode in ("forward", "backward"):
        assert_same(ref, run(mode))


class Branchy(nn.Module):
    """A module used only on even steps, a frozen one, and a parameter used functionally."""

    def __init__(self, functional_from: int | None = 0):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.frozen = nn.Linear(5, 5).requires_grad_(False)
        self.proj = nn.Linear(5, 3)  # its weight is read by F.linear, proj() is never called
        self.scale = nn.Parameter(torch.ones(5))
        self.functional_from = functional_from
        self.calls = 0

    def forward(self, x, use_b: bool):
        h = self.a(x) * self.scale
        if use_b:
            h = self.b(torch.tanh(h))
        h = self.frozen(h)
        if self.functional_from is not None and self.calls >= self.functional_from:
            out = F.linear(h, self.proj.weight, self.proj.bias)
        else:
            out = self.proj(h)
        self.calls += 1
        return out


def _train_branchy(mode, set_to_none=True, zero_via_model=False, functional_from=0,
                   overlap=False):
    model = Branchy(functional_from)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if mode:
        opt = fuse(opt, model, mode=mode, overlap=overlap, bucket_numel=0)
    g = torch.Generator().manual_seed(3)
    for i in range(12):
        x = torch.randn(4, 5, generator=g)
        model(x, use_b=i % 2 == 0).square().mean().backward()
        opt.step()
        if zero_via_model:
            model.zero_grad(set_to_none=set_to_none)
        else:
            opt.zero_grad(set_to_none=set_to_none)
        if i == 5:  # an evaluation forward between steps
            with torch.no_grad():
                model.eval()
                model(x, use_b=True)
                model.train()
    return model, opt.state_dict()


@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_unused_modules_frozen_params_functional_use_and_eval(mode, set_to_none, overlap):
    ref = _train_branchy(None, set_to_none)
    assert_same(ref, _train_branchy(mode, set_to_none, overlap=overlap))


@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("zero_via_model", [False, True])
def test_unused_modules_frozen_params_functional_use_and_eval(mode, set_to_none, zero_via_model):
    if zero_via_model and not set_to_none and mode == "backward":
        # zeroing consumed gradients behind the fused optimizer's back is refused, never ignored
        # (forward mode: model.zero_grad() applies the pending updates first, paraprop.optim.reads)
        with pytest.raises(FusionError, match="already consumed"):
            _train_branchy(mode, set_to_none, zero_via_model)
        return
    ref = _train_branchy(None, set_to_none, zero_via_model)
    assert_same(ref, _train_branchy(mode, set_to_none, zero_via_model))


def test_grad_scaler_forward_mode_including_skipped_steps():
    def run(mode):
        model = TinyLM()
        opt = torch.optim.Adam(param_groups(model), lr=1e-2)
        if mode:
            opt = fuse(opt, model, mode=mode)
        # a scale near the float32 maximum overflows the first gradients: the scaler skips
        # those steps and backs off, then grows again every 3 steps
        scaler = torch.amp.GradScaler("cpu", init_scale=3e38, growth_interval=3)
        skipped = 0
        for idx in batches(12):
            scaler.scale(64 * loss_fn(model, idx)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
            opt.zero_grad()
        return (model, opt.state_dict()), skipped

    (ref, skipped), (got, _) = run(None), run("forward")
    assert skipped >= 1
    assert_same(ref, got)


def test_autocast_forward_mode():
    def run(mode):
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if mode:
            opt = fuse(opt, model, mode=mode)
        for idx in batches(6):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return model, opt.state_dict()

    ref = run(None)
    for mode in ("forward", "backward"):
        assert_same(ref, run(mode))


def test_buckets_are_modules_and_root_holds_tied_weights():
    model = TinyLM(tied=True)
    opt = fuse(torch.optim.SGD(model.parameters(), lr=0.1), model, bucket_numel=0)
    names = [b.name for b in opt.buckets]
    assert names == ["<root>", "mix.0", "mix.2", "norm", "head"]  # emb owns only the tied one
    assert opt.buckets[0].names == ["emb.weight"]  # shared by emb and head
    assert [len(b.params) for b in opt.buckets] == [1, 2, 2, 2, 1]
    assert sum(len(b.params) for b in opt.buckets) == len(list(model.parameters()))
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, FusedOptimizer)
    assert opt.param_groups is opt.optimizer.param_groups
    merged = fuse(opt.unfuse(), model, bucket_numel=150)  # mix.0 (8*16+16) is merged on
    assert [b.name for b in merged.buckets] == ["<root>", "mix.0..mix.2", "norm..head"]
