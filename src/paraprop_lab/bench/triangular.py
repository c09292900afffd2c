"""``paraprop bench triangular``: back-propagation as a block bi-diagonal system (Naumov 2017).

1. Deep narrow MLPs (tanh, orthogonal weights so that gradients neither vanish nor explode,
   float32): backward by cyclic reduction (CR) and by block substitution, both from the
   activation points of a pass, against autograd's backward of the same pass (interleaved
   timing, medians, ratios from the same run); also forward + backward. Counters: sequential
   levels, flops, peak memory allocated during the backward (measured with the profiler), the
   float64 gradient error against autograd, and Jacobi and BiCGStab iteration counts.
2. A stacked ``nn.RNN`` (K layers x tau steps): the nested system of eq. 23-24.
3. Forward propagation by the lower system from the previous training step's activation
   points (the paper's §2 remark): Newton iterations per step while training on the digits.
4. A plot of sequential steps against depth ``l``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from paraprop.errors import ConvergenceError, NonFiniteError
from paraprop.linalg import activation_points, mlp_backward, mlp_forward, rnn_backward
from paraprop.models import deep_mlp
from paraprop_lab.experiments import rows_more as _rows
from paraprop_lab.experiments.harness import interleaved, machine_info, median, threads
from paraprop_lab.experiments.plots import plt, save_figure
from paraprop_lab.experiments.report import markdown_table, text_table, write_results
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows

DESCRIPTION = ("MLP/RNN backward as block bi-diagonal systems: cyclic reduction vs autograd, "
               "Jacobi, BiCGStab")

# its comparison on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("triangular.mlp_backward", _rows.triangular_rows, 8)]

MLP_COLUMNS = ["l", "width", "batch", "threads", "autograd_ms", "cr_ms", "subst_ms", "cr_speedup",
               "fwd_bwd_speedup", "cr_levels", "log2_bound", "subst_levels", "cr_mflop",
               "subst_mflop", "autograd_peak_mb", "cr_peak_mb", "subst_peak_mb",
               "cr_vs_subst_mem", "grad_rel_err_f64", "jacobi_iters", "bicgstab_iters"]
RNN_COLUMNS = ["K", "tau", "hidden", "batch", "threads", "autograd_ms", "cr_ms", "subst_ms",
               "cr_speedup", "cr_levels", "inner_levels", "outer_levels", "subst_levels",
               "jacobi_iters", "bicgstab_iters", "grad_rel_err_f64"]
THREAD_COLUMNS = ["l", "width", "batch", "threads", "autograd_ms", "cr_ms", "subst_ms",
                  "cr_speedup", "fwd_bwd_speedup"]
TRAIN_COLUMNS = ["activation", "l", "steps", "lr", "loss_first", "loss_last", "newton_iters_mean",
                 "newton_iters_max", "levels_per_forward", "sequential_levels",
                 "max_abs_err_vs_pass"]


def peak_memory(fn) -> int:
    """Peak bytes of tensors allocated (net of frees) while ``fn()`` runs (CPU profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    cur = peak = 0
    for e in events:
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def _rel_err(ours, ref) -> float:
    return max(float((a - b).norm() / b.norm().clamp_min(1e-300)) for a, b in
               zip(ours, ref, strict=True))


def mlp_row(l: int, width: int, batch: int, *, repeats: int, nthreads: int | None = 1,
            counters: bool = True) -> dict:
    """Every measurement of one deep MLP; times with ``nthreads`` intra-op threads (``None``:
    the process default); ``counters=False`` skips all but the timing."""
    net = deep_mlp(l, width)
    params = list(net.parameters())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=gen)
    g = torch.randn(batch, width, generator=gen)
    xg = x.clone().requires_grad_()
    out = net(xg)
    pts = activation_points(net, x)

    def autograd_bwd():
        return torch.autograd.grad(out, [xg, *params], g, retain_graph=True)

    def cr_bwd():
        return mlp_backward(net, x, g, points=pts)

    def subst_bwd():
        return mlp_backward(net, x, g, points=pts, method="substitution")

    def autograd_full():
        xx = x.clone().requires_grad_()
        return torch.autograd.grad(net(xx), [xx, *params], g)

    def cr_full():
        return mlp_backward(net, x, g)

    with threads(nthreads) as used:
        times = interleaved({"autograd": autograd_bwd, "cr": cr_bwd, "subst": subst_bwd,
                             "autograd_full": autograd_full, "cr_full": cr_full},
                            repeats=repeats, warmup=1, desc=f"mlp l={l} w={width} b={batch}")
    t = {k: median(v) for k, v in times.items()}
    row = {"l": l, "width": width, "batch": batch, "threads": used,
           "autograd_ms": 1e3 * t["autograd"], "cr_ms": 1e3 * t["cr"],
           "subst_ms": 1e3 * t["subst"], "cr_speedup": t["autograd"] / t["cr"],
           "fwd_bwd_speedup": t["autograd_full"] / t["cr_full"], "times_s": times}
    if not counters:
        return row
    _, cr = mlp_backward(net, x, g, points=pts)
    _, sub = mlp_backward(net, x, g, points=pts, method="substitution")
    mem = {"autograd": peak_memory(autograd_bwd), "cr": peak_memory(cr_bwd),
           "subst": peak_memory(subst_bwd)}
    # float64: gradients against autograd, and the iterative methods' iteration counts
    net64 = copy.deepcopy(net).double()
    x64, g64 = x.double(), g.double()
    x64g = x64.clone().requires_grad_()
    ref = torch.autograd.grad(net64(x64g), [x64g, *net64.parameters()], g64)
    (gx, gp), _ = mlp_backward(net64, x64, g64)
    pts64 = activation_points(net64, x64)
    _, jac = mlp_backward(net64, x64, g64, points=pts64, method="jacobi", tol=1e-10)
    try:
        _, bic = mlp_backward(net64, x64, g64, points=pts64, method="bicgstab", tol=1e-10,
                              max_iters=4 * l)
        bic_iters = bic.iterations
    except (ConvergenceError, NonFiniteError) as e:  # a result here, not a crash
        sol = getattr(e, "solution", None)
        bic_iters = f"no conv. ({sol.iterations if sol is not None else '?'})"
    return {
        **row,
        "cr_levels": cr.stats["levels"], "log2_bound": math.ceil(math.log2(l)) + 1,
        "subst_levels": sub.stats["levels"],
        "cr_mflop": cr.stats["flops"] / 1e6, "subst_mflop": sub.stats["flops"] / 1e6,
        "autograd_peak_mb": mem["autograd"] / 2**20, "cr_peak_mb": mem["cr"] / 2**20,
        "subst_peak_mb": mem["subst"] / 2**20,
        "cr_vs_subst_mem": mem["cr"] / max(mem["subst"], 1),
        "cr_vs_autograd_mem": mem["cr"] / max(mem["autograd"], 1),
        "grad_rel_err_f64": _rel_err([gx, *gp], ref),
        "jacobi_iters": jac.iterations, "bicgstab_iters": bic_iters,
    }


