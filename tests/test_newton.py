"""Newton-type methods of paraprop.solve ("newton" = DEER, "quasi_newton", "elk"): exact prefix
after every iteration, at most T iterations, per-sample stopping, divergence handling, plain
Markov callables, and ELK's parallel Kalman filter against a sequential filter."""

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paraprop
from paraprop.scan import linear_recurrence
from paraprop.solvers import ELK, GSJacobi, Jacobi, JacobiGS, Newton, QuasiELK, QuasiNewton
from paraprop.solvers.kalman import kalman_step

NEWTON = ["newton", "quasi_newton", "elk", "quasi_elk"]
DAMPED = ["elk", "quasi_elk"]
PARALLEL = ["jacobi", "jacobi_gs", "gs_jacobi", *NEWTON]
H = 3


pytestmark = pytest.mark.usefixtures("one_thread")


def solver(method, block_size=3):
    """``method`` as passed to solve: the hybrids configured with ``block_size``."""
    return {"jacobi_gs": JacobiGS, "gs_jacobi": GSJacobi}[method](block_size) \
        if method in ("jacobi_gs", "gs_jacobi") else method


def damped(method, damping):
    """``method`` with ``damping`` (``None``: the default) for the damped ones."""
    if method not in DAMPED or damping is None:
        return method
    return {"elk": ELK, "quasi_elk": QuasiELK}[method](damping=damping)


class ElementwiseCell:
    """``tanh(u + W h)`` with ``W h`` written as ``H`` elementwise multiply-adds: every row is
    computed by the same operations however many rows there are, so a position computed from an
    exact prefix is bitwise the sequential one."""

    def __init__(self, W):
        self.W = W

    def __call__(self, u, h):
        z = u.clone()
        for j in range(self.W.shape[1]):
            z = z + h[:, j:j + 1] * self.W[:, j]
        return torch.tanh(z)


def elementwise_problem(batch=(2,), T=13, gain=3.0, seed=0, dtype=torch.float64, device="cpu"):
    """A Recurrence of :class:`ElementwiseCell`; ``gain`` 3 makes it hard (chaotic)."""
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(H, H, generator=g, dtype=torch.float64) * gain).to(device, dtype)
    u = torch.randn(*batch, T, H, generator=g, dtype=torch.float64).to(device, dtype)
    h0 = (torch.randn(*batch, H, generator=g, dtype=torch.float64) * 0.5).to(device, dtype)
    rec = paraprop.Recurrence(ElementwiseCell(W), u, h0)
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2).value
    return rec, ref


def max_err(a, b):
    return float((a - b).abs().max())


# -- exactness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", [*NEWTON, "jacobi"])
def test_exact_prefix_after_every_iteration(method, device):
    rec, ref = elementwise_problem(device=device)
    seen = []

    def callback(k, value, residual):
        assert value.shape == rec.shape
        seen.append(k)
        assert torch.equal(value[:, :k], ref[:, :k]), k   # bitwise the sequential prefix

    sol = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=0, callback=callback)
    assert seen == list(range(1, sol.iterations + 1))
    assert sol.iterations <= rec.T and sol.converged
    assert torch.equal(sol.value, ref)


