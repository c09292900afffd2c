"""paraprop.nn.LSTM: the outputs, ``(h_n, c_n)`` and every gradient of torch.nn.LSTM, with the
scan / Jacobi backward and with a parallel forward; the options it refuses."""

import itertools

import pytest
import torch

import paraprop
import paraprop.nn as pnn
from paraprop.nn import ParallelForward, ScanBackward

# max |ours - torch| / max |torch| per dtype, for outputs and gradients
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
PARALLEL = ["newton", "quasi_newton", "elk", "quasi_elk", "jacobi", "jacobi_gs", "gs_jacobi",
            "sliding_jacobi"]
I, H = 3, 5

pytestmark = pytest.mark.usefixtures("one_thread")


def rel(x, ref):
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def pair(dtype=torch.float64, seed=0, device="cpu", **kw):
    torch.manual_seed(seed)
    # the settings these tests were written for (torch's kernel, the scan), unless given; the
    # defaults' own choice is tested in tests/test_nn_auto.py
    ours_kw = {"forward": kw.pop("forward", "sequential"), "backward": kw.pop("backward", "scan")}
    ref = torch.nn.LSTM(I, H, dtype=dtype, **kw).to(device)
    ours = pnn.LSTM(I, H, dtype=dtype, device=device, **kw, **ours_kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def run_both(ref, ours, x, hx):
    """Both modules on the same inputs with a random loss on output, h_n and c_n: per module
    ``[out, h_n, c_n, dx, (dh0, dc0,) {name: dparam}]``."""
    results = []
    g = torch.Generator().manual_seed(1)
    weights = None
    for mod in (ref, ours):
        mod.zero_grad()
        xi = x.clone().requires_grad_()
        hi = None if hx is None else tuple(h.clone().requires_grad_() for h in hx)
        out, (hn, cn) = mod(xi, hi)
        if weights is None:   # drawn on the CPU, then moved: the same loss on every device
            weights = [torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device)
                       for t in (out, hn, cn)]
        sum((t * w).sum() for t, w in zip((out, hn, cn), weights, strict=True)).backward()
        grads = {n: p.grad for n, p in mod.named_parameters()}
        states = [] if hi is None else [hi[0].grad, hi[1].grad]
        results.append([out.detach(), hn.detach(), cn.detach(), xi.grad, *states, grads])
    return results


def assert_same(results, tol):
    want, got = results
    for w, g in zip(want[:-1], got[:-1], strict=True):
        assert g.shape == w.shape
        assert rel(g, w) <= tol
    assert got[-1].keys() == want[-1].keys()
    for name, w in want[-1].items():
        assert rel(got[-1][name], w) <= tol, name


