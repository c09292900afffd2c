"""paraprop.nn.RNN / GRU with a parallel forward (forward="newton", "quasi_newton", "elk",
"quasi_elk", "jacobi", "jacobi_gs", "gs_jacobi", "sliding_jacobi"): the outputs, final states and
every gradient of the torch modules."""

import itertools

import pytest
import torch

import paraprop
import paraprop.nn as pnn
from paraprop.nn import FORWARDS, ParallelForward
from paraprop.solvers import ELK, Sequential

CASES = [(pnn.RNN, torch.nn.RNN, {}), (pnn.RNN, torch.nn.RNN, {"nonlinearity": "relu"}),
         (pnn.GRU, torch.nn.GRU, {})]
IDS = ["rnn-tanh", "rnn-relu", "gru"]
PARALLEL = ["newton", "quasi_newton", "elk", "quasi_elk", "jacobi", "jacobi_gs", "gs_jacobi",
            "sliding_jacobi"]
# the solver's tol, and the allowed max |ours - torch| for outputs and gradients, per dtype
TOL = {torch.float64: (1e-13, 1e-10), torch.float32: (1e-6, 1e-5)}


pytestmark = pytest.mark.usefixtures("one_thread")


def pair(cls, tcls, extra, dtype=torch.float64, seed=0, forward="newton", device="cpu", **kw):
    torch.manual_seed(seed)
    ref = tcls(3, 5, dtype=dtype, **extra, **kw).to(device)
    fwd = forward if forward == "sequential" else ParallelForward(method=forward,
                                                                     tol=TOL[dtype][0])
    ours = cls(3, 5, dtype=dtype, forward=fwd, device=device, **extra, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def run_both(ref, ours, x, h0):
    """Forward both with the same inputs and a random loss on outputs and final states; return
    (out, h_n, dx, dh0, {name: dparam}) of each."""
    results = []
    g = torch.Generator().manual_seed(1)
    w_out = w_h = None
    for mod in (ref, ours):
        mod.zero_grad()
        xi = x.clone().requires_grad_()
        hi = h0.clone().requires_grad_() if h0 is not None else None
        out, hn = mod(xi, hi)
        if w_out is None:   # drawn on the CPU, then moved: the same loss on every device
            w_out = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
            w_h = torch.randn(hn.shape, generator=g, dtype=hn.dtype).to(hn.device)
        ((out * w_out).sum() + (hn * w_h).sum()).backward()
        grads = {n: p.grad for n, p in mod.named_parameters()}
        results.append((out.detach(), hn.detach(), xi.grad, None if hi is None else hi.grad,
                        grads))
    return results


def err(a, b):
    return float((a - b).abs().max())


def grad_err(a, b):
    """Gradients: the error relative to their scale, ``max |a - b| / max(1, max |b|)`` (float32
    gradients of size ~20 differ from torch's by a few units in the last place, ~1e-5
    absolute, whatever the forward)."""
    return err(a, b) / max(1.0, float(b.abs().max()))


def assert_same(results, tol):
    (o1, h1, gx1, gh1, gw1), (o2, h2, gx2, gh2, gw2) = results
    assert o2.shape == o1.shape and h2.shape == h1.shape
    assert err(o2, o1) <= tol
    assert err(h2, h1) <= tol
    assert err(gx2, gx1) <= tol
    if gh1 is not None:
        assert err(gh2, gh1) <= tol
    assert gw1.keys() == gw2.keys()
    for name in gw1:
        assert grad_err(gw2[name], gw1[name]) <= tol, name


def assert_stats(mod, layers, T):
    """``last_forward``: one converged Solution per layer, within its tol, with its last state
    only as value (no sequence kept alive)."""
    sols = mod.last_forward
    assert len(sols) == layers
    for s in sols:
        assert isinstance(s, paraprop.Solution) and s.converged
        assert 1 <= s.iterations <= T and len(s.residuals) == s.iterations
        assert all(r >= 0 for r in s.residuals.tolist())
        assert 0 <= s.stats["error_estimate"] <= s.stats["tol"]
        assert s.stats["compute_dtype"] == mod.weight_ih_l0.dtype
        assert s.value.dim() == 2                       # (B, state): the last state only


def test_every_forward_is_covered():
    assert sorted(FORWARDS) == sorted(["sequential", "native", "auto", *PARALLEL])


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
@pytest.mark.parametrize("num_layers,batch_first,bias",
                         list(itertools.product([1, 2], [False, True], [True, False])))
@pytest.mark.parametrize("forward", PARALLEL)
def test_parallel_forward_equals_torch(cls, tcls, extra, num_layers, batch_first, bias, forward,
                                       device):
    ref, ours = pair(cls, tcls, extra, forward=forward, num_layers=num_layers,
                     batch_first=batch_first, bias=bias, device=device)
    T, B = 9, 4
    x = torch.randn((B, T, 3) if batch_first else (T, B, 3), dtype=torch.float64).to(device)
    h0 = torch.randn(num_layers, B, 5, dtype=torch.float64).to(device)
    results = run_both(ref, ours, x, h0)
    assert_same(results, TOL[torch.float64][1])
    assert_stats(ours, num_layers, T)
    # without a graph: the parallel forward runs as well (under no_grad and without grads)
    with torch.no_grad():
        out, hn = ours(x, h0)
    assert_stats(ours, num_layers, T)
    assert not out.requires_grad
    assert err(out, results[0][0]) <= TOL[torch.float64][1]
    assert err(hn, results[0][1]) <= TOL[torch.float64][1]


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
@pytest.mark.parametrize("forward", ["newton", "elk"])
def test_no_grad_forward_is_parallel(cls, tcls, extra, forward):
    ref, ours = pair(cls, tcls, extra, forward=forward, num_layers=2)
    x = torch.randn(11, 3, 3, dtype=torch.float64)
    with torch.no_grad():
        o1, h1 = ref(x)
        o2, h2 = ours(x)
    assert_stats(ours, 2, 11)
    assert err(o2, o1) <= 1e-10 and err(h2, h1) <= 1e-10
    for p in ours.parameters():       # nothing requires grad: the same path outside no_grad
        p.requires_grad_(False)
    o3, h3 = ours(x)
    assert_stats(ours, 2, 11)
    assert err(o3, o1) <= 1e-10 and err(h3, h1) <= 1e-10


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
@pytest.mark.parametrize("T", [1, 2, 3])
def test_short_sequences_and_no_h0(cls, tcls, extra, T):
    ref, ours = pair(cls, tcls, extra, forward="newton", num_layers=2)
    x = torch.randn(T, 2, 3, dtype=torch.float64)
    assert_same(run_both(ref, ours, x, None), 1e-10)
    assert_stats(ours, 2, T)


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
@pytest.mark.parametrize("forward", ["newton", "quasi_elk"])
def test_unbatched_input(cls, tcls, extra, forward):
    ref, ours = pair(cls, tcls, extra, forward=forward, num_layers=2)
    x = torch.randn(7, 3, dtype=torch.float64)
    h0 = torch.randn(2, 5, dtype=torch.float64)
    results = run_both(ref, ours, x, h0)
    assert results[1][0].shape == (7, 5) and results[1][1].shape == (2, 5)
    assert_same(results, 1e-10)


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
@pytest.mark.parametrize("forward", PARALLEL)
def test_float32(cls, tcls, extra, forward, device):
    ref, ours = pair(cls, tcls, extra, dtype=torch.float32, forward=forward, num_layers=2,
                     device=device)
    x = torch.randn(40, 3, 3).to(device)
    assert_same(run_both(ref, ours, x, None), TOL[torch.float32][1])
    assert_stats(ours, 2, 40)


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
def test_parallel_forward_with_jacobi_backward(cls, tcls, extra):
    ref, ours = pair(cls, tcls, extra, forward="newton", num_layers=2)
    ours.backward_config = "jacobi"
    x = torch.randn(8, 3, 3, dtype=torch.float64)
    h0 = torch.randn(2, 3, 5, dtype=torch.float64)
    assert_same(run_both(ref, ours, x, h0), 1e-10)
    run = ours.last_backward
    assert run.kind == "jacobi" and len(run.layers) == 2 and run.converged
    assert all(s.method == "jacobi" for s in run.layers)


def test_sequential_forward_leaves_last_forward_empty():
    ref, ours = pair(pnn.GRU, torch.nn.GRU, {}, forward="sequential")
    x = torch.randn(6, 2, 3, dtype=torch.float64)
    assert_same(run_both(ref, ours, x, None), 1e-10)
    assert ours.last_forward == ()


def test_damping_reaches_the_solver():
    ref, ours = pair(pnn.GRU, torch.nn.GRU, {}, forward="elk", num_layers=1)
    x = torch.randn(12, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        o_ref, _ = ref(x)
        ours(x)
        light = ours.last_forward[0].iterations
        ours.forward_config = ParallelForward(method=ELK(damping=1e4), tol=1e-13)
        o, _ = ours(x)
        heavy = ours.last_forward[0].iterations
    assert heavy > light
    assert err(o, o_ref) <= 1e-10


def test_diverging_newton_forward_is_reset_and_still_equals_torch():
    # W_hh = 50 I with tiny inputs: the zero guess makes every Jacobian ~50, and Newton's
    # linear recurrence overflows float32 within 40 steps
    ref, ours = pair(pnn.RNN, torch.nn.RNN, {}, dtype=torch.float32, forward="newton")
    with torch.no_grad():
        for m in (ref, ours):
            m.weight_hh_l0.copy_(torch.eye(5) * 50)
            m.bias_ih_l0.zero_()
            m.bias_hh_l0.zero_()
    x = torch.randn(40, 3, 3) * 1e-3
    with torch.no_grad():
        o_ref, h_ref = ref(x)
        o, h = ours(x)
    assert ours.last_forward[0].stats["resets"] > 0
    assert err(o, o_ref) <= 1e-5 and err(h, h_ref) <= 1e-5


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
def test_forward_max_iters(cls, tcls, extra):
    ref, ours = pair(cls, tcls, extra, forward="jacobi")
    ours.forward_config = ParallelForward(method="jacobi", tol=1e-13, max_iters=2)
    x = torch.randn(10, 2, 3, dtype=torch.float64)
    with pytest.raises(paraprop.ConvergenceError, match="did not converge within max_iters=2"):
        ours(x)
    ours.forward_config = ParallelForward(method="jacobi", tol=1e-13, max_iters=10)  # the bound
    with torch.no_grad():
        assert err(ours(x)[0], ref(x)[0]) <= 1e-10


@pytest.mark.parametrize("cls", [pnn.RNN, pnn.GRU], ids=["rnn", "gru"])
@pytest.mark.parametrize("kwargs,exc,match", [
    (lambda: {"forward": "deer"}, ValueError,
     r"unknown forward='deer'; choose one of sequential, "),
    (lambda: {"forward": "newton", "backward": "autograd"}, ValueError,
     r"forward='newton' differentiates implicitly at the solution, with backward='scan' or "
     r"'jacobi'; backward='autograd' needs forward='sequential'"),
    (lambda: {"forward": "jacobi", "backward": "autograd"}, ValueError,
     r"forward='jacobi' differentiates implicitly"),
    (lambda: {"forward": ELK(damping=0.1), "backward": "autograd"}, ValueError,
     r"forward=ParallelForward\(method=ELK\(damping=0.1\).*\) differentiates implicitly"),
    (lambda: {"forward": ParallelForward(method="deer")}, ValueError,
     r"ParallelForward: unknown method='deer'; choose one of newton|jacobi"),
    (lambda: {"forward": ParallelForward(method="sequential")}, ValueError,
     r"method='sequential' is a sequential loop; pass forward='sequential'"),
    (lambda: {"forward": Sequential()}, ValueError, r"pass forward='sequential'"),
    (lambda: {"forward": ELK}, TypeError, r"forward must be .* got the class ELK"),
    (lambda: {"forward": 3}, TypeError, r"forward must be a method name, .* got int: 3"),
    (lambda: {"forward": ParallelForward(method=3)}, TypeError,
     r"ParallelForward: method must be a method name or a solver object"),
    (lambda: {"forward": ParallelForward(tol=-1e-3)}, ValueError,
     r"ParallelForward: tol must be a number >= 0, got -0.001"),
    (lambda: {"forward": ParallelForward(tol=True)}, ValueError,
     r"ParallelForward: tol must be a number >= 0, got True"),
    (lambda: {"forward": ParallelForward(max_iters=0)}, ValueError,
     r"ParallelForward: max_iters must be a positive int or None, got 0"),
    (lambda: {"forward": ParallelForward(max_iters=True)}, ValueError,
     r"max_iters must be .* got True"),
    (lambda: {"forward": ParallelForward(max_iters=2.0)}, ValueError,
     r"max_iters must be .* got 2.0"),
    (lambda: {"forward": ParallelForward(throw=1)}, TypeError,
     r"ParallelForward: throw must be a bool, got 1"),
])
def test_forward_option_errors(cls, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cls(3, 5, **kwargs())


@pytest.mark.parametrize("cls", [pnn.RNN, pnn.GRU], ids=["rnn", "gru"])
def test_valid_forward_options_and_repr(cls):
    m = cls(3, 5, forward=ParallelForward(method=ELK(damping=2), tol=0, max_iters=4))
    fwd = m.forward_config
    assert fwd.solver.name == "elk" and fwd.solver.damping == 2 and fwd.max_iters == 4
    assert fwd.tol == 0 and fwd.tol_for(torch.float32) == 0
    assert "forward=ParallelForward(method=ELK(damping=2.0)" in repr(m)
    assert "forward='elk'" in repr(cls(3, 5, forward="elk"))
    assert cls(3, 5, forward=ELK(damping=3)).forward_config.solver.damping == 3
    assert "forward=" not in repr(cls(3, 5))
    with pytest.raises(ValueError, match="backward='autograd' needs forward='sequential'"):
        m.backward_config = "autograd"        # assignments are validated as the constructor
    with pytest.raises(ValueError, match="unknown forward='deer'"):
        m.forward_config = "deer"
    assert m.forward_config is fwd


def test_a_loop_forwards_record_is_a_copy_built_when_read():
    """After a loop forward (``forward="auto"``), ``last_forward`` holds one record per layer
    with the final state as it was returned (the caller's later in-place changes do not reach
    it), built when read; a later ``forward="sequential"`` call leaves none."""
    torch.manual_seed(0)
    lstm = paraprop.nn.LSTM(2, 3, num_layers=2, forward="auto")
    _, (h, c) = lstm(torch.randn(5, 4, 2))
    want = torch.cat([h, c], -1).clone()
    h.zero_()
    records = lstm.last_forward
    assert len(records) == 2
    for k, rec in enumerate(records):
        assert rec.converged and rec.method == "sequential" and rec.iterations == 5
        assert rec.stats["kernel"] in ("native", "torch")
        assert torch.equal(rec.value, want[k])
    assert lstm.last_forward == records   # (read again: the same records)
    lstm.forward_config = "sequential"
    lstm(torch.randn(5, 4, 2))
    assert lstm.last_forward == ()
