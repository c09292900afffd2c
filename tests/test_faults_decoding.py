"""Fault tests for decoding (issue 27): each class of defect with cases built here, on other
models and settings than the issue's.

1. a generation setting ignored silently (the model's generation_config, other models);
2. a setting that is not implemented, accepted instead of refused by name;
3. a stochastic model (train mode with dropout) accepted; randomness that no up-front check
   sees (router jitter, a custom random layer, tiny noise) certified (converged=True);
4. low precision: a token that may differ from generate's reported as certified;
5. cryptic errors: sliding-window attention, encoder-decoder models, positions beyond the
   model's, token ids outside the vocabulary, a cache that cannot be cut back, left padding
   for a model without position_ids (Bloom: supported) or without attention_mask (refused);
6. a certificate failure blamed on the wrong cause (rounding, "use a float32 model") where it
   is the model's non-finite logits, an exact tie, or a setting's cut.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from paraprop import ConvergenceError, StochasticModelError
from paraprop.decoding import generate
from paraprop.decoding.lm import cache_keyword

transformers = pytest.importorskip("transformers")

from test_decoding import V, _TupleCacheLM, hf, make, prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _small(cls_config, cls_model, seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return cls_model(cls_config(**{**base, **kw})).double().eval()


def _qwen2(**kw):
    return _small(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, **kw)


def _mistral(**kw):
    return _small(transformers.MistralConfig, transformers.MistralForCausalLM, **kw)


def _neox(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=96, bos_token_id=1, eos_token_id=2,
                                     pad_token_id=0)
    return transformers.GPTNeoXForCausalLM(cfg).double().eval()


# 1. a pretrained model's generation_config, as it ships: honoured, as generate honours it
@pytest.mark.parametrize("build", [_qwen2, _neox, lambda: _mistral(sliding_window=64)],
                         ids=["qwen2", "gpt-neox", "mistral"])
def test_the_models_generation_config_is_honoured(build):
    model = build()
    ids, mask = prompts(3, 6)
    shipped = dict(repetition_penalty=1.25, no_repeat_ngram_size=3, suppress_tokens=[4, 6],
                   bad_words_ids=[[8, 9]], min_new_tokens=3, max_new_tokens=18)
    for k, v in shipped.items():
        setattr(model.generation_config, k, v)
    ref = model.generate(ids, attention_mask=mask)           # what the user compares with
    out, sol = generate(model, ids, attention_mask=mask)
    assert torch.equal(out, ref) and sol.converged
    assert sol.stats["processors"] == ["RepetitionPenaltyLogitsProcessor",
                                       "NoRepeatNGramLogitsProcessor",
                                       "NoBadWordsLogitsProcessor", "MinLengthLogitsProcessor",
                                       "MinNewTokensLengthLogitsProcessor",
                                       "SuppressTokensLogitsProcessor"]
    # an explicit argument wins over the config, as in generate
    ref = model.generate(ids, attention_mask=mask, repetition_penalty=1.0)
    out, _ = generate(model, ids, attention_mask=mask, repetition_penalty=1.0)
    assert torch.equal(out, ref)
    # and a sampling config samples with its own settings (generate's default top_k=50 too)
    model.generation_config.do_sample, model.generation_config.top_p = True, 0.85
    u = torch.rand(3, 18, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a, sa = generate(model, ids, attention_mask=mask, noise=u)
    b, _ = generate(model, ids, attention_mask=mask, noise=u, method="sequential")
    assert torch.equal(a, b) and "top_p" in sa.stats["processors"]
    assert "top_k" in sa.stats["processors"]


# 2. settings that are not implemented: refused by name, with the value and where it came from
REFUSED = [("num_beams", 4, "beam search"), ("num_beam_groups", 2, "group beam search"),
           ("penalty_alpha", 0.6, "contrastive search"), ("num_return_sequences", 3,
                                                          "repeat the prompts"),
           ("typical_p", 0.9, "typical sampling"), ("eta_cutoff", 3e-4, "eta sampling"),
           ("encoder_repetition_penalty", 1.2, "encoder-decoder"),
           ("exponential_decay_length_penalty", (4, 1.1), "length penalty"),
           ("guidance_scale", 1.5, "classifier-free guidance"),
           ("force_words_ids", [[5]], "constrained beam search"),
           ("stop_strings", ["\n"], "stop strings"), ("max_time", 2.0, "time limit"),
           ("prompt_lookup_num_tokens", 3, "n-gram"), ("dola_layers", "low", "DoLa"),
           ("diversity_penalty", 0.5, "group beam search"),
           ("cache_implementation", "static", "dynamic cache")]


@pytest.mark.parametrize("field,value,why", REFUSED, ids=[r[0] for r in REFUSED])
def test_unimplemented_settings_are_refused_by_name(field, value, why):
    model = make("gpt2", "cpu", fresh=True)
    ids, _ = prompts(1, 4)
    cfg = transformers.GenerationConfig()
    setattr(cfg, field, value)
    msg = re.escape(f"generation setting {field}={value!r} (from generation_config) is not "
                    "supported")
    with pytest.raises(ValueError, match=msg) as e:
        generate(model, ids, max_new_tokens=4, generation_config=cfg)
    assert why in str(e.value)
    setattr(model.generation_config, field, value)            # as a pretrained model ships it
    with pytest.raises(ValueError, match=f"{field}=.*from model.generation_config"):
        generate(model, ids, max_new_tokens=4)


def test_neutral_values_of_refused_settings_pass():
    model = make("gpt2", "cpu", fresh=True)
    ids, mask = prompts(1, 4)
    cfg = transformers.GenerationConfig(num_beams=1, typical_p=1.0, eta_cutoff=0.0,
                                        guidance_scale=1.0, num_return_sequences=1,
                                        length_penalty=2.0, early_stopping=True,
                                        output_scores=True, return_dict_in_generate=True)
    out, sol = generate(model, ids, max_new_tokens=6, generation_config=cfg)
    assert sol.converged and torch.equal(out, hf(model, ids, mask, 6))


def test_an_unknown_setting_is_refused(monkeypatch):
    """A field that a newer transformers adds is not ignored: refused until it is classified."""
    from paraprop.decoding import settings

    model = make("gpt2", "cpu", fresh=True)
    ids, _ = prompts(1, 4)
    cfg = transformers.GenerationConfig(typical_p=0.3)
    monkeypatch.delitem(settings.REFUSED, "typical_p")   # a real field, as if unclassified
    with pytest.raises(ValueError, match=r"generation setting typical_p=0.3 \(from "
                                         r"generation_config\) is not known to paraprop"):
        generate(model, ids, max_new_tokens=4, generation_config=cfg)


# 3. stochastic models: there is no sequential result to reproduce
def test_train_mode_dropout_is_refused():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.2, embd_pdrop=0.1, attn_pdrop=0.1)
    gpt2 = transformers.GPT2LMHeadModel(cfg).double()
    llama = _small(transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   attention_dropout=0.3)
    llama.train()
    ids, _ = prompts(2, 4)
    for model in (gpt2.train(), llama):
        with pytest.raises(StochasticModelError, match=r"decoding.generate: model is in train "
                                                       r"mode.*call model.eval\(\) first"):
            generate(model, ids, max_new_tokens=5)
        out, sol = generate(model.eval(), ids, max_new_tokens=5, eos_token_id=[])
        assert sol.converged and out.shape == (2, 9)


def test_a_custom_module_with_dropout_is_refused():
    class Dropped(_TupleCacheLM):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.1)

    m = Dropped().double()
    with pytest.raises(StochasticModelError, match="'drop' \\(Dropout\\)"):
        generate(m, torch.randint(0, V, (1, 3)), max_new_tokens=4)


# 4. low precision: a token that may differ from generate's is never reported as certified
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_never_certifies_a_difference(dtype):
    for build in (_qwen2, _neox):
        for seed in range(2):
            model = build(seed=seed).to(dtype)
            ids, mask = prompts(2, 5, seed=seed)
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                 eos_token_id=None, repetition_penalty=1.1)
            out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=24,
                                eos_token_id=[], repetition_penalty=1.1, throw=False)
            bad = {}
            for b, t in sol.stats["uncertified"]:
                bad[b] = min(bad.get(b, 24), t)
            for b in range(2):
                t0 = bad.get(b, 24)
                assert torch.equal(out[b, 5 : 5 + t0], ref[b, 5 : 5 + t0])
            if sol.converged:
                assert torch.equal(out, ref)
            else:
                with pytest.raises(ConvergenceError, match="use method='sequential'"):
                    generate(model, ids, attention_mask=mask, max_new_tokens=24,
                             eos_token_id=[], repetition_penalty=1.1)


def test_low_precision_sampling_never_certifies_a_difference():
    """Sampled tokens in bf16: Jacobi against the sequential sampler (generate's loop with the
    same variates), up to the first uncertified position."""
    for build in (_qwen2, _neox):
        model = build().to(torch.bfloat16)
        ids, mask = prompts(3, 5)
        u = torch.rand(3, 24, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        kw = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=[], do_sample=True,
                  noise=u, top_p=0.9, temperature=0.8)
        ref, _ = generate(model, ids, method="sequential", **kw)
        out, sol = generate(model, ids, throw=False, **kw)
        bad = {}
        for b, t in sol.stats["uncertified"]:
            bad[b] = min(bad.get(b, 24), t)
        for b in range(3):
            t0 = bad.get(b, 24)
            assert torch.equal(out[b, 5 : 5 + t0], ref[b, 5 : 5 + t0])


# 5. cryptic errors become clear ones
def test_sliding_window_models():
    ids, mask = prompts(2, 5)
    for model, setting in ((_mistral(sliding_window=12), "sliding_window=12"),
                           (_qwen2(use_sliding_window=True, sliding_window=12,
                                   max_window_layers=1), "sliding_window=12")):
        with pytest.raises(ValueError, match=rf"sliding-window attention \({setting}\), and "
                                             r"the prompt \(5 positions\) plus "
                                             r"max_new_tokens=20 make 25 > 12"):
            generate(model, ids, attention_mask=mask, max_new_tokens=20)
        # within the window it never binds: generate's tokens
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=7)
        assert torch.equal(out, ref) and sol.converged
    # a window configured but switched off does not bind
    model = _qwen2(use_sliding_window=False, sliding_window=4)
    out, _ = generate(model, ids, attention_mask=mask, max_new_tokens=20)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=20,
                                           do_sample=False))


def test_chunked_attention_that_would_bind_is_refused():
    model = _qwen2()
    model.config.attention_chunk_size = 10     # as Llama 4's text configuration sets it
    ids, mask = prompts(2, 5)
    with pytest.raises(ValueError, match=r"model Qwen2ForCausalLM has chunked attention "
                                         r"\(attention_chunk_size=10\) and the prompt \(5 "
                                         r"positions\) plus max_new_tokens=20 make 25 > 10 "
                                         r"positions; keep them within 10"):
        generate(model, ids, attention_mask=mask, max_new_tokens=20)


def test_encoder_decoder_models_are_not_causal_lms():
    cfg = transformers.T5Config(vocab_size=V, d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                d_kv=8, decoder_start_token_id=0)
    t5 = transformers.T5ForConditionalGeneration(cfg).eval()
    with pytest.raises(TypeError, match=r"model T5ForConditionalGeneration is an "
                                        r"encoder-decoder model \(config.is_encoder_decoder="
                                        r"True\), not a causal LM"):
        generate(t5, torch.randint(0, V, (1, 4)), max_new_tokens=3)


def test_positions_beyond_the_model():
    ids, _ = prompts(1, 30)
    for model, limit in ((make("gpt2", "cpu"), 96), (_neox(), 96)):
        with pytest.raises(ValueError, match=rf"prompt \(30 positions\) plus max_new_tokens=70 "
                                             rf"make 100 positions, more than the model's "
                                             rf"max_position_embeddings={limit}.*at most 66"):
            generate(model, ids, max_new_tokens=70)
    out, _ = generate(make("gpt2", "cpu"), ids, max_new_tokens=66, eos_token_id=[])
    assert out.shape == (1, 96)


def test_token_ids_outside_the_vocabulary():
    model = make("llama", "cpu")
    ids, _ = prompts(2, 4)
    with pytest.raises(ValueError, match=rf"input_ids holds the token id {V + 3}, outside the "
                                         rf"model's vocabulary of vocab_size={V}"):
        generate(model, ids.index_fill(1, torch.tensor([2]), V + 3), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"input_ids holds the negative token id -1"):
        generate(model, ids.index_fill(1, torch.tensor([0]), -1), max_new_tokens=3)
    with pytest.raises(ValueError, match=rf"pad_token_id={V} is outside the model's vocabulary "
                                         rf"of vocab_size={V}"):
        generate(model, ids, max_new_tokens=3, pad_token_id=V)


def test_a_cache_that_cannot_be_cut_back(monkeypatch):
    """A cache whose crop fails (as a sliding-window layer past its window does) gives an error
    that names the model, the cache and the way out."""
    from transformers import DynamicCache

    from paraprop.decoding import token_map

    # wrong guesses, so that a pass accepts part of its window and the cache is cut back
    monkeypatch.setattr(token_map.TokenMap, "propose",
                        lambda self, x, final: torch.full_like(x, float(V - 1)))

    model = make("gpt2", "cpu", fresh=True)

    class Stuck(DynamicCache):
        def crop(self, n):
            raise RuntimeError("`crop` was called, but the current layer does not track "
                               "past states")

    forward = model.forward

    @functools.wraps(forward)   # forward's signature: generate passes the cache by its name
    def fwd(*a, **kw):
        out = forward(*a, **kw)
        cache = out.get("cache", None) or out.get("past_key_values", None)
        cache.__class__ = Stuck
        return out

    model.forward = fwd
    ids, _ = prompts(1, 4)
    with pytest.raises(TypeError, match=r"model GPT2LMHeadModel: its cache \(Stuck\) cannot "
                                        r"be cut back to the accepted prefix.*use "
                                        r"method='sequential'"):
        generate(model, ids, max_new_tokens=12, eos_token_id=[])
    out, _ = generate(model, ids, max_new_tokens=12, eos_token_id=[], method="sequential")
    assert out.shape == (1, 16)


def test_autocast_counts_as_low_precision():
    """A float32 model under bf16 autocast computes in bf16: the bound is bf16's."""
    model = make("gpt2", "cpu", dtype=torch.float32)
    ids, _ = prompts(1, 4)
    _, sol = generate(model, ids, max_new_tokens=6, eos_token_id=[], throw=False)
    assert sol.stats["rounding_dtype"] == "torch.float32"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, sol = generate(model, ids, max_new_tokens=6, eos_token_id=[], throw=False)
    assert sol.stats["rounding_dtype"] == "torch.bfloat16"