@pytest.mark.parametrize("method", NEWTON)
@pytest.mark.parametrize("kind", ["rnn", "gru", "lstm"])
def test_exact_prefix_with_torch_cells(method, kind):
    # the analytic Jacobian paths compute fn with other operations than the sequential rows,
    # so "exact" means within rounding here
    torch.manual_seed(0)
    dt = torch.float64
    cell = {"rnn": torch.nn.RNNCell(3, 4, dtype=dt), "gru": torch.nn.GRUCell(3, 4, dtype=dt),
            "lstm": torch.nn.LSTMCell(3, 4, dtype=dt)}[kind]
    with torch.no_grad():
        for p in cell.parameters():
            p.mul_(3)
    rec = paraprop.Recurrence(cell, torch.randn(3, 11, 3, dtype=dt))
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2).value
    errs = []
    sol = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=0,
                         callback=lambda k, v, r: errs.append(max_err(v[:, :k], ref[:, :k])))
    assert sol.iterations <= 11 and len(errs) == sol.iterations
    assert max(errs) <= 1e-14
    assert max_err(sol.value.detach(), ref.detach()) <= 1e-14


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(T=st.integers(1, 16), batch=st.sampled_from([(), (1,), (3,), (2, 2)]),
       gain=st.sampled_from([0.3, 1.0, 3.0, 8.0]), method=st.sampled_from(NEWTON),
       damping=st.sampled_from([None, 1e-6, 1.0, 1e3]), seed=st.integers(0, 2**16))
def test_tol_zero_is_bitwise_sequential_within_T(T, batch, gain, method, damping, seed):
    rec, ref = elementwise_problem(batch, T, gain, seed)
    sol = paraprop.solve(rec, rec.zeros(), method=damped(method, damping), dim=-2, tol=0)
    assert sol.converged and 1 <= sol.iterations <= T
    assert torch.equal(sol.value, ref)
    assert int(sol.stats["sample_iterations"].max()) == sol.iterations
    assert sol.stats["bound"] == T


@pytest.mark.parametrize("method", NEWTON)
def test_l2_norm_and_residual_history(method):
    rec, ref = elementwise_problem(T=40, gain=0.3)
    sol = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=1e-12, norm="l2")
    assert sol.iterations < 40     # stopped by tol, not by the bound
    assert sol.residuals.shape == (sol.iterations,) and sol.residuals.dtype == torch.float64
    assert sol.residuals[-1] <= 1e-12 < sol.residuals[0]
    assert max_err(sol.value, ref) <= 1e-12


def test_elk_damping_is_reported_and_only_damps():
    rec, ref = elementwise_problem(T=20, gain=1.0)
    default = paraprop.solve(rec, rec.zeros(), method="elk", dim=-2, tol=1e-13)
    assert default.stats["damping"] == 1e-2
    newton = paraprop.solve(rec, rec.zeros(), method="newton", dim=-2, tol=1e-13)
    tiny = paraprop.solve(rec, rec.zeros(), method=ELK(damping=1e-12), dim=-2, tol=1e-13)
    assert tiny.stats["damping"] == 1e-12
    assert tiny.iterations == newton.iterations     # lambda -> 0 is Newton
    heavy = paraprop.solve(rec, rec.zeros(), method=ELK(damping=1e4), dim=-2, tol=1e-13)
    assert heavy.iterations > newton.iterations     # heavy damping: small steps, still exact
    for sol in (default, newton, tiny, heavy):
        assert sol.converged and max_err(sol.value, ref) <= 1e-12
    assert "damping" not in newton.stats


# -- per-sample stopping and warm starts -------------------------------------------------------
class GatedCell:
    """``tanh(u[:, :H] + u[:, H] * W h)``: the last input feature switches the coupling."""

    def __init__(self, W):
        self.W = W

    def __call__(self, u, h):
        return torch.tanh(u[:, :H] + u[:, H:] * (h @ self.W.T))


@pytest.mark.parametrize("method", NEWTON)
def test_each_sample_stops_on_its_own(method):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(H, H, generator=g, dtype=torch.float64) * 3
    T = 20
    u = torch.randn(2, T, H + 1, generator=g, dtype=torch.float64)
    u[0, :, H] = 0      # sample 0: no coupling, J = 0
    u[1, :, H] = 1      # sample 1: strongly coupled
    rec = paraprop.Recurrence(GatedCell(W), u, hidden_size=H)
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2).value
    sol = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=1e-13)
    it = sol.stats["sample_iterations"]
    assert it.shape == (2,) and it.dtype == torch.long
    assert it[0] < it[1] and sol.iterations == int(it[1]) <= T
    if method not in DAMPED:   # one step is the exact solution, one more sees it
        assert it[0] == 2
    assert max_err(sol.value, ref) <= 1e-12


