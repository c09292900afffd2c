"""``paraprop.diffusion.accelerate(pipe)``: a diffusers pipeline's own call, its denoising loop
through paraprop, returns the plain pipeline's output bit for bit at ``tol=0`` (tiny
StableDiffusionPipeline / StableDiffusion3Pipeline from configs, prompts as embeddings, nothing
downloaded); the settings it does not support fall through to the plain loop, named."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import paraprop
from diffusion_cases import assert_served_bitwise
from paraprop.diffusion import FallThroughWarning, accelerate

diffusers = pytest.importorskip("diffusers")


class RowUNet(diffusers.UNet2DConditionModel):
    """The tiny UNet evaluated one row at a time: its rows do not round by batch size (the
    plain UNet's CPU kernels do, which stops the parallel certificate: see
    ``test_batch_variance_falls_through_bitwise``)."""

    def forward(self, sample, timestep, encoder_hidden_states, return_dict=True, **kw):
        t = timestep.reshape(-1).expand(sample.shape[0])
        base = super().forward
        out = torch.cat([base(sample[i:i + 1], t[i:i + 1], encoder_hidden_states[i:i + 1],
                              return_dict=False, **kw)[0] for i in range(sample.shape[0])])
        return (out,) if not return_dict else out


class BatchVariantUNet(RowUNet):
    """:class:`RowUNet` whose output moves by one unit in the last place in a call of more rows
    than the plain loop's (4: two samples, guidance on): the batch variance of CPU and GPU
    kernels, which the plain tiny UNet shows or not depending on the threads and the kernels
    chosen, made certain."""

    def forward(self, sample, timestep, encoder_hidden_states, return_dict=True, **kw):
        out = super().forward(sample, timestep, encoder_hidden_states, return_dict=False,
                              **kw)[0]
        if sample.shape[0] > 4:
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return (out,) if not return_dict else out


class RowTransformer(diffusers.SD3Transformer2DModel):
    """The tiny SD3 transformer, one row at a time (as :class:`RowUNet`)."""

    def forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None,
                timestep=None, return_dict=True, **kw):
        n = hidden_states.shape[0]
        t = timestep.reshape(-1).expand(n)
        base = super().forward
        out = torch.cat([base(hidden_states[i:i + 1], encoder_hidden_states[i:i + 1],
                              pooled_projections[i:i + 1], t[i:i + 1], return_dict=False,
                              **kw)[0] for i in range(n)])
        return (out,) if not return_dict else out


def vae(device, **kw):
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), latent_channels=4,
        norm_num_groups=4, sample_size=8, **kw).eval().to(device)


def sd(scheduler, device="cpu", unet=RowUNet):
    torch.manual_seed(0)
    net = unet(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
               block_out_channels=(8, 16), cross_attention_dim=12, attention_head_dim=2,
               down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
               up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
               norm_num_groups=4).eval().to(device)
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae(device), text_encoder=None, tokenizer=None, unet=net, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sd3(scheduler, device="cpu"):
    torch.manual_seed(0)
    net = RowTransformer(sample_size=8, patch_size=1, in_channels=4, num_layers=1,
                         attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
                         caption_projection_dim=16, pooled_projection_dim=10, out_channels=4,
                         pos_embed_max_size=16).eval().to(device)
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=net, scheduler=scheduler, vae=vae(device, shift_factor=0.0),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
        text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call(pipe, steps=5, scale=5.0, rescale=0.0, output_type="latent", B=1, **kw):
    """The pipeline's own call with prompt embeddings and a seeded generator."""
    device = pipe.vae.device
    g = torch.Generator().manual_seed(1)
    pe, ne = (torch.randn(B, 5, 12, generator=g).to(device) for _ in range(2))
    if isinstance(pipe, diffusers.StableDiffusion3Pipeline):
        pp, npp = (torch.randn(B, 10, generator=g).to(device) for _ in range(2))
        kw.update(pooled_prompt_embeds=pp, negative_pooled_prompt_embeds=npp, height=8, width=8)
    elif rescale:
        kw["guidance_rescale"] = rescale
    kw.setdefault("generator", torch.Generator().manual_seed(3))
    return pipe(prompt_embeds=pe, negative_prompt_embeds=ne, num_inference_steps=steps,
                guidance_scale=scale, output_type=output_type, **kw).images


