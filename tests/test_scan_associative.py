"""associative_scan: every method equals the sequential scan for non-commutative operators."""

import pytest
import torch

from paraprop.scan import associative_scan
from paraprop.scan.associative import ASSOCIATIVE_METHODS

LENGTHS = [1, 2, 3, 5, 7, 8, 9, 16, 17, 31, 32, 33, 97]
PARALLEL = [a for a in ASSOCIATIVE_METHODS if a != "sequential"]


def matmul_later_first(a, b):
    """a ⊕ b = b @ a: the running product M_i ... M_1 M_0 (non-commutative)."""
    return b @ a


def mats(n, H=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype)


def close(x, y, tol=1e-10):
    return float((x - y).abs().max()) <= tol * max(1.0, float(y.abs().max()))


def test_sequential_is_the_definition():
    M = mats(6)
    P = associative_scan(M, matmul_later_first, method="sequential")
    expect = torch.eye(3, dtype=M.dtype)
    for i in range(6):
        expect = M[i] @ expect
        assert close(P[i], expect)
    E = associative_scan(M, matmul_later_first, method="sequential", exclusive=True,
                         identity=torch.eye(3, dtype=M.dtype))
    assert close(E[0], torch.eye(3, dtype=M.dtype)) and close(E[1:], P[:-1])
    R = associative_scan(M, matmul_later_first, method="sequential", reverse=True)
    assert close(R[0], M[0] @ M[1] @ M[2] @ M[3] @ M[4] @ M[5])
    assert close(R[4], M[4] @ M[5]) and close(R[5], M[5])


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("method", PARALLEL)
@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_matrix_products_equal_sequential(n, method, exclusive, reverse, device):
    M = mats(n, seed=n).to(device)
    kw = {"exclusive": exclusive, "reverse": reverse}
    if exclusive:
        kw["identity"] = torch.eye(3, dtype=M.dtype, device=device)
    ref = associative_scan(M, matmul_later_first, method="sequential", **kw)
    got = associative_scan(M, matmul_later_first, method=method, **kw)
    assert close(got, ref)


@pytest.mark.parametrize("n", [5, 31, 33, 97])
def test_blelloch_level_cap_and_chunk_sizes(n):
    M = mats(n, seed=1)
    ref = associative_scan(M, matmul_later_first, method="sequential")
    for levels in range(0, 9):
        assert close(associative_scan(M, matmul_later_first, method="blelloch",
                                      levels=levels), ref), levels
    for chunk in (1, 2, 3, 10, n):
        assert close(associative_scan(M, matmul_later_first, method="chunked",
                                      chunk_size=chunk), ref), chunk


def test_blelloch_exclusive_keeps_the_operand_order():
    """Slot i holds M_{i-1} ... M_0, not the product in the commuted order."""
    from paraprop.scan import blelloch

    M = mats(8, seed=2)
    ex = blelloch.exclusive([M], lambda a, b: [b[0] @ a[0]], 0)[0]
    assert close(ex[5], M[4] @ M[3] @ M[2] @ M[1] @ M[0])
    assert not close(ex[5], M[0] @ M[1] @ M[2] @ M[3] @ M[4], tol=1e-3)


@pytest.mark.parametrize("method", PARALLEL)
def test_tuples_dim_and_affine_pairs(method):
    """Affine maps (A, b) composed along dim=1 with a batch dim in front."""
    g = torch.Generator().manual_seed(3)
    A = torch.randn(2, 45, 4, 4, generator=g, dtype=torch.float64) / 2
    b = torch.randn(2, 45, 4, generator=g, dtype=torch.float64)

    def compose(x, y):
        return (y[0] @ x[0], (y[0] @ x[1].unsqueeze(-1)).squeeze(-1) + y[1])

    ref = associative_scan((A, b), compose, dim=1, method="sequential")
    got = associative_scan((A, b), compose, dim=1, method=method)
    assert isinstance(got, tuple) and len(got) == 2
    assert close(got[0], ref[0]) and close(got[1], ref[1])
    # the b part is the linear recurrence h_t = A_t h_{t-1} + b_t from h_{-1} = 0
    h = torch.zeros(2, 4, dtype=torch.float64)
    for t in range(45):
        h = (A[:, t] @ h.unsqueeze(-1)).squeeze(-1) + b[:, t]
    assert close(got[1][:, -1], h)


@pytest.mark.parametrize("method", PARALLEL)
def test_gradients_through_the_scan_equal_sequential(method):
    M0 = mats(21, seed=4)
    w = torch.randn(21, 3, 3, dtype=torch.float64)
    grads = {}
    for alg in ("sequential", method):
        M = M0.clone().requires_grad_()
        (associative_scan(M, matmul_later_first, method=alg) * w).sum().backward()
        grads[alg] = M.grad
    assert close(grads[method], grads["sequential"])


def test_float32_and_a_commutative_operator():
    x = torch.rand(1000, dtype=torch.float32)
    for method in PARALLEL:
        y = associative_scan(x, torch.add, method=method)
        assert torch.allclose(y, torch.cumsum(x, 0), rtol=1e-5, atol=1e-4)
        m = associative_scan(x, torch.maximum, method=method)
        assert torch.equal(m, torch.cummax(x, 0).values)


ERRORS = [
    (lambda: associative_scan([1, 2], torch.add), TypeError, r"elems must be a tensor"),
    (lambda: associative_scan(torch.zeros(3), "add"), TypeError, r"combine must be callable"),
    (lambda: associative_scan(torch.zeros(3), torch.add, method="magic"), ValueError,
     r"unknown method='magic'"),
    (lambda: associative_scan(torch.zeros(3), torch.add, exclusive=True), ValueError,
     r"exclusive=True needs identity="),
    (lambda: associative_scan(torch.zeros(3), torch.add, levels=2), ValueError,
     r"levels is only used by method='blelloch'"),
    (lambda: associative_scan(torch.zeros(3), torch.add, method="chunked", chunk_size=-1),
     ValueError, r"chunk_size must be a positive int"),
    (lambda: associative_scan((torch.zeros(3), torch.zeros(4)), lambda a, b: b), ValueError,
     r"same length along dim=0"),
    (lambda: associative_scan(torch.zeros(0), torch.add), ValueError, r"length >= 1"),
    (lambda: associative_scan(torch.zeros(3), torch.add, dim=2), ValueError,
     r"dim=2 is out of range"),
    (lambda: associative_scan(torch.zeros(4, 2), lambda a, b: (a, b), method="sequential"),
     TypeError, r"combine must return a tensor"),
    (lambda: associative_scan(torch.zeros(4, 2), lambda a, b: a.sum(-1), method="blelloch"),
     ValueError, r"combine returned shape"),
]


@pytest.mark.parametrize("call,exc,match", ERRORS)
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
