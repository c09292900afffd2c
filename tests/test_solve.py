"""paraprop.solve: every method returns the sequential result (Song et al. 2021, Props 1-2)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paraprop
from problems import TOLERANCES, FastTriangular, RandomTriangular

METHODS = ["sequential", "jacobi", "jacobi_gs", "gs_jacobi"]


def _kwargs(method, block_size):
    return {"block_size": block_size} if method in ("jacobi_gs", "gs_jacobi") else {}


def _bound(method, T, block_size):
    return {"sequential": T, "jacobi": T, "gs_jacobi": T,
            "jacobi_gs": math.ceil(T / block_size) if block_size else T}[method]


@st.composite
def systems(draw):
    batch = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    pos = draw(st.lists(st.integers(1, 5), min_size=1, max_size=2))
    feat = draw(st.lists(st.integers(1, 3), min_size=0, max_size=1))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    gain = draw(st.sampled_from([0.3, 1.5, 4.0]))
    seed = draw(st.integers(0, 2**16))
    method = draw(st.sampled_from(METHODS))
    T = math.prod(pos)
    block = draw(st.integers(1, T + 1))
    fast = draw(st.booleans())
    cls = FastTriangular if fast else RandomTriangular
    prob = cls(batch, pos, feat, dtype, seed=seed, gain=gain)
    nb = len(batch)
    dim = tuple(range(nb, nb + len(pos)))
    if len(dim) == 1:
        dim = draw(st.sampled_from([dim[0], dim[0] - len(prob.shape)]))
    else:
        dim = draw(st.sampled_from([dim, tuple(d - len(prob.shape) for d in dim)]))
    return prob, method, block, dim, fast


@settings(max_examples=150, deadline=None)
@given(systems())
def test_every_method_returns_the_sequential_result(case):
    prob, method, block, dim, fast = case
    x0 = prob.x0()
    ref = prob.reference(x0)
    dtype = x0.dtype
    tol = TOLERANCES[dtype]
    bs = block if method in ("jacobi_gs", "gs_jacobi") else None
    # tol=0: a bitwise fixed point. Plain callables compute every position with the same
    # operations whatever else is asked, so the result is bitwise the sequential one.
    sol = paraprop.solve(prob, x0, method=method, dim=dim, tol=0, **_kwargs(method, bs))
    assert sol.converged
    assert sol.value.shape == x0.shape and sol.value.dtype == dtype
    if fast:
        assert (sol.value - ref).abs().max() <= tol["max_err"]
    else:
        assert torch.equal(sol.value, ref)
    assert sol.iterations <= _bound(method, prob.T, bs)
    # a small positive tol stops earlier but stays within the table's tolerance
    sol = paraprop.solve(prob, x0, method=method, dim=dim, tol=tol["solve_tol"],
                         **_kwargs(method, bs))
    assert (sol.value - ref).abs().max() <= tol["max_err"]
    assert sol.iterations <= _bound(method, prob.T, bs)


@pytest.mark.parametrize("method", METHODS)
def test_strongly_coupled_map_is_exact_within_the_bound(method):
    # large weights: no early convergence, every method runs to its bound and is still exact
    prob = RandomTriangular((2,), (12,), (), seed=3, gain=30.0)
    x0 = prob.x0()
    sol = paraprop.solve(prob, x0, method=method, tol=0, **_kwargs(method, 4))
    assert torch.equal(sol.value, prob.reference(x0))
    assert sol.iterations <= _bound(method, 12, 4)
    assert sol.converged


def test_jacobi_exact_after_k_sweeps_on_the_prefix():
    # Proposition 1: after k sweeps the first k positions are final
    prob = RandomTriangular((3,), (10,), (2,), seed=5, gain=20.0)
    x0 = prob.x0()
    ref = prob.reference(x0)
    for k in range(1, 11):
        sol = paraprop.solve(prob, x0, dim=1, tol=0, max_iters=k, throw=False)
        assert torch.equal(sol.value[:, :k], ref[:, :k])


def test_jacobi_gs_proposition_2_blocks_final_after_k_iterations():
    prob = RandomTriangular((2,), (12,), (), seed=7, gain=20.0)
    x0 = prob.x0()
    ref = prob.reference(x0)
    for k in range(1, 4):
        sol = paraprop.solve(prob, x0, method="jacobi_gs", block_size=4, tol=0, max_iters=k,
                             throw=False)
        assert torch.equal(sol.value[:, : 4 * k], ref[:, : 4 * k])
        # 4 sequential steps per iteration; at the bound (k = 3) one more sweep verifies the
        # fixed point when the last iteration still moved
        assert sol.evaluations == 4 * k or (k == 3 and sol.evaluations == 16)


def test_each_sample_stops_on_its_own():
    # sample 0 has no coupling (converges at once), sample 1 is strongly coupled
    prob = RandomTriangular((2,), (16,), (), seed=1, gain=3.0, scale=[0.0, 1.0])
    x0 = prob.x0()
    sol = paraprop.solve(prob, x0, tol=0)
    it = sol.stats["sample_iterations"]
    assert it.shape == (2,)
    assert it[0] == 2 and it[1] > it[0]  # one sweep to reach the fixed point, one to see it
    assert sol.iterations == int(it.max())
    assert torch.equal(sol.value, prob.reference(x0))


def test_fast_path_computes_only_requested_positions():
    prob = FastTriangular((4,), (20,), (2,), seed=2)
    x0 = prob.x0()
    ref = prob.reference(x0)
    seq = paraprop.solve(prob, x0, method="sequential", dim=1)
    assert prob.calls == [1] * 20 and seq.stats["positions"] == 20
    prob.calls.clear()
    sol = paraprop.solve(prob, x0, method="gs_jacobi", block_size=5, dim=1, tol=0)
    assert set(prob.calls) == {5} and sol.stats["positions"] == 5 * sol.evaluations
    assert (sol.value - ref).abs().max() <= 1e-12
    prob.calls.clear()
    sol = paraprop.solve(prob, x0, method="jacobi_gs", block_size=8, dim=1, tol=0)
    assert sorted(set(prob.calls)) == [2, 3]  # 20 positions in blocks of 8: offsets 0-3 hit 3
    assert (sol.value - ref).abs().max() <= 1e-12


def test_l2_norm_and_residual_history():
    prob = RandomTriangular((3,), (30,), (), seed=4, gain=0.5)
    x0 = prob.x0()
    sol = paraprop.solve(prob, x0, norm="l2", tol=1e-10)
    assert sol.residuals.shape == (sol.iterations,)
    assert sol.residuals[-1] <= 1e-10 < sol.residuals[0]
    assert (sol.value - prob.reference(x0)).abs().max() <= 1e-9


def test_callback_sees_every_iteration():
    prob = RandomTriangular((2,), (9,), (), seed=4)
    seen = []
    sol = paraprop.solve(prob, prob.x0(), callback=lambda k, v, r: seen.append((k, v.shape, r)))
    assert [k for k, _, _ in seen] == list(range(1, sol.iterations + 1))
    assert all(shape == (2, 9) for _, shape, _ in seen)


def test_solution_is_frozen():
    prob = RandomTriangular((), (4,), ())
    sol = paraprop.solve(prob, prob.x0())
    with pytest.raises(AttributeError):
        sol.iterations = 3


def test_unconverged_result_with_throw_false():
    prob = RandomTriangular((2,), (20,), (), seed=9, gain=8.0)
    sol = paraprop.solve(prob, prob.x0(), max_iters=2, throw=False, tol=0)
    assert not sol.converged and sol.iterations == 2
    with pytest.raises(paraprop.ConvergenceError, match="did not converge within max_iters=2") as e:
        paraprop.solve(prob, prob.x0(), max_iters=2, tol=0)
    assert e.value.solution is not None and not e.value.solution.converged


# -- bad input: every error names the argument and the offending value -------------------------

def _prob():
    return RandomTriangular((2,), (6,), ())


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"method": "newtonish"}, ValueError, r"unknown method='newtonish'"),
        ({"method": "jacobi_gs"}, ValueError, r"block_size is required for method='jacobi_gs'"),
        ({"method": "gs_jacobi", "block_size": 0}, ValueError, r"block_size must be a positive"),
        ({"method": "jacobi_gs", "block_size": -3}, ValueError, r"got -3"),
        ({"method": "jacobi", "block_size": 4}, ValueError, r"only used by the hybrid"),
        ({"dim": 2}, ValueError, r"dim=2 is out of range for x0 with 2 dims"),
        ({"dim": -3}, ValueError, r"dim=-3 is out of range"),
        ({"dim": (0, 0)}, ValueError, r"consecutive dims"),
        ({"dim": "x"}, TypeError, r"dim must be an int"),
        ({"tol": -1e-3}, ValueError, r"tol must be a number >= 0, got -0.001"),
        ({"norm": "l1"}, ValueError, r"unknown norm='l1'"),
        ({"max_iters": 0}, ValueError, r"max_iters must be a positive int or None, got 0"),
        ({"callback": 3}, TypeError, r"callback must be callable"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    prob = _prob()
    with pytest.raises(exc, match=match):
        paraprop.solve(prob, prob.x0(), **kwargs)


def test_bad_x0():
    prob = _prob()
    with pytest.raises(TypeError, match="x0 must be a torch.Tensor, got list"):
        paraprop.solve(prob, [0.0] * 6)
    with pytest.raises(TypeError, match="floating-point dtype, got torch.int64"):
        paraprop.solve(prob, torch.zeros(2, 6, dtype=torch.long))
    x0 = prob.x0()
    x0[1, 2] = float("nan")
    with pytest.raises(ValueError, match="x0 must be finite"):
        paraprop.solve(prob, x0)
    with pytest.raises(TypeError, match="fn must be callable"):
        paraprop.solve(42, prob.x0())


def test_fn_returning_wrong_shape_dtype_or_type():
    x0 = torch.zeros(2, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"returned shape \(2, 5\), expected \(2, 6\)"):
        paraprop.solve(lambda x: x[:, :5], x0)
    with pytest.raises(TypeError, match="returned dtype torch.float32, expected torch.float64"):
        paraprop.solve(lambda x: x.float(), x0)
    with pytest.raises(TypeError, match="must return a torch.Tensor, got list"):
        paraprop.solve(lambda x: [1.0], x0)


@pytest.mark.parametrize("method", METHODS)
def test_non_finite_values_name_iteration_and_position(method):
    prob = _prob()

    def fn(x):
        y = prob(x).clone()
        y[1, 4] = float("inf")
        return y

    with pytest.raises(paraprop.NonFiniteError, match=r"sample \(1,\), position \(4,\)"):
        paraprop.solve(fn, prob.x0(), method=method, **_kwargs(method, 3))


@pytest.mark.parametrize("method", ["jacobi", "jacobi_gs", "gs_jacobi"])
def test_not_triangular_is_detected(method):
    prob = RandomTriangular((2,), (10,), (), seed=0, gain=3.0, strict=False)
    with pytest.raises(paraprop.NotTriangularError,
                       match="depends on itself or on a later one"):
        paraprop.solve(prob, prob.x0(), method=method, tol=0, **_kwargs(method, 5))


def test_multi_dim_positions_in_raster_order():
    # dim=(1, 2): pixels in raster order; the last dim holds the values of a pixel
    prob = RandomTriangular((2,), (3, 4), (2,), seed=11, gain=2.0)
    x0 = prob.x0()
    sol = paraprop.solve(prob, x0, dim=(1, 2), tol=0)
    assert torch.equal(sol.value, prob.reference(x0))
    assert sol.stats["T"] == 12
    with pytest.raises(ValueError, match=r"dim=\(1, 3\) must name consecutive dims"):
        paraprop.solve(prob, x0, dim=(1, 3))


class _SelfDependent:
    """Triangular except that position ``t_self`` also reads itself (a contraction there)."""

    def __init__(self, T, t_self):
        self.prob = RandomTriangular((2,), (T,), (), seed=6, gain=2.0)
        self.t = t_self

    def __call__(self, x):
        y = self.prob(x).clone()
        y[:, self.t] = y[:, self.t] + 0.5 * torch.tanh(x[:, self.t])
        return y


@pytest.mark.parametrize(("method", "T", "t_self", "bs"), [
    ("jacobi", 8, 7, None),  # only the last position reads itself
    ("jacobi_gs", 8, 7, 4),
    ("gs_jacobi", 8, 3, 4),  # the last position of the first block
    ("gs_jacobi", 8, 7, 4),
])
def test_self_dependence_at_the_end_is_caught(method, T, t_self, bs):
    fn = _SelfDependent(T, t_self)
    with pytest.raises(paraprop.NotTriangularError, match="depends on itself or on a later one"):
        paraprop.solve(fn, fn.prob.x0(), method=method, tol=0, **_kwargs(method, bs))


def test_verification_costs_one_evaluation_and_no_iteration():
    # strongly coupled: Jacobi still moves at sweep T; one extra call confirms the fixed point
    prob = RandomTriangular((2,), (6,), (), seed=3, gain=40.0)
    sol = paraprop.solve(prob, prob.x0(), tol=0)
    assert sol.iterations == 6 and sol.evaluations in (6, 7)
    assert torch.equal(sol.value, prob.reference(prob.x0()))


def test_empty_x0_is_rejected():
    with pytest.raises(ValueError, match=r"x0 must not be empty, got shape \(2, 0\)"):
        paraprop.solve(lambda x: x, torch.zeros(2, 0))
