"""The nested RNN system (Naumov 2017, eq. 23-24): the pass and autograd's gradients."""

import math

import pytest
import torch
from torch import nn

import paraprop
from paraprop.linalg import METHODS, from_rnn, rnn_backward, solve

CASES = [  # (K layers, tau steps, nonlinearity, batch_first, bias)
    (1, 1, "tanh", False, True),
    (1, 6, "relu", False, True),
    (2, 3, "tanh", True, True),
    (3, 5, "relu", False, False),
    (4, 8, "tanh", False, True),
]


def make_rnn(K, nl, bf, bias, seed=0):
    torch.manual_seed(seed)
    return nn.RNN(3, 4, num_layers=K, nonlinearity=nl, batch_first=bf, bias=bias).double()


def kwargs(method):
    return {"tol": 1e-14} if method == "bicgstab" else {}


@pytest.mark.parametrize("K,tau,nl,bf,bias", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_rnn_backward_equals_autograd(K, tau, nl, bf, bias, method):
    rnn = make_rnn(K, nl, bf, bias, seed=K + tau)
    B = 2
    x = torch.randn((B, tau, 3) if bf else (tau, B, 3), dtype=torch.float64)
    h0 = torch.randn(K, B, 4, dtype=torch.float64)
    xr, h0r = x.clone().requires_grad_(), h0.clone().requires_grad_()
    out, hn = rnn(xr, h0r)
    g, gh = torch.randn_like(out), torch.randn_like(hn)
    ref = torch.autograd.grad([out, hn], [xr, h0r, *rnn.parameters()], [g, gh])
    (gx, gh0, gp), sol = rnn_backward(rnn, x, g, h0=h0, grad_hn=gh, method=method,
                                      **kwargs(method))
    ours = [gx, gh0, *gp]
    if method == "bicgstab":
        cat = lambda ts: torch.cat([t.flatten() for t in ts])  # noqa: E731
        assert float((cat(ours) - cat(ref)).norm() / cat(ref).norm()) <= 1e-10
    else:
        for a, b in zip(ours, ref, strict=True):
            assert a.shape == b.shape
            assert float((a - b).norm() / b.norm().clamp_min(1e-300)) <= 1e-10
    if method == "cyclic_reduction":
        assert sol.stats["inner_levels"] == math.ceil(math.log2(K)) + 1
        assert sol.stats["outer_levels"] == math.ceil(math.log2(tau))
    if method == "substitution":
        assert sol.stats["levels"] == K * tau
    if method == "jacobi":
        assert sol.iterations <= K + tau - 1


@pytest.mark.parametrize("method", ["substitution", "cyclic_reduction", "jacobi"])
def test_nested_forward_system_reproduces_the_pass(method):
    rnn = make_rnn(3, "tanh", False, True)
    x = torch.randn(7, 2, 3, dtype=torch.float64)
    S = from_rnn(rnn, x)
    h = solve(S.forward, S.forward_rhs, method=method).value.reshape(2, 7, 3, 4)
    with torch.no_grad():
        out, hn = rnn(x)
    assert torch.allclose(h[:, :, -1].transpose(0, 1), out, atol=1e-12, rtol=0)
    assert torch.allclose(h[:, -1].transpose(0, 1), hn, atol=1e-12, rtol=0)


def test_only_final_state_gradient():
    rnn = make_rnn(2, "tanh", False, True)
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    _, hn = rnn(xr)
    gh = torch.randn_like(hn)
    ref = torch.autograd.grad(hn, [xr, *rnn.parameters()], gh)
    (gx, gh0, gp), _ = rnn_backward(rnn, x, None, grad_hn=gh)
    for a, b in zip([gx, *gp], ref, strict=True):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-10)


def test_rnn_errors_are_reported():
    rnn = make_rnn(2, "tanh", False, True)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    g = torch.randn(5, 2, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"rnn must be an nn.RNN, got GRU"):
        rnn_backward(nn.GRU(3, 4).double(), x, g)
    with pytest.raises(ValueError, match=r"bidirectional RNNs are not supported"):
        rnn_backward(nn.RNN(3, 4, bidirectional=True).double(), x, g)
    with pytest.raises(ValueError, match=r"x must have shape \(tau, B, 3\)"):
        rnn_backward(rnn, x[0], g)
    with pytest.raises(ValueError, match=r"h0 must have shape \(2, 2, 4\), got \(1, 2, 4\)"):
        rnn_backward(rnn, x, g, h0=torch.zeros(1, 2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"grad_output must have shape \(5, 2, 4\)"):
        rnn_backward(rnn, x, g[:, :1])
    with pytest.raises(ValueError, match=r"give grad_output and/or grad_hn"):
        rnn_backward(rnn, x, None)
    with pytest.raises(TypeError, match=r"x has dtype torch.float32 but the rnn has"):
        rnn_backward(rnn, x.float(), g)
    drop = nn.RNN(3, 4, num_layers=2, dropout=0.5).double()
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"linalg.rnn_backward: rnn \(RNN\) is in train mode and applies "
                             r"dropout in train mode \(dropout=0.5\).* call rnn.eval\(\) first"):
        rnn_backward(drop, x, g)
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"linalg.from_rnn: rnn \(RNN\) is in train"):
        from_rnn(drop, x)
    drop.eval()                          # eval mode: no dropout, the gradients of autograd
    (gx, _, gp), _ = rnn_backward(drop, x, g)
    xi = x.clone().requires_grad_()
    ref = torch.autograd.grad(drop(xi)[0], [xi, *drop.parameters()], g)
    for a, b in zip([gx, *gp], ref, strict=True):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-10)