# 3b. randomness that no up-front check recognises: caught at run time by the repeat check
def _mixtral(jitter):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, router_jitter_noise=jitter,
                                     max_position_embeddings=96, bos_token_id=1, eos_token_id=2,
                                     pad_token_id=0)
    return transformers.MixtralForCausalLM(cfg).float()


class _Noise(torch.nn.Module):
    """Adds ``scale * randn_like(x)``, in train mode only (``always``: in eval mode too)."""

    def __init__(self, scale, always=False):
        super().__init__()
        self.scale, self.always = scale, always

    def forward(self, x):
        return x + self.scale * torch.randn_like(x) if self.training or self.always else x


class _NoisyLM(_TupleCacheLM):
    """The tuple-cache LM with a random layer after its embedding."""

    def __init__(self, scale, always=False):
        super().__init__()
        self.noise = _Noise(scale, always)
        emb = self.emb
        self.emb = torch.nn.Sequential(emb, self.noise)


class _DroppedLogits(torch.nn.Module):
    """A wrapper applying functional dropout to the logits under its own attribute name."""

    def __init__(self, inner, p):
        super().__init__()
        self.inner, self.noise_p = inner, p
        self.generation_config = inner.generation_config

    def forward(self, input_ids, past_key_values=None, use_cache=True, attention_mask=None,
                position_ids=None):
        cache = {cache_keyword(self.inner): past_key_values}   # transformers 5 renamed it
        out = self.inner(input_ids, **cache, use_cache=use_cache,
                         attention_mask=attention_mask, position_ids=position_ids)
        out.logits = torch.nn.functional.dropout(out.logits, self.noise_p, self.training)
        return out


