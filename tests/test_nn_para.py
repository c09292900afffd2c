"""paraprop.nn.ParaGRU / ParaLSTM (ParaRNN's diagonal-recurrence cells): the cells are torch's GRU
and LSTM with diagonal hidden weights, Newton equals the sequential loop, and the scan backward
gives the gradients of autograd through the sequential loop."""

import os
import subprocess
import sys

import pytest
import torch

import paraprop
from paraprop.jacobians.diagonal import gru_linearize, gru_step, lstm_linearize, lstm_step
from paraprop.nn import ParaGRU, ParallelForward, ParaLSTM
from paraprop.nn.para_gru import GRURecurrence
from paraprop.nn.para_lstm import LSTMRecurrence

pytestmark = pytest.mark.usefixtures("one_thread")

MODULES = {"gru": (ParaGRU, torch.nn.GRU), "lstm": (ParaLSTM, torch.nn.LSTM)}
# per dtype: the solver's tol for the forward comparisons, the allowed max |Newton - loop|, and
# the allowed relative gradient difference (scan backward vs autograd through the loop)
TOL = {torch.float64: (1e-12, 5e-12, 1e-10), torch.float32: (1e-6, 1e-5, 1e-5)}


def make(kind, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    return MODULES[kind][0](3, 6, dtype=dtype, **kw)


def states(kind, m, B, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m.num_layers, B, m.hidden_size, generator=g, dtype=dtype)
    if kind == "gru":
        return h
    return h, torch.randn(m.num_layers, B, m.hidden_size, generator=g, dtype=dtype)


def flat(hn):
    return hn if isinstance(hn, tuple) else (hn,)


def on(hx, device):
    """States (a tensor or a pair) on ``device``."""
    return tuple(h.to(device) for h in hx) if isinstance(hx, tuple) else hx.to(device)


def err(a, b):
    return float((a - b).detach().abs().max())


def rel(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max().clamp_min(1e-30))


# -- the cells ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODULES)
def test_cell_is_torch_module_with_diagonal_hidden_weights(kind):
    ours = make(kind, num_layers=2, forward="sequential")
    ref = MODULES[kind][1](3, 6, num_layers=2, dtype=torch.float64)
    sd = {k: (torch.cat([torch.diag(v) for v in p.view(-1, 6)]) if "weight_hh" in k else p)
          for k, p in ours.state_dict().items()}
    ref.load_state_dict(sd)
    x = torch.randn(40, 4, 3, dtype=torch.float64)
    hx = states(kind, ours, 4, torch.float64)
    out, hn = ours(x, hx)
    r_out, r_hn = ref(x, hx)
    assert err(out, r_out) < 1e-12
    for a, b in zip(flat(hn), flat(r_hn), strict=True):
        assert err(a, b) < 1e-12


def test_gru_jacobian_diagonal_is_exact():
    torch.manual_seed(0)
    H = 5
    gi, h = torch.randn(7, 3, H, dtype=torch.float64), torch.randn(7, H, dtype=torch.float64)
    w, b = torch.randn(3, H, dtype=torch.float64), torch.randn(3, H, dtype=torch.float64)
    y, a = torch.empty_like(h), torch.empty_like(h)
    coef = torch.empty(7, 4, H, dtype=torch.float64)
    gru_linearize(gi, h, w, b, y, a)
    a2 = torch.empty_like(a)
    gru_linearize(gi, h, w, b, torch.empty_like(h), a2, coef)
    assert err(y, gru_step(gi, h, w, b)) == 0 and err(a, a2) < 1e-15
    for n in range(7):
        J = torch.autograd.functional.jacobian(lambda v, n=n: gru_step(gi[n], v, w, b), h[n])
        assert err(J, torch.diag(a[n])) < 1e-14


def test_lstm_jacobian_blocks_are_exact():
    torch.manual_seed(0)
    H = 5
    gi = torch.randn(7, 4, H, dtype=torch.float64)
    h, c = torch.randn(7, H, dtype=torch.float64), torch.randn(7, H, dtype=torch.float64)
    w = torch.randn(4, H, dtype=torch.float64)
    hy, cy = torch.empty_like(h), torch.empty_like(h)
    J = torch.empty(7, H, 2, 2, dtype=torch.float64)
    lstm_linearize(gi, h, c, w, hy, cy, J)
    h2, c2 = lstm_step(gi, h, c, w)
    assert err(hy, h2) < 1e-15 and err(cy, c2) < 1e-15
    for n in range(7):
        def f(s, n=n):
            return torch.cat(lstm_step(gi[n], s[:H], s[H:], w))
        full = torch.autograd.functional.jacobian(f, torch.cat([h[n], c[n]]))
        blocks = full.view(2, H, 2, H).diagonal(dim1=1, dim2=3)        # (2, 2, H): per unit
        assert err(blocks.permute(2, 0, 1), J[n]) < 1e-14
        off = full.view(2, H, 2, H).clone()
        idx = torch.arange(H)
        off[:, idx, :, idx] = 0
        assert float(off.abs().max()) == 0                              # nothing across units


@pytest.mark.parametrize("kind", MODULES)
def test_recurrence_methods_agree(kind):
    """The layer's Recurrence under paraprop.solve: its sequential path (rows) and Newton."""
    torch.manual_seed(0)
    B, T, H = 2, 50, 4
    if kind == "gru":
        rec = GRURecurrence(torch.randn(B, T, 3 * H, dtype=torch.float64),
                            torch.randn(B, H, dtype=torch.float64),
                            torch.randn(3, H, dtype=torch.float64),
                            torch.randn(3, H, dtype=torch.float64))
    else:
        rec = LSTMRecurrence(torch.randn(4, B, H, T, dtype=torch.float64),
                             torch.randn(B, H, 2, dtype=torch.float64),
                             torch.randn(4, H, dtype=torch.float64))
    seq = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2)
    new = paraprop.solve(rec, rec.zeros(), method="newton", dim=-2, tol=1e-12)
    assert new.converged and new.iterations < 12 and new.stats["jacobian"] == "any"
    assert err(new.value, seq.value) < 1e-11
    y = rec(seq.value)
    assert err(y, seq.value) < 1e-13                                    # a fixed point of fn