@pytest.mark.parametrize("method", PARALLEL)
def test_warm_start_from_the_solution(method):
    torch.manual_seed(0)
    cell = torch.nn.GRUCell(3, 4, dtype=torch.float64)
    rec = paraprop.Recurrence(cell, torch.randn(2, 15, 3, dtype=torch.float64))
    # the sequential loop (rec.update, one position per call) and fn's bitwise fixed point
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2).value.detach()
    fixed = paraprop.solve(rec, rec.zeros(), method="jacobi", dim=-2, tol=0).value.detach()
    assert max_err(fixed, ref) <= 1e-14
    # From fn's own fixed point every method that evaluates fn recomputes it bitwise: one step
    # (GS-Jacobi: one per block); Jacobi-GS, GS-Jacobi (row-subset updates) and quasi-ELK (its
    # float64 filter) may move it by rounding, and a step at the rounding level certifies
    # nothing: they run on, at most to their exactness bound.
    blocks = math.ceil(15 / 3) if method == "gs_jacobi" else 1
    cap = {"jacobi_gs": math.ceil(15 / 3), "gs_jacobi": 15, "quasi_elk": 15}.get(method, blocks)
    sol = paraprop.solve(rec, fixed.clone(), method=solver(method), dim=-2, tol=1e-13)
    assert sol.converged
    assert sol.iterations <= cap
    assert all(k <= cap for k in sol.stats["sample_iterations"].tolist())
    if method == "gs_jacobi":   # the blocks' longest samples add up: sum of max >= max of sums
        assert sol.iterations >= int(sol.stats["sample_iterations"].max())
    else:
        assert sol.iterations == int(sol.stats["sample_iterations"].max())
    assert max_err(sol.value.detach(), ref) <= 1e-14
    # From the sequential loop's value (rounding-level away from fn's fixed point) the steps are
    # at the rounding level: exact Newton's step bounds the error directly and stops at once;
    # the contraction estimates have no ratio above the noise and run on, within the bound.
    sol = paraprop.solve(rec, ref.clone(), method=solver(method), dim=-2, tol=1e-13)
    assert sol.converged and sol.iterations <= (1 if method == "newton" else 15)
    assert max_err(sol.value.detach(), ref) <= 1e-14


# -- divergence and failures -------------------------------------------------------------------
def overflow_problem():
    """``s_t = tanh(50 s_{t-1} + u_t)`` with tiny inputs, float32: at the zero guess every
    Jacobian is ~50, so Newton's linear recurrence multiplies by 50 per step and overflows."""
    g = torch.Generator().manual_seed(0)
    W = torch.eye(2) * 50
    u = torch.randn(3, 40, 2, generator=g) * 1e-3
    rec = paraprop.Recurrence(lambda x, h: torch.tanh(h @ W.T + x), u, hidden_size=2)
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2).value
    return rec, ref


@pytest.mark.parametrize("method", ["newton", "quasi_newton"])
def test_diverging_steps_are_reset_and_the_result_is_still_sequential(method):
    rec, ref = overflow_problem()
    sol = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=1e-6)
    assert sol.stats["resets"] > 0
    assert sol.converged and sol.iterations <= rec.T
    assert bool(torch.isfinite(sol.value).all())
    assert max_err(sol.value, ref) <= 1e-5


@pytest.mark.parametrize("method", DAMPED)
def test_elk_on_the_overflowing_problem(method):
    # the filter runs in float64 and damps where the Jacobian products grow
    rec, ref = overflow_problem()
    sol = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=1e-6)
    assert sol.converged and sol.iterations <= rec.T
    assert max_err(sol.value, ref) <= 1e-5


