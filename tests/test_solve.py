"""paraprop.solve: every method returns the sequential result (Song et al. 2021, Props 1-2)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paraprop
from paraprop.solvers import (
    ELK,
    GSJacobi,
    Jacobi,
    JacobiGS,
    Newton,
    QuasiELK,
    QuasiNewton,
    Sequential,
    SlidingJacobi,
    TriangularAnderson,
)
from problems import TOLERANCES, FastTriangular, RandomTriangular, Windowed

METHODS = ["sequential", "jacobi", "jacobi_gs", "gs_jacobi"]


def _method(method, block_size):
    """The solver for ``method``: the hybrids configured with ``block_size``, others by name."""
    return {"jacobi_gs": JacobiGS, "gs_jacobi": GSJacobi}[method](block_size) \
        if method in ("jacobi_gs", "gs_jacobi") else method


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
    # tol=0: a bitwise fixed point of fn. Plain callables compute every position with the same
    # operations whatever else is asked, so the result is bitwise the sequential one.
    sol = paraprop.solve(prob, x0, method=_method(method, bs), dim=dim, tol=0, throw=False)
    assert sol.value.shape == x0.shape and sol.value.dtype == dtype
    if fast and method != "sequential":
        # fn.update's row-subset products may round differently from fn's full product: the
        # one evaluation of fn at the end then finds a rounding-level difference and says so
        if sol.converged:
            assert torch.equal(sol.value, ref)
        else:
            assert "by rounding only" in sol.stats["not_converged"]
        assert (sol.value - ref).abs().max() <= tol["max_err"]
    elif fast:   # the reference loop with fn.update
        assert sol.converged and (sol.value - ref).abs().max() <= tol["max_err"]
    else:
        assert sol.converged and torch.equal(sol.value, ref)
    assert sol.iterations <= _bound(method, prob.T, bs)
    # a small positive tol stops earlier but stays within the table's tolerance
    sol = paraprop.solve(prob, x0, method=_method(method, bs), dim=dim, tol=tol["solve_tol"])
    assert (sol.value - ref).abs().max() <= tol["max_err"]
    assert sol.iterations <= _bound(method, prob.T, bs)


@pytest.mark.parametrize("method", METHODS)
def test_strongly_coupled_map_is_exact_within_the_bound(method):
    # large weights: no early convergence, every method runs to its bound and is still exact
    prob = RandomTriangular((2,), (12,), (), seed=3, gain=30.0)
    x0 = prob.x0()
    sol = paraprop.solve(prob, x0, method=_method(method, 4), tol=0)
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
        sol = paraprop.solve(prob, x0, method=JacobiGS(block_size=4), tol=0, max_iters=k,
                             throw=False)
        assert torch.equal(sol.value[:, : 4 * k], ref[:, : 4 * k])
        # 4 sequential steps per iteration; the last block is finished by 4 sequential steps
        # (the last one an evaluation of fn that checks the value): never more than T
        assert sol.evaluations == 4 * k <= 12


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
    # one evaluation of fn at the end checks the update path's value (T positions)
    sol = paraprop.solve(prob, x0, method=GSJacobi(block_size=5), dim=1, tol=0, throw=False)
    assert set(prob.calls) == {5} and len(prob.calls) == sol.evaluations - 1
    assert sol.stats["positions"] == 5 * (sol.evaluations - 1) + 20 and sol.evaluations <= 20
    assert sol.stats["verification"] in ("evaluation", "failed")
    assert (sol.value - ref).abs().max() <= 1e-12
    prob.calls.clear()
    sol = paraprop.solve(prob, x0, method=JacobiGS(block_size=8), dim=1, tol=0, throw=False)
    # 20 positions in blocks of 8: offsets 0-3 hit 3 blocks, the others 2; the last block is
    # finished by the sweep's first offsets (one sequential step each) and an evaluation of fn
    assert sorted(set(prob.calls)) == [2, 3] and sol.evaluations <= 20
    assert sol.stats["finished_sequentially"] == 4
    assert (sol.value - ref).abs().max() <= 1e-12
    # with tol > 0 too, one evaluation of fn checks the value against the certificate
    prob.calls.clear()
    sol = paraprop.solve(prob, x0, method=GSJacobi(block_size=5), dim=1, tol=1e-10)
    assert len(prob.calls) == sol.evaluations - 1 and sol.stats["verification"] == "evaluation"
    assert sol.evaluations <= 20


def test_hooks_that_round_differently_are_not_certified_at_tol_zero():
    """FastTriangular's update multiplies a subset of W's rows: on this machine's BLAS that
    rounds differently from fn's full product. tol=0 promises fn's sequential result bitwise;
    the methods that compute with fn.update cannot give it, and say so."""
    prob = FastTriangular((4,), (20,), (2,), seed=2)
    x0 = prob.x0()
    ref = prob.reference(x0)   # position by position with fn itself
    for method in (GSJacobi(5), JacobiGS(8), SlidingJacobi(4)):
        sol = paraprop.solve(prob, x0, method=method, dim=1, tol=0, throw=False)
        if sol.converged:      # a BLAS that rounds the rows alike: then bitwise
            assert torch.equal(sol.value, ref)
            continue
        assert sol.stats["verification"] == "failed" and sol.stats["error_estimate"] == math.inf
        assert "fn.update(x, index) rounds differently from fn(x)" in sol.stats["not_converged"]
        with pytest.raises(paraprop.ConvergenceError,
                           match=r"did not converge: fn\(x\) at the final value differs from it "
                                 r"by rounding only .*pass tol > 0"):
            paraprop.solve(prob, x0, method=method, dim=1, tol=0)
        # a tol at the rounding level accepts it
        ok = paraprop.solve(prob, x0, method=method, dim=1, tol=1e-12)
        assert ok.converged and (ok.value - ref).abs().max() <= 1e-12
    # Jacobi computes with fn alone: its fixed point is fn's sequential result, bitwise
    sol = paraprop.solve(prob, x0, method="jacobi", dim=1, tol=0)
    assert torch.equal(sol.value, ref) and sol.stats["verification"] == "iterations"


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
        ({"method": "newtonish"}, ValueError,
         r"unknown method='newtonish'; choose one of sequential, jacobi, .*solver object"),
        ({"method": object()}, TypeError,
         r"method must be a method name or a solver object from paraprop.solvers, got object"),
        ({"method": 3}, TypeError, r"method must be a method name or a solver object.*got int"),
        # settings belong to the solver objects now; solve() itself no longer takes them
        ({"method": "jacobi_gs", "block_size": 4}, TypeError, r"unexpected keyword.*block_size"),
        ({"method": "elk", "damping": 1e-3}, TypeError, r"unexpected keyword.*damping"),
        ({"dim": 2}, ValueError, r"dim=2 is out of range for x0 with 2 dims"),
        ({"dim": -3}, ValueError, r"dim=-3 is out of range"),
        ({"dim": (0, 0)}, ValueError, r"consecutive dims"),
        ({"dim": "x"}, TypeError, r"dim must be an int"),
        ({"tol": -1e-3}, ValueError, r"tol must be a number >= 0, got -0.001"),
        ({"norm": "l1"}, ValueError, r"unknown norm='l1'"),
        ({"tol": float("nan")}, ValueError, r"tol must be a number >= 0, got nan"),
        ({"tol": "1e-5"}, ValueError, r"tol must be a number >= 0, got '1e-5'"),
        ({"max_iters": 0}, ValueError, r"max_iters must be a positive int or None, got 0"),
        ({"max_iters": -2}, ValueError, r"max_iters must be a positive int or None, got -2"),
        ({"max_iters": 2.5}, ValueError, r"max_iters must be a positive int or None, got 2.5"),
        ({"max_iters": True}, ValueError, r"max_iters must be a positive int or None, got True"),
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
    for bad in ([float("inf")], [float("inf"), -float("inf")]):   # the latter sums to NaN
        x0 = prob.x0()
        x0.view(-1)[:len(bad)] = torch.tensor(bad, dtype=x0.dtype)
        with pytest.raises(ValueError, match="x0 must be finite"):
            paraprop.solve(prob, x0)
    # finite entries whose sum overflows are finite: accepted (the full check decides)
    x0 = prob.x0()
    x0.fill_(1e308)
    assert not torch.isfinite(x0.sum())
    paraprop.solve(prob, x0, method="sequential")
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
        paraprop.solve(fn, prob.x0(), method=_method(method, 3))


@pytest.mark.parametrize("method", ["jacobi", "jacobi_gs", "gs_jacobi"])
def test_not_triangular_is_detected(method):
    prob = RandomTriangular((2,), (10,), (), seed=0, gain=3.0, strict=False)
    with pytest.raises(paraprop.NotTriangularError,
                       match="depends on itself or on a later one"):
        paraprop.solve(prob, prob.x0(), method=_method(method, 5), tol=0)


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
    ("jacobi_gs", 8, 3, 4),  # the last position of the first block
    ("gs_jacobi", 8, 3, 4),
    ("sliding_jacobi", 8, 3, 4),
    ("jacobi", 8, 5, None),
    ("anderson", 8, 5, None),
])
def test_self_dependence_is_caught(method, T, t_self, bs):
    fn = _SelfDependent(T, t_self)
    with pytest.raises(paraprop.NotTriangularError, match="depends on itself or on a later one"):
        paraprop.solve(fn, fn.prob.x0(), method=_method(method, bs), tol=0)


@pytest.mark.parametrize("method", ["jacobi", "jacobi_gs", "gs_jacobi", "sliding_jacobi",
                                    "anderson"])
def test_a_last_position_that_reads_itself_gets_the_sequential_loops_value(method):
    """Within T calls nothing can see that the last position reads itself (the sequential loop
    computes it once, from x0's value there, and never again). The last call computes it as
    that loop does: the result is the sequential loop's, bitwise, in at most T calls."""
    fn = _SelfDependent(8, 7)
    x0 = fn.prob.x0()
    ref = paraprop.solve(fn, x0, method="sequential")
    sol = paraprop.solve(fn, x0, method=_method(method, 4), tol=0)
    assert sol.converged and torch.equal(sol.value, ref.value) and sol.evaluations <= 8


def test_the_bound_costs_no_more_calls_than_the_sequential_loop():
    # strongly coupled: Jacobi still moves at sweep T, which computes the last position from
    # the final ones and checks every other: T calls, no more
    prob = RandomTriangular((2,), (6,), (), seed=3, gain=40.0)
    sol = paraprop.solve(prob, prob.x0(), tol=0)
    assert sol.iterations == 6 and sol.evaluations == 6
    assert torch.equal(sol.value, prob.reference(prob.x0()))


def test_empty_x0_is_rejected():
    with pytest.raises(ValueError, match=r"x0 must not be empty, got shape \(2, 0\)"):
        paraprop.solve(lambda x: x, torch.zeros(2, 0))


@pytest.mark.parametrize("cls", [JacobiGS, ELK, Jacobi])
def test_solver_class_instead_of_an_instance_is_rejected(cls):
    # a class is not a solver object: the TypeError must say so, not fail later inside bound()
    prob = _prob()
    with pytest.raises(TypeError, match=r"method must be a method name or a solver object"):
        paraprop.solve(prob, prob.x0(), method=cls)


# -- solver objects: settings, validation, repr ------------------------------------------------

@pytest.mark.parametrize(("make", "match"), [
    (lambda: JacobiGS(block_size=0), r"^JacobiGS: block_size must be a positive int or None, "
                                     r"got 0$"),
    (lambda: JacobiGS(block_size=-3), r"^JacobiGS: block_size must be .*got -3$"),
    (lambda: JacobiGS(block_size=2.0), r"^JacobiGS: block_size must be .*got 2.0$"),
    (lambda: JacobiGS(block_size=True), r"^JacobiGS: block_size must be .*got True$"),
    (lambda: GSJacobi(block_size=0), r"^GSJacobi: block_size must be a positive int or None, "
                                     r"got 0$"),
    (lambda: GSJacobi(block_size="4"), r"^GSJacobi: block_size must be .*got '4'$"),
    (lambda: SlidingJacobi(window=0), r"^SlidingJacobi: window must be a positive int or None, "
                                      r"got 0$"),
    (lambda: SlidingJacobi(window=-1), r"^SlidingJacobi: window must be .*got -1$"),
    (lambda: ELK(damping=0), r"^ELK: damping must be a number > 0, got 0$"),
    (lambda: ELK(damping=-1.0), r"^ELK: damping must be a number > 0, got -1.0$"),
    (lambda: QuasiELK(damping=True), r"^QuasiELK: damping must be a number > 0, got True$"),
    (lambda: QuasiELK(damping=float("nan")), r"^QuasiELK: damping must be .*got nan$"),
])
def test_solver_settings_are_validated_in_the_constructor(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("cls", [Sequential, Jacobi, Newton, QuasiNewton])
def test_solvers_without_settings_take_no_arguments(cls):
    with pytest.raises(TypeError):
        cls(3)


@pytest.mark.parametrize(("solver", "text"), [
    (Sequential(), "Sequential()"),
    (Jacobi(), "Jacobi()"),
    (JacobiGS(), "JacobiGS(block_size=None)"),
    (JacobiGS(block_size=4), "JacobiGS(block_size=4)"),
    (GSJacobi(), "GSJacobi(block_size=None)"),
    (GSJacobi(block_size=7), "GSJacobi(block_size=7)"),
    (SlidingJacobi(), "SlidingJacobi(window=None)"),
    (SlidingJacobi(window=16), "SlidingJacobi(window=16)"),
    (Newton(), "Newton()"),
    (QuasiNewton(), "QuasiNewton()"),
    (ELK(), "ELK(damping=0.01)"),
    (ELK(damping=1e-3), "ELK(damping=0.001)"),
    (QuasiELK(), "QuasiELK(damping=0.01)"),
    (QuasiELK(damping=2), "QuasiELK(damping=2.0)"),
])
def test_solver_repr_names_the_class_and_its_settings(solver, text):
    assert repr(solver) == text
    # the repr is a constructor call that rebuilds an equivalent solver
    assert repr(eval(text)) == text  # noqa: S307


def test_names_and_solver_objects_agree():
    names = {Sequential: "sequential", Jacobi: "jacobi", JacobiGS: "jacobi_gs",
             GSJacobi: "gs_jacobi", SlidingJacobi: "sliding_jacobi", Newton: "newton",
             QuasiNewton: "quasi_newton", ELK: "elk", QuasiELK: "quasi_elk",
             TriangularAnderson: "anderson"}
    assert paraprop.solvers.SOLVERS == {name: cls for cls, name in names.items()}
    for cls, name in names.items():
        assert cls.name == name


PLAIN_SOLVERS = [Sequential(), Jacobi(), JacobiGS(), JacobiGS(block_size=3), GSJacobi(),
                 GSJacobi(block_size=3), SlidingJacobi(), SlidingJacobi(window=4),
                 TriangularAnderson(), TriangularAnderson(memory=5)]


@pytest.mark.parametrize("solver", PLAIN_SOLVERS, ids=repr)
def test_solve_accepts_each_solver_object(solver):
    prob = RandomTriangular((2,), (10,), (2,), seed=12, gain=2.0)
    x0 = prob.x0()
    ref = prob.reference(x0)
    sol = paraprop.solve(prob, x0, method=solver, dim=1, tol=0)
    assert sol.converged and sol.method == solver.name
    assert torch.equal(sol.value, ref)
    assert sol.iterations <= sol.stats["bound"]
    by_name = paraprop.solve(prob, x0, method=solver.name, dim=1, tol=0)
    assert torch.equal(by_name.value, ref)


@pytest.mark.parametrize("solver", [Newton(), QuasiNewton(), ELK(), ELK(damping=1e-3),
                                    QuasiELK(), QuasiELK(damping=0.5)], ids=repr)
def test_solve_accepts_each_newton_solver_object(solver):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 3, generator=g, dtype=torch.float64) * 0.5
    u = torch.randn(2, 9, 3, generator=g, dtype=torch.float64)
    rec = paraprop.Recurrence(lambda x, h: torch.tanh(x + h @ W.T), u,
                              torch.zeros(2, 3, dtype=torch.float64))
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2).value
    sol = paraprop.solve(rec, rec.zeros(), method=solver, dim=-2, tol=1e-12)
    assert sol.converged and sol.method == solver.name
    assert (sol.value - ref).abs().max() <= 1e-10
    if solver.damped:
        assert sol.stats["damping"] == solver.damping


