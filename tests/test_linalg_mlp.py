"""MLP forward and backward propagation as triangular systems equal the pass and autograd."""

import math

import pytest
import torch
from torch import nn

from paraprop.errors import ConvergenceError
from paraprop.linalg import (
    METHODS,
    activation_points,
    from_mlp,
    mlp_backward,
    mlp_forward,
    solve,
)

ACTIVATIONS = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
}
GRAD_TOL = 1e-10  # relative, float64: the target


def make_mlp(widths, act, *, seed=0, lead=False, last_act=False, bias=True,
             dtype=torch.float64):
    torch.manual_seed(seed)
    mods = [nn.Tanh()] if lead else []
    l = len(widths) - 1
    for k in range(l):
        mods.append(nn.Linear(widths[k], widths[k + 1], bias=bias and k % 2 == 0))
        if k < l - 1 or last_act:
            mods.append(ACTIVATIONS[act]())
    return nn.Sequential(*mods).to(dtype)


def autograd_grads(net, x, g):
    x = x.detach().requires_grad_()
    return torch.autograd.grad(net(x), [x, *net.parameters()], g)


def rel_err(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def backward_kwargs(method):
    return {"tol": 1e-14} if method == "bicgstab" else {}


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("l", [1, 2, 3, 6])
@pytest.mark.parametrize("method", METHODS)
def test_mlp_backward_equals_autograd(act, l, method):
    widths = [3, 5, 2, 4, 4, 3, 2][: l + 1]  # layers of different widths
    net = make_mlp(widths, act, seed=l, lead=l == 3, last_act=l == 2)
    x = torch.randn(4, widths[0], dtype=torch.float64)
    if act == "relu":
        x[0] = 0.0  # exact zeros of the pre-activations where the biases are absent
    g = torch.randn(4, widths[-1], dtype=torch.float64)
    (gx, gp), sol = mlp_backward(net, x, g, method=method, **backward_kwargs(method))
    ref = autograd_grads(net, x, g)
    assert len(gp) == len(list(net.parameters()))
    ours = [gx, *gp]
    if method == "bicgstab":  # its stopping test is norm-wise: compare all gradients together
        cat = lambda ts: torch.cat([t.flatten() for t in ts])  # noqa: E731
        assert rel_err(cat(ours), cat(ref)) <= GRAD_TOL
    else:
        for a, b in zip(ours, ref, strict=True):
            assert a.shape == b.shape
            assert rel_err(a, b) <= GRAD_TOL
    if method == "cyclic_reduction":
        assert sol.stats["levels"] == math.ceil(math.log2(l)) + 1


def test_relu_zero_derivatives_keep_the_system_nonsingular():
    net = make_mlp([4, 6, 6, 6, 3], "relu", seed=3)
    x = torch.randn(8, 4, dtype=torch.float64)
    S = from_mlp(net, x, grad_output=torch.ones(8, 3, dtype=torch.float64))
    assert any(bool((d == 0).any()) for d in S.derivatives if d is not None)
    assert all(d is None for d in S.backward.diag)  # identity diagonal: nothing to divide by
    for method in METHODS:
        (gx, gp), _ = mlp_backward(net, x, torch.ones(8, 3, dtype=torch.float64),
                                   method=method, **backward_kwargs(method))
        ref = autograd_grads(net, x, torch.ones(8, 3, dtype=torch.float64))
        assert len(gp) == len(ref) - 1
        ours = [gx, *gp]
        if method == "bicgstab":  # norm-wise stopping test: compare all gradients together
            cat = lambda ts: torch.cat([t.flatten() for t in ts])  # noqa: E731
            assert rel_err(cat(ours), cat(ref)) <= GRAD_TOL
        else:
            for a, b in zip(ours, ref, strict=True):
                assert rel_err(a, b) <= GRAD_TOL


def test_deep_mlp_backward_levels_and_gradients():
    l = 64
    torch.manual_seed(0)
    mods = []
    for _ in range(l):
        lin = nn.Linear(8, 8)
        nn.init.orthogonal_(lin.weight)
        mods += [lin, nn.Tanh()]
    net = nn.Sequential(*mods).double()
    x, g = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    (gx, gp), sol = mlp_backward(net, x, g)
    assert sol.stats["levels"] == math.ceil(math.log2(l)) + 1 == 7
    _, sub = mlp_backward(net, x, g, method="substitution")
    assert sub.stats["levels"] == l
    for a, b in zip([gx, *gp], autograd_grads(net, x, g), strict=True):
        assert rel_err(a, b) <= GRAD_TOL


def test_shared_linear_gradients_are_summed():
    lin = nn.Linear(3, 3).double()
    net = nn.Sequential(lin, nn.Tanh(), lin, nn.Sigmoid(), nn.Linear(3, 2).double())
    x, g = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    (gx, gp), _ = mlp_backward(net, x, g)
    ref = autograd_grads(net, x, g)
    assert len(gp) == len(ref) - 1 == 4
    for a, b in zip([gx, *gp], ref, strict=True):
        assert rel_err(a, b) <= GRAD_TOL


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("method", ["substitution", "cyclic_reduction", "jacobi"])
def test_forward_system_reproduces_the_pass(act, method):
    net = make_mlp([3, 5, 4, 4, 2], act, seed=1, lead=True, last_act=True)
    x = torch.randn(6, 3, dtype=torch.float64)
    S = from_mlp(net, x)
    z = S.forward.split(solve(S.forward, S.forward_rhs, method=method).value)
    with torch.no_grad():
        assert torch.allclose(z[-1], net(x), atol=1e-12, rtol=0)
    sol = mlp_forward(net, x, method=method)
    assert sol.iterations == 1 and torch.allclose(sol.value, net(x).detach(), atol=1e-12)


@pytest.mark.parametrize("act", ["tanh", "relu", "gelu"])
def test_forward_from_previous_points_iterates_to_the_pass(act):
    net = make_mlp([4, 8, 8, 8, 8, 3], act, seed=2)
    x = torch.randn(5, 4, dtype=torch.float64)
    old = activation_points(net, x)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * torch.randn_like(p))  # one small training step later
    sol = mlp_forward(net, x, points=old)
    assert sol.converged and 1 <= sol.iterations <= 5
    assert len(sol.residuals) == sol.iterations
    assert torch.allclose(sol.value, net(x).detach(), atol=1e-10, rtol=0)
    # the returned points are those of the new pass: backward from them equals autograd
    g = torch.randn(5, 3, dtype=torch.float64)
    (gx, gp), _ = mlp_backward(net, x, g, points=sol.stats["points"])
    for a, b in zip([gx, *gp], autograd_grads(net, x, g), strict=True):
        assert rel_err(a, b) <= 1e-8


