"""paraprop_lab.experiments.jax_peers: the JAX ``lax.scan`` peers give torch's outputs and
autograd's gradients, refuse what they do not model, and the module imports without JAX.

The tests that run JAX skip without it (the ``peers`` extra); the import test runs either way.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import paraprop
import paraprop_lab.experiments
from paraprop_lab.experiments import jax_peers

requires_jax = pytest.mark.skipif(not jax_peers.available(),
                                  reason="jax is not installed (the peers extra)")

T, B, I, H = 25, 3, 4, 6


def _module(kind: str, bias: bool) -> torch.nn.Module:
    if kind in ("rnn_tanh", "rnn_relu"):
        return torch.nn.RNN(I, H, nonlinearity=kind[4:], bias=bias)
    if kind == "gru":
        return torch.nn.GRU(I, H, bias=bias)
    if kind == "lstm":
        return torch.nn.LSTM(I, H, bias=bias)
    cls = paraprop.nn.ParaGRU if kind == "paragru" else paraprop.nn.ParaLSTM
    return cls(I, H, bias=bias, forward="sequential", backward="autograd")   # the reference


def _torch_grads(module, x, hx, G):
    module.zero_grad()
    out, _ = module(x, hx)
    loss = (out * G).sum()
    loss.backward()
    return out.detach(), loss.item(), {k: p.grad.clone() for k, p in module.named_parameters()}


@requires_jax
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", jax_peers.KINDS)
def test_peer_matches_torch_outputs_and_gradients(kind, bias):
    torch.manual_seed(0)
    module = _module(kind, bias)
    p = jax_peers.peer(module, seed=3)
    assert p.kind == kind
    x = torch.randn(T, B, I)
    states = [torch.randn(1, B, H) for _ in range(2 if "lstm" in kind else 1)]
    hx = states[0] if len(states) == 1 else tuple(states)
    G = p.cotangent(T, B)
    assert torch.equal(G, p.cotangent(T, B))                     # fixed
    for h0 in (None, hx):                                        # same shapes: one compile
        ref, ref_loss, ref_grads = _torch_grads(module, x, h0, G)
        out = p.forward(x, h0)
        assert out.shape == (T, B, H) and out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        loss, grads = p.train_step(x, h0)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-4)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            r = ref_grads[name]
            assert g.shape == r.shape
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * r.abs().max().item(),
                                       msg=f"{kind} {name}")
    if kind == "gru" and bias:                                   # the timers, compiled above
        assert p.time_forward(x, hx, repeats=2) > 0
        assert p.time_train(x, hx, repeats=2) > 0
        p.runner(x, train=True, weights_out=G)()


@requires_jax
def test_peer_takes_weights_out_and_batch_major_h0():
    torch.manual_seed(1)
    module = torch.nn.GRU(I, H)
    p = jax_peers.peer(module)
    x, h0, G = torch.randn(T, B, I), torch.randn(B, H), torch.randn(T, B, H)
    ref, ref_loss, ref_grads = _torch_grads(module, x, h0[None], G)
    torch.testing.assert_close(p.forward(x, h0), ref, rtol=0, atol=1e-5)
    loss, grads = p.train_step(x, h0, weights_out=G)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-4)
    torch.testing.assert_close(grads["weight_hh_l0"], ref_grads["weight_hh_l0"], rtol=1e-4,
                               atol=1e-4 * ref_grads["weight_hh_l0"].abs().max().item())


@requires_jax
def test_paraprop_subclasses_count_as_torch_layers():
    assert jax_peers.peer(paraprop.nn.RNN(I, H, nonlinearity="relu")).kind == "rnn_relu"
    assert jax_peers.peer(paraprop.nn.GRU(I, H, batch_first=True)).kind == "gru"
    assert jax_peers.peer(paraprop.nn.LSTM(I, H)).kind == "lstm"


@requires_jax
@pytest.mark.parametrize("module, match", [
    (torch.nn.GRU(I, H, num_layers=2), r"module\.num_layers must be 1, got 2"),
    (torch.nn.RNN(I, H, bidirectional=True), r"module\.bidirectional must be False, got True"),
    (torch.nn.LSTM(I, H, proj_size=2), r"module\.proj_size must be 0, got 2"),
    (torch.nn.LSTM(I, H).double(), r"must be torch\.float32, got torch\.float64"),
    (paraprop.nn.ParaGRU(I, H, num_layers=3), r"module\.num_layers must be 1, got 3"),
    (torch.nn.Linear(I, H), r"module must be a torch\.nn\.RNN.*got torch\.nn.*Linear"),
])
def test_peer_refusals(module, match):
    with pytest.raises(ValueError, match=match):
        jax_peers.peer(module)


@requires_jax
def test_bad_inputs_are_refused():
    p = jax_peers.peer(torch.nn.LSTM(I, H))
    with pytest.raises(ValueError, match=r"time-major \(T, B, 4\)"):
        p.forward(torch.randn(T, B, I + 1))
    with pytest.raises(ValueError, match="float32"):
        p.forward(torch.randn(T, B, I, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"tuple \(h0, c0\)"):
        p.forward(torch.randn(T, B, I), torch.zeros(1, B, H))
    with pytest.raises(ValueError, match=r"h0 must be float32 \(1, 3, 6\)"):
        p.forward(torch.randn(T, B, I), (torch.zeros(1, B, H + 1), torch.zeros(1, B, H)))
    with pytest.raises(ValueError, match="weights_out"):
        p.train_step(torch.randn(T, B, I), weights_out=torch.zeros(T, B, H + 1))
    with pytest.raises(ValueError, match="repeats"):
        p.time_forward(torch.randn(T, B, I), repeats=0)


def test_module_imports_and_available_is_a_bool_without_jax(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)                # `import jax` raises
    monkeypatch.delitem(sys.modules, "paraprop_lab.experiments.jax_peers")
    monkeypatch.delattr(paraprop_lab.experiments, "jax_peers")       # restored by undo()
    fresh = importlib.import_module("paraprop_lab.experiments.jax_peers")
    assert fresh.available() is False
    with pytest.raises(ImportError, match="peers"):
        fresh.peer(torch.nn.GRU(I, H))
    monkeypatch.undo()
    assert isinstance(jax_peers.available(), bool)
