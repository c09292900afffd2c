"""The fused Newton steps of ParaGRU and ParaLSTM (``newton_step`` of the recurrences in
paraprop.nn.para_gru, para_lstm): the same values and iterations as the unfused step of
paraprop.solvers.newton, their buffers reused across many iterations, several blocks along time,
and the input terms formed block by block."""

import pytest
import torch
import torch.nn.functional as F

import paraprop
from paraprop.jacobians import diagonal
from paraprop.jacobians.diagonal import (
    GRU_SCRATCH,
    LSTM_SCRATCH,
    gru_linearize,
    gru_newton_block,
    gru_step,
    lstm_linearize,
    lstm_newton_block,
    lstm_step,
)
from paraprop.nn import ParaGRU, ParallelForward, ParaLSTM
from paraprop.nn.para_gru import GRURecurrence
from paraprop.nn.para_lstm import LSTMRecurrence
from paraprop.scan import linear_recurrence, native

pytestmark = pytest.mark.usefixtures("one_thread")
f64 = torch.float64


def err(a, b):
    return float((a - b).detach().abs().max())


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 3 steps (at B * H = 6 .. 16 values per step): every solve spans many."""
    monkeypatch.setattr(diagonal, "NEWTON_BLOCK_ELEMENTS", 40)


def hard_gru(B=3, T=120, H=5, scale=3.0, seed=0, dtype=f64, inputs=False, device="cpu"):
    """A ParaGRU layer whose Newton solve needs tens of iterations (strong diagonal weights),
    with samples that stop at different iterations."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=dtype)).to(device)

    w, b, h0 = r(3, H, scale=scale), r(3, H), r(B, H)
    if not inputs:
        return GRURecurrence(r(B, T, 3 * H, scale=2), h0, w, b)
    x, w_ih = r(B, T, 2), r(3 * H, 2, scale=2)
    return GRURecurrence(None, h0, w, b, inputs=(x, w_ih, r(3 * H)))


