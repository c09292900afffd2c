"""``forward="native"`` / ``"auto"``: the RNN, GRU and LSTM loops in the native kernel.

Every case is compared with torch's own module (outputs, final states and every gradient),
and the factors the native loop writes for the scan backward with those the PyTorch path
recomputes. The kernels' ``tanh``/``sigmoid`` are checked against torch's over the whole float32
range, special values included.
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import paraprop
from paraprop.nn import GRU, LSTM, RNN, SequentialForward
from paraprop.nn.options import describe, forward_option
from paraprop.scan import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")

CASES = [(RNN, torch.nn.RNN, {}), (RNN, torch.nn.RNN, {"nonlinearity": "relu"}),
         (GRU, torch.nn.GRU, {}), (LSTM, torch.nn.LSTM, {})]
IDS = ["rnn_tanh", "rnn_relu", "gru", "lstm"]
# float32: the loop's rounding differs from torch's (another summation order, own tanh and
# sigmoid within 3 ulp); float64: the same, 2^-52 apart per step
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def kernels(mod):
    """The sequential kernel that ran per layer: ``last_forward`` holds one record of the loop
    per layer (the sequential result itself)."""
    assert all(s.method == "sequential" and s.converged for s in mod.last_forward)
    return [s.stats["kernel"] for s in mod.last_forward]


def pair(cls, tcls, extra, dtype, **kw):
    ref = tcls(3, 6, **extra, **kw).to(dtype)
    ours = cls(3, 6, **extra, **kw, forward="native").to(dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def run(mod, x, hx, g):
    out, h = mod(x, hx)
    params = [p for p in mod.parameters()]
    leaves = [x, *params] + ([h_ for h_ in (hx if isinstance(hx, tuple) else (hx,))]
                             if hx is not None else [])
    grads = torch.autograd.grad((out * g).sum() + sum((t * t).sum() for t in
                                (h if isinstance(h, tuple) else (h,))), leaves)
    return out, h, grads


def close(a, b, tol):
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("layers,batch_first,bias,with_h0",
                         list(itertools.product([1, 2], [False, True], [True, False],
                                                [False, True])))
def test_native_forward_equals_torch(cls, tcls, extra, dtype, layers, batch_first, bias,
                                     with_h0):
    torch.manual_seed(layers * 8 + batch_first * 4 + bias * 2 + with_h0)
    ref, ours = pair(cls, tcls, extra, dtype, num_layers=layers, batch_first=batch_first,
                     bias=bias)
    T, B = 23, 5
    x = torch.randn((B, T, 3) if batch_first else (T, B, 3), dtype=dtype, requires_grad=True)
    hx = None
    if with_h0:
        hx = torch.randn(layers, B, 6, dtype=dtype, requires_grad=True)
        if cls is LSTM:
            hx = (hx, torch.randn(layers, B, 6, dtype=dtype, requires_grad=True))
    g = torch.randn((B, T, 6) if batch_first else (T, B, 6), dtype=dtype)
    o1, h1, g1 = run(ref, x, hx, g)
    o2, h2, g2 = run(ours, x, hx, g)
    assert kernels(ours) == ["native"] * layers
    tol = TOL[dtype]
    assert o2.shape == o1.shape and close(o2, o1, tol)
    for a, b in zip(h2 if cls is LSTM else (h2,), h1 if cls is LSTM else (h1,), strict=True):
        assert a.shape == b.shape and close(a, b, tol)
    assert len(g1) == len(g2)
    for a, b in zip(g2, g1, strict=True):
        assert close(a, b, 10 * tol)


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
def test_native_forward_without_grad_and_unbatched(cls, tcls, extra):
    ref, ours = pair(cls, tcls, extra, torch.float32)
    x = torch.randn(40, 3)
    with torch.no_grad():
        o1, _ = ref(x)
        o2, _ = ours(x)
    assert kernels(ours) == ["native"]
    assert o2.shape == o1.shape and close(o2, o1, 1e-5)


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
def test_native_forward_long_sequence_many_rows(cls, tcls, extra):
    """Many batch rows (split across threads, groups of four rows in the kernel) and a long,
    saturating sequence: still torch's result."""
    torch.manual_seed(1)
    ref, ours = pair(cls, tcls, extra, torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(3)
        ours.load_state_dict(ref.state_dict())
        x = 2 * torch.randn(700, 37, 3, dtype=torch.float64)
        assert close(ours(x)[0], ref(x)[0], 1e-12)


def test_gru_and_lstm_factors_equal_the_recomputed_ones():
    """What the native loop writes for the scan backward equals what the PyTorch path
    recomputes from the states (paraprop.nn.gru / lstm ``jacobian_factors``)."""
    from paraprop.nn import gru as gru_mod
    from paraprop.nn import lstm as lstm_mod

    torch.manual_seed(2)
    T, B, H = 31, 6, 7
    x = torch.randn(T, B, 4, dtype=torch.float64)
    h0, c0 = torch.randn(B, H, dtype=torch.float64), torch.randn(B, H, dtype=torch.float64)
    g = torch.nn.GRU(4, H).double()
    w = [g.weight_ih_l0, g.weight_hh_l0, g.bias_ih_l0, g.bias_hh_l0]
    with torch.no_grad():
        out, fac = gru_mod.native_layer(x, h0, *w, True)
        hprev = torch.cat([h0[None], out[:-1]])
        for a, b in zip(fac, gru_mod.jacobian_factors(x, hprev, *w), strict=True):
            assert torch.allclose(a, b, atol=1e-13, rtol=0)
    m = torch.nn.LSTM(4, H).double()
    w = [m.weight_ih_l0, m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0]
    with torch.no_grad():
        out, cell, fac = lstm_mod.native_layer(x, h0, c0, *w, True)
        ref, (hn, cn) = m(x, (h0[None], c0[None]))
        assert torch.allclose(cell[-1], cn[0], atol=1e-13, rtol=0)
        hprev = torch.cat([h0[None], out[:-1]])
        for a, b in zip(fac, lstm_mod.jacobian_factors(x, hprev, c0, *w), strict=True):
            assert torch.allclose(a, b, atol=1e-13, rtol=0)


def _elementwise(values: torch.Tensor, kind: str) -> torch.Tensor:
    """The kernel's tanh (an RNN step with zero hidden weights) or sigmoid (a GRU's output with
    an update gate only: ``h' = z h`` when ``n = 0``), each value in its own batch row."""
    p = values.reshape(1, -1, 1).contiguous()
    out = torch.empty_like(p)
    if kind == "tanh":
        native.rnn_forward(p, torch.zeros(1, 1), None, out, False)
        return out.flatten()
    # GRU, H = 1: r anything, n = tanh(0 + r * 0) = 0, h' = (h - 0) z + 0 = z * h with h = 1
    gi = torch.zeros(1, p.shape[1], 3)
    gi[..., 1] = p[..., 0]
    native.gru_forward(gi, torch.zeros(1, 3), None, torch.ones(p.shape[1], 1), out)
    return out.flatten()


@pytest.mark.parametrize("kind", ["tanh", "sigmoid"])
def test_float32_tanh_and_sigmoid_within_3_ulp(kind):
    xs = torch.cat([torch.linspace(-30, 30, 600_001), torch.logspace(-30, 1.5, 20_001),
                    -torch.logspace(-30, 1.5, 20_001)])
    ours = _elementwise(xs, kind).double()
    ref = (torch.tanh if kind == "tanh" else torch.sigmoid)(xs.double())
    # 3 units in the last place of the float32 result (ulp = 2^-23 relative, at least the
    # smallest normal's)
    ulp = torch.maximum(ref.abs() * 2.0 ** -23, torch.tensor(2.0 ** -149, dtype=torch.float64))
    err = (ours - ref).abs() / ulp
    mask = ref.abs() > 1e-37       # below: flushed subnormals, checked apart
    assert err[mask].max().item() <= 3.0


@pytest.mark.parametrize("kind", ["tanh", "sigmoid"])
def test_float32_special_values(kind):
    xs = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 100.0, -100.0])
    got = _elementwise(xs, kind)
    want = (torch.tanh if kind == "tanh" else torch.sigmoid)(xs)
    assert torch.isnan(got[0])
    assert torch.allclose(got[1:], want[1:], atol=1e-37, rtol=0)


