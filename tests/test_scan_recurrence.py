"""linear_recurrence: every method equals the plain loop; gradients equal finite differences."""

import pytest
import torch

import paraprop
from paraprop.scan import (
    METHODS,
    Factored,
    associative_scan,
    jacobi_recurrence,
    linear_recurrence,
    native,
    native_build,
)
from paraprop.scan.linear import method_for

LENGTHS = [1, 2, 3, 7, 31, 32, 33, 97]
TORCH_METHODS = ["sequential", "blelloch", "hillis_steele", "chunked", "auto"]
# max relative error against the float64 loop, per dtype
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
HAVE_NATIVE = native.available()


def loop(A, b, h0=None, reverse=False):
    """The definition, one step at a time, on dense matrices (..., T, H, H)."""
    T = b.shape[-2]
    h = torch.zeros_like(b[..., 0, :]) if h0 is None else h0.expand_as(b[..., 0, :])
    out = [None] * T
    for t in (range(T - 1, -1, -1) if reverse else range(T)):
        h = (A[..., t, :, :] @ h.unsqueeze(-1)).squeeze(-1) + b[..., t, :]
        out[t] = h
    return torch.stack(out, -2)


def as_dense(A, H):
    if isinstance(A, Factored):
        s = A.scale
        R = A.right if A.right is not None else torch.eye(H, dtype=s.dtype).repeat(
            s.shape[-1] // H, 1)
        L = A.left if A.left is not None else torch.eye(H, dtype=s.dtype).repeat(
            1, s.shape[-1] // H)
        M = L @ (s.unsqueeze(-1) * R)
        return M + torch.diag_embed(A.diag) if A.diag is not None else M
    return A if A.shape[-1] == A.shape[-2] and A.dim() == 4 else torch.diag_embed(A)


def make(kind, N, T, H, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    if kind == "dense":
        A = r(N, T, H, H, scale=0.6 / H**0.5)
    elif kind == "diag":
        A = r(N, T, H, scale=0.8)
    elif kind == "factored":      # RNN-like: diag(s_t) W (left = block sum = identity)
        A = Factored(scale=r(N, T, H), right=r(H, H, scale=0.5 / H**0.5))
    elif kind == "factored_gru":  # GRU-like: diag(d) + W diag(s) [I; I; I]
        A = Factored(scale=r(N, T, 3 * H, scale=0.3), left=r(H, 3 * H, scale=0.5 / H**0.5),
                     diag=r(N, T, H, scale=0.5))
    else:                         # general: diag(d) + L diag(s) R, K != H
        A = Factored(scale=r(N, T, 5), left=r(H, 5, scale=0.4), right=r(5, H, scale=0.4),
                     diag=r(N, T, H, scale=0.3))
    return A, r(N, T, H), r(N, H)


def on(A, device):
    """``A`` (a tensor or a Factored) on ``device``."""
    if isinstance(A, Factored):
        return Factored(*(None if t is None else t.to(device)
                          for t in (A.scale, A.left, A.right, A.diag)))
    return A.to(device)


def methods(device):
    """The methods to check on ``device``: the native kernels on the CPU (where they build), the
    Triton kernels on CUDA (on the CPU they run only in Triton's interpreter,
    tests/test_triton.py)."""
    kernels = (["native"] if device.type == "cpu" and HAVE_NATIVE else []) + (
        ["triton"] if device.type == "cuda" else [])
    return TORCH_METHODS + kernels


def rel_err(x, ref):
    x, ref = x.detach().cpu(), ref.detach().cpu()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("kind", ["dense", "diag", "factored", "factored_gru", "factored_lr"])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("reverse", [False, True])
def test_every_method_equals_the_loop(kind, T, reverse, device):
    A, b, h0 = make(kind, 3, T, 4)
    ref = loop(as_dense(A, 4), b, h0, reverse)
    ref_free = loop(as_dense(A, 4), b, None, reverse)
    A, b, h0 = on(A, device), b.to(device), h0.to(device)
    for method in methods(device):
        h = linear_recurrence(A, b, h0, reverse=reverse, method=method)
        assert rel_err(h, ref) <= TOL[torch.float64], method
    for levels in (0, 1, 3):
        h = linear_recurrence(A, b, h0, reverse=reverse, method="blelloch", levels=levels)
        assert rel_err(h, ref) <= TOL[torch.float64], levels
    for chunk in (1, 2, 5, T):
        h = linear_recurrence(A, b, None, reverse=reverse, method="chunked", chunk_size=chunk)
        assert rel_err(h, ref_free) <= TOL[torch.float64], chunk


@pytest.mark.parametrize("kind", ["dense", "diag", "factored_gru"])
@pytest.mark.parametrize("method", ["auto", "chunked", "blelloch"])
def test_float32_relative_error(kind, method, device):
    A, b, h0 = make(kind, 4, 200, 6)
    ref = loop(as_dense(A, 6), b, h0)
    A32 = (A.to(torch.float32) if isinstance(A, torch.Tensor) else Factored(
        *(None if x is None else x.float() for x in (A.scale, A.left, A.right, A.diag))))
    h = linear_recurrence(on(A32, device), b.float().to(device), h0.float().to(device),
                          method=method)
    assert h.dtype == torch.float32
    assert rel_err(h.double(), ref) <= TOL[torch.float32]


@pytest.mark.parametrize("kind", ["dense", "diag"])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("reverse", [False, True])
def test_gradcheck(kind, T, reverse):
    A, b, h0 = make(kind, 2, T, 3, seed=T)
    inputs = tuple(x.clone().requires_grad_() for x in (A, b, h0))
    assert torch.autograd.gradcheck(
        lambda a, bb, h: linear_recurrence(a, bb, h, reverse=reverse), inputs,
        fast_mode=T > 7)


@pytest.mark.parametrize("kind", ["factored", "factored_gru", "factored_lr"])
@pytest.mark.parametrize("reverse", [False, True])
def test_gradcheck_factored(kind, reverse):
    A, b, h0 = make(kind, 2, 7, 3, seed=1)
    names = [n for n in ("scale", "left", "right", "diag") if getattr(A, n) is not None]
    inputs = tuple(getattr(A, n).clone().requires_grad_() for n in names) + (
        b.clone().requires_grad_(), h0.clone().requires_grad_())

    def f(*xs):
        return linear_recurrence(Factored(**dict(zip(names, xs[:-2], strict=True))), xs[-2],
                                 xs[-1], reverse=reverse)

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("method", ["sequential", "native", "blelloch", "hillis_steele",
                                    "chunked", "triton"])
def test_gradients_of_every_method_equal_autograd_of_the_loop(method, device):
    if method in ("native", "triton") and method not in methods(device):
        pytest.skip(f"method={method!r} does not run on {device.type} here")
    A, b, h0 = make("dense", 2, 33, 3, seed=3)
    w = torch.randn(2, 33, 3, dtype=torch.float64)
    xs = [x.clone().to(device).requires_grad_() for x in (A, b, h0)]
    (linear_recurrence(*xs, reverse=True, method=method) * w.to(device)).sum().backward()
    ys = [x.clone().requires_grad_() for x in (A, b, h0)]
    (loop(*ys, reverse=True) * w).sum().backward()
    for x, y in zip(xs, ys, strict=True):
        assert rel_err(x.grad, y.grad) <= TOL[torch.float64]


def test_broadcast_batch_and_shared_matrices():
    A, b, h0 = make("dense", 1, 20, 3)
    b = torch.randn(2, 5, 20, 3, dtype=torch.float64)
    Ab = A.reshape(1, 1, 20, 3, 3).requires_grad_()
    h = linear_recurrence(Ab, b, h0[0])
    assert h.shape == (2, 5, 20, 3)
    ref = loop(Ab.detach().expand(2, 5, 20, 3, 3), b, h0[0])
    assert rel_err(h, ref) <= TOL[torch.float64]
    h.sum().backward()
    Ae = Ab.detach().expand(2, 5, 20, 3, 3).clone().requires_grad_()
    loop(Ae, b, h0[0]).sum().backward()
    assert rel_err(Ab.grad, Ae.grad.sum((0, 1), keepdim=True)) <= TOL[torch.float64]


@pytest.mark.skipif(not HAVE_NATIVE, reason=f"native kernels unavailable: {native.status()}")
@pytest.mark.parametrize("kind", ["dense", "diag", "factored", "factored_gru", "factored_lr"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_kernel_equals_torch_loop_on_strided_layouts(kind, dtype):
    A, b, h0 = make(kind, 5, 40, 6, dtype=dtype)
    b_tm = b.transpose(0, 1).contiguous().transpose(0, 1)      # time-major memory
    for reverse in (False, True):
        ref = linear_recurrence(A, b, h0, reverse=reverse, method="sequential")
        for bb in (b, b_tm):
            h = linear_recurrence(A, bb, h0, reverse=reverse, method="native")
            assert rel_err(h.double(), ref.double()) <= TOL[dtype]
            assert h.stride() == bb.stride()   # the output follows b's layout


def test_jacobi_recurrence_is_exact_after_T_sweeps_and_truncates_before():
    A, b, h0 = make("factored_gru", 2, 25, 4)
    ref = loop(as_dense(A, 4), b, h0, reverse=True)
    full = jacobi_recurrence(A, b, h0, reverse=True)
    assert full.converged and full.iterations <= 25
    assert rel_err(full.value, ref) <= TOL[torch.float64]
    part = jacobi_recurrence(A, b, h0, reverse=True, max_iters=5)
    assert part.iterations == 5 and not part.converged
    # after k sweeps the last k positions (first in the reverse direction) are exact
    assert rel_err(part.value[:, -5:], ref[:, -5:]) <= TOL[torch.float64]
    assert rel_err(part.value, ref) > 1e-3
    tol = jacobi_recurrence(A, b, h0, reverse=True, tol=1e-4)
    assert tol.converged and tol.residuals[-1] <= 1e-4 and tol.iterations < 25


ERRORS = [
    (lambda: linear_recurrence(torch.zeros(2, 5, 3, 2), torch.zeros(2, 5, 3)),
     ValueError, r"A must be dense \(\.\.\., T, H, H\) or diagonal"),
    (lambda: linear_recurrence(torch.zeros(5, 3, 3), torch.zeros(2, 5, 3)),
     ValueError, r"batch dims of b written out"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(3, 5, 3)),
     ValueError, r"do not broadcast"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), torch.zeros(2, 4)),
     ValueError, r"h0 must have shape \(\.\.\., H\) = \(\.\.\., 3\)"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3, dtype=torch.float64)),
     TypeError, r"A has dtype torch.float32 but b has torch.float64"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3, dtype=torch.long)),
     TypeError, r"b must have a floating-point dtype"),
    (lambda: linear_recurrence([1.0], torch.zeros(2, 5, 3)), TypeError, r"A must be a torch"),
    (lambda: linear_recurrence(torch.zeros(2, 0, 3), torch.zeros(2, 0, 3)),
     ValueError, r"T, H >= 1"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), method="fast"),
     ValueError, r"unknown method='fast'; choose one of auto, sequential, native, blelloch"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), levels=2),
     ValueError, r"levels is only used by method='blelloch', not method='auto'"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), method="native",
                               chunk_size=4),
     ValueError, r"chunk_size is only used by method='chunked', not method='native'"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), method="chunked",
                               chunk_size=0), ValueError, r"chunk_size must be a positive int"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), algorithm="auto"),
     TypeError, r"unexpected keyword argument 'algorithm'"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), native=True),
     TypeError, r"unexpected keyword argument 'native'"),
    (lambda: linear_recurrence(Factored(scale=torch.zeros(2, 5, 4)), torch.zeros(2, 5, 3)),
     ValueError, r"need K a multiple of H; got K=4, H=3"),
    (lambda: linear_recurrence(Factored(scale=torch.zeros(2, 5, 3), left=torch.zeros(3, 2)),
                               torch.zeros(2, 5, 3)), ValueError, r"A.left must have shape"),
    (lambda: linear_recurrence(Factored(scale=torch.zeros(2, 4, 3)), torch.zeros(2, 5, 3)),
     ValueError, r"A.scale must have shape \(\.\.\., T, K\) with T=5"),
    (lambda: jacobi_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), max_iters=0),
     ValueError, r"max_iters must be a positive int"),
    (lambda: jacobi_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), tol=-1),
     ValueError, r"tol must be a number >= 0"),
]


