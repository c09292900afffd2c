"""paraprop.diffusion against diffusers' own loop (scheduler.step) and against its sequential
method; the accumulating chain; a map built to break Anderson; errors. (The UNet2DModel and the
two-process cases are in tests/test_diffusion.py.)"""

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler  # noqa: E402

import paraprop  # noqa: E402
from paraprop.diffusion import draw_noise, sample, step_table  # noqa: E402
from paraprop.solvers import Jacobi, SlidingJacobi, TriangularAnderson  # noqa: E402


class Eps(torch.nn.Module):
    """A small fixed MLP on flattened samples and the timestep; per-row or 0-d ``t``."""

    def __init__(self, features=2, seed=0, scale=1.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(features + 1, 16, generator=g) * 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(16, features, generator=g) * 0.5 * scale)
        self.requires_grad_(False)

    def forward(self, x, t, gain=None):
        t = torch.as_tensor(t, dtype=x.dtype).reshape(-1).expand(len(x)) / 1000
        h = torch.tanh(torch.cat([x.reshape(len(x), -1), t[:, None]], 1) @ self.w1.to(x.dtype))
        out = (h @ self.w2.to(x.dtype)).reshape(x.shape)
        if gain is not None:
            out = out * gain.reshape(-1, *([1] * (x.dim() - 1)))
        return out


def diffusers_loop(model, scheduler, shape, steps, seed, eta=None):
    kw = {} if eta is None else {"eta": eta}
    g = torch.Generator().manual_seed(seed)
    scheduler.set_timesteps(steps)
    x = torch.randn(shape, generator=g)
    for t in scheduler.timesteps:
        x = scheduler.step(model(x, t), t, x, generator=g, **kw).prev_sample
    return x


def gen(seed=1):
    return torch.Generator().manual_seed(seed)


CONFIGS = [
    ("ddpm", {}, None), ("ddpm", {"clip_sample": False}, None),
    ("ddpm", {"prediction_type": "v_prediction"}, None),
    ("ddpm", {"prediction_type": "sample"}, None),
    ("ddpm", {"variance_type": "fixed_large"}, None),
    ("ddpm", {"variance_type": "fixed_small_log"}, None),
    ("ddpm", {"timestep_spacing": "trailing"}, None),
    ("ddpm", {"thresholding": True}, None),
    ("ddim", {}, 0.0), ("ddim", {}, 0.5), ("ddim", {"clip_sample": False}, 1.0),
    ("ddim", {"prediction_type": "v_prediction"}, 0.5),
    ("ddim", {"prediction_type": "sample", "set_alpha_to_one": False}, 1.0),
    ("ddim", {"timestep_spacing": "trailing", "thresholding": True}, 0.0),
]


@pytest.mark.parametrize("steps", [1, 7, 50])
@pytest.mark.parametrize("kind,cfg,eta", CONFIGS, ids=lambda v: str(v))
def test_sequential_is_the_diffusers_loop_bitwise(kind, cfg, eta, steps):
    shape = (3, 1, 2, 2)
    model = Eps(features=4)
    make = DDPMScheduler if kind == "ddpm" else DDIMScheduler
    ref = diffusers_loop(model, make(**cfg), shape, steps, 5, eta)
    kw = {} if eta is None else {"eta": eta}
    x, sol = sample(model, make(**cfg), shape, num_inference_steps=steps, method="sequential",
                    generator=gen(5), **kw)
    assert torch.equal(x, ref)
    assert sol.converged and sol.stats["model_calls"] == steps
    # the same noise passed explicitly
    table = step_table(make(**cfg), steps, eta=eta or 0.0)
    noise = draw_noise(table, shape, generator=gen(5))
    y, _ = sample(model, make(**cfg), shape, num_inference_steps=steps, method="sequential",
                  noise=noise, **kw)
    assert torch.equal(y, ref)