SCHEDULERS = {   # Stable Diffusion's settings: steps_offset=1, no clipping
    "ddim": lambda: diffusers.DDIMScheduler(clip_sample=False, steps_offset=1),
    "euler": lambda: diffusers.EulerDiscreteScheduler(steps_offset=1),
    # the steps draw noise from the pipeline's generator: drawn beforehand from a copy of it
    "ddpm": lambda: diffusers.DDPMScheduler(clip_sample=False, steps_offset=1),
    "ddim-eta": lambda: diffusers.DDIMScheduler(clip_sample=False, steps_offset=1),
    "euler-ancestral": lambda: diffusers.EulerAncestralDiscreteScheduler(steps_offset=1),
    "lcm": lambda: diffusers.LCMScheduler(steps_offset=1),
    "sde-dpm++1": lambda: diffusers.DPMSolverMultistepScheduler(
        steps_offset=1, solver_order=1, algorithm_type="sde-dpmsolver++"),
    # DPM-Solver++ 2M and 3M (its steps read earlier model outputs; the pipeline's scheduler
    # keeps them from the served outputs), and the SDE 2M with its step noise
    "dpm++2m": lambda: diffusers.DPMSolverMultistepScheduler(steps_offset=1),
    "dpm++3m-karras": lambda: diffusers.DPMSolverMultistepScheduler(
        steps_offset=1, solver_order=3, use_karras_sigmas=True),
    "sde-dpm++2m": lambda: diffusers.DPMSolverMultistepScheduler(
        steps_offset=1, algorithm_type="sde-dpmsolver++"),
    # UniPC: its predictor and corrector read earlier model outputs and the corrected sample
    "unipc": lambda: diffusers.UniPCMultistepScheduler(steps_offset=1),
    # Heun: two denoiser calls a step (2N - 1 in all), the second reading the first's
    # derivative and input sample; the pipeline's scheduler keeps them from the served outputs
    "heun": lambda: diffusers.HeunDiscreteScheduler(steps_offset=1),
    "heun-karras-v": lambda: diffusers.HeunDiscreteScheduler(
        steps_offset=1, use_karras_sigmas=True, prediction_type="v_prediction"),
}
GUIDANCE = [(5.0, 0.0), (5.0, 0.7), (1.0, 0.0)]


@pytest.mark.parametrize(("name", "scale", "rescale"),
                         [(n, *g) for n in ("ddim", "euler") for g in GUIDANCE]
                         + [(n, 5.0, 0.0) for n in ("ddpm", "ddim-eta", "euler-ancestral", "lcm",
                                                    "sde-dpm++1", "dpm++2m", "dpm++3m-karras",
                                                    "sde-dpm++2m", "unipc", "heun",
                                                    "heun-karras-v")])
def test_the_accelerated_pipeline_is_the_plain_one_bitwise(name, scale, rescale, device):
    """At ``tol=0`` the accelerated ``pipe(...)`` returns the plain pipeline's latents bit for
    bit, every step's denoiser output from paraprop's certified solve, in at most the loop's
    denoiser calls in sequence (the step noise of DDPM, DDIM with eta, Euler ancestral, LCM
    and SDE-DPM-Solver++ drawn beforehand from a copy of the pipeline's generator)."""
    pipe = sd(SCHEDULERS[name](), device)
    extra = {"eta": 0.5} if name == "ddim-eta" else {}
    ref = call(pipe, scale=scale, rescale=rescale, **extra)
    with accelerate(pipe) as handle:
        out = call(pipe, scale=scale, rescale=rescale, **extra)
    assert torch.equal(out, ref)
    # (Heun's loop: two denoiser calls a step but the last, each served)
    assert_served_bitwise(handle, 9 if name.startswith("heun") else 5)
    assert 1 <= handle.counters.model_calls <= handle.counters.steps


@pytest.mark.parametrize("name", ["ddim", "euler", "dpm++2m"])
def test_under_inference_mode_the_accelerated_pipeline_is_the_plain_one(name):
    """Under ``torch.inference_mode()`` (its tensors have no version counter) the accelerated
    call is served and returns the plain pipeline's latents bit for bit."""
    pipe = sd(SCHEDULERS[name]())
    ref = call(pipe)
    with torch.inference_mode(), accelerate(pipe) as handle:
        out = call(pipe)
    assert torch.equal(out, ref)
    assert_served_bitwise(handle, 5)