class NaNAt:
    """A GRU-like cell that returns NaN in the rows whose first input is the marker 99."""

    def __init__(self, W):
        self.W = W

    def __call__(self, u, h):
        y = torch.tanh(u + h @ self.W.T)
        return torch.where(u[:, :1] == 99, torch.full_like(y, math.nan), y)


@pytest.mark.parametrize("method", ["sequential", *PARALLEL])
def test_cell_returning_nan_raises_non_finite_error(method):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(H, H, generator=g, dtype=torch.float64)
    u = torch.randn(2, 8, H, generator=g, dtype=torch.float64)
    u[1, 5, 0] = 99
    rec = paraprop.Recurrence(NaNAt(W), u, hidden_size=H)
    with pytest.raises(paraprop.NonFiniteError,
                       match=r"non-finite value at iteration \d+, sample \(1,\), position \(5,\)"):
        paraprop.solve(rec, rec.zeros(), method=solver(method), dim=-2)


def test_non_finite_values_of_a_diverging_iterate_are_not_errors():
    """Finite but huge Newton iterates make this cell return NaN (|h| > 1e6 is outside its
    domain), at positions computed from iterates that are not final. The sequential loop stays
    finite, so the NaN is not the map's: those positions keep their old values, the sample
    takes the Jacobi update for that step (a reset), and the result is the sequential one."""
    g = torch.Generator().manual_seed(0)
    W = torch.eye(2, dtype=torch.float64) * 50
    u = torch.randn(3, 20, 2, generator=g, dtype=torch.float64) * 1e-3

    def cell(x, h):
        y = torch.tanh(h @ W.T + x)
        return torch.where(h.abs() > 1e6, torch.full_like(y, math.nan), y)

    rec = paraprop.Recurrence(cell, u, hidden_size=2)
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2).value
    sol = paraprop.solve(rec, rec.zeros(), method="newton", dim=-2, tol=1e-12)
    assert sol.converged and sol.stats["kept_non_finite"] > 0 and sol.stats["resets"] > 0
    assert bool(torch.isfinite(sol.value).all()) and max_err(sol.value, ref) <= 1e-12


@pytest.mark.parametrize("method", NEWTON)
def test_max_iters_raises_convergence_error(method):
    rec, ref = elementwise_problem()
    with pytest.raises(paraprop.ConvergenceError,
                       match=rf"method='{method}' did not converge within max_iters=2") as e:
        paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=0, max_iters=2)
    assert not e.value.solution.converged and e.value.solution.iterations == 2
    sol = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=0, max_iters=2,
                         throw=False)
    assert not sol.converged and sol.iterations == 2 and sol.residuals.shape == (2,)
    assert torch.equal(sol.value[:, :2], ref[:, :2])
    assert not torch.equal(sol.value, ref)


# -- plain callables ---------------------------------------------------------------------------
def markov_fn(batch=(2,), T=9, feat=(H,), gain=1.5, seed=0, lag2=0.0):
    """``fn(x)_t = tanh(u_t + W x_{t-1} + lag2 * x_{t-2})`` on the flattened features (a plain
    function; Markov when ``lag2 == 0``, triangular anyway), its zero guess and the same
    recurrence as a :class:`paraprop.Recurrence` (states ``(*batch, T, F)``)."""
    F = math.prod(feat)
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(F, F, generator=g, dtype=torch.float64) * gain / math.sqrt(F)
    u = torch.randn(*batch, T, F, generator=g, dtype=torch.float64)

    def fn(x):
        xf = x.reshape(*batch, T, F)
        prev = torch.cat([torch.zeros_like(xf[..., :1, :]), xf[..., :-1, :]], -2)
        prev2 = torch.cat([torch.zeros_like(xf[..., :2, :]), xf[..., :-2, :]], -2)[..., :T, :]
        return torch.tanh(u + prev @ W.T + lag2 * prev2).reshape(x.shape)

    rec = paraprop.Recurrence(lambda v, h: torch.tanh(v + h @ W.T), u, hidden_size=F)
    return fn, torch.zeros(*batch, T, *feat, dtype=torch.float64), rec


