"""The scheduler readers (paraprop.diffusion.readers and its per-family modules) against
diffusers itself: the loop through a reader is the diffusers loop bit for bit (every state, in
float32 and float64, at 1, 7, 25 and 50 steps, default and non-default configurations, the
ancestral and SDE ones with one generator); a window of steps applied from one batched model
call gives the loop's states bit for bit; every setting a reader does not implement is refused
by name."""

import inspect

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import DDIMScheduler  # noqa: E402
from diffusers.utils.torch_utils import randn_tensor  # noqa: E402

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
from paraprop.diffusion import readers  # noqa: E402
from paraprop.diffusion.karras import EulerDiscreteReader  # noqa: E402

pytestmark = READER_MARKS

FLOW_SIGMAS = {"use_flow_sigmas": True, "prediction_type": "flow_prediction", "flow_shift": 3.0}

# (id, scheduler class, config, set_timesteps' mu)
CONFIGS = [
    ("dpm2", DPM, {}, None),
    ("dpm1", DPM, {"solver_order": 1}, None),
    ("dpm3", DPM, {"solver_order": 3}, None),
    ("dpm2-heun", DPM, {"solver_type": "heun"}, None),
    ("dpm2-karras", DPM, {"use_karras_sigmas": True}, None),
    ("dpm2-v", DPM, {"prediction_type": "v_prediction"}, None),
    ("dpm3-sample", DPM, {"prediction_type": "sample", "solver_order": 3}, None),
    ("dpm2-euler-final", DPM, {"euler_at_final": True, "lower_order_final": False}, None),
    ("dpm3-sigma-min", DPM, {"solver_order": 3, "final_sigmas_type": "sigma_min",
                             "lower_order_final": False}, None),
    ("dpm2-lu", DPM, {"use_lu_lambdas": True, "timestep_spacing": "trailing"}, None),
    ("dpm2-flow", DPM, FLOW_SIGMAS, None),
    ("sde2", DPM, SDE, None),
    ("sde2-heun", DPM, {**SDE, "solver_type": "heun", "use_karras_sigmas": True}, None),
    ("sde3", DPM, {**SDE, "solver_order": 3}, None),
    ("sde1-v", DPM, {**SDE, "solver_order": 1, "prediction_type": "v_prediction"}, None),
    ("unipc2", UNIPC, {}, None),
    ("unipc1", UNIPC, {"solver_order": 1}, None),
    ("unipc3", UNIPC, {"solver_order": 3}, None),
    ("unipc3-bh1", UNIPC, {"solver_order": 3, "solver_type": "bh1"}, None),
    ("unipc2-noise", UNIPC, {"predict_x0": False, "prediction_type": "v_prediction"}, None),
    ("unipc3-sample-noise", UNIPC, {"solver_order": 3, "predict_x0": False,
                                    "prediction_type": "sample"}, None),
    ("unipc2-karras-nocorr", UNIPC, {"use_karras_sigmas": True,
                                     "disable_corrector": [0, 3, 4]}, None),
    ("unipc3-final", UNIPC, {"solver_order": 3, "lower_order_final": False,
                             "final_sigmas_type": "sigma_min"}, None),
    ("unipc2-flow", UNIPC, FLOW_SIGMAS, None),
    ("euler", EULER, {}, None),
    ("euler-v-zsnr", EULER, {"prediction_type": "v_prediction", "rescale_betas_zero_snr": True,
                             "timestep_spacing": "trailing"}, None),
    ("euler-sample-karras", EULER, {"prediction_type": "sample", "use_karras_sigmas": True},
     None),
    ("euler-continuous", EULER, {"prediction_type": "v_prediction",
                                 "timestep_type": "continuous",
                                 "final_sigmas_type": "sigma_min"}, None),
    ("ancestral", ANCESTRAL, {}, None),
    ("ancestral-v", ANCESTRAL, {"prediction_type": "v_prediction",
                                "timestep_spacing": "trailing"}, None),
    ("heun", HEUN, {}, None),
    ("heun-v-karras", HEUN, {"prediction_type": "v_prediction", "use_karras_sigmas": True},
     None),
    ("heun-sample-clip", HEUN, {"prediction_type": "sample", "clip_sample": True,
                                "clip_sample_range": 0.5}, None),
    ("flow", FLOW, {}, None),
    ("flow-shift", FLOW, {"shift": 3.0}, None),
    ("flow-dynamic", FLOW, DYNAMIC, 0.8),
    ("flow-karras", FLOW, {"use_karras_sigmas": True}, None),
    ("flow-exponential", FLOW, {"use_exponential_sigmas": True, "shift": 3.0}, None),
    ("flow-stochastic", FLOW, {"stochastic_sampling": True, "shift": 2.0}, None),
    ("lcm", LCM, {}, None),
    ("lcm-v-clip", LCM, {"prediction_type": "v_prediction", "clip_sample": True}, None),
    ("lcm-sample-trailing", LCM, {"prediction_type": "sample", "timestep_spacing": "trailing"},
     None),
]
IDS = [c[0] for c in CONFIGS]
STEPS = (1, 7, 25, 50)
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64"),
          pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="f16")]
