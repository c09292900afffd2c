"""diffusers' ``DiTPipeline`` (class-conditional DiT) under ``paraprop.diffusion.accelerate``:
the accelerated ``pipe(class_labels=...)`` returns the plain pipeline's images bit for bit at
``tol=0``, guidance on and off, learned sigma on and off; :class:`DiTGuided` is the pipeline's
own guidance arithmetic bit for bit; what DiT's loop does that paraprop does not follow falls
through, named. A tiny random DiT transformer and VAE from configs, nothing downloaded."""

from __future__ import annotations

import dataclasses
import io
import re

import numpy as np
import pytest
import torch

from diffusion_cases import assert_served_bitwise
from paraprop.diffusion import FallThroughWarning, accelerate
from paraprop.diffusion.dit_guidance import DiTGuided

diffusers = pytest.importorskip("diffusers")
Output = pytest.importorskip("diffusers.models.modeling_outputs").Transformer2DModelOutput


class RowDiT(diffusers.DiTTransformer2DModel):
    """The tiny DiT evaluated one row at a time: its rows do not round by batch size (the
    batched CPU kernels may, which stops the parallel certificate at ``tol=0``: the plain loop
    then runs, see ``tests/test_diffusion_accelerate.py``)."""

    def forward(self, hidden_states, timestep=None, class_labels=None,
                cross_attention_kwargs=None, return_dict=True):
        n = hidden_states.shape[0]
        t = timestep.reshape(-1).expand(n)
        base = super().forward
        out = torch.cat([base(hidden_states[i:i + 1], t[i:i + 1], class_labels[i:i + 1],
                              return_dict=False)[0] for i in range(n)])
        return Output(sample=out) if return_dict else (out,)


