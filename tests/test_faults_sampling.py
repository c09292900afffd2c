"""Fault tests of autoregressive sampling (issue 27): paraprop.sampling.sample (MADE, PixelCNN, any
autoregressive model) and TarFlow, one class of defect per section, with models built to break
them.

1. A stochastic model (train mode with dropout, a random layer, batch norm, a transformers-style
   dropout attribute) is refused by name, with the model.eval() advice.
2. A fast path (``update`` / ``window``) must compute bitwise what the full map computes, in
   every dtype: MADE's output rows, TarFlow's windows, PixelCNN's windows.
3. Low precision: TarFlow's KV-cached loop rounds differently from the solve; "auto" hands it a
   block only where its measured deviation is well within tol, and says so.
4. Settings assigned after construction: MADE refuses its constructor settings by name; an
   order changed in place is honoured with its masks or refused.
5. A random operation in the network (torch.randn_like) is named.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import paraprop
from paraprop.flows.tarflow_sampling import CACHED_SHARE
from paraprop.models import MADE, PixelCNN, TarFlow
from paraprop.models.tarflow import patchify
from paraprop.sampling import sample
from paraprop.sampling.pixelcnn import CachedPixels
from paraprop.solvers import GSJacobi, Jacobi, JacobiGS

LOW = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: one thread."""


class _Sampler:
    """The triangular system of :class:`_Autoregressive`: ``x_t = net(x_<t) + noise_t``."""

    def __init__(self, model, noise):
        self.m, self.noise = model, noise
        self.x0 = torch.zeros_like(noise)
        self.dim = -1

    def to_data(self, x):
        return x

    def __call__(self, x):
        return self.m.net(x) + self.noise


class _Autoregressive(nn.Module):
    """A user's own autoregressive model (not one of paraprop's), with a dropout layer."""

    def __init__(self, d=6, p=0.3):
        super().__init__()
        self.d = d
        self.lin = nn.Linear(d, d)
        with torch.no_grad():
            self.lin.weight.mul_(torch.ones(d, d).tril(-1))   # strictly lower: autoregressive
        self.drop = nn.Dropout(p)

    def net(self, x):
        return torch.tanh(self.drop(self.lin(x)))

    def noise_shape(self, n):
        return (n, self.d)

    def draw_noise(self, n, generator=None):
        return torch.randn(n, self.d, generator=generator)

    def sampling_map(self, noise):
        return _Sampler(self, noise)


class _Attention(nn.Module):
    """A transformers-style module: functional dropout through an attribute in train mode."""

    def __init__(self):
        super().__init__()
        self.attention_dropout = 0.1

    def forward(self, x):
        return nn.functional.dropout(x, self.attention_dropout, self.training)


def _made_with_dropout():
    m = MADE(8, (16,), seed=0)
    m.hidden[0] = nn.Sequential(m.hidden[0], nn.Dropout(0.2))
    return m


def _pixelcnn_with_batchnorm():
    m = PixelCNN(1, 4, hidden=4, layers=1, mixtures=2, levels=17)
    m.norm = nn.BatchNorm2d(1)   # a norm layer reading batch statistics in train mode
    return m


def _autoregressive_with_attention_dropout():
    m = _Autoregressive(p=0.0)
    m.attn = _Attention()
    return m


# name: (build in train mode, the layer named, what the message says it does)
MODELS = {
    "MADE with dropout": (_made_with_dropout, r"'hidden.0.1' \(Dropout\)",
                          r"draws random numbers at every call p=0.2"),
    "PixelCNN with batch norm": (_pixelcnn_with_batchnorm, r"'norm' \(BatchNorm2d\)",
                                 r"normalises with batch statistics"),
    "a user's model with dropout": (_Autoregressive, r"'drop' \(Dropout\)",
                                    r"draws random numbers"),
    "a user's model with attention_dropout": (_autoregressive_with_attention_dropout,
                                              r"'attn' \(_Attention\)",
                                              r"applies dropout in train mode "
                                              r"\(attention_dropout=0.1\)"),
}