@pytest.mark.parametrize("method", NEWTON)
@pytest.mark.parametrize("feat", [(H,), (2, 3), ()], ids=str)
def test_plain_markov_callable(method, feat):
    fn, x0, rec = markov_fn(feat=feat)
    ref = paraprop.solve(fn, x0, method="sequential", dim=1).value
    seen = []
    sol = paraprop.solve(fn, x0, method=method, dim=1, tol=1e-13,
                         callback=lambda k, v, r: seen.append(v.clone()))
    assert sol.converged and sol.iterations <= 9
    assert sol.value.shape == x0.shape
    assert max_err(sol.value, ref) <= 1e-12
    F = math.prod(feat)
    assert sol.stats["jvps"] == F * sol.iterations     # one forward-mode product per feature
    # the forward-mode Jacobians are the recurrence's: the same iterates as with a Recurrence
    seen_rec = []
    sol_rec = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=1e-13,
                             callback=lambda k, v, r: seen_rec.append(v.clone()))
    assert sol_rec.iterations == sol.iterations
    for a, b in zip(seen, seen_rec, strict=True):
        assert max_err(a.reshape(b.shape), b) <= 1e-13


@pytest.mark.parametrize("method", NEWTON)
def test_plain_triangular_non_markov_callable_is_exact_within_T(method):
    fn, x0, _ = markov_fn(T=12, lag2=0.8, gain=2.0)
    ref = paraprop.solve(fn, x0, method="sequential", dim=1).value
    sol = paraprop.solve(fn, x0, method=method, dim=1, tol=1e-13)
    assert sol.converged and sol.iterations <= 12
    assert max_err(sol.value, ref) <= 1e-12


def _non_triangular(kind):
    fn, x0, _ = markov_fn(T=8)

    def bad(x):
        y = fn(x).clone()
        if kind == "self":          # every position reads itself
            y = y + 0.5 * torch.tanh(x)
        elif kind == "later":       # every position reads the next one
            y[:, :-1] = y[:, :-1] + 0.5 * torch.tanh(x[:, 1:])
        else:                       # only the last position reads itself
            y[:, -1] = y[:, -1] + 0.5 * torch.tanh(x[:, -1])
        return y

    return bad, x0


@pytest.mark.parametrize("method", NEWTON)
@pytest.mark.parametrize("kind", ["self", "later"])
def test_non_triangular_callable_is_detected(method, kind):
    fn, x0 = _non_triangular(kind)
    with pytest.raises(paraprop.NotTriangularError,
                       match="fn is not autoregressive along dim: position .* depends on itself "
                             "or on a later one"):
        paraprop.solve(fn, x0, method=method, dim=1, tol=1e-12)


@pytest.mark.parametrize("method", NEWTON)
def test_a_last_position_that_reads_itself_gets_the_sequential_loops_value(method):
    """No check within the sequential loop's T evaluations can see that the last position
    reads itself; the last iteration computes it as that loop does (from the final positions,
    with x0's value there), so the result is still the loop's."""
    fn, x0 = _non_triangular("last")
    ref = paraprop.solve(fn, x0, method="sequential", dim=1).value
    sol = paraprop.solve(fn, x0, method=method, dim=1, tol=1e-12)
    assert sol.converged and sol.evaluations <= x0.shape[1]
    assert max_err(sol.value, ref) <= 1e-11


def test_plain_callable_warm_start():
    fn, x0, _ = markov_fn()
    ref = paraprop.solve(fn, x0, method="sequential", dim=1).value
    sol = paraprop.solve(fn, ref.clone(), method="newton", dim=1, tol=1e-13)
    assert sol.iterations == 1 and max_err(sol.value, ref) <= 1e-15


