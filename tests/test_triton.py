"""The Triton kernels (paraprop.scan.triton_kernels, paraprop.nn.triton_cells) against the
sequential reference: compiled on a CUDA device where there is one, in Triton's interpreter on
the CPU (``TRITON_INTERPRET=1``, set per test whatever the shell says; sizes kept tiny, the
interpreter runs every program in Python).

The bound for the scans (docs/scan.md): a tree scan groups the products and sums of
``h_t = sum_s (a_{s+1} ... a_t) b_s`` differently from the loop, so every state is within
``gamma_k M_t`` of the exact value (``gamma_k = k u / (1 - k u)``), ``M_t`` the same sum of
absolute values, ``u`` the accumulation's unit roundoff and ``k`` the roundings a term can pass
through (``2 T + 2`` for the diagonal scan, below for the others), plus half an ulp of the
output's dtype. The data make every carry matter (multipliers near 1, a non-zero ``h0``), so a
wrong carry is far outside the bound.
"""

import ast
import os
import threading
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import paraprop  # noqa: E402
from paraprop.nn import ParaGRU, ParallelForward, ParaLSTM, para_solve, triton_cells  # noqa: E402
from paraprop.nn.para_gru import GRURecurrence  # noqa: E402
from paraprop.nn.para_lstm import LSTMRecurrence  # noqa: E402
from paraprop.scan import Factored, LSTMFactored, linear_recurrence  # noqa: E402
from paraprop.scan import linear as rec_module  # noqa: E402
from paraprop.scan import triton_kernels as tk  # noqa: E402
from paraprop.scan import triton_runtime as rt  # noqa: E402
from paraprop.scan.transitions import canonicalise  # noqa: E402

f64 = torch.float64
# unit roundoff of the accumulation (float32 for half-precision inputs) and of the outputs
ACC_UNIT = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -24,
            torch.float16: 2.0 ** -24}
OUT_UNIT = {torch.float64: 0.0, torch.float32: 0.0, torch.bfloat16: 2.0 ** -8,
            torch.float16: 2.0 ** -11}


@pytest.fixture
def dev(device, monkeypatch):
    """The device, with the kernels compiled on CUDA and interpreted on the CPU."""
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return device


def diag_reference(a, b, h0, reverse):
    """Float64 states and ``M_t`` of ``(N, T, D)`` inputs, by the loop."""
    a, b = a.to(f64), b.to(f64)
    h = torch.zeros_like(b[:, 0]) if h0 is None else h0.to(f64).expand_as(b[:, 0])
    m = h.abs()
    out, mag = torch.empty_like(b), torch.empty_like(b)
    for t in (range(b.shape[1] - 1, -1, -1) if reverse else range(b.shape[1])):
        h = a[:, t] * h + b[:, t]
        m = a[:, t].abs() * m + b[:, t].abs()
        out[:, t], mag[:, t] = h, m
    return out, mag


def assert_within(h, ref, mag, k, dtype, interpreted=False):
    """``|h - ref| <= gamma_k M + u_out (|ref| + gamma_k M)``, elementwise, ``gamma_k = k u /
    (1 - k u)``. (Triton's interpreter truncates float32 to bfloat16 where the compiled
    kernels round to nearest: one ulp instead of half.)"""
    ku = k * ACC_UNIT[dtype]
    acc = ku / (1 - ku) * mag
    out = OUT_UNIT[dtype] * (2 if interpreted and dtype == torch.bfloat16 else 1)
    bound = acc + out * (ref.abs() + acc)
    excess = (h.to(f64) - ref).abs() - bound
    assert float(excess.max()) <= 0, float(((h.to(f64) - ref).abs() / (mag + 1e-300)).max())