def test_ddim_use_clipped_model_output_matches_the_loop():
    model, shape = Eps(), (4, 2)
    g = gen(2)
    s = DDIMScheduler()
    s.set_timesteps(10)
    ref = torch.randn(shape, generator=g)
    for t in s.timesteps:
        ref = s.step(model(ref, t), t, ref, eta=1.0, use_clipped_model_output=True,
                     generator=g).prev_sample
    x, _ = sample(model, DDIMScheduler(), shape, num_inference_steps=10, method="sequential",
                  eta=1.0, use_clipped_model_output=True, generator=gen(2))
    assert torch.equal(x, ref)


METHODS = [("picard", {}), ("picard", {"window": 1}), ("picard", {"window": 3}),
           ("picard", {"window": 30}), ("picard", {"window": 35}),
           ("anderson", {}), ("anderson", {"memory": 1}), ("anderson", {"memory": 5}),
           (Jacobi(), {}), (SlidingJacobi(8), {}), (TriangularAnderson(memory=2), {})]


@pytest.mark.parametrize("method,kw", METHODS, ids=lambda v: repr(v))
@pytest.mark.parametrize("kind,eta", [("ddpm", None), ("ddim", 0.0), ("ddim", 1.0)])
def test_every_method_is_sequential_within_tol_and_at_the_bound(method, kw, kind, eta):
    model, shape, steps = Eps().double(), (5, 2), 30
    make = (lambda: DDPMScheduler(clip_sample=False)) if kind == "ddpm" else \
        (lambda: DDIMScheduler(clip_sample=False))
    ekw = {} if eta is None else {"eta": eta}
    ref, rsol = sample(model, make(), shape, num_inference_steps=steps, method="sequential",
                       generator=gen(), dtype=torch.float64, **ekw)
    for tol, bound in ((1e-3, 1e-3), (0.0, 1e-10)):
        x, sol = sample(model, make(), shape, num_inference_steps=steps, method=method,
                        tol=tol, generator=gen(), dtype=torch.float64, **kw, **ekw)
        assert sol.converged
        assert float((x - ref).abs().max()) <= bound
        assert float((sol.value - rsol.value).abs().max()) <= max(bound, 1e-10)
        assert sol.iterations <= steps
        assert sol.value.shape == (5, steps, 2) and torch.equal(sol.value[:, -1], x)
        assert sol.stats["model_calls"] >= sol.iterations
        assert sol.stats["model_evaluations"] >= steps
        assert sol.stats["error_estimate"] <= tol or tol == 0


def test_per_sample_model_kwargs_and_stopping():
    model, steps = Eps().double(), 40
    gain = torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)
    sched = lambda: DDIMScheduler(clip_sample=False)  # noqa: E731
    table = step_table(sched(), steps)
    noise = draw_noise(table, (3, 2), generator=gen(4), dtype=torch.float64)
    x, sol = sample(model, sched(), (3, 2), num_inference_steps=steps, method="picard",
                    window=16, noise=noise, gain=gain, tol=1e-6)
    for b in range(3):
        xb, _ = sample(model, sched(), (1, 2), num_inference_steps=steps, method="sequential",
                       noise=noise[:, b : b + 1], gain=gain[b : b + 1])
        assert float((x[b] - xb[0]).abs().max()) <= 1e-6 * max(1.0, float(xb.abs().max()))
    ja, jsol = sample(model, sched(), (3, 2), num_inference_steps=steps, method=Jacobi(),
                      noise=noise, gain=gain, tol=1e-6)
    it = jsol.stats["sample_iterations"]
    assert int(it.min()) < int(it.max())   # each sample stopped on its own


def drift(x, t):
    """eps of a chain that accumulates: every step moves x by about the same small amount."""
    return torch.full_like(x, -0.5)


@pytest.mark.parametrize("method", ["picard", "anderson", Jacobi()], ids=repr)
def test_accumulating_chain_is_not_stopped_early(method):
    steps, tol = 100, 1e-2
    sched = lambda: DDIMScheduler(clip_sample=False)  # noqa: E731
    ref, _ = sample(drift, sched(), (2, 3), num_inference_steps=steps, method="sequential",
                    generator=gen(), dtype=torch.float64)
    start = draw_noise(step_table(sched(), steps), (2, 3), generator=gen(),
                       dtype=torch.float64)[0]
    assert float((ref - start).abs().max()) > 10 * tol    # the chain moves far in total
    x, sol = sample(drift, sched(), (2, 3), num_inference_steps=steps, method=method, tol=tol,
                    generator=gen(), dtype=torch.float64)
    assert sol.converged and float((x - ref).abs().max()) <= tol


