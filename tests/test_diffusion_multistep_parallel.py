"""DPM-Solver++ of order 2 and 3 (``DPMSolverMultistepScheduler``) and UniPC
(``UniPCMultistepScheduler``, predictor and corrector) in parallel: step ``s`` reads the converted
model outputs of the steps before it, which the chain evaluates in the window's own model call
(or takes from the certified prefix); UniPC's states carry the corrected sample before them.
``picard`` (any window) and ``anderson`` at ``tol=0`` return the diffusers loop's sample bit for
bit (float32 and float64 at 1, 7, 25 and 50 steps; bfloat16 and float16 at any ``tol``), never
with more model calls in sequence than steps; at ``tol > 0`` a converged sample is within ``tol``
of the loop's, with the two-input error recurrence, also for models built to break it
(expanding, batch-variant)."""

import inspect
import math
import re
import warnings

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers.utils.torch_utils import randn_tensor  # noqa: E402

from diffusion_cases import DPM, EULER, READER_MARKS, SDE, UNIPC, RowEps  # noqa: E402, I001
from paraprop.diffusion import BatchVarianceWarning, DiffusionChain, readers, sample  # noqa: E402
from paraprop.diffusion.gains import bounds, carried_gains  # noqa: E402
from paraprop.diffusion.programs import HistoryProgram  # noqa: E402

pytestmark = READER_MARKS

SHAPE = (3, 2)
# (UniPC's configurations carry their class: "cls")
CONFIGS = {
    "dpm2": {},
    "dpm2-karras": {"use_karras_sigmas": True},
    "dpm2-no-lof": {"lower_order_final": False},
    "dpm2-heun-v": {"solver_type": "heun", "prediction_type": "v_prediction"},
    "dpm2-sample": {"prediction_type": "sample"},
    "sde2": SDE,
    "dpm3": {"solver_order": 3},
    "sde3-karras": {**SDE, "solver_order": 3, "use_karras_sigmas": True},
    "unipc2": {"cls": UNIPC},
    "unipc1": {"cls": UNIPC, "solver_order": 1},
    "unipc3-karras-nocorr": {"cls": UNIPC, "solver_order": 3, "use_karras_sigmas": True,
                             "disable_corrector": [0, 3]},
    "unipc3-bh1-noise": {"cls": UNIPC, "solver_order": 3, "solver_type": "bh1",
                         "predict_x0": False, "final_sigmas_type": "sigma_min"},
    "unipc2-v": {"cls": UNIPC, "prediction_type": "v_prediction"},
}


def make(cfg):
    """The scheduler of a configuration of :data:`CONFIGS`."""
    cfg = dict(cfg)
    return cfg.pop("cls", DPM)(**cfg)
METHODS = [("picard", None), ("picard", 4), ("picard", 1), ("anderson", None)]


def gen(seed=1):
    return torch.Generator().manual_seed(seed)


def diffusers_loop(model, scheduler, steps, dtype, device="cpu", seed=1, shape=SHAPE):
    """The pipelines' loop, written here: one CPU generator for the latents and the steps'
    noise, latents scaled by init_noise_sigma."""
    g = gen(seed)
    scheduler.set_timesteps(steps, device=device)
    x = randn_tensor(shape, generator=g, device=torch.device(device), dtype=dtype)
    x = x * scheduler.init_noise_sigma
    kw = {"generator": g} if "generator" in inspect.signature(scheduler.step).parameters else {}
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(model(scheduler.scale_model_input(x, t), t), t, x,
                               **kw).prev_sample
    return x


def run(cfg, model, steps, dtype=torch.float32, device="cpu", seed=1, shape=SHAPE, **kw):
    return sample(model, make(cfg), shape, num_inference_steps=steps, dtype=dtype,
                  device=device, generator=gen(seed), **kw)