def rnn_row(K: int, tau: int, hidden: int, batch: int, *, repeats: int,
            nthreads: int | None = 1) -> dict:
    with torch.random.fork_rng(devices=[]):  # leave the global random state alone
        torch.manual_seed(0)
        rnn = nn.RNN(hidden, hidden, num_layers=K)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tau, batch, hidden, generator=gen)
    g = torch.randn(tau, batch, hidden, generator=gen)
    xg = x.clone().requires_grad_()
    out, _ = rnn(xg)
    params = list(rnn.parameters())
    with threads(nthreads) as used:
        times = interleaved(
            {"autograd": lambda: torch.autograd.grad(out, [xg, *params], g, retain_graph=True),
             "cr": lambda: rnn_backward(rnn, x, g),
             "subst": lambda: rnn_backward(rnn, x, g, method="substitution")},
            repeats=repeats, warmup=1, desc=f"rnn K={K} tau={tau}")
    t = {k: median(v) for k, v in times.items()}
    rnn64 = copy.deepcopy(rnn).double()
    x64, g64 = x.double(), g.double()
    x64g = x64.clone().requires_grad_()
    ref = torch.autograd.grad(rnn64(x64g)[0], [x64g, *rnn64.parameters()], g64)
    (gx, _, gp), cr = rnn_backward(rnn64, x64, g64)
    _, sub = rnn_backward(rnn64, x64, g64, method="substitution")
    _, jac = rnn_backward(rnn64, x64, g64, method="jacobi", tol=1e-10)
    try:
        bic_iters = rnn_backward(rnn64, x64, g64, method="bicgstab", tol=1e-10,
                                 max_iters=4 * K * tau)[1].iterations
    except (ConvergenceError, NonFiniteError) as e:
        sol = getattr(e, "solution", None)
        bic_iters = f"no conv. ({sol.iterations if sol is not None else '?'})"
    return {"K": K, "tau": tau, "hidden": hidden, "batch": batch, "threads": used,
            "autograd_ms": 1e3 * t["autograd"], "cr_ms": 1e3 * t["cr"],
            "subst_ms": 1e3 * t["subst"], "cr_speedup": t["autograd"] / t["cr"],
            "cr_levels": cr.stats["levels"], "inner_levels": cr.stats["inner_levels"],
            "outer_levels": cr.stats["outer_levels"], "subst_levels": sub.stats["levels"],
            "jacobi_iters": jac.iterations, "bicgstab_iters": bic_iters,
            "grad_rel_err_f64": _rel_err([gx, *gp], ref), "times_s": times}


