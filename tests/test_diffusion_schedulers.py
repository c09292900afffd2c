"""paraprop.diffusion.sample with the schedulers beyond DDPM/DDIM (the readers wired into the
chain through paraprop.diffusion.programs): ``method="sequential"`` is the diffusers loop bit for
bit for every scheduler with a reader; the parallel methods return that sample for the Markov
ones (bitwise at ``tol=0``, within ``tol`` otherwise) in at most the loop's model calls; the
rest is refused by name."""

import inspect

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import DDIMScheduler, DDPMScheduler, PNDMScheduler  # noqa: E402
from diffusers.utils.torch_utils import randn_tensor  # noqa: E402

import paraprop  # noqa: E402
from diffusion_cases import (  # noqa: E402, I001
    ANCESTRAL,
    DPM,
    DYNAMIC,
    EULER,
    FLOW,
    HEUN,
    LCM,
    READER_MARKS,
    SDE,
    UNIPC,
)
from diffusion_cases import (
    RowEps as Eps,
)
from paraprop import NonFiniteError, StochasticModelError  # noqa: E402
from paraprop.diffusion import readers, sample  # noqa: E402
from paraprop.diffusion.programs import MarkovProgram  # noqa: E402

pytestmark = READER_MARKS

SHAPE = (3, 2)

# (id, scheduler class, config, mu): the Markov ones (every method)
MARKOV = [
    ("euler", EULER, {}, None),
    ("euler-v-karras", EULER, {"prediction_type": "v_prediction", "use_karras_sigmas": True},
     None),
    ("euler-sample-trailing", EULER, {"prediction_type": "sample",
                                      "timestep_spacing": "trailing"}, None),
    ("ancestral", ANCESTRAL, {}, None),
    ("ancestral-v", ANCESTRAL, {"prediction_type": "v_prediction",
                                "timestep_spacing": "trailing"}, None),
    ("flow", FLOW, {}, None),
    ("flow-shift", FLOW, {"shift": 3.0}, None),
    ("flow-dynamic", FLOW, DYNAMIC, 0.8),
    ("flow-stochastic", FLOW, {"stochastic_sampling": True, "shift": 2.0}, None),
    ("lcm", LCM, {}, None),
    ("lcm-v-clip", LCM, {"prediction_type": "v_prediction", "clip_sample": True}, None),
    ("dpm1", DPM, {"solver_order": 1}, None),
    ("dpm1-karras-v", DPM, {"solver_order": 1, "use_karras_sigmas": True,
                            "prediction_type": "v_prediction"}, None),
    ("sde1", DPM, {**SDE, "solver_order": 1}, None),
]
# the readers with history (DPM-Solver++ of order 2 and 3, UniPC and Heun run in parallel
# too: tests/test_diffusion_multistep_parallel.py, tests/test_diffusion_heun_parallel.py)
HISTORY = [
    ("dpm2", DPM, {}, None),
    ("dpm3-sde", DPM, {**SDE, "solver_order": 3}, None),
    ("unipc2", UNIPC, {}, None),
    ("unipc3-bh1", UNIPC, {"solver_order": 3, "solver_type": "bh1"}, None),
    ("heun", HEUN, {}, None),
    ("heun-v-karras", HEUN, {"prediction_type": "v_prediction", "use_karras_sigmas": True},
     None),
]
ALL = MARKOV + HISTORY


def ids(cases):
    return [c[0] for c in cases]


def diffusers_loop(model, scheduler, steps, dtype, device, seed=1, mu=None, **kw):
    """A pipeline's loop, written here independently of paraprop: latents from one CPU
    generator scaled by init_noise_sigma, scale_model_input, then every step with the same
    generator."""
    g = torch.Generator().manual_seed(seed)
    scheduler.set_timesteps(steps, device=device, **({} if mu is None else {"mu": mu}))
    x = randn_tensor(SHAPE, generator=g, device=torch.device(device), dtype=dtype)
    init = getattr(scheduler, "init_noise_sigma", None)
    if init is not None:
        x = x * init
    takes_generator = "generator" in inspect.signature(scheduler.step).parameters
    with torch.no_grad():
        for t in scheduler.timesteps:
            inp = scheduler.scale_model_input(x, t) if hasattr(scheduler,
                                                                "scale_model_input") else x
            step_kw = {"generator": g} if takes_generator else {}
            x = scheduler.step(model(inp, t, **kw), t, x, **step_kw).prev_sample
    return x


