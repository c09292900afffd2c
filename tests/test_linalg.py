"""paraprop.linalg: every solver equals the dense triangular solve (Naumov 2017, eq. 13-41)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paraprop.errors import ConvergenceError, NonFiniteError
from paraprop.linalg import (
    METHODS,
    BlockBidiagonal,
    BlockDiagonalOperator,
    LinearOperator,
    solve,
)
from paraprop.linalg.stacked import StackedSystem

# allowed max |x - x_dense| / max(1, max |x_dense|), per dtype and method kind. float32, over
# 3000 random systems like test_random_systems_match_dense's: direct methods at most 1.2e-6;
# Jacobi, which stops at its default tol (1e-5 on the residual), up to 1.05e-5.
TOL = {
    torch.float64: {"direct": 1e-11, "jacobi": 1e-11, "bicgstab": 1e-8},
    torch.float32: {"direct": 1e-5, "jacobi": 1e-4, "bicgstab": 1e-3},
}
KIND = {"substitution": "direct", "cyclic_reduction": "direct", "jacobi": "jacobi",
        "bicgstab": "bicgstab"}


def random_system(sizes, lower, *, batch=None, diag=True, scale=True, dtype=torch.float64,
                  seed=0, zero_frac=0.0):
    """A well-conditioned random system: diagonals in [0.5, 1.5], blocks ~ 1/sqrt(cols)."""
    g = torch.Generator().manual_seed(seed)
    l = len(sizes)
    off = []
    for j in range(l - 1):
        r, c = (sizes[j + 1], sizes[j]) if lower else (sizes[j], sizes[j + 1])
        off.append(torch.randn(r, c, generator=g, dtype=dtype) / math.sqrt(c))

    def shaped(n):
        return (batch, n) if batch else (n,)

    dg = [torch.rand(shaped(n), generator=g, dtype=dtype) + 0.5 for n in sizes] if diag else None
    sc = None
    if scale:
        sc = []
        for j in range(l - 1):
            s = torch.randn(shaped(off[j].shape[0]), generator=g, dtype=dtype)
            if zero_frac:
                s = s * (torch.rand(s.shape, generator=g) >= zero_frac)
            sc.append(s)
    return BlockBidiagonal(off, lower=lower, diag=dg, off_scale=sc, sizes=sizes)


def dense_solve(A: BlockBidiagonal, r: torch.Tensor) -> torch.Tensor:
    """The reference: torch.linalg.solve_triangular on the dense matrix."""
    D = A.dense().to(r.dtype)  # (G, N, N); a system of identities only has no dtype
    R = r.reshape(-1, A.N)
    if A.batch is None:
        X = torch.linalg.solve_triangular(D[0], R.T, upper=not A.lower).T
    else:
        X = torch.linalg.solve_triangular(D, R.unsqueeze(-1), upper=not A.lower).squeeze(-1)
    return X.reshape(r.shape)


def assert_close(x, ref, method, dtype=torch.float64):
    err = float((x - ref).abs().max()) / max(1.0, float(ref.abs().max()))
    assert err <= TOL[dtype][KIND[method]], f"{method}: relative error {err:.2e}"


def kwargs(method, dtype=torch.float64):
    return {"tol": 1e-14 if dtype == torch.float64 else 1e-5} if method == "bicgstab" else {}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("l", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("batch", [None, 3])
def test_every_solver_equals_the_dense_triangular_solve(method, lower, l, batch):
    sizes = [2, 3, 1, 4, 2, 3, 3, 2][:l]  # non-square blocks between widths
    A = random_system(sizes, lower, batch=batch, seed=l)
    r = torch.randn(3, A.N, dtype=torch.float64)
    sol = solve(A, r, method=method, **kwargs(method))
    assert sol.converged
    assert sol.value.shape == r.shape
    assert_close(sol.value, dense_solve(A, r), method)


@st.composite
def systems(draw):
    l = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(1, 4), min_size=l, max_size=l))
    return {
        "sizes": sizes,
        "lower": draw(st.booleans()),
        "batch": draw(st.sampled_from([None, 1, 2])),
        "diag": draw(st.booleans()),
        "scale": draw(st.booleans()),
        "zero_frac": draw(st.sampled_from([0.0, 0.5])),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "seed": draw(st.integers(0, 2**16)),
        "method": draw(st.sampled_from(METHODS)),
        "vector": draw(st.booleans()),
    }


@settings(max_examples=120, deadline=None)
@given(systems())
def test_random_systems_match_dense(case):
    dtype, method = case["dtype"], case["method"]
    if method == "bicgstab":  # float32 BiCGStab can stall on these non-normal systems (docs)
        dtype = torch.float64
    A = random_system(case["sizes"], case["lower"], batch=case["batch"], diag=case["diag"],
                      scale=case["scale"], dtype=dtype, seed=case["seed"],
                      zero_frac=case["zero_frac"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    shape = (A.N,) if case["vector"] and A.batch is None else (case["batch"] or 2, A.N)
    r = torch.randn(shape, generator=g, dtype=dtype)
    sol = solve(A, r, method=method, **kwargs(method, dtype))
    assert_close(sol.value, dense_solve(A, r), method, dtype)


def test_rhs_as_a_list_of_blocks_and_split_join():
    A = random_system([2, 3, 4], True)
    blocks = [torch.randn(5, n, dtype=torch.float64) for n in A.sizes]
    sol = solve(A, blocks)
    assert sol.value.shape == (5, A.N)
    assert [b.shape[-1] for b in A.split(sol.value)] == [2, 3, 4]
    assert torch.equal(A.join(A.split(sol.value)), sol.value)
    assert torch.allclose(A.matvec(sol.value), A.join(blocks))


@pytest.mark.parametrize("l", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 100])
def test_cyclic_reduction_takes_ceil_log2_l_plus_one_levels(l):
    A = random_system([3] * l, l % 2 == 0, seed=l)
    r = torch.randn(2, A.N, dtype=torch.float64)
    cr = solve(A, r, method="cyclic_reduction")
    sub = solve(A, r, method="substitution")
    assert cr.stats["levels"] == math.ceil(math.log2(l)) + 1
    assert cr.iterations == cr.stats["levels"]
    assert sub.stats["levels"] == l
    assert cr.stats["flops"] > 0 and cr.stats["memory_bytes"] > 0
    assert_close(cr.value, sub.value, "cyclic_reduction")


@pytest.mark.parametrize("lower", [True, False])
def test_jacobi_is_exact_after_l_sweeps(lower):
    l = 9
    A = random_system([3] * l, lower, seed=3)
    r = torch.randn(2, A.N, dtype=torch.float64)
    sol = solve(A, r, method="jacobi", tol=0)
    assert sol.converged and sol.iterations <= A.depth == l
    assert len(sol.residuals) == sol.iterations
    ref = solve(A, r, method="substitution")
    assert float((sol.value - ref.value).abs().max()) <= 1e-13


def test_shifted_systems_solve_each_sample_with_its_shift():
    A = random_system([2, 3, 2, 3], False, seed=5)
    shifts = torch.tensor([0.0, 0.5, 2.0], dtype=torch.float64)
    S = A.shifted(shifts)
    assert S.batch == 3
    r = torch.randn(3, A.N, dtype=torch.float64)
    dense = A.dense()[0]
    for method in METHODS:
        sol = solve(S, r, method=method, **kwargs(method))
        for b in range(3):
            ref = torch.linalg.solve_triangular(dense + shifts[b] * torch.eye(A.N,
                                                dtype=torch.float64), r[b:b + 1].T, upper=True)
            assert_close(sol.value[b], ref[:, 0], method)


def test_zero_scalings_like_relu_derivatives():
    sizes = [4] * 6
    A = random_system(sizes, False, batch=2, diag=False, seed=11, zero_frac=0.7)
    assert any(bool((s == 0).any()) for s in A.off_scale)
    r = torch.randn(2, A.N, dtype=torch.float64)
    for method in METHODS:
        assert_close(solve(A, r, method=method, **kwargs(method)).value, dense_solve(A, r),
                     method)


def test_stacked_matvec_matches_the_system():
    for lower in (True, False):
        A = random_system([2, 4, 3, 1, 4], lower, batch=2, seed=2)
        x = torch.randn(2, 1, A.N, dtype=torch.float64)
        S = StackedSystem(A, 2)
        X = S.to_blocks(x)
        off = S.from_blocks(S.matvec_off(X) + S.diag_rows() * X)
        assert torch.allclose(off, A.matvec(x[:, 0]).unsqueeze(1))
        assert torch.allclose(A.matvec(x[:, 0]), (A.dense() @ x[:, 0].unsqueeze(-1))[..., 0])


class _Shift(LinearOperator):
    """A matrix-free operator: x -> (x rolled by one) * 0.5 (no dense() of its own)."""

    def __init__(self, n):
        self.shape, self.dtype, self.device = (n, n), torch.float64, torch.device("cpu")

    def matvec(self, x):
        return 0.5 * torch.roll(x, 1, dims=-1)


def test_linear_operator_blocks():
    ops = [_Shift(3), BlockDiagonalOperator([torch.eye(1, dtype=torch.float64),
                                             2 * torch.ones(2, 2, dtype=torch.float64)]),
           torch.randn(3, 3, dtype=torch.float64)]
    A = BlockBidiagonal(ops, lower=True)
    r = torch.randn(2, A.N, dtype=torch.float64)
    for method in METHODS:
        assert_close(solve(A, r, method=method, **kwargs(method)).value, dense_solve(A, r),
                     method)


def nested_system(lower, tau=4, K=3, n=2, batch=2, seed=0):
    """A random two-level system like the RNN's: tau outer blocks of K inner blocks each."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    inner = []
    for _ in range(tau):
        off = [torch.randn(n, n, generator=g, dtype=dt) / 2 for _ in range(K - 1)]
        sc = [torch.randn(batch, n, generator=g, dtype=dt) for _ in range(K - 1)]
        dg = [torch.rand(batch, n, generator=g, dtype=dt) + 0.5 for _ in range(K)]
        inner.append(BlockBidiagonal(off, lower=lower, diag=dg, off_scale=sc))
    outer = [BlockDiagonalOperator([torch.randn(n, n, generator=g, dtype=dt) / 2
                                    for _ in range(K)]) for _ in range(tau - 1)]
    sc = [torch.randn(batch, K * n, generator=g, dtype=dt) for _ in range(tau - 1)]
    return BlockBidiagonal(outer, lower=lower, diag=inner, off_scale=sc)