def hard_lstm(B=2, T=120, H=3, scale=16.0, seed=0, dtype=f64, inputs=False, device="cpu"):
    """A ParaLSTM layer whose Newton solve needs tens of iterations, units stopping apart."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=dtype)).to(device)

    w, h0 = r(4, H, scale=scale), r(B, H, 2)
    if not inputs:
        return LSTMRecurrence(r(4, B, H, T, scale=0.5), h0, w)
    x, w_ih = r(B, T, 2), r(4 * H, 2, scale=0.25)
    return LSTMRecurrence(None, h0, w, inputs=(x, w_ih, r(4 * H, scale=0.25)))


HARD = {"gru": hard_gru, "lstm": hard_lstm}


def unfused(rec):
    """The same recurrence without the fused step (the driver's linearize path)."""
    rec.newton_step = lambda x, lo, form: None
    return rec


# -- the block kernel -----------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_block_kernel_is_the_cell_and_its_exact_jacobian(bias):
    g = torch.Generator().manual_seed(0)
    B, n, H = 2, 9, 5
    gi = torch.randn(B, 2 * n, 3, H, generator=g, dtype=f64)[:, ::2]        # strided views
    prev = torch.randn(B, n, 2 * H, generator=g, dtype=f64)[..., :H]
    w = torch.randn(3, H, generator=g, dtype=f64)
    b = torch.randn(3, H, generator=g, dtype=f64) if bias else None
    y, a = torch.empty(B, n, H, dtype=f64), torch.empty(B, n, H, dtype=f64)
    scratch = torch.full((GRU_SCRATCH * B * n * H,), float("nan"), dtype=f64)
    gru_newton_block(gi, prev, w, b, y, a, scratch)
    assert err(y, gru_step(gi, prev, w, b)) == 0
    y2, a2 = torch.empty_like(y), torch.empty_like(a)
    gru_linearize(gi, prev, w, b, y2, a2)
    assert err(y, y2) == 0 and err(a, a2) < 1e-14
    for i in range(B):
        for t in range(n):
            J = torch.autograd.functional.jacobian(
                lambda v, i=i, t=t: gru_step(gi[i, t], v, w, b), prev[i, t])
            assert err(J, torch.diag(a[i, t])) < 1e-14
    y3 = torch.empty_like(y)
    gru_newton_block(gi, prev, w, b, y3, None, scratch)                    # values only
    assert err(y3, y) == 0


def test_lstm_block_kernel_is_the_cell_and_its_exact_jacobian():
    g = torch.Generator().manual_seed(0)
    B, H, n = 2, 5, 7
    gi = torch.randn(4, B, H, 2 * n, generator=g, dtype=f64)[..., ::2]     # strided views
    hc = torch.randn(B, H, n, 2, generator=g, dtype=f64)                  # interleaved
    w = torch.randn(4, H, generator=g, dtype=f64)
    out = torch.empty(B, H, n, 2, dtype=f64)
    J = torch.empty(B, H, n, 2, 2, dtype=f64)
    scratch = torch.full((LSTM_SCRATCH * B * H * n,), float("nan"), dtype=f64)
    lstm_newton_block(gi, hc[..., 0], hc[..., 1], w.view(4, 1, H, 1), out[..., 0], out[..., 1],
                      J, scratch)
    rows = gi.permute(1, 3, 0, 2)                                         # (B, n, 4, H)
    h_ref, c_ref = lstm_step(rows, hc[..., 0].transpose(1, 2), hc[..., 1].transpose(1, 2), w)
    assert err(out[..., 0], h_ref.transpose(1, 2)) == 0
    assert err(out[..., 1], c_ref.transpose(1, 2)) == 0
    J2 = torch.empty_like(J)
    lstm_linearize(gi, hc[..., 0], hc[..., 1], w.view(4, 1, H, 1), torch.empty_like(hc[..., 0]),
                   torch.empty_like(hc[..., 0]), J2, dim=0)
    assert err(J, J2) < 1e-14
    out2 = torch.empty_like(out)
    lstm_newton_block(gi, hc[..., 0], hc[..., 1], w.view(4, 1, H, 1), out2[..., 0],
                      out2[..., 1], None, scratch)                          # values only
    assert err(out2, out) == 0


# -- the fused step -------------------------------------------------------------------------------
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("inputs", [False, True], ids=["gi", "inputs"])
@pytest.mark.parametrize("kind", HARD)
def test_fused_step_equals_the_drivers_step(small_blocks, monkeypatch, kind, inputs,
                                            use_native):
    if not use_native:
        monkeypatch.setattr(native, "supports", lambda *t: False)
    elif not native.available():
        pytest.skip(native.status())
    rec = HARD[kind](inputs=inputs, T=40)
    x = torch.randn(rec.shape, dtype=f64, generator=torch.Generator().manual_seed(3))
    xc = x.reshape(rec.B, 40, -1)
    for lo in (0, 1, 7, 39):
        y, trial = rec.newton_step(xc, lo, "any")
        y_ref, J = rec.linearize(xc, lo, "any")
        ref = linear_recurrence(J, y_ref - xc[:, lo:]).add_(xc[:, lo:])
        assert y.shape == trial.shape == y_ref.shape == (rec.B, 40 - lo, xc.shape[-1])
        assert err(y, y_ref) == 0 and err(trial, ref) < 1e-14
    assert rec.newton_step(xc, 0, "dense") is None


@pytest.mark.parametrize("method", ["newton", "quasi_newton"])
@pytest.mark.parametrize("inputs", [False, True], ids=["gi", "inputs"])
@pytest.mark.parametrize("kind", HARD)
def test_buffers_reused_over_many_iterations(small_blocks, kind, inputs, method, device):
    """Tens of iterations, samples stopping at different ones, many blocks: the fused step
    takes the unfused step's iterations and values, within 1e-10 of the sequential loop. (It is
    the torch cell's on every device: a Recurrence never certifies with the Triton cell; the
    layers use that only as a warm start, tests/test_triton.py.)"""
    rec = HARD[kind](inputs=inputs, device=device)
    seq = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2)
    fused = paraprop.solve(rec, rec.zeros(), method=method, dim=-2, tol=1e-12)
    plain = paraprop.solve(unfused(HARD[kind](inputs=inputs, device=device)), rec.zeros(),
                           method=method, dim=-2, tol=1e-12)
    if method == "newton" or kind == "gru":
        assert rec.step_kernel in ("native", "torch")
    its = fused.stats["sample_iterations"]
    assert fused.converged and fused.iterations >= 20 and len(set(its.flatten().tolist())) > 1
    assert torch.equal(its, plain.stats["sample_iterations"])
    assert fused.evaluations == plain.evaluations == fused.iterations
    assert err(fused.value, plain.value) < 1e-13
    assert err(fused.value, seq.value) < 1e-10


def test_float32_fused_solve_is_certified(small_blocks):
    rec = hard_gru(dtype=torch.float32, scale=1.0, T=300)
    seq = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2)
    sol = paraprop.solve(rec, rec.zeros(), method="newton", dim=-2, tol=1e-5)
    assert sol.converged and sol.stats["error_estimate"] <= 1e-5
    assert err(sol.value, seq.value) <= 1e-5


def test_input_terms_per_block_equal_the_stored_ones():
    g = torch.Generator().manual_seed(1)
    B, T, H, I = 2, 50, 4, 3
    x = torch.randn(B, T, I, generator=g, dtype=f64)
    w_ih, b_ih = torch.randn(3 * H, I, generator=g, dtype=f64), torch.randn(3 * H, dtype=f64)
    w, b, h0 = (torch.randn(3, H, dtype=f64), torch.randn(3, H, dtype=f64),
                torch.randn(B, H, dtype=f64))
    for bias in (b_ih, None):
        a = GRURecurrence(None, h0, w, b, inputs=(x, w_ih, bias))
        ref = GRURecurrence(F.linear(x, w_ih, bias), h0, w, b)
        seq = paraprop.solve(ref, ref.zeros(), method="sequential", dim=-2).value
        for method in ("sequential", "newton", "jacobi"):
            sol = paraprop.solve(a, a.zeros(), method=method, dim=-2, tol=1e-12)
            assert err(sol.value, seq) < 1e-10, method
    with pytest.raises(ValueError, match="either gi or inputs"):
        GRURecurrence(F.linear(x, w_ih, b_ih), h0, w, b, inputs=(x, w_ih, b_ih))
    with pytest.raises(ValueError, match="either gi or inputs"):
        GRURecurrence(None, h0, w, b)


