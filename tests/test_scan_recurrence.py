"""linear_recurrence: every algorithm equals the plain loop; gradients equal finite differences."""

import pytest
import torch

import paraprop
from paraprop.scan import Factored, jacobi_recurrence, linear_recurrence, native

LENGTHS = [1, 2, 3, 7, 31, 32, 33, 97]
ALGORITHMS = ["sequential", "blelloch", "hillis_steele", "chunked", "auto"]
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


def algorithms(device):
    """The algorithms to check on ``device``: the Triton kernels too on CUDA (on the CPU they
    run only in Triton's interpreter, tests/test_triton.py)."""
    return ALGORITHMS + (["triton"] if device.type == "cuda" else [])


def rel_err(x, ref):
    x, ref = x.detach().cpu(), ref.detach().cpu()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("kind", ["dense", "diag", "factored", "factored_gru", "factored_lr"])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("reverse", [False, True])
def test_every_algorithm_equals_the_loop(kind, T, reverse, device):
    A, b, h0 = make(kind, 3, T, 4)
    ref = loop(as_dense(A, 4), b, h0, reverse)
    ref_free = loop(as_dense(A, 4), b, None, reverse)
    A, b, h0 = on(A, device), b.to(device), h0.to(device)
    for algorithm in algorithms(device):
        for use_native in ([None, False] if algorithm in ("sequential", "auto") else [None]):
            h = linear_recurrence(A, b, h0, reverse=reverse, algorithm=algorithm,
                                  native=use_native)
            assert rel_err(h, ref) <= TOL[torch.float64], (algorithm, use_native)
    for levels in (0, 1, 3):
        h = linear_recurrence(A, b, h0, reverse=reverse, algorithm="blelloch", levels=levels)
        assert rel_err(h, ref) <= TOL[torch.float64], levels
    for chunk in (1, 2, 5, T):
        h = linear_recurrence(A, b, None, reverse=reverse, algorithm="chunked", chunk_size=chunk)
        assert rel_err(h, ref_free) <= TOL[torch.float64], chunk


@pytest.mark.parametrize("kind", ["dense", "diag", "factored_gru"])
@pytest.mark.parametrize("algorithm", ["auto", "chunked", "blelloch"])
def test_float32_relative_error(kind, algorithm, device):
    A, b, h0 = make(kind, 4, 200, 6)
    ref = loop(as_dense(A, 6), b, h0)
    A32 = (A.to(torch.float32) if isinstance(A, torch.Tensor) else Factored(
        *(None if x is None else x.float() for x in (A.scale, A.left, A.right, A.diag))))
    h = linear_recurrence(on(A32, device), b.float().to(device), h0.float().to(device),
                          algorithm=algorithm)
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


@pytest.mark.parametrize("algorithm", ["sequential", "blelloch", "hillis_steele", "chunked",
                                       "triton"])
def test_gradients_of_every_algorithm_equal_autograd_of_the_loop(algorithm, device):
    if algorithm == "triton" and device.type != "cuda":
        pytest.skip("the Triton kernels run on CUDA here (interpreted: tests/test_triton.py)")
    A, b, h0 = make("dense", 2, 33, 3, seed=3)
    w = torch.randn(2, 33, 3, dtype=torch.float64)
    xs = [x.clone().to(device).requires_grad_() for x in (A, b, h0)]
    (linear_recurrence(*xs, reverse=True, algorithm=algorithm) * w.to(device)).sum().backward()
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
        ref = linear_recurrence(A, b, h0, reverse=reverse, algorithm="sequential", native=False)
        for bb in (b, b_tm):
            h = linear_recurrence(A, bb, h0, reverse=reverse, native=True)
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
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), algorithm="fast"),
     ValueError, r"unknown algorithm='fast'"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), levels=2),
     ValueError, r"levels is only used by algorithm='blelloch'"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), algorithm="chunked",
                               chunk_size=0), ValueError, r"chunk_size must be a positive int"),
    (lambda: linear_recurrence(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), algorithm="blelloch",
                               native=True), ValueError, r"native=True needs algorithm"),
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


def test_native_required_but_unusable_is_an_error():
    b = torch.zeros(2, 5, 3, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"native=True but the native scan kernels cannot run"):
        linear_recurrence(torch.zeros(2, 5, 3, dtype=torch.float16), b, native=True)


@pytest.mark.skipif(not HAVE_NATIVE, reason=f"native kernels unavailable: {native.status()}")
def test_native_kernel_split_across_threads():
    """Large calls split the batch rows across threads and use size-specialised kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for kind in ("dense", "factored_gru"):
            A64, b64, h64 = make(kind, 7, 300, 16)
            A, b, h0 = make(kind, 7, 300, 16, dtype=torch.float32)
            got = linear_recurrence(A, b, h0, reverse=True, native=True)
            ref = linear_recurrence(A64, b64, h64, reverse=True, algorithm="sequential",
                                    native=False)
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