HIDDEN = r"different logits for the same tokens in two passes: at new position \d+ of sample"


def test_hidden_randomness_is_caught_at_run_time(monkeypatch):
    """Mixtral's router jitter as if its attribute were unknown to the up-front check, a Llama
    with a custom randn_like layer, and a float64 wrapper with functional dropout under its own
    attribute name (once a ConvergenceError blaming rounding): the repeat check raises whatever
    throw says, naming train mode and model.eval(); in eval mode the tokens are generate's."""
    from paraprop import determinism

    ids, mask = prompts(3, 6)
    mixtral = _mixtral(0.9).train()
    with pytest.raises(StochasticModelError, match="jitter_noise=0.9"):   # the up-front check
        generate(mixtral, ids, attention_mask=mask, max_new_tokens=12)
    unknown = tuple(a for a in determinism.DROPOUT_ATTRIBUTES if "jitter" not in a)
    monkeypatch.setattr(determinism, "DROPOUT_ATTRIBUTES", unknown)
    llama = make("llama", "cpu", fresh=True)
    llama.model.embed_tokens = torch.nn.Sequential(llama.model.embed_tokens, _Noise(0.5))
    wrapped = _DroppedLogits(make("llama", "cpu", fresh=True), 0.3)     # float64, as probed
    for model in (mixtral, llama.train(), wrapped.train()):
        for seed in range(2):
            # one sample (nothing recomputed but the repeat check's position), and a batch
            for b, kw in ((1, {}), (1, {"throw": False}), (1, {"method": "gs_jacobi"}),
                          (1, {"do_sample": True}), (3, {})):
                torch.manual_seed(seed)
                with pytest.raises(StochasticModelError, match=HIDDEN + r".*model is in train "
                                   r"mode.*router jitter noise.*call model.eval\(\) first"):
                    generate(model, ids[:b], attention_mask=mask[:b], max_new_tokens=8,
                             eos_token_id=[], **kw)
        model.eval()
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=12)
        ref = hf(getattr(model, "inner", model), ids, mask, 12)
        assert torch.equal(out, ref) and sol.converged
        assert 0 < sol.stats["repeat_checks"] and sol.stats["repeat_ratio"] < 1


