"""``paraprop bench made``: parallel sampling of a trained MADE (Song et al. 2021, §5.3.1).

A MADE 2x512 with logistic conditionals is trained on the MNIST test set (and one on the digits);
then 100 samples are drawn for the same noise by ancestral sampling (the baseline), Jacobi with
the online stop, Jacobi with an oracle stop (the paper's figure; here the first iterate within
``TOL`` of the ancestral sample, as if it were known), fixed ``D`` passes (what the flow libraries
do), and the hybrids. Also: a batch sweep, a convergence plot, an image grid, and the zuko /
nflows inverse rows.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from paraprop.bench.harness import interleaved, machine_info, median  # noqa: E402
from paraprop.bench.plots import convergence_plot, save_figure  # noqa: E402
from paraprop.bench.report import markdown_table, text_table, write_results  # noqa: E402
from paraprop.models import MADE  # noqa: E402
from paraprop.sampling import parallel_inverse, sample  # noqa: E402
from paraprop.solve import solve  # noqa: E402
from paraprop.solvers import GSJacobi, JacobiGS  # noqa: E402
from paraprop.training.made import made_data, train_made  # noqa: E402

DESCRIPTION = "MADE sampling: ancestral vs Jacobi (online / oracle stop) vs fixed passes; flows"
TOL = 1e-5
COLUMNS = ["method", "iterations", "evaluations", "time_ms", "speedup", "max_abs_err"]


def trained_made(out_dir: Path, data: str, *, hidden=(512, 512), epochs: int = 20,
                 seed: int = 0) -> tuple[MADE, dict]:
    """Train (or reuse the checkpoint ``out_dir/made_DATA_HIDDEN_eEPOCHS.pt``, e.g.
    ``made_digits_512x512_e20.pt``, of the same config) a MADE."""
    path = out_dir / f"made_{data}_{'x'.join(map(str, hidden))}_e{epochs}.pt"
    if path.exists():
        model = MADE.load(path)
        return model.requires_grad_(False), {"checkpoint": str(path), "trained_now": False}
    x = made_data(data, "logistic", seed=seed)
    model = MADE(x.shape[1], hidden, "logistic", seed=seed)
    hist = train_made(model, x, epochs=epochs, seed=seed)
    model.save(path)
    return model.requires_grad_(False), {"checkpoint": str(path), "trained_now": True,
                                         "nll_per_dim": hist}


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


def flow_rows(features: int, n: int, *, repeats: int) -> list[dict]:
    """zuko MAF and nflows MAF (random weights): the library's inverse vs the parallel one."""
    import zuko
    from nflows.transforms import (
        CompositeTransform,
        MaskedAffineAutoregressiveTransform,
        ReversePermutation,
    )

    torch.manual_seed(0)
    y = torch.randn(n, features)
    zt = zuko.flows.MAF(features, transforms=3, randperm=True)().transform
    nt = CompositeTransform([MaskedAffineAutoregressiveTransform(features, 64),
                             ReversePermutation(features),
                             MaskedAffineAutoregressiveTransform(features, 64)]).eval()
    cases = {
        "zuko MAF x3": (lambda: zt.inv(y), lambda: parallel_inverse(zt, y), 3),
        "nflows MAF x2": (lambda: nt.inverse(y)[0], lambda: parallel_inverse(nt, y), 2),
    }
    rows = []
    with torch.no_grad():
        for name, (lib, par, k) in cases.items():
            x_lib = lib()
            x_par, sol = par()
            times = interleaved({"library": lib, "paraprop": par}, repeats=repeats, warmup=1,
                                desc=name)
            passes = sol.evaluations
            rows.append({"flow": name, "D": features, "library passes": k * features,
                         "paraprop passes": passes,
                         "fewer passes": k * features / passes,
                         "library_ms": 1e3 * median(times["library"]),
                         "paraprop_ms": 1e3 * median(times["paraprop"]),
                         "speedup": median(times["library"]) / median(times["paraprop"]),
                         "bitwise equal": bool(torch.equal(x_lib, x_par)),
                         "max_abs_err": float((x_lib - x_par).abs().max())})
    return rows


