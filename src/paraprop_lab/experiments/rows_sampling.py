"""Device rows of the nonlinear adapters (issue 28's targets): MADE by Jacobi against ancestral
sampling, PixelCNN by GS-Jacobi against its cached sampler, Jacobi decoding against
``generate``, diffusion by Picard iteration against the diffusers loop, TarFlow against its
key/value-cached sampler; and the measurements behind the decoding window and the TarFlow plan.

Each model is trained here, on the row's device, with the training job's own function and the
recipe of the CPU suite where the window allows (the row's note says where it does not): the
number of iterations a solver needs depends on the trained model. See
:mod:`paraprop_lab.experiments.rows` for the record format and the scales.
"""

from __future__ import annotations

import torch

from paraprop_lab.experiments.rows import (
    Context,
    choice,
    cudnn_float32,
    guarded,
    max_abs,
    row,
    skipped,
)

MADE_TARGET, PIXELCNN_TARGET, DECODING_TARGET = 26.0, 4.4, 2.0
DECODING_BATCH_TARGET = 2.0   # issue 32: greedy, batch 8, at least 2x generate
DECODING_SAMPLED_TARGET = 1.5  # issue 32: sampled, batch 1, 1.5x the sequential sampler
DECODING_LOOKUP_TARGET = 1.5   # issue 32: greedy, batch 1, 1.5x the best prompt lookup
DIFFUSION_TARGET, TARFLOW_TARGET = 3.0, 3.0
FLOWMATCH_TARGET = 2.0        # issue 31: flow matching, Euler, 50 steps, batch 16: 2x the loop


def _images(ctx: Context, load, want: str, **kw):
    """``load(data, **kw)`` for ``want`` (``"mnist"`` at the GPU scale), falling back to the
    digits where the MNIST files are not found; returns the data, its name and a note."""
    data = ctx.pick("digits", want)
    if data == "mnist":
        try:
            return load("mnist", **kw), "mnist", ""
        except (OSError, ValueError) as e:
            return load("digits", **kw), "digits", f"MNIST not found ({e}): the digits instead. "
    return load("digits", **kw), "digits", ""


# -- MADE --------------------------------------------------------------------------------------
def made_rows(ctx: Context) -> list[dict]:
    """A MADE 2x512 (logistic conditionals) trained on MNIST (20 epochs), 100 samples from the
    same noise by ancestral sampling and by Jacobi (online stop, tol 1e-5; Song et al. 2021,
    §5.3.1: 26x on a GPU)."""
    from paraprop.models import MADE
    from paraprop.sampling import sample
    from paraprop_lab.experiments.made import TOL
    from paraprop_lab.training.made import made_data, train_made

    x, data, note = _images(ctx, made_data, "mnist", conditional="logistic")
    hidden, epochs = ctx.pick(((16, 16), 1), ((512, 512), 20 if data == "mnist" else 30))
    if ctx.tiny:
        x = x[:128]
    dev, n = ctx.device, ctx.pick(8, 100)
    model = MADE(x.shape[1], hidden, "logistic", seed=0).to(dev)
    hist = train_made(model, x.to(dev), epochs=epochs, progress=False)
    model.requires_grad_(False)
    noise = model.draw_noise(n, torch.Generator().manual_seed(0))
    runs = {"ancestral": lambda: sample(model, n, method="sequential", noise=noise),
            "jacobi": lambda: sample(model, n, method="jacobi", tol=TOL, noise=noise)}
    times = ctx.time(runs, repeats=ctx.rounds(5), desc="made")
    ref, _ = runs["ancestral"]()
    got, sol = runs["jacobi"]()
    D = model.features
    return [row("made", "jacobi_vs_ancestral", what="MADE sampling: Jacobi vs ancestral",
                shape=f"MADE {'x'.join(map(str, hidden))} on {data} (D={D}), {n} samples",
                baseline="ancestral (D passes)", baseline_s=times["ancestral"],
                method=f"jacobi, online stop, tol {TOL:g}", method_s=times["jacobi"],
                target=MADE_TARGET, max_dev=max_abs(got, ref), bound=TOL,
                note=note + f"trained here: {epochs} epochs, NLL {hist[-1]:.3f} nats/dim",
                iterations=sol.iterations, evaluations=sol.evaluations, passes_saved=D /
                max(1, sol.evaluations))]


