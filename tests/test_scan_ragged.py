"""The ragged scan: Blelloch's tree over a list of elements of different shapes."""

import pytest
import torch

from paraprop.scan import ragged_scan


def _chain(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` matrices of different shapes whose products chain: ``(d_0, d_1), (d_1, d_2)...``"""
    gen = torch.Generator().manual_seed(seed)
    dims = torch.randint(1, 5, (n + 1,), generator=gen).tolist()
    return [torch.randn(dims[i], dims[i + 1], dtype=torch.float64, generator=gen)
            for i in range(n)]


def _matmul(a, b):
    return a @ b


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("levels", [None, 0, 1, 2, 10])
def test_prefixes_equal_the_sequential_products(n, levels):
    xs = _chain(n, seed=n)
    prefixes, steps = ragged_scan(xs, _matmul, levels=levels)
    ref = [xs[0]]
    for x in xs[1:]:
        ref.append(ref[-1] @ x)
    assert len(prefixes) == n
    assert prefixes[0] is xs[0]
    for p, r in zip(prefixes, ref, strict=True):
        assert p.shape == r.shape and torch.allclose(p, r, atol=1e-12)
    if n == 1:
        assert steps == []
    phases = {s["phase"] for s in steps}
    if levels == 0 and n > 1:
        assert steps == [{"level": 0, "phase": "linear", "combines": n - 1}]
    if levels is None:
        assert "linear" not in phases
        assert len([s for s in steps if s["phase"] == "up"]) == n.bit_length() - 1  # floor(log2 n)


def test_combines_are_counted_and_measured():
    xs = _chain(6, seed=1)
    calls = []

    def combine(a, b):
        calls.append((a.shape, b.shape))
        return a @ b

    def cost(a, b, out):
        return {"flops": 2 * a.shape[0] * a.shape[1] * b.shape[1], "size": out.numel()}

    _, steps = ragged_scan(xs, combine, levels=1, cost=cost)
    assert sum(s["combines"] for s in steps) == len(calls)
    assert [s["phase"] for s in steps] == ["up", "linear", "down"]
    assert [s["level"] for s in steps] == [0, 1, 0]
    up = steps[0]
    flops = [2 * xs[2 * i].shape[0] * xs[2 * i].shape[1] * xs[2 * i + 1].shape[1]
             for i in range(3)]
    assert up["combines"] == 3 and up["flops"] == sum(flops) and up["max_flops"] == max(flops)
    assert set(up) == {"level", "phase", "combines", "flops", "max_flops", "size", "max_size"}


def test_any_associative_combine_and_any_elements():
    # strings under concatenation: associative, not commutative, of different lengths
    words = ["a", "bc", "", "def", "g", "hi", "j"]
    prefixes, _ = ragged_scan(words, lambda a, b: a + b, levels=None)
    assert prefixes == ["".join(words[: i + 1]) for i in range(len(words))]


def test_errors():
    with pytest.raises(ValueError, match="elems is empty"):
        ragged_scan([], _matmul)
    with pytest.raises(TypeError, match="combine must be callable, got int"):
        ragged_scan([torch.ones(1)], 3)
    with pytest.raises(TypeError, match="cost must be callable or None, got str"):
        ragged_scan([torch.ones(1)], _matmul, cost="flops")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"levels must be an int >= 0 or None, got {bad}"):
            ragged_scan([torch.ones(1)], _matmul, levels=bad)
