"""``StableDiffusionXLPipeline`` under ``paraprop.diffusion.accelerate``: its UNet's
``added_cond_kwargs`` (pooled text embeddings and size/crop time ids, both guidance halves) split
as the other per-sample arguments, and the accelerated ``pipe(...)`` returns the plain
pipeline's latents bit for bit at ``tol=0``. A tiny UNet with SDXL's text-time embedding and a
one-block VAE from configs, prompts as embeddings, nothing downloaded."""

from __future__ import annotations

import pytest
import torch

from diffusion_cases import assert_served_bitwise
from paraprop.diffusion import accelerate

diffusers = pytest.importorskip("diffusers")


class RowXLUNet(diffusers.UNet2DConditionModel):
    """The tiny SDXL UNet evaluated one row at a time (its rows do not round by batch size;
    see ``RowUNet`` in ``tests/test_diffusion_accelerate.py``)."""

    def forward(self, sample, timestep, encoder_hidden_states, return_dict=True,
                added_cond_kwargs=None, **kw):
        t = timestep.reshape(-1).expand(sample.shape[0])
        base = super().forward
        out = torch.cat([
            base(sample[i:i + 1], t[i:i + 1], encoder_hidden_states[i:i + 1],
                 added_cond_kwargs={k: v[i:i + 1] for k, v in added_cond_kwargs.items()},
                 return_dict=False, **kw)[0]
            for i in range(sample.shape[0])])
        return (out,) if not return_dict else out


def sdxl(scheduler, device="cpu"):
    torch.manual_seed(0)
    net = RowXLUNet(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                    block_out_channels=(8, 16), cross_attention_dim=12, attention_head_dim=2,
                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=4,
                    addition_embed_type="text_time", addition_time_embed_dim=4,
                    projection_class_embeddings_input_dim=4 * 6 + 10).eval().to(device)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), latent_channels=4,
        norm_num_groups=4, sample_size=8).eval().to(device)
    pipe = diffusers.StableDiffusionXLPipeline(
        vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None,
        unet=net, scheduler=scheduler, force_zeros_for_empty_prompt=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call(pipe, scale=5.0, rescale=0.0, **kw):
    device = pipe.vae.device
    g = torch.Generator().manual_seed(1)
    pe, ne = (torch.randn(2, 5, 12, generator=g).to(device) for _ in range(2))
    pp, npp = (torch.randn(2, 10, generator=g).to(device) for _ in range(2))
    return pipe(prompt_embeds=pe, negative_prompt_embeds=ne, pooled_prompt_embeds=pp,
                negative_pooled_prompt_embeds=npp, num_inference_steps=5, height=8, width=8,
                guidance_scale=scale, guidance_rescale=rescale, output_type="latent",
                generator=torch.Generator().manual_seed(3), **kw).images


SCHEDULERS = {   # SDXL's settings: steps_offset=1, no clipping
    "euler": lambda: diffusers.EulerDiscreteScheduler(steps_offset=1),
    "ddpm": lambda: diffusers.DDPMScheduler(steps_offset=1, clip_sample=False),
}


@pytest.mark.parametrize(("name", "scale", "rescale"), [
    ("euler", 5.0, 0.7), ("euler", 1.0, 0.0), ("ddpm", 5.0, 0.0)])
def test_the_accelerated_sdxl_pipeline_is_the_plain_one_bitwise(name, scale, rescale, device):
    """Guidance on (with and without ``guidance_rescale``) and off, DDPM's step noise from the
    pipeline's generator: the plain latents bit for bit, every step served."""
    pipe = sdxl(SCHEDULERS[name](), device)
    ref = call(pipe, scale, rescale)
    with accelerate(pipe) as handle:
        out = call(pipe, scale, rescale)
    assert torch.equal(out, ref)
    assert_served_bitwise(handle)


def test_denoising_end_stops_the_loop_early_bitwise():
    """``denoising_end`` (the base model of a base + refiner pair) stops the loop after the
    first steps: those are served bit for bit (the solve covers all the scheduler's steps: it
    reads their number from ``set_timesteps``)."""
    pipe = sdxl(SCHEDULERS["euler"]())
    ref = call(pipe, denoising_end=0.6)
    with accelerate(pipe) as handle:
        out = call(pipe, denoising_end=0.6)
    assert torch.equal(out, ref)
    c = handle.counters
    assert c.steps == c.served == 3 and c.denoiser_calls == 0 and c.model_calls <= 5