# -- PixelCNN ----------------------------------------------------------------------------------
def pixelcnn_rows(ctx: Context) -> list[dict]:
    """A gated PixelCNN (hidden 32, 5 layers, 1 epoch on MNIST), 16 images from the same noise
    by the cached sequential sampler and by GS-Jacobi (tol 0; Song et al. 2021, Table 1: 4.4x
    on a GPU)."""
    from paraprop.models import PixelCNN
    from paraprop.sampling import sample
    from paraprop.sampling.pixelcnn import DEFAULT_WINDOW_ROWS
    from paraprop.solvers import GSJacobi
    from paraprop_lab.training.pixelcnn import pixel_data, train_pixelcnn

    (x, levels), data, note = _images(ctx, pixel_data, "mnist")
    hidden, layers, epochs = ctx.pick((8, 2, 1), (32, 5, 1 if data == "mnist" else 10))
    if ctx.tiny:
        x = x[:64]
    dev, n = ctx.device, ctx.pick(2, 16)
    model = PixelCNN(1, x.shape[-1], hidden=hidden, layers=layers, mixtures=5,
                     levels=levels).to(dev)
    hist = train_pixelcnn(model, x.to(dev), epochs=epochs, progress=False)
    model.requires_grad_(False)
    noise = model.draw_noise(n, torch.Generator().manual_seed(0))
    rows_per = min(DEFAULT_WINDOW_ROWS, model.size)
    runs = {"cached": lambda: sample(model, n, method="sequential_cached", noise=noise, tol=0),
            "gs_jacobi": lambda: sample(model, n, method=GSJacobi(block_size=rows_per),
                                        noise=noise, tol=0)}
    # gs_jacobi checks its cached columns against the full pass and refuses cuDNN's TF32
    # convolutions (torch's default on CUDA; paraprop.sampling.pixelcnn): both samplers run
    # with cuDNN in float32 here, as a user would set it
    with cudnn_float32(dev) as changed:
        times = ctx.time(runs, repeats=ctx.rounds(3), desc="pixelcnn")
        ref, _ = runs["cached"]()
        got, sol = runs["gs_jacobi"]()
    if changed:
        note += "cuDNN convolutions in float32 (fp32_precision 'ieee'; gs_jacobi refuses TF32); "
    return [row("pixelcnn", "gs_jacobi_vs_cached", what="PixelCNN sampling: GS-Jacobi vs the "
                "cached sequential sampler", shape=f"hidden {hidden}, {layers} layers, {data} "
                f"{model.size}x{model.size}, {n} images", baseline="sequential, cached",
                baseline_s=times["cached"], method=f"gs_jacobi, windows of {rows_per} rows, "
                "tol 0", method_s=times["gs_jacobi"], target=PIXELCNN_TARGET,
                max_dev=max_abs(got, ref), bound=0.0,
                note=note + f"trained here: {epochs} epoch(s), {hist[-1]:.3f} bits/dim",
                iterations=sol.iterations, evaluations=sol.evaluations,
                identical=bool(torch.equal(got, ref)))]


# -- decoding ----------------------------------------------------------------------------------
def _charlm(ctx: Context):
    from paraprop.models.charlm import char_gpt2
    from paraprop_lab.training.charlm import TRAIN, corpus, train_charlm

    vocab, train, held = corpus()
    kw = ctx.pick({"width": 16, "layers": 1, "heads": 2, "context": 64}, {})
    steps = ctx.pick(3, TRAIN["steps"])
    model = char_gpt2(len(vocab), seed=0, **kw).to(ctx.device)
    hist = train_charlm(model, train.to(ctx.device), steps=steps, progress=False,
                        length=min(TRAIN["length"], model.config.n_positions))
    model.requires_grad_(False)
    return model, vocab, held, steps, hist


