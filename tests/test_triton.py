"""The Triton kernels (paraprop.scan.triton_kernels, paraprop.nn.triton_cells) against the
sequential reference: compiled on a CUDA device where there is one, in Triton's interpreter on
the CPU (``TRITON_INTERPRET=1``, set per test whatever the shell says; sizes kept tiny, the
interpreter runs every program in Python).

The bound for the scans (docs/scan.md): a tree scan groups the products and sums of
``h_t = sum_s (a_{s+1} ... a_t) b_s`` differently from the loop, so every state is within
``k u M_t`` of the exact value, ``M_t`` the same sum of absolute values, ``u`` the
accumulation's unit roundoff and ``k`` a small multiple of ``T`` (below), plus half an ulp of the
output's dtype. The data make every carry matter (multipliers near 1, a non-zero ``h0``), so a
wrong carry is far outside the bound.
"""

import ast
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import paraprop  # noqa: E402
from paraprop.nn import ParaGRU, ParaLSTM, para_layers, triton_cells  # noqa: E402
from paraprop.nn.para_layers import GRURecurrence, LSTMRecurrence  # noqa: E402
from paraprop.scan import Factored, LSTMFactored, linear_recurrence  # noqa: E402
from paraprop.scan import recurrence as rec_module  # noqa: E402
from paraprop.scan import triton_kernels as tk  # noqa: E402

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
    """``|h - ref| <= k u M + u_out (|ref| + k u M)``, elementwise. (Triton's interpreter
    truncates float32 to bfloat16 where the compiled kernels round to nearest: one ulp instead
    of half.)"""
    acc = k * ACC_UNIT[dtype] * mag
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
    assert_within(got, ref, mag, 3 * T + 2, torch.float32)
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
        assert_within(h.cpu(), ref, mag, 3 * 70 + 2, dtype, interpreted=dev.type == "cpu")


def test_diagonal_scan_broadcasts_a_and_h0(dev):
    a, b = data((3, 4, 40), torch.float32, dev, seed=2)
    a = a[:1]                                                   # (1, 4, T) for every row
    h0 = torch.randn(4, 1).to(dev)                              # (4, 1) -> (3, 4)
    h = tk.diagonal_scan(a, b, h0[:, 0], block_t=16)
    ref, mag = diag_reference(a.expand(3, 4, 40).reshape(12, 1, 40).transpose(1, 2).cpu(),
                              b.reshape(12, 1, 40).transpose(1, 2).cpu(),
                              h0.expand(4, 1).repeat(3, 1).cpu(), False)
    assert_within(h.reshape(12, 40, 1).cpu(), ref, mag, 3 * 40 + 2, torch.float32)


# -- linear_recurrence(algorithm="triton"): every form --------------------------------------------
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
        ref = linear_recurrence(A, b, h0, reverse=reverse, algorithm="sequential", native=False)
        h = linear_recurrence(A, b, h0, reverse=reverse, algorithm="triton")
        scale = float(ref.abs().max())
        assert float((h - ref).abs().max()) <= 1e-13 * max(1.0, scale), (form, reverse)


def test_gradients_through_the_triton_scan_equal_the_loop(dev):
    T = 19
    g = torch.Generator().manual_seed(5)
    ins = [(0.9 + 0.1 * torch.rand(2, T, 3, generator=g, dtype=f64)),
           torch.randn(2, T, 3, generator=g, dtype=f64), torch.randn(2, 3, generator=g,
                                                                     dtype=f64)]
    grads = {}
    for algorithm in ("triton", "sequential"):
        leaves = [x.to(dev).requires_grad_() for x in ins]
        out = linear_recurrence(*leaves, reverse=True, algorithm=algorithm)
        grads[algorithm] = torch.autograd.grad(out.sin().sum(), leaves)
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


@pytest.mark.parametrize("H, chunks, transposed", [(5, None, False), (20, 4, True)])
def test_dense_scan_within_its_bound(dev, H, chunks, transposed):
    T = 21
    g = torch.Generator().manual_seed(6)
    A = (torch.randn(3, T, H, H, generator=g) / H ** 0.5).to(dev)
    A = A.transpose(-1, -2) if transposed else A
    b, h0 = torch.randn(3, T, H, generator=g).to(dev), torch.randn(3, H, generator=g).to(dev)
    for reverse in (False, True):
        h = tk.dense_scan(A, b, h0, reverse=reverse, chunks=chunks)
        ref, mag = dense_reference(A.cpu(), b.cpu(), h0.cpu(), reverse)
        # each step's matrix-vector product (and each chunk's matrix products): ~ (H + 2) u
        assert_within(h.cpu(), ref, mag, 2 * (T + 4) * (H + 2), torch.float32)


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
    diag = rec_module.canonicalise(torch.rand(2, 40, 3, device=dev), b, None)
    wide = rec_module.canonicalise(torch.rand(2, 40, 65, 65, device=dev),
                                   torch.randn(2, 40, 65, device=dev), None)
    cuda = dev.type == "cuda"
    assert (rec_module.choose(diag.op, diag.b, None) == "triton") == cuda
    assert rec_module.choose(wide.op, wide.b, None) != "triton"   # H > 64: the torch tree
    if not cuda:   # the interpreter is for tests: never chosen on its own
        assert rec_module.choose(diag.op, diag.b, None) in ("sequential", "blelloch")
    A = torch.rand(2, 40, 3, device=dev)
    assert (rec_module.algorithm_for(A, b) == "triton") == cuda
    assert rec_module.algorithm_for(A, b, algorithm="chunked") == "chunked"


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
        monkeypatch.setattr(para_layers, "STEP_KERNEL", "triton")
    torch.manual_seed(12)
    m = cls(3, 4, num_layers=2, batch_first=True).to(dev)
    x = torch.randn(2, 16, 3, device=dev, requires_grad=True)
    out, _ = m(x)
    (g,) = torch.autograd.grad(out.square().sum(), x)
    assert m.forward_stats["newton_step"] == ["triton", "triton"]
    assert all(m.forward_stats["converged"])
    m.forward_config = "sequential"
    ref, _ = m(x)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
    assert float((out - ref).detach().abs().max()) <= 5e-5
    assert float((g - g_ref).abs().max()) <= 1e-4 * max(1.0, float(g_ref.abs().max()))