def test_lstm_input_terms_per_block_equal_the_stored_ones():
    g = torch.Generator().manual_seed(1)
    B, T, H, I = 2, 50, 4, 3
    x = torch.randn(B, T, I, generator=g, dtype=f64)
    w_ih, b = torch.randn(4 * H, I, generator=g, dtype=f64), torch.randn(4 * H, dtype=f64)
    w, h0 = torch.randn(4, H, dtype=f64), torch.randn(B, H, 2, dtype=f64)
    for bias in (b, None):
        a = LSTMRecurrence(None, h0, w, inputs=(x, w_ih, bias))
        gi = torch.matmul(w_ih.view(4, 1, H, I), x.transpose(1, 2))       # (4, B, H, T)
        ref = LSTMRecurrence(gi if bias is None else gi + bias.view(4, 1, H, 1), h0, w)
        seq = paraprop.solve(ref, ref.zeros(), method="sequential", dim=-2).value
        for method in ("sequential", "newton", "jacobi"):
            sol = paraprop.solve(a, a.zeros(), method=method, dim=-2, tol=1e-12)
            assert err(sol.value, seq) < 1e-10, method
    with pytest.raises(ValueError, match="either gi or inputs"):
        LSTMRecurrence(gi, h0, w, inputs=(x, w_ih, b))


# -- the module -----------------------------------------------------------------------------------
@pytest.mark.parametrize("inputs", [2, 7], ids=["per-block", "stored"])
@pytest.mark.parametrize("cls", [ParaGRU, ParaLSTM])
def test_newton_within_1e10_of_the_loop_in_float64(small_blocks, cls, inputs, device):
    torch.manual_seed(0)
    m = cls(inputs, 6, num_layers=2, dtype=f64,
            forward=ParallelForward(method="newton", tol=1e-12)).to(device)
    x = torch.randn(500, 3, inputs, dtype=f64).to(device)
    hx = torch.randn(2, 3, 6, dtype=f64).to(device)
    hx = hx if cls is ParaGRU else (hx, torch.randn(2, 3, 6, dtype=f64).to(device))
    with torch.no_grad():
        out, hn = m(x, hx)
        sols = m.last_forward
        m.forward_config = "sequential"
        ref, r_hn = m(x, hx)
    assert [s.converged for s in sols] == [True, True]
    bound = 5 * 1e-12       # the modules' stated bound: 5 tol (max |out| <= 1 here)
    assert err(out, ref) <= bound
    for a, b in zip(hn if isinstance(hn, tuple) else (hn,),
                    r_hn if isinstance(r_hn, tuple) else (r_hn,), strict=True):
        assert err(a, b) <= bound


def test_paragru_gradients_unchanged_by_the_fused_forward(small_blocks):
    torch.manual_seed(0)
    m = ParaGRU(2, 5, dtype=f64)
    x = torch.randn(60, 2, 2, dtype=f64, requires_grad=True)
    out, _ = m(x)
    g = torch.autograd.grad(out.square().sum(), [x, *m.parameters()])
    m.forward_config = "sequential"
    ref, _ = m(x)
    g_ref = torch.autograd.grad(ref.square().sum(), [x, *m.parameters()])
    assert err(out, ref) < 1e-9
    for a, b in zip(g, g_ref, strict=True):
        assert err(a, b) < 1e-8


@pytest.mark.parametrize("cls", [paraprop.nn.ParaGRU, paraprop.nn.ParaLSTM])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B, H", [(3, 5), (1, 7), (2, 33)])
def test_newton_at_tol0_is_bitwise_the_loop_at_any_row_width(cls, dtype, B, H):
    # B * H not a multiple of the vector width: torch.sigmoid rounds a CPU tensor's last partial
    # vector differently, so the cells use a logistic function of exp / add / reciprocal, which
    # round each element alike in a row of the loop and in a block of Newton's steps
    torch.manual_seed(0)
    m = cls(3, H).to(dtype)
    x = torch.randn(40, B, 3, dtype=dtype)
    m.forward_config = paraprop.nn.ParallelForward("newton", tol=0)
    y, _ = m(x)
    assert all(s.converged for s in m.last_forward)
    m.forward_config = "sequential"
    ref, _ = m(x)
    assert torch.equal(y, ref)


def test_the_cells_logistic_function_is_size_independent():
    x = torch.randn(4099, dtype=torch.float64) * 4
    whole = diagonal.sigmoid_(x.clone())
    pieces = torch.cat([diagonal.sigmoid_(x[i:i + 7].clone()) for i in range(0, 4099, 7)])
    assert torch.equal(whole, pieces)
    assert (whole - torch.sigmoid(x)).abs().max() < 1e-15
