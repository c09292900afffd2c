"""The defaults ``forward="auto", backward="auto"`` of paraprop.nn.RNN / GRU / LSTM: which pair
they choose (:func:`paraprop.nn.options.resolve`), that the chosen pair gives torch's outputs and
autograd's gradients, that ``last_forward`` / ``last_backward`` say which path ran, and that
an explicit setting is honoured. No timings here (the choice is a table of measurements,
docs/recurrences.md)."""

import pytest
import torch

import paraprop.nn as pnn
from paraprop.nn.options import (
    TORCH_FASTEST,
    AutoBackward,
    AutogradBackward,
    ParallelForward,
    ScanBackward,
    SequentialForward,
    resolve,
)
from paraprop.scan import native

# the size (T=1000, batch 16, input 8, hidden 32 / 64) with a shorter sequence: the choice
# does not depend on T, and the tests stay fast
T, B, I = 40, 16, 8
CELLS = [(pnn.RNN, torch.nn.RNN), (pnn.GRU, torch.nn.GRU), (pnn.LSTM, torch.nn.LSTM)]
IDS = ["rnn", "gru", "lstm"]
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}   # as tests/test_nn_native.py


def kernels(mod):
    """The sequential kernel that ran per layer: ``last_forward`` holds one record of the loop
    per layer (the sequential result itself)."""
    assert all(s.method == "sequential" and s.converged for s in mod.last_forward)
    return [s.stats["kernel"] for s in mod.last_forward]