def test_forward_iteration_cap_reports_non_convergence():
    net = make_mlp([4, 8, 8, 8, 8, 8, 3], "tanh", seed=4)
    x = torch.randn(5, 4, dtype=torch.float64)
    old = activation_points(net, torch.randn(5, 4, dtype=torch.float64))  # another input
    with pytest.raises(ConvergenceError, match=r"mlp_forward: method='cyclic_reduction' did not "
                       r"converge within max_iters=1"):
        mlp_forward(net, x, points=old, max_iters=1)
    sol = mlp_forward(net, x, points=old, max_iters=1, throw=False)
    assert not sol.converged and sol.iterations == 1


def test_mlp_errors_are_reported():
    net = make_mlp([3, 4, 2], "tanh")
    x, g = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"model\[1\] is Softmax; supported modules"):
        mlp_backward(nn.Sequential(nn.Linear(3, 3), nn.Softmax(-1)).double(), x, g[:, :1])
    with pytest.raises(TypeError, match=r"model must be an nn.Sequential"):
        mlp_backward(nn.Linear(3, 2), x, g)
    with pytest.raises(ValueError, match=r"model must contain at least one nn.Linear"):
        mlp_backward(nn.Sequential(nn.Tanh()), x, g)
    with pytest.raises(ValueError, match=r"x must have shape \(B, 3\), got \(3,\)"):
        mlp_backward(net, x[0], g)
    with pytest.raises(ValueError, match=r"grad_output must have shape \(2, 2\), got \(2, 3\)"):
        mlp_backward(net, x, torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"x has dtype torch.float32 but the model has"):
        mlp_backward(net, x.float(), g)
    with pytest.raises(ValueError, match=r"points.pre\[0\] has shape \(5, 4\), expected"):
        mlp_backward(net, x, g, points=activation_points(net, torch.randn(5, 3).double()))
    with pytest.raises(ValueError, match=r"unknown method='qr'"):
        mlp_backward(net, x, g, method="qr")