def decoding_rows(ctx: Context) -> list[dict]:
    """The character-level GPT-2-shaped LM of ``paraprop bench decoding`` (trained here, 1500
    steps), greedy, batch 1, 256 new tokens: ``model.generate`` (transformers, KV cache) vs
    Jacobi decoding (window 16, n-gram guesses); also the window sizes, the measurement behind
    the default window."""
    from paraprop.decoding import generate
    from paraprop_lab.experiments.decoding import prompts

    model, vocab, held, steps, hist = _charlm(ctx)
    new = ctx.pick(16, 256)
    ids = prompts(vocab, held, 1).to(ctx.device)

    def hf():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              pad_token_id=0, do_sample=False)

    def ours(**kw):   # (an uncertified token is reported in the row, not raised)
        return lambda: generate(model, ids, max_new_tokens=new, throw=False, **kw)

    runs = {"generate": hf, "jacobi": ours(window=16), "sequential": ours(method="sequential")}
    with torch.no_grad():
        times = ctx.time(runs, repeats=ctx.rounds(3), desc="decoding")
        want, tokens = hf(), {}
        for k in ("jacobi", "sequential"):
            tokens[k], sol = runs[k]()
            if k == "jacobi":
                stats, certified = sol.stats, sol.converged
        windows = ctx.pick([4, 8], [4, 8, 16, 32, 64])
        wtimes = ctx.time({f"window {w}": ours(window=w) for w in windows},
                          repeats=ctx.rounds(3), desc="decoding windows")
        batch = _batch_rows(ctx, model, prompts(vocab, held, 8).to(ctx.device), new)
        extra = [*guarded("decoding", "sampled_gumbel",
                          lambda: _sampled_rows(ctx, model, ids, new)),
                 *guarded("decoding", "jacobi_vs_prompt_lookup",
                          lambda: _lookup_rows(ctx, model, ids, new))]
    differ = int((tokens["jacobi"] != want).sum())
    shape = f"char LM ({sum(p.numel() for p in model.parameters())} parameters), batch 1, " \
            f"{new} new tokens, greedy"
    return [row("decoding", "jacobi_vs_generate", what="greedy decoding: Jacobi vs "
                "model.generate", shape=shape, baseline="transformers generate (KV cache)",
                baseline_s=times["generate"], method="paraprop jacobi, window 16, n-gram "
                "guesses", method_s=times["jacobi"], target=DECODING_TARGET,
                max_dev=float(differ), bound=0.0,
                note=f"deviation: tokens that differ from generate's; trained here: {steps} "
                f"steps, loss {hist[-1]:.3f}", model_calls=stats.get("model_calls"),
                tokens_per_call=stats.get("tokens_per_call"),
                same_as_sequential=bool(torch.equal(tokens["jacobi"], tokens["sequential"])),
                certified=certified,
                vs_sequential=times["sequential"] / times["jacobi"]),
            choice("decoding", "window", what="paraprop.decoding.generate window (default 16)",
                   shape=shape, times=wtimes, auto="window 16" if 16 in windows else None),
            *batch, *extra]


def _sampled_rows(ctx: Context, model, ids: torch.Tensor, new: int) -> list[dict]:
    """Sampled, temperature 0.8, batch 1 (issue 32: 1.5x the sequential sampler, the same
    tokens): paraprop's sequential loop against Jacobi (window 16), both with the Gumbel-max
    coupling and the same seed."""
    from paraprop.decoding import generate
    from paraprop_lab.experiments.decoding import TEMPERATURE

    def ours(**kw):
        return lambda: generate(model, ids, max_new_tokens=new, throw=False, do_sample=True,
                                temperature=TEMPERATURE, top_k=0, coupling="gumbel",
                                generator=torch.Generator().manual_seed(0), **kw)

    runs = {"sequential": ours(method="sequential"), "jacobi": ours(window=16)}
    times = ctx.time(runs, repeats=ctx.rounds(3), desc="decoding sampled")
    want, _ = runs["sequential"]()
    got, sol = runs["jacobi"]()
    return [row("decoding", "sampled_gumbel", what=f"sampled decoding (temperature "
                f"{TEMPERATURE}, Gumbel-max coupling): Jacobi vs the sequential sampler",
                shape=f"char LM, batch 1, {new} new tokens", baseline="paraprop sequential "
                "(KV cache, the same coupling and seed)", baseline_s=times["sequential"],
                method="paraprop jacobi, window 16", method_s=times["jacobi"],
                target=DECODING_SAMPLED_TARGET, max_dev=float((got != want).sum()), bound=0.0,
                note="deviation: tokens that differ from the sequential sampler's",
                model_calls=sol.stats.get("model_calls"),
                tokens_per_call=sol.stats.get("tokens_per_call"), certified=sol.converged)]