@pytest.mark.parametrize("packed", [False, True])
def test_tiny_randomness(packed, monkeypatch):
    """Noise of 1e-4 of the logits is far above the rounding bound: refused. Noise below the
    bound (1e-13 in float64) cannot change a certified token: the tokens are the sequential
    loop's, and the repeat check reports it under its bound. ``packed``: each pass's results
    reach the host in one float64 copy, as off the CPU."""
    from paraprop.decoding.token_map import TokenMap

    monkeypatch.setattr(TokenMap, "PACKED", packed)
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = _NoisyLM(1e-4).double().train()
    for method in ("jacobi", "gs_jacobi"):
        with pytest.raises(StochasticModelError, match=HIDDEN + r".*model is in train mode"):
            generate(model, ids, max_new_tokens=16, method=method)
    model.noise.scale = 1e-13
    out, sol = generate(model, ids, max_new_tokens=16)
    ref, _ = generate(model, ids, max_new_tokens=16, method="sequential")
    assert torch.equal(out, ref) and sol.converged
    assert 0 < sol.stats["repeat_ratio"] < 1e-3
    # randomness in eval mode: the message says so and does not advise eval()
    model = _NoisyLM(1e-3, always=True).double().eval()
    with pytest.raises(StochasticModelError, match=HIDDEN + r".*model is in eval mode, so its "
                                                   r"forward draws random numbers") as e:
        generate(model, ids, max_new_tokens=16, throw=False)
    assert "eval()" not in str(e.value)


