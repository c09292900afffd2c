"""``paraprop bench jacobians``: BPPSA Table 1 and Fig. 10 on this machine.

1. Table 1: sparsity of the transposed Jacobians of VGG-11's first convolution, ReLU and
   max-pool at 32x32, and the time to generate them analytically (pattern build + fill, and
   fill only: the pattern depends only on the architecture, so a training step only fills) vs
   column by column with autograd (the paper's baseline: one VJP per output) and vs
   ``torch.func`` (vjp + vmap). The two autograd baselines would take minutes at full size, so
   they are timed on a slice of the columns and scaled by the column count (stated in the
   table).
2. Fig. 10: per-step FLOPs of the BPPSA scan on torchvision's VGG-11 convolutional part (random
   weights, and 97%-pruned by magnitude with ``torch.nn.utils.prune``) vs the per-operator FLOPs
   of back-propagation, with the tree capped at ``levels`` (BPPSA §5.3).
3. Wall time of the sparse scan backward vs autograd's backward for the pruned network.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from paraprop.jacobians import bppsa, patterns, transposed_jacobian  # noqa: E402
from paraprop_lab.experiments.harness import interleaved, machine_info, median  # noqa: E402
from paraprop_lab.experiments.plots import save_figure  # noqa: E402
from paraprop_lab.experiments.report import markdown_table, text_table, write_results  # noqa: E402
from paraprop_lab.experiments.rows_report import cpu_only

DESCRIPTION = "CSR transposed Jacobians (BPPSA Table 1) and BPPSA FLOPs on (pruned) VGG-11"

# no device rows: ``run(device=...)`` refuses any device but the CPU, saying why
CPU_ONLY = ("its figures are the CPU's: the CSR transposed Jacobians built and filled on the "
            "host, and the sparse scan backward on CPU tensors")

PAPER_SPARSITY = {"conv": 0.99157, "relu": 0.99998, "maxpool": 0.99994}
T1_COLUMNS = ["layer", "JT shape", "sparsity", "paper", "dense MB", "csr MB", "analytic_ms",
              "analytic_fill_ms", "autograd_cols_s", "jacrev_vmap_s", "speedup vs autograd",
              "fill speedup vs autograd", "speedup vs jacrev", "columns timed"]


def _time(fn, repeats: int) -> float:
    return median(interleaved({"f": fn}, repeats=repeats, warmup=1, desc="t")["f"])


def table1(size: int, channels: int, *, repeats: int, columns: int) -> list[dict]:
    torch.manual_seed(0)
    x0 = torch.randn(3, size, size)
    conv = nn.Conv2d(3, channels, 3, padding=1)
    x1 = conv(x0[None])[0].detach()
    cases = [("conv", conv, x0), ("relu", nn.ReLU(), x1), ("maxpool", nn.MaxPool2d(2), x1)]
    rows = []
    for name, layer, x in cases:
        def cold(layer=layer, x=x):
            patterns.conv2d.cache_clear()
            patterns.max_pool2d.cache_clear()
            patterns.diagonal.cache_clear()
            return transposed_jacobian(layer, x)

        t_cold = _time(cold, repeats)
        t_fill = _time(lambda layer=layer, x=x: transposed_jacobian(layer, x), repeats)
        JT = transposed_jacobian(layer, x)
        n_in, n_out = JT.shape
        k = min(columns, n_out)
        xr = x.clone().requires_grad_(True)
        y = layer(xr[None])[0].flatten()
        eye = torch.zeros(k, n_out)  # the first k unit vectors (never the full identity)
        eye[torch.arange(k), torch.arange(k)] = 1.0

        def autograd_cols(y=y, xr=xr, k=k, eye=eye):  # the paper's baseline: a VJP per output
            return [torch.autograd.grad(y, xr, eye[j].reshape(y.shape), retain_graph=True)[0]
                    for j in range(k)]

        t_cols = _time(autograd_cols, 1) * n_out / k
        f = lambda v, layer=layer: layer(v[None])[0].flatten()  # noqa: E731
        jac_rows = k

        def jacrev(f=f, x=x, jac_rows=jac_rows, eye=eye):
            # rows [0, k) of the Jacobian by vmap over VJPs: jacrev's own method
            _, vjp = torch.func.vjp(f, x)
            return torch.vmap(vjp)(eye[:jac_rows])

        t_jr = _time(jacrev, 1) * n_out / k
        # ours: pattern build + fill (cold) is the fair comparison; fill-only shown too
        rows.append({"layer": name, "JT shape": f"{n_in}x{n_out}",
                     "sparsity": f"{1 - JT._nnz() / (n_in * n_out):.5f}",
                     "paper": f"{PAPER_SPARSITY[name]:.5f}", "dense MB": n_in * n_out * 4 / 2**20,
                     "csr MB": (JT._nnz() * 12 + (n_in + 1) * 8) / 2**20,
                     "analytic_ms": 1e3 * t_cold, "analytic_fill_ms": 1e3 * t_fill,
                     "autograd_cols_s": t_cols, "jacrev_vmap_s": t_jr,
                     "speedup vs autograd": t_cols / t_cold,
                     "fill speedup vs autograd": t_cols / t_fill,
                     "speedup vs jacrev": t_jr / t_cold,
                     "columns timed": f"{k} of {n_out}"})
    return rows


def vgg_layers(quick: bool, prune_amount: float | None) -> tuple[list[nn.Module], int]:
    """VGG-11's convolutional part (torchvision, random weights), optionally pruned."""
    torch.manual_seed(0)
    if quick:
        feats = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        size = 16
    else:
        import torchvision

        feats = torchvision.models.vgg11().features
        size = 32
    layers = [nn.ReLU() if isinstance(m, nn.ReLU) else m for m in feats.eval()]
    if prune_amount:
        from torch.nn.utils import prune

        for m in layers:
            if isinstance(m, nn.Conv2d):
                prune.l1_unstructured(m, "weight", amount=prune_amount)
                prune.remove(m, "weight")
    return layers, size