@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("method", METHODS)
def test_nested_systems(lower, method):
    A = nested_system(lower)
    assert A.nested and A.depth == 4 - 1 + 3
    r = torch.randn(2, A.N, dtype=torch.float64)
    sol = solve(A, r, method=method, **kwargs(method))
    assert_close(sol.value, dense_solve(A, r), method)
    if method == "cyclic_reduction":
        assert sol.stats["inner_levels"] == math.ceil(math.log2(3)) + 1
        assert sol.stats["outer_levels"] == math.ceil(math.log2(4))
    if method == "substitution":
        assert sol.stats["levels"] == 4 * 3


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_singular_diagonal_is_reported(method):
    A = random_system([2, 2, 2], True)
    d = [torch.ones(2, dtype=torch.float64) for _ in range(3)]
    d[1][0] = 0.0
    S = BlockBidiagonal(list(A.off), lower=True, diag=d)
    with pytest.raises(ValueError, match=r"diag\[1\] is singular: entry \(0,\)"):
        solve(S, torch.ones(S.N, dtype=torch.float64), method=method)


def test_singular_nested_diagonal_is_reported():
    A = nested_system(True)
    bad = A.diag[2].diag[1].clone()
    bad[0, 1] = 0.0
    inner = BlockBidiagonal(list(A.diag[2].off), lower=True,
                            diag=[A.diag[2].diag[0], bad, A.diag[2].diag[2]],
                            off_scale=list(A.diag[2].off_scale))
    diag = list(A.diag)
    diag[2] = inner
    B = BlockBidiagonal(list(A.off), lower=True, diag=diag, off_scale=list(A.off_scale))
    with pytest.raises(ValueError, match=r"diag\[2\] \(nested system\): diag\[1\] is singular"):
        solve(B, torch.ones(2, B.N, dtype=torch.float64))


