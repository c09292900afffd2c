"""TarFlow: the density against autograd, and sampling by every solve method against the
sequential inverse (bitwise at tol=0), the KV-cached loop, the cached-prefix protocol, errors and
the training job."""

from __future__ import annotations

import math

import pytest
import torch

import paraprop
from paraprop.flows.tarflow_inverse import sequential_cached
from paraprop.flows.tarflow_sampling import TARFLOW_METHODS
from paraprop.models.tarflow import TarFlow, patchify
from paraprop.solvers import GSJacobi, Jacobi, JacobiGS, SlidingJacobi
from paraprop_lab.cli import main
from paraprop_lab.training.tarflow import checkpoint_name, trained_tarflow

# allowed |x - x_sequential| of the KV-cached loop, which rounds differently from a full pass:
# a few units of the dtype's rounding at the values' scale (measured: float32 ~1e-6 on values
# of ~5; bf16 ~0.06, fp16 ~0.007)
CACHED_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 0.25,
              torch.float16: 0.04}
LOW = [torch.bfloat16, torch.float16]
METHODS = ["jacobi", "sliding_jacobi", "gs_jacobi", "jacobi_gs", "anderson", SlidingJacobi(3),
           GSJacobi(5), GSJacobi(8), JacobiGS(3), ["jacobi", GSJacobi(4), "sliding_jacobi"], "auto"]


def _flow(dtype=torch.float64, *, scale=0.3, alpha_bias=0.0, seed=0, blocks=3, device="cpu",
          **kw):
    """A small flow (8x8, patches of 2: T=16, P=4) with random output projections, so that every
    block is a non-trivial affine map (the trained-looking case: |alpha| of order 0.1 to 1).
    The weights are drawn in float64 on the CPU, then cast and moved: the same flow in every
    dtype and on every device."""
    opts = {"patch_size": 2, "blocks": blocks, "layers": 2, "width": 32, "heads": 2, **kw}
    flow = TarFlow(8, seed=seed, **opts).double()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for blk in flow.blocks:
            w = blk.out.weight
            w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype) * scale / math.sqrt(32))
            blk.out.bias.copy_(torch.randn(blk.out.bias.shape, generator=g, dtype=w.dtype) * 0.1)
            blk.out.bias[flow.P:] += alpha_bias
    return flow.to(device=device, dtype=dtype).eval()