def test_nan_input_propagates_like_torch():
    ref = torch.nn.GRU(2, 4)
    ours = GRU(2, 4, forward="native")
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(10, 3, 2)
    x[4, 1, 0] = float("nan")
    with torch.no_grad():
        o1, o2 = ref(x)[0], ours(x)[0]
    assert torch.equal(torch.isnan(o1), torch.isnan(o2))
    assert close(o2.nan_to_num(), o1.nan_to_num(), 1e-5)


def test_options_names_and_errors():
    assert forward_option("native") == SequentialForward("native")
    assert forward_option("auto") == SequentialForward("auto")
    assert forward_option("sequential") == SequentialForward()
    assert describe(SequentialForward("native")) == "'native'"
    assert describe(SequentialForward()) == "'sequential'"
    assert "forward='native'" in repr(GRU(2, 3, forward="native"))
    assert "forward='sequential'" in repr(GRU(2, 3, forward="sequential"))
    assert "forward" not in repr(GRU(2, 3))       # the default, forward="auto"
    assert "backward='auto'" in repr(GRU(2, 3))
    with pytest.raises(ValueError, match="SequentialForward: unknown kernel='fast'; choose one "
                                         "of torch, native, auto$"):
        SequentialForward("fast")
    with pytest.raises(ValueError, match="SequentialForward: unknown kernel=3; choose one of"):
        SequentialForward(3)
    with pytest.raises(ValueError, match="native loop.*backward='autograd'"):
        RNN(2, 3, forward="native", backward="autograd")
    with pytest.raises(ValueError, match="sequential loop"):
        paraprop.nn.ParallelForward(method="native")


