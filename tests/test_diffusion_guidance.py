"""Classifier-free guidance (``paraprop.diffusion.Guided``): the diffusers pipeline's guided loop
bit for bit (a StableDiffusionPipeline built from a tiny config, no download), the parallel
methods its sequential result, and the refusals."""

from __future__ import annotations

import pytest
import torch

import paraprop
from paraprop.diffusion import Guided, sample

diffusers = pytest.importorskip("diffusers")


def tiny_pipeline(scheduler, dtype=torch.float32):
    """A StableDiffusionPipeline from random tiny configs (UNet with cross-attention, one-block
    VAE; no text encoder: the prompts come as embeddings)."""
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=12,
        attention_head_dim=2, norm_num_groups=4).eval().to(dtype)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), latent_channels=4,
        norm_num_groups=4, sample_size=8).eval().to(dtype)
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


SCHEDULERS = {   # (steps_offset=1 and no clipping: Stable Diffusion's settings)
    "ddim": lambda: diffusers.DDIMScheduler(clip_sample=False, steps_offset=1),
    "ddim-eta": lambda: diffusers.DDIMScheduler(clip_sample=False, steps_offset=1),
    "ddpm": lambda: diffusers.DDPMScheduler(clip_sample=False, steps_offset=1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("scale", "rescale"), [(5.0, 0.0), (7.5, 0.7)])
@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("steps", [1, 7])
def test_the_sequential_guided_loop_is_the_pipelines(name, steps, scale, rescale, dtype):
    """``sample(Guided(unet, ...), method="sequential")`` returns the latents of
    ``StableDiffusionPipeline(...)(prompt_embeds=..., negative_prompt_embeds=...,
    guidance_scale=..., guidance_rescale=..., output_type="latent")`` with the same generator,
    bit for bit (DDIM with eta, DDPM's step noise included)."""
    pipe = tiny_pipeline(SCHEDULERS[name](), dtype)
    B = 2
    g = torch.Generator().manual_seed(1)
    pe, ne = (torch.randn(B, 5, 12, generator=g).to(dtype) for _ in range(2))
    eta = 0.5 if name == "ddim-eta" else None
    extra = {} if eta is None else {"eta": eta}
    ref = pipe(prompt_embeds=pe, negative_prompt_embeds=ne, num_inference_steps=steps,
               guidance_scale=scale, guidance_rescale=rescale, output_type="latent",
               generator=torch.Generator().manual_seed(3), **extra).images
    model = Guided(pipe.unet, scale, cond={"encoder_hidden_states": pe},
                   uncond={"encoder_hidden_states": ne}, guidance_rescale=rescale)
    x, sol = sample(model, pipe.scheduler, (B, 4, 8, 8), num_inference_steps=steps,
                    method="sequential", eta=eta, generator=torch.Generator().manual_seed(3))
    assert sol.converged and x.dtype == dtype
    assert torch.equal(x, ref)


class CondMlp(torch.nn.Module):
    """A conditional MLP denoiser on 2-d samples: its output reads the sample, the timestep and
    a per-sample embedding (kept small, so its rows do not round by batch size)."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(6, 16, generator=g) * 0.5)
        self.v = torch.nn.Parameter(torch.randn(16, 2, generator=g) * 0.3)
        self.requires_grad_(False)

    def forward(self, x, t, emb, gain=None):
        tt = torch.as_tensor(t).reshape(-1).expand(len(x)).to(x.dtype) / 1000
        h = torch.tanh(torch.cat([x, tt[:, None], emb], 1) @ self.w)
        out = h @ self.v
        return out if gain is None else out * gain


@pytest.mark.parametrize("tol", [0.0, 1e-3])
@pytest.mark.parametrize("method", ["picard", "anderson"])
def test_parallel_guided_sampling_is_the_sequential_one(method, tol, device):
    """The parallel methods on a guided model return the guided loop's sample: bitwise at
    ``tol=0``, within ``tol`` above, in fewer model calls than steps."""
    B, N = 3, 40
    g = torch.Generator().manual_seed(2)
    cond, uncond = torch.randn(B, 3, generator=g), torch.zeros(B, 3)
    net = CondMlp().to(device)
    model = Guided(net, 4.0, cond={"emb": cond.to(device)}, uncond={"emb": uncond.to(device)},
                   shared={"gain": 0.5})
    sched = diffusers.DDIMScheduler(clip_sample=False)
    run = {"num_inference_steps": N, "device": device,
           "generator": torch.Generator().manual_seed(5)}
    ref, _ = sample(model, sched, (B, 2), method="sequential", **run)
    run["generator"] = torch.Generator().manual_seed(5)
    x, sol = sample(model, sched, (B, 2), method=method, tol=tol, **run)
    assert sol.converged and sol.iterations < N
    if tol == 0:
        assert torch.equal(x, ref)
    else:
        assert float((x - ref).abs().max()) <= tol


def test_guided_rows_read_their_samples_conditioning():
    """A window's rows (steps one after another, each holding the batch) read the conditioning
    of their own sample, unconditional half first, as the pipeline concatenates them."""
    seen = {}

    def net(x, t, emb):
        seen["x"], seen["emb"] = x, emb
        return emb.expand_as(x)

    cond, uncond = torch.tensor([[1.0], [2.0]]), torch.tensor([[-1.0], [-2.0]])
    model = Guided(net, 2.0, cond={"emb": cond}, uncond={"emb": uncond})
    out = model(torch.zeros(6, 1), torch.zeros(6, dtype=torch.long))   # 3 steps of 2 samples
    assert seen["x"].shape == (12, 1)
    assert seen["emb"].flatten().tolist() == [-1, -2] * 3 + [1, 2] * 3
    # u + 2 (c - u) = 2c - u, per row: the row's own sample
    assert out.flatten().tolist() == [3.0, 6.0] * 3


def test_guided_refusals():
    net = CondMlp()
    emb = {"emb": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=r"guidance_scale must be > 1 .* got 1.0"):
        Guided(net, 1.0, cond=emb, uncond=emb)
    with pytest.raises(ValueError, match="guidance_scale must be a finite number > 0, got nan"):
        Guided(net, float("nan"), cond=emb, uncond=emb)
    with pytest.raises(ValueError, match="guidance_rescale must be a finite number >= 0, got -0.5"):
        Guided(net, 3.0, cond=emb, uncond=emb, guidance_rescale=-0.5)
    with pytest.raises(ValueError, match=r"cond and uncond must hold the same keys, got \['emb'\]"
                                         r" and \['other'\]"):
        Guided(net, 3.0, cond=emb, uncond={"other": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"one row per sample .* got first dims \[2, 3\]"):
        Guided(net, 3.0, cond=emb, uncond={"emb": torch.zeros(3, 3)})
    with pytest.raises(TypeError, match=r"cond\['emb'\] must be a tensor .* got list"):
        Guided(net, 3.0, cond={"emb": [0.0, 1.0]}, uncond=emb)
    with pytest.raises(TypeError, match="cond must be a non-empty dict"):
        Guided(net, 3.0, cond={}, uncond=emb)
    model = Guided(net, 3.0, cond=emb, uncond=emb)
    with pytest.raises(ValueError, match="3 rows of x are not whole steps of the 2 samples"):
        model(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))
    # a sample batch that is not the conditioning's: the first call says so
    with pytest.raises(ValueError, match="5 rows of x are not whole steps of the 2 samples"):
        sample(model, diffusers.DDIMScheduler(clip_sample=False), (5, 2), num_inference_steps=4,
               method="sequential")


def test_dropout_behind_the_guidance_is_refused():
    """The guided model's own module is checked like any: train-mode dropout inside it is a
    StochasticModelError naming the layer."""

    class Drop(CondMlp):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x, t, emb):
            return self.drop(super().forward(x, t, emb))

    model = Guided(Drop().train(), 3.0, cond={"emb": torch.zeros(2, 3)},
                   uncond={"emb": torch.zeros(2, 3)})
    with pytest.raises(paraprop.StochasticModelError, match="drop"):
        sample(model, diffusers.DDIMScheduler(clip_sample=False), (2, 2), num_inference_steps=4)
