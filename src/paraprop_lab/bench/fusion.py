"""``paraprop bench fusion``: unfused vs forward- vs backward-fusion of the optimizer step.

Jiang et al. 2021 ("Optimizer Fusion", Fig. 3 and Tables 2-4): torchvision MobileNetV2, ResNet-18,
VGG-11 (random weights) and a deep MLP of small layers; batch 1, 8, 32; SGD with momentum, Adam,
Adagrad, each with its for-loop, ``foreach`` and ``fused`` implementation as the unfused baseline.

For every configuration copies of the model start from the same weights: one trained with the
plain optimizer, the others with ``fuse(mode="forward")`` and ``fuse(mode="backward")``. They are
timed interleaved (A B C ... A B C ...), each timed call running a few training steps with the
forward, backward and optimizer phases timed separately (a fused mode's updates fall inside its
forward or backward phase; a forward-mode update still pending at the end of a call is applied in
the next call's forward, so in the steady state every call contains as many updates as steps).
Each fused mode also runs with ``overlap=True`` (updates on a background thread); a call of
``forward+overlap`` waits for its thread at the end (counted), so no work runs on into the next
case, and its last step per call is not overlapped: with ``steps`` steps per call the figure is a
lower bound. ``speedup`` and ``saved_of_opt`` are medians over rounds of ratios taken within one
round (which saw one machine load); ``step_ms`` and the phases are plain medians. A second plain
copy (``unfused-again``) in the target configuration shows the noise of the measurement: its
ratio to ``unfused`` should be 1. After timing, all copies must hold
bitwise the same parameters. Peak memory of one steady-state step is the
live tensors at its start plus the largest allocation high-water mark the profiler sees during it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from paraprop.optim import fuse
from paraprop.optim.backward import ConsumedGrad
from paraprop_lab.experiments.harness import interleaved, machine_info, median
from paraprop_lab.experiments.plots import plt, save_figure
from paraprop_lab.experiments.report import markdown_table, text_table, write_results
from paraprop_lab.experiments.rows_report import cpu_only

DESCRIPTION = "optimizer fusion: unfused vs forward/backward-fused steps, time breakdown, memory"

# no device rows: ``run(device=...)`` refuses any device but the CPU, saying why
CPU_ONLY = ("optimizer fusion's GPU comparison (the update overlapping a GPU backward) is "
            "not written yet")

MODES = ("unfused", "forward", "forward+overlap", "backward", "backward+overlap")
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.01, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=1e-3)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.01)),
}
IMPLS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def build_model(name: str, *, mlp_depth: int = 48, mlp_width: int = 64) -> nn.Module:
    """A model with random weights (seeded; torchvision weights are never downloaded)."""
    torch.manual_seed(0)
    if name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(mlp_depth):
            layers += [nn.Linear(mlp_width, mlp_width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(mlp_width, 10))
    import torchvision  # the CNNs only: the optional 'vision' extra

    return getattr(torchvision.models, name)(weights=None)


def make_batch(name: str, batch: int, res: int, mlp_width: int = 64):
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        return torch.randn(batch, mlp_width, generator=g), torch.randint(0, 10, (batch,),
                                                                           generator=g)
    return (torch.randn(batch, 3, res, res, generator=g),
            torch.randint(0, 1000, (batch,), generator=g))


class Trainer:
    """One model copy with its (plain or fused) optimizer; ``run(n)`` trains ``n`` steps."""

    def __init__(self, model_name, mode, opt_name, impl, batch, res, model_kw):
        self.model = build_model(model_name, **model_kw)
        cls, kw = OPTIMIZERS[opt_name]
        opt = cls(self.model.parameters(), **kw, **IMPLS[impl])
        if mode.startswith("unfused"):
            self.opt = opt
        else:
            self.opt = fuse(opt, self.model, mode=mode.split("+")[0], overlap="overlap" in mode)
        self.mode = mode
        self.x, self.y = make_batch(model_name, batch, res, model_kw.get("mlp_width", 64))
        self.phases: list[tuple[float, float, float]] = []  # per call: forward, backward, opt
        # each copy draws the same dropout masks: its own random stream, restored per call
        self.rng = torch.Generator().manual_seed(2).get_state()

    def step(self) -> None:
        """One training step, without timing or flushing."""
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng)
            F.cross_entropy(self.model(self.x), self.y).backward()
            self.rng = torch.get_rng_state()
        self.opt.step()
        self.opt.zero_grad()

    def run(self, steps: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng)
            self._run(steps)
            self.rng = torch.get_rng_state()

    def _run(self, steps: int) -> None:
        f = b = o = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = F.cross_entropy(self.model(self.x), self.y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            self.opt.step()
            self.opt.zero_grad()
            t3 = time.perf_counter()
            f, b, o = f + t1 - t0, b + t2 - t1, o + t3 - t2
        if self.mode == "forward+overlap":
            # the background thread must not run on into the next case's timing: wait for it
            # here (counted), so the last step of each call gets no overlap (a lower bound)
            t0 = time.perf_counter()
            self.opt.flush()
            o += time.perf_counter() - t0
        self.phases.append((f / steps, b / steps, o / steps))


def live_bytes(model: nn.Module, opt) -> int:
    """Bytes of the distinct storages alive between steps: parameters, buffers, gradients,
    optimizer state and (forward mode) the gradients held by pending updates."""
    seen: set[int] = set()
    total = 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and not isinstance(t, ConsumedGrad):
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()

    from paraprop.optim.reads import without_applying

    with without_applying():   # counting storages must not apply the pending updates
        for p in model.parameters():
            add(p)
            add(p.grad)
        for buf in model.buffers():
            add(buf)
    for st in opt.state.values():
        for v in st.values():
            add(v)
    for b in getattr(opt, "buckets", []):
        if b.pending is not None:
            for g in b.pending.grads:
                add(g)
    return total


def peak_step_bytes(tr: Trainer) -> int:
    """Peak bytes of one steady-state training step (live tensors + the step's high-water)."""
    tr.step()
    tr.step()  # steady state: optimizer state exists; forward mode: an update is pending
    base = live_bytes(tr.model, tr.opt)
    if torch.cuda.is_available() and tr.x.is_cuda:  # pragma: no cover - CPU machine
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        tr.step()
        return base + torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tr.step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = high = 0
    for _, n in events:
        cur += n
        high = max(high, cur)
    return base + high


def measure(model_name, opt_name, impl, batch, res, *, steps, repeats, budget_s, model_kw,
            modes=MODES):
    """Time ``modes`` (the first is the baseline) on one configuration; one row per mode."""
    trainers = {m: Trainer(model_name, m, opt_name, impl, batch, res, model_kw) for m in modes}
    t0 = time.perf_counter()
    for tr in trainers.values():  # warm-up, and the cost of a call
        tr.run(steps)
    per_round = time.perf_counter() - t0
    if repeats is None:
        repeats = int(max(7, min(25, budget_s / max(per_round, 1e-9))))
    for tr in trainers.values():
        tr.phases.clear()
    cases = {m: (lambda tr=tr: tr.run(steps)) for m, tr in trainers.items()}
    times = interleaved(cases, repeats=repeats, warmup=0,
                        desc=f"{model_name} b{batch} {opt_name} {impl}")
    for tr in trainers.values():
        if not tr.mode.startswith("unfused"):
            tr.opt.flush()
    ref = list(trainers["unfused"].model.parameters())
    rows = []
    base = None
    first = next(iter(trainers))
    base_t, base_opt = times[first], [ph[2] for ph in trainers[first].phases]
    for mode, tr in trainers.items():
        same = all(torch.equal(p, q) for p, q in zip(ref, tr.model.parameters(), strict=True))
        fwd, bwd, opt = (median([ph[i] for ph in tr.phases]) * 1e3 for i in range(3))
        total = median(times[mode]) / steps * 1e3
        row = {"model": model_name, "batch": batch, "optimizer": opt_name, "impl": impl,
               "mode": mode, "step_ms": total, "forward_ms": fwd, "backward_ms": bwd,
               "optimizer_ms": opt, "bitwise_equal": same, "repeats": repeats}
        if base is None:
            base = row
            row["opt_share"] = opt / (fwd + bwd + opt)
        else:
            # paired per round (the same round saw the same machine load), median over rounds
            row["speedup"] = median([b / t for b, t in zip(base_t, times[mode], strict=True)])
            # the unfused optimizer time this mode saves (1.0: the whole optimizer step hidden)
            row["saved_of_opt"] = median([(b - t) / steps / o for b, t, o in
                                          zip(base_t, times[mode], base_opt, strict=True)])
        rows.append(row)
    del trainers
    return rows


def memory_rows(model_name, batch, res, model_kw, opt_name="adam", impl="foreach"):
    rows, base = [], None
    for mode in MODES:
        tr = Trainer(model_name, mode, opt_name, impl, batch, res, model_kw)
        peak = peak_step_bytes(tr) / 2**20
        base = peak if mode == "unfused" else base
        rows.append({"model": model_name, "batch": batch, "optimizer": opt_name, "impl": impl,
                     "mode": mode, "peak_MiB": peak, "vs_unfused": peak / base - 1})
        del tr
    return rows


def plan(quick: bool) -> dict:
    """What the suite measures (``quick``: tiny sizes for a smoke run).

    The full grid fits a shared 2-core CPU in about ten minutes: every optimizer and
    implementation at batch 1 (where the optimizer's share of a step is largest), Adam with
    every implementation at batch 8, Adam foreach at batch 32, and VGG-11 (133M parameters,
    about a second per Adam step here) at batch 1 with Adam foreach and three modes only (its
    copies take 2 GiB each).
    """
    if quick:
        return {"res": 64, "steps": 1, "budget_s": 0.5,
                "model_kw": {"mlp_depth": 6, "mlp_width": 16}, "target": None,
                "grid": [("mlp", 2, "adam", i) for i in ("for-loop", "foreach")],
                "memory": [("mlp", 2)]}
    grid = []
    for model in ("mobilenet_v2", "resnet18", "mlp"):
        grid += [(model, 1, opt, impl) for opt in OPTIMIZERS for impl in IMPLS]
        grid += [(model, 8, "adam", impl) for impl in IMPLS]
        grid += [(model, 32, "adam", "foreach")]
    grid += [("vgg11", 1, "adam", "foreach", ("unfused", "forward+overlap", "backward"))]
    return {"res": 64, "steps": 3, "budget_s": 2.0, "model_kw": {},
            "target": {"model": "mobilenet_v2", "res": 224, "batch": 1, "optimizer": "adam",
                       "budget_s": 10.0, "steps": 3},
            "grid": grid,
            "memory": [("mobilenet_v2", 1), ("mobilenet_v2", 32), ("resnet18", 32),
                       ("mlp", 32)]}


def targets(target_rows: list[dict], mem_rows: list[dict]) -> tuple[dict, str]:
    """The issue's targets, checked on the measured rows: ``(record, markdown)``."""
    rec: dict = {"per_impl": {}}
    lines = []
    for impl in IMPLS:
        rows = [r for r in target_rows if r["impl"] == impl and r["mode"] in MODES[1:]]
        if not rows:
            continue
        best = max(rows, key=lambda r: r["saved_of_opt"])
        again = [r for r in target_rows if r["impl"] == impl and r["mode"] == "unfused-again"]
        rec["per_impl"][impl] = {r["mode"]: r["saved_of_opt"] for r in rows + again}
        noise = (f" (noise: a second plain copy measured {again[0]['saved_of_opt']:+.0%} of "
                 f"it, speedup {again[0]['speedup']:.3f})" if again else "")
        lines.append(f"- {impl}: best fused mode `{best['mode']}` saves "
                     f"{best['saved_of_opt']:.0%} of the unfused optimizer time, step "
                     f"{best['speedup']:.3f}x (goal >= 50%): "
                     f"{'met' if best['saved_of_opt'] >= 0.5 else 'not met'}{noise}.")
    if target_rows:
        unf = min((r for r in target_rows if r["mode"] == "unfused"), key=lambda r: r["step_ms"])
        fus = min((r for r in target_rows if r["mode"] in MODES[1:]),
                  key=lambda r: r["step_ms"])
        rec["best_unfused"] = {k: unf[k] for k in ("impl", "mode", "step_ms")}
        rec["best_fused"] = {k: fus[k] for k in ("impl", "mode", "step_ms")}
        met = fus["step_ms"] < unf["step_ms"]
        lines.append(f"- best fused ({fus['impl']}, {fus['mode']}: {fus['step_ms']:.1f} ms) vs "
                     f"best unfused ({unf['impl']}: {unf['step_ms']:.1f} ms): "
                     f"{unf['step_ms'] / fus['step_ms']:.3f}x, {'met' if met else 'not met'}.")
    for r in mem_rows:
        if r["mode"] == "backward":
            lines.append(f"- peak memory, backward mode, {r['model']} batch {r['batch']}: "
                         f"{r['vs_unfused']:+.1%} vs unfused ({r['peak_MiB']:.1f} MiB).")
    rec["memory_backward_vs_unfused"] = {f"{r['model']}-b{r['batch']}": r["vs_unfused"]
                                         for r in mem_rows if r["mode"] == "backward"}
    return rec, "\n".join(lines)


TARGET_COLS = ["impl", "mode", "step_ms", "forward_ms", "backward_ms", "optimizer_ms",
               "opt_share", "saved_of_opt", "speedup", "bitwise_equal"]
GRID_COLS = ["model", "batch", "optimizer", "impl", "mode", "step_ms", "optimizer_ms",
             "opt_share", "saved_of_opt", "speedup", "bitwise_equal"]
MEM_COLS = ["model", "batch", "optimizer", "impl", "mode", "peak_MiB", "vs_unfused"]


def breakdown_plot(path: Path, title: str, rows: list[dict]) -> Path:
    """Stacked forward / backward / optimizer time per implementation and mode (Fig. 3)."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{r['impl']}\n{r['mode']}" for r in rows]
    bottom = [0.0] * len(rows)
    for key, color in (("forward_ms", "tab:blue"), ("backward_ms", "tab:orange"),
                       ("optimizer_ms", "tab:green")):
        vals = [r[key] for r in rows]
        ax.bar(labels, vals, bottom=bottom, color=color, label=key.replace("_ms", ""))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("median time per training step (ms)")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


def saving_plot(path: Path, rows: list[dict]) -> Path:
    """Share of the unfused optimizer time each fused mode saves, per configuration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    modes = [m for m in MODES[1:] if any(r["mode"] == m for r in rows)]
    keys: list[str] = []
    for r in rows:
        k = f"{r['model']} b{r['batch']} {r['optimizer']} {r['impl']}"
        if k not in keys:
            keys.append(k)
    fig, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes), 0.16 * len(keys) + 1.5),
                             sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        vals = {f"{r['model']} b{r['batch']} {r['optimizer']} {r['impl']}": r["saved_of_opt"]
                for r in rows if r["mode"] == mode}
        ys = [vals.get(k, float("nan")) for k in keys]
        ax.barh(range(len(keys)), ys, color=["tab:green" if v >= 0.5 else "tab:red"
                                             for v in ys])
        ax.axvline(0.5, color="grey", ls="--", lw=0.8)
        ax.axvline(0.0, color="black", lw=0.6)
        ax.set_yticks(range(len(keys)), keys, fontsize=6)
        ax.set_xlim(-2.0, 2.0)
        ax.set_title(f"{mode}: share of the plain\noptimizer time saved", fontsize=9)
    return save_figure(fig, path, dpi=110)


