"""``paraprop bench pixelcnn``: Table 1 of Song et al. 2021 (§5.3.2) on this machine.

A gated PixelCNN with a discretized logistic mixture is trained briefly on the MNIST test set
(28x28) and on the digits (8x8); then 16 images are sampled for the same noise by sequential
sampling without a cache (a full forward pass per pixel), with the fast-generation cache, by
Jacobi, GS-Jacobi and Jacobi-GS. Reported: time, speedups over both sequential samplers (same
run), iterations, network steps, and whether the image is identical; a sweep of block / window
sizes; a figure with one row of samples per sampler.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paraprop.models import PixelCNN
from paraprop.sampling import sample
from paraprop.sampling.pixelcnn import DEFAULT_BLOCK_ROWS, DEFAULT_WINDOW_ROWS
from paraprop.solvers import GSJacobi, JacobiGS
from paraprop_lab.experiments import rows_sampling as _rows
from paraprop_lab.experiments.harness import interleaved, machine_info, median
from paraprop_lab.experiments.made import image_rows
from paraprop_lab.experiments.report import markdown_table, text_table, write_results
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows
from paraprop_lab.training.pixelcnn import pixel_data, train_pixelcnn

SWEEP_REPEATS = 3  # at least this many timed runs per sweep row (after one warm-up run)

DESCRIPTION = "PixelCNN sampling: sequential with/without cache vs Jacobi, GS-Jacobi, Jacobi-GS"

# the headline rows on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("pixelcnn.gs_jacobi", _rows.pixelcnn_rows, 12)]
COLUMNS = ["method", "block_size", "iterations", "evaluations", "time_s", "vs uncached",
           "vs cached", "identical"]


def trained_pixelcnn(out_dir: Path, data: str, *, hidden: int, layers: int, epochs: int,
                     subset: int | None = None) -> tuple[PixelCNN, dict]:
    """Train (or reuse the checkpoint of the same config in ``out_dir``) a PixelCNN."""
    tag = f"h{hidden}_l{layers}_e{epochs}" + (f"_n{subset}" if subset else "")
    path = out_dir / f"pixelcnn_{data}_{tag}.pt"
    if path.exists():
        return PixelCNN.load(path).requires_grad_(False), {"checkpoint": str(path)}
    x, levels = pixel_data(data)
    if subset:
        x = x[:subset]
    model = PixelCNN(1, x.shape[-1], hidden=hidden, layers=layers, mixtures=5, levels=levels)
    hist = train_pixelcnn(model, x, epochs=epochs)
    model.save(path)
    return model.requires_grad_(False), {"checkpoint": str(path), "bits_per_dim": hist,
                                         "train_images": len(x)}


def table(model: PixelCNN, n: int, *, repeats: int, block_rows: int, window_rows: int,
          desc: str) -> tuple[list[dict], dict]:
    """The five samplers for the same noise, timed interleaved in one run."""
    noise = model.draw_noise(n, torch.Generator().manual_seed(0))
    specs = {
        "sequential (no cache)": ("sequential", None),
        "sequential (cache)": ("sequential_cached", None),
        "jacobi": ("jacobi", None),
        "gs_jacobi": ("gs_jacobi", window_rows),
        "jacobi_gs": ("jacobi_gs", block_rows),
    }
    results = {k: sample(model, n, method=_method(m, b), noise=noise, tol=0)
               for k, (m, b) in specs.items()}
    runs = {k: (lambda m=m, b=b: sample(model, n, method=_method(m, b), noise=noise, tol=0))
            for k, (m, b) in specs.items()}
    times = interleaved(runs, repeats=repeats, warmup=1, desc=desc)
    ref = results["sequential (no cache)"][0]
    t_unc, t_cac = median(times["sequential (no cache)"]), median(times["sequential (cache)"])
    rows = []
    for k, (x, sol) in results.items():
        t = median(times[k])
        rows.append({"method": k, "block_size": specs[k][1] or "", "iterations": sol.iterations,
                     "evaluations": sol.evaluations, "time_s": t, "vs uncached": t_unc / t,
                     "vs cached": t_cac / t, "identical": bool(torch.equal(x, ref))})
    return rows, {k: v[0] for k, v in results.items()}


def _method(name: str, rows: int | None):
    """The method argument of :func:`sample`: a name, or a hybrid with its rows per block."""
    if rows is None:
        return name
    return {"jacobi_gs": JacobiGS, "gs_jacobi": GSJacobi}[name](block_size=rows)


def sweep(model: PixelCNN, n: int, sizes: list[int], *, repeats: int = SWEEP_REPEATS
          ) -> list[dict]:
    """Block / window sizes: time (median of ``repeats`` runs after a warm-up, interleaved with
    the cached sampler: its ratio comes from the same run) and iterations."""
    noise = model.draw_noise(n, torch.Generator().manual_seed(0))
    rows = []
    for method in ("gs_jacobi", "jacobi_gs"):
        for b in sizes:
            if b > model.size:
                continue
            times = interleaved({
                "cached": lambda: sample(model, n, method="sequential_cached", noise=noise),
                method: lambda m=method, b=b: sample(model, n, method=_method(m, b),
                                                     noise=noise, tol=0)},
                repeats=repeats, warmup=1, desc=f"{method} {b}")
            _, sol = sample(model, n, method=_method(method, b), noise=noise, tol=0)
            t = median(times[method])
            rows.append({"method": method, "block_size": b, "iterations": sol.iterations,
                         "evaluations": sol.evaluations, "time_s": t,
                         "vs cached": median(times["cached"]) / t})
    return rows


def samples_figure(path: Path, images: dict[str, torch.Tensor], title: str, n: int = 8) -> Path:
    """One row of samples per sampler (images ``(N, 1, S, S)`` in ``[-1, 1]``)."""
    return image_rows(path, [(k, (x[:, 0] + 1) / 2) for k, x in images.items()], title, n)


@with_device_rows("pixelcnn", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
    repeats = repeats or (1 if quick else 2)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"suite": "pixelcnn", "machine": machine_info(), "repeats": repeats,
               "quick": quick, "defaults": {"jacobi_gs block rows": DEFAULT_BLOCK_ROWS,
                                            "gs_jacobi window rows": DEFAULT_WINDOW_ROWS}}
    sections = []
    # quick (CI): a small model on 256 digits, sizes 1 and 2; still every sampler and the sweep
    configs = ([("digits", 16, 3, 1, 256, [1, 2])] if quick else
               [("mnist", 32, 5, 1, None, [1, 2, 4, 7, 14]), ("digits", 32, 5, 10, None,
                                                                [1, 2, 4])])
    for data, hidden, layers, epochs, subset, sizes in configs:
        model, info = trained_pixelcnn(out_dir, data, hidden=hidden, layers=layers,
                                       epochs=epochs, subset=subset)
        br = min(DEFAULT_BLOCK_ROWS, model.size)
        wr = min(DEFAULT_WINDOW_ROWS, model.size)
        rows, images = table(model, 16, repeats=repeats, block_rows=br, window_rows=wr,
                             desc=f"pixelcnn {data}")
        title = (f"PixelCNN (hidden {hidden}, {layers} layers, {epochs} epochs) on {data} "
                 f"{model.size}x{model.size}, batch 16")
        print(f"\n{title}")
        print(text_table(rows, COLUMNS))
        sw = sweep(model, 16, sizes, repeats=max(SWEEP_REPEATS, repeats))
        cols = ["method", "block_size", "iterations", "evaluations", "time_s", "vs cached"]
        print(f"\nblock / window sizes ({data})")
        print(text_table(sw, cols))
        fig = samples_figure(out_dir / f"pixelcnn_{data}_samples.png", images,
                             f"{title}: the same noise through every sampler")
        sections += [(title, markdown_table(rows, COLUMNS) + f"\n\n![]({fig.name})"),
                     (f"Block / window sizes ({data})", markdown_table(sw, cols))]
        payload[data] = {"model": info, "rows": rows, "sweep": sw}
    write_results(out_dir, "pixelcnn", payload, sections,
                  "paraprop bench pixelcnn" + (" --quick" if quick else ""))
    return payload