def test_mismatched_block_shapes_are_reported():
    dt = torch.float64
    with pytest.raises(ValueError, match=r"mismatched block shapes: block 1 has width 3"):
        BlockBidiagonal([torch.ones(3, 2, dtype=dt), torch.ones(4, 2, dtype=dt)], lower=True)
    with pytest.raises(ValueError, match=r"off_scale\[0\] has shape \(2,\) but off\[0\] has 3"):
        BlockBidiagonal([torch.ones(3, 2, dtype=dt)], lower=True,
                        off_scale=[torch.ones(2, dtype=dt)])
    with pytest.raises(ValueError, match=r"block 0 has width 2 from sizes but width 3"):
        BlockBidiagonal([torch.ones(3, 2, dtype=dt)], lower=False, sizes=[2, 2])
    with pytest.raises(ValueError, match=r"diag must have 2 entries"):
        BlockBidiagonal([torch.ones(3, 2, dtype=dt)], lower=True, diag=[None])
    with pytest.raises(ValueError, match=r"off_scale\[0\] has per-sample batch 4"):
        BlockBidiagonal([torch.ones(2, 2, dtype=dt)], lower=True,
                        diag=[torch.ones(3, 2, dtype=dt), None],
                        off_scale=[torch.ones(4, 2, dtype=dt)])
    with pytest.raises(ValueError, match=r"cannot infer the width of block 0"):
        BlockBidiagonal([], lower=True)
    with pytest.raises(TypeError, match=r"off\[0\] must be a 2-D tensor or a LinearOperator"):
        BlockBidiagonal(["x"], lower=True)
    with pytest.raises(TypeError, match=r"off\[1\] has dtype torch.float32"):
        BlockBidiagonal([torch.ones(2, 2, dtype=dt), torch.ones(2, 2)], lower=True)
    with pytest.raises(TypeError, match=r"off must be a sequence"):
        BlockBidiagonal(torch.ones(1, 2, 2), lower=True)