def run(cls, config, mu, model, steps, dtype, device, seed=1, **kw):
    return sample(model, cls(**config), SHAPE, num_inference_steps=steps, mu=mu, dtype=dtype,
                  device=device, generator=torch.Generator().manual_seed(seed), **kw)


# -- sequential: the diffusers loop ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_sequential_is_the_diffusers_loop_bitwise(case, dtype, device):
    _, cls, config, mu = case
    model = Eps().to(device)
    for steps in (1, 7, 25):
        ref = diffusers_loop(model, cls(**config), steps, dtype, device, mu=mu)
        if not bool(ref.isfinite().all()):   # (UniPC bh1 at one step: NaN in diffusers too)
            with pytest.raises(NonFiniteError, match=r"step \d+ of sample \d+ is not finite"):
                run(cls, config, mu, model, steps, dtype, device, method="sequential")
            continue
        x, sol = run(cls, config, mu, model, steps, dtype, device, method="sequential")
        assert x.dtype == dtype and x.device.type == device.type
        assert torch.equal(x, ref), steps
        K = 2 * steps - 1 if cls is HEUN else steps
        assert sol.converged and sol.stats["model_calls"] == K == sol.iterations
        assert sol.stats["certificate"] == "bitwise"
        assert sol.value.shape == (SHAPE[0], K, *SHAPE[1:])
        assert torch.equal(sol.value[:, -1], x)