# -- forward: Newton equals the sequential loop ---------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", MODULES)
def test_newton_equals_sequential(kind, dtype, device):
    tol, bound, _ = TOL[dtype]
    m = make(kind, dtype, num_layers=2, batch_first=True,
             forward=ParallelForward(method="newton", tol=tol)).to(device)
    x = torch.randn(3, 300, 3, dtype=dtype).to(device)
    hx = on(states(kind, m, 3, dtype), device)
    with torch.no_grad():
        out, hn = m(x, hx)
        sols = m.last_forward
        m.forward_config = "sequential"
        ref, r_hn = m(x, hx)
    assert out.shape == (3, 300, 6) and out.is_contiguous()
    assert err(out, ref) <= bound
    for a, b in zip(flat(hn), flat(r_hn), strict=True):
        assert err(a, b) <= bound
    assert [s.converged for s in sols] == [True, True]
    assert max(s.iterations for s in sols) <= 10
    # the fused Newton step: on CUDA the Triton kernel's warm start, then the torch cell's
    # blocked step certifies; on the CPU the blocked step alone
    want = ("triton+torch",) if device.type == "cuda" else ("native", "torch")
    steps = [s.stats["newton_step"] for s in sols]
    assert all(k in want for k in steps), steps
    assert (min(s.stats["triton_iterations"] for s in sols) > 0) == (device.type == "cuda")
    assert m.last_forward == ()                                         # the loop ran


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", MODULES)
def test_newton_at_tol_0_is_the_loop_bitwise(kind, dtype, device):
    """tol=0: the bitwise fixed point of the cell, which is the module's own loop (the input
    terms and each layer's input are the loop's, from the same products). B H = 32: torch's
    CPU sigmoid rounds a tensor's last partial vector (the scalar tail) differently from its
    vectorised part, so the cell evaluated per step and per block of steps agree bitwise only
    where no value falls in a tail (docs/recurrences.md, "On the GPU")."""
    torch.manual_seed(3)
    m = MODULES[kind][0](3, 16, num_layers=2, dtype=dtype,
                         forward=ParallelForward(method="newton", tol=0.0)).to(device)
    x = torch.randn(30, 2, 3, dtype=dtype).to(device)
    with torch.no_grad():
        out, hn = m(x)
        sols = m.last_forward
        m.forward_config = "sequential"
        ref, r_hn = m(x)
    assert [s.converged for s in sols] == [True, True]
    assert [s.stats["error_estimate"] for s in sols] == [0.0, 0.0]
    assert torch.equal(out, ref)
    for a, b in zip(flat(hn), flat(r_hn), strict=True):
        assert torch.equal(a, b)


