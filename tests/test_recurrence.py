"""paraprop.Recurrence: every method of solve returns the sequential states, its Jacobians are
the cell's, and its solutions carry the gradients of a plain loop over the cell."""

import functools
import math
from dataclasses import dataclass, field

import pytest
import torch

import paraprop
from paraprop import solvers
from paraprop.scan import linear_recurrence

I_SIZE, HID = 3, 4          # input size; hidden size of the cells (the LSTM state [h, c] has 2H)
BLOCK = 3                   # block_size of the hybrid methods, window of sliding_jacobi
METHODS = ["sequential", "jacobi", "jacobi_gs", "gs_jacobi", "sliding_jacobi", "anderson",
           "newton", "quasi_newton", "elk", "quasi_elk"]
NEWTON = ["newton", "quasi_newton", "elk", "quasi_elk"]
JACOBIAN_FORM = {"newton": "any", "quasi_newton": "diag", "elk": "dense", "quasi_elk": "diag"}
PARALLEL = METHODS[1:]
KINDS = ["rnn_tanh", "rnn_relu", "rnn_nobias", "gru", "gru_nobias", "lstm", "custom",
         "custom_jac"]
LENGTHS = [1, 2, 3, 7, 13, 31]
BATCHES = [(), (3,), (2, 2)]
# tol passed to solve, allowed max |x - x_seq|, allowed max |grad - grad_ref| / max |grad_ref|
TOL = {torch.float64: {"solve": 1e-13, "value": 1e-12, "grad": 1e-10},
       torch.float32: {"solve": 1e-6, "value": 1e-5, "grad": 1e-4}}


pytestmark = pytest.mark.usefixtures("one_thread")


def solver(method):
    """``method`` as passed to solve: the windowed ones configured with ``BLOCK``."""
    configured = {"jacobi_gs": solvers.JacobiGS(block_size=BLOCK),
                  "gs_jacobi": solvers.GSJacobi(block_size=BLOCK),
                  "sliding_jacobi": solvers.SlidingJacobi(window=BLOCK)}
    return configured.get(method, method)


def bound(method, T):
    return math.ceil(T / BLOCK) if method == "jacobi_gs" else T