def _lookup_rows(ctx: Context, model, ids: torch.Tensor, new: int) -> list[dict]:
    """Greedy, batch 1 (issue 32: 1.5x transformers' best prompt-lookup setting): the best of
    ``prompt_lookup_num_tokens`` 3/5/10 x n-gram 2/3 against Jacobi (window 16)."""
    from paraprop.decoding import generate
    from paraprop_lab.experiments.decoding_peers import LOOKUP, NGRAM

    plain = {"attention_mask": torch.ones_like(ids), "max_new_tokens": new, "pad_token_id": 0,
             "do_sample": False}
    runs = {f"lookup k={k} n={n}": (lambda k=k, n=n: model.generate(
        ids, **plain, prompt_lookup_num_tokens=k, max_matching_ngram_size=n))
        for k in LOOKUP for n in NGRAM}
    runs["jacobi"] = lambda: generate(model, ids, max_new_tokens=new, throw=False, window=16)
    times = ctx.time(runs, repeats=ctx.rounds(3), desc="decoding lookup")
    want = model.generate(ids, **plain)
    lookups = {k: t for k, t in times.items() if k != "jacobi"}
    best = min(lookups, key=lambda k: lookups[k])
    differ = [int((runs[k]() != want).sum()) for k in lookups]
    got, sol = runs["jacobi"]()
    return [row("decoding", "jacobi_vs_prompt_lookup", what="greedy decoding: Jacobi vs "
                "transformers' best prompt-lookup setting", shape=f"char LM, batch 1, {new} "
                "new tokens, greedy", baseline=f"generate, prompt lookup ({best}, the best of "
                f"{len(lookups)})", baseline_s=lookups[best], method="paraprop jacobi, "
                "window 16, n-gram guesses", method_s=times["jacobi"],
                target=DECODING_LOOKUP_TARGET, max_dev=float((got != want).sum()), bound=0.0,
                note="deviation: tokens that differ from generate's (prompt lookup's: "
                f"{max(differ)} at most)", certified=sol.converged,
                lookup_ms={k: 1e3 * t for k, t in lookups.items()})]


def _batch_rows(ctx: Context, model, ids: torch.Tensor, new: int) -> list[dict]:
    """Greedy, batch 8 (issue 32's target: 2x ``generate``): ``model.generate`` against Jacobi
    decoding whose batch advances with its slowest sample (``batch_advance="minimum"``, the
    default) and per sample (``"per-sample"``: each sample's own window in one wider block,
    which on a CPU costs its arithmetic and on a GPU about one pass)."""
    from paraprop.decoding import generate

    def hf():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              pad_token_id=0, do_sample=False)

    def ours(advance):
        return lambda: generate(model, ids, max_new_tokens=new, throw=False, window=16,
                                batch_advance=advance)

    runs = {"generate": hf, "minimum": ours("minimum"), "per-sample": ours("per-sample")}
    times = ctx.time(runs, repeats=ctx.rounds(3), desc="decoding batch 8")
    want = hf()
    shape = f"char LM, batch {ids.shape[0]}, {new} new tokens, greedy"
    out = []
    for advance in ("minimum", "per-sample"):
        got, sol = runs[advance]()
        out.append(row("decoding", f"batch8_{advance.replace('-', '_')}",
                       what=f"greedy decoding, batch 8: Jacobi ({advance} advance) vs "
                       "model.generate", shape=shape,
                       baseline="transformers generate (KV cache)", baseline_s=times["generate"],
                       method=f"paraprop jacobi, window 16, batch_advance={advance!r}",
                       method_s=times[advance], target=DECODING_BATCH_TARGET,
                       max_dev=float((got != want).sum()), bound=0.0,
                       note="deviation: tokens that differ from generate's",
                       model_calls=sol.stats.get("model_calls"),
                       fed_positions=sol.stats.get("fed_positions"),
                       certified=sol.converged))
    return out