SHAPE = (3, 2, 2)   # (batch, channels, features): UniPC's einsum reads (b, k, c...)


class Mix(torch.nn.Module):
    """A small fixed MLP mixing the features of a sample, with the timestep as an input."""

    def __init__(self, features=4, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(features + 1, 16, generator=g) * 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(16, features, generator=g) * 0.5)
        self.requires_grad_(False)

    def forward(self, x, t):
        B = len(x)
        t = torch.as_tensor(t, device=x.device).reshape(-1).expand(B).to(x.dtype) / 1000
        h = torch.tanh(torch.cat([x.reshape(B, -1), t[:, None]], 1) @ self.w1.to(x.dtype))
        return (h @ self.w2.to(x.dtype)).reshape(x.shape)


class Elementwise(torch.nn.Module):
    """A model whose every output element reads one input element and the timestep only: its
    batched calls give the bits of its single calls (no reduction to round differently)."""

    def __init__(self, shape=SHAPE[1:], seed=1):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(torch.randn(shape, generator=g))
        self.b = torch.nn.Parameter(torch.randn(shape, generator=g))
        self.requires_grad_(False)

    def forward(self, x, t):
        t = torch.as_tensor(t, device=x.device).to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
        return torch.tanh(x * self.a.to(x.dtype) + t / 1000 * self.b.to(x.dtype))


def same(a, b):
    """Bit for bit where the values are numbers (the sign of a zero included), and NaN at the
    same places: diffusers gives NaN for some schedules (e.g. UniPC's bh1 at one step), and the
    reader must give it too (a NaN's payload is not compared)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.contiguous().view(bits)[~nan], b.contiguous().view(bits)[~nan])


def make(cls, config):
    return cls(**config)


def diffusers_loop(model, scheduler, steps, dtype, device, seed=0, mu=None):
    """A pipeline's loop, written here independently of paraprop: latents from one CPU
    generator (scaled by init_noise_sigma where the scheduler has one), then every step with
    the same generator. Returns every state (and UniPC's corrected samples)."""
    g = torch.Generator().manual_seed(seed)
    scheduler.set_timesteps(steps, device=device, **({} if mu is None else {"mu": mu}))
    x = randn_tensor(SHAPE, generator=g, device=torch.device(device), dtype=dtype)
    init = getattr(scheduler, "init_noise_sigma", None)
    if init is not None:
        x = x * init
    takes_generator = "generator" in inspect.signature(scheduler.step).parameters
    states, corrected = [x], []
    for t in scheduler.timesteps:
        inp = scheduler.scale_model_input(x, t) if hasattr(scheduler, "scale_model_input") \
            else x
        kw = {"generator": g} if takes_generator else {}
        x = scheduler.step(model(inp, t), t, x, **kw).prev_sample
        states.append(x)
        corrected.append(getattr(scheduler, "last_sample", None))
    return torch.stack(states), corrected


def trajectory(reader, model, latents, z):
    """The loop through the reader one step at a time, keeping every state, model input,
    model output and record."""
    state = reader.initial(latents)[None]
    states, inputs, outs, recs = [state[0]], [], [], []
    past = tuple(r[:0] for r in reader.records_like(latents[None]))
    for k in range(reader.K):
        x_in = reader.model_input(k, k + 1, state)
        out = model(x_in[0], reader.timesteps[k])[None]
        state, rec = reader.step(k, k + 1, state, out, past, z[k: k + 1])
        if reader.history:
            past = tuple(torch.cat([p, r])[-reader.history:] for p, r in zip(past, rec,
                                                                           strict=True))
        states.append(state[0])
        inputs.append(x_in[0])
        outs.append(out[0])
        recs.append(rec)
    rec_rows = tuple(torch.cat([r[i] for r in recs]) for i in range(len(recs[0])))
    return torch.stack(states), torch.stack(inputs), torch.stack(outs), rec_rows


def run_reader(cls, config, mu, model, steps, dtype, device, seed=0):
    r = readers.reader(make(cls, config), steps, mu=mu, device=device)
    g = torch.Generator().manual_seed(seed)
    latents, z = readers.draw_noise(r, SHAPE, generator=g, dtype=dtype, device=device)
    return r, latents, z


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONFIGS, ids=IDS)
def test_loop_is_the_diffusers_loop_bitwise(case, dtype, device):
    _, cls, config, mu = case
    model = Mix().to(device)
    for steps in STEPS if dtype in (torch.float32, torch.float64) else STEPS[:3]:
        ref, corrected = diffusers_loop(model, make(cls, config), steps, dtype, device, mu=mu)
        r, latents, z = run_reader(cls, config, mu, model, steps, dtype, device)
        states = trajectory(r, model, latents, z)[0]
        assert states.shape[0] == ref.shape[0] == r.K + 1
        assert states.dtype == ref.dtype == dtype
        for k in range(r.K + 1):
            assert same(states[k, 0], ref[k]), (steps, k)
        if r.parts == 2:   # UniPC: the corrected sample the scheduler keeps
            for k in range(1, r.K):
                assert same(states[k + 1, 1], corrected[k]), (steps, k)
        # the public sequential loop gives the same sample
        assert same(readers.loop(r, model, latents, z), ref[-1])


