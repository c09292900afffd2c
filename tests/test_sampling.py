"""Parallel sampling returns the ancestral sample (the flow libraries: test_flows_accelerate.py)."""

import math

import pytest
import torch

import paraprop
from paraprop.models import MADE
from paraprop.sampling import sample
from paraprop.solve import solve
from paraprop.solvers import GSJacobi, JacobiGS, SlidingJacobi
from paraprop_lab.cli import main
from problems import TOLERANCES

CONDITIONALS = ["logistic", "gaussian", "bernoulli"]
METHODS = [("jacobi", None), ("jacobi_gs", 5), ("gs_jacobi", 7), ("sliding_jacobi", 4),
           ("fixed_passes", None)]
SOLVER = {"jacobi_gs": JacobiGS, "gs_jacobi": GSJacobi, "sliding_jacobi": SlidingJacobi}


def _method(name, size):
    return name if size is None else SOLVER[name](size)


def _made(cond, dtype=torch.float64, order=True, seed=0, device="cpu"):
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(seed)) if order else None
    return MADE(24, (48, 48), conditional=cond, order=perm, seed=seed).to(device=device,
                                                                          dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cond", CONDITIONALS)
@pytest.mark.parametrize(("method", "bs"), METHODS)
def test_every_method_returns_the_ancestral_sample(cond, method, bs, dtype, device):
    m = _made(cond, dtype, device=device)
    noise = m.draw_noise(6, torch.Generator().manual_seed(1))
    ref, seq = sample(m, 6, method="sequential", noise=noise)
    assert seq.evaluations == 24
    x, sol = sample(m, 6, method=_method(method, bs), noise=noise, tol=0)
    # the ancestral sampler's update computes the same chunks of the output layer as the full
    # map (a row subset would round differently on AVX-512 machines): bitwise, every dtype
    assert sol.converged and torch.equal(x, ref)
    # and the sequential solve that evaluates the full map gives the same bits
    system = m.sampling_map(noise)
    full = solve(lambda z: system(z), system.x0, method="sequential", dim=system.dim)
    assert torch.equal(x, system.to_data(full.value))


def test_bernoulli_samples_are_binary_and_jacobi_is_fast():
    m = _made("bernoulli", order=False)
    x, sol = sample(m, 50, generator=torch.Generator().manual_seed(0), tol=0)
    assert set(x.unique().tolist()) <= {0.0, 1.0}
    assert sol.iterations < 24


def test_same_generator_seed_same_sample_and_per_sample_stopping():
    tols = TOLERANCES[torch.float64]
    m = _made("logistic")
    a, sa = sample(m, 8, tol=tols["solve_tol"], generator=torch.Generator().manual_seed(3))
    b, _ = sample(m, 8, method=GSJacobi(block_size=6), tol=tols["solve_tol"],
                  generator=torch.Generator().manual_seed(3))
    assert (a - b).abs().max() <= tols["max_err"]
    it = sa.stats["sample_iterations"]
    assert it.shape == (8,) and int(it.max()) == sa.iterations
    assert len(set(it.tolist())) > 1  # the samples of this batch stop at different iterations
    # each sample is frozen once it stops; the frozen values are still the ancestral sample
    ref, _ = sample(m, 8, method="sequential", generator=torch.Generator().manual_seed(3))
    assert (a - ref).abs().max() <= tols["max_err"]


def _device_checking(fn):
    """Emulate CUDA's refusal of a generator on another device (meta has no such check)."""
    def wrapped(*args, generator=None, device=None, **kw):
        gdev = (generator.device if generator is not None else torch.device("cpu")).type
        if torch.device(device or "cpu").type != gdev:
            raise RuntimeError(f"generator on {gdev}, tensor on {device}")
        return fn(*args, generator=generator, device=device, **kw)
    return wrapped


@pytest.mark.parametrize("cond", CONDITIONALS)
def test_noise_is_drawn_on_the_generator_device_then_moved(cond, monkeypatch):
    expected = _made(cond).draw_noise(3, torch.Generator().manual_seed(5))
    assert expected.dtype == torch.float64  # follows the model
    monkeypatch.setattr(torch, "rand", _device_checking(torch.rand))
    monkeypatch.setattr(torch, "randn", _device_checking(torch.randn))
    noise = _made(cond).to("meta").draw_noise(3, torch.Generator().manual_seed(5))
    assert noise.device.type == "meta" and noise.dtype == torch.float64
    assert noise.shape == expected.shape


def test_log_prob_matches_torch_distributions():
    x = torch.rand(5, 24, dtype=torch.float64)
    for cond in CONDITIONALS:
        m = _made(cond)
        xx = (x > 0.5).double() if cond == "bernoulli" else x
        p = m.conditional_params(xx)
        if cond == "bernoulli":
            expected = torch.distributions.Bernoulli(logits=p["logits"]).log_prob(xx).sum(-1)
        elif cond == "gaussian":
            expected = torch.distributions.Normal(p["loc"], p["log_scale"].exp()).log_prob(xx)
            expected = expected.sum(-1)
        else:
            base = torch.distributions.Uniform(torch.zeros_like(xx), torch.ones_like(xx))
            logistic = torch.distributions.TransformedDistribution(base, [
                torch.distributions.transforms.SigmoidTransform().inv,
                torch.distributions.transforms.AffineTransform(p["loc"], p["log_scale"].exp())])
            expected = logistic.log_prob(xx).sum(-1)
        assert torch.allclose(m.log_prob(xx), expected, atol=1e-10), cond


def test_made_is_autoregressive_in_its_order():
    m = _made("gaussian")
    x = torch.randn(1, 24, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda v: m.conditional_params(v)["loc"], x)[0, :, 0]
    # output i may depend on input j only if j comes earlier in the order
    allowed = m.order[None, :] < m.order[:, None]
    assert torch.all(J[~allowed] == 0) and J[allowed].abs().sum() > 0


def test_broken_masks_are_detected():
    m = _made("logistic", order=False)
    with torch.no_grad():
        m.out.mask.fill_(1.0)  # every output sees every input: not autoregressive
    with pytest.raises(paraprop.NotTriangularError, match="depends on itself or on a later"):
        sample(m, 4, generator=torch.Generator().manual_seed(0), tol=0)


def test_bad_arguments():
    m = _made("logistic")
    with pytest.raises(ValueError, match=r"noise must have shape \(4, 24\) for n=4, got \(4, 23\)"):
        sample(m, 4, noise=torch.zeros(4, 23, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown method='newton'"):
        sample(m, 4, method="newton")
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        sample(m, 0)
    with pytest.raises(ValueError, match="unknown conditional='poisson'"):
        MADE(4, (8,), conditional="poisson")
    with pytest.raises(ValueError,
                       match=r"order must be a permutation of 0..3, got \[0, 0, 1, 2\]"):
        MADE(4, (8,), order=[0, 0, 1, 2])
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"features must be a positive int, got {bad!r}"):
            MADE(bad, (8,))
    with pytest.raises(ValueError, match="max_iters is not used by method='fixed_passes'"):
        sample(m, 4, method="fixed_passes", max_iters=3)
    from paraprop_lab.training.made import train_made

    with pytest.raises(ValueError, match="epochs and batch_size must be >= 1, got 0, 100"):
        train_made(m, torch.zeros(2, 24, dtype=torch.float64), epochs=0)
    with pytest.raises(ValueError, match="hidden must be a non-empty tuple"):
        MADE(4, ())
    with pytest.raises(ValueError, match=r"x must have shape \(N, 24\), got \(3, 5\)"):
        m.log_prob(torch.zeros(3, 5))


def test_checkpoint_round_trip(tmp_path):
    m = _made("gaussian", torch.float32)
    m.save(tmp_path / "m.pt")
    m2 = MADE.load(tmp_path / "m.pt")
    x = torch.randn(3, 24)
    assert torch.equal(m.log_prob(x), m2.log_prob(x))
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a paraprop MADE checkpoint"):
        MADE.load(tmp_path / "other.pt")


def test_train_made_cli(tmp_path, capsys):
    out = tmp_path / "made.pt"
    assert main(["train", "made", "--data", "digits", "--epochs", "2", "--hidden", "32", "32",
                 "--out", str(out)]) == 0
    assert "NLL" in capsys.readouterr().out
    m = MADE.load(out)
    assert m.features == 64
    x, sol = sample(m, 5, generator=torch.Generator().manual_seed(0))
    assert sol.converged and math.isfinite(float(x.sum()))


def test_bench_made_quick(tmp_path):
    from paraprop_lab.bench import made

    payload = made.run(tmp_path, quick=True, repeats=1)
    rows = {r["method"]: r for r in payload["digits"]["rows"]}
    assert rows["jacobi (online stop)"]["max_abs_err"] <= 1e-4
    # D full passes reach the fixed point of the full map; the reference is the row-subset
    # ancestral sampler, which a BLAS kernel may round differently (float32 here)
    assert rows["fixed D passes"]["max_abs_err"] <= TOLERANCES[torch.float32]["max_err"]
    assert all(r["bitwise equal"] for r in payload["flows"])
    assert (tmp_path / "made.md").exists() and (tmp_path / "made_digits_samples.png").exists()
