"""The Gumbel-max coupling of paraprop.decoding.generate (``coupling="gumbel"``): the counter-based
noise (SplitMix64 bits, a function of its indices only), the processed distribution (a
chi-square test that a wrong temperature fails), and the parallel methods against the coupling's
own sequential loop, bit for bit, in float64 and float32 (there up to an uncertified position,
reported), batches, EOS and generation configs."""

from __future__ import annotations

import random
import re

import pytest
import torch

from paraprop.decoding import generate, gumbel, process_logits

transformers = pytest.importorskip("transformers")

from test_decoding import MODELS, V, make, prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=sorted(MODELS))
def name(request):
    return request.param

_MASK = (1 << 64) - 1


def _splitmix_reference(x: int) -> int:
    """SplitMix64's output function on Python integers (unsigned, masked)."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def test_the_hash_is_splitmix64_bit_for_bit():
    rng = random.Random(0)
    xs = [rng.getrandbits(64) for _ in range(2000)] + [0, 1, _MASK, 1 << 63, (1 << 63) - 1]
    got = gumbel.mix64(torch.tensor([_signed(x) for x in xs], dtype=torch.int64)).tolist()
    assert [g & _MASK for g in got] == [_splitmix_reference(x) for x in xs]
    # SplitMix64's published first output for the seed 1234567
    assert _splitmix_reference(1234567 + 0x9E3779B97F4A7C15) == 6457827717110365317


def test_the_noise_is_a_function_of_its_indices_only():
    full = gumbel.GumbelNoise(7, 5, "cpu").window(0, 12, 9)
    assert full.shape == (5, 12, 9) and full.dtype == torch.float64
    # a window of positions, a smaller batch: the same bits as the full table's slice
    assert torch.equal(gumbel.GumbelNoise(7, 5, "cpu").window(4, 9, 9), full[:, 4:9])
    assert torch.equal(gumbel.GumbelNoise(7, 2, "cpu").window(0, 12, 9), full[:2])
    # the kept blocks (here 2 positions of 5 x 9 values): one position at a time, windows
    # across a block's end, a window starting before the kept block
    noise = gumbel.GumbelNoise(7, 5, "cpu")
    noise.BLOCK = 90
    assert torch.equal(torch.cat([noise.window(t, t + 1, 9) for t in range(12)], 1), full)
    for a, b in ((3, 7), (5, 6), (0, 12), (11, 12), (2, 3)):
        assert torch.equal(noise.window(a, b, 9), full[:, a:b]), (a, b)
    assert torch.equal(noise.compute(0, 12, 9), full)
    other = gumbel.GumbelNoise(8, 5, "cpu").window(0, 12, 9)
    assert not bool((other == full).any())                  # another key: other noise
    assert bool((full[0] != full[1]).all()) and bool((full[:, 0] != full[:, 1]).all())
    # the extreme hashes give uniforms strictly inside (0, 1), so finite noise
    u = gumbel.uniforms(torch.tensor([0, -1, 1 << 62, -(1 << 63)], dtype=torch.int64))
    assert bool(((u > 0) & (u < 1)).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_the_noise_is_standard_gumbel():
    g = gumbel.GumbelNoise(3, 64, "cpu").window(0, 64, 64).flatten()      # 262,144 draws
    n = g.numel()
    # mean: the Euler-Mascheroni constant; variance pi^2 / 6 (4 standard errors)
    assert abs(float(g.mean()) - 0.5772156649) < 4 * (torch.pi ** 2 / 6 / n) ** 0.5
    assert abs(float(g.var()) - torch.pi ** 2 / 6) < 0.03
    u = torch.exp(-torch.exp(-g))                               # back to the uniforms
    hist = torch.histc(u, bins=20, min=0, max=1) / n
    assert float((hist - 0.05).abs().max()) < 0.003


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom over the entries of positive probability;
    an observed token of probability 0 makes it infinite."""
    n = float(counts.sum())
    keep = probs > 0
    if bool((counts[~keep] > 0).any()):
        return float("inf"), int(keep.sum()) - 1
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def _quantile(df: int) -> float:
    scipy_stats = pytest.importorskip("scipy.stats")
    return float(scipy_stats.chi2.ppf(0.999, df))