def test_importing_and_running_the_modules_never_imports_triton():
    """triton (slow to import, absent in some environments) is imported only when a Triton
    kernel first runs: not by the imports, building the modules, or a CPU forward and
    backward."""
    code = (
        "import sys, torch, paraprop, paraprop.nn, paraprop.scan\n"
        "from paraprop.nn import ParaGRU, ParaLSTM\n"
        "for cls in (ParaGRU, ParaLSTM):\n"
        "    m = cls(2, 3)\n"
        "    x = torch.randn(5, 2, 2, requires_grad=True)\n"
        "    m(x)[0].sum().backward()\n"
        "paraprop.scan.linear_recurrence(torch.rand(2, 9, 3), torch.randn(2, 9, 3))\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] == 'triton'))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize("kind", MODULES)
def test_default_forward_is_newton_within_the_float32_bound(kind):
    m = make(kind, torch.float32)
    assert m.forward_config == ParallelForward(method="newton")
    x = torch.randn(2000, 2, 3)
    with torch.no_grad():
        out, _ = m(x)
        m.forward_config = "sequential"
        ref, _ = m(x)
    assert err(out, ref) <= 1e-5


@pytest.mark.parametrize("method", ["quasi_newton", "elk", "jacobi_gs"])
@pytest.mark.parametrize("kind", MODULES)
def test_other_methods_of_solve(kind, method):
    m = make(kind, forward=ParallelForward(method=method, tol=1e-12))
    x = torch.randn(40, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        out, _ = m(x)
        m.forward_config = "sequential"
        ref, _ = m(x)
    assert err(out, ref) < 1e-9


@pytest.mark.parametrize("kind", MODULES)
def test_unbatched_input(kind):
    m = make(kind)
    x = torch.randn(30, 3, dtype=torch.float64)
    out, hn = m(x)
    ref, r_hn = m(x.unsqueeze(1))
    assert out.shape == (30, 6) and err(out, ref[:, 0]) < 1e-10
    for a, b in zip(flat(hn), flat(r_hn), strict=True):
        assert a.shape == (1, 6) and err(a, b[:, 0]) < 1e-10


def test_unconverged_solve():
    m = make("gru", forward=ParallelForward(max_iters=1))
    x = torch.randn(100, 2, 3, dtype=torch.float64)
    with pytest.raises(paraprop.ConvergenceError):
        m(x)
    m.forward_config = ParallelForward(max_iters=1, throw=False)
    m(x)
    (sol,) = m.last_forward
    assert not sol.converged and sol.result is paraprop.Result.max_iters_reached


# -- backward: the scan gives autograd's gradients through the loop -------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("backward", ["scan", "jacobi"])
@pytest.mark.parametrize("forward", ["newton", "sequential"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind", MODULES)
def test_gradients_match_autograd_through_the_loop(kind, bias, forward, backward, dtype,
                                                  device):
    tol, _, bound = TOL[dtype]
    fwd = ParallelForward(method="newton", tol=tol) if forward == "newton" else forward
    ours = make(kind, dtype, num_layers=2, bias=bias, forward=fwd, backward=backward)
    ref = make(kind, dtype, num_layers=2, bias=bias, forward="sequential", backward="autograd")
    ref.load_state_dict(ours.state_dict())
    ours, ref = ours.to(device), ref.to(device)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(80, 3, 3, generator=g, dtype=dtype).to(device)
    hx = on(states(kind, ours, 3, dtype), device)
    w = torch.randn(80, 3, 6, generator=g, dtype=dtype).to(device)
    grads = []
    for m in (ours, ref):
        xi = x.clone().requires_grad_()
        hi = tuple(h.clone().requires_grad_() for h in flat(hx))
        out, hn = m(xi, hi if kind == "lstm" else hi[0])
        loss = (out * w).sum() + sum((h * h).sum() for h in flat(hn))
        grads.append(torch.autograd.grad(loss, [*m.parameters(), xi, *hi]))
    for a, b in zip(*grads, strict=True):
        assert rel(a, b) <= bound
    run = ours.last_backward
    assert run.kind == backward and len(run.layers) == 2 and run.converged
    assert ref.last_backward.kind == "autograd" and ref.last_backward.layers == ()
    if backward == "jacobi":
        assert [s.method for s in run.layers] == ["jacobi", "jacobi"]


@pytest.mark.parametrize("kind", MODULES)
def test_gradients_of_a_single_step_and_of_the_final_state_only(kind):
    ours = make(kind)
    ref = make(kind, forward="sequential", backward="autograd")
    x = torch.randn(1, 2, 3, dtype=torch.float64)
    for m in (ours, ref):
        m.zero_grad()
        out, hn = m(x)
        flat(hn)[-1].sum().backward()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert rel(p.grad, q.grad) < 1e-12


# -- options and errors ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODULES)
def test_bad_arguments(kind):
    cls = MODULES[kind][0]
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got 0"):
        cls(3, 0)
    with pytest.raises(TypeError, match="batch_first must be a bool"):
        cls(3, 4, batch_first=1)
    with pytest.raises(ValueError, match="unknown forward='fast'"):
        cls(3, 4, forward="fast")
    with pytest.raises(ValueError, match="backward='autograd' needs forward='sequential'"):
        cls(3, 4, backward="autograd")
    m = cls(3, 4)
    with pytest.raises(ValueError, match="expected input to be 2D or 3D"):
        m(torch.randn(2, 3, 4, 3))
    with pytest.raises(ValueError, match="input_size=3"):
        m(torch.randn(5, 2, 4))
    with pytest.raises(TypeError, match="must match the parameters"):
        m(torch.randn(5, 2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="the sequence is empty"):
        m(torch.randn(0, 2, 3))
    with pytest.raises(ValueError, match=r"expected hidden size \(1, 2, 4\)"):
        m(torch.randn(5, 2, 3), torch.zeros(1, 3, 4) if kind == "gru"
          else (torch.zeros(1, 3, 4), torch.zeros(1, 2, 4)))
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 3), [5, 3])
    with pytest.raises(NotImplementedError, match="PackedSequence"):
        m(packed)


def test_lstm_state_must_be_a_pair():
    m = ParaLSTM(3, 4)
    with pytest.raises(TypeError, match=r"hx must be a tuple \(h0, c0\)"):
        m(torch.randn(5, 2, 3), torch.zeros(1, 2, 4))


@pytest.mark.parametrize("kind", MODULES)
def test_double_backward_and_func_transforms_refused(kind):
    m = make(kind)
    x = torch.randn(10, 2, 3, dtype=torch.float64, requires_grad=True)
    out, _ = m(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="first-order gradients only"):
        gx.sum().backward()
    params = dict(m.named_parameters())
    with pytest.raises(NotImplementedError, match="cannot run under torch.func"):
        torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,))[0].sum())(params)
    m.forward_config = "sequential"      # the loop runs under torch.func, with autograd
    g = torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,))[0].sum())(params)
    assert set(g) == set(params)


