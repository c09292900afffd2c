"""Device rows of the linear core and the recurrent networks (issue 28's targets): the diagonal
scan against the device-to-device copy, ParaGRU / ParaLSTM against their cell loop (plain and
``torch.compile`` d), the BPPSA backward against autograd, the Newton GRU forward against
torch's kernel (cuDNN on a GPU), and the measurements behind the scan's and the RNN forward's
``auto`` choices. See :mod:`paraprop_lab.experiments.rows` for the record format and the scales.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F

from paraprop.data import bitstreams
from paraprop.nn import GRU, ParaGRU, ParallelForward, ParaLSTM, ScanBackward
from paraprop.scan import METHODS, linear_recurrence, native
from paraprop_lab.experiments.bppsa import CLASSES, pair
from paraprop_lab.experiments.device import synchronize
from paraprop_lab.experiments.harness import median
from paraprop_lab.experiments.rows import (
    Context,
    choice,
    cudnn_float32,
    max_abs,
    max_rel,
    row,
    skipped,
)

SCAN_TARGET = 0.7           # the diagonal scan: >= 70% of the copy bandwidth
PARA_LOOP_TARGET, PARA_COMPILED_TARGET, PARA_TOL = 100.0, 5.0, 1e-5
BPPSA_TARGET = 16.0         # BPPSA's RTX 2070 headline, RNN backward vs autograd
NEWTON_TARGET, NEWTON_FORWARD_TOL, NEWTON_STATE_TOL = 50.0, 1e-6, 1e-5


def triton_available() -> str | None:
    """``None`` where ``method="triton"`` is one of the scan's methods, else why not."""
    if "triton" in METHODS:
        return None
    return ("method='triton' is not among paraprop.scan's methods yet (the Triton "
            "kernels are not in this tree)")


def _algorithms(device: torch.device) -> list[str]:
    names = [a for a in METHODS if a not in ("auto", "sequential")]
    if device.type != "cuda":        # Triton kernels run on CUDA tensors only
        names = [a for a in names if a != "triton"]
    if device.type != "cpu" or not native.available():   # the C kernels: CPU tensors only
        names = [a for a in names if a != "native"]
    return names


# -- the diagonal scan -------------------------------------------------------------------------
def _scan_inputs(ctx: Context, B: int, D: int, T: int):
    g = torch.Generator(device=ctx.device).manual_seed(0)
    a = torch.rand(B, T, D, device=ctx.device, generator=g).mul_(0.5).add_(0.5)  # in (0.5, 1)
    b = torch.randn(B, T, D, device=ctx.device, generator=g)
    return a, b