FLOW_COLUMNS = ["flow", "D", "library passes", "paraprop passes", "fewer passes", "library_ms",
                "paraprop_ms", "speedup", "bitwise equal", "max_abs_err"]


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None) -> dict:
    repeats = repeats or (1 if quick else 5)
    out_dir.mkdir(parents=True, exist_ok=True)
    sections, payload = [], {"suite": "made", "machine": machine_info(), "tol": TOL,
                             "repeats": repeats, "quick": quick}
    configs = ([("digits", (64, 64), 2, 8)] if quick
               else [("mnist", (512, 512), 20, 28), ("digits", (512, 512), 30, 8)])
    models = {}
    for data, hidden, epochs, side in configs:
        model, info = trained_made(out_dir, data, hidden=hidden, epochs=epochs)
        models[data] = model
        rows, extra = sampling_rows(model, 100, repeats=repeats, desc=f"made {data}")
        title = f"MADE {'x'.join(map(str, hidden))} on {data} (D={model.features}), 100 samples"
        print(f"\n{title} (tol={TOL:g}; oracle stop = {extra['oracle']} iterations)")
        print(text_table(rows, COLUMNS))
        conv = convergence_plot(out_dir / f"made_{data}_convergence.png", title,
                                extra["curves"], tol=TOL)
        grid = image_grid(out_dir / f"made_{data}_samples.png", extra["ref"], extra["iterates"],
                          side, f"{title}: Jacobi iterates vs ancestral samples (same noise)")
        sections.append((title, markdown_table(rows, COLUMNS)
                         + f"\n\n![]({conv.name})\n\n![]({grid.name})"))
        payload[data] = {"model": info, "rows": rows, "oracle_iterations": extra["oracle"]}

    model = models[configs[0][0]]
    batches = [1, 10] if quick else [1, 10, 100, 1000]
    sweep = []
    for n in batches:
        noise = model.draw_noise(n, torch.Generator().manual_seed(1))
        seq = lambda nz=noise, k=n: sample(model, k, method="sequential", noise=nz)  # noqa: E731
        jac = lambda nz=noise, k=n: sample(model, k, method="jacobi", tol=TOL, noise=nz)  # noqa: E731
        times = interleaved({"sequential": seq, "jacobi": jac},
                            repeats=max(1, repeats if n <= 100 else repeats // 2), warmup=1,
                            desc=f"batch {n}")
        x_seq, _ = seq()
        x_jac, sol = jac()
        sweep.append({"batch": n, "sequential_ms": 1e3 * median(times["sequential"]),
                      "jacobi_ms": 1e3 * median(times["jacobi"]),
                      "speedup": median(times["sequential"]) / median(times["jacobi"]),
                      "iterations": sol.iterations,
                      "max_abs_err": float((x_seq - x_jac).abs().max())})
    cols = ["batch", "sequential_ms", "jacobi_ms", "speedup", "iterations", "max_abs_err"]
    print(f"\nBatch sweep ({configs[0][0]} model)")
    print(text_table(sweep, cols))
    sections.append((f"Batch sweep ({configs[0][0]} model, Jacobi online stop)",
                     markdown_table(sweep, cols)))
    payload["batch_sweep"] = sweep

    frows = flow_rows(16 if quick else 784, 10 if quick else 100, repeats=repeats)
    print("\nFlow libraries: their fixed-pass inverse vs paraprop.sampling.parallel_inverse")
    print(text_table(frows, FLOW_COLUMNS))
    sections.append(("Flow inverses (random weights, tol=0)", markdown_table(frows, FLOW_COLUMNS)))
    payload["flows"] = frows
    write_results(out_dir, "made", payload, sections,
                  "paraprop bench made" + (" --quick" if quick else ""))
    return payload