@pytest.mark.parametrize("output_type", ["pt", "np"])
def test_decoded_images_are_the_plain_ones_bitwise(output_type):
    pipe = sd(SCHEDULERS["euler"]())
    ref = call(pipe, output_type=output_type)
    with accelerate(pipe) as handle:
        out = call(pipe, output_type=output_type)
    assert type(out) is type(ref) and (out == ref).all()
    assert handle.counters.served == 5


@pytest.mark.parametrize("scale", [5.0, 1.0])
@pytest.mark.parametrize("shifting", [{"shift": 3.0}, {"use_dynamic_shifting": True}])
def test_sd3_flow_matching_is_the_plain_one_bitwise(shifting, scale, device):
    """StableDiffusion3Pipeline with FlowMatchEulerDiscreteScheduler (a fixed shift, and the
    dynamic shift whose ``mu`` the pipeline computes), guidance on and off."""
    pipe = sd3(diffusers.FlowMatchEulerDiscreteScheduler(**shifting), device)
    ref = call(pipe, scale=scale, steps=6)
    with accelerate(pipe) as handle:
        out = call(pipe, scale=scale, steps=6)
    assert torch.equal(out, ref)
    assert handle.counters.served == 6 and handle.counters.certified == 1


@pytest.mark.parametrize("name", ["euler", "dpm++2m", "heun"])
def test_tol_above_zero_is_within_tol_in_latent_space(name):
    """Above ``tol=0`` the pipeline follows paraprop's trajectory, certified within ``tol`` of
    the plain one, with fewer denoiser calls in sequence than steps (DPM-Solver++ 2M too: the
    pipeline's scheduler keeps its history of model outputs at paraprop's trajectory)."""
    pipe = sd(SCHEDULERS[name]())
    ref = call(pipe, steps=20)
    with accelerate(pipe, tol=1e-3) as handle:
        out = call(pipe, steps=20)
    assert float((out - ref).abs().max()) <= 1e-3
    assert handle.solution.stats["certificate"] in ("estimate", "bitwise")
    # (on this random tiny UNet Picard needs all 20 calls for DPM-Solver++ 2M: never more;
    # Heun's loop makes 39)
    loop = 39 if name == "heun" else 20
    assert handle.counters.served == loop
    assert handle.counters.model_calls < loop if name != "dpm++2m" else \
        handle.counters.model_calls <= loop


def test_undo_restores_the_pipeline():
    pipe = sd(SCHEDULERS["ddim"]())
    unet, sched = pipe.unet, pipe.scheduler
    ref = call(pipe)
    handle = accelerate(pipe)
    assert "forward" in unet.__dict__ and "step" in sched.__dict__
    assert torch.equal(call(pipe), ref) and handle.active
    with pytest.raises(ValueError, match="pipe is already accelerated: call undo"):
        accelerate(pipe)
    handle.undo()
    handle.undo()   # again: nothing
    assert not handle.active and pipe.unet is unet and pipe.scheduler is sched
    for name in ("set_timesteps", "scale_model_input", "step"):
        assert name not in sched.__dict__
    assert "forward" not in unet.__dict__ and "prepare_extra_step_kwargs" not in pipe.__dict__
    assert torch.equal(call(pipe), ref)
    assert handle.counters.runs == 1   # the plain run after undo is not counted
    with accelerate(pipe) as again:   # accelerated anew after undo
        assert torch.equal(call(pipe), ref)
    assert again.counters.served == 5


def test_the_context_manager_undoes_on_an_exception():
    pipe = sd(SCHEDULERS["ddim"]())
    with pytest.raises(RuntimeError, match="inside"), accelerate(pipe) as handle:
        assert handle.active
        raise RuntimeError("inside")
    assert not handle.active and "forward" not in pipe.unet.__dict__