def expanding(x, t):
    return -3.0 * x * torch.cos(t.to(x.dtype).reshape(-1, *([1] * (x.dim() - 1))))


@pytest.mark.parametrize("method", ["anderson", "picard"])
def test_map_built_to_break_the_extrapolation(method):
    steps = 25
    sched = lambda: DDPMScheduler(clip_sample=False)  # noqa: E731
    ref, _ = sample(expanding, sched(), (3, 2), num_inference_steps=steps, method="sequential",
                    generator=gen(), dtype=torch.float64)
    x, sol = sample(expanding, sched(), (3, 2), num_inference_steps=steps, method=method,
                    tol=1e-6, generator=gen(), dtype=torch.float64)
    assert sol.converged
    assert float((x - ref).abs().max()) <= 1e-6 * max(1.0, float(ref.abs().max()))
    with pytest.raises(paraprop.ConvergenceError, match="did not converge within max_iters=2"):
        sample(expanding, sched(), (3, 2), num_inference_steps=steps, method=method, tol=1e-9,
               max_iters=2, generator=gen(), dtype=torch.float64)
    _, bad = sample(expanding, sched(), (3, 2), num_inference_steps=steps, method=method,
                    tol=1e-9, max_iters=2, throw=False, generator=gen(), dtype=torch.float64)
    assert not bad.converged


def test_errors_name_the_argument():
    m, s = Eps(), DDIMScheduler
    with pytest.raises(NotImplementedError, match="DDPMScheduler, DDIMScheduler"):
        sample(m, EulerDiscreteScheduler(), (2, 2), num_inference_steps=3)
    with pytest.raises(NotImplementedError, match="variance_type='learned'"):
        sample(m, DDPMScheduler(variance_type="learned"), (2, 2), num_inference_steps=3)
    with pytest.raises(ValueError, match=r"= \(4, 2, 2\), got \(3, 2, 2\)"):
        sample(m, s(), (2, 2), num_inference_steps=3, noise=torch.zeros(3, 2, 2))
    with pytest.raises(ValueError, match="window must be a positive int or None, got 0"):
        sample(m, s(), (2, 2), num_inference_steps=3, window=0)
    with pytest.raises(ValueError, match=r"model output has shape \(6, 4\), expected \(6, 2\)"):
        sample(lambda x, t: torch.zeros(len(x), 4), s(), (2, 2), num_inference_steps=3)
    with pytest.raises(ValueError, match="eta is an option of DDIMScheduler"):
        sample(m, DDPMScheduler(), (2, 2), num_inference_steps=3, eta=0.5)
    with pytest.raises(ValueError, match="either noise or generator"):
        sample(m, s(), (2, 2), num_inference_steps=3, generator=gen(),
               noise=torch.zeros(4, 2, 2))
    with pytest.raises(ValueError, match="unknown method='newton'; choose one of sequential"):
        sample(m, s(), (2, 2), num_inference_steps=3, method="newton")
    with pytest.raises(ValueError, match="num_inference_steps must be a positive int"):
        sample(m, s(), (2, 2), num_inference_steps=0)
    with pytest.raises(ValueError, match="memory is an option of method='anderson'"):
        sample(m, s(), (2, 2), num_inference_steps=3, memory=3)
    with pytest.raises(ValueError, match="window is an option of 'picard'"):
        sample(m, s(), (2, 2), num_inference_steps=3, method="anderson", window=2)
    with pytest.raises(ValueError, match="shape must be a non-empty tuple"):
        sample(m, s(), (0, 2), num_inference_steps=3)
    with pytest.raises(ValueError, match="TriangularAnderson: memory must be a positive int"):
        TriangularAnderson(memory=0)