def _z(flow, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = flow.blocks[0].out.weight
    return torch.randn(n, flow.channels, flow.image_size, flow.image_size, generator=g,
                       dtype=torch.float64).to(device=w.device, dtype=w.dtype)


# -- density ----------------------------------------------------------------------------------
def test_logdet_and_log_prob_match_autograd():
    flow = TarFlow(4, patch_size=2, blocks=3, layers=1, width=16, heads=2).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for blk in flow.blocks:
            blk.out.weight.normal_(0, 0.5, generator=g)
            blk.out.bias.normal_(0, 0.3, generator=g)
    x = torch.rand(1, 1, 4, 4, dtype=torch.float64, generator=g) * 2 - 1
    with torch.no_grad():
        z, logdet = flow(x)
    J = torch.autograd.functional.jacobian(lambda v: flow(v.view(1, 1, 4, 4))[0].flatten(),
                                           x.flatten())
    sign, ref = torch.linalg.slogdet(J)
    assert sign > 0 and abs(float(logdet[0] - ref)) < 1e-10
    assert abs(float(logdet[0])) > 0.1  # not trivially the identity
    lp = -0.5 * z.pow(2).sum() - 8 * math.log(2 * math.pi) + logdet[0]
    assert torch.allclose(flow.log_prob(x)[0], lp, rtol=0, atol=1e-12)


def test_blocks_start_as_the_identity_and_are_autoregressive():
    flow = TarFlow(8, patch_size=2, blocks=2, layers=1, width=16, heads=2).double()
    x = _z(flow, n=2)
    z, logdet = flow(x)
    assert torch.equal(z, x) and torch.equal(logdet, torch.zeros(2, dtype=torch.float64))
    blk = _flow(blocks=1).blocks[0]
    h = patchify(_z(flow, n=1), 2)
    mu, alpha = blk.params(h)
    assert torch.equal(mu[:, 0], torch.zeros_like(mu[:, 0]))
    for t in range(16):  # patch t's parameters read the patches < t only
        h2 = h.clone()
        h2[:, t:] += 1.0
        mu2, alpha2 = blk.params(h2)
        assert torch.equal(mu2[:, : t + 1], mu[:, : t + 1])
        assert torch.equal(alpha2[:, : t + 1], alpha[:, : t + 1])


# -- sampling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *LOW])
def test_inverse_of_forward(dtype, device):
    flow = _flow(dtype, device=device)
    x = _z(flow).clamp(-1, 1)
    z, _ = flow(x)
    err = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 0.1,
           torch.float16: 0.02}[dtype]
    for method in ("sequential", "jacobi", "sequential_cached"):
        back, sol = flow.inverse(z, method=method, tol=0)
        assert sol.converged and float((back - x).abs().max()) <= err, method


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *LOW])
def test_every_method_is_bitwise_sequential_at_tol_0(dtype, device):
    flow = _flow(dtype, device=device)
    z = _z(flow)
    ref, seq = flow.inverse(z, method="sequential")
    assert seq.evaluations == 3 * 16 and seq.converged
    # (bf16 and fp16 run emulated on a CPU: one method of each kind there)
    methods = METHODS if dtype not in LOW else ["jacobi", SlidingJacobi(3), GSJacobi(5),
                                                JacobiGS(3), "auto"]
    for method in methods:
        x, sol = flow.inverse(z, method=method, tol=0)
        assert sol.converged and torch.equal(x, ref), method
        blocks = sol.stats["blocks"]
        assert len(blocks) == 3 and len(sol.stats["methods"]) == 3
        assert sol.iterations == sum(b.iterations for b in blocks)
        assert sol.evaluations == sol.stats["model_calls"] == sum(b.evaluations for b in blocks)
    for chunk in (3, 16):  # other chunkings: other maps, each with its own bitwise agreement
        ref_c, _ = flow.inverse(z, method="sequential", chunk=chunk)
        assert float((ref_c - ref).abs().max()) <= CACHED_TOL[dtype]
        for method in ("jacobi", GSJacobi(chunk), "auto")[: 3 if dtype not in LOW else 1]:
            x, sol = flow.inverse(z, method=method, tol=0, chunk=chunk)
            assert torch.equal(x, ref_c), (chunk, method)
    cached, sol = flow.inverse(z, method="sequential_cached")
    assert sol.evaluations == 3 * 15 and sol.converged
    assert float((cached - ref).abs().max()) <= CACHED_TOL[dtype]
    assert float(ref.abs().max()) > 1.5 * float(z.abs().max()) or \
        float((ref - z).abs().max()) > 0.5  # the blocks do move the values


def test_jacobi_needs_fewer_passes_than_positions_and_windows_compute_less():
    flow = _flow(scale=0.1)
    z = _z(flow, n=4)
    _, jac = flow.inverse(z, method="jacobi", tol=1e-8)
    assert all(b.iterations < 16 for b in jac.stats["blocks"])
    _, gs = flow.inverse(z, method=GSJacobi(8), tol=1e-8)
    assert gs.stats["positions"] < jac.stats["positions"]
    # the work in chunks of the sampling maps: a Jacobi sweep computes both chunks (T=16, 8)
    assert jac.stats["chunks"] == 2 * jac.evaluations
    # a window is one chunk, plus per block one recomputed chunk (the keys of the first segment
    # were cached from the iterate before its last sweep, and positions < start are final now)
    # and one more for the block's final check, a full evaluation of both chunks
    assert gs.stats["chunks"] == gs.evaluations + 2 * 3