@pytest.mark.parametrize("kind", MODULES)
def test_empty_batch(kind):
    m = make(kind)
    x = torch.randn(7, 0, 3, dtype=torch.float64, requires_grad=True)
    out, hn = m(x)
    assert out.shape == (7, 0, 6) and flat(hn)[0].shape == (1, 0, 6)
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_repr_and_state_dict():
    m = ParaGRU(3, 4, num_layers=2, batch_first=True)
    assert repr(m) == ("ParaGRU(3, 4, num_layers=2, batch_first=True, forward='newton', "
                       "backward='scan')")
    assert {k: tuple(v.shape) for k, v in ParaLSTM(3, 4, bias=False).state_dict().items()} == {
        "weight_ih_l0": (16, 3), "weight_hh_l0": (16,)}


# -- settings at call time, jit and autocast (issue 27: settings changed after construction) --
@pytest.mark.parametrize("cls", [paraprop.nn.ParaGRU, paraprop.nn.ParaLSTM])
@pytest.mark.parametrize("attr, value", [("bias", False), ("hidden_size", 5),
                                         ("num_layers", 2), ("input_size", 4)])
def test_para_settings_assigned_after_construction_are_refused(cls, attr, value):
    m = cls(3, 4)
    x = torch.randn(6, 2, 3)
    m(x)                                  # as built: runs
    setattr(m, attr, value)
    with pytest.raises(ValueError, match=rf"{attr} was assigned after construction \(expected "
                                         rf"{attr}=.*found {value!r}\)"):
        m(x)


# torch deprecates torch.jit; this test calls it on purpose, to see the modules refuse it
# (a FutureWarning in newer torch, a DeprecationWarning in torch 2.11)
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:FutureWarning")
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("cls", [paraprop.nn.ParaGRU, paraprop.nn.ParaLSTM])
def test_para_jit_is_refused_by_name(cls):
    m = cls(3, 4)
    x = torch.randn(6, 2, 3)
    with pytest.raises(NotImplementedError, match=rf"{cls.__name__} cannot be traced by "
                                                  "torch.jit.trace.*torch.compile"):
        torch.jit.trace(m, (x,), check_trace=False)
    with pytest.raises(NotImplementedError, match=rf"{cls.__name__} cannot be compiled by "
                                                  "torch.jit.script"):
        torch.jit.script(m)


@pytest.mark.parametrize("cls", [paraprop.nn.ParaGRU, paraprop.nn.ParaLSTM])
def test_para_parallel_forward_under_autocast_is_refused(cls):
    m = cls(3, 4)
    x = torch.randn(6, 2, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(NotImplementedError, match=r"does not run under torch.autocast.*"
                                                     "forward='sequential'"):
        m(x)