def training_row(act, l: int, steps: int, *, n: int = 256, hidden: int = 32, lr: float = 0.05,
                 synthetic: bool = False) -> dict:
    """Full-batch training (digits, or a synthetic 10-class problem): each step's forward is
    solved by the lower system linearised at the previous step's activation points (Newton
    iterations to the pass), its backward by the upper system. The linear solves use
    substitution (the iteration count does not depend on the solver); ``levels_per_forward``
    counts what cyclic reduction takes for the same iterations."""
    if synthetic:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(n, 64, generator=gen)
        y = (x[:, :10] @ torch.randn(10, 10, generator=gen)).argmax(1)
    else:
        from paraprop.data import load_digits

        images, labels = load_digits()
        x, y = images[:n].reshape(n, 64), labels[:n]
    with torch.random.fork_rng(devices=[]):  # leave the global random state alone
        g = torch.manual_seed(0)
        mods: list[nn.Module] = [nn.Linear(64, hidden), act()]
        for _ in range(l - 2):
            mods += [nn.Linear(hidden, hidden), act()]
        mods.append(nn.Linear(hidden, 10))
        gain = nn.init.calculate_gain("tanh" if act is nn.Tanh else "relu")
        for m in mods:
            if isinstance(m, nn.Linear):  # orthogonal: a deep net that trains by plain SGD
                nn.init.orthogonal_(m.weight, gain=gain, generator=g)
                nn.init.zeros_(m.bias)
    net = nn.Sequential(*mods)
    points = activation_points(net, x)
    iters, losses, errs = [], [], []
    for _ in range(steps):
        sol = mlp_forward(net, x, points=points, method="substitution")
        points = sol.stats["points"]
        iters.append(sol.iterations)
        with torch.no_grad():
            errs.append(float((sol.value - net(x)).abs().max()))
        logits = sol.value.detach().requires_grad_()
        loss = nn.functional.cross_entropy(logits, y)
        (g,) = torch.autograd.grad(loss, logits)
        (_, grads), _ = mlp_backward(net, x, g, points=points, method="substitution")
        with torch.no_grad():
            for p, gp in zip(net.parameters(), grads, strict=True):
                p.sub_(lr * gp)
        losses.append(loss.item())
    cr_levels = mlp_forward(net, x[:1], method="cyclic_reduction").stats["solve_levels"]
    mean = sum(iters) / len(iters)
    return {"activation": act.__name__, "l": l, "steps": steps, "lr": lr, "loss_first": losses[0],
            "loss_last": losses[-1], "newton_iters_mean": mean, "newton_iters_max": max(iters),
            "levels_per_forward": mean * (cr_levels + 1), "sequential_levels": l,
            "max_abs_err_vs_pass": max(errs), "iterations": iters}