@pytest.mark.parametrize("tol", [1e-4, 1e-7])
def test_each_block_is_within_tol_of_its_exact_inverse(tol):
    """What converged=True promises, block by block: the value is within tol of the exact
    inverse of the input that block was given (re-solved here exactly)."""
    flow = _flow(scale=0.6)
    z = _z(flow, n=4)
    ref, _ = flow.inverse(z, method="sequential")
    for method in ("jacobi", "gs_jacobi", "sliding_jacobi", "jacobi_gs"):
        x, sol = flow.inverse(z, method=method, tol=tol)
        assert sol.converged
        h = patchify(z, 2)
        for k in reversed(range(3)):
            hk = h.flip(1) if k % 2 else h
            exact = paraprop.solve(flow.sampling_map(hk, k), torch.zeros_like(hk), dim=-2,
                                   method="sequential").value
            got = sol.stats["blocks"][k].value
            assert float((got - exact).abs().max()) <= tol, (method, k)
            h = got.flip(1) if k % 2 else got
        # the image: three blocks' errors, each grown by the inversions after it (the stated
        # bound of this model: K tol; measured up to 1.1 tol)
        assert float((x - ref).abs().max()) <= 3 * tol, method


def _expanding():
    """Large alpha (exp(alpha) up to ~100): each inverse multiplies an error at one patch by up
    to exp(alpha) at every later patch, and Jacobi's error plateaus before it drops."""
    flow = _flow(scale=1.5, alpha_bias=2.0, blocks=2)
    z = _z(flow, n=4) * 0.1
    h = patchify(z, 2)
    h1 = paraprop.solve(flow.sampling_map(h.flip(1), 1), torch.zeros_like(h), dim=-2,
                        method="sequential").value.flip(1)
    return flow, z, flow.sampling_map(h1, 0)


def test_expanding_blocks_are_exact_at_tol_0_and_at_the_bound():
    flow, z, f = _expanding()
    ref, _ = flow.inverse(z, method="sequential")
    assert float(ref.abs().max()) > 100  # the inverse expands
    for method in ("jacobi", "gs_jacobi", "sliding_jacobi"):
        x, sol = flow.inverse(z, method=method, tol=0)
        assert sol.converged and torch.equal(x, ref), method
    sol = paraprop.solve(f, f.x0, dim=-2, method="jacobi", tol=0)
    assert sol.iterations == 16 and sol.stats["error_estimate"] == 0.0


def test_expanding_block_stops_within_tol():
    """Found here: with the rate taken from two ratios, Jacobi stopped a sample whose step fell
    40x in one sweep (est 2.8e-5) while its error stayed at 3.1e-4 > tol (transient growth: the
    next step was 7x larger). The rule now takes the largest of the last three ratios."""
    _, _, f = _expanding()
    exact = paraprop.solve(f, f.x0, dim=-2, method="sequential").value
    sol = paraprop.solve(f, f.x0, dim=-2, method="jacobi", tol=1e-4)
    assert sol.converged
    assert float((sol.value - exact).abs().max()) <= 1e-4