def dit(scheduler, device="cpu", learned_sigma=True, cls=diffusers.DiTPipeline):
    torch.manual_seed(0)
    net = RowDiT(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                 out_channels=8 if learned_sigma else 4, num_layers=1, norm_num_groups=4,
                 sample_size=4, patch_size=2).eval().to(device)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), latent_channels=4,
        norm_num_groups=4, sample_size=8).eval().to(device)
    pipe = cls(transformer=net, vae=vae, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call(pipe, steps=5, scale=4.0, output_type="pt", labels=(1, 7), **kw):
    """The pipeline's own call with a seeded generator (and global RNG: the schedulers that
    draw step noise draw it there, DiTPipeline passes scheduler.step no generator)."""
    torch.manual_seed(11)
    return pipe(class_labels=list(labels), guidance_scale=scale, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(3), output_type=output_type,
                **kw).images


SCHEDULERS = {
    "ddim": lambda: diffusers.DDIMScheduler(),
    "dpm++1": lambda: diffusers.DPMSolverMultistepScheduler(solver_order=1),
    "dpm++1-karras": lambda: diffusers.DPMSolverMultistepScheduler(
        solver_order=1, use_karras_sigmas=True),
    "dpm++2m": lambda: diffusers.DPMSolverMultistepScheduler(),
}


@pytest.mark.parametrize("learned_sigma", [True, False], ids=["learned-sigma", "eps-only"])
@pytest.mark.parametrize("scale", [4.0, 1.0])
@pytest.mark.parametrize("name", ["ddim", "dpm++1-karras", "dpm++2m"])
def test_the_accelerated_dit_pipeline_is_the_plain_one_bitwise(name, scale, learned_sigma,
                                                              device):
    """At ``tol=0`` ``pipe(class_labels=..., guidance_scale=...)`` returns the plain
    pipeline's images bit for bit, every step's transformer output served from paraprop's
    certified solve (as the ``Transformer2DModelOutput`` the pipeline reads ``.sample`` of)."""
    pipe = dit(SCHEDULERS[name](), device, learned_sigma)
    ref = call(pipe, scale=scale)
    with accelerate(pipe) as handle:
        out = call(pipe, scale=scale)
    assert out.device == ref.device and torch.equal(out, ref)
    assert_served_bitwise(handle)
    assert 1 <= handle.counters.model_calls <= handle.counters.steps


@pytest.mark.parametrize("output_type", ["np", "pil"])
def test_decoded_outputs_are_the_plain_ones(output_type):
    pipe = dit(SCHEDULERS["dpm++1"]())
    ref = call(pipe, output_type=output_type)
    with accelerate(pipe) as handle:
        out = call(pipe, output_type=output_type)
        as_tuple = pipe(class_labels=[1, 7], num_inference_steps=5, output_type="np",
                        generator=torch.Generator().manual_seed(3), return_dict=False)
    arrays = [np.asarray(x) for x in (out if output_type == "pil" else [out])]
    refs = [np.asarray(x) for x in (ref if output_type == "pil" else [ref])]
    assert all((a == r).all() for a, r in zip(arrays, refs, strict=True))
    plain = call(pipe, output_type="np")
    assert isinstance(as_tuple, tuple) and (as_tuple[0] == plain).all()
    assert handle.counters.served == 10 and handle.counters.runs == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_other_dtypes_and_a_sliding_window_bitwise(dtype):
    pipe = dit(SCHEDULERS["ddim"]()).to(dtype=dtype)
    ref = call(pipe)
    with accelerate(pipe, window=2) as handle:
        out = call(pipe)
    assert torch.equal(out, ref)
    assert handle.counters.served == 5 and handle.solution.stats["window"] == 2


def decoded_latents(pipe, sink):
    """Record the latents the pipeline decodes (an instance patch of ``vae.decode``)."""
    decode = pipe.vae.decode

    def recording(latents, *args, **kwargs):
        sink.append(latents.clone())
        return decode(latents, *args, **kwargs)
    pipe.vae.decode = recording


def test_tol_above_zero_is_within_tol_in_latent_space():
    """Above ``tol=0`` the pipeline follows paraprop's trajectory (its first half: DiT steps
    both guidance halves and keeps the first), within ``tol`` of the plain one in latent
    space, in fewer transformer calls in sequence than steps. The VAE's scaling factor is 1,
    so that what it decodes is the latents bit for bit (DiTPipeline divides them by it: at the
    default 0.18215 the decoded input's differences are 5.5 times the latents')."""
    pipe = dit(SCHEDULERS["dpm++1"]())
    pipe.vae.register_to_config(scaling_factor=1.0)
    plain, fast = [], []
    decoded_latents(pipe, plain)
    call(pipe, steps=20)
    del pipe.vae.decode
    decoded_latents(pipe, fast)
    with accelerate(pipe, tol=1e-3) as handle:
        call(pipe, steps=20)
    assert handle.solution.stats["certificate"] == "estimate"   # the pipeline's steps replaced
    assert float((fast[0] - plain[0]).abs().max()) <= 1e-3
    assert handle.counters.served == 20 and handle.counters.model_calls < 20


def test_the_progress_bar_runs_as_usual():
    """The pipeline's own progress bar counts its steps (DiTPipeline has no callback
    argument: there is none to keep)."""
    bars = []
    for accelerated in (False, True):
        pipe = dit(SCHEDULERS["ddim"]())
        bars.append(io.StringIO())
        pipe.set_progress_bar_config(file=bars[-1], disable=False)
        if accelerated:
            with accelerate(pipe) as handle:
                out = call(pipe)
            assert handle.counters.served == 5
        else:
            ref = call(pipe)
    assert torch.equal(out, ref)
    assert all("5/5" in bar.getvalue() for bar in bars)


@pytest.mark.parametrize(("scheduler", "why"), [
    (lambda: diffusers.EulerDiscreteScheduler(),
     "EulerDiscreteScheduler.scale_model_input scales the latents, and DiTPipeline passes the "
     "scaled sample to scheduler.step"),
    (lambda: diffusers.EulerAncestralDiscreteScheduler(),
     "EulerAncestralDiscreteScheduler.scale_model_input scales the latents"),
    (lambda: diffusers.DDPMScheduler(),
     r"DDPMScheduler draws noise inside scheduler.step, and the pipeline passes it no "
     r"generator \(the global RNG\)"),
    (lambda: diffusers.HeunDiscreteScheduler(),
     "HeunDiscreteScheduler.scale_model_input scales the latents"),
    (lambda: diffusers.PNDMScheduler(skip_prk_steps=True),
     "NotImplementedError: scheduler: PNDMScheduler is not supported"),
])
def test_unsupported_settings_fall_through_named(scheduler, why):
    """What paraprop does not follow in DiT's loop: the plain loop (its result bit for bit),
    a FallThroughWarning naming why, and the reason on the handle."""
    pipe = dit(scheduler())
    ref = call(pipe)
    with pytest.warns(FallThroughWarning, match=why), accelerate(pipe) as handle:
        out = call(pipe)
    assert torch.equal(out, ref)
    (run, step, reason), = handle.reasons
    assert (run, step) == (1, 0) and re.match(why, reason)
    c = handle.counters
    assert (c.solved, c.served, c.denoiser_calls, c.model_calls) == (0, 0, c.steps, 0)


def test_a_tensor_guidance_scale_falls_through_named():
    """A ``guidance_scale`` tensor (the plain pipeline takes one: its arithmetic then differs
    from a Python number's): the plain loop, named."""
    pipe = dit(SCHEDULERS["ddim"]())
    ref = call(pipe, scale=torch.tensor(4.0))
    with pytest.warns(FallThroughWarning, match="DiTPipeline's guidance_scale is a Tensor, not "
                      "an int or a float"), accelerate(pipe) as handle:
        out = call(pipe, scale=torch.tensor(4.0))
    assert torch.equal(out, ref) and handle.counters.served == 0


class OwnLoop(diffusers.DiTPipeline):
    """A DiTPipeline whose call is a loop of its own (no guidance), not DiT's code."""

    @torch.no_grad()
    def __call__(self, class_labels, num_inference_steps, generator):
        labels = torch.tensor(class_labels)
        x = torch.randn(len(class_labels), 4, 4, 4, generator=generator)
        self.scheduler.set_timesteps(num_inference_steps)
        for t in self.scheduler.timesteps:
            out = self.transformer(x, timestep=t.expand(len(x)), class_labels=labels).sample
            x = self.scheduler.step(out[:, :4], t, x).prev_sample
        return x


def test_a_loop_other_than_dits_falls_through_named():
    """A DiTPipeline subclass whose ``__call__`` is other code: paraprop does not know its
    guidance, so the run is the plain loop, named."""
    pipe = dit(SCHEDULERS["ddim"](), cls=OwnLoop)

    def run():
        return pipe([1, 7], 4, torch.Generator().manual_seed(3))
    ref = run()
    with pytest.warns(FallThroughWarning, match="the transformer was not called from "
                      r"DiTPipeline.__call__ \(its guidance_scale is read"), \
            accelerate(pipe) as handle:
        out = run()
    assert torch.equal(out, ref) and handle.counters.served == 0


# -- DiTGuided: the pipeline's arithmetic --------------------------------------------------------

def recorded_steps(pipe, scale):
    """Run the plain pipeline, recording each ``scheduler.step``'s model output, timestep
    and sample (an instance patch of the scheduler)."""
    seen = []
    step = pipe.scheduler.step

    def recording(model_output, timestep, sample, *args, **kwargs):
        seen.append((model_output.clone(), timestep, sample.clone()))
        return step(model_output, timestep, sample, *args, **kwargs)
    pipe.scheduler.step = recording
    call(pipe, scale=scale, steps=3)
    del pipe.scheduler.step
    return seen


@pytest.mark.parametrize("learned_sigma", [True, False], ids=["learned-sigma", "eps-only"])
@pytest.mark.parametrize("scale", [4.0, 3, 1.0], ids=["4.0", "int-3", "1.0"])
def test_dit_guided_is_the_pipelines_arithmetic(scale, learned_sigma, device):
    """``DiTGuided(transformer, ...)(x, t)`` is the model output DiTPipeline gives
    ``scheduler.step`` for the trajectory's rows (its first half), bit for bit, per step and
    for all steps in one call (rows step-major, the class labels tiled)."""
    pipe = dit(SCHEDULERS["ddim"](), device, learned_sigma)
    seen = recorded_steps(pipe, scale)
    B = 2
    labels = torch.tensor([1, 7], device=device)
    uncond = None if scale <= 1 else {"class_labels": torch.full((B,), 1000, device=device)}
    guided = DiTGuided(lambda x, t, **kw: pipe.transformer(x, timestep=t, **kw), scale,
                       channels=4, learned_sigma=learned_sigma, cond={"class_labels": labels},
                       uncond=uncond)
    rows = 2 * B if scale > 1 else B
    for out, t, sample in seen:
        assert out.shape[0] == rows
        assert torch.equal(guided(sample[:B], t.reshape(1).expand(B)), out[:B])
    xs = torch.cat([sample[:B] for _, _, sample in seen])
    ts = torch.cat([t.reshape(1).expand(B) for _, t, _ in seen])
    assert torch.equal(guided(xs, ts), torch.cat([out[:B] for out, _, _ in seen]))


def test_dit_guided_refusals():
    net = lambda x, t, class_labels: x   # noqa: E731
    labels = {"class_labels": torch.tensor([1, 2])}
    null = {"class_labels": torch.tensor([1000, 1000])}
    with pytest.raises(ValueError, match=r"guidance_scale=4.0 > 1 turns guidance on: uncond "
                       r"\(the null class's arguments\) is required"):
        DiTGuided(net, 4.0, channels=1, learned_sigma=False, cond=labels)
    with pytest.raises(ValueError, match="guidance_scale=1.0 <= 1: DiTPipeline has no "
                       "unconditional half there, so uncond must be None"):
        DiTGuided(net, 1.0, channels=1, learned_sigma=False, cond=labels, uncond=null)
    with pytest.raises(TypeError, match="guidance_scale must be an int or a float .*got str"):
        DiTGuided(net, "4", channels=1, learned_sigma=False, cond=labels)
    with pytest.raises(ValueError, match="channels must be a positive int, got 0"):
        DiTGuided(net, 1.0, channels=0, learned_sigma=False, cond=labels)
    with pytest.raises(ValueError, match=r"one row per sample \(the same count\), got first "
                       r"dims \[2, 3\]"):
        DiTGuided(net, 4.0, channels=1, learned_sigma=False, cond=labels,
                  uncond={"class_labels": torch.tensor([1000] * 3)})
    with pytest.raises(TypeError, match="cond must be a non-empty dict"):
        DiTGuided(net, 1.0, channels=1, learned_sigma=False, cond={})
    g = DiTGuided(net, 4.0, channels=1, learned_sigma=False, cond=labels, uncond=null)
    with pytest.raises(ValueError, match="DiTGuided: 3 rows of x are not whole steps of the 2"):
        g(torch.ones(3, 1), torch.zeros(3))


# -- a denoiser's output object (return_dict=True), in any pipeline ------------------------------

@dataclasses.dataclass
class Out:
    sample: torch.Tensor


@dataclasses.dataclass
class NoteFirst:   # a dataclass whose first field is not the output
    note: str
    sample: torch.Tensor | None = None


class NotADataclass:
    def __init__(self, sample):
        self.sample = sample


class Net(torch.nn.Module):
    def __init__(self, output):
        super().__init__()
        self.output = output

    def forward(self, sample, timestep, return_dict=True):
        out = torch.tanh(sample) * 0.5
        if not return_dict:
            return (out,)
        return NoteFirst("hi", out) if self.output is NoteFirst else self.output(out)


class Pipe:
    """A pipeline-shaped loop that calls its denoiser with ``return_dict`` left ``True``."""

    def __init__(self, output):
        self.unet, self.scheduler = Net(output).eval(), diffusers.DDIMScheduler()

    def __call__(self, steps=6):
        self.scheduler.set_timesteps(steps)
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
        for t in self.scheduler.timesteps:
            x = self.scheduler.step(self.unet(x, t).sample, t, x).prev_sample
        return x


def test_an_output_object_is_served_or_falls_through_named():
    """A denoiser called with ``return_dict=True`` gets the served output in its own output
    type where that is a dataclass around the output (diffusers' ``ModelOutput`` s); another
    type cannot be rebuilt: the plain loop, named."""
    pipe = Pipe(Out)
    ref = pipe()
    with accelerate(pipe) as handle:
        assert torch.equal(pipe(), ref)
    assert handle.counters.served == 6
    for output, why in [(NotADataclass, r"the denoiser's output NotADataclass "
                         r"\(return_dict=True\) cannot be rebuilt around a tensor"),
                        (NoteFirst, "the denoiser returned a str where its output tensor was "
                         "expected")]:
        pipe = Pipe(output)
        with pytest.warns(FallThroughWarning, match=why), accelerate(pipe) as handle:
            assert torch.equal(pipe(), ref)
        assert handle.counters.served == 0 and handle.counters.denoiser_calls == 6
