"""paraprop.scan.LSTMFactored: the LSTM Jacobians on [h; c] (and their transposes) as a
transition form of linear_recurrence, against the dense recurrence it stands for."""

import pytest
import torch

from paraprop.jacobians.cells import dense_jacobian
from paraprop.scan import LSTMFactored, jacobi_recurrence, linear_recurrence, native

LENGTHS = [1, 2, 3, 7, 31, 33]
TORCH_METHODS = ["sequential", "blelloch", "hillis_steele", "chunked", "auto"]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
HAVE_NATIVE = native.available()


def make(N, T, Hc, dtype=torch.float64, seed=0, transposed=False, batch_one=()):
    """A random LSTMFactored (``batch_one``: the per-step tensors broadcast over the batch),
    ``b`` and ``h0``."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, positive=False):
        x = torch.rand(*shape, generator=g, dtype=torch.float64) if positive else \
            torch.randn(*shape, generator=g, dtype=torch.float64)
        return (x * scale).to(dtype)

    n = {name: 1 if name in batch_one else N for name in ("scale", "forget", "output")}
    A = LSTMFactored(scale=r(n["scale"], T, 4 * Hc, scale=0.4),
                     forget=r(n["forget"], T, Hc, positive=True),
                     output=r(n["output"], T, Hc, positive=True),
                     weight=r(4 * Hc, Hc, scale=0.6 / Hc**0.5), transposed=transposed)
    return A, r(N, T, 2 * Hc), r(N, 2 * Hc)


def dense(A):
    """The matrices written out from the definition (not from the code under test)."""
    s, f, k, W = A.scale, A.forget, A.output, A.weight
    Hc = f.shape[-1]
    batch = torch.broadcast_shapes(s.shape[:-1], f.shape[:-1], k.shape[:-1])
    s, f, k = s.expand(*batch, 4 * Hc), f.expand(*batch, Hc), k.expand(*batch, Hc)
    blocks = [s[..., j * Hc:(j + 1) * Hc, None] * W[j * Hc:(j + 1) * Hc] for j in range(4)]
    P = blocks[0] + blocks[1] + blocks[2]
    top = torch.cat([k[..., None] * P + blocks[3], torch.diag_embed(k * f)], -1)
    bottom = torch.cat([P, torch.diag_embed(f)], -1)
    J = torch.cat([top, bottom], -2)
    return J.transpose(-1, -2) if A.transposed else J


def loop(J, b, h0, reverse):
    T = b.shape[-2]
    h = torch.zeros_like(b[..., 0, :]) if h0 is None else h0
    out = [None] * T
    for t in (range(T - 1, -1, -1) if reverse else range(T)):
        h = (J[..., t, :, :] @ h.unsqueeze(-1)).squeeze(-1) + b[..., t, :]
        out[t] = h
    return torch.stack(out, -2)


def rel_err(x, ref):
    x, ref = x.cpu(), ref.cpu()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def on(A, device):
    return LSTMFactored(A.scale.to(device), A.forget.to(device), A.output.to(device),
                        A.weight.to(device), A.transposed)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("reverse", [False, True])
def test_every_method_equals_the_dense_loop(transposed, T, reverse, device):
    A, b, h0 = make(3, T, 4, transposed=transposed)
    J = dense(A).expand(3, T, 8, 8)
    refs = {start is None: loop(J, b, start, reverse) for start in (h0, None)}
    A, b, h0 = on(A, device), b.to(device), h0.to(device)
    # the C kernels on the CPU, the Triton kernels on CUDA (on the CPU: interpreted,
    # tests/test_triton.py)
    extra = (["native"] if device.type == "cpu" and HAVE_NATIVE else []) + (
        ["triton"] if device.type == "cuda" else [])
    for start in (h0, None):
        ref = refs[start is None]
        for method in TORCH_METHODS + extra:
            h = linear_recurrence(A, b, start, reverse=reverse, method=method)
            assert rel_err(h, ref) <= TOL[torch.float64], method
    for chunk in (1, 2, 5, T):
        h = linear_recurrence(A, b, h0, reverse=reverse, method="chunked", chunk_size=chunk)
        assert rel_err(h, refs[False]) <= TOL[torch.float64], chunk
    h = linear_recurrence(A, b, h0, reverse=reverse, method="blelloch", levels=1)
    assert rel_err(h, refs[False]) <= TOL[torch.float64]


def test_dense_jacobian_and_the_transpose():
    A, _, _ = make(2, 5, 3)
    assert rel_err(dense_jacobian(A), dense(A)) <= 1e-15
    At = LSTMFactored(A.scale, A.forget, A.output, A.weight, transposed=True)
    assert torch.equal(dense_jacobian(At), dense_jacobian(A).transpose(-1, -2))


def test_broadcast_per_step_tensors_and_batch_dims():
    A, b, h0 = make(3, 20, 4, batch_one=("scale", "output"), transposed=True)
    ref = loop(dense(A).expand(3, 20, 8, 8), b, h0, True)
    for method in ("auto", "sequential"):
        assert rel_err(linear_recurrence(A, b, h0, reverse=True, method=method),
                       ref) <= TOL[torch.float64]
    # extra batch dims, written out
    A2 = LSTMFactored(A.scale[None].expand(2, 1, 20, 16), A.forget[None].expand(2, 3, 20, 4),
                      A.output[None], A.weight, transposed=True)
    b2 = torch.stack([b, 2 * b])
    h = linear_recurrence(A2, b2, h0, reverse=True)
    assert h.shape == (2, 3, 20, 8)
    assert rel_err(h[1], 2 * linear_recurrence(A, b, h0 / 2, reverse=True)) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_float64(dtype, device):
    A, b, h0 = make(4, 200, 6, transposed=True)
    ref = loop(dense(A).expand(4, 200, 12, 12), b, h0, True)
    low = LSTMFactored(*(t.to(dtype).to(device) for t in (A.scale, A.forget, A.output,
                                                         A.weight)), transposed=True)
    for method in ("auto", "chunked"):
        h = linear_recurrence(low, b.to(dtype).to(device), h0.to(dtype).to(device),
                              reverse=True, method=method)
        assert h.dtype == dtype and rel_err(h.double(), ref) <= TOL[dtype]


@pytest.mark.skipif(not HAVE_NATIVE, reason=f"native kernels unavailable: {native.status()}")
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Hc", [3, 64])
def test_native_kernel_equals_torch_loop_on_strided_layouts(transposed, dtype, Hc):
    # time-major memory as paraprop.nn passes it; Hc = 64 with 5 x 40 rows uses a kernel
    # specialised for the size
    A, b, h0 = make(5, 40, Hc, dtype=dtype, transposed=transposed)
    tm = LSTMFactored(*(t.transpose(0, 1).contiguous().transpose(0, 1)
                        for t in (A.scale, A.forget, A.output)), A.weight, transposed)
    b_tm = b.transpose(0, 1).contiguous().transpose(0, 1)
    for reverse in (False, True):
        ref = linear_recurrence(A, b, h0, reverse=reverse, method="sequential")
        for AA, bb in ((A, b), (tm, b_tm)):
            h = linear_recurrence(AA, bb, h0, reverse=reverse, method="native")
            assert rel_err(h.double(), ref.double()) <= TOL[dtype]
            assert h.stride() == bb.stride()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_gradcheck(transposed, reverse):
    A, b, h0 = make(2, 6, 3, seed=1, transposed=transposed, batch_one=("output",))
    xs = [t.clone().requires_grad_() for t in (A.scale, A.forget, A.output, A.weight, b, h0)]

    def f(s, fg, k, W, bb, h):
        return linear_recurrence(LSTMFactored(s, fg, k, W, transposed), bb, h, reverse=reverse)

    assert torch.autograd.gradcheck(f, xs)


def test_jacobi_recurrence_is_exact_after_T_sweeps():
    A, b, h0 = make(2, 12, 3, transposed=True)
    ref = linear_recurrence(A, b, h0, reverse=True)
    sol = jacobi_recurrence(A, b, h0, reverse=True)
    assert sol.converged and sol.iterations <= 12
    assert rel_err(sol.value, ref) <= 1e-12


def _A(**kw):
    t = {"scale": torch.zeros(2, 5, 16), "forget": torch.zeros(2, 5, 4),
         "output": torch.zeros(2, 5, 4), "weight": torch.zeros(16, 4)}
    t.update(kw)
    return LSTMFactored(**t)


@pytest.mark.parametrize("A,b,exc,match", [
    (_A(), torch.zeros(2, 5, 7), ValueError, r"even size H = 2 \* hidden, got \(2, 5, 7\)"),
    (_A(weight=torch.zeros(4, 16)), torch.zeros(2, 5, 8), ValueError,
     r"A.weight must have shape \(4 \* hidden, hidden\) = \(16, 4\) .* got \(4, 16\)"),
    (_A(scale=torch.zeros(2, 5, 12)), torch.zeros(2, 5, 8), ValueError,
     r"A.scale must have shape \(..., T, 16\) with T=5 .* got \(2, 5, 12\)"),
    (_A(forget=torch.zeros(2, 4, 4)), torch.zeros(2, 5, 8), ValueError,
     r"A.forget must have shape \(..., T, 4\) with T=5"),
    (_A(output=torch.zeros(5, 4)), torch.zeros(2, 5, 8), ValueError,
     r"A.output must have shape \(..., T, 4\) with T=5 and as many dims as b"),
    (_A(forget=None), torch.zeros(2, 5, 8), TypeError,
     "LSTMFactored needs scale, forget, output and weight"),
    (_A(transposed=1), torch.zeros(2, 5, 8), TypeError, "A.transposed must be"),
    (_A(weight=torch.zeros(16, 4, dtype=torch.float64)), torch.zeros(2, 5, 8), TypeError,
     "A.weight has dtype torch.float64 but b has torch.float32"),
    (_A(scale=torch.zeros(3, 5, 16)), torch.zeros(2, 5, 8), ValueError, "do not broadcast"),
])
def test_errors(A, b, exc, match):
    with pytest.raises(exc, match=match):
        linear_recurrence(A, b)