def test_model_changes_after_a_call_are_seen():
    net = make_mlp([3, 4, 4, 2], "tanh")
    x, g = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    mlp_backward(net, x, g)  # parses (and caches) the model
    net[2].bias = None  # a parameter removed
    net[1] = nn.Sigmoid()  # an activation replaced
    (gx, gp), _ = mlp_backward(net, x, g)
    ref = autograd_grads(net, x, g)
    assert len(gp) == len(ref) - 1
    for a, b in zip([gx, *gp], ref, strict=True):
        assert rel_err(a, b) <= GRAD_TOL


@pytest.mark.parametrize("change", ["slope", "approximate"])
def test_activation_settings_changed_after_a_call_are_seen(change):
    if change == "slope":
        net = make_mlp([3, 4, 4, 2], "leaky_relu")
    else:
        net = make_mlp([3, 4, 4, 2], "gelu")
    x, g = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    mlp_backward(net, x, g)  # parses (and caches) the model
    if change == "slope":
        net[1].negative_slope = 0.5
    else:
        net[1].approximate = "tanh"
    (gx, gp), _ = mlp_backward(net, x, g)
    for a, b in zip([gx, *gp], autograd_grads(net, x, g), strict=True):
        assert rel_err(a, b) <= GRAD_TOL
    with torch.no_grad():
        assert torch.allclose(mlp_forward(net, x).value, net(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("method", ["substitution", "cyclic_reduction"])
def test_iterative_options_with_a_direct_method_are_rejected(method):
    net = make_mlp([3, 4, 2], "tanh")
    x, g = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"tol is only used by the iterative methods, not "
                       rf"method='{method}'"):
        mlp_backward(net, x, g, method=method, tol=123)
    with pytest.raises(ValueError, match=r"max_iters is only used by the iterative methods"):
        mlp_backward(net, x, g, method=method, max_iters=5)
    with pytest.raises(ValueError, match=r"tol is only used by the iterative methods"):
        mlp_backward(net, x[:0], g[:0], method=method, tol=123)  # also for an empty batch


def test_empty_batch_gives_empty_gradients_like_autograd():
    net = make_mlp([3, 4, 4, 2], "tanh", lead=True)
    x, g = torch.randn(0, 3, dtype=torch.float64), torch.randn(0, 2, dtype=torch.float64)
    ref = autograd_grads(net, x, g)
    for method in METHODS:
        (gx, gp), sol = mlp_backward(net, x, g, method=method)
        for a, b in zip([gx, *gp], ref, strict=True):
            assert a.shape == b.shape and torch.equal(a, b)
        assert sol.value.shape == (0, 10) and sol.converged and sol.stats["levels"] == 0
        out = mlp_forward(net, x, method=method)
        assert out.value.shape == (0, 2) and out.converged
    assert mlp_forward(net, x, points=activation_points(net, x)).value.shape == (0, 2)


def test_input_errors_name_the_argument():
    net = make_mlp([3, 4, 2], "tanh")
    x, g = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    bad = g.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"grad_output must be finite; entry \(1, 0\) of shape "
                       r"\(2, 2\) is nan"):
        mlp_backward(net, x, bad)
    with pytest.raises(ValueError, match=r"grad_output must be finite"):
        from_mlp(net, x, grad_output=bad)
    xbad = x.clone()
    xbad[0, 2] = float("inf")
    with pytest.raises(ValueError, match=r"x must be finite; entry \(0, 2\) of shape \(2, 3\) "
                       r"is inf"):
        mlp_backward(net, xbad, g)
    with pytest.raises(ValueError, match=r"x must be finite"):
        mlp_forward(net, xbad)
    with pytest.raises(TypeError, match=r"grad_output is on meta but x is on cpu"):
        mlp_backward(net, x, torch.empty(2, 2, dtype=torch.float64, device="meta"))
    with pytest.raises(TypeError, match=r"grad_output has dtype torch.float32 but x has"):
        mlp_backward(net, x, g.float())
    with pytest.raises(TypeError, match=r"grad_output must be a torch.Tensor, got list"):
        mlp_backward(net, x, [[0.0, 0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match=r"grad_output is required \(dL/d model\(x\)"):
        mlp_backward(net, x, None)
    with pytest.raises(TypeError, match=r"points must be ActivationPoints, got dict"):
        mlp_backward(net, x, g, points={})
    with pytest.raises(TypeError, match=r"points must be ActivationPoints, got tuple"):
        mlp_forward(net, x, points=())
    with pytest.raises(ValueError, match=r"unknown method='lu'"):
        mlp_forward(net, x, method="lu")
    with pytest.raises(TypeError, match=r"throw must be a bool, got 'yes'"):
        mlp_forward(net, x, throw="yes")


def test_forward_from_its_own_pass_counts_the_pass():
    l = 4
    net = make_mlp([3, 5, 5, 5, 2], "tanh")
    x = torch.randn(3, 3, dtype=torch.float64)
    sol = mlp_forward(net, x, method="cyclic_reduction")
    assert sol.stats["layer_evaluations"] == l
    assert sol.stats["solve_levels"] == math.ceil(math.log2(l)) + 1
    assert sol.evaluations == sol.stats["levels"] == l + sol.stats["solve_levels"]
    old = activation_points(net, x)
    newton = mlp_forward(net, x, points=old)
    assert newton.iterations == 1  # already at the fixed point
    assert newton.stats["layer_evaluations"] == l
    assert newton.stats["levels"] == newton.stats["solve_levels"] + 1


def test_no_per_sample_blocks_when_only_the_last_layer_has_an_activation():
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2), nn.Tanh()).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    g = torch.randn(5, 2, dtype=torch.float64)
    S = from_mlp(net, x, grad_output=g)
    assert S.backward.batch is None  # E_l scales only the right-hand side
    first = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    assert from_mlp(first, x).forward.batch is None  # D_1 scales only the right-hand side
    for method in METHODS:
        (gx, gp), _ = mlp_backward(net, x, g, method=method, **backward_kwargs(method))
        ours, ref = torch.cat([t.flatten() for t in [gx, *gp]]), \
            torch.cat([t.flatten() for t in autograd_grads(net, x, g)])
        assert rel_err(ours, ref) <= GRAD_TOL
        with torch.no_grad():
            assert torch.allclose(mlp_forward(first, x, method=method).value, first(x),
                                  atol=1e-12, rtol=0)


