"""``paraprop bench newton``: recurrences by Newton's method (DEER, quasi-DEER, ELK) vs sequential.

Two experiments on the CPU (issue 11):

1. **GRU forward and forward+backward** in DEER's setup (Lim et al. 2023: input size 1, batch
   16): :class:`torch.nn.GRU` against :class:`paraprop.nn.GRU` with ``forward="newton"`` and
   ``"quasi_newton"`` (same weights, ``ParallelForward(tol=1e-6)``), hidden 1 .. 64, ``T`` 1k ..
   100k.
   Forward: torch's fused sequential kernel vs the Newton solve; forward+backward: the loss
   ``sum(out * W)`` (``W`` fixed random) by torch autograd vs our Newton forward plus the exact
   scan backward at the solution. Reported: median times of interleaved rounds, iterations,
   ``max |h - h_torch|`` and the gradients' relative difference. Torch's autograd takes about a
   minute at ``T = 100k``, so forward+backward is measured at every hidden size up to
   ``T = 10k`` and at the headline cell (hidden 8, ``T = 100k``) only, and an overall time
   budget skips the costliest optional cells if the machine is slow; the coverage table says
   which cells were measured.
2. **Autoregressive sine-wave GRU** (the unstable case of ELK, Gonzalez et al. 2024): a GRUCell
   (hidden 16) with a linear readout is trained by teacher forcing on noisy sine waves, then
   generates on its own, ``s_t = cell(readout(s_{t-1}) + eps_t, s_{t-1})``, a
   :class:`paraprop.Recurrence` with a plain Python cell (Jacobians by autograd). Undamped
   Newton and ELK at a few dampings run with an iteration cap and ``throw=False``; reported:
   iterations, convergence, resets (diverging steps replaced by the Jacobi update), error
   against ``method="sequential"`` and time. The claim under test: ELK converges with damping
   where undamped Newton does not.
3. **ParaGRU / ParaLSTM** (ParaRNN's diagonal-recurrence cells, :mod:`paraprop.nn.para`) at
   ``T = 100000``, hidden 64, batch 4, input 1: the Newton forward against the module's own
   sequential loop (``forward="sequential"``), same weights, no graph; reported: median times,
   iterations and ``max |h_newton - h_loop|``.

Every time is a median over interleaved rounds (A B A B ...) from the same run; speedups are
ratios of those medians. Benchmarks are not tests: nothing here asserts on time.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import paraprop
from paraprop.errors import NonFiniteError
from paraprop.nn import GRU, ParaGRU, ParallelForward, ParaLSTM
from paraprop.solvers import ELK
from paraprop_lab.experiments import rows_recurrent as _rows
from paraprop_lab.experiments.harness import interleaved, machine_info, median
from paraprop_lab.experiments.plots import plt, save_figure
from paraprop_lab.experiments.report import markdown_table, text_table, write_results
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows
from paraprop_lab.progress import progress as progress_bar

DESCRIPTION = ("Newton / quasi-Newton / ELK forward: GRU vs torch.nn.GRU; sine-wave GRU; "
               "ParaGRU / ParaLSTM")

# the headline rows on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("newton.gru_forward", _rows.newton_rows, 30)]

BATCH, INPUTS = 16, 1
METHODS = ("newton", "quasi_newton")
FORWARD_TOL = 1e-6      # ParallelForward(tol=...): the error estimate the solve stops at
STATE_TOL = 1e-5        # the "states within 1e-5 of sequential"
SINE_H, SINE_TOL = 16, 1e-5


@dataclass
class Config:
    """Sizes of one run (full or ``--quick``)."""

    hidden: list[int]
    lengths: list[int]
    head: tuple[int, int]                   # (hidden, T) of the headline row
    fb_max_T: int                           # forward+backward at every hidden size up to here
    budget_s: float | None                  # overall; optional cells are skipped past it
    reserve_s: float                        # kept for the headline forward+backward and sine
    sine_T: list[int]
    sine_steps: int                         # Adam steps of the teacher-forced training
    sine_max_iters: int
    dampings: list[float]
    elk_seconds: dict[int, float] = field(default_factory=dict)   # T -> time cap per ELK solve
    long_dampings: int | None = None        # at the longest T only the first so many dampings
    para: tuple[int, int, int] = (100000, 64, 4)    # ParaGRU / ParaLSTM: (T, hidden, batch)


FULL = Config(hidden=[1, 2, 4, 8, 16, 32, 64], lengths=[1000, 3000, 10000, 30000, 100000],
              head=(8, 100000), fb_max_T=10000, budget_s=900.0, reserve_s=450.0,
              sine_T=[2000, 10000], sine_steps=300, sine_max_iters=300,
              dampings=[1e-4, 1e-3, 1e-2], elk_seconds={2000: 25.0, 10000: 180.0},
              long_dampings=1)
QUICK = Config(hidden=[2, 8], lengths=[64, 256], head=(8, 256), fb_max_T=256, budget_s=None,
               reserve_s=0.0, sine_T=[150], sine_steps=5, sine_max_iters=40,
               dampings=[1e-3, 1e-2], para=(256, 8, 4))
PARA_SPEEDUP = 10.0     # the target for ParaGRU: Newton >= 10x its sequential loop


def rounds(kind: str, T: int, head: bool, quick: bool, repeats: int | None) -> tuple[int, dict]:
    """``(warmup, {case: timed rounds})`` of one cell: fewer rounds where one run takes
    seconds; torch's autograd at the headline ``T = 100k`` (about a minute) runs once."""
    cases = ("torch", *METHODS)
    if quick:
        return 1, dict.fromkeys(cases, repeats or 1)
    if kind == "fwd":
        warm, n = (1, 5) if T <= 3000 else (1, 3) if T <= 10000 else (0, 2) if T <= 30000 \
            else (0, 3 if head else 1)
        return warm, dict.fromkeys(cases, repeats or n)
    if T <= 10000:
        return 1, dict.fromkeys(cases, repeats or (3 if T <= 3000 else 2))
    return 0, {"torch": repeats or 1, **dict.fromkeys(METHODS, repeats or 3)}