def inputs(T, B, batch_first, layers, dtype=torch.float64, seed=2, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((B, T, I) if batch_first else (T, B, I), generator=g, dtype=dtype)
    hx = tuple(torch.randn(layers, B, H, generator=g, dtype=dtype).to(device) for _ in range(2))
    return x.to(device), hx


# -- equality with torch ------------------------------------------------------------------------
@pytest.mark.parametrize("num_layers,batch_first,bias,with_hx",
                         list(itertools.product([1, 2], [False, True], [True, False],
                                                [True, False])))
@pytest.mark.parametrize("backward", ["scan", "jacobi", "autograd"])
def test_equal_to_torch(num_layers, batch_first, bias, with_hx, backward, device):
    ref, ours = pair(num_layers=num_layers, batch_first=batch_first, bias=bias,
                     backward=backward, device=device)
    x, hx = inputs(9, 4, batch_first, num_layers, device=device)
    results = run_both(ref, ours, x, hx if with_hx else None)
    if device.type == "cpu":   # torch's own kernel, layer by layer (cuDNN may fuse the layers)
        assert torch.equal(results[1][0], results[0][0])
    assert_same(results, TOL[torch.float64])


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("forward", ["sequential", "newton"])
def test_short_sequences(T, forward):
    ref, ours = pair(num_layers=2, forward=forward)
    x, hx = inputs(T, 3, False, 2)
    assert_same(run_both(ref, ours, x, hx), TOL[torch.float64])


def test_float32_long_sequence(device):
    ref, ours = pair(torch.float32, num_layers=2, device=device)
    x, hx = inputs(300, 6, False, 2, torch.float32, device=device)
    assert_same(run_both(ref, ours, x, hx), TOL[torch.float32])
    assert_same(run_both(ref, ours, x, None), TOL[torch.float32])


@pytest.mark.parametrize("algorithm", ["sequential", "chunked", "blelloch"])
def test_every_scan_algorithm(algorithm):
    ref, ours = pair(num_layers=2, batch_first=True, backward=ScanBackward(method=algorithm))
    x, hx = inputs(40, 3, True, 2)
    assert_same(run_both(ref, ours, x, hx), TOL[torch.float64])


@pytest.mark.parametrize("with_hx", [True, False])
def test_unbatched_input(with_hx):
    ref, ours = pair(num_layers=2)
    x, hx = inputs(8, 1, False, 2)
    hx = tuple(h[:, 0] for h in hx) if with_hx else None
    results = run_both(ref, ours, x[:, 0], hx)
    assert results[1][0].shape == (8, H) and results[1][1].shape == (2, H)
    assert_same(results, TOL[torch.float64])


def test_gradcheck_float64(monkeypatch):
    _, ours = pair(num_layers=2)
    names = [n for n, _ in ours.named_parameters()]
    x, (h0, c0) = inputs(6, 2, False, 2)
    leaves = [t.clone().requires_grad_() for t in (x, h0, c0)]
    params = [p.detach().clone().requires_grad_() for p in ours.parameters()]

    def f(x, h0, c0, *ps):
        out, (hn, cn) = torch.func.functional_call(ours, dict(zip(names, ps, strict=True)),
                                                   (x, (h0, c0)))
        return out, hn, cn

    # functional_call swaps the parameters, the module's own forward (scan backward) runs
    calls, backward = [], pnn.lstm.LSTMScanFunction.backward
    monkeypatch.setattr(pnn.lstm.LSTMScanFunction, "backward",
                        staticmethod(lambda ctx, *g: calls.append(1) or backward(ctx, *g)))
    assert torch.autograd.gradcheck(f, (*leaves, *params))
    assert calls


def test_no_grad_and_no_parameter_grad_are_torch():
    ref, ours = pair(num_layers=2)
    x, hx = inputs(7, 3, False, 2)
    with torch.no_grad():
        want, got = ref(x, hx), ours(x, hx)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(g, w) for g, w in zip(got[1], want[1], strict=True))
    for p in ours.parameters():
        p.requires_grad_(False)
    out, (hn, cn) = ours(x, hx)
    assert torch.equal(out, want[0]) and not out.requires_grad


def test_state_dict_round_trip_and_isinstance():
    ref = torch.nn.LSTM(4, 6, num_layers=2)
    ours = pnn.LSTM(4, 6, num_layers=2)
    assert isinstance(ours, torch.nn.LSTM)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())
    ref.load_state_dict(ours.state_dict())
    assert "backward='auto'" in repr(ours)      # the default


# -- parallel forward ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", PARALLEL)
@pytest.mark.parametrize("num_layers", [1, 2])
def test_parallel_forward_equals_torch(method, num_layers, device):
    ref, ours = pair(num_layers=num_layers,
                     forward=ParallelForward(method=method, tol=1e-13), device=device)
    x, hx = inputs(11, 3, False, num_layers, device=device)
    assert_same(run_both(ref, ours, x, hx), TOL[torch.float64])
    sols = ours.last_forward
    assert len(sols) == num_layers and all(s.converged for s in sols)
    assert all(1 <= s.iterations <= 11 for s in sols)
    assert all(s.value.shape == (3, 2 * 5) for s in sols)     # the last [h, c] only


def test_newton_default_tol_float32():
    ref, ours = pair(torch.float32, num_layers=2, batch_first=True, forward="newton")
    x, hx = inputs(200, 4, True, 2, torch.float32)
    want, got = run_both(ref, ours, x, hx)
    scale = max(1.0, float(want[0].abs().max()))
    assert float((got[0] - want[0]).abs().max()) <= 5e-5 * scale
    for w, g in zip(want[3:-1], got[3:-1], strict=True):
        assert rel(g, w) <= 1e-4