def test_the_argmax_has_the_processed_distribution_and_a_wrong_temperature_fails():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0, 0.5, -0.5])
    for temperature, top_k in ((0.8, None), (0.8, 4), (1.5, None)):
        scores = process_logits(logits, temperature=temperature, top_k=top_k)
        noise = gumbel.GumbelNoise(11, 100, "cpu").window(0, 200, logits.numel())
        tok, _ = gumbel.perturbed_top(scores.expand(100, 200, -1), noise, margins=False)
        counts = torch.bincount(tok.flatten(), minlength=logits.numel()).double()
        probs = scores.softmax(-1).double()
        stat, df = _chi2(counts, probs)
        assert stat < _quantile(df), (temperature, top_k, stat)
        # the same draws against the distribution at another temperature: rejected
        wrong = process_logits(logits, temperature=temperature * 1.25, top_k=top_k)
        stat, df = _chi2(counts, wrong.softmax(-1).double())
        assert stat > _quantile(df), (temperature, top_k, stat)


def test_generate_samples_the_processed_distribution():
    """Through ``generate``: 1500 samples of one prompt (each sample its own noise) against the
    processed distribution of the model's first new position; a wrong temperature (x1.25) is
    rejected."""
    model = make("gpt2", "cpu", fresh=True, vocab=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)      # less flat (every expected count still above 30)
    B = 1500
    ids = torch.tensor([[3, 5, 4, 6]]).repeat(B, 1)
    kw = dict(max_new_tokens=1, do_sample=True, temperature=0.7, top_k=0, eos_token_id=[],
              coupling="gumbel", method="sequential")
    out, _ = generate(model, ids, generator=torch.Generator().manual_seed(0), **kw)
    with torch.no_grad():
        logits = model(ids[:1]).logits[0, -1]
    counts = torch.bincount(out[:, -1], minlength=8).double()
    stat, df = _chi2(counts, process_logits(logits, temperature=0.7).softmax(-1).double())
    assert stat < _quantile(df), stat
    probs = process_logits(logits, temperature=0.7).softmax(-1)
    assert float(probs.min()) * B > 30 and float(probs.max()) < 0.7
    stat, df = _chi2(counts, process_logits(logits, temperature=0.875).softmax(-1).double())
    assert stat > _quantile(df), stat