class Budget:
    """Wall-clock budget: estimates a cell from the per-step times measured at shorter ``T``."""

    def __init__(self, seconds: float | None):
        self.deadline = math.inf if seconds is None else time.perf_counter() + seconds
        self.rate: dict[tuple, float] = {}     # (kind, hidden, case) -> seconds per step

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def estimate(self, kind: str, H: int, T: int, warm: int, reps: dict) -> float:
        total = 0.0
        for case, n in reps.items():
            r = self.rate.get((kind, H, case))
            if r is None:       # the first (shortest) cell of this kind and hidden size
                return 0.0
            total += r * T * (n + warm)
        return total

    def learn(self, kind: str, H: int, T: int, times: dict[str, list[float]]) -> None:
        for case, ts in times.items():
            self.rate[(kind, H, case)] = median(ts) / T


# -- GRU: torch.nn.GRU vs paraprop.nn.GRU(forward="newton" | "quasi_newton") ------------------
def models(H: int) -> tuple[nn.GRU, dict[str, GRU]]:
    """torch.nn.GRU and ours (one per method) with identical weights, seeded by ``H``."""
    torch.manual_seed(1000 + H)
    ref = nn.GRU(INPUTS, H)
    ours = {}
    for m in METHODS:
        g = GRU(INPUTS, H, forward=ParallelForward(method=m, tol=FORWARD_TOL))
        g.load_state_dict(ref.state_dict())
        ours[m] = g
    return ref, ours


def sequence(T: int, H: int | None = None) -> torch.Tensor:
    """Inputs ``(T, 16, 1)`` (``H`` None) or the loss weights ``(T, 16, H)``, seeded by ``T``."""
    g = torch.Generator().manual_seed(T if H is None else 7 * T + H)
    return torch.randn(T, BATCH, INPUTS if H is None else H, generator=g)


def _timed(cases: dict, warm: int, reps: dict, desc: str) -> dict[str, list[float]]:
    """Interleaved rounds of every case, then extra rounds of the cases that want more."""
    low = min(reps.values())
    times = interleaved(cases, repeats=low, warmup=warm, desc=desc)
    more = {k: c for k, c in cases.items() if reps[k] > low}
    if more:
        extra = interleaved(more, repeats=max(reps[k] for k in more) - low, warmup=0, desc=desc)
        for k, ts in extra.items():
            times[k] += ts
    return times


