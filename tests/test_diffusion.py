"""paraprop.diffusion: diffusers' DDPM/DDIM sampling loop as a triangular system over the steps.

The references: ``method="sequential"`` against the diffusers loop itself (``scheduler.step``, bit
for bit; every configuration and dtype: tests/test_diffusion_core.py), and every parallel method
against ``"sequential"``: within ``tol``, and at ``tol=0`` bit for bit, or ``converged=False``
where the model's batched calls round differently from the loop's (a batch-variant matmul). The
maps built to break a method: a chain whose every step moves less than ``tol`` (a
forward-difference rule stops at once, far from the answer), one that flips and triples its
input (Anderson's extrapolation is poor), and one that expands differences (the windowed freeze
rule's assumption fails). Every method stays within ``N`` sequential model calls.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch

import paraprop
from paraprop.diffusion import draw_noise, sample, step_table
from paraprop.solvers import Jacobi, SlidingJacobi, TriangularAnderson

diffusers = pytest.importorskip("diffusers")
DDPMScheduler = diffusers.DDPMScheduler
DDIMScheduler = diffusers.DDIMScheduler

# tiny ops: one intra-op thread (two threads on a loaded 2-core machine cost ~20 ms per matmul)
pytestmark = pytest.mark.usefixtures("one_thread")

D = torch.float64


def exact_or_refused(x, sol, ref, ref_traj=None):
    """The rule of ``tol=0``: the sequential result bit for bit, or ``converged=False`` because
    the model's batched calls round differently from the loop's (and nothing else)."""
    if sol.converged:
        assert torch.equal(x, ref)
        if ref_traj is not None:
            assert torch.equal(sol.value, ref_traj)
        assert sol.stats["certificate"] == "bitwise" and sol.stats["error_estimate"] == 0
        return True
    assert sol.stats["loop_bitwise"] is False
    assert "rounds differently on the batched calls" in sol.stats["reason"]
    return False


class TinyEps(torch.nn.Module):
    """A fixed random MLP ``eps(x, t)`` of width ``width`` (a "trained-looking" denoiser).

    ``t`` is a 0-d tensor (the diffusers loop) or a 1-D tensor of one timestep per row
    (paraprop); ``scale`` (optional) is a per-row tensor, ``shift`` a plain float: the model
    checks that paraprop repeated the first for every step of a window and passed the second as
    it is.
    """

    def __init__(self, features: int, width: int = 16, seed: int = 0, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(
            torch.randn(features + 1, width, generator=g, dtype=dtype) / math.sqrt(features + 1))
        self.w2 = torch.nn.Parameter(
            torch.randn(width, features, generator=g, dtype=dtype) * 0.5 / math.sqrt(width))
        self.requires_grad_(False)

    def forward(self, x, t, scale=None, shift=0.0):
        B = x.shape[0]
        t = torch.as_tensor(t)
        assert t.dim() == 0 or t.shape == (B,), (tuple(t.shape), B)
        tt = t.reshape(-1).expand(B).to(x.device, x.dtype) / 1000
        out = torch.tanh(torch.cat([x.reshape(B, -1), tt[:, None]], 1) @ self.w1) @ self.w2
        if scale is not None:
            assert scale.shape == (B,), (tuple(scale.shape), B)
            out = out * scale[:, None]
        assert isinstance(shift, float)
        return (out + shift).reshape(x.shape)


def linear_eps(c):
    """The analytic ``eps(x, t) = c * x``."""
    return lambda x, t: c * x


def diffusers_loop(model, scheduler, shape, N, seed, eta=None, **step_kwargs):
    """The loop of a diffusers pipeline, written here independently of paraprop."""
    g = torch.Generator().manual_seed(seed)
    scheduler.set_timesteps(N)
    x = torch.randn(shape, generator=g)
    extra = {} if eta is None else {"eta": eta}
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(model(x, t), t, x, generator=g, **extra, **step_kwargs).prev_sample
    return x


def _eta_kw(eta):
    return {} if eta is None else {"eta": eta}


def _err(a, b) -> float:
    return float((a - b).abs().max())


# -- 1. method="sequential" is the diffusers loop, bit for bit ---------------------------------

BASE = [("ddpm", None), ("ddim", 0.0), ("ddim", 0.5), ("ddim", 1.0)]


@pytest.mark.parametrize("N", [1, 7, 50])
@pytest.mark.parametrize(("kind", "eta"), BASE)
def test_sequential_is_the_diffusers_loop_bitwise(kind, eta, N):
    sch = DDPMScheduler() if kind == "ddpm" else DDIMScheduler()
    model = TinyEps(2)
    ref = diffusers_loop(model, sch, (4, 2), N, seed=3, eta=eta)
    x, sol = sample(model, sch, (4, 2), num_inference_steps=N, method="sequential",
                    generator=torch.Generator().manual_seed(3), **_eta_kw(eta))
    assert x.dtype == torch.float32
    assert torch.equal(x, ref)
    assert sol.converged and sol.iterations == N and sol.stats["certificate"] == "bitwise"
    assert sol.stats["model_calls"] == N and sol.stats["model_evaluations"] == N
    assert sol.stats["fallback_steps"] == N and sol.stats["passes"] == 0
    assert sol.value.shape == (4, N, 2) and torch.equal(sol.value[:, -1], x)


def test_use_clipped_model_output_changes_the_result():
    """The option reaches the step rule (else the bitwise test above could not tell)."""
    sch = DDIMScheduler(clip_sample=True)
    model = TinyEps(2)
    kw = {"num_inference_steps": 20, "method": "sequential", "eta": 0.5}
    a, _ = sample(model, sch, (4, 2), generator=torch.Generator().manual_seed(5), **kw)
    b, _ = sample(model, sch, (4, 2), generator=torch.Generator().manual_seed(5),
                  use_clipped_model_output=True, **kw)
    assert not torch.equal(a, b)


@pytest.mark.parametrize(("kind", "eta"), BASE)
def test_explicit_noise_is_the_generator_path(kind, eta):
    sch = DDPMScheduler() if kind == "ddpm" else DDIMScheduler()
    model = TinyEps(2)
    N, shape = 12, (4, 2)
    table = step_table(sch, N, eta=eta or 0.0)
    noise = draw_noise(table, shape, generator=torch.Generator().manual_seed(7))
    assert noise.shape == (N + 1, *shape) and noise.dtype == torch.float32
    # row 0 is the initial sample: the loop's first draw
    assert torch.equal(noise[0], torch.randn(shape, generator=torch.Generator().manual_seed(7)))
    silent = ~table.noisy
    assert bool((noise[1:][silent] == 0).all())      # steps that add no noise draw none
    if kind == "ddpm":                               # the last step (t = 0) adds none
        assert bool(silent[-1]) and int(table.timesteps[-1]) == 0
    if eta == 0.0:
        assert bool(silent.all())
    x_noise, _ = sample(model, sch, shape, num_inference_steps=N, method="sequential",
                        noise=noise, **_eta_kw(eta))
    x_gen, _ = sample(model, sch, shape, num_inference_steps=N, method="sequential",
                      generator=torch.Generator().manual_seed(7), **_eta_kw(eta))
    assert torch.equal(x_noise, x_gen)
    assert torch.equal(x_noise, diffusers_loop(model, sch, shape, N, seed=7, eta=eta))
    x_par, _ = sample(model, sch, shape, num_inference_steps=N, method="picard", noise=noise,
                      tol=1e-4, **_eta_kw(eta))
    assert _err(x_par, x_gen) <= 1e-4


# -- 2. every method is the sequential sample, within tol --------------------------------------

N_MAIN = 30
# (method, options); window "N" and "N+5" resolve against N_MAIN ("N+5" is clipped to N)
METHODS = [
    ("picard", {"window": 1}),
    ("picard", {"window": 3}),
    ("picard", {"window": "N"}),
    ("picard", {"window": "N+5"}),
    ("anderson", {"memory": 1}),
    ("anderson", {"memory": 3}),
    ("anderson", {"memory": 5}),
    (Jacobi(), {}),
    (SlidingJacobi(8), {}),
    (TriangularAnderson(memory=2), {}),
]
SCHEDULERS = [("ddpm", None), ("ddim", 0.0), ("ddim", 1.0)]


def _options(opts, N):
    out = dict(opts)
    if out.get("window") == "N":
        out["window"] = N
    elif out.get("window") == "N+5":
        out["window"] = N + 5
    return out


def _analytic_eps(x, t, scale=None, shift=0.0):
    """Elementwise only: each row's output does not depend on how many rows a call holds (no
    batch variance), so every method reaches the loop's bits at ``tol=0``."""
    tt = torch.as_tensor(t).reshape(-1, *([1] * (x.dim() - 1))).to(x.device, x.dtype) / 1000
    out = torch.tanh(1.5 * x + tt) * 0.8
    if scale is not None:
        assert scale.shape == (x.shape[0],), (tuple(scale.shape), x.shape[0])
        out = out * scale.reshape(-1, *([1] * (x.dim() - 1)))
    assert isinstance(shift, float)
    return out + shift


