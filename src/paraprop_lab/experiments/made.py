"""MADE sampling measured method by method (ancestral, Jacobi with online and oracle stops, fixed
passes, the hybrids), with convergence curves and image grids; shared by ``paraprop bench made``
and the MADE demo part.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from paraprop.models import MADE  # noqa: E402
from paraprop.sampling import sample  # noqa: E402
from paraprop.solve import solve  # noqa: E402
from paraprop.solvers import GSJacobi, JacobiGS  # noqa: E402
from paraprop_lab.experiments.harness import interleaved, median  # noqa: E402
from paraprop_lab.experiments.plots import save_figure  # noqa: E402

TOL = 1e-5


COLUMNS = ["method", "iterations", "evaluations", "time_ms", "speedup", "max_abs_err"]


def oracle_iterations(model: MADE, noise: torch.Tensor, ref: torch.Tensor
                      ) -> tuple[int, list[torch.Tensor]]:
    """The oracle stop: the first Jacobi iterate within ``TOL`` of the ancestral sample ``ref``
    (max abs), as if the answer were known; also all iterates up to the fixed point (data
    order)."""
    system = model.sampling_map(noise)
    iterates: list[torch.Tensor] = []
    with torch.no_grad():
        solve(system, system.x0, tol=0,
              callback=lambda k, v, r: iterates.append(system.to_data(v.clone())))
    k = next(i + 1 for i, v in enumerate(iterates) if float((v - ref).abs().max()) <= TOL)
    return k, iterates


def sampling_rows(model: MADE, n: int, *, repeats: int, seed: int = 0, hybrids: bool = True,
                  desc: str = "made") -> tuple[list[dict], dict]:
    """Time every sampling method for the same noise; rows and the convergence curves."""
    noise = model.draw_noise(n, torch.Generator().manual_seed(seed))
    ref, _ = sample(model, n, method="sequential", noise=noise)
    D = model.features
    k_oracle, iterates = oracle_iterations(model, noise, ref)
    specs = {
        "sequential (ancestral)": {"method": "sequential"},
        "jacobi (online stop)": {"method": "jacobi", "tol": TOL},
        "jacobi (oracle stop)": {"method": "jacobi", "tol": 0.0, "max_iters": k_oracle,
                                 "throw": False},
        "fixed D passes": {"method": "fixed_passes"},
    }
    if hybrids:
        specs["gs_jacobi"] = {"method": GSJacobi(block_size=math.ceil(D / 8)), "tol": TOL}
        specs["jacobi_gs"] = {"method": JacobiGS(block_size=math.ceil(D / 8)), "tol": TOL}

    def runner(kw):
        return lambda: sample(model, n, noise=noise, **kw)

    results = {label: sample(model, n, noise=noise, **kw) for label, kw in specs.items()}
    times = interleaved({label: runner(kw) for label, kw in specs.items()}, repeats=repeats,
                        warmup=1, desc=desc)
    base = median(times["sequential (ancestral)"])
    rows = []
    for label, (x, sol) in results.items():
        t = median(times[label])
        rows.append({"method": label, "iterations": sol.iterations,
                     "evaluations": sol.evaluations, "time_ms": 1e3 * t, "speedup": base / t,
                     "max_abs_err": float((x - ref).abs().max())})
    fd = results["jacobi (online stop)"][1].residuals.tolist()
    curves = {"jacobi": {"forward difference": fd,
                         "true error": [float((v - ref).abs().max()) for v in iterates]}}
    return rows, {"curves": curves, "iterates": iterates, "ref": ref, "oracle": k_oracle}


def image_rows(path: Path, rows: list[tuple[str, torch.Tensor]], title: str, n: int = 8
               ) -> Path:
    """A figure with one labelled row of ``n`` grey images per entry of ``rows``; each entry is
    ``(label, images)`` with images ``(N, H, W)`` in ``[0, 1]`` (shared by the MADE and PixelCNN
    suites)."""
    fig, axes = plt.subplots(len(rows), n, figsize=(n * 0.9, len(rows) * 0.95), squeeze=False)
    for r, (label, x) in enumerate(rows):
        for c in range(n):
            ax = axes[r, c]
            if c < len(x):
                ax.imshow(x[c].clamp(0, 1).cpu().numpy(), cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[r, 0].set_ylabel(label, rotation=0, ha="right", va="center", fontsize=7)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path, dpi=100)


def image_grid(path: Path, ref: torch.Tensor, iterates: list[torch.Tensor], side: int,
               title: str, n: int = 8) -> Path:
    """Rows: Jacobi iterates 1, 2, 4, ... and the final one; last row: ancestral samples."""
    steps = sorted({1, 2, 4, 8, len(iterates)} & set(range(1, len(iterates) + 1)))
    rows = [(f"Jacobi iter {k}", iterates[k - 1]) for k in steps] + [("ancestral", ref)]
    return image_rows(path, [(label, x.reshape(-1, side, side)) for label, x in rows], title, n)

