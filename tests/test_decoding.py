"""paraprop.decoding.generate against transformers' generate (greedy, float64), against the
sequential path (sampling), and the processors against transformers' own warpers."""

from __future__ import annotations

import pytest
import torch

from paraprop import solvers
from paraprop.decoding import choose, generate, process_logits

transformers = pytest.importorskip("transformers")

V = 53


def _gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=96, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=96,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).double().eval()


MODELS = {"gpt2": _gpt2, "llama": _llama}


# tiny transformers: one intra-op thread is as fast, and immune to a busy machine
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def _prompts(B, P, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    if B > 1 and P > 1:   # left padding of different lengths
        mask[1, : P // 2] = 0
        mask[2 % B, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _hf(model, ids, mask, n, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None, **kw)


@pytest.mark.parametrize("P", [1, 5, 17])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("n", [1, 7, 40])
def test_greedy_equals_generate(model, P, B, n):
    ids, mask = _prompts(B, P)
    ref = _hf(model, ids, mask, n)
    for method in ("jacobi", "gs_jacobi", "sequential"):
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=n, method=method,
                            pad_token_id=0)
        assert out.shape == ref.shape
        assert torch.equal(out, ref), method
        assert sol.converged and sol.stats["new_tokens"] == n
        # never more decoding passes than tokens (each pass accepts at least one); GS-Jacobi
        # may add one verifying pass per block
        blocks = -(-n // min(16, n))
        assert sol.stats["decode_calls"] <= n + (blocks if method == "gs_jacobi" else 0)


def test_greedy_windows_and_guesses(model):
    ids, mask = _prompts(3, 6)
    ref = _hf(model, ids, mask, 30)
    for kw in ({"window": 1}, {"window": 5}, {"window": 30}, {"ngram": 0}, {"ngram": 1},
               {"method": solvers.SlidingJacobi(7)}, {"method": solvers.GSJacobi(4)}):
        out, _ = generate(model, ids, attention_mask=mask, max_new_tokens=30, pad_token_id=0,
                          **kw)
        assert torch.equal(out, ref), kw


def test_eos_in_the_middle(model):
    ids, mask = _prompts(3, 5)
    free = _hf(model, ids, mask, 20)
    eos = int(free[0, 5 + 6])         # sample 0 emits this token at its 7th new position
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         pad_token_id=0, eos_token_id=eos)
    for method in ("jacobi", "sequential"):
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=20, method=method,
                            eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref), method
    row = out[0, 5:].tolist()
    k = row.index(eos)
    assert all(t == 0 for t in row[k + 1 :])   # pad after EOS, as generate does


def test_all_samples_end_early_returns_shorter():
    m = _gpt2()
    ids, mask = _prompts(1, 4)
    free = _hf(m, ids, mask, 30)
    eos = int(free[0, 4 + 3])
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                     pad_token_id=0, eos_token_id=eos)
    out, sol = generate(m, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos,
                        pad_token_id=0)
    assert torch.equal(out, ref)
    assert out.shape[1] < 4 + 30
    assert sol.stats["new_tokens"] == out.shape[1] - 4


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.8},
                                {"temperature": 1.3, "top_k": 10, "top_p": 0.9}])
def test_sampling_equals_sequential(model, kw):
    ids, mask = _prompts(3, 5)
    outs = []
    for method in ("sequential", "jacobi", "gs_jacobi"):
        g = torch.Generator().manual_seed(7)
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=25, do_sample=True,
                            generator=g, method=method, pad_token_id=0, **kw)
        outs.append(out)
        assert sol.converged
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # the noise decides the sample: another seed gives another one
    g = torch.Generator().manual_seed(8)
    other, _ = generate(model, ids, attention_mask=mask, max_new_tokens=25, do_sample=True,
                        generator=g, pad_token_id=0, **kw)
    assert not torch.equal(other, outs[0]) or kw.get("top_k") == 1


def test_sampling_with_given_noise_and_adversarial_guesses(model, monkeypatch):
    """Guesses that are always wrong (the map's propose returns junk) cost passes, not
    exactness."""
    ids, mask = _prompts(2, 4)
    u = torch.rand(2, 20, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref, _ = generate(model, ids, attention_mask=mask, max_new_tokens=20, do_sample=True,
                      noise=u, method="sequential", pad_token_id=0)
    from paraprop.decoding import decode

    monkeypatch.setattr(decode._TokenMap, "propose",
                        lambda self, x, final: torch.full_like(x, float(V - 1)))
    out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=20, do_sample=True,
                        noise=u, pad_token_id=0)
    assert torch.equal(out, ref)
    assert sol.stats["decode_calls"] <= 20


