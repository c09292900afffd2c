"""paraprop.nn.RNN / GRU: the outputs, final states and every gradient of the torch modules."""

import itertools

import pytest
import torch

import paraprop.nn as pnn
from paraprop.nn import JacobiBackward, ScanBackward

CASES = [(pnn.RNN, torch.nn.RNN, {}), (pnn.RNN, torch.nn.RNN, {"nonlinearity": "relu"}),
         (pnn.GRU, torch.nn.GRU, {})]
IDS = ["rnn-tanh", "rnn-relu", "gru"]
# max |ours - torch| / max |torch| per dtype, for outputs and gradients
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def rel(x, ref):
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def pair(cls, tcls, extra, dtype=torch.float64, seed=0, device="cpu", **kw):
    torch.manual_seed(seed)
    # the settings these tests were written for (torch's kernel, the scan), unless given; the
    # defaults' own choice is tested in tests/test_nn_auto.py
    ours_kw = {"forward": kw.pop("forward", "sequential"), "backward": kw.pop("backward", "scan")}
    ref = tcls(3, 5, dtype=dtype, **extra, **kw).to(device)
    ours = cls(3, 5, dtype=dtype, device=device, **extra, **kw, **ours_kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def run_both(ref, ours, x, h0):
    """Forward both with the same inputs and a random loss on outputs and final states."""
    results = []
    g = torch.Generator().manual_seed(1)
    w_out = w_h = None
    for mod in (ref, ours):
        xi = x.clone().requires_grad_()
        hi = h0.clone().requires_grad_() if h0 is not None else None
        out, hn = mod(xi, hi)
        if w_out is None:   # drawn on the CPU, then moved: the same loss on every device
            w_out = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
            w_h = torch.randn(hn.shape, generator=g, dtype=hn.dtype).to(hn.device)
        ((out * w_out).sum() + (hn * w_h).sum()).backward()
        grads = {n: p.grad for n, p in mod.named_parameters()}
        results.append((out, hn, xi.grad, None if hi is None else hi.grad, grads))
    return results


def assert_same(results, tol):
    (o1, h1, gx1, gh1, gw1), (o2, h2, gx2, gh2, gw2) = results
    assert rel(o2.detach(), o1.detach()) <= tol
    assert rel(h2.detach(), h1.detach()) <= tol
    assert rel(gx2, gx1) <= tol
    if gh1 is not None:
        assert rel(gh2, gh1) <= tol
    assert gw1.keys() == gw2.keys()
    for name in gw1:
        assert rel(gw2[name], gw1[name]) <= tol, name


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
@pytest.mark.parametrize("num_layers,batch_first,bias",
                         list(itertools.product([1, 2], [False, True], [True, False])))
@pytest.mark.parametrize("backward", ["scan", "jacobi", "autograd"])
def test_equal_to_torch(cls, tcls, extra, num_layers, batch_first, bias, backward, device):
    ref, ours = pair(cls, tcls, extra, num_layers=num_layers, batch_first=batch_first, bias=bias,
                     device=device)
    ours.backward_config = backward
    T, B = 9, 4
    x = torch.randn((B, T, 3) if batch_first else (T, B, 3), dtype=torch.float64).to(device)
    h0 = torch.randn(num_layers, B, 5, dtype=torch.float64).to(device)
    assert_same(run_both(ref, ours, x, h0), TOL[torch.float64])


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
def test_float32_long_sequence_without_h0(cls, tcls, extra, device):
    ref, ours = pair(cls, tcls, extra, dtype=torch.float32, num_layers=2, device=device)
    x = torch.randn(300, 6, 3).to(device)
    assert_same(run_both(ref, ours, x, None), TOL[torch.float32])


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
@pytest.mark.parametrize("algorithm", ["sequential", "chunked", "blelloch"])
def test_every_scan_algorithm(cls, tcls, extra, algorithm, device):
    ref, ours = pair(cls, tcls, extra, num_layers=2, batch_first=True, device=device)
    ours.backward_config = ScanBackward(method=algorithm)
    x = torch.randn(3, 40, 3, dtype=torch.float64).to(device)
    assert_same(run_both(ref, ours, x, torch.randn(2, 3, 5, dtype=torch.float64).to(device)),
                TOL[torch.float64])


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
def test_unbatched_input(cls, tcls, extra):
    ref, ours = pair(cls, tcls, extra)
    assert_same(run_both(ref, ours, torch.randn(8, 3, dtype=torch.float64),
                         torch.randn(1, 5, dtype=torch.float64)), TOL[torch.float64])


def test_jacobi_truncation_is_truncated_backprop():
    """With K sweeps, gradients reach exactly K steps back from the loss at the last step."""
    ref, ours = pair(pnn.RNN, torch.nn.RNN, {}, seed=3)
    ours.backward_config = JacobiBackward(max_iters=4)
    x = torch.randn(12, 2, 3, dtype=torch.float64)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ref(xs[0])[1].sum().backward()
    ours(xs[1])[1].sum().backward()
    (sweeps,) = ours.last_backward.layers
    assert sweeps.method == "jacobi" and sweeps.iterations == 4
    assert not sweeps.converged and not ours.last_backward.converged   # truncated: not exact
    assert rel(xs[1].grad[-4:], xs[0].grad[-4:]) <= TOL[torch.float64]
    assert torch.count_nonzero(xs[1].grad[:-4]) == 0 and torch.count_nonzero(xs[0].grad[:-4])
    ours.backward_config = JacobiBackward(tol=1e-300)   # until exact: at most T sweeps
    xs[1].grad = None
    ours(xs[1])[1].sum().backward()
    assert rel(xs[1].grad, xs[0].grad) <= TOL[torch.float64]
    (sweeps,) = ours.last_backward.layers
    assert sweeps.iterations <= 12 and sweeps.converged
    assert sweeps.stats["error_estimate"] <= 1e-300


def test_state_dict_round_trip_and_isinstance():
    ref = torch.nn.GRU(4, 6, num_layers=2)
    ours = pnn.GRU(4, 6, num_layers=2)
    ours.load_state_dict(ref.state_dict())
    assert isinstance(ours, torch.nn.GRU)
    assert list(ours.state_dict()) == list(ref.state_dict())
    back = torch.nn.GRU(4, 6, num_layers=2)
    back.load_state_dict(ours.state_dict())
    assert "backward='auto'" in repr(ours)      # the default


@pytest.mark.parametrize("cls,tcls,extra", CASES, ids=IDS)
def test_forward_with_grad_is_bitwise_torch(cls, tcls, extra):
    """The forward pass is torch's own kernel, layer by layer: bitwise the same outputs."""
    ref, ours = pair(cls, tcls, extra, dtype=torch.float32, num_layers=2)
    x = torch.randn(30, 4, 3)
    (o1, h1), (o2, h2) = ref(x), ours(x)
    assert o2.grad_fn is not None and torch.equal(o1, o2) and torch.equal(h1, h2)


def test_no_grad_is_torch_forward():
    ref, ours = pair(pnn.GRU, torch.nn.GRU, {}, dtype=torch.float32)
    x = torch.randn(20, 2, 3)
    with torch.no_grad():
        assert torch.equal(ours(x)[0], ref(x)[0])


ERRORS = [
    (lambda: pnn.RNN(3, 5, bidirectional=True), NotImplementedError,
     r"does not support bidirectional=True"),
    (lambda: pnn.GRU(3, 5, num_layers=2, dropout=0.5), NotImplementedError,
     r"does not support dropout"),
    (lambda: pnn.GRU(3, 5, proj_size=2), NotImplementedError, r"does not support proj_size"),
    (lambda: pnn.RNN(3, 5, backward="magic"), ValueError,
     r"unknown backward='magic'; choose one of scan, jacobi, autograd"),
    (lambda: pnn.RNN(3, 5, backward=JacobiBackward(max_iters=0)), ValueError,
     r"JacobiBackward: max_iters must be a positive int or None, got 0"),
    (lambda: pnn.RNN(3, 5, backward=JacobiBackward(tol=-1.0)), ValueError,
     r"JacobiBackward: tol must be a number >= 0, got -1.0"),
    (lambda: pnn.GRU(3, 5, backward=ScanBackward(method="fast")), ValueError,
     r"ScanBackward: unknown method='fast'"),
    (lambda: pnn.GRU(3, 5, backward=ScanBackward), TypeError,
     r"backward must be a name or an object, got the class ScanBackward"),
    (lambda: pnn.GRU(3, 5, backward=None), TypeError, r"backward must be one of .* got NoneType"),
    (lambda: pnn.RNN(3, 5, jacobi_iters=3), TypeError, r"unexpected keyword argument"),
    (lambda: pnn.RNN(3, 5, nonlinearity="sigmoid"), ValueError, r"Unknown nonlinearity"),
    (lambda: pnn.RNN(3, 5)(torch.randn(4, 2, 7)), ValueError,
     r"input.size\(-1\) must be equal to input_size=3"),
    (lambda: pnn.GRU(3, 5)(torch.randn(4, 2, 3), torch.zeros(1, 3, 5)), ValueError,
     r"expected hidden size \(1, 2, 5\), got \(1, 3, 5\)"),
    (lambda: pnn.RNN(3, 5)(torch.randn(2, 4, 2, 3)), ValueError, r"expected input to be 2D or 3D"),
    (lambda: pnn.RNN(3, 5)(torch.nn.utils.rnn.pack_sequence([torch.randn(4, 3)])),
     NotImplementedError, r"does not take a PackedSequence"),
]


@pytest.mark.parametrize("call,exc,match", ERRORS)
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_gru_gate_recomputation_in_blocks(monkeypatch):
    """The CPU recomputes the gates in blocks of time steps; block edges change nothing."""
    import paraprop.nn.gru as gru_module

    monkeypatch.setattr(gru_module, "BLOCK_ROWS", 7)        # 2 steps of batch 3 per block
    ref, ours = pair(pnn.GRU, torch.nn.GRU, {}, num_layers=2)
    x = torch.randn(11, 3, 3, dtype=torch.float64)
    assert_same(run_both(ref, ours, x, torch.randn(2, 3, 5, dtype=torch.float64)),
                TOL[torch.float64])