def test_default_block_size_is_ceil_sqrt_T_and_reported():
    prob = RandomTriangular((2,), (10,), (), seed=3, gain=2.0)
    x0 = prob.x0()
    for method in ("jacobi_gs", JacobiGS(), "gs_jacobi", GSJacobi()):
        sol = paraprop.solve(prob, x0, method=method, tol=0)
        assert sol.stats["block_size"] == 4  # ceil(sqrt(10))
        assert torch.equal(sol.value, prob.reference(x0))
    sol = paraprop.solve(prob, x0, method=JacobiGS(block_size=3), tol=0)
    assert sol.stats["block_size"] == 3 and sol.stats["bound"] == 4
    # a block larger than T is clipped to T
    sol = paraprop.solve(prob, x0, method=GSJacobi(block_size=50), tol=0)
    assert sol.stats["block_size"] == 10
    sol = paraprop.solve(prob, x0, method="sliding_jacobi", tol=0)
    assert sol.stats["window"] == 10  # the default 64, clipped to T
    assert "block_size" not in paraprop.solve(prob, x0, method="jacobi", tol=0).stats


def test_solver_objects_are_reusable_across_problems():
    solver = JacobiGS(block_size=3)
    for T in (5, 12):
        prob = RandomTriangular((2,), (T,), (), seed=T, gain=2.0)
        x0 = prob.x0()
        sol = paraprop.solve(prob, x0, method=solver, tol=0)
        assert torch.equal(sol.value, prob.reference(x0))
        assert sol.stats["block_size"] == 3 and sol.stats["bound"] == math.ceil(T / 3)
    assert repr(solver) == "JacobiGS(block_size=3)"