# -- diffusion ---------------------------------------------------------------------------------
def _denoiser(ctx: Context, data: str, epochs: int, n: int | None):
    from paraprop_lab.training.ddpm import ddpm_data, make_denoiser, train_ddpm

    x = ddpm_data(data, n=n)
    model = make_denoiser(data, x).to(ctx.device)
    hist = train_ddpm(model, x.to(ctx.device), epochs=epochs, progress=False)
    return model.requires_grad_(False), hist


def _chain_row(ctx: Context, name: str, model, scheduler, shape, steps: int, eta, what: str,
               label: str, note: str) -> dict:
    from paraprop.diffusion import sample
    from paraprop_lab.experiments.diffusion import TOL
    from paraprop_lab.training.ddpm import sample_loop

    kw = {} if eta is None else {"eta": eta}

    def ours(method, **extra):
        return lambda: sample(model, scheduler, shape, num_inference_steps=steps, method=method,
                              generator=torch.Generator().manual_seed(0), **extra, **kw)

    # throw=False: a run the certificate refuses (the first GPU run: the UNet's batched calls in
    # TF32 round apart from the loop's) is a row that says so, not a failed row
    runs = {"loop": lambda: sample_loop(model, scheduler, shape, steps, seed=0, eta=eta),
            "picard": ours("picard", tol=TOL, throw=False)}
    times = ctx.time(runs, repeats=ctx.rounds(3), desc=name)
    ref, _ = ours("sequential")()
    got, sol = runs["picard"]()
    if not sol.converged:
        note += f"; not certified: {_why(sol)}"
    return row("diffusion", name, what=what, shape=f"{label}, batch {shape[0]}",
               baseline="diffusers loop", baseline_s=times["loop"],
               method=f"picard, window {sol.stats['window']}, tol {TOL:g}",
               method_s=times["picard"], target=DIFFUSION_TARGET, max_dev=max_abs(got, ref),
               bound=TOL, note=note, iterations=sol.iterations,
               model_evals=sol.stats.get("model_evaluations"), certified=sol.converged,
               loop_vs_sequential=max_abs(runs["loop"](), ref))


def _why(sol) -> str:
    """Why a diffusion run was not certified (its reason, as the Solution states it)."""
    return str(sol.stats.get("reason", sol.stats.get("not_converged")))


def _scheduler_rows(ctx: Context, name: str, model, make, shape, steps: int, what: str,
                    label: str, note: str, target: float | None) -> list[dict]:
    """Any scheduler with a reader: the pipelines' loop (a fresh ``make()``) against ``picard``
    and ``anderson`` at the diffusion suite's tolerance, each row with the sequential model
    calls and evaluations; deviations from paraprop's sequential sample (the loop's bits)."""
    from paraprop.diffusion import sample
    from paraprop_lab.experiments.diffusion import MEMORY, TOL, pipeline_loop

    specs = {"picard": {"method": "picard"},
             "anderson": {"method": "anderson", "memory": MEMORY}}

    def ours(spec):
        return lambda: sample(model, make(), shape, num_inference_steps=steps, tol=TOL,
                              throw=False, generator=torch.Generator().manual_seed(0), **spec)

    runs = {"loop": lambda: pipeline_loop(model, make(), shape, steps, seed=0),
            **{k: ours(v) for k, v in specs.items()}}
    times = ctx.time(runs, repeats=ctx.rounds(3), desc=name)
    ref, _ = sample(model, make(), shape, num_inference_steps=steps, method="sequential",
                    generator=torch.Generator().manual_seed(0))
    out = []
    for k in specs:
        got, sol = runs[k]()
        calls = sol.iterations          # one batched model call each (the bench's count)
        out.append(row("diffusion", f"{name}.{k}", what=what, shape=f"{label}, batch "
                       f"{shape[0]}", baseline="diffusers loop (the pipelines')",
                       baseline_s=times["loop"], method=f"{k}, tol {TOL:g}",
                       method_s=times[k], target=target, max_dev=max_abs(got, ref), bound=TOL,
                       note=note + f"{calls} sequential model calls for {steps} steps"
                       + ("" if sol.converged else "; not certified: "
                          + _why(sol)),
                       model_calls=calls, model_evals=sol.stats.get("model_evaluations"),
                       converged=sol.converged,
                       loop_vs_sequential=max_abs(runs["loop"](), ref)))
    return out


