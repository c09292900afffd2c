"""Fault tests for paraprop.diffusion (issue 27 items 2, 3 and 7; issue 28's device parity), one
per class of defect, each with cases built to show it:

1. a stochastic model (train mode with dropout, batch statistics) is refused up front, through
   a ``functools.partial``, a bound method or a closure, and at run time where it cannot be
   seen (a lambda over a global, a ``randn_like`` in ``forward``): never ``converged=True``;
2. ``method="sequential"`` rounds as the diffusers loop does, in bfloat16 and float16;
3. ``tol=0`` is the loop's bits, or ``converged=False`` (never a rounding-level difference);
4. ``tol > 0`` accounts for the dtype's rounding floor and for error growth along the chain:
   whenever ``converged=True`` the sample is within ``tol`` of the real diffusers loop, over a
   grid of schedulers, prediction types, variances, clipping and dtypes;
5. Picard iterates that overflow at uncertified positions are not the user's error, while a
   non-finite step from exact inputs (the loop's own) is reported by step;
6. no method takes more model calls in sequence than the loop;
7. a model whose batched calls round differently from the loop's (batch variance) cannot be
   certified bitwise;
8. a model output of another dtype is refused by name;
9. the same for the readers' schedulers (Euler, Euler ancestral, flow matching, LCM,
   DPM-Solver++ of order 1): batch variance at ``tol=0``, the ``tol > 0`` certificate against
   the real diffusers loop, stochastic models, a non-finite step, another output dtype; and
   DPM-Solver++ of order 2 and 3 and UniPC, whose steps read earlier model outputs (batch
   variance at ``tol=0`` and the two-input certificate; more in
   tests/test_diffusion_multistep_parallel.py).
"""

from __future__ import annotations

import functools
import importlib
import math
import re
import types
import warnings

import pytest
import torch

import paraprop
from paraprop.diffusion import BatchVarianceWarning, draw_noise, sample, step_table
from paraprop.solvers import Jacobi, SlidingJacobi, TriangularAnderson

diffusers = pytest.importorskip("diffusers")
DDPMScheduler = diffusers.DDPMScheduler
DDIMScheduler = diffusers.DDIMScheduler
from diffusion_cases import UNCHECKED, within_tol_or_unchecked  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LOW = [torch.bfloat16, torch.float16]
PARALLEL = [("picard", {}), ("picard", {"window": 4}), ("anderson", {}), (Jacobi(), {}),
            (SlidingJacobi(3), {}), (TriangularAnderson(memory=2), {})]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def elementwise(x, t):
    """A nonlinear eps with no batch variance (each element on its own)."""
    tt = torch.as_tensor(t).reshape(-1, *([1] * (x.dim() - 1))).to(x.device, x.dtype) / 1000
    return torch.tanh(1.5 * x + tt) * 0.8 - 0.1 * x


class Mlp(torch.nn.Module):
    """A small MLP denoiser with torch.nn layers (its matmuls may round a row differently in
    batches of other sizes)."""

    def __init__(self, seed=0, scale=0.5, dropout=0.0, norm=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1, self.l2 = torch.nn.Linear(3, 32), torch.nn.Linear(32, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * scale)
        self.drop = torch.nn.Dropout(dropout)
        self.norm = torch.nn.BatchNorm1d(32) if norm else torch.nn.Identity()
        self.requires_grad_(False)

    def forward(self, x, t):
        tt = torch.as_tensor(t).reshape(-1).expand(len(x)).to(x.device, x.dtype) / 1000
        h = self.drop(torch.tanh(self.norm(self.l1(torch.cat([x, tt[:, None]], 1)))))
        return self.l2(h)


def loop(model, scheduler, shape, N, seed, *, dtype=torch.float32, eta=None, **kw):
    """The diffusers loop, with the pipelines' draw of the noise."""
    g = gen(seed)
    scheduler.set_timesteps(N)
    x = diffusers.utils.torch_utils.randn_tensor(shape, generator=g, dtype=dtype)
    ekw = {} if eta is None else {"eta": eta}
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(model(x, t), t, x, generator=g, **ekw, **kw).prev_sample
    return x


# -- 1. stochastic models --------------------------------------------------------------------

def _tiny_unet(dropout):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return diffusers.UNet2DModel(
            sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16),
            layers_per_block=1, norm_num_groups=4, dropout=dropout,
            down_block_types=("DownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "UpBlock2D")).requires_grad_(False)


@pytest.mark.parametrize("method", ["sequential", "picard", "anderson"])
def test_a_unet_in_train_mode_with_dropout_is_refused(method):
    unet = _tiny_unet(dropout=0.1).train()
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"diffusion\.sample: model .*train mode.*dropout.*"
                             r"call model\.eval\(\) first"):
        sample(unet, DDIMScheduler(), (2, 1, 8, 8), num_inference_steps=4, method=method,
               generator=gen())
    # its bound forward as the model, too
    with pytest.raises(paraprop.StochasticModelError, match=r"model\.eval\(\)"):
        sample(unet.forward, DDIMScheduler(), (2, 1, 8, 8), num_inference_steps=4,
               generator=gen())
    # in eval mode it samples, and the parallel sample is the loop's within tol
    unet.eval()
    ref = loop(lambda x, t: unet(x, t).sample, DDIMScheduler(), (2, 1, 8, 8), 4, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchVarianceWarning)
        x, sol = sample(unet, DDIMScheduler(), (2, 1, 8, 8), num_inference_steps=4,
                        method=method, tol=1e-3, throw=False, generator=gen())
    # (or refused by name: the untrained UNet's chain takes every call of the budget, and its
    # float32 convolutions round a batch apart)
    within_tol_or_unchecked(x, sol, ref, 1e-3)


class FunctionalDropout(torch.nn.Module):
    """Dropout applied through ``torch.nn.functional`` and an attribute, as transformers' and
    timm's blocks do: no dropout layer to find by type."""

    def __init__(self):
        super().__init__()
        self.inner = Mlp()
        self.dropout = 0.1

    def forward(self, x, t):
        return torch.nn.functional.dropout(self.inner(x, t), self.dropout, self.training)


@pytest.mark.parametrize(("make", "layer"), [
    (lambda: Mlp(dropout=0.2), "Dropout"),
    (lambda: Mlp(norm=True), "BatchNorm1d"),
    (FunctionalDropout, "dropout=0.1"),
], ids=["dropout", "batchnorm", "functional-dropout"])
def test_a_module_with_stochastic_layers_in_train_mode_is_refused(make, layer):
    model = make().train()
    for method in ("sequential", "picard"):
        with pytest.raises(ValueError, match=rf"{layer}.*call model\.eval\(\) first.*"
                                             r"expected a module in eval mode"):
            sample(model, DDPMScheduler(), (2, 2), num_inference_steps=3, method=method,
                   generator=gen())
    model.eval()
    ref = loop(model, DDPMScheduler(), (2, 2), 3, 0)   # (the diffusers loop)
    x, sol = sample(model, DDPMScheduler(), (2, 2), num_inference_steps=3, throw=False,
                    generator=gen())
    within_tol_or_unchecked(x, sol, ref, 1e-3)   # (the default tol)


def test_a_module_in_train_mode_without_stochastic_layers_samples():
    model = Mlp().train()
    x, sol = sample(model, DDPMScheduler(), (3, 2), num_inference_steps=5, method="sequential",
                    generator=gen())
    assert torch.equal(x, loop(model, DDPMScheduler(), (3, 2), 5, 0))


class NoisyEps(torch.nn.Module):
    """Randomness in ``forward`` in train mode, with no layer to find by type."""

    def __init__(self, sigma):
        super().__init__()
        self.inner = Mlp()
        self.sigma = sigma

    def forward(self, x, t):
        y = self.inner(x, t)
        return y + self.sigma * torch.randn_like(y) if self.training else y


@pytest.mark.parametrize("wrap", ["partial", "partial-args", "bound", "closure", "wrapped"])
def test_a_train_mode_unet_behind_a_wrapper_is_refused_up_front(wrap):
    unet = _tiny_unet(dropout=0.2).train()

    def closure():
        inner = unet
        return lambda x, t: inner(x, t).sample

    def call(m, x, t):
        return m(x, t).sample

    @functools.wraps(unet.forward)
    def wrapped(x, t):
        return unet(x, t).sample

    model, name = {
        "partial": (functools.partial(unet, return_dict=False), r"model\.func"),
        "partial-args": (functools.partial(call, unet), r"model\.args\[0\]"),
        "bound": (unet.forward, "model"),
        "closure": (closure(), r"inner"),
        "wrapped": (wrapped, r"model\.__wrapped__"),
    }[wrap]
    if wrap == "partial":
        model = (lambda f: lambda x, t: f(x, t)[0])(model)   # a lambda over the partial
        name = r"f\.func"
    with pytest.raises(paraprop.StochasticModelError,
                       match=rf"{name} is in train mode.*Dropout.*call {name}\.eval\(\)"):
        sample(model, DDIMScheduler(), (2, 1, 8, 8), num_inference_steps=4, method="picard",
               tol=1e-2, generator=gen())


@pytest.mark.parametrize("tol", [0.0, 1e-2, 0.5])
@pytest.mark.parametrize("method", ["picard", "anderson", SlidingJacobi(3)], ids=repr)
def test_randomness_the_static_check_cannot_see_is_caught_at_run_time(method, tol):
    """A train-mode UNet with dropout behind an attribute of a plain object (a lambda over a
    global is the same), and a module with ``randn_like`` in ``forward``: the recomputed step
    differs from the first evaluation far beyond batch variance, so StochasticModelError names
    train mode and model.eval() (the probe's case: converged=True at tol=1e-2, the 0.67
    difference called rounding; at tol=0 an error blaming batch-variant kernels)."""
    holder = types.SimpleNamespace(unet=_tiny_unet(dropout=0.2).train())
    hidden = lambda x, t: holder.unet(x, t).sample  # noqa: E731
    for model, shape in ((hidden, (2, 1, 8, 8)), (NoisyEps(0.05).train(), (3, 2))):
        with pytest.raises(paraprop.StochasticModelError,
                           match=r"not a fixed function of its input.*train mode.*"
                                 r"call model\.eval\(\) first"):
            sample(model, DDIMScheduler(), shape, num_inference_steps=6, method=method,
                   tol=tol, throw=False, generator=gen())


def test_small_randomness_is_told_apart_from_batch_variance_by_evaluating_again():
    """Noise of 1e-4 of the outputs' size: within what batch variance might explain in size,
    so the loop's first step is evaluated again on the same rows: other values, refused."""
    model = NoisyEps(1e-4).train()
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"evaluating the loop's first step again on the same 3 rows gave "
                             r"other values"):
        sample(model, DDPMScheduler(), (3, 2), num_inference_steps=10, method="picard",
               tol=1e-2, generator=gen())
    model.eval()   # deterministic: samples, and the diagnosis costs nothing
    x, sol = sample(model, DDPMScheduler(), (3, 2), num_inference_steps=10, method="picard",
                    tol=1e-2, generator=gen())
    assert sol.converged and sol.iterations <= 10