def _models():
    return {"mlp": TinyEps(2, width=32, seed=1, dtype=D), "linear": linear_eps(0.5),
            "analytic": _analytic_eps}


def _check_counters(method, opts, sol, N):
    """Every model call counts as a sequential step, the loop's first step, a verification
    and a fallback step included: never more than the loop's ``N``."""
    calls = sol.stats["model_calls"]
    assert calls == sol.iterations == sol.evaluations == sol.stats["sequential_steps"]
    assert calls <= N
    window = opts.get("window", 128)
    sliding = (method == "picard" and window < N) or isinstance(method, SlidingJacobi)
    w = (window if method == "picard" else min(method.window, N)) if sliding else N
    assert sol.stats["window"] == w
    # rows per call, in samples: 1 for a loop step, at most the window for a parallel call
    assert calls <= sol.stats["model_evaluations"] <= calls * w
    assert sol.stats["max_rows"] <= w * sol.value.shape[0]
    assert sol.stats["fallback_steps"] <= calls


@pytest.mark.parametrize(("kind", "eta"), SCHEDULERS)
@pytest.mark.parametrize("model_name", ["mlp", "linear", "analytic"])
@pytest.mark.parametrize(("method", "opts"), METHODS, ids=lambda v: repr(v))
def test_every_method_is_the_sequential_sample(method, opts, model_name, kind, eta):
    N, shape = N_MAIN, (4, 2)
    model = _models()[model_name]
    sch = DDPMScheduler() if kind == "ddpm" else DDIMScheduler()
    opts = _options(opts, N)
    common = {"num_inference_steps": N, "dtype": D, **_eta_kw(eta)}
    ref, rsol = sample(model, sch, shape, method="sequential",
                       generator=torch.Generator().manual_seed(2), **common)
    for tol in (1e-2, 1e-3, 0.0):
        x, sol = sample(model, sch, shape, method=method, tol=tol, throw=False,
                        generator=torch.Generator().manual_seed(2), **opts, **common)
        assert x.dtype == D
        assert sol.value.shape == (4, N, 2) and torch.equal(sol.value[:, -1], x)
        _check_counters(method, opts, sol, N)
        if tol > 0:
            assert sol.converged
            assert _err(sol.value, rsol.value) <= tol, (tol, sol.iterations)
            assert sol.stats["error_estimate"] <= tol
        else:
            exact = exact_or_refused(x, sol, ref, rsol.value)
            assert exact or model_name == "mlp"   # elementwise models have no batch variance
        if method == "picard" and opts["window"] == 1:   # one step per call: the loop itself
            assert sol.iterations == N