@pytest.mark.parametrize("method", ["sequential", "jacobi", "fixed_passes"])
@pytest.mark.parametrize("name", list(MODELS))
def test_sample_refuses_a_stochastic_model(name, method):
    build, layer, does = MODELS[name]
    model = build()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(paraprop.StochasticModelError,
                       match=rf"paraprop.sampling.sample: model is in train mode, and its layer "
                             rf"{layer} {does}.*call model.eval\(\) first"):
        sample(model, 3, method=method, generator=g)
    model.eval()   # the same model in eval mode: every method gives the ancestral sample
    noise = model.draw_noise(3, torch.Generator().manual_seed(1))
    ref, _ = sample(model, 3, method="sequential", noise=noise)
    x, sol = sample(model, 3, method=method, noise=noise, tol=0)
    assert sol.converged and torch.equal(x, ref)


@pytest.mark.parametrize("name", ["sequential_cached", "jacobi_gs", "gs_jacobi"])
def test_pixelcnn_samplers_called_directly_refuse_a_stochastic_model(name):
    from paraprop.sampling import pixelcnn as ps

    m = _pixelcnn_with_batchnorm()
    noise = m.draw_noise(1, torch.Generator().manual_seed(0))
    call = {"sequential_cached": lambda: ps.sequential_cached(m, noise),
            "jacobi_gs": lambda: ps.jacobi_gs(m, noise, 2),
            "gs_jacobi": lambda: ps.gs_jacobi(m, noise, 2)}[name]
    with pytest.raises(paraprop.StochasticModelError,
                       match=rf"paraprop.sampling.pixelcnn.{name}: model is in train mode, and "
                             r"its layer 'norm' \(BatchNorm2d\)"):
        call()
    m.eval()
    assert call().converged


def test_a_model_switched_to_train_mode_later_is_refused():
    model = _Autoregressive().eval()
    sample(model, 2, generator=torch.Generator().manual_seed(0))
    model.drop.train()   # one layer back in train mode
    with pytest.raises(paraprop.StochasticModelError, match=r"layer 'drop' \(Dropout\)"):
        sample(model, 2, generator=torch.Generator().manual_seed(0))


def _tarflow_with_dropout():
    flow = TarFlow(4, patch_size=2, blocks=2, layers=1, width=8, heads=2)
    flow.blocks[1].norm = nn.Sequential(nn.LayerNorm(8), nn.Dropout(0.1))
    return flow


@pytest.mark.parametrize("entry", ["sample", "inverse", "calibrate"])
def test_tarflow_refuses_train_mode_dropout(entry):
    flow = _tarflow_with_dropout()
    z = torch.randn(2, 1, 4, 4)
    calls = {"sample": lambda: flow.sample(2, method="jacobi", tol=0),
             "inverse": lambda: flow.inverse(z, method="jacobi", tol=0),
             "calibrate": lambda: flow.calibrate(tol=1e-4)}
    with pytest.raises(paraprop.StochasticModelError,
                       match=rf"TarFlow.{entry}: flow is in train mode, and its layer "
                             r"'blocks.1.norm.1' \(Dropout\) draws random numbers.*call "
                             r"flow.eval\(\) first"):
        calls[entry]()
    flow.eval()
    calls[entry]()
    x, sol = flow.inverse(z, method="jacobi", tol=0)
    assert sol.converged and torch.equal(x, flow.inverse(z, method="sequential")[0])
    # density evaluation (training) is one pass: train mode is fine there
    flow.train()
    assert flow.log_prob(z.clamp(-1, 1)).shape == (2,)