def test_the_wrappers_seen_through():
    wrapped = importlib.import_module("paraprop.diffusion.sample").wrapped_modules
    a, b = Mlp(), Mlp(seed=1)
    f = functools.partial(lambda m, x, t, other=None: m(x, t), a, other=b)
    found = [(name, module) for name, _, module in wrapped(f)]
    assert [n for n, _ in found] == ["model.args[0]", "model.keywords['other']"]
    assert found[0][1] is a and found[1][1] is b
    assert [n for n, _, _ in wrapped(a.forward)] == ["model"]
    assert wrapped(lambda x, t: x) == [] and wrapped(elementwise) == []


# -- 2. low precision: sequential is the loop ------------------------------------------------

LOW_CONFIGS = [
    ("ddpm", {"variance_type": "fixed_small_log", "prediction_type": "v_prediction"}, None,
     {}),
    ("ddpm", {"clip_sample_range": 1.5, "prediction_type": "sample"}, None, {}),
    ("ddim", {"prediction_type": "sample", "clip_sample": True}, 0.7,
     {"use_clipped_model_output": True}),
    ("ddim", {"set_alpha_to_one": False, "clip_sample": False}, 0.0, {}),
]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(("kind", "cfg", "eta", "kw"), LOW_CONFIGS,
                         ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_low_precision_sequential_rounds_as_the_loop(kind, cfg, eta, kw, dtype):
    """The old table cast every coefficient to the sample dtype: 0.03 away from the loop in
    bfloat16. A coefficient that divides is read at float32 precision on the CPU, one that
    multiplies is rounded to the sample dtype first."""
    make = DDPMScheduler if kind == "ddpm" else DDIMScheduler
    model = Mlp(seed=2).to(dtype)
    ref = loop(model, make(**cfg), (4, 2), 30, 3, dtype=dtype, eta=eta, **kw)
    ekw = {} if eta is None else {"eta": eta}
    x, _ = sample(model, make(**cfg), (4, 2), num_inference_steps=30, method="sequential",
                  generator=gen(3), **ekw, **kw)
    assert torch.equal(x, ref)
    # the cast of the old table is not the loop's arithmetic: one step shows it
    table = step_table(make(**cfg), 30, eta=eta or 0.0, **kw)
    xs = torch.randn(1, 64, generator=gen(1)).to(dtype)
    out = torch.randn(1, 64, generator=gen(2)).to(dtype)
    s = 5
    c = {k: getattr(table, k)[s].to(dtype) for k in ("sqrt_alpha", "sqrt_beta")}
    if table.prediction == "epsilon":
        cast_x0 = (xs - c["sqrt_beta"] * out) / c["sqrt_alpha"]
        x0 = (xs - c["sqrt_beta"] * out) / table.sqrt_alpha[s]
        assert not torch.equal(cast_x0, x0)


# -- 3. tol=0 is the loop's bits -------------------------------------------------------------

@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(("method", "opts"), PARALLEL, ids=lambda v: repr(v))
def test_tol_zero_in_low_precision_is_the_loop_bitwise(method, opts, dtype):
    """The old Picard map (x + cumsum of the increments) had a fixed point 0.14 away from the
    loop in bfloat16 and reported converged=True at tol=0."""
    N = 40
    ref = loop(elementwise, DDPMScheduler(), (8, 2), N, 0, dtype=dtype)
    x, sol = sample(elementwise, DDPMScheduler(), (8, 2), num_inference_steps=N, method=method,
                    tol=0, dtype=dtype, generator=gen(), **opts)
    assert sol.converged and torch.equal(x, ref)
    assert sol.stats["certificate"] == "bitwise" and sol.iterations <= N


@pytest.mark.parametrize("dtype", [torch.float32] + LOW, ids=str)
def test_tol_zero_with_a_matmul_model_is_the_loop_or_refused(dtype):
    """An MLP's batched matmuls may round apart from the loop's: then converged=False, never a
    silent rounding-level difference."""
    model = Mlp(seed=1).to(dtype)
    ref = loop(model, DDIMScheduler(), (5, 2), 30, 0, dtype=dtype, eta=0.0)
    for method in ("picard", "anderson", SlidingJacobi(7)):
        x, sol = sample(model, DDIMScheduler(), (5, 2), num_inference_steps=30, method=method,
                        tol=0, throw=False, generator=gen(), eta=0.0)
        if sol.converged:
            assert torch.equal(x, ref) and sol.stats["loop_bitwise"] is True
        else:
            assert sol.stats["loop_bitwise"] is False and sol.iterations <= 30
            with pytest.raises(paraprop.ConvergenceError, match="rounds differently"):
                sample(model, DDIMScheduler(), (5, 2), num_inference_steps=30, method=method,
                       tol=0, generator=gen(), eta=0.0)


# -- 4. tol > 0 and the rounding floor -------------------------------------------------------

@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(("method", "opts"), PARALLEL[:4], ids=lambda v: repr(v))
def test_tol_below_the_rounding_floor_runs_to_the_exact_result(method, opts, dtype):
    """tol=1e-3 is below one unit of bfloat16 (and of float16) at these values: no estimate can
    certify it, so the method runs to the loop's bits instead of reporting an estimate."""
    N = 40
    ref = loop(elementwise, DDPMScheduler(), (8, 2), N, 0, dtype=dtype)
    x, sol = sample(elementwise, DDPMScheduler(), (8, 2), num_inference_steps=N, method=method,
                    tol=1e-3, dtype=dtype, generator=gen(), **opts)
    assert sol.converged and torch.equal(x, ref)
    assert sol.stats["certificate"] == "bitwise" and not sol.stats["tol_resolvable"]


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_tol_is_certified_by_the_loops_bits(dtype):
    """bfloat16/float16: the gains of a step at the scale of its rounding cannot be measured
    (measured: secant gains of 0.5 where the differences grew 1.5x per step), so no estimate
    is taken at any tol: the loop's bits (every parallel method), or converged=False."""
    N, tol = 60, 0.5
    ref, rsol = sample(elementwise, DDPMScheduler(clip_sample=False), (8, 2),
                       num_inference_steps=N, method="sequential", dtype=dtype, generator=gen())
    for method in ("picard", "anderson", ("picard", 8)):
        opts = {"window": method[1]} if isinstance(method, tuple) else {}
        name = method[0] if isinstance(method, tuple) else method
        x, sol = sample(elementwise, DDPMScheduler(clip_sample=False), (8, 2),
                        num_inference_steps=N, method=name, tol=tol, dtype=dtype,
                        generator=gen(), **opts)
        assert sol.converged and not sol.stats["tol_resolvable"]
        assert sol.stats["certificate"] == "bitwise" and torch.equal(sol.value, rsol.value)
        assert sol.stats["error_estimate"] == 0 and sol.iterations <= N


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_floor_decides_between_an_estimate_and_the_exact_result(dtype):
    """The floor: 4 units of the dtype at the scale the trajectory may reach (twice the initial
    noise's, at least 4). Just below it no estimate is taken (the loop's bits); just above, an
    estimate that includes the floor carried along the chain."""
    floor = importlib.import_module("paraprop.diffusion.certificate").rounding_floor
    noise = draw_noise(step_table(DDPMScheduler(clip_sample=False), 40), (8, 2),
                       generator=gen(), dtype=dtype)
    floor0 = floor(dtype, max(4.0, 2 * float(noise[0].abs().max())))
    _, ref = sample(elementwise, DDPMScheduler(clip_sample=False), (8, 2),
                    num_inference_steps=40, method="sequential", noise=noise)
    below, above = 0.9 * floor0, 50 * floor0
    _, sol = sample(elementwise, DDPMScheduler(clip_sample=False), (8, 2),
                    num_inference_steps=40, method="anderson", tol=below, noise=noise)
    assert not sol.stats["tol_resolvable"] and sol.stats["certificate"] == "bitwise"
    assert torch.equal(sol.value, ref.value)
    _, sol = sample(elementwise, DDPMScheduler(clip_sample=False), (8, 2),
                    num_inference_steps=40, method="anderson", tol=above, noise=noise)
    assert sol.stats["tol_resolvable"] and sol.converged
    assert float((sol.value.double() - ref.value.double()).abs().max()) <= above
    if sol.stats["certificate"] == "estimate":
        assert sol.stats["rounding_floor"] >= floor(dtype, 1.0)
        assert sol.stats["error_estimate"] >= sol.stats["rounding_floor"]


class Mlp4(torch.nn.Module):
    """A random 4-feature MLP denoiser (samples ``(B, 2, 2)``) with large weights: its late
    steps expand differences several times each for ``prediction_type="sample"`` (the probe's
    model of finding 1)."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1, self.l2, self.l3 = (torch.nn.Linear(5, 24), torch.nn.Linear(24, 24),
                                     torch.nn.Linear(24, 4))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.6)
        self.requires_grad_(False)

    def forward(self, x, t):
        tt = torch.as_tensor(t).reshape(-1).expand(len(x)).to(x.device, x.dtype) / 1000
        h = torch.nn.functional.gelu(self.l1(torch.cat([x.reshape(len(x), 4), tt[:, None]], 1)))
        return self.l3(torch.sin(self.l2(h))).reshape(x.shape)


CERTIFICATE_GRID = [
    ("ddpm", {"prediction_type": "sample", "clip_sample": False}, None),
    ("ddpm", {"prediction_type": "sample", "variance_type": "fixed_large",
              "clip_sample": False}, None),
    ("ddpm", {"prediction_type": "sample", "variance_type": "fixed_large", "thresholding": True,
              "sample_max_value": 1.5, "dynamic_thresholding_ratio": 0.9,
              "clip_sample": False}, None),
    ("ddpm", {"prediction_type": "v_prediction", "clip_sample": False}, None),
    ("ddpm", {"variance_type": "fixed_small_log"}, None),
    ("ddim", {"prediction_type": "sample", "clip_sample": False}, 0.0),
    ("ddim", {"prediction_type": "v_prediction"}, 1.0),
]
# tolerances a user would ask for, per dtype
GRID_TOLS = {torch.float16: (0.05, 0.01), torch.bfloat16: (0.5,), torch.float32: (1e-3, 1e-5),
             torch.float64: (1e-3, 1e-8)}


@pytest.mark.parametrize("dtype", list(GRID_TOLS), ids=str)
@pytest.mark.parametrize(("kind", "cfg", "eta"), CERTIFICATE_GRID,
                         ids=lambda v: v if isinstance(v, str) else repr(v))
def test_a_converged_sample_is_within_tol_of_the_real_loop(kind, cfg, eta, dtype):
    """Finding 1 of the probe: float16, DDPM ``prediction_type="sample"``, Picard with a window
    of 8, ``tol=0.05`` gave converged=True 3.2 (64 tol) from the loop, thresholding and
    ``fixed_large`` up to 7 tol: the freeze estimate missed the growth of the late steps. Now
    every ``converged=True`` is within ``tol`` of the real diffusers loop, and the runs that
    converge are not rare."""
    N, shape = 24, (3, 2, 2)
    make = (lambda: DDPMScheduler(**cfg)) if kind == "ddpm" else (lambda: DDIMScheduler(**cfg))
    kw = {} if eta is None else {"eta": eta}
    model = Mlp4(seed=1).to(dtype)
    ref = loop(model, make(), shape, N, 3, dtype=dtype, **kw).double()
    converged = variance = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchVarianceWarning)
        for method, opts in (("picard", {"window": 8}), ("picard", {}), ("anderson", {})):
            for tol in GRID_TOLS[dtype]:
                x, sol = sample(model, make(), shape, num_inference_steps=N, method=method,
                                tol=tol, throw=False, generator=gen(3), **opts, **kw)
                assert sol.iterations <= N
                if sol.converged:
                    converged += 1
                    err = float((x.double() - ref).abs().max())
                    assert err <= tol, (method, opts, tol, err, sol.stats["error_estimate"])
                else:   # refused by name: the budget, or batch variance carried too far
                    assert re.search(r"budget of 24|rounds differently", sol.stats["reason"])
                    variance += "rounds differently" in sol.stats["reason"]
    # (float32 matmuls of 72 rows round apart from those of 3: carried through the expanding
    # late steps of sample prediction, that alone can exceed every tol here)
    assert converged >= 1 or variance == 6


def test_samples_settled_in_a_pass_keep_their_values_in_the_next():
    """float64 with a batch-variant MLP, Anderson, N=100: a later pass from a certified prefix
    of the samples left recomputed the settled ones (accepted on an estimate, their inputs not
    exact) in other rows, and the solver saw a position it held final change
    (NotTriangularError). Settled samples are left as they are."""
    model = Mlp4(seed=0).double()
    make = lambda: DDPMScheduler(prediction_type="sample", clip_sample=False)  # noqa: E731
    ref = loop(model, make(), (6, 2, 2), 100, 0, dtype=torch.float64)
    x, sol = sample(model, make(), (6, 2, 2), num_inference_steps=100, method="anderson",
                    tol=1e-3, throw=False, generator=gen(0))
    assert sol.stats["passes"] >= 2 and sol.iterations <= 100
    if sol.converged:
        assert float((x - ref).abs().max()) <= 1e-3
    else:       # the batch variance carried along the chain is named, never a wrong value
        assert sol.result is paraprop.Result.not_certified
        assert "rounds differently on the batched calls" in sol.stats["reason"]


def test_the_probes_float16_sample_prediction_case():
    """The probe's reproducer: converged=True at 3.2 from the loop with tol=0.05. In float16 no
    estimate is taken (the steps' gains at the scale of its rounding cannot be measured): the
    loop's bits, or converged=False with the budget named."""
    model = Mlp4().half()
    make = lambda: DDPMScheduler(prediction_type="sample", clip_sample=False)  # noqa: E731
    for seed in range(3):
        ref = loop(model, make(), (6, 2, 2), 40, seed, dtype=torch.float16)
        x, sol = sample(model, make(), (6, 2, 2), num_inference_steps=40, method="picard",
                        window=8, tol=0.05, throw=False, generator=gen(seed))
        assert not sol.stats["tol_resolvable"]
        if sol.converged:
            assert torch.equal(x, ref) and sol.stats["certificate"] == "bitwise"
        else:
            assert "budget of 40" in sol.stats["reason"]
            assert sol.stats["error_estimate"] == math.inf


def test_an_expanding_tail_in_float32_is_not_certified_by_an_estimate_it_cannot_carry():
    """float32, ``prediction_type="sample"`` with the expanding model: the old estimate stopped
    at 3.1e-3 from the loop for tol=1e-3 (Jacobi's contraction rule); the final check carries
    every defect through the observed gains of the steps after it."""
    model = Mlp4()
    make = lambda: DDPMScheduler(prediction_type="sample", variance_type="fixed_large",  # noqa
                                 clip_sample=False)
    for seed in range(2):
        ref = loop(model, make(), (6, 2, 2), 40, seed).double()
        x, sol = sample(model, make(), (6, 2, 2), num_inference_steps=40, method="picard",
                        tol=1e-3, throw=False, generator=gen(seed))
        if sol.converged:
            assert float((x.double() - ref).abs().max()) <= 1e-3
        else:   # refused with its reason, not certified on an estimate it cannot carry
            assert sol.result is paraprop.Result.not_certified and sol.stats["reason"]


# -- 5. non-finite values ----------------------------------------------------------------------

@pytest.mark.parametrize("method", ["picard", "anderson", Jacobi(), SlidingJacobi(5)], ids=repr)
@pytest.mark.parametrize("tol", [0.0, 0.5])
def test_float16_overflow_of_uncertified_iterates_is_repaired(method, tol):
    """eps = 3x: the loop stays below 1, but early Picard iterates overflow float16 (the old
    sampler raised NonFiniteError at iteration 5)."""
    model = lambda x, t: 3 * x  # noqa: E731
    N = 50
    ref = loop(model, DDPMScheduler(clip_sample=False), (4, 2), N, 0, dtype=torch.float16)
    x, sol = sample(model, DDPMScheduler(clip_sample=False), (4, 2), num_inference_steps=N,
                    method=method, tol=tol, dtype=torch.float16, generator=gen())
    assert sol.converged and bool(torch.isfinite(sol.value).all())
    assert float((x.float() - ref.float()).abs().max()) <= tol
    assert tol > 0 or torch.equal(x, ref)


@pytest.mark.parametrize("method", ["sequential", "picard", "anderson"])
def test_a_non_finite_step_from_exact_inputs_is_reported_by_step(method):
    """eps = -0.9x grows past float16's range at step 63: the loop gives inf there too."""
    with pytest.raises(paraprop.NonFiniteError, match=r"step 63 of sample 1 is not finite"):
        sample(lambda x, t: -0.9 * x, DDPMScheduler(clip_sample=False), (2, 2),
               num_inference_steps=200, method=method, tol=0, dtype=torch.float16,
               generator=gen())


def test_the_chain_keeps_a_non_finite_input_away_from_certified_positions():
    """A NaN planted at an uncertified position of the iterate reaches no position before it,
    and its successors get finite guesses instead of NaN."""
    from paraprop.diffusion import DiffusionChain

    N = 12
    table = step_table(DDPMScheduler(clip_sample=False), N)
    noise = draw_noise(table, (2, 2), generator=gen(), dtype=torch.float16)
    chain = DiffusionChain(elementwise, table, noise[0], noise[1:])
    _, ref = sample(elementwise, DDPMScheduler(clip_sample=False), (2, 2), noise=noise,
                    num_inference_steps=N, method="sequential")
    X = ref.value.reshape(2, N, 2).clone()
    X[:, 6] = float("nan")
    vals, _ = chain.window(X, 0, N)
    assert torch.equal(vals[:, :7], ref.value.reshape(2, N, 2)[:, :7])
    assert bool(torch.isfinite(vals).all())


def test_a_correction_that_cancels_does_not_certify_a_non_finite_value(monkeypatch):
    """Residuals of +1 and -1 cancel to a zero correction at position 3, whose input is still
    not certified: its non-finite direct step is an iterate's, repaired, not the loop's."""
    from paraprop.diffusion import DiffusionChain

    N = 4
    table = step_table(DDIMScheduler(clip_sample=False), N)
    noise = draw_noise(table, (1, 1), generator=gen())
    chain = DiffusionChain(elementwise, table, noise[0], noise[1:])
    X = torch.tensor([[[0.5], [1.0], [2.0], [3.0]]])
    y = torch.tensor([[[0.5], [2.0], [1.0], [float("inf")]]])   # r = 0, +1, -1
    monkeypatch.setattr(chain, "steps", lambda xin, a, b: y[:, a:b].clone())
    vals, _ = chain.window(X, 0, N)
    assert bool(torch.isfinite(vals).all())
    assert int(chain.certified()[0]) == 2 and int(chain.nonfinite_step[0]) == -1
    # the final check sees the repaired value as a defect (its direct step is not finite):
    # no estimate rests on it
    bounds = importlib.import_module("paraprop.diffusion.gains").bounds
    E, _, _ = bounds(vals, y, torch.tensor([2]), torch.ones(1, N, dtype=torch.float64),
                     torch.float32)
    assert math.isinf(float(E[0]))


# -- 6. the budget: no more sequential model calls than the loop ------------------------------

BUDGET_CASES = [  # (model, scheduler, N, window) that took up to 236 calls for 200 steps
    (lambda: Mlp(seed=1), lambda: DDPMScheduler(clip_sample=False), 200, 4),
    (lambda: Mlp(seed=2), lambda: DDPMScheduler(clip_sample=False), 50, 4),
    (lambda: (lambda x, t: -0.9 * x), lambda: DDPMScheduler(clip_sample=False), 200, 16),
    (lambda: Mlp(seed=0), lambda: DDPMScheduler(), 200, 128),
]


@pytest.mark.parametrize("case", range(len(BUDGET_CASES)))
@pytest.mark.parametrize("tol", [1e-2, 1e-3, 0.0])
def test_no_method_takes_more_model_calls_than_the_loop(case, tol):
    make_model, make_sch, N, window = BUDGET_CASES[case]
    model = make_model()
    dtype = torch.float64 if case == 2 else torch.float32
    _, ref = sample(model, make_sch(), (8, 2), num_inference_steps=N, method="sequential",
                    dtype=dtype, generator=gen(1))
    for method, opts in (("picard", {"window": window}), ("anderson", {}), (Jacobi(), {})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BatchVarianceWarning)
            x, sol = sample(model, make_sch(), (8, 2), num_inference_steps=N, method=method,
                            tol=tol, throw=False, dtype=dtype, generator=gen(1), **opts)
        assert sol.iterations == sol.stats["model_calls"] <= N, (method, sol.iterations)
        if sol.converged:
            err = float((sol.value - ref.value).abs().max())
            assert err <= tol if tol > 0 else torch.equal(sol.value, ref.value)
        else:
            assert "budget" in sol.stats["reason"] or "rounds differently" in \
                sol.stats["reason"]


@pytest.mark.parametrize("method", [paraprop.solvers.JacobiGS(block_size=4),
                                    paraprop.solvers.GSJacobi(block_size=5)], ids=repr)
def test_solvers_that_call_the_model_per_step_are_refused(method):
    """JacobiGS took 271 model calls in sequence for 30 steps; GSJacobi ran out of them."""
    with pytest.raises(ValueError, match=r"is not supported by diffusion\.sample: its iterations "
                                         r"make several model calls in sequence.*Jacobi\(\), "
                                         r"SlidingJacobi\(\)"):
        sample(elementwise, DDPMScheduler(), (4, 2), num_inference_steps=30, method=method,
               generator=gen())


@pytest.mark.parametrize("max_iters", [1, 5, 12])
def test_max_iters_caps_every_model_call(max_iters):
    for method in ("sequential", "picard", "anderson", SlidingJacobi(4)):
        x, sol = sample(elementwise, DDIMScheduler(), (3, 2), num_inference_steps=12,
                        method=method, tol=1e-3, max_iters=max_iters, throw=False,
                        generator=gen())
        assert sol.iterations <= max_iters
        assert sol.converged == (max_iters >= 12 or sol.converged)
    with pytest.raises(paraprop.ConvergenceError, match=r"max_iters=1\b.*the budget of 1"):
        sample(elementwise, DDIMScheduler(), (3, 2), num_inference_steps=12, method="picard",
               tol=1e-3, max_iters=1, generator=gen())


# -- 7. batch variance -----------------------------------------------------------------------

class BatchVariant(torch.nn.Module):
    """An eps whose rows depend on how many rows the call holds (as a batch-variant kernel's
    rounding does, here made large enough to matter)."""

    def __init__(self, rows, size):
        super().__init__()
        self.rows, self.size = rows, size

    def forward(self, x, t):
        out = elementwise(x, t)
        return out + self.size if x.shape[0] > self.rows else out


@pytest.mark.parametrize("method", ["picard", "anderson", SlidingJacobi(4)], ids=repr)
def test_batch_variance_refuses_tol_zero_and_warns_at_tol(method):
    model = BatchVariant(rows=3, size=1e-3)
    with pytest.raises(paraprop.ConvergenceError,
                       match=r"rounds differently on the batched calls \(\d+ rows\) than on "
                             r"the loop's \(3 rows\).*use method='sequential'"):
        sample(model, DDIMScheduler(), (3, 2), num_inference_steps=20, method=method, tol=0,
               generator=gen())
    x, sol = sample(model, DDIMScheduler(), (3, 2), num_inference_steps=20, method=method,
                    tol=0, throw=False, generator=gen())
    assert not sol.converged and sol.stats["loop_bitwise"] is False
    # found at the first batched call; one more call evaluates the loop's first step again
    # (the same rows give the same values: batch variance, not randomness)
    assert sol.iterations <= 4
    # a tol below float32's rounding floor could only be certified by the loop's bits, too
    _, sol = sample(model, DDIMScheduler(), (3, 2), num_inference_steps=20, method=method,
                    tol=1e-7, throw=False, generator=gen())
    assert not sol.stats["tol_resolvable"] and not sol.converged
    assert "rounding floor" in sol.stats["reason"]
    # above the floor, the estimate carries the measured difference at every step: 1e-3
    # through 20 steps exceeds tol=1e-2 (refused), and fits tol=0.1 (with a warning), where
    # the sample is within tol of the real loop's
    _, sol = sample(model, DDIMScheduler(), (3, 2), num_inference_steps=20, method=method,
                    tol=1e-2, throw=False, generator=gen())
    assert not sol.converged
    assert "carried along the chain" in sol.stats["reason"] or UNCHECKED in sol.stats["reason"]
    ref = loop(model, DDIMScheduler(), (3, 2), 20, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, sol = sample(model, DDIMScheduler(), (3, 2), num_inference_steps=20, method=method,
                        tol=0.1, throw=False, generator=gen())
    if within_tol_or_unchecked(x, sol, ref, 0.1):
        assert sol.stats["loop_bitwise"] is False and sol.stats["certificate"] == "estimate"
        assert any(issubclass(w.category, BatchVarianceWarning) and
                   "includes that difference at every step" in str(w.message) for w in caught)
    else:
        # picard and the sliding window take every call of the budget on this chain (no
        # faster than the loop) and the last step cannot be compared: refused by name;
        # anderson finishes in 14 and is certified
        assert method != "anderson"


class TailVariant(BatchVariant):
    """Rounds the last ``B`` rows of a call apart (as a kernel's tail block may), only in calls
    of more rows than the loop's: step 0 at the head of a batched call looks like the loop's."""

    def forward(self, x, t):
        out = elementwise(x, t)
        if x.shape[0] > self.rows:
            out = torch.cat([out[: -self.rows], out[-self.rows :] + self.size])
        return out


@pytest.mark.parametrize("method", ["picard", "anderson"], ids=repr)
def test_batch_variance_in_the_tail_rows_is_not_certified_bitwise(method):
    """Every other batched call holds the steps in reverse order, so step 0 (compared with the
    loop's first call) sits in the tail rows of the first batched call: the tail's rounding
    shows. (In the steps' order it sat at the head: tol=0 reported the loop's bits, 1e-3 off.)"""
    model = TailVariant(rows=3, size=1e-3)
    ref = loop(model, DDIMScheduler(), (3, 2), 20, 0)
    x, sol = sample(model, DDIMScheduler(), (3, 2), num_inference_steps=20, method=method,
                    tol=0, throw=False, generator=gen())
    assert not sol.converged and sol.stats["loop_bitwise"] is False
    assert not torch.equal(x, ref)



class LateVariant(BatchVariant):
    """Rounds apart, in calls of more rows than the loop's, every step but step 0 (whose
    timestep is the largest): the step-0 spot check sees the loop's values."""

    def forward(self, x, t):
        out = elementwise(x, t)
        if x.shape[0] > self.rows:
            out = out + self.size * (t != t.max()).to(x.dtype).reshape(-1, 1)
        return out


@pytest.mark.parametrize("method", ["picard", "anderson"], ids=repr)
def test_batch_variance_after_step_0_only_is_not_certified(method):
    """The loop's call of the last step (one model call of B rows, where the budget has it)
    sees what step 0's comparison cannot: tol=0 is refused naming the step (it was 'bitwise'
    0.0186 off before), and a certified tol > 0 is within tol."""
    model = LateVariant(rows=3, size=1e-3)
    ref = loop(model, DDIMScheduler(), (3, 2), 20, 0)
    for tol in (0, 1e-3, 1e-1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", paraprop.diffusion.BatchVarianceWarning)
            x, sol = sample(model, DDIMScheduler(), (3, 2), num_inference_steps=20,
                            method=method, tol=tol, throw=False, generator=gen())
        assert sol.stats["loop_bitwise"] is False
        assert sol.stats["model_calls"] <= 20
        if tol == 0:
            assert not sol.converged
            assert "its output for step 19 differs by 0.001" in sol.stats["reason"]
        if sol.converged:
            assert float((x - ref).abs().max()) <= tol, (tol, sol.stats["certificate"])


class OffsetMlp(torch.nn.Module):
    """The MLP denoiser with a constant offset in calls of more rows than the loop's: with
    ``prediction_type="sample"`` its last DDIM steps expand a constant offset (1.8-1.9x a step)
    where they shrink the iteration's own changes (0.35-0.46x): a step whose Jacobian is not
    normal, and a batch variance whose direction the iteration never observes."""

    def __init__(self, rows, size):
        super().__init__()
        self.m, self.rows, self.size = Mlp(), rows, size

    def forward(self, x, t):
        out = self.m(x, t)
        return out + self.size if x.shape[0] > self.rows else out


@pytest.mark.parametrize("size,tol", [(1e-4, 1e-3), (1e-3, 1e-2)])
@pytest.mark.parametrize("method", ["picard", SlidingJacobi(4), "anderson"], ids=repr)
def test_a_batch_variance_a_step_expands_is_carried_in_its_own_direction(method, size, tol):
    """The final check carries the batch variance through gains observed along the
    iteration's changes; this model's last steps expand the offset's direction 1.8x and shrink
    the iteration's 0.4x, so the bound was a third of the error: picard certified tol=1e-3
    with the sample 1.09e-3 from the loop (estimate 3.6e-4), and tol=1e-2 at 1.05e-2. The
    probe of the last window's steps in the batch variance's direction (one model call)
    observes the expansion: certified runs are within tol of the loop."""
    model = OffsetMlp(rows=3, size=size)
    sched = lambda: DDIMScheduler(clip_sample=False, prediction_type="sample")  # noqa: E731
    ref = loop(model, sched(), (3, 2), 50, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", paraprop.diffusion.BatchVarianceWarning)
        x, sol = sample(model, sched(), (3, 2), num_inference_steps=50, method=method,
                        tol=tol, throw=False, generator=gen())
    assert sol.stats["loop_bitwise"] is False and sol.stats["model_calls"] <= 50
    err = float((x.double() - ref.double()).abs().max())
    assert not sol.converged or err <= tol, (err, sol.stats["error_estimate"])
    if sol.converged:   # (probed: the last steps at least)
        a, b = sol.stats["batch_probed_steps"]
        assert b == 50 and 0 <= a < 49
    else:
        assert "carried along the chain" in sol.stats["reason"] or \
            UNCHECKED in sol.stats["reason"]


def test_the_gains_probe_is_made_only_for_a_batch_variance():
    """A batch-invariant model at tol > 0: no probe (no call spent), the same run as before."""
    x, sol = sample(elementwise, DDIMScheduler(clip_sample=False, prediction_type="sample"),
                    (3, 2), num_inference_steps=50, method="picard", tol=1e-3, generator=gen())
    assert sol.stats["loop_bitwise"] is True and sol.stats["batch_probed_steps"] is None


def test_step_gains_compare_records_a_gain_and_keeps_the_last_evaluations():
    g = paraprop.diffusion.gains.StepGains(1, 3, 1, torch.float64, torch.float64, "cpu")
    g.observe(torch.tensor([[[1.0], [1.0], [1.0]]]), torch.tensor([[[2.0], [3.0], [1.0]]]), 0, 3)
    g.observe(torch.tensor([[[2.0], [1.5]]]), torch.tensor([[[4.0], [3.5]]]), 0, 2)
    # a probe of step 1 from its last input 1.5 (output 3.5) to 1.75 (output 4.5): gain 4;
    # step 0's base is NaN (not at this input): skipped; step 2, never observed (one
    # evaluation), stays unbounded: one direction's secant does not bound it
    g.compare(torch.tensor([[[math.nan], [1.5], [1.0]]]), torch.tensor([[[4.0], [3.5], [1.0]]]),
              torch.tensor([[[2.5], [1.75], [1.5]]]), torch.tensor([[[9.0], [4.5], [1.1]]]),
              0, 3)
    gain = g.gain[0].tolist()
    assert [round(v, 6) for v in gain[:2]] == [2.0, 4.0] and math.isnan(gain[2])
    assert g.last_outputs[0, :, 0].tolist() == [4.0, 3.5, 1.0]
    assert g.last_inputs[0][0, :, 0].tolist() == [2.0, 1.5, 1.0]
    # a non-finite probe output: the step is unbounded
    g.compare(torch.tensor([[[2.0], [1.5], [1.0]]]), torch.tensor([[[4.0], [3.5], [1.0]]]),
              torch.tensor([[[2.5], [1.75], [1.5]]]), torch.tensor([[[math.inf], [4.5], [1.1]]]),
              0, 3)
    assert g.gain[0, 0] == math.inf


class GrowingVariant(BatchVariant):
    """Rounds apart by 1e-5 at step 0 and by ``size`` at every later step (a review's model):
    step 0's comparison sees a hundredth of it, the last step's spot check all of it."""

    def forward(self, x, t):
        out = elementwise(x, t)
        if x.shape[0] > self.rows:
            tt = torch.as_tensor(t).reshape(-1).expand(len(x))
            out = out + torch.where(tt == tt.max(), 1e-5, self.size).to(out.dtype)[:, None]
        return out


def test_the_gains_probe_leaves_the_last_step_check_its_call():
    """The probe of f05ed75 took the budget's last call, the last step's spot check did not
    run, and picard certified tol=1e-2 5.5x beyond it (only step 0's 1e-5 carried); the probe
    now leaves the final check a call (a run that needs every call of its budget is compared
    at step 0 only: the known gap docs/diffusion.md states)."""
    model = GrowingVariant(rows=3, size=1e-3)
    sched = lambda: DDIMScheduler(clip_sample=False)  # noqa: E731
    ref = loop(model, sched(), (3, 2), 15, 0)
    x, sol = sample(model, sched(), (3, 2), num_inference_steps=15, method="picard", tol=1e-2,
                    throw=False, generator=gen())
    assert sol.stats["model_calls"] <= 15
    assert not sol.converged or float((x - ref).abs().max()) <= 1e-2


class AltOffset(torch.nn.Module):
    """Mlp4 with an offset alternating in sign per feature in calls of more rows than the
    loop's (a review's model)."""

    def __init__(self, size):
        super().__init__()
        self.m, self.size = Mlp4(), size

    def forward(self, x, t):
        out = self.m(x, t)
        if x.shape[0] > 3:
            out = out + self.size * torch.tensor([[-1.0, 1.0], [-1.0, 1.0]])
        return out


def test_the_gains_probe_does_not_bound_a_step_the_iteration_never_observed():
    """A sliding window of 4, DDIM v_prediction, 50 steps: the last window's steps were never
    observed (unbounded: the old code refused); the probe of f05ed75 gave them one direction's
    secant (1.4-1.6) and certified tol=1e-2 6x beyond it. Now they stay unbounded."""
    model = AltOffset(1e-3)
    sched = lambda: DDIMScheduler(clip_sample=False, prediction_type="v_prediction")  # noqa: E731
    ref = loop(model, sched(), (3, 2, 2), 50, 0)
    for tol in (1e-2, 6e-2):
        x, sol = sample(model, sched(), (3, 2, 2), num_inference_steps=50, method="picard",
                        window=4, tol=tol, throw=False, generator=gen())
        assert not sol.converged or float((x - ref).abs().max()) <= tol, tol


def test_the_last_step_check_costs_one_call_and_keeps_the_loops_bits():
    """A batch-invariant model: the spot check of the last step agrees, and tol=0 is the
    loop's sample bit for bit."""
    ref = loop(elementwise, DDIMScheduler(), (3, 2), 20, 0)
    x, sol = sample(elementwise, DDIMScheduler(), (3, 2), num_inference_steps=20,
                    method="picard", tol=0, generator=gen())
    assert torch.equal(x, ref) and sol.stats["loop_bitwise"] is True
    assert sol.stats["batch_checked_steps"] == [0, 19]
    assert sol.stats["model_calls"] <= 20

def test_a_nondeterministic_model_is_caught_too():
    """A model in eval mode that draws random numbers: its step 0 differs between calls."""
    model = lambda x, t: elementwise(x, t) + 1e-3 * torch.rand_like(x)  # noqa: E731
    with pytest.raises(paraprop.StochasticModelError, match="not a fixed function"):
        sample(model, DDPMScheduler(), (2, 2), num_inference_steps=10, method="picard",
               tol=0, throw=False, generator=gen())


# -- 8. the model's output dtype ----------------------------------------------------------------

def test_a_model_output_of_another_dtype_is_refused():
    """The loop would promote a bfloat16 sample to float32 after the first step."""
    with pytest.raises(TypeError, match=r"model output has dtype torch\.float32, expected "
                                        r"torch\.bfloat16 .*pass dtype=torch\.float32"):
        sample(lambda x, t: elementwise(x, t).float(), DDIMScheduler(), (2, 2),
               num_inference_steps=4, method="picard", dtype=torch.bfloat16, generator=gen())


def test_math_of_the_floor():
    floor = importlib.import_module("paraprop.diffusion.certificate").rounding_floor
    assert floor(torch.bfloat16, 0.5) == 4 * 2 ** -7
    assert math.isclose(floor(torch.float32, 8.0), 4 * 8 * 2 ** -23)


# -- 9. the readers' schedulers (Euler, flow matching, LCM, DPM-Solver++ order 1) --------------

# diffusers' set_timesteps calls np.array on a torch tensor for the sigma schedulers
_NUMPY_COPY = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
READERS = [("euler", "EulerDiscreteScheduler", {}),
           ("ancestral", "EulerAncestralDiscreteScheduler", {}),
           ("flow", "FlowMatchEulerDiscreteScheduler", {"shift": 3.0}),
           ("flow-stochastic", "FlowMatchEulerDiscreteScheduler", {"stochastic_sampling": True}),
           ("lcm", "LCMScheduler", {}),
           ("sde1", "DPMSolverMultistepScheduler", {"solver_order": 1,
                                                   "algorithm_type": "sde-dpmsolver++"})]


def reader_loop(model, scheduler, N, seed, dtype=torch.float32):
    """A pipeline's loop with a reader's scheduler: init_noise_sigma, scale_model_input, one
    generator for the latents and every step's noise."""
    g = gen(seed)
    scheduler.set_timesteps(N)
    x = diffusers.utils.torch_utils.randn_tensor((3, 2), generator=g, dtype=dtype)
    init = getattr(scheduler, "init_noise_sigma", None)
    x = x * init if init is not None else x
    takes = "generator" in __import__("inspect").signature(scheduler.step).parameters
    with torch.no_grad():
        for t in scheduler.timesteps:
            inp = scheduler.scale_model_input(x, t) if hasattr(scheduler,
                                                                "scale_model_input") else x
            x = scheduler.step(model(inp, t), t, x,
                               **({"generator": g} if takes else {})).prev_sample
    return x


def _bitwise_or_refused(model, make, method, kw, ref):
    """tol=0 on 20 steps of a batch-variant model: the loop's bits, or converged=False with a
    reason; never more model calls than steps."""
    x, sol = sample(model, make(), (3, 2), num_inference_steps=20, method=method, tol=0,
                    throw=False, generator=gen(), **kw)
    assert sol.stats["model_calls"] <= 20
    if sol.converged:
        assert torch.equal(x, ref) and sol.stats["certificate"] == "bitwise"
    else:
        assert sol.stats["certificate"] is None and "reason" in sol.stats


def _variant_run(model, make, method, kw, tol):
    """A run at ``tol`` on 20 steps (its BatchVarianceWarning expected); never more calls."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchVarianceWarning)
        x, sol = sample(model, make(), (3, 2), num_inference_steps=20, method=method, tol=tol,
                        throw=False, generator=gen(), **kw)
    assert sol.stats["model_calls"] <= 20
    return x, sol


@_NUMPY_COPY
@pytest.mark.parametrize(("name", "cls", "cfg"), READERS, ids=[r[0] for r in READERS])
def test_readers_batch_variance_tol0_and_the_certificate(name, cls, cfg):
    """A model with torch.nn layers (its matmuls round a row by the batch it is in): at tol=0
    the loop's bits or converged=False, never a rounding-level difference called bitwise; at
    tol > 0, certified and within tol of the real diffusers loop; never more calls."""
    model = Mlp(scale=0.3)
    make = getattr(diffusers, cls)
    ref = reader_loop(model, make(**cfg), 20, 0)
    certified = 0
    for method, kw in PARALLEL:
        _bitwise_or_refused(model, lambda: make(**cfg), method, kw, ref)
        for tol in (1e-3, 1e-2):
            x, sol = _variant_run(model, lambda: make(**cfg), method, kw, tol)
            # certified within tol, or refused by name where the run took every call of the
            # budget (the last step's batch variance unknown)
            certified += within_tol_or_unchecked(x, sol, ref, tol)
    assert certified >= 2   # (the check above cannot pass vacuously)


# DPM-Solver++ 2M and SDE 3M, UniPC: steps that read the converted model outputs of the steps
# before them (the two-input certificate: every gain taken at least 1)
HISTORY_READERS = [("dpm2", "DPMSolverMultistepScheduler", {}),
                   ("dpm2-karras-v", "DPMSolverMultistepScheduler",
                    {"use_karras_sigmas": True, "prediction_type": "v_prediction"}),
                   ("sde3", "DPMSolverMultistepScheduler",
                    {"solver_order": 3, "algorithm_type": "sde-dpmsolver++"}),
                   ("unipc2", "UniPCMultistepScheduler", {}),
                   ("unipc3-karras", "UniPCMultistepScheduler",
                    {"solver_order": 3, "use_karras_sigmas": True})]


@_NUMPY_COPY
@pytest.mark.parametrize(("name", "cls", "cfg"), HISTORY_READERS,
                         ids=[r[0] for r in HISTORY_READERS])
def test_history_readers_batch_variance_and_the_certificate(name, cls, cfg):
    """The batch-variant MLP with DPM-Solver++ of order 2 and 3 and UniPC: tol=0 the loop's
    bits or converged=False; at tol > 0 a converged sample is within tol of the real diffusers loop,
    and a refusal names the batch variance carried along the chain (through 20 steps whose
    every gain is taken at least 1, and a sliding window whose exact stage leaves gains
    unobserved: an unbounded carry); at tol=1e-2 most methods are certified (so the check
    cannot pass vacuously)."""
    model = Mlp(scale=0.3)
    make = getattr(diffusers, cls)
    ref = reader_loop(model, make(**cfg), 20, 0)
    certified = {1e-3: 0, 1e-2: 0}
    unchecked = {1e-3: 0, 1e-2: 0}
    for method, kw in PARALLEL:
        _bitwise_or_refused(model, lambda: make(**cfg), method, kw, ref)
        for tol in (1e-3, 1e-2):
            x, sol = _variant_run(model, lambda: make(**cfg), method, kw, tol)
            if sol.converged:
                certified[tol] += 1
                assert float((x - ref).abs().max()) <= tol, (method, tol)
            elif UNCHECKED in sol.stats["reason"]:
                # (every call of the budget used: the later steps' batch variance unknown)
                unchecked[tol] += 1
                assert sol.stats["model_calls"] == 20
            else:
                assert "carried along the chain" in sol.stats["reason"]
    # (UniPC's chain of this model takes every call of the budget in every method)
    assert certified[1e-2] >= 4 or unchecked[1e-2] == len(PARALLEL)


@_NUMPY_COPY
def test_readers_stochastic_models_are_refused():
    """Train-mode dropout behind a closure up front; randomness inside a lambda at run time."""
    drop = Mlp(dropout=0.5).train()
    with pytest.raises(paraprop.StochasticModelError, match=r"call drop\.eval\(\) first"):
        sample(lambda x, t: drop(x, t), diffusers.EulerDiscreteScheduler(), (3, 2),
               num_inference_steps=6, method="picard", generator=gen())
    noisy = lambda x, t: elementwise(x, t) + 1e-3 * torch.rand_like(x)  # noqa: E731
    with pytest.raises(paraprop.StochasticModelError, match="not a fixed function"):
        sample(noisy, diffusers.FlowMatchEulerDiscreteScheduler(), (3, 2),
               num_inference_steps=10, method="picard", tol=0, throw=False, generator=gen())


@_NUMPY_COPY
@pytest.mark.parametrize("method", ["sequential", "picard", "anderson"])
def test_readers_a_nonfinite_step_is_named(method):
    """A model that returns inf below a timestep: the loop's own value, reported by step for
    every method (Picard iterates that overflow elsewhere are not reported)."""
    def model(x, t):
        t = torch.as_tensor(t).reshape(-1, 1).to(x.dtype)
        return torch.where(t < 400, torch.inf, elementwise(x, t.reshape(-1)))

    with pytest.raises(paraprop.NonFiniteError, match=r"step 6 of sample 0 is not finite"):
        sample(model, diffusers.FlowMatchEulerDiscreteScheduler(), (3, 2),
               num_inference_steps=10, method=method, tol=0, generator=gen())


@_NUMPY_COPY
def test_readers_a_model_output_of_another_dtype_is_refused():
    with pytest.raises(TypeError, match=r"model output has dtype torch\.float32, expected "
                                        r"torch\.bfloat16"):
        sample(lambda x, t: elementwise(x, t).float(), diffusers.EulerDiscreteScheduler(),
               (2, 2), num_inference_steps=4, method="picard", dtype=torch.bfloat16,
               generator=gen())


@pytest.mark.parametrize("case", ["ddpm-anderson", "ddim-picard", "dpm1-anderson"])
def test_no_batch_variance_is_found_where_there_is_none(case):
    """Models that compute each row on its own: the batch-variance spot check finds nothing,
    and the runs are certified. (It had compared a sample certified by an estimate at its
    values in the trajectory, which the loop's step from the step before need not give,
    after the loop's fallback had counted that sample, whose values it discards, as computed
    exactly: a defect read as batch variance, and the run not certified.)"""
    from diffusion_cases import RowEps

    model, shape, scheduler, steps, method, seed = {
        "ddpm-anderson": (elementwise, (8, 2), lambda: DDPMScheduler(clip_sample=False), 25,
                          "anderson", 0),
        "ddim-picard": (RowEps(), (3, 2), lambda: DDIMScheduler(clip_sample=False), 25,
                        "picard", 1),
        "dpm1-anderson": (elementwise, (8, 2),
                          lambda: diffusers.DPMSolverMultistepScheduler(solver_order=1), 50,
                          "anderson", 1)}[case]
    x, sol = sample(model, scheduler(), shape, num_inference_steps=steps, method=method,
                    tol=1e-4, generator=gen(seed))
    ref, _ = sample(model, scheduler(), shape, num_inference_steps=steps, method="sequential",
                    generator=gen(seed))
    assert sol.converged and sol.stats["loop_bitwise"] is True
    assert float((x.double() - ref.double()).abs().max()) <= 1e-4