def test_error_estimate_is_reported():
    prob = RandomTriangular((3,), (30,), (), seed=4, gain=0.5)
    x0 = prob.x0()
    ref = prob.reference(x0)
    sol = paraprop.solve(prob, x0, tol=1e-8)
    est = sol.stats["error_estimate"]
    assert 0 <= est <= 1e-8
    assert (sol.value - ref).abs().max() <= 1e-8
    unconv = paraprop.solve(prob, x0, tol=0, max_iters=1, throw=False)
    assert not unconv.converged and unconv.stats["error_estimate"] == math.inf


# -- every method on the device fixture's device (issue 28) ------------------------------------

def _on(prob, device):
    """``prob`` with its weights on ``device`` (the problems are built on the CPU)."""
    prob.W, prob.c, prob.scale = (t.to(device) for t in (prob.W, prob.c, prob.scale))
    return prob


class _DeviceFast(FastTriangular):
    """FastTriangular whose ``update`` builds its row index on the index's device."""

    def update(self, x, index):
        rows = (index[:, None] * self.F + torch.arange(self.F, device=index.device)).reshape(-1)
        y = torch.tanh(self.scale * (self._flat(x) @ self.W[rows].T) + self.c[rows])
        return y.reshape(*self.batch_shape, index.numel(), *self.feat_shape)