# -- 2. fast paths bitwise the full map ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *LOW])
@pytest.mark.parametrize("cond", ["logistic", "gaussian", "bernoulli"])
def test_made_update_is_bitwise_the_full_map(cond, dtype, device):
    """A product over a subset of the output rows rounds differently from the full product on
    AVX-512 machines (float32 and float64): the update path computes whole chunks instead."""
    order = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    m = MADE(40, (32, 32), conditional=cond, order=order, seed=1).to(device=device, dtype=dtype)
    noise = m.draw_noise(5, torch.Generator().manual_seed(2))
    f = m.sampling_map(noise)
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    full = f(x)
    for index in ([0], [39], [3, 17, 38], list(range(0, 40, 3)), list(range(40))):
        idx = torch.tensor(index, device=device)
        assert torch.equal(f.update(x, idx), full.index_select(-1, idx)), index
    # and so JacobiGS, which calls update, is bitwise the full-map sequential solve
    x_gs, sol = sample(m, 5, method=JacobiGS(block_size=7), noise=noise, tol=0)
    ref = paraprop.solve(lambda v: f(v), f.x0, method="sequential", dim=-1).value
    assert sol.converged and torch.equal(x_gs, f.to_data(ref))


def _tarflow(dtype, device, scale=0.3, blocks=2):
    """8x8 images in 16 patches of 4; random output projections (|alpha| ~ 0.1 to 1 at
    ``scale=0.3``), drawn in float64 on the CPU, then cast and moved."""
    flow = TarFlow(8, patch_size=2, blocks=blocks, layers=2, width=32, heads=2, seed=0).double()
    g = torch.Generator().manual_seed(100)
    with torch.no_grad():
        for blk in flow.blocks:
            w = blk.out.weight
            w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype) * scale / math.sqrt(32))
            blk.out.bias.copy_(torch.randn(blk.out.bias.shape, generator=g, dtype=w.dtype) * 0.1)
    return flow.to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("dtype", LOW)
def test_tarflow_windows_are_bitwise_the_full_pass_in_low_precision(dtype, device):
    flow = _tarflow(dtype, device)
    z = patchify(torch.randn(3, 1, 8, 8, dtype=torch.float64).to(device, dtype), 2)
    f = flow.sampling_map(z, 0, chunk=3)
    x = patchify(torch.randn(3, 1, 8, 8, dtype=torch.float64).to(device, dtype), 2)
    full = f(x)
    cache = None
    for start, stop in [(0, 4), (4, 9), (7, 12), (2, 5), (12, 16), (0, 16)]:
        vals, cache = f.window(x, start, stop, cache)
        assert torch.equal(vals, full[:, start:stop]), (start, stop)


@pytest.mark.parametrize("dtype", LOW)
def test_pixelcnn_windows_are_the_full_pass_at_a_sample(dtype, device):
    """At the sample (a fixed point) the cached map's windows give the full pass's pixels."""
    m = PixelCNN(1, 6, hidden=8, layers=2, mixtures=2, levels=17, seed=2).to(device=device,
                                                                          dtype=dtype).eval()
    noise = m.draw_noise(2, torch.Generator().manual_seed(5))
    x, _ = sample(m, 2, method="sequential", noise=noise)
    f = CachedPixels(m, noise)
    xs = x.permute(0, 2, 3, 1)
    full = f(xs).reshape(2, 36, 1)
    assert torch.equal(full, xs.reshape(2, 36, 1))
    cache = None
    for start, stop in [(0, 12), (12, 24), (18, 36)]:
        vals, cache = f.window(xs, start, stop, cache)
        assert torch.equal(vals, full[:, start:stop]), (start, stop)


# -- 3. TarFlow: the KV-cached loop in an "auto" plan ----------------------------------------------
def _hard(dtype):
    """One block that Jacobi needs all its sweeps for: "auto" prefers the cached loop there."""
    return _tarflow(dtype, "cpu", scale=3.0, blocks=1)