def test_auto_ranks_blocks_and_caches_its_plan():
    flow = _flow(scale=0.1)
    plan = flow.calibrate(tol=1e-6)
    assert len(plan) == 3 and all(isinstance(m, Jacobi | GSJacobi) for m in plan)
    _, sol = flow.sample(2, method="auto", tol=1e-6, generator=torch.Generator().manual_seed(0))
    assert sol.method == "auto" and sol.converged
    key = next(iter(flow._plans))
    flow.sample(2, method="auto", tol=1e-6)
    assert list(flow._plans) == [key]                  # reused
    with torch.no_grad():
        flow.blocks[0].out.bias.add_(0.01)              # the weights changed: calibrate again
    flow.sample(2, method="auto", tol=1e-6)
    assert list(flow._plans) != [key]
    hard = _flow(scale=3.0, blocks=1)
    assert isinstance(hard.calibrate(tol=0)[0], GSJacobi)  # Jacobi needs all 16 sweeps
    identity = TarFlow(8, patch_size=2, blocks=2, layers=1, width=16, heads=2).double()
    assert all(isinstance(m, Jacobi) for m in identity.calibrate(tol=0))  # 2 sweeps
    assert all(isinstance(m, Jacobi) for m in hard.calibrate(tol=0, chunk=16))  # one chunk
    # tol > 0: the KV-cached loop (2 (T - 1) = 30) beats 16 Jacobi sweeps or GS-Jacobi here,
    # and the plan's images are the exact ones up to the cached loop's rounding
    assert hard.calibrate(tol=1e-6) == ["sequential_cached"]
    z = _z(hard, n=2)
    x, sol = hard.inverse(z, method="auto", tol=1e-6)
    exact, _ = hard.inverse(z, method="sequential", tol=0)
    assert sol.stats["methods"] == ["sequential_cached"] and sol.converged
    assert float((x - exact).abs().max()) <= 1e-9 * float(exact.abs().max())


def test_timed_plans_choose_among_the_candidates_and_stay_exact():
    """cost="time" (what "auto" uses) depends on the machine: check what cannot vary."""
    flow = _flow(scale=1.0)
    for tol in (0.0, 1e-6):
        plan = flow.calibrate(tol=tol, cost="time")
        assert all(isinstance(m, Jacobi | GSJacobi) or m == "sequential_cached" for m in plan)
        assert tol > 0 or "sequential_cached" not in plan    # tol=0 keeps the bits
    z = _z(flow, n=3)
    exact, _ = flow.inverse(z, method="sequential", tol=0)
    x, sol = flow.inverse(z, method="auto", tol=1e-6)
    assert sol.converged and float((x - exact).abs().max()) < 1e-5
    assert [k[2] for k in flow._plans] == [3]             # calibrated at the batch size
    with pytest.raises(ValueError, match="unknown cost='fast'; choose one of count, time"):
        flow.calibrate(cost="fast")


def test_sample_noise_generator_temperature_and_convergence_error():
    flow = _flow()
    g = torch.Generator().manual_seed(5)
    a, _ = flow.sample(2, method="jacobi", tol=0, generator=g)
    noise = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(5),
                        dtype=torch.float64)
    b, _ = flow.sample(2, method="jacobi", tol=0, noise=noise)
    c, _ = flow.inverse(noise * 0.5, method="jacobi", tol=0)
    d, _ = flow.sample(2, method="jacobi", tol=0, noise=noise, temperature=0.5)
    assert torch.equal(a, b) and torch.equal(c, d)
    with pytest.raises(paraprop.ConvergenceError, match="did not converge within max_iters=1"):
        flow.sample(2, method="jacobi", tol=0, max_iters=1, noise=noise)
    x, sol = flow.sample(2, method="jacobi", tol=0, max_iters=1, noise=noise, throw=False)
    assert not sol.converged and sol.iterations == 3


# -- the cached-prefix protocol ---------------------------------------------------------------
def test_window_cache_is_bitwise_and_robust():
    flow = _flow(blocks=1)
    z = patchify(_z(flow, n=3), 2)
    f = flow.sampling_map(z, 0, chunk=3)
    x = patchify(_z(flow, n=3, seed=2), 2)
    full = f(x)
    cache = None
    for start, stop in [(0, 4), (4, 9), (7, 12), (2, 5), (12, 16), (15, 16), (0, 16)]:
        vals, cache = f.window(x, start, stop, cache)   # (2, 5): start moved back
        assert torch.equal(vals, full[:, start:stop]), (start, stop)
        assert cache["chunks"] * 3 <= start + 1
    g = flow.sampling_map(z[:2], 0, chunk=3)          # another batch: the cache is not trusted
    assert torch.equal(g.window(x[:2], 8, 12, cache)[0], g(x[:2])[:, 8:12])