def test_bad_arguments_are_reported():
    A = random_system([2, 3], True, batch=2)
    r = torch.ones(2, A.N, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"unknown method='lu'"):
        solve(A, r, method="lu")
    with pytest.raises(ValueError, match=r"tol is only used by the iterative methods"):
        solve(A, r, method="cyclic_reduction", tol=1e-3)
    with pytest.raises(ValueError, match=r"max_iters is only used by the iterative methods"):
        solve(A, r, method="substitution", max_iters=3)
    with pytest.raises(ValueError, match=r"max_iters must be a positive int"):
        solve(A, r, method="jacobi", max_iters=0)
    with pytest.raises(ValueError, match=r"tol must be a number >= 0"):
        solve(A, r, method="jacobi", tol=-1.0)
    with pytest.raises(ValueError, match=r"rhs must have shape \(2, 5\); got \(5,\)"):
        solve(A, r[0])
    with pytest.raises(ValueError, match=r"rhs must have shape \(N,\) or \(B, N\) with N=5"):
        solve(A, torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"rhs has dtype torch.float32"):
        solve(A, r.float())
    with pytest.raises(TypeError, match=r"system must be a BlockBidiagonal"):
        solve(A.dense(), r)
    with pytest.raises(ValueError, match=r"rhs must be finite"):
        solve(A, r * float("nan"))


@pytest.mark.parametrize("method", ["jacobi", "bicgstab"])
def test_non_convergence_raises_and_is_inspectable(method):
    A = random_system([3] * 12, False, seed=4)
    r = torch.randn(2, A.N, dtype=torch.float64)
    with pytest.raises(ConvergenceError, match=rf"method='{method}' did not converge within "
                       r"max_iters=2") as info:
        solve(A, r, method=method, tol=1e-14, max_iters=2)
    assert info.value.solution is not None and not info.value.solution.converged
    sol = solve(A, r, method=method, tol=1e-14, max_iters=2, throw=False)
    assert not sol.converged and sol.iterations == 2
    assert len(sol.residuals) == 2 and float(sol.residuals[-1]) > 1e-14
    assert sol.stats["sample_iterations"].shape == (2,)


def test_overflow_is_reported():
    dt = torch.float32
    off = [torch.full((2, 2), 1e30, dtype=dt) for _ in range(7)]
    A = BlockBidiagonal(off, lower=True)
    with pytest.raises(NonFiniteError, match=r"method='cyclic_reduction' produced NaN or inf"):
        solve(A, torch.ones(A.N, dtype=dt), method="cyclic_reduction")