def test_auto_hands_the_cached_loop_a_block_only_within_tol():
    flow = _hard(torch.float64)
    assert flow.calibrate(tol=1e-6) == ["sequential_cached"]   # float64 rounding: ~1e-15
    z = torch.randn(2, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x, sol = flow.inverse(z, method="auto", tol=1e-6)
    block = sol.stats["blocks"][0]
    assert sol.stats["methods"] == ["sequential_cached"]
    assert block.stats["error_estimate_source"] == "calibration"
    assert 0 <= block.stats["error_estimate"] <= CACHED_SHARE * 1e-6
    exact, _ = flow.inverse(z, method="sequential", tol=0)
    assert float((x - exact).abs().max()) <= 1e-6
    # asked for by name, the loop is its own reference
    _, own = flow.inverse(z, method="sequential_cached")
    assert own.stats["blocks"][0].stats["error_estimate_source"] == "the loop itself"


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_auto_keeps_the_cached_loop_out_where_its_rounding_exceeds_tol(dtype):
    """In float32 at tol=1e-7, and in bf16 / fp16 at 1e-3, the cached loop's rounding is above
    what tol allows: the plan keeps the solve methods, whose certificate is the solve's (before,
    "auto" took the loop whenever it was faster, and its converged=True claimed tol)."""
    flow = _hard(dtype)
    tol = 1e-7 if dtype == torch.float32 else 1e-3
    plan, deviation = flow._calibrate(tol, 4, 0, 8, "count")
    assert [repr(m) for m in flow.calibrate(tol=tol)] == [repr(m) for m in plan]
    assert all(isinstance(m, Jacobi | GSJacobi) for m in plan)
    # why: the loop's measured deviation from the exact inverse is above what tol allows
    # (float32 on this expanding block: 2.4e-4, measured; float64 lets it serve, above)
    assert math.isfinite(deviation[0]) and deviation[0] > CACHED_SHARE * tol


# -- 4. TarFlow's per-block certificate at tol > 0 in low precision -----------------------------
@pytest.mark.parametrize(("dtype", "scale", "blocks", "tol", "seed", "method"), [
    (torch.bfloat16, 0.3, 3, 1e-2, 2, "jacobi"),           # measured: 0.0156 > tol, converged
    (torch.float16, 0.3, 2, 1e-3, 1, "jacobi"),            # 0.0039
    (torch.float16, 1.0, 3, 1e-2, 1, "sliding_jacobi"),    # 0.031
])
def test_tarflow_block_certificate_in_low_precision(dtype, scale, blocks, tol, seed, method):
    """converged=True promises each block within tol of the exact inverse of its input; where
    rounding alone exceeds tol the answer must be converged=False (these cases were certified
    before the solvers' stop took the dtype's rounding into account: measured errors in the
    comments)."""
    flow = _tarflow(dtype, "cpu", scale=scale, blocks=blocks)
    z = torch.randn(4, 1, 8, 8, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed)).to(dtype)
    _, sol = flow.inverse(z, method=method, tol=tol, throw=False)
    h = patchify(z, 2)
    for k in reversed(range(blocks)):
        hk = h.flip(1) if k % 2 else h
        f = flow.sampling_map(hk, k)
        exact = paraprop.solve(f, f.x0, dim=-2, method="sequential").value
        got = sol.stats["blocks"][k].value
        if sol.stats["blocks"][k].converged:
            assert float((got.float() - exact.float()).abs().max()) <= tol, k
        h = got.flip(1) if k % 2 else got


def test_a_block_whose_windows_round_differently_is_not_certified(monkeypatch):
    """A sampling map whose windows differ from its full pass by one unit in the last place (a
    kernel that rounds a window differently): the solve's verification declines to certify
    tol=0, and TarFlow says which block and why."""
    from paraprop.flows import tarflow_inverse as tf

    window = tf.BlockInverse.window

    def rounded(self, x, start, stop, cache):
        vals, cache = window(self, x, start, stop, cache)
        if (start, stop) != (0, self.T):   # a window, not the full pass
            vals = torch.nextafter(vals, torch.full_like(vals, math.inf))
        return vals, cache

    monkeypatch.setattr(tf.BlockInverse, "window", rounded)
    flow = _tarflow(torch.float32, "cpu", blocks=2)
    z = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    _, sol = flow.inverse(z, method=GSJacobi(4), tol=0, throw=False)
    assert not sol.converged
    assert sol.stats["not_converged"].startswith("block 1: ")   # inverted first
    with pytest.raises(paraprop.ConvergenceError,
                       match=r"TarFlow.inverse: method='gs_jacobi' did not converge: block 1: "
                             r".*rounding"):
        flow.inverse(z, method=GSJacobi(4), tol=0)