def diffusion_rows(ctx: Context) -> list[dict]:
    """ParaDiGMS' setting: the MLP denoiser on two moons, DDPM with 1000 steps, and the small
    UNet on the digits, DDIM with 50 steps (eta 0); the diffusers loop against Picard
    iteration on the same noise (ParaDiGMS: 2-4x on GPUs)."""
    from diffusers import DDIMScheduler, DDPMScheduler

    out = []
    epochs = ctx.pick(1, 100)
    mlp, hist = _denoiser(ctx, "moons", epochs, ctx.pick(256, None))
    steps = ctx.pick(20, 1000)
    out.append(_chain_row(ctx, "ddpm_mlp_moons", mlp, DDPMScheduler(clip_sample=False),
                          (16, 2), steps, None, "diffusion sampling (DDPM, MLP denoiser): "
                          "Picard vs the diffusers loop", f"MLP on two moons, DDPM {steps} steps",
                          f"trained here: {epochs} epochs (the CPU suite: 300), loss "
                          f"{hist[-1]:.3f}"))
    epochs = ctx.pick(1, 30)
    unet, hist = _denoiser(ctx, "digits", epochs, ctx.pick(64, None))
    steps = ctx.pick(5, 50)
    out.append(_chain_row(ctx, "ddim_unet_digits", unet, DDIMScheduler(clip_sample=False),
                          (16, 1, 8, 8), steps, 0.0, "diffusion sampling (DDIM, UNet): Picard "
                          "vs the diffusers loop", f"UNet2DModel on the digits, DDIM {steps} "
                          "steps, eta 0", f"trained here: {epochs} epochs (the CPU suite: "
                          f"100), loss {hist[-1]:.3f}"))
    if ctx.device.type == "cuda":
        # the same in float32 convolutions: in torch's default (TF32) the second GPU run's
        # batched calls rounded 6.8e-4 apart from the loop's and the certificate refused;
        # whether they round apart in float32 too decides UNet sampling on a GPU
        def float32_row():
            with cudnn_float32(ctx.device):
                return [_chain_row(ctx, "ddim_unet_digits.float32", unet,
                                   DDIMScheduler(clip_sample=False), (16, 1, 8, 8), steps, 0.0,
                                   "diffusion sampling (DDIM, UNet), cuDNN in float32: Picard "
                                   "vs the diffusers loop", f"UNet2DModel on the digits, DDIM "
                                   f"{steps} steps, eta 0", "cuDNN convolutions in float32 "
                                   "(fp32_precision 'ieee'), the loop's too")]
        out += guarded("diffusion", "ddim_unet_digits.float32", float32_row)
    out += guarded("diffusion", "flowmatch_dpmpp", lambda: flowmatch_rows(ctx, mlp))
    return out


def flowmatch_rows(ctx: Context, eps_mlp) -> list[dict]:
    """Issue 31's rows: flow matching (``FlowMatchEulerDiscreteScheduler``, shift 1, 50 steps,
    batch 16) on the shipped two-moons velocity model (target: 2x the loop's time), and
    DPM-Solver++ 2M at 25 steps on the moons epsilon MLP (reported)."""
    from diffusers import DPMSolverMultistepScheduler

    from paraprop_lab.demos import _weights
    from paraprop_lab.training.flowmatch import flowmatch_scheduler

    out = []
    if _weights.path("flowmatch") is None:
        out.append(skipped("diffusion", "flowmatch_euler", "the shipped flow-matching model "
                           "(paraprop train flowmatch) is not in this tree"))
    else:
        vel = _weights.load("flowmatch").to(ctx.device).requires_grad_(False)
        steps = ctx.pick(10, 50)
        out += _scheduler_rows(ctx, "flowmatch_euler", vel, flowmatch_scheduler, (16, 2), steps,
                               "flow matching (Euler): Picard / Anderson vs the diffusers loop",
                               f"MLP velocity model on two moons, FlowMatch Euler {steps} steps",
                               f"{_weights.describe('flowmatch')}; ", FLOWMATCH_TARGET)
    steps = ctx.pick(10, 25)
    out += _scheduler_rows(ctx, "dpmpp2m", eps_mlp, DPMSolverMultistepScheduler, (16, 2), steps,
                           "DPM-Solver++ 2M: Picard / Anderson vs the diffusers loop",
                           f"MLP on two moons, DPM-Solver++ 2M {steps} steps",
                           "the DDPM row's model; ", None)
    return out