def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None,
        device: str | None = None) -> dict:
    cpu_only("fusion", device, CPU_ONLY)
    p = plan(quick)
    out_dir = Path(out_dir)
    load0 = os.getloadavg()
    sections, plots = [], []
    target_rows: list[dict] = []
    if p["target"] is not None:
        t = p["target"]
        for impl in IMPLS:
            target_rows += measure(t["model"], t["optimizer"], impl, t["batch"], t["res"],
                                   steps=t["steps"], repeats=repeats, budget_s=t["budget_s"],
                                   model_kw=p["model_kw"], modes=(*MODES, "unfused-again"))
        title = f"{t['model']} {t['res']}px, batch {t['batch']}, {t['optimizer']}"
        print(f"\nTarget: {title} (saved_of_opt: unfused optimizer time saved; goal >= 0.5)")
        print(text_table(target_rows, TARGET_COLS))
        png = breakdown_plot(out_dir / "fusion_breakdown_target.png", title, target_rows)
        plots.append(png)
        sections.append((f"Target: {title}", markdown_table(target_rows, TARGET_COLS)
                         + f"\n\n![]({png.name})"))
    grid_rows: list[dict] = []
    for model, batch, opt, impl, *modes in p["grid"]:
        grid_rows += measure(model, opt, impl, batch, p["res"], steps=p["steps"],
                             repeats=repeats, budget_s=p["budget_s"], model_kw=p["model_kw"],
                             modes=modes[0] if modes else MODES)
    print(f"\nGrid ({p['res']}px images; speedup and saved_of_opt against the same impl)")
    print(text_table(grid_rows, GRID_COLS))
    png = saving_plot(out_dir / "fusion_saving.png", grid_rows)
    plots.append(png)
    first = [r for r in grid_rows if r["optimizer"] == "adam" and r["impl"] == "foreach"]
    if first:
        png2 = breakdown_plot(out_dir / "fusion_breakdown_grid.png",
                              f"adam foreach, {p['res']}px: time breakdown",
                              [r | {"impl": f"{r['model']} b{r['batch']}"} for r in first])
        plots.append(png2)
    sections.append((f"Grid ({p['res']}px images)", markdown_table(grid_rows, GRID_COLS)
                     + f"\n\n![]({png.name})" + (f"\n\n![]({png2.name})" if first else "")))
    mem_rows: list[dict] = []
    for model, batch in p["memory"]:
        mem_rows += memory_rows(model, batch, p["res"], p["model_kw"])
    print("\nPeak memory of one steady-state training step")
    print(text_table(mem_rows, MEM_COLS))
    sections.append(("Peak memory (one steady-state step)", markdown_table(mem_rows, MEM_COLS)))
    rec, md = targets(target_rows, mem_rows)
    print("\nTargets\n" + md)
    sections.insert(0, ("Targets of the issue", md + f"\n\nLoad average (1, 5, 15 min) before "
                        f"the run {load0}, after {os.getloadavg()}: other processes share the "
                        "cores; the modes are interleaved so that load hits them alike."))
    payload = {"suite": "fusion", "machine": machine_info(), "quick": quick, "plan": {
        k: v for k, v in p.items() if k != "grid"}, "loadavg": [load0, os.getloadavg()],
        "targets": rec, "target_rows": target_rows, "rows": grid_rows,
        "memory_rows": mem_rows, "plots": [x.name for x in plots]}
    command = "paraprop bench fusion" + (" --quick" if quick else "") + (
        f" --repeats {repeats}" if repeats else "")
    write_results(out_dir, "fusion", payload, sections, command)
    return payload