SETTINGS = [
    {"temperature": 0.8, "top_k": 0},
    {"temperature": 0.8, "top_k": 10, "top_p": 0.9},
    {"temperature": 1.2, "min_p": 0.05, "repetition_penalty": 1.3, "eos_token_id": [5]},
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_parallel_methods_give_the_sequential_loops_tokens(device, name, dtype, B, setting):
    """float64: certified and the sequential loop's tokens. float32: the bound (4 times the
    rounding measured on a trained model) is wider than some cuts of these flat random
    distributions (the top-k cut among 53 random logits): each sample's tokens are the
    sequential ones up to its first uncertified position, each uncertified one is reported with
    its margin below the bound (a few per sample at most), and a certified run is the
    sequential loop's whole."""
    model = make(name, device, dtype)
    ids, mask = prompts(B, 5, device=device)
    kw = dict(max_new_tokens=24, do_sample=True, attention_mask=mask, coupling="gumbel",
              **{"eos_token_id": [], **SETTINGS[setting]})
    for seed in (0, 1):
        ref, rs = generate(model, ids, method="sequential",
                           generator=torch.Generator().manual_seed(seed), **kw)
        assert rs.stats["coupling"] == "gumbel"
        assert rs.stats["model_calls"] == 24 or kw["eos_token_id"]    # EOS may end it sooner
        for method in ("jacobi", "gs_jacobi"):
            out, sol = generate(model, ids, method=method, window=8, throw=False,
                                generator=torch.Generator().manual_seed(seed), **kw)
            where = sol.stats["uncertified"]
            assert sol.converged == (where == []), (method, seed)
            if dtype == torch.float64 or sol.converged:
                assert sol.converged and sol.stats["margin_ratio"] > 1, (method, seed)
                assert torch.equal(out, ref), (method, seed)
                continue
            assert len(where) <= 4 * B, (method, seed, where)   # seen: at most 2 per sample
            assert re.search(r"decided by a margin of 0\.\d+ times the bound .* in "
                             r"torch\.float32", sol.stats["uncertified_cause"]), (method, seed)
            first = {b: min(t for c, t in where if c == b) for b, _ in where}
            for b in range(B):
                t0 = first.get(b, 24)
                assert torch.equal(out[b, 5 : 5 + t0], ref[b, 5 : 5 + t0]), (method, seed, b)


def test_with_eos_and_a_generation_config(device, name):
    """EOS in the middle of the samples and settings from a ``generation_config`` (with the
    model's own generation_config underneath)."""
    model = make(name, device, fresh=True)
    model.generation_config.repetition_penalty = 1.2
    cfg = transformers.GenerationConfig(do_sample=True, temperature=0.8, top_k=20,
                                        no_repeat_ngram_size=3, eos_token_id=[7, 9],
                                        pad_token_id=0)
    ids, mask = prompts(3, 6, seed=4, device=device)
    ended = 0
    for seed in range(4):
        kw = dict(max_new_tokens=30, attention_mask=mask, generation_config=cfg,
                  coupling="gumbel")
        ref, _ = generate(model, ids, method="sequential",
                          generator=torch.Generator().manual_seed(seed), **kw)
        out, sol = generate(model, ids, generator=torch.Generator().manual_seed(seed), **kw)
        assert sol.converged and torch.equal(out, ref), seed
        assert sol.stats["processors"][:2] == ["RepetitionPenaltyLogitsProcessor",
                                               "NoRepeatNGramLogitsProcessor"]
        ended += int(torch.isin(ref[:, 6:], torch.tensor([7, 9], device=device)).any(1).sum())
    assert ended > 0                         # EOS did end some samples


def test_the_key_comes_from_the_generator_and_the_couplings_differ(device):
    model = make("gpt2", device)
    ids, mask = prompts(2, 4, device=device)
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, eos_token_id=[])
    a, _ = generate(model, ids, coupling="gumbel", generator=torch.Generator().manual_seed(5),
                    **kw)
    b, _ = generate(model, ids, coupling="gumbel", generator=torch.Generator().manual_seed(5),
                    **kw)
    c, _ = generate(model, ids, coupling="gumbel", generator=torch.Generator().manual_seed(6),
                    **kw)
    d, _ = generate(model, ids, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)
    # the key is drawn on the generator's device: a CPU generator gives the CPU sample
    cpu, _ = generate(make("gpt2", "cpu"), ids.cpu(), coupling="gumbel",
                      generator=torch.Generator().manual_seed(5),
                      **{**kw, "attention_mask": mask.cpu()})
    assert torch.equal(cpu, a.cpu())


def test_the_margin_flags_the_decisions_a_small_change_flips():
    """The Gumbel margin against brute force: logits moved within the bound flip only
    decisions whose ratio is at most 1."""
    from paraprop.decoding import settings as st
    from paraprop.decoding.processors import Pipeline

    g = torch.Generator().manual_seed(0)
    model = make("gpt2", "cpu")
    R = 512
    tokens = torch.randint(3, V, (R, 8), generator=g)
    noise = gumbel.GumbelNoise(1, R, "cpu").window(0, 1, V)
    for explicit in ({"temperature": 0.8, "top_k": 0}, {"top_k": 6}, {"top_p": 0.7},
                     {"min_p": 0.2, "temperature": 0.8, "top_k": 0}):
        s = st.resolve(model, 8, {**explicit, "do_sample": True, "max_new_tokens": 1,
                                  "eos_token_id": []}, None)
        factor = 2e-3
        pipe = Pipeline(s, 8, None, "cpu", factor, "gumbel")
        logits = torch.randn(R, 1, V, generator=g) * 2
        tok, ratio, cause = pipe.decide(logits, tokens, 0, None, noise=noise)
        assert bool((cause >= 0).all()) and int(cause.max()) < len(pipe.criteria())
        delta = factor * logits.abs().amax(-1, keepdim=True)
        moved = torch.zeros(R, dtype=torch.bool)
        for _ in range(100):
            shake = (torch.rand(logits.shape, generator=g) * 2 - 1) * delta
            moved |= (pipe.decide(logits + shake, tokens, 0, None, noise=noise)[0] != tok)[:, 0]
        assert bool(moved.any()) and bool((ratio[moved, 0] <= 1).all()), explicit
        assert bool((ratio[:, 0] > 1).any()), explicit
    assert pipe.criteria()[0].startswith("the gap between the best and the second-best perturbed")


