"""paraprop.diffusion's core against diffusers itself: ``method="sequential"`` is the diffusers
loop bit for bit in float64, float32, bfloat16 and float16 (every scheduler configuration, on
every device), the step table applies ``scheduler.step``'s operations in its precision, the
Picard map's fixed point is the sequential trajectory bit for bit, and the noise is drawn as
diffusers draws it. (Methods against sequential: tests/test_diffusion.py; fault classes:
tests/test_faults_diffusion.py.)"""

import math

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import DDIMScheduler, DDPMScheduler, PNDMScheduler  # noqa: E402
from diffusers.utils.torch_utils import randn_tensor  # noqa: E402

from diffusion_cases import Eps  # noqa: E402
from paraprop.diffusion import DiffusionChain, draw_noise, sample, step_table  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def diffusers_loop(model, scheduler, shape, steps, seed, *, dtype=torch.float32, device="cpu",
                   eta=None, **step_kwargs):
    """A diffusers pipeline's loop, written here independently of paraprop: the initial sample
    and every step's noise from one CPU generator (``randn_tensor`` draws on the generator's
    device and moves the tensor)."""
    kw = {} if eta is None else {"eta": eta}
    g = torch.Generator().manual_seed(seed)
    scheduler.set_timesteps(steps)
    x = randn_tensor(shape, generator=g, device=torch.device(device), dtype=dtype)
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(model(x, t), t, x, generator=g, **kw, **step_kwargs).prev_sample
    return x


def gen(seed=1):
    return torch.Generator().manual_seed(seed)


# (scheduler, config, sample shape, eta, step kwargs); thresholding needs image-shaped samples
CONFIGS = [
    ("ddpm", {}, (3, 2), None, {}),
    ("ddpm", {"clip_sample": False}, (3, 2), None, {}),
    ("ddpm", {"prediction_type": "v_prediction"}, (3, 2), None, {}),
    ("ddpm", {"prediction_type": "sample"}, (3, 2), None, {}),
    ("ddpm", {"variance_type": "fixed_large"}, (3, 2), None, {}),
    ("ddpm", {"variance_type": "fixed_small_log"}, (3, 2), None, {}),
    ("ddpm", {"timestep_spacing": "trailing"}, (3, 2), None, {}),
    ("ddpm", {"thresholding": True}, (3, 1, 2, 2), None, {}),
    ("ddim", {}, (3, 2), 0.0, {}),
    ("ddim", {}, (3, 2), 0.5, {}),
    ("ddim", {"clip_sample": False}, (3, 2), 1.0, {}),
    ("ddim", {"prediction_type": "v_prediction"}, (3, 2), 0.5, {}),
    ("ddim", {"prediction_type": "v_prediction", "set_alpha_to_one": False}, (3, 2), 1.0, {}),
    ("ddim", {"prediction_type": "sample", "set_alpha_to_one": False}, (3, 2), 1.0, {}),
    ("ddim", {"timestep_spacing": "trailing", "thresholding": True}, (3, 1, 2, 2), 0.0, {}),
    ("ddim", {"clip_sample": True}, (3, 2), 0.5, {"use_clipped_model_output": True}),
    ("ddim", {"thresholding": True}, (3, 1, 2, 2), 1.0, {"use_clipped_model_output": True}),
    ("ddim", {"prediction_type": "sample"}, (3, 2), 0.5, {"use_clipped_model_output": True}),
]


def _make(kind):
    return DDPMScheduler if kind == "ddpm" else DDIMScheduler


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("kind", "cfg", "shape", "eta", "step_kw"), CONFIGS,
                         ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_sequential_is_the_diffusers_loop_bitwise_in_every_dtype(kind, cfg, shape, eta, step_kw,
                                                                  dtype, device):
    """The same operations in the same precision: in bfloat16 and float16, PyTorch rounds the
    coefficient of ``c * t`` to the sample dtype on the CPU but not that of ``t / c`` (and on
    CUDA neither, dividing through the reciprocal); the table does what the kernels do."""
    steps = 20
    model = Eps(features=math.prod(shape[1:])).to(device, dtype)
    ref = diffusers_loop(model, _make(kind)(**cfg), shape, steps, 5, dtype=dtype, device=device,
                         eta=eta, **step_kw)
    ekw = {} if eta is None else {"eta": eta}
    x, sol = sample(model, _make(kind)(**cfg), shape, num_inference_steps=steps,
                    method="sequential", generator=gen(5), **ekw, **step_kw)
    assert x.dtype == dtype and x.device.type == device.type
    assert torch.equal(x, ref)
    assert sol.converged and sol.stats["model_calls"] == steps
    assert sol.stats["certificate"] == "bitwise"