def scan_bandwidth(ctx: Context) -> list[dict]:
    """``h_t = a_t * h_{t-1} + b_t`` over ``(B, D, T)`` in float32 (the library's layout
    ``(B, T, D)``) by every method, as a fraction of the device-to-device copy bandwidth
    measured in the same run (the scan reads ``a`` and ``b`` and writes ``h``: three arrays;
    the copy reads one and writes one)."""
    B, D, T = ctx.pick((2, 16, 300), (8, 1536, 65536) if ctx.device.type == "cuda"
                       else (4, 256, 16384))           # the CPU: 64 MB per array
    a, b = _scan_inputs(ctx, B, D, T)
    shape = f"(B, D, T) = ({B}, {D}, {T}), float32"
    t0 = time.perf_counter()
    ref = linear_recurrence(a, b, method="sequential")
    synchronize(ctx.device)
    seq_s = time.perf_counter() - t0
    out = torch.empty_like(b)
    algs = _algorithms(ctx.device)
    cases = {"copy": lambda: out.copy_(b)}
    cases.update({alg: (lambda alg=alg: linear_recurrence(a, b, method=alg)) for alg in algs})
    times = ctx.time(cases, repeats=ctx.rounds(5), desc="scan bandwidth")
    nbytes = b.numel() * b.element_size()
    copy_bw = 2 * nbytes / times["copy"]
    rows = []
    for alg in [*algs, "sequential"]:
        t = seq_s if alg == "sequential" else times[alg]
        dev = 0.0 if alg == "sequential" else max_abs(linear_recurrence(a, b, method=alg),
                                                      ref)
        rows.append(row(
            "scan", f"bandwidth.{alg}", what="diagonal linear scan, forward: bandwidth as a "
            "fraction of the device-to-device copy's", shape=shape, baseline="copy",
            baseline_s=times["copy"], method=f"method={alg!r}", method_s=t,
            ratio=(3 * nbytes / t) / copy_bw, unit="of copy bandwidth", target=None,
            max_dev=dev, bound=None,
            note=("one untimed run (T dependent steps)" if alg == "sequential" else "")
            + f" copy {copy_bw / 1e9:.0f} GB/s (read + write)",
            scan_gb_per_s=3 * nbytes / t / 1e9, copy_gb_per_s=copy_bw / 1e9))
    why = triton_available()
    if why or ctx.device.type != "cuda":
        rows.append(skipped("scan", "bandwidth.triton", why or "Triton kernels run on CUDA only"))
        rows.append(skipped("scan", "bandwidth.triton_kernel", why or "Triton kernels run on "
                            "CUDA only"))
        return rows
    # the kernel itself in the target's layout (B, D, T), time contiguous (dim=-1)
    from paraprop.scan.triton_kernels import diagonal_scan

    ref = ref.transpose(1, 2).contiguous()
    a, b = a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()
    out = torch.empty_like(b)
    t = ctx.time({"copy": lambda: out.copy_(b), "kernel": lambda: diagonal_scan(a, b, dim=-1)},
                 repeats=ctx.rounds(5), desc="scan kernel")
    bw = 2 * nbytes / t["copy"]
    rows.append(row("scan", "bandwidth.triton_kernel", what="the Triton diagonal scan kernel "
                    "(B, D, T), time contiguous: bandwidth as a fraction of the copy's",
                    shape=shape, baseline="copy", baseline_s=t["copy"],
                    method="triton_kernels.diagonal_scan(a, b, dim=-1)", method_s=t["kernel"],
                    ratio=(3 * nbytes / t["kernel"]) / bw, unit="of copy bandwidth",
                    target=SCAN_TARGET, max_dev=max_abs(diagonal_scan(a, b, dim=-1), ref),
                    bound=None, note=f"copy {bw / 1e9:.0f} GB/s (read + write)",
                    scan_gb_per_s=3 * nbytes / t["kernel"] / 1e9, copy_gb_per_s=bw / 1e9))
    return rows