def test_para_modules_on_the_cpu_keep_the_blocked_step(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")     # even then: never picked on its own
    m = ParaGRU(3, 4)
    m(torch.randn(10, 2, 3))
    assert m.forward_stats["newton_step"][0] in ("native", "torch")


# -- errors and the missing-triton path -----------------------------------------------------------
def test_errors_name_the_argument(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    z = torch.zeros(2, 3, 5)
    cases = [
        (lambda: tk.diagonal_scan(z, z.long()), TypeError, r"float16, bfloat16, float32"),
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
                                   algorithm="triton"), ValueError,
         r"algorithm='triton' runs dense transitions with a state of at most 64"),
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


def test_cpu_tensors_need_the_interpreter_switch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    z = torch.zeros(2, 3, 5)
    with pytest.raises(RuntimeError, match=r"diagonal_scan cannot run here: .*TRITON_INTERPRET=1"):
        tk.diagonal_scan(z, z)
    with pytest.raises(RuntimeError, match=r"linear_recurrence\(algorithm='triton'\) cannot run"):
        linear_recurrence(z, z, algorithm="triton")
    rec = GRURecurrence(torch.zeros(1, 3, 6), torch.zeros(1, 2), torch.zeros(3, 2), None,
                        kernel="triton")
    with pytest.raises(RuntimeError, match=r"GRURecurrence\(kernel='triton'\) cannot run here"):
        rec.newton_step(torch.zeros(1, 3, 2), 0, "any")
    assert "refused" in tk.status()


def test_without_triton_everything_says_why(monkeypatch):
    monkeypatch.setattr(tk, "_missing", ["triton is not installed (no module named 'triton')"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    z = torch.zeros(2, 3, 5)
    assert not tk.available() and tk.status().startswith("unavailable: triton is not installed")
    with pytest.raises(RuntimeError, match=r"cannot run here: triton is not installed"):
        linear_recurrence(z, z, algorithm="triton")
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


def test_a_failing_kernel_is_recorded_and_auto_falls_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tk, "_failed", [])
    real = tk.load
    monkeypatch.setattr(tk, "load", lambda source, device: Broken(real(source, device)))
    a, b = data((2, 20, 3), torch.float64, "cpu")
    with pytest.warns(RuntimeWarning, match=r"diag_scan failed: RuntimeError: PTX assembly"):
        with pytest.raises(tk.LaunchError, match=r"diag_scan failed"):
            linear_recurrence(a, b, algorithm="triton")      # asked for: raises
    assert "auto avoids them: diag_scan failed" in tk.status()
    # auto would pick the kernels (as on CUDA) but they failed: it runs another algorithm
    monkeypatch.setattr(tk, "_failed", [])
    monkeypatch.setattr(tk, "applies", lambda op, b: not tk.failed())
    with pytest.warns(RuntimeWarning, match="uses the torch algorithms from now on"):
        h = linear_recurrence(a, b, native=False)
    ref = linear_recurrence(a, b, algorithm="sequential", native=False)
    assert float((h - ref).abs().max()) <= 1e-13
    # the fused Newton step picked by default falls back to the blocked step; asked for, raises
    monkeypatch.setattr(tk, "_failed", [])
    rec = gru_rec(f64, torch.device("cpu"), None)
    monkeypatch.setattr(rec, "_step_kernel", lambda xc, formed: "triton")
    x = torch.zeros(rec.B, rec.T, rec.H, dtype=f64)
    with pytest.warns(RuntimeWarning, match="gru_step failed"):
        y, _ = rec.newton_step(x, 0, "any")
    assert rec.step_kernel in ("native", "torch")
    y_ref, _ = gru_rec(f64, torch.device("cpu"), "blocks").newton_step(x, 0, "any")
    assert torch.equal(y, y_ref)
    with pytest.raises(tk.LaunchError, match="gru_step failed"):
        gru_rec(f64, torch.device("cpu"), "triton").newton_step(x, 0, "any")


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