def steps_plot(path: Path, rows: list[dict]) -> Path:
    """Sequential steps of the backward against depth (width-16, batch-1 MLPs)."""
    rows = sorted((r for r in rows if r["batch"] == 1 and r["width"] == 16),
                  key=lambda r: r["l"])
    ls = [r["l"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(ls, [r["subst_levels"] for r in rows], "o-", label="substitution / autograd (l)")
    ax.loglog(ls, [r["cr_levels"] for r in rows], "s-", label="cyclic reduction (measured)")
    ax.loglog(ls, [math.ceil(math.log2(v)) + 1 for v in ls], "k:", label="ceil(log2 l) + 1")
    jac = [(r["l"], r["jacobi_iters"]) for r in rows if isinstance(r["jacobi_iters"], int)]
    if jac:
        ax.loglog(*zip(*jac, strict=True), "^--", label="Jacobi sweeps (tol 1e-10)")
    bic = [(r["l"], 2 * r["bicgstab_iters"]) for r in rows
           if isinstance(r["bicgstab_iters"], int)]
    if bic:
        ax.loglog(*zip(*bic, strict=True), "v--", label="BiCGStab products with A")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("layers l")
    ax.set_ylabel("sequential steps")
    ax.set_title("Backward propagation: sequential steps vs depth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


def mlp_configs(quick: bool) -> list[tuple[int, int, int]]:
    if quick:
        return [(16, 16, 1), (64, 16, 1)]
    return [(16, 16, 1), (64, 16, 1), (256, 16, 1), (1024, 16, 1), (1024, 16, 16),
            (256, 32, 8), (64, 64, 16), (16, 128, 64)]


def rnn_configs(quick: bool) -> list[tuple[int, int, int, int]]:
    return [(2, 8, 8, 2)] if quick else [(4, 16, 16, 4), (4, 64, 16, 4), (8, 32, 16, 1)]


@with_device_rows("triangular", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
    """Run the suite; timings use 1 intra-op thread except the thread comparison.

    On the shared 2-core machine, batched kernels with 2 threads open OpenMP parallel regions
    that stall whenever another process holds a core (measured: 10-100x slower); autograd's
    tiny per-layer kernels never go parallel. One thread keeps the comparison fair; the thread
    table shows the default as well.
    """
    repeats = repeats or (2 if quick else 7)
    default_threads = torch.get_num_threads()
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    with threads(1):
        mlp_rows = [mlp_row(l, w, b, repeats=repeats) for l, w, b in mlp_configs(quick)]
    print("\nDeep tanh MLPs, backward from the activation points of a pass, 1 intra-op thread "
          "(speedup: autograd's backward time / CR's, same run)")
    print(text_table(mlp_rows, MLP_COLUMNS))
    png = steps_plot(out_dir / "triangular_steps.png", mlp_rows)
    sections.append(("Deep MLPs: backward by cyclic reduction vs autograd (1 thread)",
                     markdown_table(mlp_rows, MLP_COLUMNS + ["cr_vs_autograd_mem"])
                     + f"\n\n![]({png.name})"))
    l, w, b = mlp_configs(quick)[-1 if quick else 3]
    thread_rows = [mlp_row(l, w, b, repeats=repeats, nthreads=n, counters=False)
                   for n in sorted({1, default_threads})]
    print("\nThe same backward with 1 thread and with the default intra-op threads")
    print(text_table(thread_rows, THREAD_COLUMNS))
    sections.append(("Intra-op threads (the default opens parallel regions in batched kernels)",
                     markdown_table(thread_rows, THREAD_COLUMNS)))
    with threads(1):
        rnn_rows = [rnn_row(*c, repeats=repeats) for c in rnn_configs(quick)]
        steps, depth = (5, 8) if quick else (40, 32)
        train_rows = [training_row(act, depth, steps, lr=lr, synthetic=quick)
                      for act, lr in ((nn.Tanh, 0.05), (nn.ReLU, 0.01))]
    print("\nStacked nn.RNN (tanh), the nested system of eq. 23-24, 1 thread")
    print(text_table(rnn_rows, RNN_COLUMNS))
    sections.append(("Stacked RNN: nested system (1 thread)",
                     markdown_table(rnn_rows, RNN_COLUMNS)))
    data = "synthetic 10-class data" if quick else "the digits"
    print(f"\nForward by the lower system from the previous step's points, training on {data}")
    print(text_table(train_rows, TRAIN_COLUMNS))
    sections.append((f"Forward propagation from the previous step's points (training on {data})",
                     markdown_table(train_rows, TRAIN_COLUMNS)))
    payload = {"suite": "triangular", "machine": machine_info(), "repeats": repeats,
               "quick": quick, "timing_threads": 1, "mlp": mlp_rows, "threads": thread_rows,
               "rnn": rnn_rows, "training": train_rows}
    write_results(out_dir, "triangular", payload, sections,
                  "paraprop bench triangular" + (" --quick" if quick else ""))
    return payload