def _auto_pick(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """The method ``linear_recurrence(a, b, method="auto")`` runs (``None`` where the scan has
    no function that says)."""
    from paraprop.scan import linear as recurrence

    method_for = getattr(recurrence, "method_for", None)
    return None if method_for is None else method_for(a, b)


def scan_choice(ctx: Context) -> list[dict]:
    """What ``linear_recurrence(method="auto")`` should pick on this device: every method
    on the diagonal scans the recurrent modules run (Newton GRU, ParaGRU, BPPSA sizes)."""
    shapes = ctx.pick([(2, 4, 64), (2, 16, 300)],
                      [(16, 8, 100000), (8, 256, 65536), (16, 20, 1000), (32, 64, 1000)])
    if ctx.device.type == "cpu" and not ctx.tiny:
        shapes = [(16, 8, 100000), (4, 64, 100000), (16, 20, 1000), (32, 64, 1000)]
    out = []
    for B, D, T in shapes:
        a, b = _scan_inputs(ctx, B, D, T)
        names = ["sequential", *_algorithms(ctx.device), "auto"]
        cases = {n: (lambda n=n, a=a, b=b: linear_recurrence(a, b, method=n)) for n in names}
        times = ctx.time(cases, repeats=ctx.rounds(3), desc=f"scan choice T={T}")
        auto_s = times.pop("auto")
        out.append(choice("scan", f"algorithm.B{B}_D{D}_T{T}", what="linear_recurrence "
                          "method='auto' (diagonal A, forward)",
                          shape=f"(B, D, T) = ({B}, {D}, {T}), float32", times=times,
                          auto=_auto_pick(a, b), auto_s=auto_s))
    return out


# -- ParaGRU / ParaLSTM against their cell loop --------------------------------------------------
def _para_loop(model: nn.Module, compiled_step):
    """The user's loop over time of ``model``'s cell (``compiled_step`` the cell step, e.g. a
    ``torch.compile`` d :func:`~paraprop.jacobians.diagonal.gru_step`); time-major input."""
    H = model.hidden_size
    w_ih, w_hh = model.weight_ih_l0, model.weight_hh_l0
    b_ih, b_hh = model.bias_ih_l0, model.bias_hh_l0
    lstm = isinstance(model, ParaLSTM)

    def forward(x):
        T, B = x.shape[:2]
        h = x.new_zeros(B, H)
        outs = []
        if lstm:
            gi = F.linear(x, w_ih, b_ih + b_hh).unflatten(-1, (4, H))
            w, c = w_hh.view(4, H), x.new_zeros(B, H)
            for t in range(T):
                h, c = compiled_step(gi[t], h, c, w)
                outs.append(h)
        else:
            gi = F.linear(x, w_ih, b_ih).unflatten(-1, (3, H))
            w, b = w_hh.view(3, H), b_hh.view(3, H)
            for t in range(T):
                h = compiled_step(gi[t], h, w, b)
                outs.append(h)
        return torch.stack(outs)
    return forward


def _train_case(forward, params, x, G):
    """One forward + backward of ``sum(forward(x) * G)``; returns the output and gradients."""
    def run():
        for p in params:
            p.grad = None
        out = forward(x)
        (out * G).sum().backward()
        return out.detach(), [p.grad for p in params]
    return run


def para_rows(kind: str):
    """ParaGRU (``kind="gru"``) or ParaLSTM: forward + backward of ``sum(out * G)`` by the plain
    cell loop with autograd (``forward="sequential", backward="autograd"``: a Python loop over
    time), by that loop with its cell ``torch.compile`` d, and by the module's Newton forward
    and scan backward; outputs and gradients relative to the plain loop's."""
    from paraprop.jacobians.diagonal import gru_step, lstm_step

    cls, step = (ParaGRU, gru_step) if kind == "gru" else (ParaLSTM, lstm_step)

    def run(ctx: Context) -> list[dict]:
        # T: the first GPU run's loops took 110 s per call at T=65536 (the Python loop over
        # time, forward and backward), far past the row's budget; 16384 keeps the row near a
        # minute, and the timed calls' own results are the comparison (no second loop)
        T, B, H = ctx.pick((120, 2, 8), (16384, 8, 256))
        dev = ctx.device
        torch.manual_seed(3)
        newton = cls(H, H).to(dev)
        loop = cls(H, H, forward="sequential", backward="autograd").to(dev)
        loop.load_state_dict(newton.state_dict())
        g = torch.Generator(device=dev).manual_seed(T)
        x = torch.randn(T, B, H, device=dev, generator=g)
        G = torch.randn(T, B, H, device=dev, generator=g)
        backend = "eager" if dev.type == "cpu" else "inductor"
        compiled = torch.compile(step, backend=backend, dynamic=False, fullgraph=True)
        cases = {"loop": (lambda x, m=loop: m(x)[0], list(loop.parameters())),
                 "compiled": (_para_loop(loop, compiled), list(loop.parameters())),
                 "newton": (lambda x, m=newton: m(x)[0], list(newton.parameters()))}
        results: dict = {}

        def kept(name, run):
            def call():
                results[name] = run()
            return call

        runs = {k: kept(k, _train_case(f, p, x, G)) for k, (f, p) in cases.items()}
        short = {k: _train_case(f, p, x[:64], G[:64]) for k, (f, p) in cases.items()}
        for k in runs:                        # compile, allocate, launch once: untimed
            short[k]()
        t_loops = ctx.time({k: runs[k] for k in ("loop", "compiled")}, repeats=1, warmup=0,
                           desc=f"{cls.__name__} loops")
        t_newton = ctx.time({"newton": runs["newton"]}, repeats=ctx.rounds(3), warmup=1,
                            desc=f"{cls.__name__} newton")["newton"]
        (ref_out, ref_grads), (out, grads), (c_out, c_grads) = (
            results[k] for k in ("loop", "newton", "compiled"))
        sols = newton.last_forward
        dev_out = max_rel(out, ref_out)
        dev_grad = max(max_rel(a, b) for a, b in zip(grads, ref_grads, strict=True))
        c_dev = max(max_rel(c_out, ref_out),
                    *(max_rel(a, b) for a, b in zip(c_grads, ref_grads, strict=True)))
        shape = f"T={T}, B={B}, H={H}, input {H}, float32"
        extra = {"iterations": [s.iterations for s in sols],
                 "converged": [s.converged for s in sols],
                 **{k: [s.stats[k] for s in sols]
                    for k in ("newton_step", "triton_iterations", "triton_skipped")},
                 "grad_rel_dev": dev_grad, "compiled_rel_dev": c_dev}
        note = (f"forward + backward of sum(out * G); loops one timed round after an untimed "
                f"T=64 call, newton the median of {ctx.rounds(3)}; deviation: the larger of the "
                f"outputs' ({dev_out:.1e}) and the gradients' ({dev_grad:.1e}), relative to the "
                f"loop's scale; Newton step {extra['newton_step']}; compile backend "
                f"{backend}")
        label = f"{cls.__name__} newton forward + scan backward"
        return [row("pararnn", f"{kind}.vs_loop", what=f"{cls.__name__} vs the plain cell loop",
                    shape=shape, baseline="cell loop, autograd", baseline_s=t_loops["loop"],
                    method=label, method_s=t_newton, target=PARA_LOOP_TARGET,
                    max_dev=max(dev_out, dev_grad), bound=PARA_TOL, note=note, **extra),
                row("pararnn", f"{kind}.vs_compiled", what=f"{cls.__name__} vs the "
                    "torch.compile'd cell loop", shape=shape,
                    baseline=f"torch.compile'd cell loop ({backend})",
                    baseline_s=t_loops["compiled"], method=label, method_s=t_newton,
                    target=PARA_COMPILED_TARGET, max_dev=max(dev_out, dev_grad), bound=PARA_TOL,
                    note=note, **extra)]
    return run


# -- BPPSA: the backward pass as a scan ------------------------------------------------------
def _backward_times(ctx: Context, models: dict[str, nn.Module], x, y, desc: str
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """Median backward and whole-step seconds of each classifier (interleaved; the backward
    timed between two synchronizations of the device)."""
    bwd: dict[str, list[float]] = {k: [] for k in models}

    def case(name, model):
        def run():
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            synchronize(ctx.device)
            t0 = time.perf_counter()
            loss.backward()
            synchronize(ctx.device)
            bwd[name].append(time.perf_counter() - t0)
        return run

    reps = ctx.rounds(5)
    steps = ctx.time({k: case(k, m) for k, m in models.items()}, repeats=reps, warmup=1,
                     desc=desc)
    return {k: median(v[1:]) for k, v in bwd.items()}, steps


def _grad_dev(ref: nn.Module, mine: nn.Module, x, y) -> float:
    """Largest relative difference of a parameter gradient from autograd's (same weights)."""
    grads = []
    for m in (ref, mine):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    return max(max_rel(grads[1][n], g) for n, g in grads[0].items())


def _float32_dev(device, measure):
    """``measure()`` (deviations from torch's result) with cuDNN in float32, and, where the
    device's default differs (CUDA: TF32), again in the default (else ``None``). torch's cuDNN
    RNNs and convolutions run float32 in TF32 by default on a GPU, so torch's own result there
    is TF32-rounded (the first GPU run: 3e-4 relative in the RNN gradients); paraprop's promise
    is the float32 computation's result."""
    with cudnn_float32(device) as changed:
        dev = measure()
    return dev, (measure() if changed else None)


def _tf32_note(dflt: float | None) -> str:
    return "" if dflt is None else (
        f"; max_dev with cuDNN in float32 (conv/rnn fp32_precision 'ieee'); in torch's default "
        f"(TF32) the deviation from torch's result is {dflt:.1e}, TF32's own rounding; times in "
        "the default")


def _triton_backward() -> ScanBackward | None:
    try:
        return ScanBackward(method="triton")
    except ValueError:
        return None


def bppsa_rows(kind: str):
    """BPPSA's training step, the backward timed: torch's module with autograd (cuDNN on a GPU)
    against :mod:`paraprop.nn` with the scan backward (``method="auto"``, and ``"triton"``
    where it exists). ``kind="rnn"``: the bitstream task (hidden 20, batch 16, input 1), T 1000
    and 30000, target 16x; ``"gru"`` / ``"lstm"``: hidden 64, T 1000, batch 32, input 16."""
    def run(ctx: Context) -> list[dict]:
        dev, out = ctx.device, []
        if kind == "rnn":
            configs = [(T, 16, 1, 20) for T in ctx.pick([40, 100], [1000, 30000])]
        else:
            configs = [ctx.pick((60, 4, 16, 8), (1000, 32, 16, 64))]
        for T, B, inputs, hidden in configs:
            g = torch.Generator().manual_seed(T)
            if kind == "rnn":
                x, y = bitstreams(T, B, generator=g)
            else:
                x = torch.randn(T, B, inputs, generator=g)
                y = torch.randint(0, CLASSES, (B,), generator=g)
            x, y = x.to(dev), y.to(dev)
            ref, mine = (m.to(dev) for m in pair(kind, inputs, CLASSES, T, hidden=hidden))
            models = {"autograd": ref, "scan": mine}
            tb, why_not = _triton_backward(), None
            if tb is not None and dev.type == "cuda":
                try:
                    models["scan, triton"] = pair(kind, inputs, CLASSES, T, hidden=hidden,
                                                  backward=tb)[1].to(dev)
                except ValueError as e:          # a state wider than the kernels take
                    why_not = str(e)
            bwd, step = _backward_times(ctx, models, x, y, f"{kind} T={T}")
            shape = f"T={T}, batch {B}, hidden {hidden}, input {inputs}, float32"
            for name in models:
                if name == "autograd":
                    continue
                dev32, dflt = _float32_dev(
                    dev, lambda m=models[name], r=ref, x=x, y=y: _grad_dev(r, m, x, y))
                out.append(row(
                    "bppsa", f"{kind}.backward.T{T}" + ("" if name == "scan" else ".triton"),
                    what=f"{kind.upper()} backward as a scan (BPPSA) vs autograd",
                    shape=shape, baseline=f"torch.nn.{kind.upper()} autograd",
                    baseline_s=bwd["autograd"], method=f"paraprop.nn, {name} backward",
                    method_s=bwd[name], target=BPPSA_TARGET if kind == "rnn" else None,
                    max_dev=dev32, bound=PARA_TOL,
                    note="deviation: largest relative difference of a parameter gradient; "
                    "backward = loss.backward() between two device synchronizations"
                    + _tf32_note(dflt), step_ratio=step["autograd"] / step[name],
                    tf32_dev=dflt))
            if tb is None or dev.type != "cuda" or why_not:
                out.append(skipped("bppsa", f"{kind}.backward.T{T}.triton",
                                   "ScanBackward(method='triton') is not available" if tb
                                   is None else why_not or "Triton kernels run on CUDA only"))
        return out
    return run


# -- the Newton (DEER) GRU forward against torch's kernel ----------------------------------------
def _gru_pair(H: int, method: str, tol: float | None):
    torch.manual_seed(1000 + H)
    ref = nn.GRU(1 if H <= 8 else 16, H)
    mine = GRU(ref.input_size, H, forward=ParallelForward(method=method, tol=tol))
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def forward_cases(models: dict[str, nn.Module], x: torch.Tensor) -> tuple[dict, dict, dict]:
    """Timing cases of recurrent modules' forwards on ``x``, without a graph: ``name -> call``
    (:func:`paraprop_lab.experiments.harness.interleaved`), and the two dicts the calls fill:
    ``outs`` (name -> the output sequence, ``model(x)[0]``) and ``stats`` (name -> the module's
    ``last_forward``, one Solution per layer; every model but ``"torch"``, whose module keeps
    none)."""
    outs, stats = {}, {}

    def case(name, model):
        def run():
            with torch.no_grad():
                outs[name] = model(x)[0]
            if name != "torch":
                stats[name] = model.last_forward
        return run

    return {name: case(name, model) for name, model in models.items()}, outs, stats


class _NoCuDNN(nn.Module):
    """A torch RNN module run with cuDNN off (torch's own CUDA kernels)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        enabled = torch.backends.cudnn.enabled
        torch.backends.cudnn.enabled = False
        try:
            return self.module(x)
        finally:
            torch.backends.cudnn.enabled = enabled


def cudnn_or_not(module: nn.Module, x: torch.Tensor) -> tuple[nn.Module, str]:
    """``module`` itself, or, where cuDNN refuses ``x`` (``CUDNN_STATUS_NOT_SUPPORTED``: the
    first GPU run met it for a GRU over T=100000, batch 16, hidden 8), the module with cuDNN off;
    and a note saying which."""
    if x.device.type != "cuda":
        return module, ""
    try:
        with torch.no_grad():
            module(x)
    except RuntimeError as e:
        if "CUDNN_STATUS_NOT_SUPPORTED" not in str(e):
            raise
        return _NoCuDNN(module), (f"; cuDNN refused this input (CUDNN_STATUS_NOT_SUPPORTED, "
                                  f"T={x.shape[0]}): the baseline is torch's CUDA kernel with "
                                  "cuDNN off")
    return module, ""


def newton_rows(ctx: Context) -> list[dict]:
    """DEER's headline: a GRU (hidden 8, input 1, batch 16) forward over T=100000 by Newton and
    quasi-Newton (``ParallelForward(tol=1e-6)``) against torch.nn.GRU (cuDNN on a GPU, or torch's
    kernel with cuDNN off where cuDNN refuses the length: :func:`cudnn_or_not`)."""
    H, T, B = ctx.pick((4, 300, 2), (8, 100000, 16))
    dev = ctx.device
    x = torch.randn(T, B, 1, generator=torch.Generator().manual_seed(T)).to(dev)
    ref, newton = _gru_pair(H, "newton", NEWTON_FORWARD_TOL)
    _, quasi = _gru_pair(H, "quasi_newton", NEWTON_FORWARD_TOL)
    base, base_note = cudnn_or_not(ref.to(dev), x)
    models = {"newton": newton.to(dev), "quasi_newton": quasi.to(dev)}
    cases, outs, stats = forward_cases({"torch": base, **models}, x)
    times = ctx.time(cases, repeats=ctx.rounds(5), desc=f"newton GRU T={T}")

    def devs():
        with torch.no_grad():
            r = base(x)[0]
        return {m: max_abs(outs[m], r) for m in models}

    d32, dflt = _float32_dev(dev, devs)
    # DEER's target is against cuDNN's kernel: against torch's kernel without cuDNN (a slower
    # loop) the ratio is reported, not held to it
    kernel = "torch's kernel without cuDNN (cuDNN refused the input)" if base_note else \
        "torch's kernel (cuDNN on a GPU)"
    return [row("newton", f"gru_forward.{m}", what=f"GRU forward by Newton (DEER) vs {kernel}",
                shape=f"T={T}, hidden {H}, batch {B}, input 1, "
                "float32", baseline="torch.nn.GRU" + (" (cuDNN off)" if base_note else ""),
                baseline_s=times["torch"],
                method=f"paraprop.nn.GRU forward={m!r}, tol {NEWTON_FORWARD_TOL:g}",
                method_s=times[m], target=None if base_note else NEWTON_TARGET, max_dev=d32[m],
                bound=NEWTON_STATE_TOL, note="no graph (torch.no_grad)" + base_note
                + _tf32_note(None if dflt is None else dflt[m]),
                iterations=[s.iterations for s in stats[m]],
                resets=[s.stats.get("resets", 0) for s in stats[m]],
                tf32_dev=None if dflt is None else dflt[m])
            for m in models]


def rnn_forward_choice(ctx: Context) -> list[dict]:
    """What ``forward="auto"`` should run on this device: torch's kernel against the Newton
    and quasi-Newton forwards (default tolerance) at the sizes of the benchmarks."""
    shapes = ctx.pick([(4, 200, 2)], [(8, 100000, 16), (8, 10000, 16), (20, 1000, 16),
                                      (64, 1000, 32), (64, 10000, 8)])
    out = []
    for H, T, B in shapes:
        ref, newton = _gru_pair(H, "newton", None)
        _, quasi = _gru_pair(H, "quasi_newton", None)
        mods = {"sequential": ref, "newton": newton, "quasi_newton": quasi}
        mods = {k: m.to(ctx.device) for k, m in mods.items()}
        x = torch.randn(T, B, ref.input_size, generator=torch.Generator().manual_seed(H + T))
        x = x.to(ctx.device)
        mods["sequential"], no_cudnn = cudnn_or_not(mods["sequential"], x)

        def case(m, x=x):
            def run():
                with torch.no_grad():
                    m(x)
            return run

        times = ctx.time({k: case(m) for k, m in mods.items()}, repeats=ctx.rounds(3),
                         desc=f"rnn forward H={H} T={T}")
        out.append(choice("bppsa", f"forward.H{H}_T{T}_B{B}", what="paraprop.nn.GRU "
                          "forward='auto' (a GRU forward, no graph)",
                          shape=f"T={T}, hidden {H}, batch {B}, input {ref.input_size}",
                          times=times, auto="sequential" if ctx.device.type != "cpu" else None,
                          note="auto runs torch's kernel off the CPU (nn/options.py)"
                          + no_cudnn))
    return out