@pytest.mark.parametrize(("scheduler", "kw", "why"), [
    (lambda: diffusers.DDPMScheduler(clip_sample=False, steps_offset=1), {"listed": True},
     "DDPMScheduler draws noise inside scheduler.step, and the pipeline passes it a list of 2 "
     "generators"),
    (lambda: diffusers.EulerAncestralDiscreteScheduler(steps_offset=1), {"listed": True},
     "EulerAncestralDiscreteScheduler draws noise inside scheduler.step"),
    (lambda: diffusers.PNDMScheduler(steps_offset=1, skip_prk_steps=True), {},
     "NotImplementedError: scheduler: PNDMScheduler is not supported"),
])
def test_unsupported_settings_fall_through_named(scheduler, kw, why):
    """A scheduler whose steps draw noise from a list of generators, one paraprop has no
    parallel path for, or any other: the plain loop (its result bit for bit, the generator's
    step noise included), a FallThroughWarning naming why, and the reason on the handle."""
    pipe = sd(scheduler())

    def run():
        if kw.get("listed"):   # one generator per sample, as a list
            return call(pipe, B=2, generator=[torch.Generator().manual_seed(i) for i in (3, 4)])
        return call(pipe)

    ref = run()
    with pytest.warns(FallThroughWarning, match=why), accelerate(pipe) as handle:
        out = run()
    assert torch.equal(out, ref)
    (run, step, reason), = handle.reasons
    assert (run, step) == (1, 0) and re.match(why, reason)
    c = handle.counters
    assert (c.solved, c.served, c.denoiser_calls, c.model_calls) == (0, 0, c.steps, 0)