DEVICE_METHODS = [Sequential(), Jacobi(), JacobiGS(3), JacobiGS(blocks=[[0, 1, 2], [3, 4, 5, 6],
                                                                        [7, 8, 9]]),
                  GSJacobi(3), SlidingJacobi(4), SlidingJacobi(), TriangularAnderson()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("method", DEVICE_METHODS, ids=repr)
def test_every_method_on_the_device(method, dtype, device):
    prob = _on(RandomTriangular((2,), (10,), (2,), dtype, seed=3, gain=2.0), device)
    x0 = prob.x0().to(device)
    ref = prob.reference(x0)
    sol = paraprop.solve(prob, x0, method=method, dim=1, tol=0)
    assert sol.converged and sol.value.device == x0.device and torch.equal(sol.value, ref)
    assert sol.residuals.device.type == "cpu" and sol.stats["sample_iterations"].device.type == \
        "cpu"
    sol = paraprop.solve(prob, x0, method=method, dim=1, tol=TOLERANCES[dtype]["solve_tol"])
    assert sol.converged and (sol.value - ref).abs().max() <= TOLERANCES[dtype]["max_err"]
    # the fast path: the hooks' rounding may differ from fn's (then converged=False, said why)
    fast = _DeviceFast((2,), (10,), (2,), dtype, seed=3, gain=2.0)
    fast = _on(fast, device)
    sol = paraprop.solve(fast, x0, method=method, dim=1, tol=0, throw=False)
    assert sol.converged or "by rounding only" in sol.stats["not_converged"]
    assert (sol.value - ref).abs().max() <= TOLERANCES[dtype]["max_err"]


@pytest.mark.parametrize("method", [Newton(), QuasiNewton(), ELK(), QuasiELK()], ids=repr)
def test_newton_family_on_the_device(method, device):
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(3, 3, generator=g, dtype=torch.float64) * 0.5).to(device)
    u = torch.randn(2, 9, 3, generator=g, dtype=torch.float64).to(device)
    rec = paraprop.Recurrence(lambda x, h: torch.tanh(x + h @ W.T), u,
                              torch.zeros(2, 3, dtype=torch.float64, device=device))
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2).value
    for tol in (0, 1e-12):
        sol = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=tol)
        assert sol.converged and sol.value.device == ref.device
        assert (sol.value - ref).abs().max() <= 1e-12

    # a plain Markov fn: the Jacobians by forward mode, on the device too
    def fn(x):
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        return torch.tanh(u + prev @ W.T)

    x0 = torch.zeros(2, 9, 3, dtype=torch.float64, device=device)
    ref = paraprop.solve(fn, x0, method="sequential", dim=1).value
    sol = paraprop.solve(fn, x0, method=method, dim=1, tol=0)
    assert sol.converged and torch.equal(sol.value, ref)