# -- TarFlow -----------------------------------------------------------------------------------
def tarflow_rows(ctx: Context) -> list[dict]:
    """A TarFlow trained on MNIST (28x28, 49 patches of 16 values, 8 blocks; the recipe of
    ``paraprop train tarflow``), 16 images from the same latents: the key/value-cached loop
    against Jacobi and the per-block plan of ``method="auto"`` (TarFlow's GS-Jacobi: 2.5-5.3x)."""
    from paraprop.models.tarflow import TarFlow
    from paraprop.solvers import GSJacobi
    from paraprop_lab.experiments.tarflow import TOL, _plan_text
    from paraprop_lab.training.tarflow import DEFAULTS, EPOCHS, PATCH, tarflow_data, train_tarflow

    x, data, note = _images(ctx, tarflow_data, "mnist")
    opts = {**DEFAULTS, "patch_size": PATCH[data]}
    epochs = ctx.pick(1, EPOCHS[data])
    if ctx.tiny:
        x = x[:64]
        opts.update(blocks=2, width=16, heads=2)
    flow = TarFlow(x.shape[-1], x.shape[1], opts["patch_size"], opts["blocks"], opts["layers"],
                   opts["width"], opts["heads"], opts["noise_std"], seed=0).to(ctx.device)
    hist = train_tarflow(flow, x.to(ctx.device), epochs=epochs, batch_size=opts["batch_size"],
                         lr=opts["lr"], progress=False)
    flow.requires_grad_(False)
    batch = ctx.pick(2, 16)
    z = torch.randn(batch, flow.channels, flow.image_size, flow.image_size,
                    generator=torch.Generator().manual_seed(0)).to(ctx.device)
    window = max(8, flow.T // 4)
    specs = {"cached": ("sequential_cached", 0.0), "jacobi": ("jacobi", TOL),
             f"gs-jacobi {window}": (GSJacobi(window), TOL), "auto": ("auto", TOL)}
    with torch.no_grad():
        exact, _ = flow.inverse(z, method="sequential", tol=0.0)
        flow.inverse(z, method="auto", tol=TOL)          # its calibration, outside the timing
        times = ctx.time({k: (lambda m=m, t=t: flow.inverse(z, method=m, tol=t))
                          for k, (m, t) in specs.items()}, repeats=ctx.rounds(3), desc="tarflow")
        results = {k: flow.inverse(z, method=m, tol=t) for k, (m, t) in specs.items()}
    shape = (f"{data} {flow.image_size}x{flow.image_size}, {flow.T} patches of {flow.P}, "
             f"{opts['blocks']} blocks, batch {batch}")
    note += f"trained here: {epochs} epochs, loss {hist[-1]:.3f}"
    out = []
    for k in ("jacobi", "auto"):
        got, sol = results[k]
        out.append(row("tarflow", f"{k}_vs_cached", what="TarFlow sampling vs the KV-cached "
                       "loop", shape=shape, baseline="sequential, KV cache",
                       baseline_s=times["cached"], method=f"{k}, tol {TOL:g}", method_s=times[k],
                       target=TARFLOW_TARGET, max_dev=max_abs(got, exact), bound=TOL, note=note,
                       model_calls=sol.stats.get("model_calls"),
                       plan=_plan_text(sol.stats["methods"])))
    auto_s = times.pop("auto")
    out.append(choice("tarflow", "plan", what="TarFlow.inverse method='auto' (a plan per block, "
                      "calibrated at run time)", shape=shape, times=times, auto=None,
                      auto_s=auto_s, note="auto's plan: "
                      + _plan_text(results["auto"][1].stats["methods"])))
    return out