def test_processors_match_transformers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g, dtype=torch.float64) * 3
    logits[0, :5] = 4.0                # ties at the top-k edge
    for t, k, p in [(1.0, None, None), (0.6, None, None), (1.0, 7, None), (1.0, None, 0.7),
                    (1.4, 12, 0.85), (0.9, 1, 0.5), (1.0, 3, 1e-6), (1.0, 40, 1.0)]:
        ref = logits.to(torch.float32)
        if t != 1.0:
            ref = TemperatureLogitsWarper(t)(None, ref)
        if k is not None:
            ref = TopKLogitsWarper(k)(None, ref)
        if p is not None:
            ref = TopPLogitsWarper(p)(None, ref)
        ours = process_logits(logits, temperature=t, top_k=k, top_p=p)
        assert torch.equal(ours, ref), (t, k, p)


def test_inverse_cdf_draw_has_the_processed_distribution():
    scores = process_logits(torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]]), top_k=3)
    probs = scores.softmax(-1)[0].double()
    u = (torch.arange(200000, dtype=torch.float64) + 0.5) / 200000   # a uniform grid
    tok = choose(scores.expand(u.numel(), -1), u)
    freq = torch.bincount(tok, minlength=5).double() / u.numel()
    assert torch.allclose(freq, probs, atol=1e-4)
    assert freq[2] == 0 and freq[3] == 0                          # filtered tokens never drawn


class _TupleCacheLM(torch.nn.Module):
    """A one-layer causal attention LM with a legacy tuple cache: the contract without
    transformers."""

    def __init__(self, vocab=V, d=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(128, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, vocab)

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        L0 = 0 if past_key_values is None else past_key_values[0][0].shape[-2]
        pos = torch.arange(L0, L0 + input_ids.shape[1])
        h = self.emb(input_ids) + self.pos(pos)
        q, k, v = self.qkv(h)[:, None].chunk(3, dim=-1)
        if past_key_values is not None:
            k = torch.cat([past_key_values[0][0], k], dim=-2)
            v = torch.cat([past_key_values[0][1], v], dim=-2)
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(L0)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(h + a[:, 0]), ((k, v),)


def test_any_module_with_the_cache_contract():
    torch.manual_seed(0)
    m = _TupleCacheLM().double().eval()
    ids = torch.randint(0, V, (2, 6))
    ref, _ = generate(m, ids, max_new_tokens=30, method="sequential")
    # the sequential reference is a plain loop without a cache
    seq = ids
    with torch.no_grad():
        for _ in range(30):
            logits, _ = m(seq, None)
            seq = torch.cat([seq, logits[:, -1].float().argmax(-1, keepdim=True)], 1)
    assert torch.equal(ref, seq)
    out, sol = generate(m, ids, max_new_tokens=30, window=8)
    assert torch.equal(out, ref) and sol.converged


def test_errors(model):
    ids, mask = _prompts(3, 5)
    with pytest.raises(TypeError, match="cache contract"):
        generate(torch.nn.Linear(3, 3), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
        generate(model, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="window must be at most max_new_tokens=4, got window=9"):
        generate(model, ids, max_new_tokens=4, window=9)
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids"):
        generate(model, ids, max_new_tokens=4, attention_mask=mask[:, :4])
    with pytest.raises(ValueError, match="pad prompts on the left"):
        generate(model, ids, max_new_tokens=4, attention_mask=mask.flip(1))
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        generate(model, ids.double(), max_new_tokens=4)
    with pytest.raises(ValueError, match="pass do_sample=True"):
        generate(model, ids, max_new_tokens=4, top_k=3)
    with pytest.raises(ValueError, match="top_p must be a number in"):
        generate(model, ids, max_new_tokens=4, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be"):
        generate(model, ids, max_new_tokens=4, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match=r"noise must be a float tensor of shape \(3, 4\)"):
        generate(model, ids, max_new_tokens=4, do_sample=True, noise=torch.rand(3, 5))
    with pytest.raises(ValueError, match="unknown method"):
        generate(model, ids, max_new_tokens=4, method="newton")
    with pytest.raises(ValueError, match="not supported by decoding"):
        generate(model, ids, max_new_tokens=4, method=solvers.Jacobi())


def test_cached_lm_never_serves_a_stale_entry():
    """CachedLM against a full pass without a cache, while tokens change under it and the
    requested ranges jump back and forth (the cases a solver may produce)."""
    from paraprop.decoding.lm import CachedLM

    model = _gpt2()
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(3, V, (2, 30), generator=g)
    lm = CachedLM(model, tokens, None)
    with torch.no_grad():
        for a, b, change in [(4, 10, None), (10, 16, None), (12, 20, 11), (5, 9, None),
                             (18, 30, 25), (0, 30, 3), (29, 30, None)]:
            if change is not None:
                tokens[:, change] = torch.randint(3, V, (2,), generator=g)
            ref = model(tokens).logits[:, a:b]
            got = lm.logits(a, b)
            assert torch.allclose(got, ref, atol=1e-10, rtol=0), (a, b)
    assert lm.fed < 30 * lm.calls     # the cache was used
