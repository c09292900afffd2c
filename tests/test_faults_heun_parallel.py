"""Fault tests (review s37) for Heun in parallel: ``sample`` against the diffusers loop with
models built to break the certificate at ``tol > 0`` (a model that expands differences only at
the late timesteps, a budget cut by ``max_iters``), and ``accelerate(pipe)`` with
``HeunDiscreteScheduler`` in the batch layouts the tested one (one prompt, guidance on: two rows
a step) does not cover."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from diffusion_cases import HEUN, READER_MARKS, RowEps, assert_served_bitwise  # noqa: E402, I001
from test_diffusion_accelerate import SCHEDULERS, RowUNet, call, sd  # noqa: E402
from test_diffusion_multistep_parallel import diffusers_loop, gen  # noqa: E402
from paraprop.diffusion import accelerate, sample  # noqa: E402

pytestmark = READER_MARKS


class LateKink(torch.nn.Module):
    """Contracting at the early timesteps, expanding (gain 8) at the late ones (``t < 300``):
    the gains observed early do not bound the late steps'."""

    def forward(self, x, t):
        tt = torch.as_tensor(t, dtype=x.dtype).reshape(-1).expand(len(x))
        g = torch.where(tt < 300, 8.0, 0.1).to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
        return torch.tanh(g * x) + RowEps()(x, t)


@pytest.mark.parametrize("cfg", [{}, {"prediction_type": "sample", "clip_sample": True}],
                         ids=["eps", "sample-clip"])
@pytest.mark.parametrize("method,window,max_iters", [("picard", 3, None), ("anderson", None, None),
                                                     ("anderson", None, 5)])
def test_heun_within_tol_on_a_late_expanding_model(device, cfg, method, window, max_iters):
    model = LateKink().to(device)
    ref = diffusers_loop(model, HEUN(**cfg), 15, torch.float64, device)
    for tol in (1e-3, 1e-1):
        x, sol = sample(model, HEUN(**cfg), (3, 2), num_inference_steps=15, dtype=torch.float64,
                        device=device, generator=gen(1), method=method, window=window, tol=tol,
                        max_iters=max_iters, throw=False)
        assert sol.stats["model_calls"] <= 2 * 15 - 1
        if sol.converged:
            assert float((x - ref).abs().max()) <= tol, (tol, sol.stats["certificate"])


def _recording(seen: list):
    class Recording(RowUNet):
        def forward(self, sample, timestep, encoder_hidden_states, return_dict=True, **kw):
            seen.append((sample.shape[0], tuple(torch.as_tensor(timestep).shape)))
            return super().forward(sample, timestep, encoder_hidden_states,
                                   return_dict=return_dict, **kw)
    return Recording


@pytest.mark.parametrize("B,scale", [(1, 1.0), (2, 5.0)], ids=["one-row", "two-prompts-cfg"])
def test_accelerated_heun_in_other_batch_layouts_is_the_plain_pipeline(B, scale):
    pipe = sd(SCHEDULERS["heun"]())
    ref = call(pipe, steps=3, B=B, scale=scale)
    with accelerate(pipe) as handle:
        out = call(pipe, steps=3, B=B, scale=scale)
    assert torch.equal(out, ref)
    assert_served_bitwise(handle, 2 * 3 - 1)


def test_one_step_calls_get_the_timestep_as_the_pipeline_passes_it():
    seen: list = []
    pipe = sd(SCHEDULERS["ddim"](), unet=_recording(seen))
    call(pipe, steps=3, scale=1.0)
    plain = set(seen)
    assert plain == {(1, ())}
    seen.clear()
    with accelerate(pipe):
        call(pipe, steps=3, scale=1.0)
    one_step = {s for s in seen if s[0] == 1}
    assert one_step and one_step <= plain, one_step