@pytest.mark.parametrize(("method", "opts"), METHODS, ids=lambda v: repr(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_at_tol_zero_is_the_loop_bitwise(method, opts, dtype, device):
    """bfloat16 and float16 as GPU users run them: at ``tol=0`` the loop's bits (the residual
    form of the Picard map has the loop's trajectory as its fixed point)."""
    N = 12
    sch = DDIMScheduler()
    kw = {"num_inference_steps": N, "eta": 1.0, "dtype": dtype, "device": device}
    ref, rsol = sample(_analytic_eps, sch, (4, 2), method="sequential",
                       generator=torch.Generator().manual_seed(4), **kw)
    x, sol = sample(_analytic_eps, sch, (4, 2), method=method, tol=0,
                    generator=torch.Generator().manual_seed(4), **_options(opts, N), **kw)
    assert sol.converged and x.dtype == dtype and x.device.type == device.type
    assert torch.equal(sol.value, rsol.value)
    assert sol.stats["loop_bitwise"] in (True, None) and sol.iterations <= N


def test_window_larger_than_n_is_clipped():
    x, sol = sample(linear_eps(0.5), DDIMScheduler(), (2, 2), num_inference_steps=7,
                    method="picard", window=12, generator=torch.Generator().manual_seed(0))
    assert sol.stats["window"] == 7
    assert sol.stats["model_evaluations"] <= 7 * sol.iterations


def test_anderson_needs_no_more_iterations_than_picard_on_a_trained_looking_model():
    """ParaTAA's point: the extrapolation saves iterations over plain Picard (full window)."""
    model = TinyEps(2, width=32, seed=1, dtype=D)
    kw = {"num_inference_steps": 50, "tol": 1e-3, "dtype": D, "eta": 0.0}
    _, picard = sample(model, DDIMScheduler(clip_sample=False), (4, 2), method=Jacobi(),
                       generator=torch.Generator().manual_seed(0), **kw)
    _, anderson = sample(model, DDIMScheduler(clip_sample=False), (4, 2), method="anderson",
                         generator=torch.Generator().manual_seed(0), **kw)
    assert anderson.iterations <= picard.iterations < 50


PER_SAMPLE = [("picard", {"window": 6}), ("anderson", {}), (Jacobi(), {})]


@pytest.mark.parametrize(("method", "opts"), PER_SAMPLE, ids=lambda v: repr(v))
def test_samples_with_their_own_kwargs_match_each_sample_alone(method, opts):
    """Per-sample stopping: a batch whose samples differ (a per-sample ``scale``, repeated by
    paraprop for every step of a window) gives each sample's own result."""
    N, B = 25, 4
    sch = DDIMScheduler(clip_sample=False)
    scale = torch.tensor([0.0, 1.0, 10.0, 0.5], dtype=D)
    noise = draw_noise(step_table(sch, N, eta=0.0), (B, 2),
                       generator=torch.Generator().manual_seed(9), dtype=D)
    common = {"num_inference_steps": N, "eta": 0.0, "shift": 0.1}
    for model, tol in ((TinyEps(2, dtype=D), 1e-3), (_analytic_eps, 1e-3), (_analytic_eps, 0.0)):
        x, sol = sample(model, sch, (B, 2), method=method, noise=noise, tol=tol, scale=scale,
                        **opts, **common)
        assert sol.converged
        its = sol.stats["sample_iterations"]
        assert its.shape == (B,) and int(its.max()) <= sol.iterations
        if tol > 0 and method != "picard":   # each sample stopped on its own (the sliding
            assert int(its.min()) < int(its.max())  # window's samples share one window)
        for b in range(B):
            one = {"noise": noise[:, b : b + 1], "scale": scale[b : b + 1]}
            ref, _ = sample(model, sch, (1, 2), method="sequential", **one, **common)
            alone, _ = sample(model, sch, (1, 2), method=method, tol=tol, **one, **opts,
                              **common)
            if tol > 0:
                assert _err(x[b], ref[0]) <= tol and _err(alone[0], ref[0]) <= tol, b
            else:
                assert torch.equal(x[b], ref[0]) and torch.equal(alone[0], ref[0]), b


def test_callback_sees_the_trajectory():
    seen = []
    x, sol = sample(linear_eps(0.5), DDIMScheduler(), (3, 2), num_inference_steps=10,
                    method="anderson", tol=1e-4, generator=torch.Generator().manual_seed(0),
                    callback=lambda k, v, r: seen.append((k, tuple(v.shape), r)))
    # one call per parallel iteration; the loop's first step is a model call, not an iteration
    assert [k for k, _, _ in seen] == list(range(1, len(sol.residuals) + 1))
    assert len(seen) < sol.iterations <= 10
    assert all(shape == (3, 10, 2) for _, shape, _ in seen)
    assert [r for _, _, r in seen] == sol.residuals.tolist()


# -- 3. maps built to break a stopping rule -----------------------------------------------------

class SlowDrift:
    """``eps(x, t) = sqrt(1 - abar_t) x + delta sqrt(abar_t)``: the exact eps of unit Gaussian
    data (under which DDIM with eta=0 barely moves x) plus a bias that makes x drift slowly.
    Every step moves by ~0.01; together they move by ~0.5."""

    def __init__(self, scheduler, delta=0.3):
        self.abar = scheduler.alphas_cumprod.to(D)
        self.delta = delta

    def __call__(self, x, t):
        a = self.abar[torch.as_tensor(t).reshape(-1)].to(x.dtype)
        a = a.reshape(-1, *([1] * (x.dim() - 1)))
        return (1 - a).sqrt() * x + self.delta * a.sqrt()


ALL_METHODS = [("sequential", {})] + METHODS


@pytest.mark.parametrize(("method", "opts"), ALL_METHODS, ids=lambda v: repr(v))
def test_accumulating_chain_does_not_stop_early(method, opts):
    N, tol = 100, 2e-2
    sch = DDIMScheduler(clip_sample=False)
    model = SlowDrift(sch)
    opts = _options(opts, N)
    common = {"num_inference_steps": N, "dtype": D, "eta": 0.0}
    ref, seq = sample(model, sch, (4, 2), method="sequential",
                      generator=torch.Generator().manual_seed(0), **common)
    x_init = torch.randn((4, 2), generator=torch.Generator().manual_seed(0), dtype=D)
    traj = torch.cat([x_init[:, None], seq.value], dim=1)
    # the chain this test needs: every step is below tol, the whole run far above it
    assert float((traj[:, 1:] - traj[:, :-1]).abs().max()) < tol
    assert _err(ref, x_init) > 20 * tol

    x, sol = sample(model, sch, (4, 2), method=method, tol=tol,
                    generator=torch.Generator().manual_seed(0), **opts, **common)
    assert sol.converged and _err(x, ref) <= tol
    window = opts.get("window") or (method.window if isinstance(method, SlidingJacobi) else None)
    if window is not None and window < N:
        # the first sweep moved less than tol, yet the run went on: each sweep certifies at
        # most its own window, so it takes ceil(N / window) of them
        assert sol.residuals[0] < tol
        assert sol.iterations >= math.ceil(N / window)

    # cut short: converged only where the value is within tol
    if method != "sequential":
        x3, sol3 = sample(model, sch, (4, 2), method=method, tol=tol, max_iters=3,
                          throw=False, generator=torch.Generator().manual_seed(0), **opts,
                          **common)
        if sol3.converged:
            assert _err(x3, ref) <= tol
        if window is not None and window < N:
            assert not sol3.converged and _err(x3, ref) > tol


def flip_eps(x, t):
    """``eps(x, t) = -3 x``: a large Lipschitz constant with a sign flip."""
    return -3 * x


ANDERSON = [("anderson", {"memory": 1}), ("anderson", {"memory": 3}),
            ("anderson", {"memory": 5}), (TriangularAnderson(memory=2), {}), (Jacobi(), {})]


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize(("method", "opts"), ANDERSON, ids=lambda v: repr(v))
def test_a_map_that_defeats_the_extrapolation(method, opts, clip):
    """With ``clip_sample=False`` the chain grows to ~1e8 (rounding there is ~1e-8 absolute)."""
    N = 40
    sch = DDIMScheduler(clip_sample=clip)
    common = {"num_inference_steps": N, "dtype": D, "eta": 0.0}
    ref, _ = sample(flip_eps, sch, (4, 2), method="sequential",
                    generator=torch.Generator().manual_seed(1), **common)
    for tol in (1e-1, 1e-3, 0.0):
        x, sol = sample(flip_eps, sch, (4, 2), method=method, tol=tol, throw=False,
                        generator=torch.Generator().manual_seed(1), **opts, **common)
        assert sol.converged and sol.iterations <= N
        assert _err(x, ref) <= tol, (tol, _err(x, ref), sol.iterations)
        assert tol > 0 or torch.equal(x, ref)
    with pytest.raises(paraprop.ConvergenceError, match="did not converge within max_iters=3"):
        sample(flip_eps, sch, (4, 2), method=method, tol=1e-3, max_iters=3,
               generator=torch.Generator().manual_seed(1), **opts, **common)
    x, sol = sample(flip_eps, sch, (4, 2), method=method, tol=1e-3, max_iters=3, throw=False,
                    generator=torch.Generator().manual_seed(1), **opts, **common)
    assert not sol.converged and sol.iterations <= 3
    assert _err(x, ref) > 1e-3 and sol.stats["error_estimate"] == math.inf


def _expanding_chain(method, tol):
    """eps = -0.9 x on DDPM 200 steps (float64): the chain expands differences by ~8e6."""
    sch = DDPMScheduler(clip_sample=False)
    common = {"num_inference_steps": 200, "dtype": D}
    model = linear_eps(-0.9)
    ref, _ = sample(model, sch, (4, 2), method="sequential",
                    generator=torch.Generator().manual_seed(0), **common)
    opts = {}
    if isinstance(method, tuple):
        method, opts = method[0], {"window": method[1]}
    x, sol = sample(model, sch, (4, 2), method=method, tol=tol, throw=False,
                    generator=torch.Generator().manual_seed(0), **opts, **common)
    return ref, x, sol


def test_picard_on_an_expanding_chain_is_within_tol_and_the_budget():
    """The chain expands differences by about 8e6: each freeze of the sliding window is budgeted
    after the growth observed so far, and carried to the end through the growth after it; all
    within the loop's N = 200 model calls."""
    tol = 1e-2
    for window in (128, 16):
        ref, x, sol = _expanding_chain(("picard", window), tol)
        assert sol.converged and _err(x, ref) <= tol, (window, sol.iterations, _err(x, ref))
        assert sol.stats["certificate"] == "estimate" and sol.stats["error_estimate"] <= tol
        assert sol.iterations <= 200


def test_expanding_chain_methods_with_an_error_estimate_stay_within_tol():
    """The same chain: the contraction rule (Jacobi) and Anderson's finish bound the error;
    at tol=0 the loop's bits (a linear eps has no batch variance)."""
    tol = 1e-2
    for method in ("anderson", Jacobi()):
        ref, x, sol = _expanding_chain(method, tol)
        assert sol.converged and _err(x, ref) <= tol, (repr(method), _err(x, ref))
        assert sol.iterations <= 200
    ref, x, sol = _expanding_chain("picard", 0)
    assert sol.converged and torch.equal(x, ref) and sol.iterations <= 200


# -- 4. several processes ------------------------------------------------------------------------

# (model, method, options, scheduler); B = 3 rows per step: the ranks' shares are uneven
DIST_CASES = [
    ("analytic", "picard", {"window": 5}, "ddpm"),
    ("analytic", "anderson", {}, "ddim"),
    ("analytic", "sequential", {}, "ddim"),
    ("mlp", "picard", {}, "ddim"),
    ("mlp", "anderson", {"memory": 2}, "ddpm"),
    ("analytic", "picard", {"window": 5}, "flow"),   # a Markov reader (scale_model_input none)
    ("analytic", "anderson", {}, "euler"),          # a Markov reader with scale_model_input
    ("analytic", "sequential", {}, "dpm2"),         # a reader with history: the loop
]
SCHEDULERS = {"ddpm": lambda: DDPMScheduler(), "ddim": lambda: DDIMScheduler(clip_sample=False),
              "flow": lambda: diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
              "euler": lambda: diffusers.EulerDiscreteScheduler(),
              "dpm2": lambda: diffusers.DPMSolverMultistepScheduler()}


def _dist_sample(rank, shard, cases):
    """One run per case; plain Python results (tensors do not travel through the queue)."""
    out = []
    for model_name, method, opts, kind in cases:
        torch.manual_seed(0)
        model = TinyEps(2, seed=3, dtype=D) if model_name == "mlp" else _analytic_eps
        sch = SCHEDULERS[kind]()
        x, sol = sample(model, sch, (3, 2), num_inference_steps=20, method=method, tol=1e-4,
                        shard=shard, dtype=D, generator=torch.Generator().manual_seed(1),
                        scale=torch.tensor([0.5, 1.0, 2.0], dtype=D),
                        **({"eta": 1.0} if kind == "ddim" else {}), **opts)
        out.append({"x": x.tolist(), "iterations": sol.iterations,
                    "calls": sol.stats["model_calls"], "converged": sol.converged})
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings(   # (diffusers' set_timesteps under NumPy 2: Euler, DPM-Solver)
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_sharded_sampling_is_the_one_process_result():
    from paraprop.distributed import spawn

    ranks = spawn(_dist_sample, 2, True, DIST_CASES, timeout=120, threads=1)
    one = _dist_sample(0, None, DIST_CASES)
    assert ranks[0] == ranks[1]          # every rank returns the same result
    for case, got, ref in zip(DIST_CASES, ranks[0], one, strict=True):
        assert got["converged"] and got["iterations"] == ref["iterations"], case
        assert got["calls"] == ref["calls"], case
        if case[0] == "analytic":   # elementwise: the same bits in any share of rows
            assert got["x"] == ref["x"], case
        else:  # the ranks' matmuls hold fewer rows than one process's: BLAS may round apart
            err = max(abs(a - b) for ra, rb in zip(got["x"], ref["x"], strict=True)
                      for a, b in zip(ra, rb, strict=True))
            assert err <= 1e-12, case


def test_shard_without_a_process_group_names_torch_distributed():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        sample(linear_eps(0.5), DDIMScheduler(), (2, 2), num_inference_steps=5, shard=True,
               generator=torch.Generator().manual_seed(0))


# -- 5. clear errors ---------------------------------------------------------------------------

def _call(**kw):
    args = {"model": linear_eps(0.5), "scheduler": DDIMScheduler(), "shape": (2, 2),
            "num_inference_steps": 5}
    args.update(kw)
    return sample(args.pop("model"), args.pop("scheduler"), args.pop("shape"), **args)


@pytest.mark.parametrize("scheduler", [diffusers.PNDMScheduler(), object()],
                         ids=["pndm", "object"])
def test_unsupported_scheduler_names_the_supported_ones(scheduler):
    with pytest.raises(NotImplementedError, match=r"DDPMScheduler, DDIMScheduler"):
        _call(scheduler=scheduler)


def test_learned_variance_is_refused():
    with pytest.raises(NotImplementedError, match=r"variance_type='learned' is not supported"):
        _call(scheduler=DDPMScheduler(variance_type="learned"))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"noise": torch.zeros(5, 2, 2)}, ValueError,
     r"noise must have shape .* = \(6, 2, 2\), got \(5, 2, 2\)"),
    ({"noise": torch.zeros(6, 3, 2)}, ValueError, r"\(6, 2, 2\), got \(6, 3, 2\)"),
    ({"window": 0}, ValueError, r"window must be a positive int or None, got 0"),
    ({"method": "anderson", "window": 4}, ValueError,
     r"window is an option of 'picard', not of method='anderson', got window=4"),
    ({"method": "sequential", "window": 4}, ValueError, r"window is an option of"),
    ({"method": "picard", "memory": 2}, ValueError,
     r"memory is an option of method='anderson', not of method='picard'"),
    ({"method": "newton"}, ValueError,
     r"unknown method='newton'; choose one of sequential, picard, anderson"),
    ({"method": SlidingJacobi(4), "window": 4}, ValueError, r"a solver object carries its own"),
    ({"num_inference_steps": 0}, ValueError, r"num_inference_steps must be a positive int"),
    ({"noise": torch.zeros(6, 2, 2), "generator": torch.Generator()}, ValueError,
     r"pass either noise or generator, not both"),
    ({"scheduler": DDPMScheduler(), "eta": 0.5}, ValueError, r"eta is an option of DDIMScheduler"),
    ({"scheduler": DDPMScheduler(), "eta": 0.0}, ValueError, r"eta is an option of DDIMScheduler"),
    ({"eta": -1.0}, ValueError, r"eta must be"),
    ({"tol": -1}, ValueError, r"tol must be"),
    ({"shape": (0, 2)}, ValueError, r"shape must be a non-empty tuple of positive ints"),
    ({"model": lambda x, t: x[:, :1], "method": "sequential"}, ValueError,
     r"model output has shape \(2, 1\), expected \(2, 2\)"),
    ({"model": lambda x, t: [x]}, TypeError, r"model must return a tensor"),
    ({"generator": 3}, TypeError, r"generator must be a torch.Generator"),
], ids=lambda v: None)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        _call(**kwargs)