def test_a_small_repeat_difference_says_it_may_be_rounding():
    """A repeat difference of a few bounds (here eval-mode noise of 3e-6 on the embeddings of a
    float64 model, whose bound is 8 float32 roundings of the scores: 5.5 bounds) may also be
    rounding beyond the bound on a model unlike the measured ones: the message says so and
    offers method='sequential'; a large one (1e-4: about 180 bounds) does not."""
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(0))
    for scale, small in ((3e-6, True), (1e-4, False)):
        torch.manual_seed(0)
        model = _NoisyLM(scale, always=True).double().eval()
        with pytest.raises(StochasticModelError, match=HIDDEN) as e:
            generate(model, ids, max_new_tokens=16, throw=False)
        hint = re.search(r"A difference of only [\d.]+ times the bound may also be rounding "
                         r"beyond the bound on this model .*use method='sequential'",
                         str(e.value))
        assert (hint is not None) == small, str(e.value)


def test_a_deterministic_model_passes_the_repeat_check_in_low_precision():
    """The repeat check compares logits of passes of different shapes: in bf16 and fp16 they
    round differently, within the bound (no false alarm)."""
    for dtype in (torch.bfloat16, torch.float16):
        for build in (_qwen2, _neox):
            model = build().to(dtype)
            ids, mask = prompts(3, 5)
            for b in (1, 3):
                _, sol = generate(model, ids[:b], attention_mask=mask[:b], max_new_tokens=24,
                                  eos_token_id=[], throw=False, do_sample=True, top_p=0.9,
                                  generator=torch.Generator().manual_seed(0))
                assert sol.stats["repeat_checks"] > 0 and sol.stats["repeat_ratio"] < 1