@pytest.mark.parametrize("method", ["jacobi", "bicgstab"])
def test_backward_iteration_cap_throw_or_report(method):
    # an iterative backward solve stopped by max_iters: ConvergenceError by default, or (with
    # throw=False) the gradients of the last iterate and an unconverged Solution
    net = make_mlp([4, 8, 8, 8, 8, 8, 3], "tanh", seed=4)
    x = torch.randn(5, 4, dtype=torch.float64)
    g = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(ConvergenceError, match=rf"method='{method}' did not converge"):
        mlp_backward(net, x, g, method=method, tol=1e-14, max_iters=1)
    (gx, gp), sol = mlp_backward(net, x, g, method=method, tol=1e-14, max_iters=1, throw=False)
    assert not sol.converged and sol.iterations == 1
    ref = torch.autograd.grad(net(x.clone().requires_grad_()), [*net.parameters()], g)
    assert gx.shape == x.shape and len(gp) == len(ref)
    assert max(float((a - b).abs().max()) for a, b in zip(gp, ref, strict=True)) > 1e-10
    (gx, gp), sol = mlp_backward(net, x, g, method=method, tol=1e-13, max_iters=500)
    assert sol.converged
    with pytest.raises(TypeError, match=r"throw must be a bool, got 'no'"):
        mlp_backward(net, x, g, method=method, throw="no")