# -- argument errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Jacobi, JacobiGS, GSJacobi, Newton, QuasiNewton])
def test_damping_only_for_elk(cls):
    # damping is a setting of the damped solvers only; no other solver (and not solve) takes it
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'damping'|takes no "
                                        r"arguments"):
        cls(damping=0.1)
    rec, _ = elementwise_problem(T=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'damping'"):
        paraprop.solve(rec, rec.zeros(), method="elk", dim=-2, damping=0.1)


@pytest.mark.parametrize("cls", [ELK, QuasiELK])
@pytest.mark.parametrize("damping,shown", [(0, "0"), (-1.0, "-1.0"), (True, "True"),
                                           ("0.1", "'0.1'"), (math.nan, "nan"),
                                           (-math.inf, "-inf")])
def test_damping_must_be_a_positive_number(cls, damping, shown):
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: damping must be a number > 0, "
                                         rf"got {shown}$"):
        cls(damping=damping)


@pytest.mark.parametrize("cls", [ELK, QuasiELK])
def test_damping_accepts_ints(cls):
    rec, ref = elementwise_problem(T=4)
    sol = paraprop.solve(rec, rec.zeros(), method=cls(damping=2), dim=-2, tol=0)
    assert sol.stats["damping"] == 2.0 and torch.equal(sol.value, ref)
    assert cls(damping=2).damping == 2.0 and repr(cls(damping=2)) == f"{cls.__name__}(damping=2.0)"


@pytest.mark.parametrize("method", NEWTON)
@pytest.mark.parametrize("shape,dim,want", [
    ((2, 13, 3), -1, "x0 has shape (2, 13, 3) with positions along dims of size (3,)"),
    ((2, 3, 13), -2, "x0 has shape (2, 3, 13) with positions along dims of size (3,)"),
], ids=["dim=-1", "transposed"])
def test_recurrence_needs_x0_of_rec_shape(method, shape, dim, want):
    rec, _ = elementwise_problem()
    match = (r"the Recurrence's states have shape \(2, 13, 3\) \(\*batch, T, H\) but "
             + re.escape(want) + r"; pass x0 of shape rec.shape and dim=-2")
    with pytest.raises(ValueError, match=match):
        paraprop.solve(rec, torch.zeros(shape, dtype=torch.float64), method=method, dim=dim)


def test_recurrence_with_wrong_x0_shape_for_the_other_methods():
    rec, _ = elementwise_problem()
    with pytest.raises(ValueError, match=r"Recurrence: states must have shape \(2, 13, 3\)"):
        paraprop.solve(rec, torch.zeros(2, 3, 13, dtype=torch.float64), method="jacobi",
                       dim=-2)


@pytest.mark.parametrize("shape,dim", [((4, 5, H), -2), ((2, 2, 5, H, 1), -3)],
                         ids=["flattened-batch", "extra-dim"])
def test_newton_refuses_x0_not_shaped_like_rec(shape, dim):
    rec, _ = elementwise_problem(batch=(2, 2), T=5)
    with pytest.raises(ValueError, match="rec.shape"):
        paraprop.solve(rec, torch.zeros(shape, dtype=torch.float64), method="newton", dim=dim)