# -- settings assigned after construction ----------------------------------------------------------
@pytest.mark.parametrize(("name", "value"), [
    ("order", torch.arange(5)), ("features", 4), ("hidden", (8,)), ("conditional", "gaussian"),
    ("seed", 3), ("k", 1), ("perm", torch.arange(5)), ("natural", True), ("config", {})])
def test_made_refuses_a_constructor_setting_assigned_later(name, value):
    """MADE's masks and layer shapes come from its constructor's settings: a new value assigned
    afterwards would be ignored (order: the samples and densities stayed those of the old
    order), so the assignment is refused by name."""
    m = MADE(5, (16,), order=[4, 2, 0, 1, 3])
    x = torch.rand(3, 5)
    before = m.log_prob(x)
    with pytest.raises(AttributeError, match=rf"MADE\.{name} cannot be assigned after "
                                             r"construction: the masks and layer shapes were "
                                             r"built from the constructor's"):
        setattr(m, name, value)
    assert torch.equal(m.log_prob(x), before) and m.config["order"] == [4, 2, 0, 1, 3]


def test_made_order_changed_in_place_is_honoured_with_its_masks_or_refused():
    """load_state_dict carries another MADE's order with its masks: honoured (the samples are
    that MADE's); an order buffer changed in place alone is refused at the next call."""
    a = MADE(5, (16,), order=[4, 2, 0, 1, 3]).eval()
    b = MADE(5, (16,)).eval()
    b.load_state_dict(a.state_dict())
    x, noise = torch.rand(3, 5), a.draw_noise(3, torch.Generator().manual_seed(0))
    assert torch.equal(b.log_prob(x), a.log_prob(x))
    assert not b.natural and b.config["order"] == [4, 2, 0, 1, 3]
    want = sample(a, 3, noise=noise, method="sequential")[0]
    assert torch.equal(sample(b, 3, noise=noise, method="jacobi", tol=0)[0], want)
    with torch.no_grad():
        b.order.copy_(torch.arange(5))
    with pytest.raises(ValueError, match=r"MADE.perm must be argsort\(MADE.order\)"):
        b.log_prob(x)
    with torch.no_grad():
        b.perm.copy_(torch.arange(5))
    for call in (lambda: b.log_prob(x), lambda: sample(b, 3, noise=noise)):
        with pytest.raises(ValueError, match=r"MADE.order was changed in place to \[0, 1, 2, 3, "
                                             r"4\], but the network's masks encode the order "
                                             r"it was built with"):
            call()
    with torch.no_grad():
        b.order[0] = 7
    with pytest.raises(ValueError, match=r"MADE.order must be a permutation of 0..4"):
        b.log_prob(x)


# -- a random operation inside the model's network ------------------------------------------------
@pytest.mark.parametrize("method", ["jacobi", "sequential", "gs_jacobi", "fixed_passes"])
def test_a_random_operation_in_the_network_is_named(method):
    """A MADE whose hidden features get torch.randn_like noise in training mode: no layer list
    knows it (require_deterministic passes), the global generator moving does."""

    class NoisyMADE(MADE):
        def _features(self, x):
            h = super()._features(x)
            return h + 0.1 * torch.randn_like(h) if self.training else h

    m = NoisyMADE(6, (16,))
    noise = m.draw_noise(3, torch.Generator().manual_seed(0))
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"paraprop.sampling.sample: the model drew random numbers while "
                             r"sampling .*Call model.eval\(\) if it draws only in training mode"):
        sample(m, 3, noise=noise, method=method, tol=0)
    m.eval()
    want = sample(m, 3, noise=noise, method="sequential")[0]
    assert torch.equal(sample(m, 3, noise=noise, method=method, tol=0)[0], want)