def test_rnn_argument_checks_name_the_argument():
    rnn = make_rnn(2, "tanh", False, True)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    g = torch.randn(5, 2, 4, dtype=torch.float64)
    h = torch.zeros(2, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"grad_hn must have shape \(2, 2, 4\), got \(2, 4\)"):
        rnn_backward(rnn, x, g, grad_hn=h[0])
    for name in ("h0", "grad_hn"):
        with pytest.raises(TypeError, match=rf"{name} has dtype torch.float32 but the rnn has"):
            rnn_backward(rnn, x, g, **{name: h.float()})
        with pytest.raises(TypeError, match=rf"{name} is on meta but the rnn is on cpu"):
            rnn_backward(rnn, x, g, **{name: torch.empty(2, 2, 4, dtype=torch.float64,
                                                          device="meta")})
        with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor or None, got list"):
            rnn_backward(rnn, x, g, **{name: [0.0]})
    with pytest.raises(TypeError, match=r"grad_output has dtype torch.float32 but the rnn has"):
        rnn_backward(rnn, x, g.float())
    with pytest.raises(TypeError, match=r"grad_output is on meta but the rnn is on cpu"):
        rnn_backward(rnn, x, torch.empty(5, 2, 4, dtype=torch.float64, device="meta"))
    with pytest.raises(TypeError, match=r"x is on meta but the rnn is on cpu"):
        rnn_backward(rnn, torch.empty(5, 2, 3, dtype=torch.float64, device="meta"), g)
    bad = g.clone()
    bad[4, 1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"grad_output must be finite; entry \(4, 1, 3\)"):
        rnn_backward(rnn, x, bad)
    with pytest.raises(ValueError, match=r"x must have at least one time step"):
        rnn_backward(rnn, x[:0], g[:0])
    with pytest.raises(ValueError, match=r"tol is only used by the iterative methods"):
        rnn_backward(rnn, x, g, method="cyclic_reduction", tol=1e-3)


@pytest.mark.parametrize("bf", [False, True])
def test_rnn_empty_batch_gives_empty_gradients_like_autograd(bf):
    rnn = make_rnn(2, "tanh", bf, True)
    x = torch.randn((0, 5, 3) if bf else (5, 0, 3), dtype=torch.float64)
    h0 = torch.randn(2, 0, 4, dtype=torch.float64)
    xr, h0r = x.clone().requires_grad_(), h0.clone().requires_grad_()
    out, _ = rnn(xr, h0r)
    g = torch.randn_like(out)
    ref = torch.autograd.grad(out, [xr, h0r, *rnn.parameters()], g)
    (gx, gh0, gp), sol = rnn_backward(rnn, x, g, h0=h0)
    for a, b in zip([gx, gh0, *gp], ref, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    assert sol.converged and sol.value.shape == (0, 5 * 2 * 4)


def test_rnn_backward_iteration_cap_throw_or_report():
    torch.manual_seed(0)
    rnn = nn.RNN(3, 4, num_layers=2).double()
    x = torch.randn(12, 2, 3, dtype=torch.float64)
    g = torch.randn(12, 2, 4, dtype=torch.float64)
    with pytest.raises(paraprop.ConvergenceError, match=r"method='jacobi' did not converge"):
        rnn_backward(rnn, x, g, method="jacobi", tol=1e-14, max_iters=1)
    (gx, gh0, gp), sol = rnn_backward(rnn, x, g, method="jacobi", tol=1e-14, max_iters=1,
                                      throw=False)
    assert not sol.converged and sol.iterations == 1
    ref = torch.autograd.grad(rnn(x.clone().requires_grad_())[0], [*rnn.parameters()], g)
    assert max(float((a - b).abs().max()) for a, b in zip(gp, ref, strict=True)) > 1e-10
    with pytest.raises(TypeError, match=r"throw must be a bool, got 0"):
        rnn_backward(rnn, x, g, throw=0)