def test_newton_refuses_x0_of_another_dtype():
    torch.manual_seed(0)
    cell = torch.nn.GRUCell(3, 4, dtype=torch.float64)
    rec = paraprop.Recurrence(cell, torch.randn(2, 5, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype"):
        paraprop.solve(rec, rec.zeros().float(), method="newton", dim=-2)


# -- ELK's Kalman filter -----------------------------------------------------------------------
def kalman_reference(J, r, lam):
    """The sequential filter: delta_0 = r_0 (exact, P = 0); for t >= 1 predict
    m = J_t d_{t-1} + r_t, P- = J_t P J_t^T + I, then K = P- (P- + I / lam)^-1,
    d_t = m - K m, P = (I - K) P-."""
    B, n, Hs = r.shape
    eye = torch.eye(Hs, dtype=r.dtype)
    Jd = torch.diag_embed(J) if J.dim() == 3 else J
    d = torch.empty_like(r)
    d[:, 0] = r[:, 0]
    P = torch.zeros(B, Hs, Hs, dtype=r.dtype)
    for t in range(1, n):
        Jt = Jd[:, t]
        m = (Jt @ d[:, t - 1].unsqueeze(-1)).squeeze(-1) + r[:, t]
        Pm = Jt @ P @ Jt.transpose(-1, -2) + eye
        K = Pm @ torch.linalg.inv(Pm + eye / lam)
        d[:, t] = m - (K @ m.unsqueeze(-1)).squeeze(-1)
        P = (eye - K) @ Pm
    return d


def kalman_data(n, form, seed=0, scale=1.2):
    g = torch.Generator().manual_seed(seed)
    B, Hs = 2, 3
    if form == "dense":
        J = torch.randn(B, n, Hs, Hs, generator=g, dtype=torch.float64) * scale / math.sqrt(Hs)
    else:
        J = torch.randn(B, n, Hs, generator=g, dtype=torch.float64) * scale
    r = torch.randn(B, n, Hs, generator=g, dtype=torch.float64)
    return J, r


@pytest.mark.parametrize("form", ["dense", "diag"])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("lam", [1e-3, 0.1, 1.0, 10.0])
def test_kalman_step_equals_a_sequential_filter(form, n, lam):
    J, r = kalman_data(n, form, seed=n)
    d = kalman_step(J, r, lam)
    ref = kalman_reference(J, r, lam)
    assert d.shape == r.shape and d.dtype == torch.float64
    assert torch.equal(d[:, 0], r[:, 0])
    assert max_err(d, ref) <= 1e-10 * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("form", ["dense", "diag"])
@pytest.mark.parametrize("n", [2, 7, 16])
def test_kalman_step_without_damping_is_the_newton_step(form, n):
    J, r = kalman_data(n, form, seed=n, scale=0.9)
    d = kalman_step(J, r, 1e-12)
    newton = linear_recurrence(J, r)
    assert max_err(d, newton) <= 1e-8 * float(newton.abs().max())


@pytest.mark.parametrize("form", ["dense", "diag"])
def test_kalman_step_with_infinite_damping_takes_no_step(form):
    J, r = kalman_data(9, form)
    d = kalman_step(J, r, 1e12)
    assert torch.equal(d[:, 0], r[:, 0])
    assert float(d[:, 1:].abs().max()) <= 1e-9


def _writes_into_a_buffer():
    """A Markov map computed with out= (forward-mode AD cannot differentiate it)."""
    W = torch.eye(2, dtype=torch.float64) * 0.5

    def fn(x):
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        out = torch.empty_like(x)
        torch.tanh(prev @ W.T + 1, out=out)
        return out

    return fn


@pytest.mark.parametrize("method", NEWTON)
def test_a_map_forward_mode_ad_cannot_differentiate_is_named(method):
    """The probe got torch's raw "Trying to use forward AD with tanh_out ..." error."""
    fn = _writes_into_a_buffer()
    x0 = torch.zeros(2, 6, 2, dtype=torch.float64)
    with pytest.raises(ValueError,
                       match=rf"^method='{method}' on a plain fn forms the Jacobians .* by "
                             r"forward-mode automatic differentiation \(torch.func.jvp\), and fn "
                             r"is not differentiable that way: NotImplementedError: .*out= .*wrap "
                             r"the cell in paraprop.Recurrence .*'jacobi', 'jacobi_gs', "
                             r"'gs_jacobi', 'sliding_jacobi' or 'anderson'"):
        paraprop.solve(fn, x0, method=method, dim=1)
    # the methods that need only fn(x) take it
    ref = paraprop.solve(fn, x0, method="sequential", dim=1).value
    assert torch.equal(paraprop.solve(fn, x0, method="jacobi", dim=1, tol=0).value, ref)
