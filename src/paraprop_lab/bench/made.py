"""``paraprop bench made``: parallel sampling of a trained MADE (Song et al. 2021, §5.3.1).

A MADE 2x512 with logistic conditionals is trained on the MNIST test set (and one on the digits);
then 100 samples are drawn for the same noise by ancestral sampling (the baseline), Jacobi with
the online stop, Jacobi with an oracle stop (the paper's figure; here the first iterate within
``TOL`` of the ancestral sample, as if it were known), fixed ``D`` passes (what the flow libraries
do), and the hybrids. Also: a batch sweep, a convergence plot, an image grid, and the zuko /
nflows inverse rows.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402

from paraprop.flows import parallel_inverse  # noqa: E402
from paraprop.sampling import sample  # noqa: E402
from paraprop_lab.experiments import rows_sampling as _rows
from paraprop_lab.experiments.harness import interleaved, machine_info, median  # noqa: E402
from paraprop_lab.experiments.made import COLUMNS, TOL, image_grid, sampling_rows
from paraprop_lab.experiments.plots import convergence_plot  # noqa: E402
from paraprop_lab.experiments.report import markdown_table, text_table, write_results  # noqa: E402
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows
from paraprop_lab.training.made import trained_made

DESCRIPTION = "MADE sampling: ancestral vs Jacobi (online / oracle stop) vs fixed passes; flows"

# the headline rows on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("made.jacobi", _rows.made_rows, 15)]


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


@with_device_rows("made", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
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
    print("\nFlow libraries: their fixed-pass inverse vs paraprop.flows.parallel_inverse")
    print(text_table(frows, FLOW_COLUMNS))
    sections.append(("Flow inverses (random weights, tol=0)", markdown_table(frows, FLOW_COLUMNS)))
    payload["flows"] = frows
    write_results(out_dir, "made", payload, sections,
                  "paraprop bench made" + (" --quick" if quick else ""))
    return payload