def forward_cell(H: int, T: int, x: torch.Tensor, warm: int, reps: dict):
    """Forward times (no graph), iterations and ``max |h - h_torch|`` of one (hidden, T)."""
    ref, ours = models(H)
    cases, outs, stats = _rows.forward_cases({"torch": ref, **ours}, x)
    times = _timed(cases, warm, reps, f"fwd H={H} T={T}")
    row = {"hidden": H, "T": T, "rounds": reps["torch"], "torch_ms": 1e3 * median(times["torch"])}
    for m in METHODS:
        row[f"{m}_ms"] = 1e3 * median(times[m])
        row[f"{m}_speedup"] = row["torch_ms"] / row[f"{m}_ms"]
    for m in METHODS:
        row[f"{m}_iters"] = stats[m][0].iterations
        row[f"{m}_resets"] = stats[m][0].stats.get("resets", 0)
        row[f"{m}_err"] = float((outs[m] - outs["torch"]).abs().max())
    return row, times


def backward_cell(H: int, T: int, x: torch.Tensor, warm: int, reps: dict):
    """Forward+backward times of ``sum(out * W)``: torch autograd vs ours (Newton forward,
    scan backward), and the largest relative difference of the parameter gradients."""
    ref, ours = models(H)
    w = sequence(T, H)

    def case(model):
        params = list(model.parameters())

        def go():
            for p in params:
                p.grad = None
            (model(x)[0] * w).sum().backward()
        return go

    cases = {"torch": case(ref), **{m: case(g) for m, g in ours.items()}}
    times = _timed(cases, warm, reps, f"fwd+bwd H={H} T={T}")
    row = {"hidden": H, "T": T, "torch_rounds": reps["torch"], "ours_rounds": reps[METHODS[0]],
           "torch_ms": 1e3 * median(times["torch"])}
    for m in METHODS:
        row[f"{m}_ms"] = 1e3 * median(times[m])
        row[f"{m}_speedup"] = row["torch_ms"] / row[f"{m}_ms"]
    want = dict(ref.named_parameters())
    for m, g in ours.items():
        row[f"{m}_grad_err"] = max(
            float((p.grad - want[n].grad).abs().max() / want[n].grad.abs().max().clamp_min(1e-30))
            for n, p in g.named_parameters())
        row[f"{m}_iters"] = g.last_forward[0].iterations
    return row, times


def gru_section(cfg: Config, budget: Budget, quick: bool, repeats: int | None) -> dict:
    """The forward grid (every cell the budget allows), then forward+backward."""
    fwd, fb, coverage = [], [], {}
    head_H, head_T = cfg.head
    # forward+backward: the headline hidden size first (its curve against T), the others by T
    fb_cells = [(head_H, T) for T in cfg.lengths if T <= cfg.fb_max_T]
    fb_cells += [(H, T) for T in cfg.lengths if T <= cfg.fb_max_T for H in cfg.hidden
                 if H != head_H]
    if cfg.head not in fb_cells:
        fb_cells.append(cfg.head)
    skipped = set()     # (kind, hidden) once a cell was skipped: longer T are skipped too
    for kind, cells in (("fwd", [(H, T) for T in cfg.lengths for H in cfg.hidden]),
                        ("fwd+bwd", fb_cells)):
        for H, T in cells:
            head = (H, T) == cfg.head
            warm, reps = rounds(kind, T, head, quick, repeats)
            est = budget.estimate(kind, H, T, warm, reps)
            if not head and ((kind, H) in skipped or est > budget.left() - cfg.reserve_s):
                skipped.add((kind, H))
                coverage.setdefault((H, T), []).append(f"{kind} skipped")
                print(f"skipping {kind} hidden={H} T={T}: estimated {est:.0f} s, "
                      f"{budget.left():.0f} s left of the budget")
                continue
            x = sequence(T)
            cell = forward_cell if kind == "fwd" else backward_cell
            row, times = cell(H, T, x, warm, reps)
            budget.learn(kind, H, T, times)
            (fwd if kind == "fwd" else fb).append(row)
            coverage.setdefault((H, T), []).append(kind)
    grid = [{"hidden": H, **{f"T={T}": ", ".join(coverage.get((H, T), ["-"]))
                             for T in cfg.lengths}} for H in cfg.hidden]
    fb.sort(key=lambda r: (r["T"], r["hidden"]))
    return {"forward": fwd, "backward": fb, "coverage": grid,
            "head": {"hidden": head_H, "T": head_T, "batch": BATCH}}