@pytest.mark.parametrize("steps", [1, 7, 50])
@pytest.mark.parametrize(("kind", "eta"), [("ddpm", None), ("ddim", 0.0), ("ddim", 1.0)])
def test_explicit_noise_is_the_generator_path(kind, eta, steps):
    model, shape = Eps(), (3, 2)
    ref = diffusers_loop(model, _make(kind)(), shape, steps, 5, eta=eta)
    table = step_table(_make(kind)(), steps, eta=eta or 0.0)
    noise = draw_noise(table, shape, generator=gen(5))
    ekw = {} if eta is None else {"eta": eta}
    y, _ = sample(model, _make(kind)(), shape, num_inference_steps=steps, method="sequential",
                  noise=noise, **ekw)
    assert torch.equal(y, ref)


def test_the_operations_round_as_pytorch_does():
    """Why the table cannot cast its coefficients to the sample dtype (the old way), nor keep
    them in float32 for every operation: on the CPU a 0-d float32 coefficient *before* a
    bfloat16 tensor is rounded to bfloat16 first, one *after* it is not."""
    z = torch.randn(1000, generator=gen(0)).to(torch.bfloat16)
    c = torch.tensor(0.123456789)
    assert torch.equal(c * z, c.to(torch.bfloat16) * z)
    assert not torch.equal(c * z, (c * z.float()).to(torch.bfloat16))
    assert torch.equal(z / c, (z.float() / c).to(torch.bfloat16))
    assert not torch.equal(z / c, z / c.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("kind", "cfg", "shape", "eta", "step_kw"), CONFIGS[:12],
                         ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_step_table_is_scheduler_step_on_a_window(kind, cfg, shape, eta, step_kw, dtype):
    """One batched apply over several steps gives each step's ``scheduler.step`` bit for bit."""
    steps = 9
    sch = _make(kind)(**cfg)
    table = step_table(sch, steps, eta=eta or 0.0,
                       use_clipped_model_output=step_kw.get("use_clipped_model_output", False))
    x = torch.randn(steps, *shape, generator=gen(1)).to(dtype)
    out = torch.randn(steps, *shape, generator=gen(2)).to(dtype)
    z = torch.randn(steps, *shape, generator=gen(3)).to(dtype) * table.noisy.reshape(
        -1, *([1] * len(shape))).to(dtype)
    got = table.apply(slice(0, steps), x, out, z)
    ekw = {} if eta is None else {"eta": eta}
    for s, t in enumerate(sch.timesteps):
        kw = {"variance_noise": z[s]} if kind == "ddim" and eta else {}
        if kind == "ddpm":   # DDPM draws its noise itself: compare the mean, then add ours
            want = sch.step(out[s], t, x[s], generator=gen(9)).prev_sample
            draw = randn_tensor(shape, generator=gen(9), dtype=dtype) if int(t) > 0 else None
            if draw is not None:
                ztab = torch.where(table.noisy[s], 1, 0) * draw
                got_s = table.apply(slice(s, s + 1), x[s:s + 1], out[s:s + 1], ztab[None])[0]
                assert torch.equal(got_s, want), (s, int(t))
                continue
        else:
            want = sch.step(out[s], t, x[s], **ekw, **kw, **step_kw).prev_sample
        assert torch.equal(got[s], want), (s, int(t))
    # an index tensor (the bench's form) selects the same steps
    idx = torch.tensor([2, 0, 5])
    assert torch.equal(table.apply(idx, x[idx], out[idx], z[idx]),
                       torch.stack([got[2], got[0], got[5]]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_picard_fixed_point_is_the_sequential_trajectory_bitwise(dtype, device):
    """The residual form: the sequential trajectory is a bitwise fixed point of the Picard map
    (every window, every split), while the cumulative-sum form ``x_s + (y_s - x_s)`` rounds
    away from it in low precision."""
    N, shape = 25, (3, 2)
    model = lambda x, t: torch.tanh(1.5 * x) - 0.3 * x  # noqa: E731 - elementwise
    for split in ("identity", "eps"):
        table = step_table(DDPMScheduler(clip_sample=False), N)
        noise = draw_noise(table, shape, generator=gen(0), dtype=dtype, device=device)
        x, ref = sample(model, DDPMScheduler(clip_sample=False), shape, num_inference_steps=N,
                        method="sequential", noise=noise)
        chain = DiffusionChain(model, table, noise[0], noise[1:], split=split)
        X = ref.value.reshape(3, N, 2)
        assert torch.equal(chain(X), X)
        for start, stop in ((0, 7), (5, 25), (24, 25)):
            vals, _ = chain.window(X, start, stop)
            assert torch.equal(vals, X[:, start:stop])
    if dtype in (torch.bfloat16, torch.float16):   # the old form's fixed point is not it
        y = chain.steps(torch.cat([noise[0].reshape(3, 1, 2), X[:, :-1]], 1), 0, N)
        xin = torch.cat([noise[0].reshape(3, 1, 2), X[:, :-1]], 1)
        cumsum_form = xin[:, :1] + (y - xin).cumsum(1)
        assert not torch.equal(cumsum_form, X)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_gains_are_those_of_every_observation(dtype, device):
    """The gains record folds its observations many at a time (when read, or when its buffer is
    full): the gains are bitwise those of taking each observation's ratio as it comes, over
    full, partial and single-step windows, reads in between and more calls than the buffer."""
    from paraprop.diffusion.gains import NOISE_ULPS, OBSERVATIONS_KEPT, StepGains, observe_level

    B, N, shape = 3, 12, (3, 2)
    table = step_table(DDPMScheduler(clip_sample=False), N)
    noise = draw_noise(table, shape, generator=gen(1), dtype=dtype, device=device)
    chain = DiffusionChain(Eps().to(device, dtype), table, noise[0], noise[1:])
    gains = chain.observer = StepGains(B, N, 2, dtype, chain.work, device)
    f64 = torch.float64
    want = torch.full((B, N), math.nan, dtype=f64, device=device)
    last = torch.full((2, B, N, 2), math.nan, dtype=dtype, device=device)
    g = gen(2)
    windows = [(0, N), (3, 9), (0, 1), (5, N), (0, N)] * 4 + [(2, 7)] * (OBSERVATIONS_KEPT + 2)
    for k, (a, b) in enumerate(windows):
        xin = torch.randn(B, b - a, 2, generator=g).to(device, dtype) * (1 + k % 3)
        if k % 5 == 4:   # (an input that did not move: no ratio)
            xin[0] = last[0, 0, a:b]
        nxt = chain.steps(xin, a, b)
        w = torch.float32 if dtype == torch.bfloat16 else dtype
        din, dout = ((v.to(w) - u.to(w)).abs().amax(2).to(f64)
                     for v, u in ((xin, last[0, :, a:b]), (nxt, last[1, :, a:b])))
        level = observe_level(dtype) * xin.to(w).abs().amax(2).to(f64).clamp(min=1)
        noise_ = NOISE_ULPS * torch.finfo(dtype).eps * nxt.to(w).abs().amax(2).to(f64).clamp(min=1)
        ratio = torch.where(din > level, (dout - noise_).clamp(min=0) / din, math.nan)
        want[:, a:b] = torch.fmax(want[:, a:b], ratio)
        last[0, :, a:b], last[1, :, a:b] = xin, nxt
        if k in (3, 11):   # a read in between folds what is pending
            assert torch.equal(gains.gain.view(torch.int64), want.view(torch.int64))
    assert bool(want.isfinite().all())   # (every step observed, with inputs that moved)
    assert torch.equal(gains.gain.view(torch.int64), want.view(torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_is_drawn_on_the_generator_device_and_moved(dtype, device):
    """A CPU generator gives the same noise wherever the sample lives (as diffusers'
    ``randn_tensor``), so a seed gives the same sample on the CPU and on a GPU."""
    table = step_table(DDPMScheduler(), 6)
    on_cpu = draw_noise(table, (2, 3), generator=gen(4), dtype=dtype)
    here = draw_noise(table, (2, 3), generator=gen(4), dtype=dtype, device=device)
    assert here.device.type == device.type and here.dtype == dtype
    assert torch.equal(here.cpu(), on_cpu)
    g = gen(4)
    first = randn_tensor((2, 3), generator=g, device=device, dtype=dtype)
    assert torch.equal(here[0], first)


def test_the_step_table_moves_to_the_sample_device(device):
    table = step_table(DDIMScheduler(), 8, eta=0.5).to(device)
    assert table.sqrt_alpha.device.type == device.type
    assert table.noisy_steps == tuple(bool(v) for v in table.noisy.cpu())
    assert table.scalars == "cpu"


def test_errors_name_the_argument():
    m, s = Eps(), DDIMScheduler
    with pytest.raises(NotImplementedError, match="DDPMScheduler, DDIMScheduler"):
        sample(m, PNDMScheduler(), (2, 2), num_inference_steps=3)
    with pytest.raises(NotImplementedError, match="variance_type='learned'"):
        sample(m, DDPMScheduler(variance_type="learned"), (2, 2), num_inference_steps=3)
    with pytest.raises(ValueError, match=r"= \(4, 2, 2\), got \(3, 2, 2\)"):
        sample(m, s(), (2, 2), num_inference_steps=3, noise=torch.zeros(3, 2, 2))
    with pytest.raises(ValueError, match=r"model output has shape \(2, 4\), expected \(2, 2\)"):
        sample(lambda x, t: torch.zeros(len(x), 4), s(), (2, 2), num_inference_steps=3)
    with pytest.raises(TypeError, match=r"model output has dtype torch.float32, expected "
                                        r"torch.bfloat16"):
        sample(lambda x, t: x.float(), s(), (2, 2), num_inference_steps=3,
               dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="eta is an option of DDIMScheduler"):
        sample(m, DDPMScheduler(), (2, 2), num_inference_steps=3, eta=0.5)
