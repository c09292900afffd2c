"""Heun (``HeunDiscreteScheduler``) in parallel: its loop makes ``K = 2 N - 1`` model calls,
alternating the first (Euler) evaluation of a step and the second (the trapezoidal correction),
which reads the first's derivative and input sample. The chain carries those two tensors as one
record per step (:class:`~paraprop.diffusion.programs.HistoryProgram`, ``record_parts=2``), so
``picard`` (any window) and ``anderson`` at ``tol=0`` return the diffusers loop's sample bit for
bit (float32 and float64 at 1, 7, 25 and 50 steps; bfloat16 and float16 at any ``tol``), never
with more model calls in sequence than the loop's ``K``; at ``tol > 0`` a converged sample is
within ``tol`` of the loop's, also for models built to break it (expanding, batch-variant)."""

import warnings

import pytest
import torch

pytest.importorskip("diffusers")

from diffusion_cases import HEUN, READER_MARKS, RowEps  # noqa: E402, I001
from test_diffusion_multistep_parallel import (  # noqa: E402
    BatchVariant,
    diffusers_loop,
    expanding_sweep,
    gen,
)
from paraprop.diffusion import BatchVarianceWarning, readers, sample  # noqa: E402
from paraprop.diffusion.programs import HistoryProgram  # noqa: E402

pytestmark = READER_MARKS

SHAPE = (3, 2)
CONFIGS = {
    "default": {},
    "karras": {"use_karras_sigmas": True},
    "v": {"prediction_type": "v_prediction"},
    "sample-clip": {"prediction_type": "sample", "clip_sample": True},
    "exponential-trailing": {"use_exponential_sigmas": True, "timestep_spacing": "trailing"},
}
METHODS = [("picard", None), ("picard", 4), ("picard", 1), ("anderson", None)]


def run(cfg, model, steps, dtype=torch.float32, device="cpu", seed=1, shape=SHAPE, **kw):
    return sample(model, HEUN(**cfg), shape, num_inference_steps=steps, dtype=dtype,
                  device=device, generator=gen(seed), **kw)


