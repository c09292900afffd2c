"""PixelCNN: no blind spot, no look-ahead; every sampler returns the same discrete image."""

import pytest
import torch

import paraprop
from paraprop import ConvergenceError
from paraprop.models import PixelCNN
from paraprop.sampling import pixelcnn as ps
from paraprop.sampling import sample
from paraprop.sampling.pixelcnn import CachedPixels, PixelSystem
from paraprop.solvers import GSJacobi, JacobiGS, SlidingJacobi
from paraprop_lab.cli import main

METHODS = [("sequential_cached", None), ("jacobi", None), ("jacobi_gs", 1), ("jacobi_gs", 3),
           ("gs_jacobi", 1), ("gs_jacobi", 2), ("gs_jacobi", 5)]


def _method(method, rows):
    """``method`` as passed to sample: the hybrids as solver objects whose block_size is the
    rows per block or window of PixelCNN's own samplers."""
    if rows is None:
        return method
    return {"jacobi_gs": JacobiGS, "gs_jacobi": GSJacobi}[method](block_size=rows)


def _model(size=6, hidden=8, layers=3, channels=1, seed=0, dtype=torch.float64, device="cpu"):
    m = PixelCNN(channels, size, hidden=hidden, layers=layers, mixtures=3, levels=17, seed=seed)
    return m.to(device=device, dtype=dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("channels", [1, 2])
def test_no_look_ahead_and_no_blind_spot(channels):
    # with as many layers as rows the receptive field covers every earlier pixel
    m = _model(size=6, layers=6, channels=channels, seed=1)
    x = torch.rand(1, channels, 6, 6, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        out = m(x)
        for r in range(6):
            for c in range(6):
                (g,) = torch.autograd.grad(out[0, :, :, r, c].sum(), x, retain_graph=True)
                dep = (g[0] != 0).any(0)
                earlier = torch.zeros(36, dtype=torch.bool)
                earlier[: r * 6 + c] = True
                assert torch.equal(dep.flatten(), earlier), (r, c)


@pytest.mark.parametrize(("size", "batch", "seed"), [(5, 1, 0), (6, 3, 1), (7, 2, 2)])
def test_every_sampler_returns_the_sequential_image(size, batch, seed, device):
    m = _model(size=size, seed=seed, device=device)
    noise = m.draw_noise(batch, torch.Generator().manual_seed(seed))
    ref, seq = sample(m, batch, method="sequential", noise=noise)
    assert seq.evaluations == size * size
    assert ref.shape == (batch, 1, size, size)
    levels = (ref + 1) * 8  # 17 levels on [-1, 1]
    assert torch.equal(levels, levels.round()) and ref.abs().max() <= 1
    for method, bs in METHODS:
        if bs is not None and bs > size:
            continue
        x, sol = sample(m, batch, method=_method(method, bs), noise=noise, tol=0)
        assert torch.equal(x, ref), (method, bs)
        assert sol.converged


def test_jacobi_gs_needs_at_most_one_iteration_per_block():
    m = _model(size=6, seed=3)
    noise = m.draw_noise(2, torch.Generator().manual_seed(0))
    _, sol = sample(m, 2, method=JacobiGS(block_size=2), noise=noise)
    # the solver's block_size counts pixels: 2 rows of 6
    assert sol.iterations <= 3 and sol.stats["block_size"] == 2 * 6
    # one call per pixel of a block per iteration, never more calls than the sequential loop
    # (36 pixels); the last call is the full evaluation that checks the value (all 36 pixels),
    # every other one computes a pixel of each of the 3 blocks
    assert sol.evaluations == sol.iterations * 12 <= 36
    assert sol.stats["positions"] == (sol.evaluations - 1) * 3 + 36


class _Counting:
    """Passes the protocol calls on to a :class:`CachedPixels` map, counting the positions asked
    for. Its window cache is a fake one that wraps the map's and counts the positions computed so
    far; it checks that the driver hands back the last cache and that the map's per-layer caches
    cover exactly the final rows above each window."""

    def __init__(self, fn: CachedPixels):
        self.fn, self.x0, self.dim = fn, fn.x0, fn.dim
        self.positions, self.last, self.windows, self.full, self.updates = 0, None, [], 0, 0

    def __call__(self, x):
        # the cached samplers never evaluate the whole map themselves; the solver may, once,
        # to verify the final value at tol=0
        self.full += 1
        assert self.full == 1, "at most one full evaluation per solve (the verification)"
        return self.fn(x)

    def update(self, x, index):
        self.positions += index.numel()
        self.updates += 1
        return self.fn.update(x, index)

    def window(self, x, start, stop, cache):
        assert cache is self.last, "the driver must hand back the cache returned last"
        inner, counted = (None, 0) if cache is None else (cache["map"], cache["positions"])
        vals, inner = self.fn.window(x, start, stop, inner)
        assert inner["row"] == start // self.fn.W  # the frozen rows above the window
        self.windows.append((start, stop))
        self.positions += stop - start
        self.last = {"map": inner, "positions": counted + stop - start}
        return vals, self.last


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_positions_computed_through_the_protocol(rows):
    m = _model(size=6, seed=3)
    noise = m.draw_noise(3, torch.Generator().manual_seed(1))
    ref, _ = sample(m, 3, method="sequential_cached", noise=noise)
    T = 36
    # gs_jacobi: fn.window on windows of whole rows in order, the cache carried between calls
    fn = _Counting(CachedPixels(m, noise))
    sol = paraprop.solve(fn, fn.x0, method=GSJacobi(block_size=rows * 6), dim=fn.dim, tol=0)
    assert torch.equal(sol.value.permute(0, 3, 1, 2), ref)
    verified = fn.full * T   # the positions of the solver's verification, if it ran one
    assert sol.stats["positions"] - verified == fn.last["positions"] == fn.positions == \
        fn.fn.computed
    assert sol.evaluations == len(fn.windows) + fn.full
    assert all(a % 6 == 0 and (b % 6 == 0 or b == T) for a, b in fn.windows)
    assert [a for a, _ in fn.windows] == sorted(a for a, _ in fn.windows)
    assert sol.stats["positions"] == sum(b - a for a, b in fn.windows) + verified
    _, via_sample = sample(m, 3, method=GSJacobi(block_size=rows), noise=noise, tol=0)
    assert via_sample.stats["positions"] == sol.stats["positions"]
    # jacobi_gs: fn.update at each pixel offset of the blocks; every iteration generates the
    # whole image once with the cache; a sweep from unchanged rows above reuses its values
    fn = _Counting(CachedPixels(m, noise, rows))
    sol = paraprop.solve(fn, fn.x0, method=JacobiGS(block_size=rows * 6), dim=fn.dim, tol=0)
    assert torch.equal(sol.value.permute(0, 3, 1, 2), ref)
    verified = fn.full * T
    assert sol.stats["positions"] - verified == fn.positions
    assert fn.fn.computed == sol.iterations * T and fn.fn.reused in (0, T)
    # never more calls than the sequential loop (T pixels); every call is an update or the one
    # full evaluation that checks the value
    assert sol.evaluations <= T
    assert sol.evaluations == fn.updates + fn.full


def test_cached_map_serves_other_calls_with_the_full_pass():
    m = _model(size=5, seed=2)
    noise = m.draw_noise(2, torch.Generator().manual_seed(3))
    ref, _ = sample(m, 2, method="sequential_cached", noise=noise)
    x = ref.permute(0, 2, 3, 1).contiguous()  # the solution, state layout
    full = PixelSystem(m, noise)(x).reshape(2, 25, 1)
    fn = CachedPixels(m, noise, 2)
    for index in (torch.tensor([3, 13, 23]), torch.tensor([0, 1, 2]), torch.tensor([7])):
        assert torch.equal(fn.update(x, index), full[:, index])  # not the sweep's next offset
    assert fn.computed == 3 * 25
    # a sweep's offset whose x does not hold the value returned for the offset before it
    first = fn.update(x, torch.tensor([0, 10, 20]))
    y = x.clone()
    y.reshape(2, 25, 1)[:, 0] = first[:, 0] + 2
    assert torch.equal(fn.update(y, torch.tensor([1, 11, 21])),
                       PixelSystem(m, noise)(y).reshape(2, 25, 1)[:, [1, 11, 21]])
    # windows need not be whole rows (SlidingJacobi)
    fn = CachedPixels(m, noise)
    sol = paraprop.solve(fn, fn.x0, method=SlidingJacobi(7), dim=fn.dim, tol=0)
    assert torch.equal(sol.value.permute(0, 3, 1, 2), ref)


def test_sequential_cached_solution_comes_from_the_driver():
    m = _model(size=5, seed=2)
    noise = m.draw_noise(2, torch.Generator().manual_seed(3))
    _, sol = sample(m, 2, method="sequential_cached", noise=noise)
    assert sol.method == "sequential_cached" and sol.converged
    assert sol.iterations == sol.evaluations == sol.stats["positions"] == 25
    assert sol.stats["bound"] == 25 and sol.residuals.numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lower_precision_models_agree(dtype, device):
    """The cached samplers compute a pixel with other products than the full forward pass (one
    column of each layer against convolutions): the same image here, in every dtype, though a
    rounding difference could in principle move a value across a grid boundary (see
    docs/sampling.md)."""
    m = _model(size=5, dtype=dtype, seed=4, device=device)
    noise = m.draw_noise(4, torch.Generator().manual_seed(0))
    assert noise.dtype == dtype and noise.device.type == torch.device(device).type
    ref, _ = sample(m, 4, method="sequential", noise=noise)
    for method, bs in [("sequential_cached", None), ("jacobi", None), ("gs_jacobi", 2),
                       ("jacobi_gs", 2)]:
        x, sol = sample(m, 4, method=_method(method, bs), noise=noise, tol=0)
        assert torch.equal(x, ref) and sol.converged, method


def test_bad_block_sizes_and_shapes():
    m = _model(size=5)
    # a block size below 1 is refused by the solver object, one above the rows by the sampler
    with pytest.raises(ValueError, match=r"GSJacobi: block_size must be a positive int or None, "
                                         r"got 0"):
        sample(m, 2, method=GSJacobi(block_size=0))
    with pytest.raises(ValueError, match=r"block_size must be an int in \[1, 5\].*got 9"):
        sample(m, 2, method=JacobiGS(block_size=9))
    with pytest.raises(ValueError, match=r"block_size must be an int in \[1, 5\].*got 6"):
        sample(m, 2, method=GSJacobi(block_size=6))
    with pytest.raises(TypeError, match="unexpected keyword argument 'block_size'"):
        sample(m, 2, method="jacobi_gs", block_size=2)
    # sample passes no block size to sequential_cached (it has no solver object); the model's
    # sampler itself still refuses one
    noise = m.draw_noise(2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="block_size is not used by method='sequential_cached'"):
        m.samplers()["sequential_cached"](noise, block_size=2, tol=0, max_iters=None,
                                          throw=True)
    with pytest.raises(ValueError, match=r"noise must have shape \(2, 5, 5, 1, 4\)"):
        sample(m, 2, method="jacobi", noise=torch.zeros(2, 5, 5, 1, 3))
    with pytest.raises(ValueError, match=r"x must have shape \(B, 1, 5, 5\), got \(2, 1, 4, 4\)"):
        m(torch.zeros(2, 1, 4, 4))
    with pytest.raises(ValueError, match="kernel must be odd and >= 3, got 4"):
        PixelCNN(1, 5, kernel=4)
    with pytest.raises(ValueError, match="unknown method='newton'; choose one of"):
        sample(m, 2, method="newton")


def test_log_prob_is_a_distribution_over_the_grid():
    # one pixel, one channel: probabilities of all grid values sum to 1
    m = _model(size=1, layers=1, seed=5)
    grid = torch.linspace(-1, 1, 17, dtype=torch.float64).reshape(17, 1, 1, 1)
    total = m.log_prob(grid).exp().sum()
    assert abs(float(total) - 1.0) < 1e-9


def test_train_and_checkpoint(tmp_path, capsys):
    out = tmp_path / "p.pt"
    assert main(["train", "pixelcnn", "--data", "digits", "--epochs", "1", "--hidden", "8",
                 "--layers", "2", "--mixtures", "2", "--out", str(out)]) == 0
    assert "bits/dim" in capsys.readouterr().out
    m = PixelCNN.load(out)
    assert m.size == 8 and m.levels == 17
    x, sol = sample(m, 2, method=GSJacobi(block_size=2),
                    generator=torch.Generator().manual_seed(0))
    y, _ = sample(m, 2, method="sequential_cached", generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, y)


def test_bench_pixelcnn_quick(tmp_path):
    from paraprop_lab.bench import pixelcnn

    payload = pixelcnn.run(tmp_path, quick=True, repeats=1)
    assert all(r["identical"] for r in payload["digits"]["rows"])
    assert (tmp_path / "pixelcnn.md").exists()
    assert (tmp_path / "pixelcnn_digits_samples.png").exists()


def test_max_iters_tol_and_throw_reach_the_cached_samplers():
    m = _model(size=6, seed=3)
    noise = m.draw_noise(2, torch.Generator().manual_seed(0))
    ref, _ = sample(m, 2, method="sequential", noise=noise)
    # jacobi_gs: max_iters caps the iterations; fewer than the blocks is not converged
    _, sol = sample(m, 2, method=JacobiGS(block_size=1), noise=noise, max_iters=1,
                    throw=False)
    assert sol.iterations == 1 and not sol.converged
    with pytest.raises(ConvergenceError, match="method='jacobi_gs' did not converge") as err:
        sample(m, 2, method=JacobiGS(block_size=1), noise=noise, max_iters=1)
    assert err.value.solution.iterations == 1
    # gs_jacobi: max_iters caps the sweeps of all windows together, as in paraprop.solve
    _, sol = sample(m, 2, method=GSJacobi(block_size=2), noise=noise, max_iters=1,
                    throw=False)
    assert sol.iterations == 1 and sol.stats["positions"] == 2 * 6  # one sweep of 2 rows
    assert not sol.converged
    with pytest.raises(ConvergenceError, match="method='gs_jacobi' did not converge"):
        sample(m, 2, method=GSJacobi(block_size=2), noise=noise, max_iters=1)
    # a cap at the exactness bound converges; a tol as large as the image range stops as soon
    # as the stopping rule has a contraction estimate (two sweeps), tol=0 only at no change
    x, sol = sample(m, 2, method=JacobiGS(block_size=2), noise=noise, max_iters=3)
    assert sol.converged and torch.equal(x, ref)
    _, loose = sample(m, 2, method=GSJacobi(block_size=6), noise=noise, tol=2.0)
    x, exact = sample(m, 2, method=GSJacobi(block_size=6), noise=noise, tol=0)
    assert loose.iterations == 2 and loose.converged and loose.stats["error_estimate"] <= 2.0
    assert exact.iterations > 2 and exact.residuals[-1] == 0 and torch.equal(x, ref)


def test_arguments_a_sampler_cannot_use_are_refused():
    m = _model(size=5)
    with pytest.raises(ValueError, match="max_iters is not used by method='sequential_cached'"):
        sample(m, 2, method="sequential_cached", max_iters=3)
    with pytest.raises(ValueError, match="tol must be a number >= 0, got -1"):
        sample(m, 2, method="gs_jacobi", tol=-1)
    with pytest.raises(ValueError, match="max_iters must be a positive int or None, got 0"):
        sample(m, 2, method="jacobi_gs", max_iters=0)


def _device_checking(fn):
    """Emulate CUDA's refusal of a generator on another device (meta has no such check)."""
    def wrapped(*args, generator=None, device=None, **kw):
        gdev = (generator.device if generator is not None else torch.device("cpu")).type
        if torch.device(device or "cpu").type != gdev:
            raise RuntimeError(f"generator on {gdev}, tensor on {device}")
        return fn(*args, generator=generator, device=device, **kw)
    return wrapped


def test_noise_is_drawn_on_the_generator_device_then_moved(monkeypatch):
    m = _model(size=4)  # float64
    expected = m.draw_noise(2, torch.Generator().manual_seed(7))
    assert expected.dtype == torch.float64
    monkeypatch.setattr(torch, "rand", _device_checking(torch.rand))
    meta = _model(size=4).to("meta")
    noise = meta.draw_noise(2, torch.Generator().manual_seed(7))
    assert noise.device.type == "meta" and noise.dtype == torch.float64
    assert noise.shape == expected.shape


def test_init_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a = PixelCNN(1, 4, hidden=4, layers=1, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    b = PixelCNN(1, 4, hidden=4, layers=1, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_log_prob_gradient_survives_in_the_tails():
    # one pixel, one component: the mean far from x with a tiny scale (the sigmoids underflow)
    m = PixelCNN(1, 1, hidden=4, layers=1, mixtures=1, levels=17).double()
    with torch.no_grad():
        m.out.weight.zero_()
        m.out.bias.copy_(torch.tensor([0.0, 3.0, -7.0]))  # logit_pi, mean (tanh), log_scale
    for value in (0.0, -1.0, 1.0):  # inner bin, left edge, right edge
        x = torch.full((1, 1, 1, 1), value, dtype=torch.float64)
        lp = m.log_prob(x)
        (g,) = torch.autograd.grad(lp.sum(), m.out.bias)
        assert torch.isfinite(lp).all() and torch.isfinite(g).all(), value
        if value < 1:
            assert g[1] != 0, value  # the mean is pulled towards x


def test_pixelcnn_argument_and_checkpoint_errors(tmp_path):
    for name in ("in_channels", "image_size", "hidden", "layers", "mixtures", "levels"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int, got 0"):
            PixelCNN(**{name: 0})
    with pytest.raises(ValueError, match="hidden must be a positive int, got True"):
        PixelCNN(hidden=True)
    torch.save({"kind": "MADE"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="other.pt: not a paraprop PixelCNN checkpoint"):
        PixelCNN.load(tmp_path / "other.pt")
    from paraprop_lab.training.pixelcnn import pixel_data, train_pixelcnn

    with pytest.raises(ValueError, match="unknown data='cifar'; choose 'digits' or 'mnist'"):
        pixel_data("cifar")
    with pytest.raises(ValueError, match="epochs and batch_size must be >= 1, got 0, 64"):
        train_pixelcnn(_model(size=4), torch.zeros(2, 1, 4, 4), epochs=0)


def test_tf32_convolutions_are_refused_where_the_cached_result_is_checked(monkeypatch):
    """On CUDA, cuDNN runs float32 convolutions in TF32 by default; the cached samplers' columns
    (float32 products) then disagree with the full pass that checks them (the first GPU run: one
    grid step within the first rows). jacobi_gs and gs_jacobi refuse that setting up front, by
    name; float64, bfloat16 and the CPU are not affected."""
    m = _model(size=5, seed=0, dtype=torch.float32)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with pytest.raises(ValueError, match=r"allow_tf32 = False.*'sequential_cached'"):
        ps.refuse_tf32_convolutions(m, cuda, "gs_jacobi")
    ps.refuse_tf32_convolutions(m, cpu, "gs_jacobi")                   # the CPU: no TF32
    with monkeypatch.context() as mp:                                  # cuDNN off: float32
        mp.setattr(torch.backends.cudnn, "enabled", False)
        ps.refuse_tf32_convolutions(m, cuda, "gs_jacobi")
    ps.refuse_tf32_convolutions(_model(size=5, seed=0, dtype=torch.float64), cuda, "x")
    # the flags are read in torch's order: the convolutions', cuDNN's, torch's
    cudnn = torch.backends.cudnn
    assert ps.cudnn_conv_tf32()                                        # torch's default
    monkeypatch.setattr(cudnn, "conv", type("C", (), {"fp32_precision": "ieee"})())
    assert not ps.cudnn_conv_tf32()
    ps.refuse_tf32_convolutions(m, cuda, "gs_jacobi")
    monkeypatch.setattr(cudnn, "conv", type("C", (), {"fp32_precision": "none"})())
    monkeypatch.setattr(cudnn, "fp32_precision", "tf32")
    assert ps.cudnn_conv_tf32()
    # both checked samplers ask before they run
    seen = []
    monkeypatch.setattr(ps, "refuse_tf32_convolutions", lambda m, d, e: seen.append(e))
    noise = m.draw_noise(1, torch.Generator().manual_seed(0))
    for method in ("gs_jacobi", "jacobi_gs", "sequential_cached", "jacobi"):
        sample(m, 1, method=method, noise=noise, tol=0)
    assert seen == ["paraprop.sampling.pixelcnn.gs_jacobi", "paraprop.sampling.pixelcnn.jacobi_gs"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_tf32_refusal_on_the_gpu():
    if not ps.cudnn_conv_tf32():
        pytest.skip("this process runs cuDNN's convolutions in float32 already")
    m = _model(size=5, seed=0, dtype=torch.float32, device="cuda")
    noise = m.draw_noise(1, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="TF32"):
        sample(m, 1, method="gs_jacobi", noise=noise, tol=0)
    # the uncached samplers run the same full pass on the same shapes: consistent in TF32
    ref, _ = sample(m, 1, method="sequential", noise=noise)
    x, sol = sample(m, 1, method="jacobi", noise=noise, tol=0)
    assert sol.converged and torch.equal(x, ref)