def data(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = 0.9 + 0.1 * torch.rand(shape, generator=g, dtype=f64)    # carries reach far
    b = torch.randn(shape, generator=g, dtype=f64)
    return a.to(dtype).to(device), b.to(dtype).to(device)


# -- the diagonal scan ----------------------------------------------------------------------------
CASES = [  # (shape, dim, reverse, chunks, with h0): T = 70 spans 5 blocks of 16, T = 5 one
    ((2, 5, 70), -1, False, None, True),
    ((2, 5, 70), -1, True, 3, True),
    ((2, 70, 5), 1, True, None, False),
    ((2, 70, 5), 1, False, 3, True),
    ((3, 5, 2), 1, True, None, True),
    ((37, 3), 0, False, 2, True),
]


@pytest.mark.parametrize("shape, dim, reverse, chunks, with_h0", CASES)
def test_diagonal_scan_within_the_bound_of_the_exact_states(dev, shape, dim, reverse, chunks,
                                                            with_h0):
    a, b = data(shape, torch.float32, dev)
    rest = list(shape)
    del rest[dim]
    h0 = torch.randn(rest, dtype=torch.float32).to(dev) if with_h0 else None
    h = tk.diagonal_scan(a, b, h0, reverse=reverse, dim=dim, block_t=16, chunks=chunks)
    assert h.shape == b.shape and h.dtype == b.dtype
    move = [x.movedim(dim, -1).reshape(-1, 1, shape[dim]).transpose(1, 2) for x in (a, b)]
    ref, mag = diag_reference(*[x.cpu() for x in move],
                              None if h0 is None else h0.reshape(-1, 1).cpu(), reverse)
    T = shape[dim]
    got = h.movedim(dim, -1).reshape(-1, 1, T).transpose(1, 2).cpu()
    assert_within(got, ref, mag, 2 * T + 2, torch.float32)
    # and far from wrong: the states depend on their carries (a near 1)
    assert float((ref - diag_reference(*[x.cpu() for x in move], None, not reverse)[0])
                 .abs().max()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_diagonal_scan_in_float64_and_half_precision(dev, dtype):
    a, b = data((2, 70, 3), dtype, dev, seed=1)
    h0 = torch.randn(2, 3, dtype=f64).to(dtype).to(dev)
    for reverse, chunks in ((False, None), (True, 3)):
        h = tk.diagonal_scan(a, b, h0, reverse=reverse, dim=1, block_t=16, chunks=chunks)
        assert h.dtype == dtype
        ref, mag = diag_reference(a.cpu(), b.cpu(), h0.cpu(), reverse)
        assert_within(h.cpu(), ref, mag, 2 * 70 + 2, dtype, interpreted=dev.type == "cpu")


def test_diagonal_scan_broadcasts_a_and_h0(dev):
    a, b = data((3, 4, 40), torch.float32, dev, seed=2)
    a = a[:1]                                                   # (1, 4, T) for every row
    h0 = torch.randn(4, 1).to(dev)                              # (4, 1) -> (3, 4)
    h = tk.diagonal_scan(a, b, h0[:, 0], block_t=16)
    ref, mag = diag_reference(a.expand(3, 4, 40).reshape(12, 1, 40).transpose(1, 2).cpu(),
                              b.reshape(12, 1, 40).transpose(1, 2).cpu(),
                              h0.expand(4, 1).repeat(3, 1).cpu(), False)
    assert_within(h.reshape(12, 40, 1).cpu(), ref, mag, 2 * 40 + 2, torch.float32)


def test_more_rows_than_a_grid_holds_run_in_slices(dev, monkeypatch):
    """Rows beyond CUDA's 2^31 - 1 programs on axis 0 run in several launches (tried here with
    a limit of 2 programs, and tiles of one row for the 2 x 2 kernel): the same states as one
    launch, for every kernel."""
    monkeypatch.setattr(tk, "PAIR_TILE", 8)
    g = torch.Generator().manual_seed(3)
    a, b = data((3, 1, 20), torch.float32, dev, seed=3)
    h0 = torch.randn(3, 3, generator=g).to(dev)
    A = (0.4 * torch.randn(3, 20, 2, 2, generator=g)).to(dev)
    D = (0.3 * torch.randn(3, 20, 3, 3, generator=g)).to(dev)
    bb, bd = torch.randn(3, 20, 2, generator=g).to(dev), torch.randn(3, 20, 3, generator=g).to(dev)
    gru = gru_rec(torch.float32, dev, "triton", B=3, T=10, H=3)
    x = torch.randn(3, 10, 3, generator=g).to(dev)

    def run():
        pair, dense = torch.empty_like(bb), torch.empty_like(bd)
        tk.pair_launch(A, bb, pair, h0[:, :2], True, block_t=8)       # one row per program
        tk.dense_launch(D, bd, dense, h0, False, chunks=2)
        outs = [torch.empty_like(x) for _ in range(2)]
        triton_cells.gru_newton_step(gru._gi, x, gru._h0, gru._w, gru._b, 2, *outs)
        return [tk.diagonal_scan(a, b, h0[:, :1], block_t=8, chunks=2),
                tk.diagonal_scan(bb, bb, dim=1, reverse=True), pair, dense,
                *(o[:, 2:] for o in outs)]

    whole = run()
    monkeypatch.setattr(rt, "MAX_GRID0", 2)
    for p, q in zip(run(), whole, strict=True):
        assert torch.equal(p, q)


# -- linear_recurrence(method="triton"): every form -----------------------------------------------
def forms(T, device):
    g = torch.Generator().manual_seed(3)

    def r(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g, dtype=f64)).to(device)

    return {
        "diag": (0.9 + 0.1 * torch.rand(2, T, 3, generator=g, dtype=f64).to(device), 3),
        "dense": (r(1, T, 5, 5, scale=0.4), 5),
        "pair": (r(2, T, 2, 2, scale=0.6), 2),
        "dense20": (r(2, T, 20, 20, scale=0.2), 20),
        "factored": (Factored(scale=torch.rand(2, T, 4, generator=g, dtype=f64).to(device),
                              left=r(4, 4, scale=0.5)), 4),
        "lstm": (LSTMFactored(scale=0.5 * torch.rand(2, T, 8, generator=g, dtype=f64).to(device),
                              forget=torch.rand(2, T, 2, generator=g, dtype=f64).to(device),
                              output=torch.rand(2, T, 2, generator=g, dtype=f64).to(device),
                              weight=r(8, 2), transposed=True), 4),
    }


@pytest.mark.parametrize("form", ["diag", "dense", "pair", "dense20", "factored", "lstm"])
def test_every_form_equals_the_sequential_loop_in_float64(dev, form):
    T = 23
    A, H = forms(T, dev)[form]
    g = torch.Generator().manual_seed(4)
    b = torch.randn(2, T, H, generator=g, dtype=f64).to(dev)
    h0 = torch.randn(2, H, generator=g, dtype=f64).to(dev)
    for reverse in (False, True):
        ref = linear_recurrence(A, b, h0, reverse=reverse, method="sequential")
        h = linear_recurrence(A, b, h0, reverse=reverse, method="triton")
        scale = float(ref.abs().max())
        assert float((h - ref).abs().max()) <= 1e-13 * max(1.0, scale), (form, reverse)


def test_gradients_through_the_triton_scan_equal_the_loop(dev):
    T = 19
    g = torch.Generator().manual_seed(5)
    ins = [(0.9 + 0.1 * torch.rand(2, T, 3, generator=g, dtype=f64)),
           torch.randn(2, T, 3, generator=g, dtype=f64), torch.randn(2, 3, generator=g,
                                                                     dtype=f64)]
    grads = {}
    for method in ("triton", "sequential"):
        leaves = [x.to(dev).requires_grad_() for x in ins]
        out = linear_recurrence(*leaves, reverse=True, method=method)
        grads[method] = torch.autograd.grad(out.sin().sum(), leaves)
    for x, y in zip(grads["triton"], grads["sequential"], strict=True):
        assert float((x - y).abs().max()) <= 1e-13


def dense_reference(A, b, h0, reverse):
    A, b = A.to(f64).expand(b.shape[0], *A.shape[1:]), b.to(f64)
    h, m = h0.to(f64), h0.to(f64).abs()
    out, mag = torch.empty_like(b), torch.empty_like(b)
    for t in (range(b.shape[1] - 1, -1, -1) if reverse else range(b.shape[1])):
        h = (A[:, t] @ h[..., None])[..., 0] + b[:, t]
        m = (A[:, t].abs() @ m[..., None])[..., 0] + b[:, t].abs()
        out[:, t], mag[:, t] = h, m
    return out, mag


@pytest.mark.parametrize("H, chunks, transposed, dtype", [
    (5, None, False, torch.float32), (20, 4, True, torch.float32),
    (5, 3, False, torch.float64), (20, 3, True, torch.float64)])
def test_dense_scan_within_its_bound(dev, H, chunks, transposed, dtype):
    """float64 in chunks: the chunks' matrix products by ``tl.dot`` in float64."""
    T = 21
    g = torch.Generator().manual_seed(6)
    A = (torch.randn(3, T, H, H, generator=g, dtype=f64) / H ** 0.5).to(dtype).to(dev)
    A = A.transpose(-1, -2) if transposed else A
    b = torch.randn(3, T, H, generator=g, dtype=f64).to(dtype).to(dev)
    h0 = torch.randn(3, H, generator=g, dtype=f64).to(dtype).to(dev)
    for reverse in (False, True):
        h = tk.dense_scan(A, b, h0, reverse=reverse, chunks=chunks)
        assert h.dtype == dtype
        ref, mag = dense_reference(A.cpu(), b.cpu(), h0.cpu(), reverse)
        # each step's matrix-vector product (and each chunk's matrix products): ~ (H + 2) u
        assert_within(h.cpu(), ref, mag, 2 * (T + 4) * (H + 2), dtype)


def test_pair_scan_in_chunks_and_reverse(dev):
    T = 45
    g = torch.Generator().manual_seed(7)
    A = (0.7 * torch.randn(3, T, 2, 2, generator=g)).to(dev)
    b, h0 = torch.randn(3, T, 2, generator=g).to(dev), torch.randn(3, 2, generator=g).to(dev)
    for reverse in (False, True):
        out = torch.empty_like(b)
        tk.pair_launch(A, b, out, h0, reverse, block_t=16, chunks=3)
        ref, mag = dense_reference(A.cpu(), b.cpu(), h0.cpu(), reverse)
        assert_within(out.cpu(), ref, mag, 2 * (T + 4) * 4, torch.float32)


def test_auto_picks_the_kernels_on_cuda_only(dev):
    b = torch.randn(2, 40, 3, device=dev)
    diag = canonicalise(torch.rand(2, 40, 3, device=dev), b, None)
    wide = canonicalise(torch.rand(2, 40, 65, 65, device=dev),
                                   torch.randn(2, 40, 65, device=dev), None)
    cuda = dev.type == "cuda"
    assert (rec_module.choose(diag.op, diag.b, None) == "triton") == cuda
    assert rec_module.choose(wide.op, wide.b, None) != "triton"   # H > 64: the torch tree
    if not cuda:   # the interpreter is for tests: never chosen on its own
        assert rec_module.choose(diag.op, diag.b, None) in ("native", "sequential", "blelloch")
    A = torch.rand(2, 40, 3, device=dev)
    assert (rec_module.method_for(A, b) == "triton") == cuda
    assert rec_module.method_for(A, b, method="chunked") == "chunked"


# -- the fused Newton steps -----------------------------------------------------------------------
def gru_rec(dtype, device, kernel, B=2, T=20, H=4, seed=8, bias=True):
    g = torch.Generator().manual_seed(seed)
    gi = (2 * torch.randn(B, T, 3 * H, generator=g, dtype=f64)).to(dtype).to(device)
    h0 = torch.randn(B, H, generator=g, dtype=f64).to(dtype).to(device)
    w = (2 * torch.randn(3, H, generator=g, dtype=f64)).to(dtype).to(device)
    b = torch.randn(3, H, generator=g, dtype=f64).to(dtype).to(device)
    return GRURecurrence(gi, h0, w, b if bias else None, kernel=kernel)


def lstm_rec(dtype, device, kernel, B=1, T=19, H=3, seed=9):
    g = torch.Generator().manual_seed(seed)
    gi = torch.randn(4, B, H, T, generator=g, dtype=f64).to(dtype).to(device)
    h0 = torch.randn(B, H, 2, generator=g, dtype=f64).to(dtype).to(device)
    w = (2 * torch.randn(4, H, generator=g, dtype=f64)).to(dtype).to(device)
    return LSTMRecurrence(gi, h0, w, kernel=kernel)


@pytest.mark.parametrize("cell", ["gru", "gru without bias", "lstm"])
def test_fused_step_equals_the_blocked_step(dev, cell):
    """``y = fn(x)`` and ``trial = x + delta`` at ``lo = 0`` and ``lo = 7``: float64 to
    rounding; in float32 ``y`` within 8 ulps of 1 (the cell's functions differ from torch's by
    a few ulps) and ``trial`` within that times the recurrence's gain plus the scan's bound."""
    make = {"gru": gru_rec, "lstm": lstm_rec,
            "gru without bias": lambda *a: gru_rec(*a, bias=False)}[cell]
    for dtype, tol_y in ((f64, 1e-14), (torch.float32, 8 * 2.0 ** -24)):
        ours, theirs = make(dtype, dev, "triton"), make(dtype, dev, "blocks")
        g = torch.Generator().manual_seed(10)
        x = (0.5 * torch.randn(ours.B, ours.T, ours.H, generator=g, dtype=f64)).to(dtype).to(dev)
        for lo in (0, 7):
            y, trial = (t.clone() for t in ours.newton_step(x, lo, "any"))
            y_ref, trial_ref = theirs.newton_step(x, lo, "any")
            assert ours.step_kernel == "triton" and theirs.step_kernel != "triton"
            assert float((y - y_ref).abs().max()) <= tol_y * max(1.0, float(y_ref.abs().max()))
            if dtype == torch.float32 and lo == 0:    # (the cells do differ: see below)
                assert not torch.equal(y, y_ref)
            assert float((trial - trial_ref).abs().max()) <= 1e3 * tol_y, (dtype, lo)


def test_fused_step_in_chunks_equals_one_pass(dev):
    g = torch.Generator().manual_seed(11)
    chunks = 3
    gru, lstm = gru_rec(f64, dev, "triton", T=21), lstm_rec(f64, dev, "triton", T=21)
    steps = {
        gru: lambda x, lo, out, **kw: triton_cells.gru_newton_step(
            gru._gi, x, gru._h0, gru._w, gru._b, lo, *out, **kw),
        lstm: lambda x, lo, out, **kw: triton_cells.lstm_newton_step(
            lstm._gi4, x, lstm._h0, lstm._w.view(4, -1), lo, *out, **kw),
    }
    for rec, step in steps.items():
        x = torch.randn(rec.B, rec.T, rec.H, generator=g, dtype=f64).to(dev)
        for lo in (0, 3):
            one = [torch.empty_like(x) for _ in range(2)]
            many = [torch.empty_like(x) for _ in range(2)]
            step(x, lo, one, block_t=4)
            step(x, lo, many, block_t=4, chunks=chunks)
            for p, q in zip(one, many, strict=True):
                assert float((p[:, lo:] - q[:, lo:]).abs().max()) <= 1e-13


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_newton_with_the_fused_kernel_makes_the_same_decisions(dev, cell):
    """float64: the same iterations and values as the blocked step (the iterates agree to
    rounding, far from any stopping threshold); float32: converged, within 5 tol of the loop."""
    make = gru_rec if cell == "gru" else lstm_rec
    for dtype, tol in ((f64, 1e-10), (torch.float32, 1e-5)):
        sols = {}
        for kernel in ("triton", "blocks"):
            rec = make(dtype, dev, kernel)
            sols[kernel] = paraprop.solve(rec, torch.zeros(rec.shape, dtype=dtype, device=dev),
                                          method="newton", dim=-2, tol=tol)
            assert (rec.step_kernel == "triton") == (kernel == "triton")
        loop = paraprop.solve(rec, torch.zeros(rec.shape, dtype=dtype, device=dev),
                              method="sequential", dim=-2).value
        ours, theirs = sols["triton"], sols["blocks"]
        assert ours.converged and theirs.converged
        if dtype == f64:
            assert ours.iterations == theirs.iterations
            assert float((ours.value - theirs.value).abs().max()) <= 1e-13
        assert float((ours.value - loop).abs().max()) <= 5 * tol


@pytest.mark.parametrize("cls", [ParaGRU, ParaLSTM])
def test_para_modules_run_the_fused_kernel_and_say_so(dev, cls, monkeypatch):
    if dev.type == "cpu":        # on the CPU only on request (interpreted)
        monkeypatch.setattr(para_solve, "STEP_KERNEL", "triton")
    torch.manual_seed(12)
    m = cls(3, 4, num_layers=2, batch_first=True).to(dev)
    x = torch.randn(2, 16, 3, device=dev, requires_grad=True)
    out, _ = m(x)
    (g,) = torch.autograd.grad(out.square().sum(), x)
    sols = m.last_forward
    certify = ("torch",) if dev.type == "cuda" else ("native", "torch")
    assert all(s.stats["newton_step"].startswith("triton+")
               and s.stats["newton_step"][7:] in certify for s in sols)
    assert all(0 < s.stats["triton_iterations"] < s.iterations for s in sols)
    assert all(s.converged and s.stats["triton_skipped"] is None for s in sols)
    assert len(sols) == 2
    m.forward_config = "sequential"
    ref, _ = m(x)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
    assert float((out - ref).detach().abs().max()) <= 5e-5
    assert float((g - g_ref).abs().max()) <= 1e-4 * max(1.0, float(g_ref.abs().max()))


def test_para_modules_on_the_cpu_keep_the_blocked_step(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")     # even then: never picked on its own
    m = ParaGRU(3, 4)
    m(torch.randn(10, 2, 3))
    (sol,) = m.last_forward
    assert sol.stats["newton_step"] in ("native", "torch")
    assert sol.stats["triton_iterations"] == 0
    assert sol.stats["triton_skipped"] is None


@pytest.mark.parametrize("cls, dtype", [(ParaGRU, torch.float32), (ParaGRU, torch.float64),
                                        (ParaLSTM, torch.float32)])
def test_the_triton_step_is_a_warm_start_certified_by_the_torch_cell(cls, dtype, monkeypatch):
    """The Triton cell (interpreted here; its exp and tanh differ from torch's by rounding, as
    the compiled one's do) only brings the iterate close: the torch cell's step certifies. At
    tol=0 the result is the module's own loop bitwise (B H = 32, see
    test_nn_para.test_newton_at_tol_0_is_the_loop_bitwise); for tol > 0 within tol of it.
    (With the Triton step certifying, as before, tol=0 stopped at the Triton cell's fixed
    point, ulps away from the loop.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(para_solve, "STEP_KERNEL", "triton")
    torch.manual_seed(13)
    x = torch.randn(2, 12, 3, dtype=dtype)
    for tol in (0.0, 1e-5 if dtype == torch.float32 else 1e-10):
        m = cls(3, 16, batch_first=True, dtype=dtype, forward=ParallelForward(tol=tol))
        with torch.no_grad():
            out, hn = m(x)
            (sol,) = m.last_forward
            m.forward_config = "sequential"
            ref, r_hn = m(x)
        assert sol.converged and sol.stats["error_estimate"] <= tol
        assert sol.stats["newton_step"] in ("triton+native", "triton+torch")
        assert 0 < sol.stats["triton_iterations"] < sol.iterations
        assert len(sol.residuals) == sol.iterations       # both solves' measures
        if tol == 0:
            assert torch.equal(out, ref)
            for a, b in zip(hn if isinstance(hn, tuple) else (hn,),
                            r_hn if isinstance(r_hn, tuple) else (r_hn,), strict=True):
                assert torch.equal(a, b)
        else:
            assert float((out - ref).abs().max()) <= tol


def test_max_iters_bounds_the_warm_start_and_the_certifying_solve(monkeypatch):
    """``max_iters`` counts the Triton iterations too (plus the one certifying evaluation);
    not converged within it, the torch step says so (converged False, or ConvergenceError)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(para_solve, "STEP_KERNEL", "triton")
    torch.manual_seed(14)
    x = torch.randn(2, 12, 3)
    m = ParaGRU(3, 16, batch_first=True,
                forward=ParallelForward(tol=0.0, max_iters=3, throw=False))
    with torch.no_grad():
        m(x)
    (sol,) = m.last_forward
    assert sol.stats["triton_iterations"] == 3 and sol.iterations == 4
    assert not sol.converged
    m.forward_config = ParallelForward(tol=0.0, max_iters=3)
    with pytest.raises(paraprop.ConvergenceError), torch.no_grad():
        m(x)


# -- errors and the missing-triton path -----------------------------------------------------------
def test_errors_name_the_argument(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    z = torch.zeros(2, 3, 5)
    cases = [
        (lambda: tk.diagonal_scan(z, z.long()), TypeError,
         r"diagonal_scan: b must be float16, bfloat16, float32 or float64, got b of dtype "
         r"torch.int64"),
        (lambda: tk.dense_scan(z[None], z.int()), TypeError,
         r"dense_scan: b must be .* got b of dtype torch.int32"),
        (lambda: tk.diagonal_scan(z.double(), z), TypeError, r"a has dtype torch.float64"),
        (lambda: tk.diagonal_scan([1.0], z), TypeError, r"a must be a torch.Tensor"),
        (lambda: tk.diagonal_scan(torch.zeros(4, 5), z), ValueError, r"does not broadcast"),
        (lambda: tk.diagonal_scan(z, z, torch.zeros(2, 5)), ValueError,
         r"h0 must have b's shape without dim 2, \(2, 3\)"),
        (lambda: tk.diagonal_scan(z, z, dim=3), ValueError, r"dim must be an int in \[-3, 2\]"),
        (lambda: tk.diagonal_scan(z, z, block_t=0), ValueError, r"block_t must be a positive"),
        (lambda: tk.diagonal_scan(z, z, reverse=1), TypeError, r"reverse must be a bool"),
        (lambda: tk.dense_scan(torch.zeros(1, 3, 65, 65), torch.zeros(2, 3, 65)), ValueError,
         r"dense_scan takes H <= 64, got H=65"),
        (lambda: tk.dense_scan(torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4)), ValueError,
         r"A must have shape \(N or 1, T, H, H\)"),
        (lambda: tk.dense_scan(torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 4), chunks=0),
         ValueError, r"chunks must be a positive int"),
        (lambda: linear_recurrence(torch.zeros(2, 3, 65, 65), torch.zeros(2, 3, 65),
                                   method="triton"), ValueError,
         r"method='triton' runs dense transitions with a state of at most 64"),
        (lambda: GRURecurrence(torch.zeros(1, 3, 6), torch.zeros(1, 2), torch.zeros(3, 2), None,
                               kernel="cuda"), ValueError, r"unknown kernel='cuda'"),
        (lambda: GRURecurrence(None, torch.zeros(1, 2), torch.zeros(3, 2), None,
                               inputs=(torch.zeros(1, 3, 1), torch.zeros(6, 1), None),
                               kernel="triton").newton_step(torch.zeros(1, 3, 2), 0, "any"),
         ValueError, r"kernel='triton'\) needs the input terms gi"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_errors_name_the_tensor_on_the_wrong_device_and_the_strides(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    z, m = torch.zeros(2, 3, 5), torch.zeros(2, 3, 5, device="meta")
    with pytest.raises(RuntimeError, match=r"diagonal_scan cannot run here: a is on meta but b "
                                           r"is on cpu; use one device"):
        tk.diagonal_scan(m, z)
    with pytest.raises(RuntimeError, match=r"h0 is on meta but b is on cpu"):
        tk.diagonal_scan(z, z, torch.zeros(2, 3, device="meta"))
    with pytest.raises(RuntimeError, match=r"the Triton kernels run on CUDA tensors, not on "
                                           r"meta \(b\)"):
        tk.diagonal_scan(m, m)
    with pytest.raises(RuntimeError, match=r"dense_scan cannot run here: A is on meta but b"):
        tk.dense_scan(torch.zeros(1, 3, 5, 5, device="meta"), z)
    assert rt.why_not(x=z, y=z.long()) == ("the Triton kernels take float16, bfloat16, float32 "
                                           "or float64; y has dtype torch.int64")
    # the fused steps: y and trial must share strides, both shown
    gru, lstm = gru_rec(torch.float32, "cpu", "triton"), lstm_rec(torch.float32, "cpu", "triton")
    x = torch.zeros(gru.B, gru.T, gru.H)
    with pytest.raises(ValueError, match=r"gru_newton_step: y and trial must have the same "
                                         r"strides, got y \(80, 4, 1\) and trial \(4, 8, 1\)"):
        triton_cells.gru_newton_step(gru._gi, x, gru._h0, gru._w, gru._b, 0, torch.empty_like(x),
                                     torch.empty(gru.T, gru.B, gru.H).transpose(0, 1))
    s = torch.zeros(lstm.B, lstm.T, 2)
    with pytest.raises(ValueError, match=r"lstm_newton_step: y and trial must have the same "
                                         r"strides, got y \(38, 2, 1\) and trial \(2, 6, 1\)"):
        triton_cells.lstm_newton_step(lstm._gi4, s, lstm._h0, lstm._w.view(4, -1), 0,
                                      torch.empty_like(s),
                                      torch.empty(lstm.T, lstm.B, 2).transpose(0, 1))


class FakeCuda:
    """Stands for a CUDA tensor where there is no GPU: the checks read only these."""

    def __init__(self, dtype=torch.float32):
        self.device, self.dtype = torch.device("cuda", 0), dtype


def test_cuda_tensors_are_refused_while_the_interpreter_is_on(monkeypatch):
    """With TRITON_INTERPRET set the kernels would run on the host: CUDA tensors are refused,
    auto runs the torch methods, ParaGRU/ParaLSTM skip the warm start, and both say why."""
    for value in ("1", "true", "ON"):                       # as triton reads the variable
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert rt.interpreting()
        reason = rt.why_not(b=FakeCuda())
        assert reason == rt.INTERPRETER_ON_CUDA and "unset TRITON_INTERPRET" in reason
        assert "CUDA tensors refused (TRITON_INTERPRET is set" in rt.status()
    op = types.SimpleNamespace(kind="diag", a=FakeCuda(), H=3)
    assert not tk.applies(op, FakeCuda())
    with pytest.raises(RuntimeError, match=r"linear_recurrence\(method='triton'\) cannot run "
                                           r"here: TRITON_INTERPRET is set"):
        tk.recurrence(op, FakeCuda(), None, False)
    rec = types.SimpleNamespace(device=torch.device("cuda", 0), formed=True, _h0=FakeCuda(),
                                fused_forms=("any", "diag"))
    newton = paraprop.solvers.Newton()
    assert para_solve.triton_warm_start(newton, rec) == (False, rt.INTERPRETER_ON_CUDA)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert rt.why_not(b=FakeCuda()) is None and "CUDA tensors compiled" in rt.status()
    assert para_solve.triton_warm_start(newton, rec) == (True, None)
    assert para_solve.triton_warm_start(paraprop.solvers.ELK(), rec)[0] is False
    monkeypatch.setattr(para_solve, "STEP_KERNEL", "blocks")
    assert para_solve.triton_warm_start(newton, rec) == (False, "STEP_KERNEL='blocks'")


def test_the_loader_runs_each_module_once_per_mode_under_a_lock(monkeypatch):
    """Threads loading at once get one module per mode (the mode switch is process-wide)."""
    monkeypatch.setattr(rt, "_loaded", {})
    got, start = [], threading.Barrier(4)

    def load():
        start.wait()
        got.append(rt.load_mode("paraprop.scan._triton_scan", True))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(m is got[0] for m in got) and got[0].INTERPRETED
    cells = rt.load_mode("paraprop.nn._triton_cells", True)
    assert cells._scan is got[0] and cells._diag_block is got[0]._diag_block   # shared helpers
    compiled = rt.load_mode("paraprop.nn._triton_cells", False)
    assert not compiled.INTERPRETED and compiled._scan is rt.load_mode(
        "paraprop.scan._triton_scan", False)
    # while a load forces the switch, the user's setting is what the checks see
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with rt._lock, rt._mode(True):
        assert os.environ["TRITON_INTERPRET"] == "1" and rt.loading_mode()
        assert not rt.interpreting()
    assert "TRITON_INTERPRET" not in os.environ and not rt.loading_mode()


def test_cpu_tensors_need_the_interpreter_switch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    z = torch.zeros(2, 3, 5)
    with pytest.raises(RuntimeError, match=r"diagonal_scan cannot run here: .*TRITON_INTERPRET=1"):
        tk.diagonal_scan(z, z)
    with pytest.raises(RuntimeError, match=r"linear_recurrence\(method='triton'\) cannot run"):
        linear_recurrence(z, z, method="triton")
    rec = GRURecurrence(torch.zeros(1, 3, 6), torch.zeros(1, 2), torch.zeros(3, 2), None,
                        kernel="triton")
    with pytest.raises(RuntimeError, match=r"GRURecurrence\(kernel='triton'\) cannot run here"):
        rec.newton_step(torch.zeros(1, 3, 2), 0, "any")
    assert "refused" in rt.status()


def test_without_triton_everything_says_why(monkeypatch):
    monkeypatch.setattr(rt, "_missing", ["triton is not installed (no module named 'triton')"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    z = torch.zeros(2, 3, 5)
    assert not rt.available() and rt.status().startswith("unavailable: triton is not installed")
    with pytest.raises(RuntimeError, match=r"cannot run here: triton is not installed"):
        linear_recurrence(z, z, method="triton")
    assert linear_recurrence(z, z).shape == z.shape                  # auto: unaffected


class Broken:
    """A kernel module whose every launch fails, as a kernel this triton cannot compile."""

    def __init__(self, real):
        self.tl = real.tl

    def __getattr__(self, name):
        class Grid:
            def __getitem__(self, grid):
                def launch(*args, **meta):
                    raise RuntimeError("PTX assembly aborted (a test)")
                return launch
        return Grid()


def test_the_newton_steps_refuse_outputs_of_different_strides():
    """One set of strides addresses ``y`` and ``trial``: the fused steps refuse two layouts
    (before any kernel is loaded), and return at once when there is nothing to compute."""
    y, trial = torch.zeros(2, 6, 3), torch.zeros(2, 3, 6).transpose(1, 2)
    with pytest.raises(ValueError, match=r"gru_newton_step: y and trial must have the same "
                       r"strides, got y \(18, 3, 1\) and trial \(18, 1, 6\)"):
        triton_cells.gru_newton_step(torch.zeros(2, 6, 3, 3), y, torch.zeros(2, 3),
                                     torch.zeros(3, 3), None, 0, y, trial)
    y, trial = torch.zeros(6, 4, 2), torch.zeros(6, 2, 4).transpose(1, 2)
    with pytest.raises(ValueError, match=r"lstm_newton_step: y and trial must have the same "
                       r"strides"):
        triton_cells.lstm_newton_step(torch.zeros(4, 2, 3, 4), y, torch.zeros(6, 2),
                                      torch.zeros(4, 3), 0, y, trial)
    # lo == T: no position left, nothing is checked or launched
    triton_cells.gru_newton_step(torch.zeros(2, 6, 3, 3), y, torch.zeros(2, 3),
                                 torch.zeros(3, 3), None, 4, y, trial)


def test_a_failing_kernel_is_recorded_and_auto_falls_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(rt, "_failed", [])
    real = rt.load
    monkeypatch.setattr(rt, "load", lambda source, device: Broken(real(source, device)))
    a, b = data((2, 20, 3), torch.float64, "cpu")
    with pytest.warns(RuntimeWarning, match=r"diag_scan failed: RuntimeError: PTX assembly"):
        with pytest.raises(rt.LaunchError, match=r"diag_scan failed"):
            linear_recurrence(a, b, method="triton")      # asked for: raises
    assert "auto avoids them: diag_scan failed" in rt.status()
    # auto would pick the kernels (as on CUDA, where the C kernels never run) but they failed:
    # it runs another method
    monkeypatch.setattr(rt, "_failed", [])
    monkeypatch.setattr(tk, "applies", lambda op, b: not rt.failed())
    monkeypatch.setattr(rec_module.native, "supports", lambda *tensors: False)
    with pytest.warns(RuntimeWarning, match="uses the torch methods from now on"):
        h = linear_recurrence(a, b)
    ref = linear_recurrence(a, b, method="sequential")
    assert float((h - ref).abs().max()) <= 1e-13
    # the layers' warm start (as picked by default on CUDA) is skipped: the torch step alone,
    # and the stats say why; asked for (STEP_KERNEL="triton"), the failure raises
    monkeypatch.setattr(rt, "_failed", [])
    monkeypatch.setattr(para_solve, "triton_warm_start", lambda solver, rec: (True, None))
    torch.manual_seed(15)
    m = ParaGRU(5, 4, forward=ParallelForward(tol=1e-12), dtype=f64)      # gi stored
    x = torch.randn(9, 2, 5, dtype=f64)
    with pytest.warns(RuntimeWarning, match="gru_step failed"), torch.no_grad():
        out, _ = m(x)
    (sol,) = m.last_forward
    assert sol.stats["triton_skipped"].startswith("gru_step failed: RuntimeError: PTX assembly")
    assert sol.stats["newton_step"] in ("native", "torch")
    assert sol.stats["triton_iterations"] == 0
    m.forward_config = "sequential"
    with torch.no_grad():
        ref, _ = m(x)
    assert sol.converged and float((out - ref).abs().max()) <= 1e-12
    monkeypatch.setattr(para_solve, "STEP_KERNEL", "triton")
    m.forward_config = ParallelForward(tol=1e-12)
    with pytest.raises(rt.LaunchError, match="gru_step failed"), torch.no_grad():
        m(x)
    with pytest.raises(rt.LaunchError, match="gru_step failed"):
        rec = gru_rec(f64, torch.device("cpu"), "triton")
        rec.newton_step(torch.zeros(rec.B, rec.T, rec.H, dtype=f64), 0, "any")


def test_only_the_kernel_sources_import_triton_and_only_the_loader_runs_them():
    """``import paraprop`` never imports triton: no module imports it at the top but the two
    kernel sources, and no module imports those (only ``triton_kernels.load`` runs them)."""
    root = Path(paraprop.__file__).parent
    sources = {"scan/_triton_scan.py", "nn/_triton_cells.py"}
    for path in root.rglob("*.py"):
        rel, text = path.relative_to(root).as_posix(), path.read_text()
        if "triton" not in text:
            continue
        tree = ast.parse(text)
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom | ast.Try)]
        names = {a.name for n in top for m in ([n] if not isinstance(n, ast.Try) else n.body)
                 if isinstance(m, ast.Import | ast.ImportFrom)
                 for a in (m.names if isinstance(m, ast.Import) else [ast.alias(m.module or "")])}
        assert rel in sources or not any(x.split(".")[0] == "triton" for x in names), rel
        assert "import _triton_scan" not in text and "import _triton_cells" not in text, rel
        assert ("_triton_scan import" not in text and "_triton_cells import" not in text), rel
