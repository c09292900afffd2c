"""Analytic transposed Jacobians against autograd; BPPSA over a CNN against back-propagation."""

import warnings

import pytest
import torch
from torch import nn

from paraprop.jacobians import bppsa, pattern_of, transposed_jacobian

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


def _autograd_jt(layer, x):
    J = torch.autograd.functional.jacobian(lambda v: layer(v[None])[0], x)
    return J.reshape(-1, x.numel()).t()


LAYERS = [
    (lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 7, 6)),
    (lambda: nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(2, 1)), (2, 9, 8)),
    (lambda: nn.Conv2d(1, 2, 5, stride=3, bias=False), (1, 11, 13)),
    (lambda: nn.MaxPool2d(2), (3, 6, 6)),
    (lambda: nn.MaxPool2d(3, stride=2, padding=1), (2, 7, 5)),
    (lambda: nn.MaxPool2d(2, ceil_mode=True), (2, 5, 5)),
    (lambda: nn.MaxPool2d(2, stride=1, dilation=2), (1, 6, 7)),
    (lambda: nn.ReLU(), (3, 4, 5)),
    (lambda: nn.Linear(5, 3), (5,)),
    (lambda: nn.Flatten(), (2, 3, 4)),
]


@pytest.mark.parametrize(("make", "shape"), LAYERS)
def test_generators_equal_autograd(make, shape, device):
    layer = make().to(device, torch.float64)
    x = torch.randn(shape, dtype=torch.float64).to(device)
    JT = transposed_jacobian(layer, x)
    assert JT.layout == torch.sparse_csr
    assert torch.allclose(JT.to_dense(), _autograd_jt(layer, x), atol=1e-12)


@pytest.mark.parametrize("cell", [nn.RNNCell(3, 5), nn.RNNCell(3, 5, nonlinearity="relu"),
                                  nn.GRUCell(3, 5), nn.GRUCell(3, 5, bias=False)])
def test_cells_equal_autograd(cell, device):
    cell = cell.to(device, torch.float64)
    x = torch.randn(3, dtype=torch.float64).to(device)
    h = torch.randn(5, dtype=torch.float64).to(device)
    J = torch.autograd.functional.jacobian(lambda v: cell(x[None], v[None])[0], h)
    assert torch.allclose(transposed_jacobian(cell, (x, h)), J.t(), atol=1e-12)


def test_pattern_is_cached_values_change():
    conv = nn.Conv2d(2, 3, 3)
    x = torch.randn(2, 6, 6)
    p1, _ = pattern_of(conv, x)
    a = transposed_jacobian(conv, x)
    with torch.no_grad():
        conv.weight.mul_(2)
    b = transposed_jacobian(conv, torch.randn(2, 6, 6))
    p2, _ = pattern_of(conv, x)
    assert p1 is p2  # built once per configuration
    assert torch.equal(a.col_indices(), b.col_indices())
    assert torch.allclose(b.values(), 2 * a.values())
    relu = nn.ReLU()
    r1, r2 = transposed_jacobian(relu, torch.randn(10)), transposed_jacobian(relu, torch.randn(10))
    assert torch.equal(r1.crow_indices(), r2.crow_indices())


def test_table_1_sparsity_of_vgg11_first_layers():
    # BPPSA Table 1: VGG-11 at 32x32: first conv, its ReLU and the first max-pool
    x = torch.randn(3, 32, 32)
    conv, _ = pattern_of(nn.Conv2d(3, 64, 3, padding=1), x)
    relu, _ = pattern_of(nn.ReLU(), torch.randn(64, 32, 32))
    pool, _ = pattern_of(nn.MaxPool2d(2), torch.randn(64, 32, 32))
    assert (round(conv.sparsity, 5), round(relu.sparsity, 5), round(pool.sparsity, 5)) == (
        0.99157, 0.99998, 0.99994)


def _net():
    return [nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 6, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(6, 3)]


def _autograd_grads(net, acts, g):
    ins = [a.clone().requires_grad_(True) for a in acts]
    outs = [layer(i[None])[0] for layer, i in zip(net, ins, strict=True)]
    ref, cur = [], g
    for i in reversed(range(len(net))):
        (cur,) = torch.autograd.grad(outs[i], ins[i], cur)
        ref.insert(0, cur)
    return ref


@pytest.mark.parametrize("levels", [None, 0, 1, 2, 5])
def test_bppsa_backward_equals_autograd(levels, device):
    torch.manual_seed(0)
    net = [layer.to(device, torch.float64) for layer in _net()]
    acts, y = bppsa.record(net, torch.randn(2, 8, 8, dtype=torch.float64).to(device))
    g = torch.randn(3, dtype=torch.float64).to(device)
    ref = _autograd_grads(net, acts, g)
    grads, sol = bppsa.backward(net, acts, g, levels=levels)
    for a, b in zip(grads, ref, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12)
    phases = {s["phase"] for s in sol.stats["steps"]}
    assert phases == ({"linear"} if levels == 0 else {"up", "down"} if levels in (None, 5)
                      else {"up", "linear", "down"})
    steps = sol.stats["steps"]
    assert sol.converged and sol.method == ("sequential" if levels == 0 else "blelloch")
    assert torch.equal(sol.value, torch.cat([a.flatten() for a in grads]))
    assert sol.iterations == sol.evaluations == sum(
        s["combines"] if s["phase"] == "linear" else 1 for s in steps)
    assert sol.stats["combines"] == sum(s["combines"] for s in steps) >= len(net)
    assert sol.stats["flops"] == sum(s["flops"] for s in steps)
    assert sol.stats["critical_flops"] == sum(
        s["flops"] if s["phase"] == "linear" else s["max_flops"] for s in steps)
    if levels == 0:  # ordinary back-propagation: L dependent matrix-vector products
        assert sol.iterations == sol.stats["combines"] == len(net) == sol.stats["L"]