def test_the_warning_is_said_once_per_reason():
    pipe = sd(SCHEDULERS["ddim"]())
    pipe.scheduler = diffusers.PNDMScheduler(steps_offset=1, skip_prk_steps=True)
    handle = accelerate(pipe)
    with pytest.warns(FallThroughWarning):
        call(pipe, steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(pipe, steps=2)   # the same reason: no second warning
    handle.undo()
    assert len(handle.reasons) == 2 and handle.counters.runs == 2


def test_batch_variance_falls_through_bitwise():
    """A denoiser that rounds a row differently in a batch of another size (as the plain tiny
    UNet's CPU kernels may; docs/diffusion.md, guidance): paraprop cannot certify its batched
    calls at ``tol=0``, so only the steps it computed with the loop's own rows are served, the
    plain loop runs from the first other one, the result is the plain one bit for bit, and the
    handle says so."""
    pipe = sd(SCHEDULERS["ddim"](), unet=BatchVariantUNet)
    ref = call(pipe, B=2)
    with pytest.warns(FallThroughWarning, match="paraprop did not certify the trajectory"), \
            accelerate(pipe) as handle:
        out = call(pipe, B=2)
    assert torch.equal(out, ref)
    c = handle.counters
    assert c.solved == 1 and c.certified == 0 and c.served >= 1
    assert c.served + c.denoiser_calls == c.steps == 5
    (_, step, reason), = handle.reasons
    assert step == c.served and "rounds differently on the batched calls" in reason


def test_callbacks_see_the_plain_latents_every_step():
    """``callback_on_step_end`` is called at every step with the plain loop's latents."""
    def recorder(seen):
        def callback(pipe, i, t, kw):
            seen.append((i, kw["latents"].clone()))
            return {}
        return callback

    pipe = sd(SCHEDULERS["euler"]())
    plain, accel = [], []
    call(pipe, callback_on_step_end=recorder(plain))
    with accelerate(pipe) as handle:
        call(pipe, callback_on_step_end=recorder(accel))
    assert [i for i, _ in accel] == [0, 1, 2, 3, 4]
    assert all(torch.equal(a, p) for (_, a), (_, p) in zip(accel, plain, strict=True))
    assert handle.counters.served == 5


def test_a_callback_that_changes_the_latents_falls_through_from_there():
    """A callback that changes the latents after step 1: the steps after it are not the ones
    paraprop solved, so the plain loop computes them (the result is the plain pipeline's with
    the same callback), and the handle names the step."""
    def nudge(pipe, i, t, kw):
        return {"latents": kw["latents"] * 1.01} if i == 1 else {}

    pipe = sd(SCHEDULERS["ddim"]())
    ref = call(pipe, callback_on_step_end=nudge)
    with pytest.warns(FallThroughWarning, match="not one paraprop evaluated"), \
            accelerate(pipe) as handle:
        out = call(pipe, callback_on_step_end=nudge)
    assert torch.equal(out, ref)
    assert handle.counters.served == 2 and handle.counters.denoiser_calls == 3
    assert handle.reasons[0][1] == 2


def test_accelerate_refusals():
    with pytest.raises(TypeError, match="pipe must be a diffusers pipeline .* got object"):
        accelerate(object())
    pipe = sd(SCHEDULERS["ddim"]())
    with pytest.raises(ValueError, match="tol"):
        accelerate(pipe, tol=-1.0)
    with pytest.raises(ValueError, match="method"):
        accelerate(pipe, method="newton")
    assert "forward" not in pipe.unet.__dict__
    assert paraprop.diffusion.accelerate is accelerate


def test_step_noise_from_one_listed_generator_or_the_global_rng():
    """One generator in a list is drawn from as ``randn_tensor`` draws it (served, bitwise);
    no generator at all (the global RNG) falls through, named, to the plain loop's bits."""
    pipe = sd(SCHEDULERS["ddpm"]())
    ref = call(pipe, generator=[torch.Generator().manual_seed(3)])
    with accelerate(pipe) as handle:
        out = call(pipe, generator=[torch.Generator().manual_seed(3)])
    assert torch.equal(out, ref) and handle.counters.served == 5
    torch.manual_seed(7)
    ref = call(pipe, generator=None)
    with pytest.warns(FallThroughWarning, match=r"passes it no generator \(the global RNG\)"), \
            accelerate(pipe) as handle:
        torch.manual_seed(7)
        out = call(pipe, generator=None)
    assert torch.equal(out, ref) and handle.counters.served == 0


def test_image_to_image_falls_through_named():
    """An image-to-image pipeline starts its loop past the first timestep (``strength``):
    the plain loop, named."""
    pipe = diffusers.StableDiffusionImg2ImgPipeline(**sd(SCHEDULERS["ddim"]()).components)
    pipe.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    ref = call(pipe, image=image, strength=0.6)
    with pytest.warns(FallThroughWarning, match="does not start at the scheduler's first"), \
            accelerate(pipe) as handle:
        out = call(pipe, image=image, strength=0.6)
    assert torch.equal(out, ref) and handle.counters.served == 0


def test_a_replaced_scheduler_falls_through_named():
    pipe = sd(SCHEDULERS["ddim"]())
    with accelerate(pipe) as handle:
        pipe.scheduler = diffusers.EulerDiscreteScheduler(steps_offset=1)
        ref_sched = diffusers.EulerDiscreteScheduler(steps_offset=1)
        with pytest.warns(FallThroughWarning, match="pipe.scheduler was replaced after"):
            out = call(pipe)
    pipe.scheduler = ref_sched
    assert torch.equal(out, call(pipe))
    assert handle.counters.served == 0 and handle.counters.denoiser_calls == 5


@pytest.mark.parametrize("name", ["ddim", "euler-ancestral"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_every_dtype_and_a_sliding_window_bitwise(dtype, name):
    """The pipeline in float64, bfloat16 and float16, Picard on a window of 2 steps: the plain
    pipeline's latents bit for bit (the schedulers' own rounding in the dtype included)."""
    pipe = sd(SCHEDULERS[name]()).to(dtype=dtype)
    g = torch.Generator().manual_seed(1)
    pe, ne = (torch.randn(1, 5, 12, generator=g).to(dtype) for _ in range(2))

    def run():
        return pipe(prompt_embeds=pe, negative_prompt_embeds=ne, num_inference_steps=5,
                    guidance_scale=5.0, generator=torch.Generator().manual_seed(3),
                    output_type="latent").images

    ref = run()
    with accelerate(pipe, window=2) as handle:
        out = run()
    assert out.dtype == dtype and torch.equal(out, ref)
    assert handle.counters.served == 5 and handle.solution.stats["window"] == 2


def test_a_stochastic_denoiser_falls_through_named():
    """A denoiser in train mode with active dropout: its output is not a function of its input,
    so paraprop does not solve the run (the plain loop, named)."""
    pipe = sd(SCHEDULERS["ddim"]())
    drop = next(m for m in pipe.unet.modules() if isinstance(m, torch.nn.Dropout))
    drop.p = 0.1
    pipe.unet.train()
    with pytest.warns(FallThroughWarning, match="RowUNet is in train mode with stochastic"), \
            accelerate(pipe) as handle:
        call(pipe)
    c = handle.counters
    assert (c.solved, c.served, c.denoiser_calls, c.model_calls) == (0, 0, 5, 0)