def test_adversarial_guesses_cost_passes_not_exactness(monkeypatch):
    model = make("llama", "cpu")
    ids, mask = prompts(2, 4)
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=True, coupling="gumbel")
    ref, _ = generate(model, ids, method="sequential",
                      generator=torch.Generator().manual_seed(2), **kw)
    from paraprop.decoding import token_map

    monkeypatch.setattr(token_map.TokenMap, "propose",
                        lambda self, x, final: torch.full_like(x, float(V - 1)))
    out, sol = generate(model, ids, generator=torch.Generator().manual_seed(2), **kw)
    assert torch.equal(out, ref) and sol.converged
    assert sol.stats["model_calls"] <= 20


def test_errors():
    model = make("gpt2", "cpu")
    ids = torch.randint(3, V, (2, 5))
    with pytest.raises(ValueError, match="coupling must be one of 'inverse_cdf', 'gumbel', "
                                         "got 'gumble'"):
        generate(model, ids, max_new_tokens=4, do_sample=True, coupling="gumble")
    with pytest.raises(ValueError, match=r"coupling='gumbel' applies to sampling; pass "
                                         r"do_sample=True"):
        generate(model, ids, max_new_tokens=4, do_sample=False, coupling="gumbel")
    with pytest.raises(ValueError, match="coupling='gumbel' computes its noise per vocabulary "
                                         "entry.*pass generator instead of noise"):
        generate(model, ids, max_new_tokens=4, do_sample=True, coupling="gumbel",
                 noise=torch.rand(2, 4, dtype=torch.float64))


def test_a_top_k_cut_within_the_bound_is_moot_only_where_it_cannot_change_the_decision():
    """(review s36) Under the Gumbel coupling with top-k alone, swapping the k-th and the
    (k+1)-th token of a cut within the rounding bound changes the argmax only if the chosen
    token could leave the set or the token that could enter could beat it."""
    from paraprop.decoding.processors import _cut_moot

    k = 2
    scores = torch.tensor([[[5.0, 1.0, 0.999, -3.0]]])          # cut between 1.0 and 0.999
    kept = torch.tensor([[[5.0, 1.0, -torch.inf, -torch.inf]]])
    delta2 = torch.tensor([[0.01]])
    quiet = torch.tensor([[[0.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    # the chosen token (0) is far from the cut and the entrant (2) far below its perturbed score
    assert bool(_cut_moot(scores, kept, torch.tensor([[0]]), quiet, delta2, k))
    # the entrant's noise lifts it within the bound of the chosen one: it could win there
    loud = torch.tensor([[[0.0, 0.0, 4.005, 0.0]]], dtype=torch.float64)
    assert not bool(_cut_moot(scores, kept, torch.tensor([[0]]), loud, delta2, k))
    # the chosen token is the one at the cut: it may leave the set in the other pass
    assert not bool(_cut_moot(scores, kept, torch.tensor([[1]]), quiet, delta2, k))
    # a token far below the cut cannot enter, whatever its noise
    far = torch.tensor([[[0.0, 0.0, 0.0, 100.0]]], dtype=torch.float64)
    assert bool(_cut_moot(scores, kept, torch.tensor([[0]]), far, delta2, k))