def test_falls_back_to_torch_where_the_kernel_cannot_run():
    # float16 parameters: no native kernel; torch's own module runs (and the stats say so)
    ours = RNN(2, 3, forward="auto")
    ref = torch.nn.RNN(2, 3)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(5, 1, 2, dtype=torch.bfloat16)
    ours, ref = ours.to(torch.bfloat16), ref.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x)[0], ref(x)[0])
    assert kernels(ours) == ["torch"]


def test_under_torch_func_the_torch_kernel_runs():
    ours = GRU(2, 3, forward="native").double()
    ref = torch.nn.GRU(2, 3).double()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(6, 2, 2, dtype=torch.float64)
    params = dict(ours.named_parameters())

    def f(mod, p):
        return torch.func.functional_call(mod, p, (x,))[0].sum()

    g1 = torch.func.grad(lambda p: f(ours, p))(params)
    g2 = torch.func.grad(lambda p: f(ref, p))(dict(ref.named_parameters()))
    for k in g1:
        assert torch.equal(g1[k], g2[k])


def test_paraprop_native_0_falls_back(tmp_path):
    """With PARAPROP_NATIVE=0 the module runs torch's kernel, bitwise torch's outputs."""
    script = (
        "import torch, paraprop.nn as pn\n"
        "m = pn.LSTM(2, 4, forward='native'); r = torch.nn.LSTM(2, 4)\n"
        "r.load_state_dict(m.state_dict()); x = torch.randn(9, 3, 2, requires_grad=True)\n"
        "o = m(x)[0]; o.sum().backward()\n"
        "assert torch.equal(o, r(x)[0]), 'outputs'\n"
        "assert [s.stats['kernel'] for s in m.last_forward] == ['torch'], m.last_forward\n"
        "print('ok')\n")
    env = {**os.environ, "PARAPROP_NATIVE": "0", "PARAPROP_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_native_layer_input_projection_is_one_product():
    """The RNN's native layer folds both biases into the one input product: the same states as
    the step-by-step definition."""
    from paraprop.nn.rnn import native_layer

    torch.manual_seed(3)
    w = [torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64) / 3,
         torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    x, h = torch.randn(12, 3, 2, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    out = native_layer({"bias": True, "mode": "RNN_TANH"}, x, h, w)
    for t in range(12):
        h = torch.tanh(F.linear(x[t], w[0], w[2]) + F.linear(h, w[1], w[3]))
        assert torch.allclose(out[t], h, atol=1e-14, rtol=0)


@pytest.mark.parametrize("kernel", ["native", "auto"])
def test_para_cells_refuse_a_native_forward(kernel):
    with pytest.raises(ValueError, match=f"ParaGRU has no forward='{kernel}'.*'sequential' is "
                                         "its step-by-step loop"):
        paraprop.nn.ParaGRU(2, 3, forward=kernel)
    m = paraprop.nn.ParaLSTM(2, 3)
    with pytest.raises(ValueError, match=f"ParaLSTM has no forward='{kernel}'"):
        m.forward_config = kernel
    assert m.forward_config == paraprop.nn.ParallelForward()      # unchanged