# 5b. left padding: a model without position_ids (Bloom) works; one without attention_mask is
# refused with what it lacks and the way out
def test_padding_for_models_without_position_ids_or_attention_mask():
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    bloom = transformers.BloomForCausalLM(cfg).eval()
    ids, mask = prompts(3, 6)
    ref = bloom.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
    for method in ("sequential", "gs_jacobi"):
        out, _ = generate(bloom, ids, attention_mask=mask, max_new_tokens=10, method=method,
                          eos_token_id=[])
        assert torch.equal(out, ref), method
    lm = _TupleCacheLM().double().eval()
    for method in ("sequential", "jacobi"):
        with pytest.raises(TypeError, match=r"model _TupleCacheLM: the prompts are left-padded "
                                            r"\(attention_mask has zeros\) but its forward "
                                            r"takes no attention_mask keyword.*pass prompts "
                                            r"without padding \(the unpadded prompts one at a "
                                            r"time"):
            generate(lm, ids, attention_mask=mask, max_new_tokens=4, method=method)
    out, _ = generate(lm, ids[1:2, 3:], max_new_tokens=4)       # sample 1 alone, unpadded
    assert out.shape == (1, 7)


# 6. each certificate failure names its own cause and a fix that applies
class _FixedLM(torch.nn.Module):
    """Logits that do not depend on the tokens (``bias``), with a tuple cache."""

    def __init__(self, bias):
        super().__init__()
        self.bias = torch.nn.Parameter(bias.double())

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        kv = input_ids[:, None, :, None].double()
        if past_key_values is not None:
            kv = torch.cat([past_key_values[0][0], kv], dim=-2)
        B, n = input_ids.shape
        return self.bias.expand(B, n, -1).clone(), ((kv, kv),)


def _bias(*top):
    b = torch.linspace(-1.0, 0.0, V)
    b[: len(top)] = torch.tensor(top)
    return b


def test_non_finite_logits_are_named_as_the_models():
    """NaN logits from the model itself (a padded float64 Bloom, whose fully masked rows give
    NaN; a NaN weight): the message names the non-finite logits and a fix, not rounding."""
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    bloom = transformers.BloomForCausalLM(cfg).double().eval()
    ids, mask = prompts(3, 6)
    with torch.no_grad():
        assert bool(bloom(ids, attention_mask=mask).logits[1].isnan().all())   # the model's
    with pytest.raises(ConvergenceError, match=r"new position 1 of sample 1 is not certified.*"
                                               r"logits for it are not finite .*torch.float64.*"
                                               r"Sample 1's prompt is left-padded.*generate the "
                                               r"padded prompts one at a time") as e:
        generate(bloom, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[])
    assert "float32 model" not in str(e.value)
    for b in (1, 2):    # the fix applies: each padded prompt alone is certified, generate's
        one = ids[b : b + 1, mask[b].bool()]
        out, sol = generate(bloom, one, max_new_tokens=6, eos_token_id=[])
        assert sol.converged and torch.equal(out, bloom.generate(
            one, attention_mask=torch.ones_like(one), max_new_tokens=6, eos_token_id=None))
    bias = _bias(3.0, 1.0)
    bias[5] = float("nan")
    out, sol = generate(_FixedLM(bias), ids[:1], max_new_tokens=5, throw=False)
    assert not sol.converged and sol.stats["uncertified"][0] == (0, 1)
    assert re.search(r"not finite.*Check the model's weights and this prompt in torch.float64",
                     sol.stats["uncertified_cause"])