def fig10(quick: bool, levels: int, repeats: int) -> tuple[list[dict], list[dict], dict]:
    out_rows, steps_out, walls = [], [], {}
    for label, amount in (("dense", None), ("pruned 97%", 0.97)):
        layers, size = vgg_layers(quick, amount)
        x = torch.randn(3, size, size)
        acts, y = bppsa.record(layers, x)
        t0 = time.perf_counter()
        res = bppsa.analyze(layers, acts, levels=levels, drop_zero_weights=bool(amount))
        took = time.perf_counter() - t0
        for s in res["steps"]:
            steps_out.append({"weights": label, **s})
        bp_dense_max = max(b["dense_flops"] for b in res["bp"])
        out_rows.append({"weights": label, "levels": levels, "steps": len(res["steps"]),
                         "max step flops": max(s["max_flops"] for s in res["steps"]),
                         "bp max op flops (csr)": res["bp_max_flops"],
                         "bp max op flops (dense)": bp_dense_max,
                         "ratio to bp (csr)": max(s["max_flops"] for s in res["steps"])
                         / res["bp_max_flops"],
                         "critical-path flops": res["critical_flops"],
                         "bp total flops (csr)": res["bp_total_flops"], "analysis_s": took})
        if label.startswith("pruned"):
            net = nn.Sequential(*layers)
            g = torch.randn(y.shape)

            def autograd_bw(net=net, x=x, g=g):
                xr = x[None].clone().requires_grad_(True)
                net(xr).backward(g[None])

            def scan_bw(layers=layers, acts=acts, g=g):
                return bppsa.backward(layers, acts, g, levels=levels, drop_zero_weights=True)

            t = interleaved({"autograd": autograd_bw, "bppsa": scan_bw}, repeats=repeats,
                            warmup=1, desc="pruned vgg backward")
            walls = {"autograd_ms": 1e3 * median(t["autograd"]),
                     "bppsa_scan_ms": 1e3 * median(t["bppsa"]),
                     "ratio": median(t["bppsa"]) / median(t["autograd"])}
    return out_rows, steps_out, walls


def _plot(path: Path, steps: list[dict], rows: list[dict]) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for i, label in enumerate(("dense", "pruned 97%")):
        ss = [s for s in steps if s["weights"] == label]
        xs = [j + 0.2 * i for j in range(len(ss))]
        ax.bar(xs, [s["max_flops"] for s in ss], width=0.2, label=f"BPPSA step ({label})")
        bp = next(r for r in rows if r["weights"] == label)["bp max op flops (csr)"]
        ax.axhline(bp, ls="--", lw=0.8, color=f"C{i}", label=f"BP max operator ({label})")
    ax.set_yscale("log")
    ax.set_xlabel("scan step (up-sweep, linear, down-sweep)")
    ax.set_ylabel("floating-point operations\nof the largest combine")
    ax.set_title("BPPSA on VGG-11 conv layers: per-step FLOPs vs back-propagation (Fig. 10)")
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None,
        device: str | None = None) -> dict:
    cpu_only("jacobians", device, CPU_ONLY)
    repeats = repeats or (1 if quick else 3)
    out_dir.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    t1 = table1(12 if quick else 32, 8 if quick else 64, repeats=repeats,
                columns=64 if quick else 256)
    print("\nTable 1: transposed Jacobians, analytic vs autograd")
    print(text_table(t1, T1_COLUMNS))
    levels = 1
    rows, steps, walls = fig10(quick, levels, repeats)
    cols = list(rows[0])
    print(f"\nFig. 10: BPPSA per-step FLOPs vs back-propagation (levels={levels})")
    print(text_table(rows, cols))
    print(f"\nPruned network, one sample: autograd backward {walls['autograd_ms']:.2f} ms, "
          f"BPPSA scan backward {walls['bppsa_scan_ms']:.1f} ms")
    png = _plot(out_dir / "jacobians_fig10.png", steps, rows)
    step_cols = ["weights", "level", "phase", "combines", "flops", "max_flops", "max_nnz"]
    payload = {"suite": "jacobians", "machine": machine_info(), "quick": quick,
               "repeats": repeats, "table1": t1, "fig10": rows, "steps": steps,
               "pruned_backward": walls}
    sections = [
        ("Table 1: transposed Jacobians (one sample; generation times)",
         markdown_table(t1, T1_COLUMNS)),
        (f"Fig. 10: BPPSA per-step FLOPs vs back-propagation (tree capped at {levels} level)",
         markdown_table(rows, cols) + "\n\n" + markdown_table(steps, step_cols)
         + f"\n\n![]({png.name})"),
        ("Pruned network: wall time of one backward pass (one sample)",
         markdown_table([walls], list(walls))),
    ]
    write_results(out_dir, "jacobians", payload, sections,
                  "paraprop bench jacobians" + (" --quick" if quick else ""))
    return payload