# -- the stopping rule's host path (NumPy views) and accelerator path (tensor operators) ---------
def _rule_pair(B, rated):
    from paraprop import stopping

    host = stopping.ContractionRule(B, "cpu")
    device = stopping.ContractionRule(B, "cpu")
    device._host, device._ops = False, stopping._TORCH   # the accelerator's code path, here
    device._views()
    assert host._ops is stopping._NUMPY
    return host, device


@pytest.mark.parametrize("rated", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_rule_on_the_host_agrees_with_the_accelerator_path(rated, seed):
    """The host runs the rule's (B,) arithmetic on NumPy views, an accelerator on tensors: the
    same IEEE operations, so the same stops, estimates of the stopping samples and rounding
    floor bitwise (the host skips the estimate where no sample can stop), on sequences with
    zeros, infinities, steps at the noise level, and samples leaving."""
    from paraprop.stopping import Floor

    g = torch.Generator().manual_seed(seed)
    B, tol = 7, 1e-3
    host, device = _rule_pair(B, rated)
    active = torch.ones(B, dtype=torch.bool)
    d = torch.rand(B, generator=g, dtype=torch.float64)
    stops = 0
    for k in range(40):
        d = d * torch.rand(B, generator=g, dtype=torch.float64) * 0.6
        d[torch.rand(B, generator=g) < 0.1] = 0.0
        if k % 7 == 3:
            d[0] = math.inf
        bound = torch.rand(B, generator=g, dtype=torch.float64) * (1e-4 if k % 4 == 1 else 1e-5)
        floor = Floor(bound, bound * 1.5, 2.0 ** -24) if k % 2 else bound
        rate = torch.rand(B, generator=g, dtype=torch.float64) if rated else None
        dd = torch.where(active, d, 0.0)
        budget = tol * (0.5 if k % 3 else 1.0)
        s1, e1 = host.update(dd, tol, active, budget, rate=rate, floor=floor)
        s2, e2 = device.update(dd, tol, active, budget, rate=rate, floor=lambda f=floor: f)
        assert torch.equal(s1, s2) and torch.equal(torch.where(s1, e1, 0.0),
                                                   torch.where(s2, e2, 0.0)), k
        assert torch.equal(host.blocked, device.blocked) and torch.equal(host.d_prev,
                                                                          device.d_prev)
        active = active & ~s1
        stops += int(s1.sum())
        if k == 20:
            for r in (host, device):
                r.reset()
            active = torch.ones(B, dtype=torch.bool)
    assert stops > 0


def test_the_rule_takes_rate_in_every_call_or_in_none():
    from paraprop.stopping import ContractionRule

    rule = ContractionRule(2, "cpu")
    on = torch.ones(2, dtype=torch.bool)
    rule.update(torch.ones(2, dtype=torch.float64), 1.0, on)
    with pytest.raises(ValueError, match="ContractionRule: pass rate in every call or in none"):
        rule.update(torch.ones(2, dtype=torch.float64), 1.0, on,
                    rate=torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("method", [Jacobi(), GSJacobi(3), JacobiGS(3)],
                         ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_host_bookkeeping_agrees_with_the_tensor_path(monkeypatch, method, dtype):
    """accept's (B,) bookkeeping runs on NumPy views on the host; with them off it runs the
    tensor operators an accelerator runs: the same sweeps, stops and estimates, bitwise."""
    from paraprop.stopping import ContractionRule

    g = torch.Generator().manual_seed(1)
    T, B = 12, 5
    W = (torch.randn(T, T, generator=g) * 0.4).tril(-1)
    scale = torch.logspace(-3, 1, B)[:, None]      # samples that stop at different sweeps

    def fn(x):
        return (torch.tanh(x.float() @ W.T + 1.0) * scale).to(x.dtype)

    x0 = torch.zeros(B, T, dtype=dtype)
    runs = []
    for host in (True, False):
        monkeypatch.setattr(ContractionRule, "host_arrays", property(lambda self, h=host: h))
        for tol in (1e-2, 1e-4):
            sol = paraprop.solve(fn, x0, method=method, tol=tol)
            runs.append((sol.value, sol.iterations, sol.stats["error_estimate"],
                         sol.stats["sample_iterations"], sol.residuals))
    for a, b in zip(runs[:2], runs[2:], strict=True):
        assert torch.equal(a[0], b[0]) and a[1:3] == b[1:3]
        assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])
    assert len(set(runs[0][3].tolist())) > 1   # the samples did stop on their own


# -- the budget: never more sequential steps than the sequential loop (issue 27 item 7) ---------
class _Markov:
    """``x_t = tanh(W x_{t-1} + 0.5)`` (x_{-1} = 0.3): a plain fn for the Newton family too."""

    def __init__(self, gain, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.W = torch.randn(2, 2, generator=g, dtype=torch.float64) * gain

    def __call__(self, x):
        prev = torch.cat([torch.full_like(x[:, :1], 0.3), x[:, :-1]], 1)
        return torch.tanh(prev @ self.W.T + 0.5)


BUDGET_METHODS = ["jacobi", "jacobi_gs", "gs_jacobi", "sliding_jacobi", "anderson", "newton",
                  "quasi_newton", "elk", "quasi_elk", JacobiGS(3), GSJacobi(3),
                  SlidingJacobi(1), SlidingJacobi(3), TriangularAnderson(1)]


@pytest.mark.parametrize("T", [1, 2, 3, 16, 20, 64])
@pytest.mark.parametrize("gain", [0.3, 30.0], ids=["weak", "strong"])
def test_never_more_calls_than_the_sequential_loop(T, gain):
    """The probe counted 72 calls of fn for jacobi_gs at T=64 (25 at T=20, 20 at T=16): more
    than the T of method="sequential". Every method, every map kind, tol=0 and the default:
    at most T calls (the final check included), and the sequential result."""
    rand = RandomTriangular((3,), (T,), (2,), seed=T, gain=gain)
    maps = {"plain": rand, "update": FastTriangular((3,), (T,), (2,), seed=T, gain=gain),
            "window": Windowed(rand), "markov": _Markov(gain, seed=T)}
    x0 = torch.zeros(3, T, 2, dtype=torch.float64)
    for name, fn in maps.items():
        ref = paraprop.solve(fn, x0, method="sequential", dim=1)
        assert ref.evaluations == T
        for method in BUDGET_METHODS:
            if name != "markov" and method in ("newton", "quasi_newton", "elk", "quasi_elk"):
                continue   # (the Newton family on a plain fn assumes a Markov map)
            for tol in (0.0, 1e-5):
                sol = paraprop.solve(fn, x0, method=method, dim=1, tol=tol, throw=False)
                what = (name, repr(method), tol, sol.evaluations)
                assert sol.evaluations <= T and sol.stats["sequential_steps"] <= T, what
                if name == "update" and not sol.converged:   # the hook rounds differently
                    assert "rounding" in sol.stats["not_converged"], what
                    continue
                assert sol.converged, what
                err = float((sol.value - ref.value).abs().max())
                assert err <= (1e-12 if tol == 0 else 10 * tol), what


def test_jacobi_gs_finishes_its_last_block_sequentially():
    """The probe's map (strongly coupled, T=64): block_size 8 took 8 iterations of 8 calls and a
    verifying sweep of 8 more. Now the last block is 8 sequential steps, the last of them the
    evaluation of fn that checks the value: 64 calls, counted in the stats."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, 64, generator=g, dtype=torch.float64).tril(-1) * 2.5

    def fn(x):
        return torch.tanh(x @ W.T + 1.0)

    x0 = torch.zeros(3, 64, dtype=torch.float64)
    ref = paraprop.solve(fn, x0, method="sequential")
    for tol in (0.0, 1e-5):
        sol = paraprop.solve(fn, x0, method="jacobi_gs", tol=tol)
        assert sol.evaluations == 64 and sol.iterations == 8 and sol.stats["block_size"] == 8
        assert sol.stats["finished_sequentially"] == 8
        assert sol.stats["verification"] == "evaluation"
        assert float((sol.value - ref.value).abs().max()) <= (0 if tol == 0 else 10 * tol)


def test_explicit_blocks_keep_the_budget_in_steps_of_their_longest_block():
    """With explicit blocks an iteration costs its longest block's calls in sequence (one worker
    per block): iterations run in parallel only while the worst case stays within T."""
    prob = FastTriangular((2,), (12,), (2,), seed=1, gain=30.0)
    x0 = torch.zeros(2, 12, 2, dtype=torch.float64)
    ref = prob.reference(x0)
    even = JacobiGS(blocks=[range(0, 4), range(4, 8), range(8, 12)], workers=3)
    sol = paraprop.solve(prob, x0, method=even, dim=1, tol=1e-10)
    assert sol.iterations <= 3 and sol.stats["sequential_steps"] <= 12
    assert float((sol.value - ref).abs().max()) <= 1e-9
    # a first block of one position cannot pay for an iteration of four steps: sequential
    uneven = JacobiGS(blocks=[range(0, 1), range(1, 5), range(5, 12)], workers=3)
    sol = paraprop.solve(prob, x0, method=uneven, dim=1, tol=1e-10)
    assert sol.iterations == 1 and sol.stats["finished_sequentially"] == 12
    assert sol.stats["sequential_steps"] == 12 and sol.evaluations == 12
    assert float((sol.value - ref).abs().max()) <= 1e-9