# -- the autoregressive sine-wave GRU (ELK) --------------------------------------------------
def train_sine(steps: int, seed: int = 0, *, length: int = 200, batch: int = 32,
               lr: float = 1e-2):
    """A GRUCell (hidden 16, input 1) and a Linear readout trained by teacher forcing to predict
    ``sin(0.2 t + phase) + 0.02 noise`` one step ahead (Adam); returns ``(cell, readout,
    losses)``."""
    torch.manual_seed(seed)
    cell, readout = nn.GRUCell(1, SINE_H), nn.Linear(SINE_H, 1)
    opt = torch.optim.Adam([*cell.parameters(), *readout.parameters()], lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    t = torch.arange(length + 1, dtype=torch.float32)
    losses = []
    for _ in progress_bar(range(steps), desc="train sine GRU", unit="steps"):
        phase = 2 * math.pi * torch.rand(batch, 1, generator=g)
        y = torch.sin(0.2 * t + phase) + 0.02 * torch.randn(batch, length + 1, generator=g)
        h, preds = torch.zeros(batch, SINE_H), []
        for k in range(length):
            h = cell(y[:, k:k + 1], h)
            preds.append(readout(h))
        loss = nn.functional.mse_loss(torch.cat(preds, 1), y[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return cell, readout, losses


def generator(cell: nn.GRUCell, readout: nn.Linear, T: int, seed: int = 5):
    """The autonomous generation as a Recurrence: ``s_t = cell(readout(s_{t-1}) + eps_t,
    s_{t-1})`` with ``eps ~ 0.01 N(0, 1)`` fixed, ``s_{-1} = 0``, a plain Python cell."""
    def step(eps, s):
        return cell(readout(s) + eps, s)

    eps = 0.01 * torch.randn(1, T, 1, generator=torch.Generator().manual_seed(seed))
    return paraprop.Recurrence(step, eps, hidden_size=SINE_H, params=[])


def _solve_row(rec, ref, T: int, method: str, damping: float | None, max_iters: int) -> dict:
    row = {"T": T, "method": method, "damping": damping if damping is not None else "-",
           "max_iters": max_iters}
    t0 = time.perf_counter()
    try:
        solver = ELK(damping=damping) if method == "elk" else method
        sol = paraprop.solve(rec, rec.zeros(), method=solver, dim=-2, tol=SINE_TOL,
                             max_iters=max_iters, throw=False)
    except NonFiniteError as e:     # a diverged iterate overflowed the cell itself
        row.update(time_s=time.perf_counter() - t0, converged=False, note=f"NonFiniteError: {e}",
                   residuals=[])
        return row
    err = (sol.value - ref).abs().amax(dim=-1).reshape(-1)       # per step
    bad = (err > 1e-3).nonzero()
    res = sol.residuals.tolist()
    row.update(time_s=time.perf_counter() - t0, iterations=sol.iterations,
               converged=sol.converged, resets=int(sol.stats.get("resets", 0)),
               residual=res[-1] if res else 0.0, max_residual=max(res) if res else 0.0,
               max_err=float(err.max()), exact_prefix=int(bad[0]) if len(bad) else T,
               note="", residuals=res)
    return row


def sine_section(cfg: Config, quick: bool) -> dict:
    """Train once, then Newton and ELK per length against the sequential generation."""
    t0 = time.perf_counter()
    cell, readout, losses = train_sine(cfg.sine_steps)
    train_s = time.perf_counter() - t0
    rows, wave = [], None
    for T in cfg.sine_T:
        rec = generator(cell, readout, T)
        with torch.no_grad():
            t0 = time.perf_counter()
            ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2).value
            seq_s = time.perf_counter() - t0
            wave = readout(ref[0]).squeeze(-1)[:400].tolist()
            rows.append({"T": T, "method": "sequential", "damping": "-", "iterations": T,
                         "converged": True, "time_s": seq_s, "max_err": 0.0, "note": "",
                         "residuals": []})
            runs = [("newton", None, cfg.sine_max_iters)]
            longest = T == max(cfg.sine_T) and len(cfg.sine_T) > 1
            for lam in cfg.dampings[:cfg.long_dampings] if longest else cfg.dampings:
                cap = cfg.sine_max_iters
                if cfg.elk_seconds.get(T):   # a time cap per ELK solve, from a 2-step probe
                    p0 = time.perf_counter()
                    paraprop.solve(rec, rec.zeros(), method=ELK(damping=lam), dim=-2,
                                   tol=SINE_TOL,
                                   max_iters=2, throw=False)
                    per = (time.perf_counter() - p0) / 2
                    cap = max(10, min(cap, int(cfg.elk_seconds[T] / per)))
                runs.append(("elk", lam, cap))
            for method, lam, cap in progress_bar(runs, desc=f"sine T={T}", unit="runs"):
                row = _solve_row(rec, ref, T, method, lam, cap)
                rows.append(row)
                print(f"  sine T={T} {method}{'' if lam is None else f' lambda={lam:g}'}: "
                      f"{row.get('iterations', '-')} iterations (cap {cap}), converged "
                      f"{row['converged']}, max err {row.get('max_err', float('nan')):.2e}, "
                      f"{row['time_s']:.1f} s {row['note'][:60]}")
    return {"rows": rows, "train_steps": cfg.sine_steps, "train_s": train_s,
            "train_loss_first": losses[0] if losses else None,
            "train_loss_last": losses[-1] if losses else None, "tol": SINE_TOL,
            "wave": wave}


# -- ParaGRU / ParaLSTM: Newton forward vs their sequential loop -----------------------------
def para_section(cfg: Config, quick: bool, repeats: int | None) -> dict:
    """Each cell's Newton forward (default ``tol``) against its ``forward="sequential"`` loop:
    the same module, weights and inputs (``N(0, 1)``, input size 1, batch first), no graph."""
    T, H, B = cfg.para
    rows = []
    for cls in (ParaGRU, ParaLSTM):
        torch.manual_seed(2000 + H)
        model = cls(INPUTS, H, batch_first=True)
        x = torch.randn(B, T, INPUTS, generator=torch.Generator().manual_seed(T + 1))
        outs, iters = {}, []

        def case(name, model=model, x=x, outs=outs, iters=iters):
            def go():
                model.forward_config = name
                with torch.no_grad():
                    outs[name] = model(x)[0]
                if name == "newton":
                    iters.append(model.last_forward[0].iterations)
            return go

        cases = {"sequential": case("sequential"), "newton": case("newton")}
        with torch.no_grad():                   # first calls (kernel builds) outside the timing
            for name in cases:
                model.forward_config = name
                model(x[:, :min(T, 1000)])
        n = repeats or (1 if quick else 3)
        times = interleaved(cases, repeats=n, warmup=1 if quick else 0,
                            desc=f"{cls.__name__} T={T}")
        row = {"cell": cls.__name__, "T": T, "hidden": H, "batch": B, "rounds": n,
               "sequential_ms": 1e3 * median(times["sequential"]),
               "newton_ms": 1e3 * median(times["newton"])}
        row["speedup"] = row["sequential_ms"] / row["newton_ms"]
        row["newton_iters"] = iters[-1]
        row["err"] = float((outs["newton"] - outs["sequential"]).abs().max())
        rows.append(row)
    return {"rows": rows, "T": T, "hidden": H, "batch": B}


# -- targets, plots, the suite ---------------------------------------------------------------
def targets(gru: dict, sine: dict, para: dict | None = None) -> list[dict]:
    """The issue's claims against the measured figures."""
    out = []
    H, T = gru["head"]["hidden"], gru["head"]["T"]
    f = next((r for r in gru["forward"] if (r["hidden"], r["T"]) == (H, T)), None)
    if f:
        best = max(METHODS, key=lambda m: f[f"{m}_speedup"])
        out.append({"target": f"hidden {H}, T={T}: newton or quasi_newton forward faster than "
                    "torch.nn.GRU", "measured": f"{f[f'{best}_speedup']:.2f}x ({best})",
                    "met": f[f"{best}_speedup"] > 1})
    b = next((r for r in gru["backward"] if (r["hidden"], r["T"]) == (H, T)), None)
    if b:
        best = max(METHODS, key=lambda m: b[f"{m}_speedup"])
        out.append({"target": f"hidden {H}, T={T}: forward+backward >= 2x faster than torch "
                    "autograd", "measured": f"{b[f'{best}_speedup']:.2f}x ({best})",
                    "met": b[f"{best}_speedup"] >= 2})
    if f:
        worst = max(f[f"{m}_err"] for m in METHODS)
        out.append({"target": f"hidden {H}, T={T}: states within {STATE_TOL:g} of sequential",
                    "measured": worst, "met": worst <= STATE_TOL})
    Tl = max((r["T"] for r in sine["rows"]), default=None)
    rows = [r for r in sine["rows"] if r["T"] == Tl and r["method"] != "sequential"]
    newton = next((r for r in rows if r["method"] == "newton"), None)
    elk = [r for r in rows if r["method"] == "elk"]
    if newton and elk:
        ok = [r for r in elk if r["converged"]]
        first = (f"converged in {newton['iterations']}" if newton["converged"]
                 else "not converged")
        at = ", ".join(f"lambda={r['damping']:g} in {r['iterations']}" for r in ok) or "none"
        peak = min(r["max_residual"] for r in elk)
        measured = (f"newton {first} (resets {newton['resets']}, largest residual "
                    f"{newton['max_residual']:.2g}); elk converged at {at} (largest residual "
                    f"{peak:.2g})")
        out.append({"target": f"sine GRU, T={Tl}: ELK converges with damping where undamped "
                    "Newton does not", "measured": measured,
                    "met": bool(ok) and not newton["converged"]})
    return out + para_targets(para)


def para_targets(para: dict | None) -> list[dict]:
    """The issue's ParaGRU target against :func:`para_section`'s rows."""
    p = next((r for r in (para or {}).get("rows", []) if r["cell"] == "ParaGRU"), None)
    if not p:
        return []
    return [{"target": f"ParaGRU, T={p['T']}, hidden {p['hidden']}, batch {p['batch']}: "
             f"Newton forward >= {PARA_SPEEDUP:g}x faster than its sequential loop, "
             f"equal within {STATE_TOL:g}",
             "measured": f"{p['speedup']:.2f}x, max error {p['err']:.1e}",
             "met": p["speedup"] >= PARA_SPEEDUP and p["err"] <= STATE_TOL}]


def plot_gru(path: Path, gru: dict) -> Path:
    """Time (headline hidden size) and iterations (every hidden size) against T, log-log."""
    H = gru["head"]["hidden"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    fr = [r for r in gru["forward"] if r["hidden"] == H]
    br = [r for r in gru["backward"] if r["hidden"] == H]
    for rows, tag, ls in ((fr, "forward", "-"), (br, "fwd+bwd", "--")):
        if not rows:
            continue
        Ts = [r["T"] for r in rows]
        ax.loglog(Ts, [r["torch_ms"] for r in rows], "o" + ls, color="k",
                  label=f"torch {tag}" + (" (autograd)" if tag == "fwd+bwd" else ""))
        for m, c in zip(METHODS, ("tab:blue", "tab:orange"), strict=True):
            ax.loglog(Ts, [r[f"{m}_ms"] for r in rows], "s" + ls, color=c, label=f"{m} {tag}")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("median wall time (ms)")
    ax.set_title(f"GRU hidden {H}, batch {BATCH}: time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    cmap = plt.get_cmap("viridis")
    hs = sorted({r["hidden"] for r in gru["forward"]})
    for ax, key, ylabel in ((axes[1], "iters", "iterations to reach the tolerance"),
                            (axes[2], "speedup",
                             "forward speedup over torch.nn.GRU\n(times faster)")):
        for i, h in enumerate(hs):
            rows = [r for r in gru["forward"] if r["hidden"] == h]
            col = cmap(i / max(1, len(hs) - 1))
            for m, ls in zip(METHODS, ("-", "--"), strict=True):
                ax.loglog([r["T"] for r in rows], [r[f"{m}_{key}"] for r in rows], "o" + ls,
                          color=col, ms=3, label=f"{m} H={h}" if key == "iters" else None)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].set_title("iterations (solid newton, dashed quasi_newton)")
    axes[1].legend(fontsize=6, ncol=2)
    axes[2].axhline(1.0, color="grey", lw=0.8)
    axes[2].set_title("forward speedup per hidden size")
    return save_figure(fig, path, dpi=110)


def plot_sine(path: Path, sine: dict) -> Path:
    """Residual per iteration at the longest T (newton vs elk), and the generated wave."""
    Tl = max(r["T"] for r in sine["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    for r in sine["rows"]:
        if r["T"] != Tl or not r.get("residuals"):
            continue
        label = r["method"] + (f" lambda={r['damping']:g}" if r["method"] == "elk" else "")
        ys = [min(max(v, 1e-12), 1e38) for v in r["residuals"]]
        ax.semilogy(range(1, len(ys) + 1), ys, lw=1,
                    label=f"{label} ({'converged' if r['converged'] else 'not converged'})")
    ax.axhline(sine["tol"], color="grey", ls="--", lw=0.8,
               label=f"stopping tolerance {sine['tol']:g}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("largest change of a state in one\niteration (max abs of fn(x) - x)")
    ax.set_title(f"sine-wave GRU, T={Tl}: how far each iteration is from a fixed point")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]
    if sine.get("wave"):
        ax.plot(sine["wave"], lw=1)
    ax.set_xlabel("time step t")
    ax.set_ylabel("the GRU's output at step t")
    ax.set_title("generated sequence (sequential), first steps")
    ax.grid(True, alpha=0.3)
    return save_figure(fig, path, dpi=110)


FWD_COLUMNS = ["hidden", "T", "rounds", "torch_ms", "newton_ms", "quasi_newton_ms",
               "newton_speedup", "quasi_newton_speedup", "newton_iters", "quasi_newton_iters",
               "newton_resets", "quasi_newton_resets", "newton_err", "quasi_newton_err"]
FB_COLUMNS = ["hidden", "T", "torch_rounds", "ours_rounds", "torch_ms", "newton_ms",
              "quasi_newton_ms", "newton_speedup", "quasi_newton_speedup", "newton_iters",
              "quasi_newton_iters", "newton_grad_err", "quasi_newton_grad_err"]
SINE_COLUMNS = ["T", "method", "damping", "max_iters", "iterations", "converged", "resets",
                "residual", "max_residual", "max_err", "exact_prefix", "time_s", "note"]
PARA_COLUMNS = ["cell", "T", "hidden", "batch", "rounds", "sequential_ms", "newton_ms", "speedup",
                "newton_iters", "err"]
TARGET_COLUMNS = ["target", "measured", "met"]


@with_device_rows("newton", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
    out_dir = Path(out_dir)
    cfg = QUICK if quick else FULL
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    budget = Budget(cfg.budget_s)
    print(f"torch threads: {torch.get_num_threads()}; load average {load_start[0]:.2f}; "
          f"budget {cfg.budget_s or 'none'} s")

    gru = gru_section(cfg, budget, quick, repeats)
    print(f"\nGRU forward, batch {BATCH}, input {INPUTS}: torch.nn.GRU vs paraprop.nn.GRU "
          f"(tol={FORWARD_TOL:g}); times in ms")
    print(text_table(gru["forward"], FWD_COLUMNS))
    print("\nGRU forward+backward (loss = sum(out * W)): torch autograd vs Newton forward + "
          "scan backward; times in ms")
    print(text_table(gru["backward"], FB_COLUMNS))

    print(f"\nSine-wave GRU (hidden {SINE_H}): training {cfg.sine_steps} Adam steps, then "
          f"generation by newton / elk")
    sine = sine_section(cfg, quick)
    print(text_table(sine["rows"], SINE_COLUMNS))

    para = para_section(cfg, quick, repeats)
    print(f"\nParaGRU / ParaLSTM forward (T={para['T']}, hidden {para['hidden']}, batch "
          f"{para['batch']}): Newton vs the sequential loop; times in ms")
    print(text_table(para["rows"], PARA_COLUMNS))

    plots = [plot_gru(out_dir / "newton_gru.png", gru), plot_sine(out_dir / "newton_sine.png",
                                                                   sine)]
    took = time.perf_counter() - t_start
    load_end = os.getloadavg()
    H, T = cfg.head
    elk_cap = ("`max_iters` of ELK is capped by time: " + ", ".join(
        f"{s:.0f} s per solve at T={t}" for t, s in cfg.elk_seconds.items())
        + " (the cap from a 2-iteration probe)." if cfg.elk_seconds else "")
    hb = next((r for r in gru["backward"] if (r["hidden"], r["T"]) == cfg.head), {})
    note = (
        f"GRU: batch {BATCH}, input {INPUTS}, weights of torch.nn.GRU copied into "
        f"paraprop.nn.GRU(forward=...) with tol={FORWARD_TOL:g}; inputs N(0, 1). "
        f"Medians of interleaved rounds (torch, newton, quasi_newton); rounds per cell in the "
        f"tables (warm-up round first up to T=10000, none beyond, where one run takes "
        f"seconds). Forward runs under no_grad. Forward+backward is `loss.backward()` of "
        f"sum(out * W) with fixed random W, after the forward with parameters requiring grad; "
        f"at hidden {H}, T={T} torch's autograd runs {hb.get('torch_rounds', '-')} round(s) "
        f"and ours {hb.get('ours_rounds', '-')} (the first interleaved). `*_err`: "
        f"max |h - h_torch| over all outputs; `*_grad_err`: the largest relative difference "
        f"of a parameter gradient from torch's. Overall "
        f"budget {cfg.budget_s or 'none'} s: optional cells estimated past it are skipped "
        f"(coverage table). Sine case: tol={SINE_TOL:g}, throw=False; `exact_prefix` is the "
        f"first step whose state differs from the sequential one by more than 1e-3; "
        f"{elk_cap} torch threads {torch.get_num_threads()}; load "
        f"average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end (other "
        f"processes on a 2-core machine slow down torch's 2-thread operators a lot). "
        f"Suite time {took:.0f} s.")
    sine_note = (f"Trained {sine['train_steps']} Adam steps (lr 1e-2, batch 32, 200 "
                 f"teacher-forced steps of sin(0.2 t + phase) + 0.02 noise) in "
                 f"{sine['train_s']:.1f} s, MSE {sine['train_loss_first']:.3g} -> "
                 f"{sine['train_loss_last']:.3g}. Generation: s_t = cell(readout(s_(t-1)) + "
                 f"eps_t, s_(t-1)), eps ~ 0.01 N(0, 1) fixed, s_(-1) = 0, a Recurrence with a "
                 f"plain Python cell (Jacobians by autograd), batch 1.")
    para_note = (f"ParaGRU and ParaLSTM (paraprop.nn, diagonal hidden weights) with input "
                 f"{INPUTS}, batch first, inputs N(0, 1), default init and the default tol "
                 f"(1e-5, float32); both forwards under no_grad, interleaved (sequential, "
                 f"newton), after one untimed call at T <= 1000. `sequential` is the module's "
                 f"forward=\"sequential\": a Python loop over time with the input projection "
                 f"computed up front; `err` is max |h_newton - h_sequential| over all outputs.")
    goal = targets(gru, sine, para)
    table_rows = [{k: v for k, v in r.items() if k != "residuals"} for r in sine["rows"]]
    sections = [("Method", note), ("Targets", markdown_table(goal, TARGET_COLUMNS)),
                ("Measured cells (hidden x T)",
                 markdown_table(gru["coverage"], ["hidden", *[f"T={t}" for t in cfg.lengths]])),
                (f"GRU forward (batch {BATCH}, input {INPUTS}; times in ms)",
                 markdown_table(gru["forward"], FWD_COLUMNS) + f"\n\n![]({plots[0].name})"),
                ("GRU forward+backward (times in ms)", markdown_table(gru["backward"],
                                                                      FB_COLUMNS)),
                (f"Autoregressive sine-wave GRU (hidden {SINE_H}): newton vs elk",
                 sine_note + "\n\n" + markdown_table(table_rows, SINE_COLUMNS)
                 + f"\n\n![]({plots[1].name})"),
                ("ParaGRU / ParaLSTM: Newton forward vs the sequential loop (times in ms)",
                 para_note + "\n\n" + markdown_table(para["rows"], PARA_COLUMNS))]
    print("\nIssue targets:")
    print(text_table(goal, TARGET_COLUMNS))
    print("\n" + note)
    payload = {"suite": "newton", "machine": machine_info(), "quick": quick, "repeats": repeats,
               "load_avg": {"start": list(load_start), "end": list(load_end)},
               "budget_s": cfg.budget_s, "forward_tol": FORWARD_TOL, "gru": gru, "sine": sine,
               "para": para,
               "targets": goal, "plots": [p.name for p in plots], "seconds": took}
    cmd = "paraprop bench newton" + (" --quick" if quick else "") + (
        f" --repeats {repeats}" if repeats else "")
    write_results(out_dir, "newton", payload, sections, cmd)
    return payload