def lstm_like(dtype, seed):
    """A Python LSTM-like cell on the concatenated state [h, c] (H = 2 * HID), closing over W, b."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(4 * HID, I_SIZE + HID, generator=g, dtype=torch.float64).to(dtype)
    W /= math.sqrt(I_SIZE + HID)
    b = (torch.randn(4 * HID, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    W.requires_grad_(True)
    b.requires_grad_(True)

    def cell(u, s):
        h, c = s[:, :HID], s[:, HID:]
        i, f, gg, o = (torch.cat([u, h], -1) @ W.T + b).chunk(4, -1)
        c2 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
        return torch.cat([torch.sigmoid(o) * torch.tanh(c2), c2], -1)

    return cell, [W, b]


class TanhCell(torch.nn.Module):
    """``tanh(U u + W h + b)`` with an analytic ``jacobian`` method (counted)."""

    def __init__(self, dtype, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.hidden_size = HID
        self.U = torch.nn.Parameter(torch.randn(HID, I_SIZE, generator=g, dtype=dtype))
        self.W = torch.nn.Parameter(torch.randn(HID, HID, generator=g, dtype=dtype) / 2)
        self.b = torch.nn.Parameter(torch.randn(HID, generator=g, dtype=dtype))
        self.jacobian_calls = 0

    def forward(self, u, h):
        return torch.tanh(u @ self.U.T + h @ self.W.T + self.b)

    def jacobian(self, u, h):
        self.jacobian_calls += 1
        y = self(u, h)
        return (1 - y * y)[:, :, None] * self.W


@dataclass
class Case:
    """A cell, the size of its state, the tensors to differentiate and the Recurrence kwargs."""

    kind: str
    cell: object
    state: int
    params: list
    rec_kwargs: dict = field(default_factory=dict)

    def step(self, u, s):
        """One step written with the cell itself (the independent reference)."""
        if isinstance(self.cell, torch.nn.LSTMCell):
            h, c = self.cell(u, (s[:, :HID], s[:, HID:]))
            return torch.cat([h, c], -1)
        return self.cell(u, s)

    def loop(self, u, h0):
        """All states by a plain Python loop, differentiable by autograd."""
        batch, T = u.shape[:-2], u.shape[-2]
        uu = u.reshape(-1, T, u.shape[-1])
        s = (torch.zeros(uu.shape[0], self.state, dtype=u.dtype) if h0 is None
             else h0.reshape(-1, self.state))
        out = []
        for t in range(T):
            s = self.step(uu[:, t], s)
            out.append(s)
        return torch.stack(out, 1).reshape(*batch, T, self.state)


def make_case(kind, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    if kind.startswith("rnn"):
        cell = torch.nn.RNNCell(I_SIZE, HID, bias=kind != "rnn_nobias",
                                nonlinearity="relu" if kind == "rnn_relu" else "tanh",
                                dtype=dtype)
        return Case(kind, cell, HID, list(cell.parameters()))
    if kind.startswith("gru"):
        cell = torch.nn.GRUCell(I_SIZE, HID, bias=kind != "gru_nobias", dtype=dtype)
        return Case(kind, cell, HID, list(cell.parameters()))
    if kind == "lstm":
        cell = torch.nn.LSTMCell(I_SIZE, HID, dtype=dtype)
        return Case(kind, cell, 2 * HID, list(cell.parameters()))
    if kind == "custom":
        cell, params = lstm_like(dtype, seed)
        return Case(kind, cell, 2 * HID, params, {"hidden_size": 2 * HID, "params": params})
    cell = TanhCell(dtype, seed)
    return Case(kind, cell, HID, list(cell.parameters()))


def data(case, batch, T, dtype, seed=1, with_h0=True):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(*batch, T, I_SIZE, generator=g, dtype=torch.float64).to(dtype)
    h0 = (torch.randn(*batch, case.state, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    return u, (h0 if with_h0 else None)


@functools.cache
def reference(kind, T, batch, dtype=torch.float64):
    """The case, its Recurrence and the sequential solution (shared by the method cases)."""
    case = make_case(kind, dtype)
    # h0 = None (zeros; the state size then comes from the cell or hidden_size) without batch
    u, h0 = data(case, batch, T, dtype, with_h0=batch != ())
    rec = paraprop.Recurrence(case.cell, u, h0, **case.rec_kwargs)
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2)
    with torch.no_grad():
        loop = case.loop(u, h0)
    return case, rec, ref, loop


def max_err(a, b):
    return float((a.detach() - b.detach()).abs().max())


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_every_method_is_covered():
    assert sorted(solvers.METHODS) == sorted(METHODS)
    assert sorted(solvers.NEWTON_METHODS) == sorted(NEWTON)


# -- values ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("batch", BATCHES, ids=str)
def test_sequential_equals_a_plain_loop_over_the_cell(kind, T, batch):
    case, rec, ref, loop = reference(kind, T, batch)
    assert rec.shape == (*batch, T, case.state)
    assert ref.value.shape == rec.shape and ref.value.dtype == torch.float64
    assert ref.iterations == T and ref.converged
    assert max_err(ref.value, loop) <= 1e-14


@pytest.mark.parametrize("method", PARALLEL)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("batch", BATCHES, ids=str)
def test_every_method_returns_the_sequential_result(method, kind, T, batch):
    case, rec, ref, _ = reference(kind, T, batch)
    tol = TOL[torch.float64]
    sol = paraprop.solve(rec, rec.zeros(), method=solver(method), dim=-2,
                         tol=tol["solve"])
    assert sol.converged and sol.method == method
    assert sol.value.shape == rec.shape and sol.value.dtype == torch.float64
    assert max_err(sol.value, ref.value) <= tol["value"]
    assert 1 <= sol.iterations <= bound(method, T)
    assert sol.stats["sample_iterations"].shape == batch
    if method in NEWTON:
        assert sol.stats["resets"] == 0
        assert sol.stats["jacobian"] == JACOBIAN_FORM[method]
        assert "jvps" not in sol.stats   # a Recurrence gives its Jacobians directly


@pytest.mark.parametrize("method", PARALLEL)
@pytest.mark.parametrize("kind", KINDS)
def test_float32_within_tolerance_of_sequential(method, kind):
    case, rec, ref, loop = reference(kind, 13, (3,), torch.float32)
    tol = TOL[torch.float32]
    sol = paraprop.solve(rec, rec.zeros(), method=solver(method), dim=-2,
                         tol=tol["solve"])
    assert sol.converged and sol.value.dtype == torch.float32
    assert max_err(sol.value, ref.value) <= tol["value"]
    assert max_err(ref.value, loop) <= tol["value"]
    assert sol.iterations <= bound(method, 13)


def test_newton_needs_few_iterations_on_a_contracting_gru():
    # DEER converges quadratically: far fewer than T iterations on a well-behaved cell
    case, rec, ref, _ = reference("gru", 31, (3,))
    sol = paraprop.solve(rec, rec.zeros(), method="newton", dim=-2, tol=1e-13)
    assert sol.iterations <= 8
    assert max_err(sol.value, ref.value) <= 1e-12


def test_cell_jacobian_method_is_used():
    case, rec, ref, _ = reference("custom_jac", 7, (3,))
    before = case.cell.jacobian_calls
    sol = paraprop.solve(rec, rec.zeros(), method="newton", dim=-2, tol=1e-13)
    assert case.cell.jacobian_calls - before == sol.iterations
    assert max_err(sol.value, ref.value) <= 1e-12


def test_autonomous_recurrence_without_inputs():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(HID, HID, generator=g, dtype=torch.float64)
    h0 = torch.randn(2, HID, generator=g, dtype=torch.float64, requires_grad=True)
    calls = []

    def cell(u, h):
        calls.append(u)
        return torch.tanh(h @ W.T + 0.1)

    rec = paraprop.Recurrence(cell, None, h0, length=11)
    assert rec.shape == (2, 11, HID)
    s, loop = h0, []
    for _ in range(11):
        s = torch.tanh(s @ W.T + 0.1)
        loop.append(s)
    loop = torch.stack(loop, 1)
    for method in ("newton", "quasi_elk", "jacobi"):
        sol = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=1e-13)
        assert max_err(sol.value, loop) <= 1e-12
        (g_ours,) = torch.autograd.grad(sol.value.sum(), h0)
        (g_ref,) = torch.autograd.grad(loop.sum(), h0, retain_graph=True)
        assert rel_err(g_ours, g_ref) <= 1e-10
    assert all(u is None for u in calls)


def test_update_returns_the_requested_positions():
    case, rec, _, _ = reference("gru", 7, (2, 2))
    x = torch.randn(rec.shape, dtype=torch.float64)
    index = torch.tensor([0, 3, 6])
    assert max_err(rec.update(x, index), rec(x)[..., index, :]) <= 1e-15


# -- Jacobians ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lo", [0, 2])
def test_linearize_gives_the_cell_jacobians(kind, lo):
    case = make_case(kind)
    T, B = 5, 3
    u, h0 = data(case, (B,), T, torch.float64)
    rec = paraprop.Recurrence(case.cell, u, h0, **case.rec_kwargs)
    x = torch.randn(B, T, case.state, dtype=torch.float64, generator=torch.Generator()
                    .manual_seed(3))
    prev = torch.cat([h0[:, None], x[:, :-1]], 1)[:, lo:]
    # reference: autograd Jacobian of one step, row by row
    J_ref = torch.empty(B, T - lo, case.state, case.state, dtype=torch.float64)
    for b in range(B):
        for t in range(T - lo):
            J_ref[b, t] = torch.autograd.functional.jacobian(
                lambda s, b=b, t=t: case.step(u[b, lo + t][None], s[None])[0], prev[b, t])
    y_ref = rec(x)[:, lo:]
    y, J = rec.linearize(x, lo, "dense")
    assert max_err(y, y_ref) <= 1e-15 and J.shape == J_ref.shape
    assert max_err(J, J_ref) <= 1e-13
    y, D = rec.linearize(x, lo, "diag")
    assert max_err(y, y_ref) <= 1e-15
    assert max_err(D, J_ref.diagonal(dim1=-2, dim2=-1)) <= 1e-13
    y, A = rec.linearize(x, lo, "any")      # Factored for the analytic cells: apply it
    b = torch.randn(B, T - lo, case.state, dtype=torch.float64)
    assert max_err(linear_recurrence(A, b), linear_recurrence(J_ref, b)) <= 1e-12
    y, none = rec.linearize(x, lo, None)
    assert none is None and max_err(y, y_ref) <= 1e-15


# -- gradients ---------------------------------------------------------------------------------
def grads_of(case, method, T, batch, dtype=torch.float64, with_h0=True):
    """Gradients of a random linear loss wrt inputs, h0 and every parameter: (ours, reference)."""
    u, h0 = data(case, batch, T, dtype, seed=2, with_h0=with_h0)
    u.requires_grad_(True)
    leaves = [u] + ([h0.requires_grad_(True)] if with_h0 else []) + case.params
    rec = paraprop.Recurrence(case.cell, u, h0, **case.rec_kwargs)
    sol = paraprop.solve(rec, rec.zeros(), method=solver(method), dim=-2,
                         tol=TOL[dtype]["solve"])
    w = torch.randn(sol.value.shape, dtype=dtype, generator=torch.Generator().manual_seed(4))
    assert sol.value.requires_grad
    ours = torch.autograd.grad((sol.value * w).sum(), leaves)
    ref = torch.autograd.grad((case.loop(u, h0) * w).sum(), leaves)
    return ours, ref


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T,batch", [(1, (2,)), (7, (2,)), (5, (2, 2)), (4, ())], ids=str)
def test_gradients_equal_autograd_through_the_loop(method, kind, T, batch):
    case = make_case(kind)
    ours, ref = grads_of(case, method, T, batch)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.shape == b.shape
        assert rel_err(a, b) <= TOL[torch.float64]["grad"], i


@pytest.mark.parametrize("kind", ["gru", "lstm", "custom"])
def test_gradients_without_h0(kind):
    case = make_case(kind)
    ours, ref = grads_of(case, "newton", 6, (2,), with_h0=False)
    for a, b in zip(ours, ref, strict=True):
        assert rel_err(a, b) <= 1e-10


@pytest.mark.parametrize("kind", ["rnn_tanh", "gru"])
def test_float32_gradients(kind):
    case = make_case(kind, torch.float32)
    ours, ref = grads_of(case, "newton", 9, (3,), dtype=torch.float32)
    for a, b in zip(ours, ref, strict=True):
        assert rel_err(a, b) <= TOL[torch.float32]["grad"]


def test_gradcheck_custom_cell_with_params():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, 6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True)

    def f(u, h0, W):
        rec = paraprop.Recurrence(lambda x, h: torch.tanh(x + h @ W.T), u, h0, params=[W])
        return paraprop.solve(rec, rec.zeros(), method="newton", dim=-2, tol=1e-14).value

    assert torch.autograd.gradcheck(f, (u, h0, W))


def test_custom_cell_without_params_gives_no_parameter_gradient():
    # a plain function's tensors are not found by themselves: only params= makes them leaves
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, 6, 3, generator=g, dtype=torch.float64)
    rec = paraprop.Recurrence(lambda x, h: torch.tanh(x + h @ W.T), u, hidden_size=3)
    assert rec.params == []
    sol = paraprop.solve(rec, rec.zeros(), method="newton", dim=-2, tol=1e-13)
    assert not sol.value.requires_grad


def test_no_graph_without_grad_or_under_no_grad():
    case = make_case("gru")
    u, h0 = data(case, (2,), 5, torch.float64)
    for p in case.cell.parameters():
        p.requires_grad_(False)
    rec = paraprop.Recurrence(case.cell, u, h0)
    assert not paraprop.solve(rec, rec.zeros(), method="newton", dim=-2).value.requires_grad
    case = make_case("gru")
    rec = paraprop.Recurrence(case.cell, u, h0)
    with torch.no_grad():
        sol = paraprop.solve(rec, rec.zeros(), method="newton", dim=-2)
    assert not sol.value.requires_grad


def test_gradient_only_where_asked():
    case = make_case("rnn_tanh")
    u, h0 = data(case, (2,), 5, torch.float64)
    h0.requires_grad_(True)
    for p in case.cell.parameters():
        p.requires_grad_(False)
    rec = paraprop.Recurrence(case.cell, u, h0)
    sol = paraprop.solve(rec, rec.zeros(), method="newton", dim=-2, tol=1e-13)
    (g,) = torch.autograd.grad(sol.value.sum(), h0)
    (g_ref,) = torch.autograd.grad(case.loop(u, h0).sum(), h0)
    assert rel_err(g, g_ref) <= 1e-10


@pytest.mark.parametrize("method", ["newton", "sequential"])
def test_cell_that_ignores_its_state(method):
    u = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    rec = paraprop.Recurrence(lambda x, h: torch.tanh(x), u, hidden_size=3)
    sol = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=1e-13)
    assert max_err(sol.value, torch.tanh(u)) <= 1e-15
    (g,) = torch.autograd.grad(sol.value.sum(), u)
    assert max_err(g, 1 - torch.tanh(u) ** 2) <= 1e-14


def test_inputs_used_only_as_a_mask():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 3, generator=g, dtype=torch.float64)
    u = torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    rec = paraprop.Recurrence(lambda x, h: torch.tanh(h @ W.T) * (x > 0), u, h0)
    sol = paraprop.solve(rec, rec.zeros(), method="newton", dim=-2, tol=1e-13)
    g_u, g_h0 = torch.autograd.grad(sol.value.sum(), [u, h0], allow_unused=True)
    assert g_u is None or torch.equal(g_u, torch.zeros_like(u))
    assert g_h0 is not None


# -- argument errors ---------------------------------------------------------------------------
def _u(*shape, dtype=torch.float64):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: paraprop.Recurrence(3), TypeError, "cell must be callable, got int"),
    (lambda: paraprop.Recurrence(torch.tanh, [[1.0]], hidden_size=2), TypeError,
     "inputs must be a torch.Tensor or None, got list"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4), _u(2, 3), h0=1.0), TypeError,
     "h0 must be a torch.Tensor or None, got float"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4), _u(3)), ValueError,
     r"inputs must have shape \(\*batch, T, I\) with T >= 1, got \(3,\)"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4), _u(2, 0, 3)), ValueError,
     r"T >= 1, got \(2, 0, 3\)"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4), _u(2, 5, 3), length=4), ValueError,
     r"length=4 does not match inputs of shape \(2, 5, 3\) \(T=5\)"),
    (lambda: paraprop.Recurrence(torch.tanh, None, _u(2, 4)), ValueError,
     "without inputs, length must be a positive int, got None"),
    (lambda: paraprop.Recurrence(torch.tanh, None, _u(2, 4), length=0), ValueError,
     "length must be a positive int, got 0"),
    (lambda: paraprop.Recurrence(torch.tanh, None, _u(2, 4), length=True), ValueError,
     "length must be a positive int, got True"),
    (lambda: paraprop.Recurrence(torch.tanh, None, length=5, hidden_size=4), ValueError,
     "without inputs, h0 is needed"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=torch.float64), None,
                                 _u(2, 4), length=5), ValueError,
     "a torch GRUCell needs inputs"),
    pytest.param(lambda: paraprop.Recurrence(torch.nn.LSTMCell(3, 4, dtype=torch.float64),
                                             None, _u(2, 8), length=5), ValueError,
                 "a torch LSTMCell needs inputs", id="lstm-without-inputs"),
    (lambda: paraprop.Recurrence(lambda u, h: h, _u(2, 5, 3)), ValueError,
     r"the state size is unknown: pass h0 or hidden_size \(got hidden_size=None\)"),
    (lambda: paraprop.Recurrence(lambda u, h: h, _u(2, 5, 3), hidden_size=0), ValueError,
     "the state size is unknown"),
    (lambda: paraprop.Recurrence(lambda u, h: h, _u(2, 5, 3), hidden_size=True), ValueError,
     "the state size is unknown"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=torch.float64), _u(2, 5, 3),
                                 _u(3, 4)), ValueError,
     r"h0 must have shape \(\*batch, H\) with batch \(2,\), got \(3, 4\)"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=torch.float64), _u(2, 5, 3),
                                 _u(2, 5)), ValueError,
     "h0 has 5 features but the cell's state has 4"),
    (lambda: paraprop.Recurrence(torch.nn.LSTMCell(3, 4, dtype=torch.float64), _u(2, 5, 3),
                                 _u(2, 4)), ValueError,
     "h0 has 4 features but the cell's state has 8"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4), _u(2, 5, 3, dtype=torch.float32),
                                 _u(2, 4)), TypeError,
     r"h0 \(torch.float64, cpu\) must match inputs \(torch.float32, cpu\)"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4), torch.zeros(2, 5, 3,
                                                                      dtype=torch.long)),
     TypeError, "inputs and h0 must be floating point, got torch.int64"),
    (lambda: paraprop.Recurrence(lambda u, h: h, _u(2, 5, 3), _u(2, 4), hidden_size=3),
     ValueError, "hidden_size=3 does not match the state size 4"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=torch.float64), _u(2, 5, 3),
                                 hidden_size=5), ValueError,
     "hidden_size=5 does not match the state size 4"),
])
def test_recurrence_argument_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_state_size_from_the_cell_attribute_and_h0():
    rec = paraprop.Recurrence(make_case("custom_jac").cell, _u(2, 5, 3))
    assert rec.shape == (2, 5, HID)
    rec = paraprop.Recurrence(lambda u, h: h, _u(5, 3), _u(6))
    assert rec.shape == (5, 6)
    rec = paraprop.Recurrence(torch.nn.LSTMCell(3, 4, dtype=torch.float64), _u(5, 3))
    assert rec.shape == (5, 8)


@pytest.mark.parametrize("method", ["sequential", "jacobi", "newton", "elk"])
def test_cell_returning_the_wrong_shape(method):
    rec = paraprop.Recurrence(lambda u, h: h[:, :2], _u(2, 5, 3), hidden_size=4)
    with pytest.raises(ValueError, match=r"cell\(input, hidden\) must return a tensor shaped "
                                         r"like hidden \(\d+, 4\), got \(\d+, 2\)"):
        paraprop.solve(rec, rec.zeros(), method=method, dim=-2)


def test_cell_returning_a_non_tensor():
    rec = paraprop.Recurrence(lambda u, h: [1.0], _u(2, 5, 3), hidden_size=4)
    with pytest.raises(ValueError, match="must return a tensor shaped like hidden.*list"):
        paraprop.solve(rec, rec.zeros(), method="newton", dim=-2)


@pytest.mark.parametrize("bad", [lambda n, H: torch.zeros(n, H),
                                 lambda n, H: torch.zeros(n, H, H + 1), lambda n, H: "J"])
def test_cell_jacobian_with_the_wrong_shape(bad):
    class Cell:
        def __call__(self, u, h):
            return torch.tanh(h + u)

        def jacobian(self, u, h):
            return bad(h.shape[0], h.shape[1])

    rec = paraprop.Recurrence(Cell(), _u(2, 5, 3), hidden_size=3)
    with pytest.raises(ValueError, match=r"cell.jacobian\(input, hidden\) must return "
                                         r"\(10, 3, 3\), got"):
        paraprop.solve(rec, rec.zeros(), method="newton", dim=-2)
    # the methods that do not need Jacobians never call it
    sol = paraprop.solve(rec, rec.zeros(), method="jacobi", dim=-2)
    assert sol.converged


def test_states_of_the_wrong_shape_for_fn():
    rec = paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=torch.float64), _u(2, 5, 3))
    with pytest.raises(ValueError, match=r"Recurrence: states must have shape \(2, 5, 4\) "
                                         r"\(\*batch, T, H\), got \(2, 4, 5\)"):
        rec(torch.zeros(2, 4, 5, dtype=torch.float64))


class _DropoutCell(torch.nn.Module):
    """An Elman cell with dropout on its output (stochastic in train mode)."""

    def __init__(self):
        super().__init__()
        self.cell = torch.nn.RNNCell(3, 4)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, u, h):
        return self.drop(self.cell(u, h))


def test_a_stochastic_cell_is_refused_and_runs_in_eval_mode():
    cell = _DropoutCell()
    u = torch.randn(2, 9, 3)
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"paraprop.Recurrence: cell is in train mode, and its layer "
                             r"'drop' \(Dropout\) draws random numbers .* call cell.eval\(\)"):
        paraprop.Recurrence(cell, u)
    rec = paraprop.Recurrence(cell.eval(), u, hidden_size=4)
    sol = paraprop.solve(rec, rec.zeros(), method="jacobi", dim=-2, tol=0)
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2)
    assert sol.converged and torch.equal(sol.value, ref.value)