def test_recurrence_with_an_lstm_cell_uses_the_factored_jacobian():
    cell = torch.nn.LSTMCell(I, H, dtype=torch.float64)
    rec = paraprop.Recurrence(cell, torch.randn(2, 9, I, dtype=torch.float64))
    _, J = rec.linearize(rec.zeros(), 1, "any")
    assert isinstance(J, paraprop.scan.LSTMFactored) and not J.transposed
    assert J.scale.shape == (2, 8, 4 * H) and J.weight is cell.weight_hh


# -- refusals and faults ------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    ({"proj_size": 2}, r"paraprop.nn.LSTM does not support proj_size; got proj_size=2"),
    ({"bidirectional": True}, r"paraprop.nn.LSTM does not support bidirectional=True"),
    ({"num_layers": 2, "dropout": 0.5},
     r"paraprop.nn.LSTM does not support dropout between layers \(got dropout=0.5\)"),
])
def test_unsupported_options_raise(kw, match):
    with pytest.raises(NotImplementedError, match=match):
        pnn.LSTM(I, H, **kw)


@pytest.mark.parametrize("hx,exc,match", [
    (torch.zeros(1, 2, H), TypeError, r"hx must be a pair of tensors \(h_0, c_0\), got Tensor"),
    ((torch.zeros(1, 2, H),), TypeError, "hx must be a pair of tensors"),
    ((torch.zeros(1, 3, H), torch.zeros(1, 2, H)), ValueError,
     r"expected hidden size \(1, 2, 5\), got \(1, 3, 5\)"),
    ((torch.zeros(1, 2, H), torch.zeros(1, 2, H + 1)), ValueError,
     r"expected hidden size \(1, 2, 5\), got \(1, 2, 6\)"),
    ((torch.zeros(1, 2, H), torch.zeros(1, 2, H, dtype=torch.float64)), TypeError,
     "hx has dtype torch.float64 but input has torch.float32"),
])
def test_bad_hx(hx, exc, match):
    ours = pnn.LSTM(I, H)
    with pytest.raises(exc, match=match):
        ours(torch.zeros(4, 2, I), hx)


def test_packed_sequence_is_refused():
    seq = torch.nn.utils.rnn.pack_sequence([torch.zeros(3, I), torch.zeros(2, I)])
    with pytest.raises(NotImplementedError, match="paraprop.nn.LSTM does not take a "
                                                  "PackedSequence"):
        pnn.LSTM(I, H)(seq)


@pytest.mark.parametrize("forward", ["sequential", "newton"])
def test_batch_zero_is_torch(forward):
    ref, ours = pair(num_layers=2, forward=forward)
    x = torch.randn(5, 0, I, dtype=torch.float64, requires_grad=True)
    out, (hn, cn) = ours(x)
    assert out.shape == (5, 0, H) and hn.shape == cn.shape == (2, 0, H)
    (out.sum() + hn.sum() + cn.sum()).backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("backward", ["scan", "jacobi"])
def test_double_backward_is_refused(backward):
    _, ours = pair(backward=backward)
    x = torch.randn(6, 2, I, dtype=torch.float64, requires_grad=True)
    out, (hn, cn) = ours(x)
    (g,) = torch.autograd.grad((out ** 2).sum() + cn.sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError,
                       match=rf"paraprop.nn.LSTM\(backward='{backward}'\) computes first-order "
                             r"gradients only .* use backward='autograd'"):
        (g ** 2).sum().backward()


def test_torch_func_is_torch_and_refused_for_a_parallel_forward():
    ref, ours = pair()
    x = torch.randn(5, 2, I, dtype=torch.float64)
    want = torch.func.jacrev(lambda z: ref(z)[1][1])(x)
    assert torch.equal(torch.func.jacrev(lambda z: ours(z)[1][1])(x), want)
    ours.forward_config = "newton"
    with pytest.raises(NotImplementedError, match=r"paraprop.nn.LSTM\(forward='newton'\) "
                                                  "cannot run under torch.func"):
        torch.func.grad(lambda z: ours(z)[0].sum())(x)