@pytest.mark.parametrize("call,exc,match", ERRORS)
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_native_on_tensors_it_cannot_run_on_is_an_error_naming_them():
    b = torch.zeros(2, 5, 3, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"method='native' cannot run here: the native scan "
                       r"kernels need CPU float32/float64 tensors of one dtype, got cpu "
                       r"torch\.float16"):
        linear_recurrence(torch.zeros(2, 5, 3, dtype=torch.float16), b, method="native")


def test_native_on_cuda_is_an_error(device):
    if device.type != "cuda":
        pytest.skip("needs a CUDA tensor")
    b = torch.zeros(2, 5, 3, device=device)
    with pytest.raises(RuntimeError, match=r"method='native' cannot run here: .* got cuda "
                       r"torch\.float32"):
        linear_recurrence(torch.zeros(2, 5, 3, device=device), b, method="native")


def test_native_disabled_is_refused_by_name_and_auto_falls_back(monkeypatch):
    """With the kernels off (PARAPROP_NATIVE=0 as a fresh import sees it), ``method="native"``
    raises with the reason and ``"auto"`` runs the torch methods, with the loop's result."""
    monkeypatch.setattr(native_build, "_lib", None)
    monkeypatch.setattr(native_build, "_status", "disabled by PARAPROP_NATIVE=0")
    A, b, h0 = make("dense", 2, 20, 3)
    with pytest.raises(RuntimeError, match=r"method='native' cannot run here: the native scan "
                       r"kernels are disabled by PARAPROP_NATIVE=0"):
        linear_recurrence(A, b, h0, method="native")
    assert method_for(A, b, h0) == "chunked"
    assert rel_err(linear_recurrence(A, b, h0), loop(A, b, h0)) <= TOL[torch.float64]


