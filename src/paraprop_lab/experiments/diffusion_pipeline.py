"""A diffusers pipeline end to end under :func:`paraprop.diffusion.accelerate` (issue 31 item 5):
the plain pipeline's own call against the same call accelerated, timed interleaved, with the
denoiser calls each makes in sequence and the images' largest difference.

The pipeline is ``DDIMPipeline`` around a ``UNet2DModel`` (the bench's digits denoiser, trained
here): the user's one line is ``with accelerate(pipe, tol=...): pipe(...)``. Where paraprop does
not serve a run (at ``tol=0`` a model whose batched calls round apart from the loop's, as
convolutions on the CPU do), the row says it fell through and why: the pipeline then ran its own
loop, and its time includes paraprop's attempt.
"""

from __future__ import annotations

import warnings

import torch

from paraprop.diffusion import BatchVarianceWarning, FallThroughWarning, accelerate
from paraprop_lab.experiments.harness import interleaved, median

PIPELINE_COLUMNS = ["method", "tol", "sequential_calls", "model_evals", "time_ms", "speedup",
                    "max_abs_err", "served"]


def pipeline_rows(unet, *, steps: int, batch: int, specs: dict[str, dict], repeats: int,
                  seed: int = 0) -> list[dict]:
    """Rows for ``DDIMPipeline(unet, DDIMScheduler(clip_sample=False))`` called with
    ``batch_size=batch``, ``num_inference_steps=steps``, a seeded generator and
    ``output_type="np"``: the plain call first, then one row per ``specs`` entry (label ->
    :func:`accelerate`'s keyword arguments).

    Columns (:data:`PIPELINE_COLUMNS`): ``sequential_calls`` the denoiser calls in sequence
    (paraprop's batched calls plus the pipeline's own calls of the real denoiser),
    ``model_evals`` paraprop's denoiser evaluations per sample (the plain loop's: ``steps``),
    ``speedup`` the plain call's median time over the row's, ``max_abs_err`` the largest
    difference of the images from the plain call's, ``served`` how many of the ``steps``
    denoiser outputs paraprop served, or the fall-through reason (and whether the model's
    batched calls rounded apart from the loop's: a ``BatchVarianceWarning``).
    """
    from diffusers import DDIMPipeline, DDIMScheduler

    pipe = DDIMPipeline(unet=unet, scheduler=DDIMScheduler(clip_sample=False))
    pipe.set_progress_bar_config(disable=True)

    def call():
        return pipe(batch_size=batch, generator=torch.Generator().manual_seed(seed),
                    num_inference_steps=steps, output_type="np").images

    handles, variant = {}, set()

    def accelerated(label: str, kw: dict):
        def run():
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always", FallThroughWarning)
                warnings.simplefilter("always", BatchVarianceWarning)
                with accelerate(pipe, **kw) as handle:
                    out = call()
            if any(issubclass(w.category, BatchVarianceWarning) for w in seen):
                variant.add(label)
            handles[label] = handle
            return out
        return run

    cases = {"plain pipeline": call, **{k: accelerated(k, v) for k, v in specs.items()}}
    times = interleaved(cases, repeats=repeats, warmup=1, desc=f"DDIMPipeline {steps}")
    ref = call()
    base = median(times["plain pipeline"])
    rows = [{"method": "plain pipeline", "tol": "-", "sequential_calls": steps,
             "model_evals": steps, "time_ms": 1e3 * base, "speedup": 1.0, "max_abs_err": 0.0,
             "served": "-"}]
    for label, kw in specs.items():
        out = cases[label]()
        handle = handles[label]
        c = handle.counters
        sol = handle.solution
        served = f"{c.served} of {c.steps}" if not handle.reasons else \
            f"fell through: {handle.reasons[0][2][:120]}"
        if label in variant:   # (carried in the certificate's bound: BatchVarianceWarning)
            served += " (batch-variant model: the bound carries it)"
        t = median(times[label])
        rows.append({"method": label, "tol": kw.get("tol", 0.0),
                     "sequential_calls": c.model_calls + c.denoiser_calls,
                     "model_evals": None if sol is None else sol.stats["model_evaluations"],
                     "time_ms": 1e3 * t, "speedup": base / t,
                     "max_abs_err": float(abs(out - ref).max()), "served": served})
    return rows


__all__ = ["PIPELINE_COLUMNS", "pipeline_rows"]