def test_csr_vjp_equals_autograd_float32():
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    x = torch.randn(3, 12, 12)
    g = torch.randn(8, 12, 12)
    xr = x.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(conv(xr[None])[0], xr, g)
    got = (transposed_jacobian(conv, x) @ g.flatten()).reshape(x.shape)
    assert ((got - ref).norm() / ref.norm()) <= 1e-6


def test_combine_flops_counts_the_nonzero_products():
    torch.manual_seed(3)
    a = (torch.rand(6, 5) < 0.4).double() * torch.randn(6, 5, dtype=torch.float64)
    b = (torch.rand(7, 6) < 0.4).double() * torch.randn(7, 6, dtype=torch.float64)
    # b @ a multiplies b[i, k] by a[k, j] for every stored pair: count them densely
    pairs = int(((b != 0).double() @ (a != 0).double()).sum())
    assert bppsa.combine_flops(a.to_sparse_csr(), b.to_sparse_csr()) == 2 * pairs
    assert bppsa.combine_flops(torch.randn(6, dtype=torch.float64), b.to_sparse_csr()) == \
        2 * int((b != 0).sum())


def test_analysis_counts_flops():
    net = _net()
    acts, _ = bppsa.record(net, torch.randn(2, 8, 8))
    res = bppsa.analyze(net, acts, levels=1)
    assert res["bp"][0]["nnz"] == transposed_jacobian(net[0], acts[0])._nnz()
    assert res["bp_total_flops"] == sum(2 * b["nnz"] for b in res["bp"])
    assert res["steps"][0]["phase"] == "up" and res["critical_flops"] > 0


def test_errors():
    with pytest.raises(TypeError, match=r"no analytic transposed Jacobian for Tanh"):
        transposed_jacobian(nn.Tanh(), torch.randn(3))
    with pytest.raises(ValueError, match=r"groups=2 is not supported"):
        transposed_jacobian(nn.Conv2d(2, 2, 3, groups=2), torch.randn(2, 5, 5))
    with pytest.raises(ValueError, match=r"one sample \(C, H, W\), got shape \(1, 2, 5, 5\)"):
        transposed_jacobian(nn.Conv2d(2, 2, 3), torch.randn(1, 2, 5, 5))
    with pytest.raises(ValueError, match="padding_mode='reflect' is not supported"):
        transposed_jacobian(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"),
                            torch.randn(2, 5, 5))
    with pytest.raises(TypeError, match=r"x must be the pair \(input, hidden\), got Tensor"):
        transposed_jacobian(nn.GRUCell(2, 3), torch.randn(2))
    with pytest.raises(ValueError, match="input has 3 channels, expected 2"):
        transposed_jacobian(nn.Conv2d(2, 2, 3), torch.randn(3, 5, 5))
    net = _net()
    acts, _ = bppsa.record(net, torch.randn(2, 8, 8))
    with pytest.raises(ValueError, match="7 layers but 6 activations"):
        bppsa.backward(net, acts[:-1], torch.ones(3))
    with pytest.raises(ValueError, match="grad_output has 4 elements"):
        bppsa.backward(net, acts, torch.ones(4))
    with pytest.raises(ValueError, match="levels must be an int >= 0 or None, got -1"):
        bppsa.backward(net, acts, torch.ones(3), levels=-1)
    bad = list(acts)
    bad[3] = torch.randn(4, 5, 5)
    with pytest.raises(ValueError, match=r"layer 2 \(MaxPool2d\) outputs 64 values but layer 3"):
        bppsa.backward(net, bad, torch.ones(3))


def test_pruned_linear_weights_leave_the_pattern():
    lin = nn.Linear(4, 3).double()
    with torch.no_grad():
        lin.weight[0, 1] = 0.0
        lin.weight[2, 3] = 0.0
    x = torch.randn(4, dtype=torch.float64)
    JT = transposed_jacobian(lin, x, drop_zero_weights=True)
    assert JT._nnz() == 10
    assert torch.equal(JT.to_dense(), lin.weight.detach().t())


def test_pruned_weights_leave_the_pattern():
    torch.manual_seed(2)
    conv = nn.Conv2d(2, 3, 3, padding=1).double()
    with torch.no_grad():
        conv.weight[conv.weight.abs() < 0.15] = 0
    x = torch.randn(2, 6, 6, dtype=torch.float64)
    full = transposed_jacobian(conv, x)
    pruned = transposed_jacobian(conv, x, drop_zero_weights=True)
    assert pruned._nnz() < full._nnz()
    assert torch.equal(pruned.to_dense(), full.to_dense())
    net = [conv, nn.ReLU(), nn.Flatten(), nn.Linear(108, 2).double()]
    acts, _ = bppsa.record(net, x)
    g = torch.randn(2, dtype=torch.float64)
    a, _ = bppsa.backward(net, acts, g, drop_zero_weights=True)
    b = _autograd_grads(net, acts, g)
    assert all(torch.allclose(u, v, atol=1e-12) for u, v in zip(a, b, strict=True))


def test_bench_jacobians_quick(tmp_path):
    from paraprop_lab.bench import jacobians

    payload = jacobians.run(tmp_path, quick=True, repeats=1)
    rows = {r["layer"]: r for r in payload["table1"]}
    assert rows["relu"]["sparsity"] == f"{1 - 1 / (8 * 12 * 12):.5f}"
    pruned = next(r for r in payload["fig10"] if r["weights"] == "pruned 97%")
    dense = next(r for r in payload["fig10"] if r["weights"] == "dense")
    assert pruned["bp total flops (csr)"] < dense["bp total flops (csr)"]
    assert (tmp_path / "jacobians.md").exists()