def test_ties_are_named_as_ties_and_settings_as_settings():
    ids = torch.randint(3, V, (1, 4), generator=torch.Generator().manual_seed(0))
    # greedy: the model's own exact tie (float64: not a rounding matter)
    with pytest.raises(ConvergenceError, match=r"exact tie in the gap between the best and the "
                                               r"second-best processed score.*method="
                                               r"'sequential'") as e:
        generate(_FixedLM(_bias(2.0, 2.0)), ids, max_new_tokens=5)
    assert "float32" not in str(e.value)
    # sampling: top_k=2 cuts between two equal scores: the setting is named
    u = torch.full((1, 5), 0.3, dtype=torch.float64)
    with pytest.raises(ConvergenceError, match=r"exact tie in top_k=2's cut.*change that "
                                               r"setting, or use method='sequential'"):
        generate(_FixedLM(_bias(3.0, 2.0, 2.0)), ids, max_new_tokens=5, do_sample=True,
                 top_k=2, noise=u)
    # min_p=1.0 keeps the best token only (the threshold sits on the best token, which always
    # stays): certified, the greedy tokens
    for seed in range(2):
        model = make("llama", "cpu", fresh=True, vocab=V)
        ids3, mask = prompts(3, 6, seed=seed)
        model.generation_config.do_sample, model.generation_config.min_p = True, 1.0
        out, sol = generate(model, ids3, attention_mask=mask, max_new_tokens=10,
                            generator=torch.Generator().manual_seed(seed), top_k=0)
        assert sol.converged and torch.equal(out, hf(model, ids3, mask, 10))


def test_a_16_bit_near_tie_suggests_float32():
    """Only where the dtype is 16-bit does the message offer a float32 model."""
    for build in (_qwen2, _neox):
        for seed in range(3):
            model = build(seed=seed).to(torch.bfloat16)
            ids, mask = prompts(3, 5, seed=seed)
            _, sol = generate(model, ids, attention_mask=mask, max_new_tokens=24,
                              eos_token_id=[], throw=False)
            cause = sol.stats.get("uncertified_cause")
            if cause is not None and "margin of" in cause:
                assert re.search(r"in torch.bfloat16 \(the margin: .*\).*use method="
                                 r"'sequential' .* or a float32 model instead of "
                                 r"torch.bfloat16", cause)
                return
    pytest.fail("no near-tie in bf16 on these models")