@pytest.mark.parametrize("dtype", DTYPES[:3])   # (float16 takes bfloat16's code path)
@pytest.mark.parametrize("case", CONFIGS, ids=IDS)
def test_window_from_one_batched_call_is_the_loop(case, dtype, device):
    _, cls, config, mu = case
    model = Elementwise().to(device)
    for steps in (7, 25):
        r, latents, z = run_reader(cls, config, mu, model, steps, dtype, device)
        states, inputs, outs, recs = trajectory(r, model, latents, z)
        K, B = r.K, SHAPE[0]
        for lo, hi in {(0, K), (1, K), (0, max(1, K // 2)), (K // 3, max(K // 3 + 1, K - 2)),
                       (K - 1, K)}:
            n = hi - lo
            x_in = r.model_input(lo, hi, states[lo:hi])
            assert same(x_in, inputs[lo:hi])
            # the window's rows in one call, one timestep per row (as the chain batches them)
            t = r.timesteps[lo:hi].to(device).repeat_interleave(B)
            out = model(x_in.reshape(n * B, *SHAPE[1:]), t).reshape(n, *SHAPE)
            assert same(out, outs[lo:hi])
            h = min(r.history, lo)
            past = tuple(rr[lo - h: lo] for rr in recs)
            new, rec = r.step(lo, hi, states[lo:hi], out, past, z[lo:hi])
            assert same(new, states[lo + 1: hi + 1]), (steps, lo, hi)
            for a, b in zip(rec, recs, strict=True):
                assert same(a, b[lo:hi])


def test_the_comparisons_can_fail():
    """Another generator, or another step's noise, changes the sample: the bitwise checks
    above compare runs that depend on every draw."""
    model = Mix()
    ref, _ = diffusers_loop(model, DPM(**SDE), 7, torch.float32, "cpu")
    r, latents, z = run_reader(DPM, SDE, None, model, 7, torch.float32, "cpu")
    assert same(readers.loop(r, model, latents, z), ref[-1])
    z2 = z.clone()
    z2[3] += 1e-3
    assert not same(readers.loop(r, model, latents, z2), ref[-1])
    r, latents, z = run_reader(DPM, SDE, None, model, 7, torch.float32, "cpu", seed=1)
    assert not same(readers.loop(r, model, latents, z), ref[-1])
    # a reader step with another formula (order 1 where the scheduler uses order 2) differs
    r2 = readers.reader(DPM(solver_order=1), 7)
    latents, z = readers.draw_noise(r2, SHAPE, generator=torch.Generator().manual_seed(0),
                                    dtype=torch.float32)
    ref2, _ = diffusers_loop(model, DPM(), 7, torch.float32, "cpu")
    assert not same(readers.loop(r2, model, latents, z), ref2[-1])


def test_heun_and_unipc_shapes():
    h = readers.reader(HEUN(), 5)
    assert h.K == 9 and h.history == 1 and h.parts == 1
    assert h.kinds[:3] == ["first", "second", "first"] and h.kinds[-1] == "first"
    u = readers.reader(UNIPC(solver_order=3), 6)
    assert u.parts == 2 and u.history == 3
    # warm-up orders 1, 2, 3, then lower_order_final 3, 2, 1; the corrector from step 1
    assert u.kinds == [(1, 0), (2, 1), (3, 2), (3, 3), (2, 3), (1, 2)]
    d = readers.reader(DPM(solver_order=3), 6)
    assert d.kinds == [1, 2, 3, 3, 2, 1] and d.history == 2
    assert readers.reader(DPM(**SDE), 4).noisy == (True,) * 4
    assert readers.reader(LCM(), 4).noisy == (True, True, True, False)


# -- refusals -----------------------------------------------------------------------------------

REFUSED = [
    (DPM, {"algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"},
     "algorithm_type='dpmsolver'"),
    (DPM, {"algorithm_type": "sde-dpmsolver", "final_sigmas_type": "sigma_min"},
     "algorithm_type='sde-dpmsolver'"),
    (DPM, {"thresholding": True}, "thresholding=True"),
    (DPM, {"variance_type": "learned_range"}, "variance_type='learned_range'"),
    (DPM, {"solver_order": 4}, "solver_order=4"),
    (UNIPC, {"thresholding": True}, "thresholding=True"),
    (UNIPC, {"solver_order": 4}, "solver_order=4"),
    (UNIPC, {"solver_p": DDIMScheduler()}, "solver_p='DDIMScheduler'"),
    (ANCESTRAL, {"prediction_type": "sample"}, "prediction_type='sample'"),
    (LCM, {"thresholding": True}, "thresholding=True"),
]


@pytest.mark.parametrize("cls,config,match", REFUSED,
                         ids=[f"{c.__name__}-{m}" for c, _, m in REFUSED])
def test_refused_settings_are_named(cls, config, match):
    if config.get("algorithm_type") in ("dpmsolver", "sde-dpmsolver"):
        with pytest.warns(FutureWarning, match="algorithm_type .*dpmsolver is deprecated"):
            scheduler = cls(**config)
    else:
        scheduler = cls(**config)
    with pytest.raises(ValueError, match=f"{cls.__name__}: {match} is not supported.*supported"):
        readers.reader(scheduler, 7)


def test_refused_options_and_inputs():
    with pytest.raises(ValueError, match=r"EulerDiscreteScheduler: s_churn=0.5 is not supp"):
        readers.reader(EULER(), 7, s_churn=0.5)
    with pytest.raises(ValueError, match=r"DDIMScheduler has no reader.*supported: "
                                         r"DPMSolverMultistepScheduler"):
        readers.reader(DDIMScheduler(), 7)

    class Mine(EULER):
        pass

    with pytest.raises(ValueError, match="expected diffusers' EulerDiscreteScheduler, got"):
        EulerDiscreteReader(Mine(), 7)
    # a schedule whose first timestep repeats starts diffusers' step index at its second
    # occurrence (index_for_timestep); stand in for one
    s = EULER()
    s.index_for_timestep = lambda timestep, schedule_timesteps=None: 2
    with pytest.raises(ValueError, match="first step index=2 is not supported"):
        readers.reader(s, 7)
    r = readers.reader(DPM(), 7)
    latents = torch.zeros(SHAPE, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dtype=torch.int32 is not supported.*float32"):
        r.initial(latents)
    x = torch.zeros((2, 1, *SHAPE))
    with pytest.raises(ValueError, match=r"dtype=torch.int64 is not supported"):
        r.step(0, 2, x, x[:, 0].long())
    with pytest.raises(ValueError, match=r"past must hold the records of the 1 steps before "
                                         r"step 3"):
        r.step(3, 5, x, x[:, 0])
    with pytest.raises(ValueError, match=r"steps \[6, 8\) of 7"):
        r.step(6, 8, x, x[:, 0])
    sde = readers.reader(DPM(**SDE), 7)
    with pytest.raises(ValueError, match=r"z: the steps \[0, 2\) of DPMSolverMultistepScheduler "
                                         r"draw noise; pass their 2 noise rows.*got None"):
        sde.step(0, 2, x, x[:, 0])
    with pytest.raises(ValueError, match="a cuda generator cannot draw noise for cpu"):
        readers.draw_noise(r, SHAPE, generator=_FakeGenerator(), dtype=torch.float32)


class _FakeGenerator:
    """Stands for a generator on another device (no GPU here to make a real one)."""

    device = torch.device("cuda")


JACOBI = ["dpm3", "sde3", "unipc3", "unipc2-karras-nocorr", "heun-v-karras", "ancestral",
          "flow-stochastic", "lcm"]


@pytest.mark.parametrize("case", [c for c in CONFIGS if c[0] in JACOBI],
                         ids=[i for i in IDS if i in JACOBI])
def test_the_states_are_a_triangular_system(case, device):
    """Jacobi iteration on all the states at once (every step from the previous iterate, one
    batched model call per iteration): after ``i`` iterations the first ``i + 1`` states are the
    loop's bit for bit, so after ``K`` they all are (history and UniPC's carry included)."""
    _, cls, config, mu = case
    model = Elementwise().to(device)
    r, latents, z = run_reader(cls, config, mu, model, 7, torch.float32, device)
    ref = trajectory(r, model, latents, z)[0]
    K, B = r.K, SHAPE[0]
    X = ref[:1].repeat(K + 1, *([1] * (ref.dim() - 1)))   # every state guessed as x_0
    t = r.timesteps.to(device).repeat_interleave(B)
    for i in range(K):
        x_in = r.model_input(0, K, X[:K])
        out = model(x_in.reshape(K * B, *SHAPE[1:]), t).reshape(K, *SHAPE)
        new, _ = r.step(0, K, X[:K], out, (), z)
        X = torch.cat([X[:1], new])
        assert same(X[: i + 2], ref[: i + 2]), i
    assert not same(ref[-1], ref[0])


# -- reading once: the memo of what a reader computed (readers._READ) ---------------------------
def test_a_second_scheduler_of_the_same_configuration_is_read_from_memory(device):
    readers._READ.clear()
    a = readers.reader(make(DPM, {"solver_order": 3}), 25, device=device)
    b = readers.reader(make(DPM, {"solver_order": 3}), 25, device=device)
    assert len(readers._READ) == 1
    # served, not read again (one entry), each reader with its own copy of the columns
    assert all(torch.equal(b._cols[k].nan_to_num(7.0), a._cols[k].nan_to_num(7.0))
               for k in a._cols)   # (NaN where a step has no such coefficient)
    assert all(b._cols[k] is not a._cols[k] for k in a._cols)
    assert b.kinds == a.kinds and b.kinds is not a.kinds        # (lists copied)
    b.kinds.append("x")
    assert readers.reader(make(DPM, {"solver_order": 3}), 25, device=device).kinds == a.kinds
    # another configuration, number of steps or mu: read anew
    readers.reader(make(DPM, {"solver_order": 2}), 25, device=device)
    readers.reader(make(DPM, {"solver_order": 3}), 24, device=device)
    readers.reader(make(FLOW, {"use_dynamic_shifting": True}), 25, mu=0.5, device=device)
    readers.reader(make(FLOW, {"use_dynamic_shifting": True}), 25, mu=0.7, device=device)
    assert len(readers._READ) == 5
    # settings that compare equal in Python but are others: typed, floats by their repr
    fp = readers._fingerprint
    assert fp(True) != fp(1) and fp(0.0) != fp(-0.0) and fp(1) != fp(1.0)
    assert fp(torch.zeros(2)) != fp(torch.zeros(2, dtype=torch.float64))
    assert fp(torch.zeros(2)) != fp(torch.zeros(1, 2)) and fp(torch.ones(2)) == fp(torch.ones(2))
    assert fp([1, object()]) is NotImplemented
    # bounded: the oldest go first
    for steps in range(2, 2 + readers.MEMO + 3):
        readers.reader(make(EULER, {}), steps, device=device)
    assert len(readers._READ) == readers.MEMO


def test_a_scheduler_changed_outside_its_configuration_is_read_again(device):
    """A scheduler whose state differs from a remembered one in anything but its configuration
    (here its ``alphas_cumprod``, which its sigmas come from) is read anew, and its loop through
    the reader stays the diffusers loop bit for bit; one holding an attribute the fingerprint
    does not cover is never served from memory."""
    readers._READ.clear()
    model = Mix().to(device)

    def changed():
        s = make(DPM, {})
        s.alphas_cumprod = s.alphas_cumprod * 0.995
        return s

    plain = readers.reader(make(DPM, {}), 7, device=device)
    other = readers.reader(changed(), 7, device=device)
    assert len(readers._READ) == 2
    assert not torch.equal(other._cols["x"], plain._cols["x"])
    ref, _ = diffusers_loop(model, changed(), 7, torch.float32, device)
    g = torch.Generator().manual_seed(0)
    latents, z = readers.draw_noise(other, SHAPE, generator=g, dtype=torch.float32,
                                    device=device)
    assert same(readers.loop(other, model, latents, z), ref[-1])

    odd = make(DPM, {})
    odd.note = object()   # (no fingerprint for it)
    first = readers.reader(odd, 7, device=device)
    again = readers.reader(odd, 7, device=device)
    assert len(readers._READ) == 2 and again._cols["x"] is not first._cols["x"]
    assert torch.equal(again._cols["x"], plain._cols["x"])


def test_a_method_patched_on_the_scheduler_class_is_read_again(device, monkeypatch):
    """LCM's reader calls the scheduler's ``get_scalings_for_boundary_condition_discrete``; with
    that method replaced on the class (a patch), the reader reads again, and its loop is the
    patched diffusers loop bit for bit."""
    readers._READ.clear()
    model = Mix().to(device)
    plain = readers.reader(make(LCM, {}), 7, device=device)
    original = LCM.get_scalings_for_boundary_condition_discrete

    def scaled(self, timestep):
        c_skip, c_out = original(self, timestep)
        return c_skip * 0.5, c_out
    monkeypatch.setattr(LCM, "get_scalings_for_boundary_condition_discrete", scaled)
    patched = readers.reader(make(LCM, {}), 7, device=device)
    assert len(readers._READ) == 2
    assert not torch.equal(patched._cols["skip"], plain._cols["skip"])
    ref, _ = diffusers_loop(model, make(LCM, {}), 7, torch.float32, device)
    g = torch.Generator().manual_seed(0)
    latents, z = readers.draw_noise(patched, SHAPE, generator=g, dtype=torch.float32,
                                    device=device)
    assert same(readers.loop(patched, model, latents, z), ref[-1])


def test_memory_copies_survive_inference_mode_patches_and_odd_attributes(device):
    """What the memory keeps and serves: copies (a reader changing its columns in place does not
    change another's), made outside inference mode (a reader served after a read under
    ``torch.inference_mode`` works with autograd); a patch of any type on the scheduler's class
    reads again; an attribute whose bytes cannot be read (a meta tensor) is no error, no memo."""
    import functools

    readers._READ.clear()
    with torch.inference_mode():
        first = readers.reader(make(EULER, {}), 7, device=device)
    served = readers.reader(make(EULER, {}), 7, device=device)
    assert len(readers._READ) == 1 and not served._cols["dt"].is_inference()
    before = first._cols["dt"].clone()
    served._cols["dt"].mul_(2)
    again = readers.reader(make(EULER, {}), 7, device=device)
    assert torch.equal(again._cols["dt"], before) and torch.equal(first._cols["dt"], before)
    x = torch.randn(SHAPE, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    latents, z = readers.draw_noise(again, SHAPE, generator=g, dtype=torch.float32,
                                    device=device)
    readers.loop(again, lambda u, t: torch.tanh(u + x.to(u.device)), latents, z).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())

    original = LCM.get_scalings_for_boundary_condition_discrete
    cols = []
    try:
        for f in (0.5, 0.25):
            LCM.get_scalings_for_boundary_condition_discrete = functools.partialmethod(
                lambda self, timestep, f: (original(self, timestep)[0] * f,
                                           original(self, timestep)[1]), f=f)
            cols.append(readers.reader(make(LCM, {}), 7, device=device)._cols["skip"])
    finally:
        LCM.get_scalings_for_boundary_condition_discrete = original
    assert not torch.equal(cols[0], cols[1])

    odd = make(EULER, {})
    odd.extra = torch.empty(3, device="meta")
    count = len(readers._READ)
    assert torch.equal(readers.reader(odd, 7, device=device)._cols["dt"], before)
    assert len(readers._READ) == count