def test_auto_picks_native_where_it_runs_and_names_it():
    A, b, h0 = make("diag", 2, 40, 3)
    assert method_for(A, b, h0) == ("native" if HAVE_NATIVE else "blelloch")
    assert method_for(A.half(), b.half(), h0.half()) == "blelloch"
    assert method_for(A, b, h0, method="sequential") == "sequential"


def test_methods_are_defined_once():
    """One tuple names every method; associative_scan takes those that are not kernels of the
    linear recurrence, and refuses the kernels by name."""
    from paraprop.scan.associative import ASSOCIATIVE_METHODS
    from paraprop.scan.linear import KERNELS

    assert METHODS[0] == "auto" and set(KERNELS) == {"native", "triton"} <= set(METHODS)
    assert ASSOCIATIVE_METHODS == tuple(m for m in METHODS if m not in KERNELS)
    for method in KERNELS:
        with pytest.raises(ValueError, match=rf"associative_scan has no method '{method}': the "
                           r"native and Triton kernels run linear recurrences only"):
            associative_scan(torch.zeros(3), torch.add, method=method)


@pytest.mark.skipif(not HAVE_NATIVE, reason=f"native kernels unavailable: {native.status()}")
def test_native_kernel_split_across_threads():
    """Large calls split the batch rows across threads and use size-specialised kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for kind in ("dense", "factored_gru"):
            A64, b64, h64 = make(kind, 7, 300, 16)
            A, b, h0 = make(kind, 7, 300, 16, dtype=torch.float32)
            got = linear_recurrence(A, b, h0, reverse=True, method="native")
            ref = linear_recurrence(A64, b64, h64, reverse=True, method="sequential")
            assert rel_err(got.double(), ref) <= TOL[torch.float32]
    finally:
        torch.set_num_threads(threads)


def test_jacobi_recurrence_is_differentiable_by_autograd():
    A, b, h0 = make("dense", 2, 9, 3, seed=5)
    inputs = tuple(x.clone().requires_grad_() for x in (A, b, h0))
    assert torch.autograd.gradcheck(lambda a, bb, h: jacobi_recurrence(a, bb, h).value, inputs)


def test_jacobi_recurrence_throw_and_accumulation():
    # A_t = I: every sweep moves by about |b|; a small step must not stop it early
    T, H = 30, 2
    A = torch.eye(H, dtype=torch.float64).expand(1, T, H, H)
    b = torch.full((1, T, H), 0.01, dtype=torch.float64)
    sol = jacobi_recurrence(A, b, tol=0.05)
    assert sol.residuals[0] <= 0.05 and sol.iterations == T and sol.converged
    torch.testing.assert_close(sol.value, linear_recurrence(A, b))
    capped = jacobi_recurrence(A, b, tol=0.05, max_iters=3)
    assert not capped.converged and capped.stats["error_estimate"] == float("inf")
    with pytest.raises(paraprop.ConvergenceError,
                       match="jacobi_recurrence: method='jacobi' did not converge within "
                             "max_iters=3"):
        jacobi_recurrence(A, b, tol=0.05, max_iters=3, throw=True)