def pair(cls, tcls, hidden, dtype=torch.float32, device="cpu", **kw):
    torch.manual_seed(hidden)
    ref = tcls(I, hidden, dtype=dtype).to(device)
    ours = cls(I, hidden, dtype=dtype, device=device, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def step(mod, x):
    """A training step's outputs and the gradients of the input and every parameter."""
    x = x.clone().requires_grad_()
    out = mod(x)[0]
    loss = out.square().mean()
    grads = torch.autograd.grad(loss, [x, *mod.parameters()])
    return out.detach(), grads


def close(a, b, tol):
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def expected(cls, device, dtype):
    """(kernel, backward) the defaults should run for ``cls`` on ``device`` in ``dtype``."""
    mode = {pnn.RNN: "RNN_TANH", pnn.GRU: "GRU", pnn.LSTM: "LSTM"}[cls]
    if (mode, device.type) in TORCH_FASTEST:
        return "torch", "autograd"
    w = torch.zeros(1, dtype=dtype, device=device)
    return ("native" if native.supports(w) else "torch"), "scan"


def test_the_cpu_table():
    """What was measured (2-core CPU, float32, T=1000, batch 16, hidden 32 / 64): torch's LSTM
    step beat the native loop + scan; the native loop + scan beat torch's RNN and GRU."""
    assert ("LSTM", "cpu") in TORCH_FASTEST
    assert ("GRU", "cpu") not in TORCH_FASTEST and ("RNN_TANH", "cpu") not in TORCH_FASTEST


@pytest.mark.parametrize("hidden", [32, 64])
@pytest.mark.parametrize("cls,tcls", CELLS, ids=IDS)
def test_defaults_choose_and_match_torch(cls, tcls, hidden, device):
    ref, ours = pair(cls, tcls, hidden, device=device)
    assert isinstance(ours.forward_config, SequentialForward)
    assert ours.forward_config.kernel == "auto"
    assert isinstance(ours.backward_config, AutoBackward)
    x = torch.randn(T, B, I, generator=torch.Generator().manual_seed(1)).to(device)
    o1, g1 = step(ref, x)
    o2, g2 = step(ours, x)
    kernel, backward = expected(cls, device, torch.float32)
    assert kernels(ours) == [kernel]
    assert ours.last_backward.kind == backward
    if backward == "autograd":    # torch's module itself: bitwise, gradients included
        assert torch.equal(o2, o1)
        assert all(torch.equal(a, b) for a, b in zip(g2, g1, strict=True))
        return
    if kernel == "torch":
        assert torch.equal(o2, o1)
    assert close(o2, o1, TOL[torch.float32])
    for a, b in zip(g2, g1, strict=True):
        assert close(a, b, TOL[torch.float32])


@pytest.mark.parametrize("cls,tcls", CELLS, ids=IDS)
def test_defaults_in_float64_match_torch(cls, tcls, device):
    ref, ours = pair(cls, tcls, 32, dtype=torch.float64, device=device)
    x = torch.randn(T, 3, I, dtype=torch.float64).to(device)
    o1, g1 = step(ref, x)
    o2, g2 = step(ours, x)
    kernel, backward = expected(cls, device, torch.float64)
    assert (kernels(ours), ours.last_backward.kind) == ([kernel], backward)
    assert close(o2, o1, TOL[torch.float64])
    for a, b in zip(g2, g1, strict=True):
        assert close(a, b, TOL[torch.float64])


@pytest.mark.parametrize("cls,tcls", CELLS, ids=IDS)
def test_without_a_graph_the_kernel_is_the_one_training_would_use(cls, tcls, device):
    ref, ours = pair(cls, tcls, 32, device=device)
    x = torch.randn(T, B, I).to(device)
    with torch.no_grad():
        out = ours(x)[0]
        want = ref(x)[0]
    kernel, _ = expected(cls, device, torch.float32)
    assert kernels(ours) == [kernel]
    assert torch.equal(out, want) if kernel == "torch" else close(out, want, TOL[torch.float32])


@pytest.mark.parametrize("cls,tcls", CELLS, ids=IDS)
def test_explicit_settings_are_honoured(cls, tcls, device):
    x = torch.randn(T, B, I).to(device)
    # backward="scan": the scan, whatever the table says
    ref, ours = pair(cls, tcls, 32, device=device, backward="scan")
    o1, g1 = step(ref, x)
    o2, g2 = step(ours, x)
    assert ours.last_backward.kind == "scan"
    assert kernels(ours) == [expected(pnn.GRU, device, torch.float32)[0]]
    for a, b in zip((o2, *g2), (o1, *g1), strict=True):
        assert close(a, b, TOL[torch.float32])
    # forward="sequential": torch's kernel (bitwise), no kernel entry; the auto backward picks
    # (autograd where the table says torch is fastest, else the scan), with torch's gradients
    ref, ours = pair(cls, tcls, 32, device=device, forward="sequential")
    o2, g2 = step(ours, x)
    assert torch.equal(o2, o1) and ours.last_forward == ()
    picked = ours.last_backward.kind
    assert picked == ("autograd" if (cls.__name__, torch.device(device).type) in TORCH_FASTEST
                      else "scan")
    for a, b in zip(g2, g1, strict=True):
        assert torch.equal(a, b) if picked == "autograd" else close(a, b, TOL[torch.float32])
    # backward="autograd" with the default forward: torch's kernel and autograd, bitwise
    ref, ours = pair(cls, tcls, 32, device=device, backward="autograd")
    o2, g2 = step(ours, x)
    assert kernels(ours) == ["torch"]
    assert ours.last_backward.kind == "autograd"
    assert torch.equal(o2, o1)
    assert all(torch.equal(a, b) for a, b in zip(g2, g1, strict=True))
    # forward="native" with the default backward: the native loop needs the scan
    ref, ours = pair(cls, tcls, 32, device=device, forward="native")
    step(ours, x)
    assert ours.last_backward.kind == "scan"


def test_resolve():
    auto, seq = SequentialForward("auto"), SequentialForward()
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve("LSTM", cpu, auto, AutoBackward()) == (seq, AutogradBackward())
    assert resolve("LSTM", cpu, seq, AutoBackward()) == (seq, AutogradBackward())
    assert resolve("LSTM", cpu, SequentialForward("native"), AutoBackward()) == (
        SequentialForward("native"), ScanBackward())
    assert resolve("LSTM", gpu, auto, AutoBackward()) == (auto, ScanBackward())   # unmeasured
    assert resolve("GRU", cpu, auto, AutoBackward()) == (auto, ScanBackward())
    newton = ParallelForward()
    assert resolve("LSTM", cpu, newton, AutoBackward()) == (newton, ScanBackward())
    assert resolve("GRU", cpu, auto, AutogradBackward()) == (seq, AutogradBackward())
    assert resolve("GRU", cpu, auto, ScanBackward("blelloch")) == (auto, ScanBackward("blelloch"))


def test_auto_backward_names_and_refusals():
    m = pnn.GRU(2, 3, backward="auto")
    assert isinstance(m.backward_config, AutoBackward)
    m.backward_config = AutoBackward()
    assert "backward='auto'" in repr(m)
    with pytest.raises(ValueError, match=r"unknown backward='fast'; choose one of scan, jacobi, "
                                         r"autograd, auto"):
        pnn.GRU(2, 3, backward="fast")
    with pytest.raises(TypeError, match=r"got the class AutoBackward; pass an instance"):
        pnn.LSTM(2, 3, backward=AutoBackward)
    # the native loop records no graph: autograd with it is still refused by name
    with pytest.raises(ValueError, match=r"forward='native' runs paraprop's native loop"):
        pnn.LSTM(2, 3, forward="native", backward="autograd")


def test_last_backward_names_the_kind_and_follows_the_last_call():
    # an option object is reported by its kind's name; a call without a graph clears the entry
    ref, ours = pair(pnn.GRU, torch.nn.GRU, 8, forward="sequential",
                     backward=ScanBackward(method="blelloch"))
    step(ours, torch.randn(T, B, I))
    assert ours.last_backward.kind == "scan"
    with torch.no_grad():
        ours(torch.randn(T, B, I))
    assert ours.last_backward is None