def test_shifted_rejects_bad_shifts():
    A = random_system([2, 2], True, batch=2)
    with pytest.raises(ValueError, match=r"shifts has 3 entries but the system has batch 2"):
        A.shifted(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"shifts must be a 1-D tensor"):
        A.shifted(torch.zeros(2, 1))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [None, 1])
def test_solve_leaves_its_inputs_alone(method, batch):
    for sizes, diag in (([1, 1], False), ([2, 3, 2], True), ([3] * 5, False)):
        A = random_system(sizes, False, batch=batch, diag=diag, scale=batch is not None)
        r = torch.randn(1, A.N, dtype=torch.float64)
        r0, D0 = r.clone(), A.dense().clone()
        solve(A, r, method=method, **kwargs(method))
        assert torch.equal(r, r0) and torch.equal(A.dense(), D0)


# -- nested systems: orientation and the Jacobi bound ----------------------------------------
def test_nested_blocks_must_have_the_outer_orientation():
    A = nested_system(True)
    upper_inner = nested_system(False)
    with pytest.raises(ValueError, match=r"diag\[0\] is a nested upper system but the outer "
                       r"system is lower"):
        BlockBidiagonal(list(A.off), lower=True, diag=list(upper_inner.diag),
                        off_scale=list(A.off_scale))
    with pytest.raises(ValueError, match=r"diag\[0\] is a nested lower system but the outer "
                       r"system is upper"):
        BlockBidiagonal(list(upper_inner.off), lower=False, diag=list(A.diag),
                        off_scale=list(upper_inner.off_scale))


@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("method", METHODS)
def test_nested_systems_with_dense_coupling(lower, method):
    """Dense coupling blocks link every inner unknown of one step to every one of the next, so
    a chain of dependent unknowns runs through all inner blocks of every step: Jacobi is exact
    only after tau * K sweeps, not tau - 1 + K."""
    tau, K, n = 5, 4, 2
    A = nested_system(lower, tau=tau, K=K, n=n)
    g = torch.Generator().manual_seed(7)
    off = [torch.randn(K * n, K * n, generator=g, dtype=torch.float64) / 2 for _ in A.off]
    S = BlockBidiagonal(off, lower=lower, diag=list(A.diag), off_scale=list(A.off_scale))
    assert A.depth == tau - 1 + K and S.depth == tau * K
    r = torch.randn(2, S.N, dtype=torch.float64)
    sol = solve(S, r, method=method, **kwargs(method))
    assert sol.converged
    assert_close(sol.value, dense_solve(S, r), method)


# -- error messages ---------------------------------------------------------------------------
def test_more_bad_arguments_are_reported():
    A = random_system([2, 3], True)
    dt = torch.float64
    r = torch.ones(2, A.N, dtype=dt)
    with pytest.raises(ValueError, match=r"rhs must not be empty, got shape \(0, 5\)"):
        solve(A, torch.ones(0, A.N, dtype=dt))
    with pytest.raises(TypeError, match=r"throw must be a bool, got 1$"):
        solve(A, r, method="jacobi", throw=1)
    with pytest.raises(TypeError, match=r"rhs\[1\] must be a tensor \(one block of a list of "
                       r"blocks\), got str"):
        solve(A, [torch.ones(2, dtype=dt), "b"])
    with pytest.raises(ValueError, match=r"rhs must be finite; entry \(1, 2\) of shape \(2, 5\) "
                       r"is inf"):
        r2 = r.clone()
        r2[1, 2] = float("inf")
        solve(A, r2)
    with pytest.raises(ValueError, match=r"sizes must be 2 positive ints, got \[2, 0\]"):
        BlockBidiagonal([torch.ones(3, 2, dtype=dt)], lower=True, sizes=[2, 0])
    with pytest.raises(ValueError, match=r"sizes must be 2 positive ints, got \[2\]"):
        BlockBidiagonal([torch.ones(3, 2, dtype=dt)], lower=True, sizes=[2])
    with pytest.raises(ValueError, match=r"shifted\(\) needs scalar diagonal blocks, not nested "
                       r"systems"):
        nested_system(True).shifted(torch.zeros(2, dtype=dt))
