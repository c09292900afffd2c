"""TarFlow sampling measured method by method against the KV-cached loop; shared by
``paraprop bench tarflow`` and the TarFlow demo part.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402

from paraprop.solvers import GSJacobi, SlidingJacobi  # noqa: E402
from paraprop_lab.experiments.harness import interleaved, median  # noqa: E402

TOL = 1e-5


COLUMNS = ["method", "tol", "model_calls", "iterations_per_block", "time_ms", "speedup",
           "max_abs_err", "converged", "plan"]


def method_rows(flow, batch: int, *, repeats: int, desc: str) -> tuple[list[dict], dict]:
    """Every method on the same latents; rows, and each block's Jacobi residuals."""
    ref_w = flow.blocks[0].out.weight
    z = torch.randn(batch, flow.channels, flow.image_size, flow.image_size,
                    generator=torch.Generator().manual_seed(0), dtype=ref_w.dtype)
    T = flow.T
    window = max(8, T // 4)
    specs = {   # label: (method, tol, chunk); chunk None is the default, T one chunk a pass
        "sequential, KV cache": ("sequential_cached", 0.0, None),
        "jacobi": ("jacobi", TOL, None),
        "jacobi, one chunk": ("jacobi", TOL, T),
        "jacobi, one chunk, tol 1e-4": ("jacobi", 1e-4, T),
        "jacobi, tol 0": ("jacobi", 0.0, None),
        f"sliding jacobi (window {window})": (SlidingJacobi(window), TOL, None),
        f"gs-jacobi (blocks of {window})": (GSJacobi(window), TOL, None),
        "auto (calibrated per block)": ("auto", TOL, None),
        "auto, one chunk": ("auto", TOL, T),
    }
    with torch.no_grad():
        exact = {c: flow.inverse(z, method="sequential", tol=0.0, chunk=c)[0]
                 for c in {c for _, _, c in specs.values()}}
        for chunk in (None, T):                        # calibrate once, outside the timing
            flow.inverse(z, method="auto", tol=TOL, chunk=chunk)

        def runner(method, tol, chunk):
            return lambda: flow.inverse(z, method=method, tol=tol, chunk=chunk)

        times = interleaved({k: runner(*v) for k, v in specs.items()}, repeats=repeats,
                            warmup=1, desc=desc)
        base = median(times["sequential, KV cache"])
        rows, curves = [], {}
        for label, (method, tol, chunk) in specs.items():
            x, sol = flow.inverse(z, method=method, tol=tol, chunk=chunk)
            t = median(times[label])
            rows.append({"method": label, "tol": tol, "model_calls": sol.stats["model_calls"],
                         "iterations_per_block": " ".join(str(b.iterations)
                                                          for b in sol.stats["blocks"]),
                         "time_ms": 1e3 * t, "speedup": base / t,
                         "max_abs_err": float((x - exact[chunk]).abs().max()),
                         "converged": sol.converged,
                         "plan": _plan_text(sol.stats["methods"])})
            if label == "jacobi, tol 0":
                curves = {k: b.residuals.tolist() for k, b in enumerate(sol.stats["blocks"])}
    return rows, curves


def _plan_text(methods: list[str]) -> str:
    """A per-block plan in a few words, e.g. ``7 x jacobi, sequential_cached``."""
    out, run = [], 1
    for i, m in enumerate(methods):
        if i + 1 < len(methods) and methods[i + 1] == m:
            run += 1
            continue
        out.append(f"{run} x {m}" if run > 1 else m)
        run = 1
    return ", ".join(out)