LOW = ["euler", "ancestral", "flow-shift", "lcm", "dpm1", "dpm2", "unipc2", "heun"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", [c for c in ALL if c[0] in LOW], ids=LOW)
def test_sequential_low_precision_is_the_loop(case, dtype, device):
    _, cls, config, mu = case
    model = Eps().to(device)
    ref = diffusers_loop(model, cls(**config), 7, dtype, device, mu=mu)
    x, _ = run(cls, config, mu, model, 7, dtype, device, method="sequential")
    assert x.dtype == dtype and torch.equal(x, ref)


def test_the_comparison_can_fail():
    """Another seed, or a config the reader must read (shift), changes the loop's sample."""
    model = Eps()
    ref = diffusers_loop(model, FLOW(shift=3.0), 7, torch.float32, "cpu")
    x, _ = run(FLOW, {"shift": 3.0}, None, model, 7, torch.float32, "cpu", method="sequential")
    assert torch.equal(x, ref)
    y, _ = run(FLOW, {}, None, model, 7, torch.float32, "cpu", method="sequential")
    assert not torch.equal(y, ref)
    y, _ = run(FLOW, {"shift": 3.0}, None, model, 7, torch.float32, "cpu", seed=2,
               method="sequential")
    assert not torch.equal(y, ref)


# -- parallel methods: the Markov readers --------------------------------------------------

METHODS = [("picard", 8), ("picard", None), ("anderson", None)]


@pytest.mark.parametrize(("method", "window"), METHODS, ids=["picard8", "jacobi", "anderson"])
@pytest.mark.parametrize("case", MARKOV, ids=ids(MARKOV))
def test_parallel_is_the_sequential_sample(case, method, window, device):
    _, cls, config, mu = case
    model = Eps().to(device)
    steps = 25
    ref, _ = run(cls, config, mu, model, steps, torch.float32, device, method="sequential")
    x, sol = run(cls, config, mu, model, steps, torch.float32, device, method=method,
                 window=window, tol=0)
    assert torch.equal(x, ref)
    assert sol.converged and sol.stats["certificate"] == "bitwise"
    assert sol.stats["model_calls"] <= steps and sol.iterations <= steps
    x, sol = run(cls, config, mu, model, steps, torch.float32, device, method=method,
                 window=window, tol=1e-3)
    assert sol.converged and sol.stats["model_calls"] <= steps
    assert float((x - ref).abs().max()) <= 1e-3
    assert sol.stats["error_estimate"] <= 1e-3


LOW_PARALLEL = ["euler-v-karras", "ancestral", "flow-dynamic", "flow-stochastic", "lcm", "sde1"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", [c for c in MARKOV if c[0] in LOW_PARALLEL], ids=LOW_PARALLEL)
def test_parallel_low_precision_is_the_loop(case, dtype, device):
    """In bfloat16 and float16 (no tol is resolvable there: every tol runs to the loop's
    bits), the residual form's fixed point is the loop's sample bit for bit."""
    _, cls, config, mu = case
    model = Eps().to(device)
    ref = diffusers_loop(model, cls(**config), 12, dtype, device, mu=mu)
    for method, window in (("picard", 4), ("anderson", None)):
        for tol in (0, 1e-2):
            x, sol = run(cls, config, mu, model, 12, dtype, device, method=method,
                         window=window, tol=tol)
            assert torch.equal(x, ref) and sol.stats["certificate"] == "bitwise"
            assert sol.stats["model_calls"] <= 12


# (lcm-v-clip is left out: with this model it certifies one step per call, the budget)
FEWER = [c for c in MARKOV if c[0] != "lcm-v-clip"]


@pytest.mark.parametrize("case", FEWER, ids=ids(FEWER))
def test_picard_takes_fewer_calls_than_steps(case):
    """The contracting model: a window of 8 steps certifies several steps per call."""
    _, cls, config, mu = case
    x, sol = run(cls, config, mu, Eps(), 25, torch.float32, "cpu", method="picard", window=8,
                 tol=0)
    # (the spot check of the last step's batch variance adds one call where the budget has it)
    spot = 24 in sol.stats["batch_checked_steps"]
    assert sol.converged and sol.stats["model_calls"] <= 25
    assert sol.stats["model_calls"] - spot < 25


@pytest.mark.parametrize("case", [c for c in MARKOV if c[0] in ("euler", "flow-dynamic",
                                                                 "lcm", "sde1")],
                         ids=["euler", "flow-dynamic", "lcm", "sde1"])
def test_parallel_float64_and_the_budget(case):
    """float64 samples (these steps compute in float32 inside, as diffusers upcasts), and a
    model that does not contract: still the loop's sample, never more calls than the loop."""
    _, cls, config, mu = case
    for model in (Eps(), Eps(scale=4.0, seed=3)):
        ref, _ = run(cls, config, mu, model, 12, torch.float64, "cpu", method="sequential")
        for method in ("picard", "anderson"):
            x, sol = run(cls, config, mu, model, 12, torch.float64, "cpu", method=method,
                         window=4 if method == "picard" else None, tol=0)
            assert torch.equal(x, ref) and sol.stats["model_calls"] <= 12
            x, sol = run(cls, config, mu, model, 12, torch.float64, "cpu", method=method,
                         window=4 if method == "picard" else None, tol=1e-3, throw=False)
            assert sol.stats["model_calls"] <= 12
            if sol.converged:
                assert float((x - ref).abs().max()) <= 1e-3


def test_explicit_noise_is_the_generator_path():
    """``noise`` rows: the latents (before init_noise_sigma), then each step's noise, as
    readers.draw_noise draws them with the generator."""
    model = Eps()
    for cls, config in ((ANCESTRAL, {}), (FLOW, {"stochastic_sampling": True}), (LCM, {})):
        r = readers.reader(cls(**config), 9)
        latents, z = readers.draw_noise(r, SHAPE, generator=torch.Generator().manual_seed(1),
                                        dtype=torch.float32)
        noise = torch.cat([latents[None], z.to(torch.float32)])
        ref, _ = run(cls, config, None, model, 9, torch.float32, "cpu", method="sequential")
        for method in ("sequential", "picard"):
            x, _ = sample(model, cls(**config), SHAPE, num_inference_steps=9, method=method,
                          noise=noise, tol=0)
            assert torch.equal(x, ref)
        noise[4] += 1.0   # step 3's noise is read
        x, _ = sample(model, cls(**config), SHAPE, num_inference_steps=9, noise=noise, tol=0)
        assert not torch.equal(x, ref)


@pytest.mark.parametrize("case", [MARKOV[0], HISTORY[0], HISTORY[4]],
                         ids=["euler", "dpm2", "heun"])
def test_model_kwargs_reach_the_model(case):
    """A per-sample tensor argument is tiled over a window's rows (and passed as it is by the
    loop of a reader with history)."""
    _, cls, config, mu = case
    model = Eps()
    gain = torch.tensor([0.5, 1.0, 2.0])
    ref = diffusers_loop(model, cls(**config), 7, torch.float32, "cpu", gain=gain)
    x, _ = run(cls, config, mu, model, 7, torch.float32, "cpu", method="sequential",
               gain=gain)
    assert torch.equal(x, ref)
    plain, _ = run(cls, config, mu, model, 7, torch.float32, "cpu", method="sequential")
    assert not torch.equal(plain, ref)
    if cls is EULER:
        y, _ = run(cls, config, mu, model, 7, torch.float32, "cpu", method="picard", tol=0,
                   gain=gain)
        assert torch.equal(y, ref)


@pytest.mark.parametrize("case", MARKOV, ids=ids(MARKOV))
def test_output_gains_are_the_steps_derivative(case):
    """``|d step / d model output|`` of each step (the certificate's batch-variance term)
    against autograd through the program's own step."""
    _, cls, config, mu = case
    r = readers.reader(cls(**config), 6, mu=mu)
    p = MarkovProgram(r)
    gains = p.output_gains()
    g = torch.Generator().manual_seed(0)
    for k in range(p.N):
        x = torch.randn(1, 1, 3, generator=g) * 0.1
        out = torch.randn(1, 1, 3, generator=g).mul(0.1).requires_grad_()
        z = torch.randn(1, 1, 3, generator=g)
        y = p.apply(slice(k, k + 1), x, out, z)
        (d,) = torch.autograd.grad(y.sum(), out)
        torch.testing.assert_close(d.abs().double(), gains[k].expand(1, 1, 3), rtol=1e-5,
                                   atol=1e-7)


# -- refusals --------------------------------------------------------------------------------

def test_ddim_options_and_split_are_refused_by_name():
    m = Eps()
    for cls in (EULER, FLOW, HEUN):
        with pytest.raises(ValueError, match=f"eta is an option of DDIMScheduler; "
                                             f"{cls.__name__} has no eta, got eta=0.5"):
            run(cls, {}, None, m, 5, torch.float32, "cpu", eta=0.5)
        with pytest.raises(ValueError, match=f"use_clipped_model_output is an option of "
                                             f"DDIMScheduler; {cls.__name__} has none"):
            run(cls, {}, None, m, 5, torch.float32, "cpu", use_clipped_model_output=True)
        with pytest.raises(NotImplementedError, match=f"split='eps' is not implemented for "
                                                      f"{cls.__name__}: its step has no linear"):
            run(cls, {}, None, m, 5, torch.float32, "cpu", split="eps")
    with pytest.raises(ValueError, match="use_clipped_model_output is an option of "
                                         "DDIMScheduler; DDPMScheduler has none"):
        run(DDPMScheduler, {}, None, m, 5, torch.float32, "cpu", use_clipped_model_output=True)
    with pytest.raises(NotImplementedError, match="split='eps' is not implemented for "
                                                  "EulerDiscreteScheduler"):
        MarkovProgram(readers.reader(EULER(), 4)).linear_part("eps")


def test_mu_is_read_or_refused():
    m = Eps()
    with pytest.raises(ValueError, match=r"mu: FlowMatchEulerDiscreteScheduler reads mu only "
                                         r"with use_dynamic_shifting=True .*got mu=0.5"):
        run(FLOW, {}, 0.5, m, 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"mu: DDIMScheduler reads mu only"):
        run(DDIMScheduler, {}, 0.5, m, 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"mu: FlowMatchEulerDiscreteScheduler with "
                                         r"use_dynamic_shifting=True needs mu"):
        run(FLOW, DYNAMIC, None, m, 5, torch.float32, "cpu")
    with pytest.raises(TypeError, match="mu must be a float, got str"):
        run(FLOW, DYNAMIC, "0.5", m, 5, torch.float32, "cpu")
    a, _ = run(FLOW, DYNAMIC, 0.5, m, 5, torch.float32, "cpu")
    b, _ = run(FLOW, DYNAMIC, 1.0, m, 5, torch.float32, "cpu")
    assert not torch.equal(a, b)   # mu is read


def test_unsupported_schedulers_and_settings():
    m = Eps()
    with pytest.raises(NotImplementedError, match=r"PNDMScheduler is not supported.*"
                                                  r"DDPMScheduler, DDIMScheduler.*readers"):
        run(PNDMScheduler, {}, None, m, 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"EulerAncestralDiscreteScheduler: "
                                         r"prediction_type='sample' is not supported"):
        run(ANCESTRAL, {"prediction_type": "sample"}, None, m, 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"noise must have shape .* = \(6, 3, 2\)"):
        sample(m, EULER(), SHAPE, num_inference_steps=5, noise=torch.zeros(5, 3, 2))
    with pytest.raises(ValueError, match="pass either noise or generator, not both"):
        sample(m, EULER(), SHAPE, num_inference_steps=5, noise=torch.zeros(6, 3, 2),
               generator=torch.Generator())
    with pytest.raises(ValueError, match=r"MarkovProgram: HeunDiscreteScheduler reads "
                                         r"history \(history=1, parts=1\)"):
        MarkovProgram(readers.reader(HEUN(), 4))
    with pytest.raises(ValueError, match=r"EulerDiscreteScheduler: samples on meta, but the "
                                         r"reader was made for cpu"):
        MarkovProgram(readers.reader(EULER(), 4)).to("meta")


def test_train_mode_dropout_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    with pytest.raises(StochasticModelError, match="model.eval()"):
        sample(lambda x, t: model(x), EULER(), SHAPE, num_inference_steps=4)


@pytest.mark.parametrize("case", [c for c in ALL if c[0] in ("flow-dynamic", "euler", "dpm2")],
                         ids=["euler", "flow-dynamic", "dpm2"])
def test_guided_sampling_is_the_guided_loop(case, device):
    """Classifier-free guidance (Guided) with a reader's scheduler: the pipelines' loop (both
    halves in one call, the mix, then the step) bit for bit, sequentially and, for the Markov
    ones, in parallel at tol=0."""
    from paraprop.diffusion import Guided

    _, cls, config, mu = case
    model = Eps().to(device)
    cond = torch.tensor([1.5, 0.5, 1.0], device=device)
    uncond = torch.tensor([0.2, 0.3, 0.1], device=device)

    def pipeline_model(x, t):   # the pipeline's guided output, written out
        out = model(torch.cat([x, x]), t, gain=torch.cat([uncond, cond]))
        u, c = out.chunk(2)
        return u + 4.0 * (c - u)

    ref = diffusers_loop(pipeline_model, cls(**config), 9, torch.float32, device, mu=mu)
    guided = Guided(model, 4.0, cond={"gain": cond}, uncond={"gain": uncond})
    x, _ = run(cls, config, mu, guided, 9, torch.float32, device, method="sequential")
    assert torch.equal(x, ref)
    if cls is not DPM:
        y, sol = run(cls, config, mu, guided, 9, torch.float32, device, method="picard",
                     window=4, tol=0)
        assert torch.equal(y, ref) and sol.stats["model_calls"] <= 9


def test_max_iters_below_the_loops_calls():
    """As DDPM's loop: ``max_iters`` below the loop's calls runs none and certifies nothing
    (Heun's loop makes 2N - 1 calls); at the loop's count it runs."""
    m = Eps()
    with pytest.raises(paraprop.ConvergenceError,
                       match=r"the loop needs 9 model calls \(HeunDiscreteScheduler, "
                             r"num_inference_steps=5\), more than max_iters=5"):
        run(HEUN, {}, None, m, 5, torch.float32, "cpu", method="sequential", max_iters=5)
    x, sol = run(HEUN, {}, None, m, 5, torch.float32, "cpu", method="sequential", max_iters=5,
                 throw=False)
    assert not sol.converged and sol.stats["model_calls"] == 0
    assert sol.stats["certificate"] is None and "reason" in sol.stats
    x, sol = run(HEUN, {}, None, m, 5, torch.float32, "cpu", method="sequential", max_iters=9)
    assert sol.converged and sol.stats["model_calls"] == 9
    x, sol = run(EULER, {}, None, m, 5, torch.float32, "cpu", method="sequential", max_iters=4,
                 throw=False)
    assert not sol.converged and sol.stats["model_calls"] == 0