def loop_calls(steps: int) -> int:
    return 2 * steps - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_heun_is_the_loop_bitwise(dtype, device):
    """Every parallel method at 1, 7, 25 and 50 steps: the loop's bits, at most ``2 N - 1``
    model calls in sequence (the loop's)."""
    model = RowEps().to(device)
    for steps in (1, 7, 25, 50):
        ref = diffusers_loop(model, HEUN(), steps, dtype, device)
        for method, window in METHODS if steps < 50 else METHODS[:1] + METHODS[3:]:
            x, sol = run({}, model, steps, dtype, device, method=method, window=window, tol=0)
            assert torch.equal(x, ref), (steps, method, window)
            assert sol.converged and sol.stats["certificate"] == "bitwise"
            assert sol.iterations == sol.stats["model_calls"] <= loop_calls(steps)
            assert sol.stats["loop_bitwise"] in (True, None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_setting_is_the_loop_bitwise(name, device):
    """Karras and exponential sigmas, ``v_prediction``, ``sample`` with ``clip_sample`` (the
    second evaluation clips too)."""
    cfg, model = CONFIGS[name], RowEps().to(device)
    for steps in (7, 25):
        ref = diffusers_loop(model, HEUN(**cfg), steps, torch.float32, device)
        for method, window in METHODS[:2] + METHODS[3:]:
            x, sol = run(cfg, model, steps, device=device, method=method, window=window, tol=0)
            assert torch.equal(x, ref), (steps, method, window)
            assert sol.converged and sol.stats["model_calls"] <= loop_calls(steps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_low_precision_is_the_loop_bitwise_at_any_tol(dtype, device):
    """bfloat16 and float16 certify by the loop's bits only, at every tol (Heun computes in
    the sample's dtype)."""
    model = RowEps().to(device)
    for name in ("default", "karras"):
        ref = diffusers_loop(model, HEUN(**CONFIGS[name]), 12, dtype, device)
        for method, window in (("picard", 4), ("anderson", None)):
            for tol in (0, 1e-2):
                x, sol = run(CONFIGS[name], model, 12, dtype, device, method=method,
                             window=window, tol=tol)
                assert torch.equal(x, ref) and sol.stats["certificate"] == "bitwise"
                assert sol.stats["model_calls"] <= loop_calls(12)


def test_picard_takes_fewer_calls_than_the_loop():
    """The contracting model: several of Heun's evaluations certified per call."""
    x, sol = run({}, RowEps(), 25, method="picard", tol=0)
    assert sol.converged and sol.stats["model_calls"] < loop_calls(25) - 5, \
        sol.stats["model_calls"]


def test_the_records_are_the_derivative_and_the_sample_side_by_side():
    """The chain's record of a first evaluation: its derivative, then its input sample (each
    ``R`` values); a second evaluation's record is read by no step (zeros)."""
    p = HistoryProgram(readers.reader(HEUN(), 4))
    assert (p.N, p.history, p.record_parts) == (7, 1, 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, generator=g)     # (n, B, R): steps 0 (first) and 1 (second)
    out = torch.randn(2, 3, 2, generator=g)
    rec = p.records(0, 2, x, out)
    assert rec.shape == (2, 3, 4)
    torch.testing.assert_close(rec[0, :, 2:], x[0], rtol=0, atol=0)
    assert not torch.equal(rec[0, :, :2], torch.zeros(3, 2))
    assert torch.equal(rec[1], torch.zeros(3, 4))
    # the second evaluation reads them: the same as the reader's own step with both tensors
    y, _ = p.apply_history(slice(1, 2), x[1:], out[1:], torch.zeros(1, 3, 2), rec[:1])
    want, _ = p.reader.step(1, 2, x[1:, None], out[1:], (rec[:1, :, :2], rec[:1, :, 2:]))
    assert torch.equal(y, want[:, 0])


@pytest.mark.parametrize("name", ["default", "v", "sample-clip"])
def test_output_gains_are_the_steps_derivatives(name):
    """``|d step_s / d out_s|`` and the sum over the outputs step ``s`` reads (the second
    evaluation: its own and the first's, through the derivative record), against autograd
    through the reader's step and records, at small inputs (clipping inactive, as the gains
    assume: clipping only lowers them)."""
    p = HistoryProgram(readers.reader(HEUN(**CONFIGS[name]), 5))
    own, total = p.own_output_gains(), p.output_gains()
    g = torch.Generator().manual_seed(0)
    for s in range(p.N):
        h = min(p.history, s)
        x = torch.randn(1, 1, 3, generator=g, dtype=torch.float64) * 0.01
        xs = torch.randn(h, 1, 3, generator=g, dtype=torch.float64) * 0.01
        outs = (torch.randn(h + 1, 1, 3, generator=g, dtype=torch.float64) * 0.01
                ).requires_grad_()
        past = torch.cat([p.records(s - h + j, s - h + j + 1, xs[j: j + 1], outs[j: j + 1])
                          for j in range(h)]) if h else torch.zeros(0, 1, 6, dtype=x.dtype)
        y, _ = p.apply_history(slice(s, s + 1), x, outs[h:], torch.zeros(1, 1, 3), past)
        d = torch.autograd.grad(y[0, 0, 0], outs)[0].abs()[:, 0, 0]
        torch.testing.assert_close(d[h], own[s], rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(d.sum(), total[s], rtol=1e-6, atol=1e-12)
    assert (total > own).any()   # (the second evaluations read the first's output too)


@pytest.mark.parametrize("name", ["default", "karras", "sample-clip"])
def test_tol_is_within_tol_of_the_loop(name):
    cfg = CONFIGS[name]
    ref = diffusers_loop(RowEps(), HEUN(**cfg), 25, torch.float32)
    for method, window in METHODS:
        x, sol = run(cfg, RowEps(), 25, method=method, window=window, tol=1e-3)
        assert sol.converged and sol.stats["model_calls"] <= loop_calls(25)
        assert float((x - ref).abs().max()) <= 1e-3
        assert sol.stats["error_estimate"] <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_a_model_built_to_expand_is_certified_within_tol_or_refused(dtype):
    """Every ``converged=True`` is within ``tol`` of the real diffusers loop, over expanding
    models (``prediction_type="sample"``: the derivative divides by sigma)."""
    configs = ({"prediction_type": "sample"},
               {"prediction_type": "sample", "use_karras_sigmas": True})
    assert expanding_sweep([lambda c=c: HEUN(**c) for c in configs], 10, loop_calls(10),
                           dtype) >= 6


@pytest.mark.parametrize("where", ["all", "tail", "late"])
@pytest.mark.parametrize("method", ["picard", "anderson"])
def test_batch_variance_is_never_certified_bitwise(where, method):
    """The batch-variance spot checks with Heun's records: ``tol=0`` is refused naming the
    rows; a certified ``tol > 0`` is within ``tol`` of the loop."""
    model = BatchVariant(where)
    N = 20
    ref = diffusers_loop(model, HEUN(), N, torch.float32)
    x, sol = run({}, model, N, method=method, tol=0, throw=False)
    assert not sol.converged and sol.stats["loop_bitwise"] is False
    assert "rounds differently on the batched calls" in sol.stats["reason"]
    assert sol.stats["model_calls"] <= loop_calls(N)
    for tol in (1e-3, 1e-1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BatchVarianceWarning)
            x, sol = run({}, model, N, method=method, tol=tol, throw=False)
        assert sol.stats["model_calls"] <= loop_calls(N) and sol.stats["loop_bitwise"] is False
        if sol.converged:
            assert float((x - ref).abs().max()) <= tol, (tol, sol.stats["error_estimate"])
        else:
            assert sol.stats["reason"]


def test_a_pipeline_call_s_rows_are_placed_by_their_timesteps():
    """Under ``accelerate(pipe)`` the denoiser's batched calls are told apart by their
    timesteps; Heun's timesteps repeat (``t0, t1, t1, t2, t2, ...``), so a call's rows are
    placed where its run of timesteps fits the scheduler's, in order or reversed (the chain
    flips every other call), and a row that fits two steps is kept for both."""
    from paraprop.diffusion.pipeline_run import Run

    scheduler = HEUN()
    scheduler.set_timesteps(4)
    run = Run(4, None, scheduler)
    run._index_timesteps()
    ts = [float(v) for v in scheduler.timesteps.tolist()]
    assert len(ts) == 7 and ts[1] == ts[2] and ts[3] == ts[4] and run.loop_steps == 7
    assert run._steps_of(ts[1:4]) == [[1], [2], [3]]            # in order
    assert run._steps_of(ts[1:4][::-1]) == [[3], [2], [1]]      # reversed
    assert run._steps_of(ts[2:5]) == [[2], [3], [4]]
    assert run._steps_of([ts[0]]) == [[0]]                      # a timestep of one step
    assert run._steps_of([ts[1]]) == [[1, 2]]                   # one row: either step
    assert run._steps_of(ts[1:3]) == [[1, 2], [1, 2]]           # t1, t1: either order


@pytest.mark.parametrize(("steps", "tol"), [(25, 1e-3), (50, 1e-2)])
def test_the_loop_from_a_later_step_reads_the_trajectory_s_records(steps, tol):
    """The final check may finish a sample with the loop from a step ``q`` past its certified
    prefix (the error at ``q - 1`` carried on fits ``tol``): the loop's first step reads the
    records of the steps before ``q``, which are then those computed from the trajectory, not
    the certified ones (there are none there). Found on the shipped two-moons model, where
    Anderson's passes leave such a finish (the sample was 0.93 off the loop at tol=1e-3 when
    the loop read zeros)."""
    from paraprop_lab.demos import _weights

    model = _weights.load("ddpm")
    ref = diffusers_loop(model, HEUN(), steps, torch.float32, shape=(16, 2), seed=0)
    x, sol = sample(model, HEUN(), (16, 2), num_inference_steps=steps, method="anderson",
                    tol=tol, generator=gen(0))
    assert sol.stats["fallback_steps"] > 0 and sol.stats["certificate"] == "estimate"
    assert float((x - ref).abs().max()) <= tol
    assert sol.stats["model_calls"] <= loop_calls(steps)
    # the batch-variance spot check of a later step: the last one the batched calls computed,
    # before the loop's tail (the budget had a call left)
    last = loop_calls(steps) - sol.stats["fallback_steps"] - 1
    assert sol.stats["batch_checked_steps"] == [0, last] and sol.stats["loop_bitwise"] is True


class LateOnTop(torch.nn.Module):
    """``model`` whose calls of more rows than the loop's differ by ``size`` at every step but
    the first (a kernel that rounds apart only later: step 0's comparison cannot see it)."""

    def __init__(self, model, rows: int, size: float):
        super().__init__()
        self.model, self.rows, self.size = model, rows, size

    def forward(self, x, t):
        out = self.model(x, t)
        if x.shape[0] <= self.rows:
            return out
        t = torch.as_tensor(t).reshape(-1)
        return out + self.size * (t != t.max()).to(x.dtype).reshape(-1, 1)


@pytest.mark.parametrize("tol", [1e-3, 1e-2])
def test_the_spot_check_before_the_loop_s_tail_sees_a_late_batch_variance(tol):
    """Where the final check finishes with the loop (its tail computed by calls of the loop's
    rows), the batch-variance spot check compares the last step the batched calls computed,
    before that tail: a model that rounds apart only after step 0 is seen there, and nothing is
    certified that the carried difference does not fit (the reason says so)."""
    from paraprop_lab.demos import _weights

    model = LateOnTop(_weights.load("ddpm"), 16, 1e-6)
    x, sol = sample(model, HEUN(), (16, 2), num_inference_steps=25, method="anderson",
                    tol=tol, generator=gen(0), throw=False)
    checked = sol.stats["batch_checked_steps"]
    assert sol.stats["fallback_steps"] > 0 and len(checked) == 2
    assert checked[1] == loop_calls(25) - sol.stats["fallback_steps"] - 1
    assert not sol.converged and sol.stats["loop_bitwise"] is False
    assert "rounds differently on the batched calls" in sol.stats["reason"]
    assert f"its output for step {checked[1]} differs" in sol.stats["reason"]