def test_sequential_cached_is_the_usual_loop():
    flow = _flow(torch.float32)
    z = patchify(_z(flow), 2)
    blk = flow.blocks[0]
    with torch.no_grad():
        x = sequential_cached(blk, z)
        back, _ = blk(x)
    assert float((back - z).abs().max()) <= 1e-5


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"image_size": 0}, r"image_size must be a positive int, got 0"),
    ({"channels": 1.5}, r"channels must be a positive int, got 1.5"),
    ({"patch_size": 3}, r"patch_size must divide image_size=8 into at least 2 patches per "
                        r"side, got patch_size=3"),
    ({"patch_size": 8}, r"patch_size must divide image_size=8 .*got patch_size=8"),
    ({"blocks": 0}, r"blocks must be a positive int, got 0"),
    ({"layers": -1}, r"layers must be a positive int, got -1"),
    ({"width": 30, "heads": 4}, r"width must be a multiple of heads=4, got width=30"),
    ({"heads": True}, r"heads must be a positive int, got True"),
    ({"noise_std": -0.1}, r"noise_std must be a finite number >= 0, got -0.1"),
    ({"seed": -1}, r"seed must be an int >= 0, got -1"),
])
def test_constructor_errors(kwargs, message):
    opts = {"image_size": 8, "patch_size": 2, "width": 16, "heads": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        TarFlow(**opts)


def test_method_names_are_the_librarys():
    """TarFlow's names are paraprop.solve's triangular methods (the set paraprop.flows takes),
    the model's own cached loop and "auto"; the default is solve's "jacobi", and each solve
    name runs the solver of that name on every block."""
    from paraprop.flows.part_solve import FLOW_METHODS
    from paraprop.solvers import METHODS, NEWTON_METHODS

    assert TARFLOW_METHODS == ("sequential_cached", *FLOW_METHODS, "auto")
    assert set(FLOW_METHODS) == set(METHODS) - set(NEWTON_METHODS)
    flow = _flow(blocks=2)
    z = _z(flow, n=2)
    x, sol = flow.inverse(z)
    xj, solj = flow.inverse(z, method="jacobi")
    assert torch.equal(x, xj) and sol.method == solj.method == "jacobi"
    assert sol.stats["methods"] == ["jacobi", "jacobi"]
    _, sol = flow.sample(2, noise=z)
    assert sol.method == "jacobi"
    for name in FLOW_METHODS:
        _, sol = flow.inverse(z, method=name, tol=0)
        assert sol.method == name and [b.method for b in sol.stats["blocks"]] == [name] * 2
    _, sol = flow.inverse(z, method=["sequential_cached", "jacobi"])
    assert sol.method == "per_block" and sol.stats["methods"] == ["sequential_cached", "jacobi"]


def test_sampling_errors():
    flow = _flow(blocks=2)
    z = _z(flow, n=2)
    cases = [
        (lambda: flow.inverse(z, method="newton"), ValueError,
         r"unknown method='newton'; choose one of sequential_cached, sequential, jacobi, "
         r"jacobi_gs, gs_jacobi, sliding_jacobi, anderson, auto"),
        (lambda: flow.inverse(z, method=["newton", "jacobi"]), ValueError,
         r"unknown method\[0\]='newton'"),
        (lambda: flow.inverse(z, method=["jacobi"]), ValueError,
         r"method must be one method per block \(2\), got a list of 1"),
        (lambda: flow.inverse(z, method=["jacobi", "auto"]), ValueError,
         r"unknown method\[1\]='auto'"),
        (lambda: flow.inverse(z, method=SlidingJacobi), TypeError, r"got the class"),
        (lambda: flow.inverse(z, method=paraprop.solvers.Newton()), ValueError,
         r"is not supported here"),
        (lambda: flow.inverse(z, method="sequential_cached", max_iters=3), ValueError,
         r"max_iters is not used by method='sequential_cached'"),
        (lambda: flow.inverse(z, tol=-1), ValueError, r"tol must be a number >= 0, got -1"),
        (lambda: flow.inverse(z, max_iters=0), ValueError, r"max_iters must be a positive int"),
        (lambda: flow.inverse(z, throw="yes"), TypeError, r"throw must be a bool, got 'yes'"),
        (lambda: flow.inverse(z[:, :, :4]), ValueError,
         r"z must have shape \(N, 1, 8, 8\), got \(2, 1, 4, 8\)"),
        (lambda: flow.inverse(z.float()), TypeError,
         r"z must have the model's dtype torch.float64, got torch.float32"),
        (lambda: flow(z.float()), TypeError, r"x must have the model's dtype"),
        (lambda: flow.sample(0), ValueError, r"n must be a positive int, got 0"),
        (lambda: flow.sample(2, temperature=0), ValueError,
         r"temperature must be a finite number > 0, got 0"),
        (lambda: flow.sample(3, noise=z), ValueError, r"noise must hold n=3 images, got 2"),
        (lambda: flow.sample(2, noise=z[:, :, :2]), ValueError, r"noise must have shape"),
        (lambda: flow.sampling_map(patchify(z, 2), 0, chunk=0), ValueError,
         r"chunk must be a positive int, got 0"),
        (lambda: flow.calibrate(samples=0), ValueError, r"samples must be a positive int"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=message):
            call()


def test_save_load_roundtrip(tmp_path):
    flow = _flow(torch.float32)
    flow.save(tmp_path / "f.pt")
    back = TarFlow.load(tmp_path / "f.pt")
    x = _z(flow, n=2)
    assert torch.equal(back.log_prob(x), flow.log_prob(x)) and not back.training
    with pytest.raises(FileNotFoundError, match="no such file"):
        TarFlow.load(tmp_path / "nothing.pt")
    paraprop.models.MADE(4, (8,)).save(tmp_path / "made.pt")
    with pytest.raises(ValueError, match="not a paraprop TarFlow checkpoint"):
        TarFlow.load(tmp_path / "made.pt")


# -- training ---------------------------------------------------------------------------------
def test_train_job_end_to_end(tmp_path, capsys):
    out = tmp_path / "t.pt"
    assert main(["train", "tarflow", "--data", "digits", "--epochs", "1", "--n", "32",
                 "--blocks", "2", "--layers", "1", "--width", "16", "--heads", "2",
                 "--out", str(out)]) == 0
    assert "trained TarFlow on digits" in capsys.readouterr().out
    assert out.exists() and out.with_suffix(".png").exists()
    flow = TarFlow.load(out)
    assert flow.T == 16 and len(flow.blocks) == 2


def test_trained_tarflow_reuses_its_checkpoint(tmp_path):
    kw = {"epochs": 1, "n": 16, "blocks": 1, "layers": 1, "width": 16, "heads": 2,
          "progress": False}
    flow, info = trained_tarflow("digits", out_dir=tmp_path, **kw)
    assert info["trained_now"] and len(info["loss"]) == 1 and math.isfinite(info["loss"][0])
    assert info["checkpoint"].endswith(checkpoint_name("digits", 1, n=16, blocks=1, layers=1,
                                                       width=16, heads=2))
    again, info2 = trained_tarflow("digits", out_dir=tmp_path, **kw)
    assert not info2["trained_now"] and info2["checkpoint"] == info["checkpoint"]
    x = _z(flow, n=2)
    assert torch.equal(again.log_prob(x), flow.log_prob(x))
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['depth'\]"):
        trained_tarflow("digits", out_dir=tmp_path, depth=3)
    with pytest.raises(ValueError, match="unknown data='cifar'"):
        trained_tarflow("cifar", out_dir=tmp_path)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: one intra-op thread (threads only add synchronisation here)."""