# -- tol=0: the loop's bits ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_dpm_solver_2m_is_the_loop_bitwise(dtype, device):
    """DPM-Solver++ 2M, the default configuration, every parallel method at 1, 7, 25 and 50
    steps."""
    model = RowEps().to(device)
    for steps in (1, 7, 25, 50):
        ref = diffusers_loop(model, DPM(), steps, dtype, device)
        for method, window in METHODS:
            x, sol = run({}, model, steps, dtype, device, method=method, window=window, tol=0)
            assert torch.equal(x, ref), (steps, method, window)
            assert sol.converged and sol.stats["certificate"] == "bitwise"
            assert sol.iterations == sol.stats["model_calls"] <= steps
            assert sol.stats["loop_bitwise"] in (True, None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_setting_is_the_loop_bitwise(name, device):
    """Karras sigmas, ``lower_order_final`` off, the Heun solver type, other predictions, the
    SDE variant (its noise drawn in float32) and order 3."""
    cfg, model = CONFIGS[name], RowEps().to(device)
    for steps in (7, 25):
        ref = diffusers_loop(model, make(cfg), steps, torch.float32, device)
        for method, window in METHODS[:2] + METHODS[3:]:
            x, sol = run(cfg, model, steps, device=device, method=method, window=window, tol=0)
            assert torch.equal(x, ref), (steps, method, window)
            assert sol.converged and sol.stats["model_calls"] <= steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", ["dpm2", "sde2", "dpm3", "unipc2", "unipc3-karras-nocorr"])
def test_low_precision_is_the_loop_bitwise_at_any_tol(name, dtype, device):
    """bfloat16 and float16 certify by the loop's bits only, at every tol."""
    cfg, model = CONFIGS[name], RowEps().to(device)
    ref = diffusers_loop(model, make(cfg), 12, dtype, device)
    for method, window in (("picard", 4), ("anderson", None)):
        for tol in (0, 1e-2):
            x, sol = run(cfg, model, 12, dtype, device, method=method, window=window, tol=tol)
            assert torch.equal(x, ref) and sol.stats["certificate"] == "bitwise"
            assert not sol.stats["tol_resolvable"] and sol.stats["model_calls"] <= 12


def test_picard_takes_fewer_calls_than_steps():
    """The contracting model: the window certifies several steps per call, history and all."""
    for cfg in (CONFIGS["dpm2"], CONFIGS["dpm3"]):
        x, sol = run(cfg, RowEps(), 25, method="picard", tol=0)
        spot = 24 in sol.stats["batch_checked_steps"]
        assert sol.converged and sol.stats["model_calls"] - spot < 25, sol.stats["model_calls"]


def test_the_steps_before_a_window_are_evaluated_in_its_call():
    """A window that starts past the certified prefix evaluates the step before it in the same
    call (its converted output is the window's history): more rows, no more calls."""
    calls = []

    def model(x, t):
        calls.append(len(x))
        return RowEps()(x, t)

    ref = diffusers_loop(RowEps(), DPM(), 25, torch.float32)
    x, sol = run({}, model, 25, method="picard", window=4, tol=0)
    assert torch.equal(x, ref) and sol.stats["model_calls"] <= 25
    assert sum(calls) == 3 * sol.stats["model_evaluations"]
    assert max(calls) <= 3 * 5   # (a window of 4 steps and the step before it)


def test_sequential_and_model_kwargs():
    """``method="sequential"`` stays the loop through the reader; a per-sample model argument
    reaches every row of a window."""
    gain = torch.tensor([0.5, 1.0, 2.0])

    def model(x, t, gain):   # (the chain tiles gain over a window's rows)
        return RowEps()(x, t, gain=gain)

    g = gen()
    scheduler = DPM()
    scheduler.set_timesteps(9)
    ref = randn_tensor(SHAPE, generator=g)
    for t in scheduler.timesteps:
        ref = scheduler.step(model(ref, t, gain), t, ref).prev_sample
    for method in ("sequential", "picard", "anderson"):
        x, _ = run({}, model, 9, method=method, tol=0, gain=gain)
        assert torch.equal(x, ref), method
    plain, _ = run({}, RowEps(), 9, method="picard", tol=0)
    assert not torch.equal(plain, ref)


# -- the step's reaction to its model outputs ----------------------------------------------------

@pytest.mark.parametrize("name", ["dpm2", "dpm2-heun-v", "sde3-karras", "unipc2",
                                  "unipc3-bh1-noise"])
def test_output_gains_are_the_steps_derivatives(name):
    """``own_output_gains``: ``|d step_s / d out_s|``; ``output_gains``: the sum over the model
    outputs the step reads (its own and those of the steps before it, through their
    records), each the largest over the state's parts (UniPC), against autograd through the
    reader's step and records."""
    p = HistoryProgram(readers.reader(make(CONFIGS[name]), 6))
    own, total = p.own_output_gains(), p.output_gains()
    g = torch.Generator().manual_seed(0)
    F = 3 * p.parts   # (UniPC's states: the sample and the corrected sample before it)
    for s in range(p.N):
        h = min(p.history, s)
        x = torch.randn(1, 1, F, generator=g, dtype=torch.float64) * 0.1
        xs = torch.randn(h, 1, F, generator=g, dtype=torch.float64) * 0.1
        outs = torch.randn(h + 1, 1, 3, generator=g, dtype=torch.float64).requires_grad_()
        past = torch.cat([p.records(s - h + j, s - h + j + 1, xs[j: j + 1], outs[j: j + 1])
                          for j in range(h)]) if h else torch.zeros(0, 1, 3, dtype=x.dtype)
        y, _ = p.apply_history(slice(s, s + 1), x, outs[h:], torch.zeros(1, 1, 3), past)
        # per part of the state (the largest counts), per model output read
        d = torch.stack([torch.autograd.grad(y[0, 0, 3 * q], outs, retain_graph=True)[0]
                         .abs()[:, 0, 0] for q in range(p.parts)]).amax(0)
        torch.testing.assert_close(d[h], own[s], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(d.sum(), total[s], rtol=1e-5, atol=1e-9)


# -- tol > 0: the two-input certificate ----------------------------------------------------------

def test_the_two_input_recurrence_bounds_every_error():
    """``e_s <= g_s max(e_{s-1}, e_{s-2}) + r_s`` at its worst (equality), gains below and
    above 1: the bound of :func:`bounds` with the history gains (``max(g, 1)``) is never below
    it; with the one-input gains it is (the Markov certificate would be unsound here)."""
    g = torch.Generator().manual_seed(0)
    N = 30
    for trial in range(20):
        gain = torch.rand(1, N, generator=g, dtype=torch.float64) * (0.6 + trial / 10)
        r = torch.rand(1, N, generator=g, dtype=torch.float64) * 1e-3
        e = torch.zeros(N, dtype=torch.float64)
        for s in range(N):
            prev = max(e[s - 1] if s >= 1 else 0.0, e[s - 2] if s >= 2 else 0.0)
            e[s] = gain[0, s] * prev + r[0, s]
        X = torch.zeros(1, N, 1, dtype=torch.float64)
        y = r[:, :, None]   # defects r_s = |y_s - X_s|
        p = torch.zeros(1, dtype=torch.long)
        two = carried_gains(gain, 1, N, "cpu", history=1)
        E, _, _ = bounds(X, y, p, two, torch.float64, loop=False)
        assert float(E) >= float(e.max()) * (1 - 1e-12)
    one = carried_gains(torch.full((1, N), 0.5, dtype=torch.float64), 1, N, "cpu")
    r = torch.full((1, N, 1), 1e-3, dtype=torch.float64)
    e = torch.zeros(N, dtype=torch.float64)
    for s in range(N):
        e[s] = 0.5 * max(e[s - 1] if s >= 1 else 0.0, e[s - 2] if s >= 2 else 0.0) + 1e-3
    E_one, _, _ = bounds(torch.zeros(1, N, 1, dtype=torch.float64), r,
                         torch.zeros(1, dtype=torch.long), one, torch.float64, loop=False)
    assert math.isclose(float(e.max()), 2e-3, rel_tol=1e-6)   # (0.5 * 2e-3 + 1e-3)
    assert float(E_one) >= float(e.max()) * (1 - 1e-9)        # (equal here: geometric)


@pytest.mark.parametrize("name", ["dpm2", "dpm2-karras", "sde2", "dpm3", "unipc2",
                                  "unipc3-bh1-noise"])
def test_tol_is_within_tol_of_the_loop(name):
    cfg = CONFIGS[name]
    ref = diffusers_loop(RowEps(), make(cfg), 25, torch.float32)
    for method, window in METHODS:
        x, sol = run(cfg, RowEps(), 25, method=method, window=window, tol=1e-3)
        assert sol.converged and sol.stats["model_calls"] <= 25
        assert float((x - ref).abs().max()) <= 1e-3
        assert sol.stats["error_estimate"] <= 1e-3


class Expanding(torch.nn.Module):
    """A 4-feature model with large weights (per-row products, no batch variance): with
    ``prediction_type="sample"`` its converted outputs, and so the steps, expand differences
    several times each."""

    def __init__(self, seed=0, scale=1.2):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(5, 16, generator=g) * scale)
        self.w2 = torch.nn.Parameter(torch.randn(16, 4, generator=g) * scale)
        self.requires_grad_(False)

    def forward(self, x, t):
        B = len(x)
        tt = torch.as_tensor(t).reshape(-1).expand(B).to(x.dtype) / 1000
        inp = torch.cat([x.reshape(B, 4), tt[:, None]], 1)
        h = torch.sin((inp[:, :, None] * self.w1.to(x.dtype)).sum(1) * 2)
        return (h[:, :, None] * self.w2.to(x.dtype)).sum(1).reshape(x.shape)


def expanding_sweep(schedulers, steps: int, calls: int, dtype) -> int:
    """Every parallel method at tol 1e-2 and 1e-4 on two expanding models, for each scheduler
    of ``schedulers`` (zero-argument callables): each ``converged=True`` within ``tol`` of the
    real diffusers loop, each refusal naming the budget of ``calls`` (the loop's model calls),
    never more calls than that. Returns how many runs converged (the caller asserts enough, so
    that the check cannot pass vacuously)."""
    shape = (3, 2, 2)
    converged = 0
    for seed in range(2):
        model = Expanding(seed).to(dtype)
        for make_scheduler in schedulers:
            ref = diffusers_loop(model, make_scheduler(), steps, dtype, shape=shape).double()
            for method, window in (("picard", None), ("picard", 5), ("anderson", None)):
                for tol in (1e-2, 1e-4):
                    x, sol = sample(model, make_scheduler(), shape, num_inference_steps=steps,
                                    dtype=dtype, generator=gen(1), method=method,
                                    window=window, tol=tol, throw=False)
                    assert sol.iterations <= calls
                    if sol.converged:
                        converged += 1
                        err = float((x.double() - ref).abs().max())
                        assert err <= tol, (seed, method, window, tol, err)
                    else:
                        assert re.search(rf"budget of {calls}", sol.stats["reason"])
    return converged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_a_model_built_to_expand_is_certified_within_tol_or_refused(dtype):
    """Every ``converged=True`` is within ``tol`` of the real diffusers loop, over expanding
    models, both solver orders and tolerances; a refusal names its reason."""
    configs = ({"prediction_type": "sample"}, {"prediction_type": "sample", "solver_order": 3},
               {"cls": UNIPC, "prediction_type": "sample"})
    assert expanding_sweep([lambda c=c: make(c) for c in configs], 20, 20, dtype) >= 6


class BatchVariant(torch.nn.Module):
    """Differs from its own loop calls only in calls of more rows than the loop's: ``where``
    says which rows (``"all"``, ``"tail"``: the last ``B`` rows, as a kernel's tail block may;
    ``"late"``: every step but step 0)."""

    def __init__(self, where="all", rows=3, size=1e-3):
        super().__init__()
        self.where, self.rows, self.size = where, rows, size

    def forward(self, x, t):
        out = RowEps()(x, t)
        if x.shape[0] <= self.rows:
            return out
        if self.where == "all":
            return out + self.size
        if self.where == "tail":
            return torch.cat([out[: -self.rows], out[-self.rows:] + self.size])
        t = torch.as_tensor(t).reshape(-1)
        return out + self.size * (t != t.max()).to(x.dtype).reshape(-1, 1)


@pytest.mark.parametrize("name", ["dpm2", "unipc2"])
@pytest.mark.parametrize("where", ["all", "tail", "late"])
@pytest.mark.parametrize("method", ["picard", "anderson"])
def test_batch_variance_is_never_certified_bitwise(where, method, name):
    """The batch-variance spot checks (step 0 in the first batched call, the last step in the
    loop's own call, its records from the certified prefix) with history: ``tol=0`` is refused
    naming the rows; a certified ``tol > 0`` is within ``tol`` of the loop. (25 steps for
    DPM-Solver++, 40 for UniPC: the budget leaves the last step's check a call, which it
    needs.)"""
    model, cfg = BatchVariant(where), CONFIGS[name]
    N = 40 if name.startswith("unipc") else 25
    ref = diffusers_loop(model, make(cfg), N, torch.float32)
    x, sol = run(cfg, model, N, method=method, tol=0, throw=False)
    assert not sol.converged and sol.stats["loop_bitwise"] is False
    assert "rounds differently on the batched calls" in sol.stats["reason"]
    if where == "late":
        assert sol.stats["batch_checked_steps"] == [0, N - 1]
        assert f"its output for step {N - 1} differs" in sol.stats["reason"]
    assert sol.stats["model_calls"] <= N
    for tol in (1e-3, 1e-1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BatchVarianceWarning)
            x, sol = run(cfg, model, N, method=method, tol=tol, throw=False)
        assert sol.stats["model_calls"] <= N and sol.stats["loop_bitwise"] is False
        if sol.converged:
            assert float((x - ref).abs().max()) <= tol, (tol, sol.stats["error_estimate"])
        else:
            assert sol.stats["reason"]


def test_the_last_step_check_runs_with_history():
    """A batch-invariant model: the loop's call of the last step (its records from the
    certified prefix) agrees, and the sample is the loop's."""
    ref = diffusers_loop(RowEps(), DPM(), 25, torch.float32)
    x, sol = run({}, RowEps(), 25, method="picard", tol=0)
    assert torch.equal(x, ref) and sol.stats["loop_bitwise"] is True
    assert sol.stats["batch_checked_steps"] == [0, 24]


def test_misuse_of_the_history_program_and_chain_is_refused_by_name():
    with pytest.raises(ValueError, match=r"HistoryProgram: EulerDiscreteScheduler is not read "
                                         r"in parallel \(history=0, parts=1\); supported: "
                                         r"DPMSolverMultistepScheduler, UniPCMultistepScheduler, "
                                         r"HeunDiscreteScheduler with history"):
        HistoryProgram(readers.reader(EULER(), 5))
    with pytest.raises(ValueError, match=r"HistoryProgram: DPMSolverMultistepScheduler with "
                                         r"solver_order=1 is not read in parallel"):
        HistoryProgram(readers.reader(DPM(solver_order=1), 5))
    p = HistoryProgram(readers.reader(DPM(), 5))
    x = torch.zeros(1, 3, 2)
    with pytest.raises(TypeError, match="a step reads the records of the steps before it; use "
                                        "apply_history"):
        p.apply(slice(0, 1), x, x, x)
    chain = DiffusionChain(RowEps(), p, torch.zeros(3, 2), torch.zeros(5, 3, 2))
    with pytest.raises(ValueError, match=r"chain: steps \[2, 4\) read the records of the 1 steps "
                                         r"before them: pass their inputs \(hist\) and records"):
        chain.steps(torch.zeros(3, 2, 2), 2, 4)
    # the loop from a step past a sample's certified prefix needs the records before it
    with pytest.raises(ValueError, match=r"chain.sequential: the loop from step 3 reads the "
                                         r"records of the 1 steps before it, and some sample "
                                         r"is certified only to step 0: pass their records "
                                         r"computed from the trajectory \(shape \(3, 1, 2\)\)"):
        chain.sequential(torch.zeros(3, 5, 2), 3)
