"""The rows of ``paraprop bench diffusion`` for the schedulers people run (issue 31): the
pipelines' loop is paraprop's sequential sample bit for bit, the parallel rows stay within the
tolerance in at most the loop's sequential calls, and the multistep solvers' parallel methods
are refused, checked, not assumed. Measures nothing (no wall-clock assertion)."""

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import (  # noqa: E402
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

from paraprop.models import MLPDenoiser  # noqa: E402
from paraprop_lab.bench import diffusion as suite  # noqa: E402
from paraprop_lab.experiments.diffusion import (  # noqa: E402
    SCHEDULER_COLUMNS,
    TOL,
    pipeline_loop,
    scheduler_rows,
)
from paraprop_lab.training.ddpm import sample_loop  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = (4, 2)
STEPS = 7


@pytest.fixture(scope="module")
def model():
    return MLPDenoiser(dim=2, seed=0).eval().requires_grad_(False)


@pytest.mark.parametrize("cls", [EulerDiscreteScheduler, EulerAncestralDiscreteScheduler,
                                 lambda: DPMSolverMultistepScheduler(solver_order=1)],
                         ids=["euler", "ancestral", "dpm1"])
def test_parallel_rows(cls, model):
    rows = scheduler_rows(model, "s", cls, SHAPE, STEPS, parallel=True, repeats=1)
    assert [r["method"] for r in rows][:2] == ["diffusers loop", "paraprop sequential"]
    assert rows[2]["method"].startswith("picard (window ")
    assert rows[3]["method"] == "anderson (memory 3)" and len(rows) == 4
    for r in rows:
        assert (r["scheduler"], r["steps"], r["parallel"]) == ("s", STEPS, "yes")
        assert set(SCHEDULER_COLUMNS) <= set(r)
        assert 1 <= r["iterations"] <= STEPS and r["model_evals"] >= r["iterations"]
        assert r["time_ms"] > 0 and r["speedup"] > 0
    # the loop and the sequential sample: the same bits; the parallel ones: within tol
    assert rows[0]["max_abs_err"] == rows[1]["max_abs_err"] == 0
    assert all(r["max_abs_err"] <= TOL for r in rows[2:])


@pytest.mark.parametrize("cls", [DPMSolverMultistepScheduler, UniPCMultistepScheduler],
                         ids=["dpm2m", "unipc"])
def test_multistep_rows_are_sequential_with_the_refusals(cls, model):
    rows = scheduler_rows(model, "m", cls, SHAPE, STEPS, parallel=False, repeats=1)
    assert [r["method"] for r in rows] == ["diffusers loop", "paraprop sequential", "picard",
                                           "anderson"]
    assert rows[0]["max_abs_err"] == rows[1]["max_abs_err"] == 0
    assert rows[1]["iterations"] == STEPS
    for r in rows[2:]:
        assert r["parallel"].startswith("refused (NotImplementedError")
        assert f"method='{r['method']}' is not implemented for {cls.__name__}" in r["refusal"]
        assert r.get("iterations") is None and r.get("time_ms") is None


def test_a_parallel_scheduler_listed_as_refused_is_an_error(model):
    with pytest.raises(RuntimeError, match=r"e: method='picard' ran; it was to be refused"):
        scheduler_rows(model, "e", EulerDiscreteScheduler, SHAPE, STEPS, parallel=False,
                       repeats=1)


def test_pipeline_loop_draws_what_sample_loop_draws_for_ddpm(model):
    want = sample_loop(model, DDPMScheduler(clip_sample=False), SHAPE, STEPS, seed=3)
    got = pipeline_loop(model, DDPMScheduler(clip_sample=False), SHAPE, STEPS, seed=3)
    assert torch.equal(got, want)
    other = pipeline_loop(model, DDPMScheduler(clip_sample=False), SHAPE, STEPS, seed=4)
    assert not torch.equal(other, want)


def test_the_suite_lists_the_schedulers_and_what_it_leaves_out():
    assert [(s[0], s[3]) for s in suite.SCHEDULERS] == [
        ("Euler", True), ("Euler ancestral", True), ("DPM-Solver++ order 1", True),
        ("DPM-Solver++ 2M", False), ("UniPC", False)]
    for name in ("flow matching", "LCMScheduler", "Heun"):
        assert name in suite.LEFT_OUT