# the Gumbel-max coupling (issue 32 item 1): the same refusals, certificates and causes
def test_gumbel_coupling_catches_hidden_randomness():
    """A custom random layer the up-front check does not know: the repeat check raises under
    the Gumbel-max coupling too (whatever throw says); in eval mode the tokens are the
    coupling's sequential loop's."""
    llama = make("llama", "cpu", fresh=True)
    llama.model.embed_tokens = torch.nn.Sequential(llama.model.embed_tokens, _Noise(0.5))
    ids, mask = prompts(3, 6)
    kw = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=[], do_sample=True,
              coupling="gumbel")
    for extra in ({}, {"throw": False}, {"method": "gs_jacobi"}):
        with pytest.raises(StochasticModelError, match=HIDDEN + r".*model is in train mode"):
            generate(llama.train(), ids, generator=torch.Generator().manual_seed(0), **kw,
                     **extra)
    llama.eval()
    ref, _ = generate(llama, ids, method="sequential",
                      generator=torch.Generator().manual_seed(0), **kw)
    out, sol = generate(llama, ids, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(out, ref) and sol.converged and sol.stats["repeat_ratio"] < 1


def test_gumbel_coupling_names_its_causes():
    ids = torch.randint(3, V, (1, 4), generator=torch.Generator().manual_seed(0))

    def kw():       # a fresh generator per call: the key is its first draw
        return dict(max_new_tokens=5, do_sample=True, coupling="gumbel",
                    generator=torch.Generator().manual_seed(0))

    # top_k=2 cuts between two equal scores: the setting is named, as for the inverse CDF
    with pytest.raises(ConvergenceError, match=r"exact tie in top_k=2's cut.*change that "
                                               r"setting, or use method='sequential'"):
        generate(_FixedLM(_bias(3.0, 2.0, 2.0)), ids, top_k=2, **kw())
    # non-finite logits from the model
    bias = _bias(3.0, 1.0)
    bias[5] = float("nan")
    out, sol = generate(_FixedLM(bias), ids, throw=False, **kw())
    assert not sol.converged and sol.stats["uncertified"][0] == (0, 1)
    assert "not finite" in sol.stats["uncertified_cause"]
    # a margin below the bound: logits that put two perturbed scores of new position 1 within
    # 2e-6 of each other (the noise is a function of the key and the indices)
    from paraprop.decoding.gumbel import GumbelNoise, draw_key

    g = GumbelNoise(draw_key(torch.Generator().manual_seed(0)), 1, "cpu").window(1, 2, V)[0, 0]
    near = -g.clone()
    near[3] += 1.0
    near[4] += 1.0 + 2e-6
    out, sol = generate(_FixedLM(near), ids, throw=False, **kw())
    assert sol.stats["uncertified"] == [(0, 1)] and sol.stats["margin_ratio"] < 1
    assert re.search(r"new position 1 of sample 0 is not certified.*decided by a margin of "
                     r".* times the bound.*the gap between the best and the second-best "
                     r"perturbed score", sol.stats["uncertified_cause"])
    ref, _ = generate(_FixedLM(near), ids, method="sequential", **kw())
    assert int(ref[0, 5]) in (3, 4)                       # the near-tie it reports


def test_gumbel_with_min_p_one_is_greedy():
    """min_p=1.0 keeps the best token only: the Gumbel-max draw is then generate's greedy
    token, certified."""
    for seed in range(2):
        model = make("llama", "cpu", fresh=True, vocab=V)
        ids, mask = prompts(3, 6, seed=seed)
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=10, do_sample=True,
                            min_p=1.0, top_k=0, coupling="gumbel",
                            generator=torch.Generator().manual_seed(seed))
        assert sol.converged and torch.equal(out, hf(model, ids, mask, 10))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gumbel_low_precision_never_certifies_a_difference(dtype):
    """Sampled with the Gumbel-max coupling in 16 bits: Jacobi against the coupling's sequential
    loop, up to each sample's first uncertified position."""
    for build in (_qwen2, _neox):
        model = build().to(dtype)
        ids, mask = prompts(3, 5)
        kw = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=[], do_sample=True,
                  top_p=0.9, temperature=0.8, coupling="gumbel")
        ref, _ = generate(model, ids, method="sequential",
                          generator=torch.Generator().manual_seed(4), **kw)
        out, sol = generate(model, ids, throw=False, generator=torch.Generator().manual_seed(4),
                            **kw)
        bad: dict[int, int] = {}
        for b, t in sol.stats["uncertified"]:
            bad[b] = min(bad.get(b, 24), t)
        for b in range(3):
            t0 = bad.get(b, 24)
            assert torch.equal(out[b, 5 : 5 + t0], ref[b, 5 : 5 + t0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gumbel_low_precision_certifies_tokens_without_filters(dtype):
    """The test above compares little: with top_p, 16-bit scores tie at the cut and every sample
    is uncertified from new position 1 on. Without a filter the noise breaks the ties, so many
    positions are certified: each sample's tokens are the sequential loop's up to its first
    uncertified position, and those prefixes hold more than position 0 (the prefill's)."""
    for build in (_qwen2, _neox):
        model = build().to(dtype)
        ids, mask = prompts(3, 5)
        kw = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=[], do_sample=True,
                  top_k=0, temperature=0.8, coupling="gumbel")
        ref, _ = generate(model, ids, method="sequential",
                          generator=torch.Generator().manual_seed(4), **kw)
        out, sol = generate(model, ids, throw=False, generator=torch.Generator().manual_seed(4),
                            **kw)
        assert sol.converged == (sol.stats["uncertified"] == [])
        bad: dict[int, int] = {}
        for b, t in sol.stats["uncertified"]:
            bad[b] = min(bad.get(b, 24), t)
        for b in range(3):
            t0 = bad.get(b, 24)
            assert torch.equal(out[b, 5 : 5 + t0], ref[b, 5 : 5 + t0]), (build.__name__, b)
        compared = sum(bad.get(b, 24) for b in range(3))
        assert compared >= 12, (build.__name__, bad)       # seen: 21 or more