def test_wrong_model_output_shape_in_a_window_names_both_shapes():
    def model(x, t):
        return x[:1] if x.shape[0] > 2 else x      # wrong only for a batched window

    with pytest.raises(ValueError, match=r"model output has shape \(1, 2\), expected \(6, 2\)"):
        _call(model=model, method="picard", window=3, generator=torch.Generator().manual_seed(0))


# -- 6. a diffusers UNet ------------------------------------------------------------------------

def tiny_unet(dropout=0.0):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        unet = diffusers.UNet2DModel(
            sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16),
            layers_per_block=1, norm_num_groups=4, dropout=dropout,
            down_block_types=("DownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "UpBlock2D"))
    return unet.requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("kind", "eta"), [("ddim", 0.0), ("ddpm", None)])
def test_unet2d_model(kind, eta, dtype, device):
    """A diffusers UNet2DModel as it is (its output's ``.sample`` is taken): sequential is the
    loop's bits; at tol=0 the parallel methods give them too, or refuse where the UNet's
    kernels round a batch of rows differently (the float32 convolutions on this CPU)."""
    unet = tiny_unet().eval().to(device, dtype)
    sch = DDPMScheduler() if kind == "ddpm" else DDIMScheduler()
    N, shape = 10, (2, 1, 8, 8)
    g = torch.Generator().manual_seed(0)
    sch.set_timesteps(N)
    ref = diffusers.utils.torch_utils.randn_tensor(shape, generator=g, device=device,
                                                   dtype=dtype)
    with torch.no_grad():
        for t in sch.timesteps:
            ref = sch.step(unet(ref, t).sample, t, ref, generator=g, **_eta_kw(eta)).prev_sample
    x, sol = sample(unet, sch, shape, num_inference_steps=N, method="sequential",
                    generator=torch.Generator().manual_seed(0), **_eta_kw(eta))
    assert torch.equal(x, ref)     # bitwise: the same batch, a 0-d t broadcast by the UNet
    xe, sole = sample(unet, sch, shape, num_inference_steps=N, method="picard", tol=0,
                      throw=False, generator=torch.Generator().manual_seed(0), **_eta_kw(eta))
    exact_or_refused(xe, sole, ref)
    assert sole.iterations <= N
    tol = 1e-3 if dtype == torch.float32 else 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", paraprop.diffusion.BatchVarianceWarning)
        xp, solp = sample(unet, sch, shape, num_inference_steps=N, method="picard", tol=tol,
                          throw=False, generator=torch.Generator().manual_seed(0),
                          **_eta_kw(eta))
    assert solp.iterations <= N and solp.value.shape == (2, N, 1, 8, 8)
    # certified within tol; or, where the float32 convolutions round a batch apart and the
    # untrained UNet's chain took every call of the budget, refused by name
    from diffusion_cases import within_tol_or_unchecked
    assert within_tol_or_unchecked(xp, solp, ref, tol) or dtype == torch.float32


def test_the_solution_and_its_refusal_name_the_method_the_caller_named():
    """``method="picard"`` runs Jacobi (a window holding every step) or sliding Jacobi; the
    Solution and a refusal name ``picard``, as the caller did (the first GPU run's refusal said
    method='jacobi'). A solver object keeps its own name."""
    from paraprop.solvers import SlidingJacobi

    model = TinyEps(2)
    run = functools.partial(sample, model, DDIMScheduler(), (3, 2), num_inference_steps=6,
                            generator=torch.Generator().manual_seed(0))
    for method, window in [("picard", None), ("picard", 2), ("anderson", None)]:
        _, sol = run(method=method, window=window, tol=1e-3, throw=False)
        assert sol.method == method
    _, sol = run(method=SlidingJacobi(3), tol=1e-3, throw=False)
    assert sol.method == "sliding_jacobi"
    with pytest.raises(paraprop.ConvergenceError, match="method='picard'"):
        run(method="picard", window=2, tol=0, max_iters=2)
