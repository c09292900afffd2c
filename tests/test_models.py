"""The reference computations of the demo and benchmarks are correct triangular systems."""

import pytest
import torch

import paraprop
from paraprop.models import LayerChain, MaskedAffineMap, made_masks
from paraprop.solvers import GSJacobi, JacobiGS


def test_layer_chain_solutions_equal_the_forward_pass():
    chain = LayerChain(40, 6, seed=1).double().requires_grad_(False)
    u = torch.randn(5, 6, dtype=torch.float64)
    chain.bind(u)
    expected = chain.forward_sequential(u)
    x0 = torch.zeros(5, 40, 6, dtype=torch.float64)
    for method in ["sequential", "jacobi", JacobiGS(block_size=7), GSJacobi(block_size=9)]:
        sol = paraprop.solve(chain, x0, method=method, dim=1, tol=0)
        assert (sol.value - expected).abs().max() <= 1e-12, method
    # update computes bitwise what the full map computes (one layer or several), so tol=0 is
    # bitwise the sequential solve
    x = torch.randn(5, 40, 6, dtype=torch.float64)
    full = chain(x)
    for index in ([0], [7], [39], [0, 3, 39]):
        idx = torch.tensor(index)
        assert torch.equal(chain.update(x, idx), full[:, idx]), index
    ref = paraprop.solve(chain, x0, method="sequential", dim=1)
    for method in ["jacobi", JacobiGS(block_size=7), GSJacobi(block_size=9)]:
        sol = paraprop.solve(chain, x0, method=method, dim=1, tol=0)
        assert torch.equal(sol.value, ref.value), method


def test_made_masks_are_autoregressive():
    masks = made_masks(10, (16, 16))
    conn = masks[0]
    for m in masks[1:]:
        conn = (m @ conn).clamp(max=1)
    # output d may only see inputs < d
    assert torch.equal(conn * torch.ones(10, 10).triu(), torch.zeros(10, 10))
    assert conn.tril(-1).sum() > 0


def test_masked_affine_map_jacobian_is_strictly_lower_and_update_matches():
    m = MaskedAffineMap(12, (32, 32), seed=3).double().requires_grad_(False)
    m.bind(torch.randn(1, 12, dtype=torch.float64))
    x = torch.randn(1, 12, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda v: m(v), x)[0, :, 0, :]
    assert torch.equal(J.triu(), torch.zeros_like(J))
    idx = torch.tensor([0, 5, 11])
    assert torch.equal(m.update(x, idx), m(x)[:, idx])    # the protocol: bitwise forward's


@pytest.mark.parametrize("features", [16, 40, 300])
def test_masked_affine_map_chunks_update_bitwise_and_follow_weight_changes(features):
    # 1, 3 and 16 chunks of the output layer (chunk_positions); the chunked weights are cached
    # between calls and must follow an in-place change of the weights or the bias
    m = MaskedAffineMap(features, (48,), seed=1).requires_grad_(False)
    m.bind(torch.randn(5, features, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(5, features, generator=torch.Generator().manual_seed(3))
    idx = torch.tensor([0, features // 3, features // 2, features - 1])
    before = m(x)
    assert torch.equal(m.update(x, idx), before[:, idx])
    with torch.no_grad():
        m.out.weight.mul_(0.5)
    after = m(x)
    assert not torch.equal(after, before)
    fresh = MaskedAffineMap(features, (48,), seed=1).requires_grad_(False)
    fresh.bind(m.z).load_state_dict(m.state_dict())
    assert torch.equal(after, fresh(x))        # what an uncached map computes
    assert torch.equal(m.update(x, idx), after[:, idx])
    with torch.no_grad():
        m.out.bias.add_(0.25)
    assert torch.equal(m.update(x, idx), m(x)[:, idx])
    assert not torch.equal(m(x), after)


def test_masked_affine_map_sampling_all_methods_agree():
    m = MaskedAffineMap(30, (64, 64), seed=0).double().requires_grad_(False)
    m.bind(torch.randn(8, 30, dtype=torch.float64))
    x0 = torch.zeros(8, 30, dtype=torch.float64)
    ref = paraprop.solve(m, x0, method="sequential")
    # the map's update computes its output chunks with the products of the full map, so the
    # ancestral sampler (update) is bitwise the full map's fixed point
    full = paraprop.solve(lambda v: m(v), x0, method="sequential")
    assert torch.equal(full.value, ref.value)
    for method in ["jacobi", JacobiGS(block_size=6), GSJacobi(block_size=10)]:
        sol = paraprop.solve(m, x0, method=method, tol=0)
        assert sol.converged and torch.equal(sol.value, ref.value), method   # tol=0: bitwise
        sol = paraprop.solve(m, x0, method=method, tol=1e-12)   # a tol at the rounding level
        assert sol.converged and (sol.value - ref.value).abs().max() <= 1e-12
