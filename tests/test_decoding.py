"""paraprop.decoding.generate against transformers' generate: greedy tokens bitwise (float64,
and the sequential loop in bf16/fp16 too), every supported generation setting, the model's own
generation_config, sampling's processed distributions against generate's scores and its tokens
against our sequential sampler, on the device fixture."""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch

from paraprop import Result, solvers
from paraprop.decoding import choose, generate, process_logits

transformers = pytest.importorskip("transformers")

V = 53


def _gpt2(seed=0, vocab=V, **kw):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=96, n_embd=32, n_layer=2,
                                  n_head=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  **kw)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def _llama(seed=0, vocab=V, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=96,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    return transformers.LlamaForCausalLM(cfg).double().eval()


MODELS = {"gpt2": _gpt2, "llama": _llama}


@functools.cache
def _cached(name: str, device: str, dtype=torch.float64):
    return MODELS[name]().to(device=device, dtype=dtype)


def make(name: str, device, dtype=torch.float64, fresh: bool = False, **kw):
    """A tiny randomly initialised model; ``fresh`` (or config overrides) for one a test may
    change (its generation_config)."""
    if fresh or kw:
        return MODELS[name](**kw).to(device=device, dtype=dtype)
    return _cached(name, str(device), dtype)


# tiny transformers: one intra-op thread is as fast, and immune to a busy machine
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=sorted(MODELS))
def name(request):
    return request.param


def prompts(B, P, seed=1, device="cpu", vocab=V):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    if B > 1 and P > 1:   # left padding of different lengths
        mask[1, : P // 2] = 0
        mask[2 % B, :1] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


ARGS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
        "no_repeat_ngram_size", "min_new_tokens", "eos_token_id", "pad_token_id")


def as_kwargs(setting: dict) -> dict:
    """``setting`` as generate's arguments, with what is not one in a ``generation_config``."""
    rest = {k: v for k, v in setting.items() if k not in ARGS}
    kw = {k: v for k, v in setting.items() if k in ARGS}
    return {**kw, "generation_config": transformers.GenerationConfig(**rest)} if rest else kw


def hf(model, ids, mask, n, **kw):
    """transformers' own greedy loop, with the model's generation_config (EOS 2, pad 0)."""
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)


@pytest.mark.parametrize("P,B,n", [(1, 1, 1), (1, 3, 40), (5, 1, 7), (5, 3, 40), (17, 3, 7),
                                   (17, 1, 40), (17, 3, 1)])
def test_greedy_equals_generate(device, name, P, B, n):
    model = make(name, device)
    ids, mask = prompts(B, P, device=device)
    ref = hf(model, ids, mask, n)
    for method in ("jacobi", "gs_jacobi", "sequential"):
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=n, method=method)
        assert out.shape == ref.shape
        assert torch.equal(out, ref), method
        assert sol.converged and sol.stats["new_tokens"] == ref.shape[1] - P
        # never more model calls than the sequential loop (one per token, prefill included)
        assert sol.stats["model_calls"] <= n + (0 if method != "gs_jacobi" else -(-n // 16))
        if method == "sequential":
            assert sol.stats["model_calls"] == ref.shape[1] - P


def test_no_eos_and_explicit_arguments_win(device, name):
    model = make(name, device)
    ids, mask = prompts(3, 6, device=device)
    ref = hf(model, ids, mask, 30, eos_token_id=None)
    out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[])
    assert torch.equal(out, ref) and out.shape[1] == 36
    eos = int(ref[0, 6 + 4])   # a token sample 0 emits early, as the EOS
    ref = hf(model, ids, mask, 30, eos_token_id=eos)
    out, _ = generate(model, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos)
    assert torch.equal(out, ref)


def test_greedy_windows_and_guesses(device, name):
    model = make(name, device)
    ids, mask = prompts(3, 6, device=device)
    ref = hf(model, ids, mask, 30, eos_token_id=None)
    for kw in ({"window": 1}, {"window": 5}, {"window": 30}, {"ngram": 0}, {"ngram": 1},
               {"method": solvers.SlidingJacobi(7)}, {"method": solvers.GSJacobi(4)}):
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=30,
                            eos_token_id=[], **kw)
        assert torch.equal(out, ref), kw
        assert sol.converged and sol.stats["uncertified"] == []


def test_eos_in_the_middle(device, name):
    model = make(name, device)
    ids, mask = prompts(3, 5, device=device)
    free = hf(model, ids, mask, 20, eos_token_id=None)
    eos = int(free[0, 5 + 6])         # sample 0 emits this token at its 7th new position
    ref = hf(model, ids, mask, 20, eos_token_id=eos)
    for method in ("jacobi", "sequential"):
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=20, method=method,
                            eos_token_id=eos)
        assert torch.equal(out, ref), method
    row = out[0, 5:].tolist()
    k = row.index(eos)
    assert all(t == 0 for t in row[k + 1 :])   # pad after EOS, as generate does


def test_all_samples_end_early_returns_shorter(device):
    m = make("gpt2", device)
    ids, mask = prompts(1, 4, device=device)
    free = hf(m, ids, mask, 30, eos_token_id=None)
    eos = int(free[0, 4 + 3])
    ref = hf(m, ids, mask, 30, eos_token_id=eos)
    out, sol = generate(m, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos)
    assert torch.equal(out, ref)
    assert out.shape[1] < 4 + 30
    assert sol.stats["new_tokens"] == out.shape[1] - 4


# every supported processor, set the three ways a user sets it; greedy tokens against generate
PROCESSORS = [
    {"repetition_penalty": 1.6}, {"repetition_penalty": 0.6}, {"no_repeat_ngram_size": 2},
    {"no_repeat_ngram_size": 3}, {"min_new_tokens": 9}, {"min_length": 14},
    {"suppress_tokens": [7, 11, 13]}, {"begin_suppress_tokens": [7, 2]},
    {"forced_eos_token_id": 2}, {"sequence_bias": [[[9], 4.0], [[5, 9], -9.0]]},
    {"bad_words_ids": [[9], [5, 13]]}, {"remove_invalid_values": True},
    {"renormalize_logits": True},
    {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 4,
     "suppress_tokens": [7], "sequence_bias": [[[3], 2.5]]},
]


WAYS = [(setting, "generation_config") for setting in PROCESSORS[:-1]] + [
    (PROCESSORS[-1], way) for way in ("argument", "generation_config", "model.generation_config")]


@pytest.mark.parametrize("setting,way", WAYS,
                         ids=[f"{','.join(setting)}-{way}" for setting, way in WAYS])
def test_processors_greedy_equal_generate(device, name, setting, way):
    model = make(name, device, fresh=way == "model.generation_config")
    ids, mask = prompts(3, 6, device=device)
    eos = int(hf(model, ids, mask, 12, eos_token_id=None)[0, 6 + 2])   # a frequent token
    setting = {**setting, "eos_token_id": eos}
    ref = hf(model, ids, mask, 24, **setting)
    kw = {}
    if way == "argument":
        kw = as_kwargs(setting)
    elif way == "generation_config":
        kw = {"generation_config": transformers.GenerationConfig(**setting)}
    else:
        for k, v in setting.items():
            setattr(model.generation_config, k, v)
    for method in ("jacobi", "sequential"):
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=24, method=method,
                            **kw)
        assert torch.equal(out, ref), (method, setting)
        assert sol.converged


def test_forced_bos_and_begin_suppress_with_one_token_prompt(device, name):
    model = make(name, device)
    ids = torch.tensor([[1], [1]], device=device)
    cfg = transformers.GenerationConfig(forced_bos_token_id=17, begin_suppress_tokens=[4, 5])
    ref = hf(model, ids, torch.ones_like(ids), 12, generation_config=cfg)
    out, _ = generate(model, ids, max_new_tokens=12, generation_config=cfg)
    assert torch.equal(out, ref) and bool((out[:, 1] == 17).all())


def test_the_processor_list_is_generates():
    """The processors applied are the classes generate builds, in its order (its private
    builder, read here only to check ours)."""
    from paraprop.decoding import settings as st
    from paraprop.decoding.processors import Pipeline

    model = make("llama", "cpu")
    ids, mask = prompts(3, 6)
    everything = dict(sequence_bias=[[[9], 1.0]], repetition_penalty=1.2,
                      no_repeat_ngram_size=2, bad_words_ids=[[9]], min_length=9,
                      min_new_tokens=2, forced_eos_token_id=2, remove_invalid_values=True,
                      suppress_tokens=[4], begin_suppress_tokens=[5], do_sample=True,
                      temperature=0.7, top_k=9, top_p=0.8, min_p=0.05, epsilon_cutoff=1e-4,
                      renormalize_logits=True, max_new_tokens=8)
    cfg = transformers.GenerationConfig(**everything)
    s = st.resolve(model, 6, {}, cfg)
    ours = Pipeline(s, 6, mask, "cpu", 1.0).active
    gcfg, _ = model._prepare_generation_config(cfg)
    model._prepare_special_tokens(gcfg, True, device="cpu")
    gcfg.max_length, gcfg.min_length = 14, 8
    theirs = model._get_logits_processor(gcfg, input_ids_seq_length=6, encoder_input_ids=ids,
                                         device="cpu", model_kwargs={"attention_mask": mask})
    names = {"TemperatureLogitsWarper": "temperature", "TopKLogitsWarper": "top_k",
             "TopPLogitsWarper": "top_p"}
    assert ours == [names.get(type(p).__name__, type(p).__name__) for p in theirs]


# sampling: generate's processed distributions, position by position, on generate's own tokens
SAMPLING = [{}, {"temperature": 0.7}, {"top_k": 5}, {"top_k": 0}, {"top_p": 0.8},
            {"min_p": 0.1}, {"epsilon_cutoff": 0.02},
            {"temperature": 1.3, "top_k": 10, "top_p": 0.9},
            {"repetition_penalty": 1.4, "no_repeat_ngram_size": 2, "top_p": 0.95}]


@pytest.mark.parametrize("setting", SAMPLING, ids=lambda d: ",".join(d) or "defaults")
def test_sampling_scores_equal_generates(device, name, setting):
    from paraprop.decoding import settings as st
    from paraprop.decoding.processors import Pipeline

    model = make(name, device, vocab=80)     # > 50 tokens: generate's default top_k=50 bites
    ids, mask = prompts(3, 5, device=device, vocab=80)
    torch.manual_seed(5)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                         eos_token_id=None, output_scores=True, return_dict_in_generate=True,
                         **setting)
    seq = out.sequences
    s = st.resolve(model, 5, {"do_sample": True, "eos_token_id": [], "max_new_tokens": 12},
                   transformers.GenerationConfig(**setting) if setting else None)
    pipe = Pipeline(s, 5, mask, device, 1.0)
    full = torch.cat([mask, torch.ones_like(seq[:, 5:])], 1)
    pos = (full.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(seq, attention_mask=full, position_ids=pos).logits[:, 4:-1]
    ours, _ = pipe.process(logits, seq, 0)
    theirs = torch.stack(out.scores, 1)
    assert torch.equal(ours.isinf(), theirs.isinf()), setting
    fin = theirs.isfinite()
    assert torch.allclose(ours[fin], theirs[fin], rtol=1e-5, atol=1e-6), setting
    if not setting:   # generate's default top_k=50 of 80 tokens is in force
        assert bool((theirs.isinf().sum(-1) >= 30).all())


@pytest.mark.parametrize("setting", [SAMPLING[i] for i in (0, 2, 5, 6, 7, 8)],
                         ids=lambda d: ",".join(d) or "defaults")
def test_sampling_equals_sequential(device, name, setting):
    model = make(name, device)
    ids, mask = prompts(3, 5, device=device)
    outs = []
    for method in ("sequential", "jacobi", "gs_jacobi"):
        g = torch.Generator().manual_seed(7)
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=25, do_sample=True,
                            generator=g, method=method, eos_token_id=[], **as_kwargs(setting))
        outs.append(out)
        assert sol.converged
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # the noise decides the sample: another seed gives another one
    g = torch.Generator().manual_seed(8)
    other, _ = generate(model, ids, attention_mask=mask, max_new_tokens=25, do_sample=True,
                        generator=g, eos_token_id=[], **as_kwargs(setting))
    assert not torch.equal(other, outs[0])


def test_sampling_from_the_model_config(device):
    """A pretrained model that samples by default (do_sample, temperature, top_p in its
    generation_config) samples here too, with the config's settings."""
    model = make("gpt2", device, fresh=True)
    ids, mask = prompts(2, 5, device=device)
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.6
    model.generation_config.top_p = 0.9
    u = torch.rand(2, 15, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    a, sa = generate(model, ids, attention_mask=mask, max_new_tokens=15, noise=u)
    b, _ = generate(model, ids, attention_mask=mask, max_new_tokens=15, noise=u,
                    do_sample=True, temperature=0.6, top_p=0.9, top_k=50)
    assert torch.equal(a, b) and sa.stats["processors"] == ["temperature", "top_k", "top_p"]
    greedy, sg = generate(model, ids, attention_mask=mask, max_new_tokens=15, do_sample=False)
    assert torch.equal(greedy, hf(model, ids, mask, 15)) and sg.stats["processors"] == []


def test_lengths_from_the_config(device):
    model = make("llama", device, fresh=True)
    ids, mask = prompts(2, 5, device=device)
    out, _ = generate(model, ids, attention_mask=mask, eos_token_id=[])   # generate: 20 new
    assert out.shape[1] == 25
    with pytest.warns(UserWarning, match="model-agnostic default `max_length`"):  # on purpose
        ref = model.generate(ids, attention_mask=mask, eos_token_id=None)
    assert torch.equal(out, ref)
    model.generation_config.max_new_tokens = 7
    out, _ = generate(model, ids, attention_mask=mask, eos_token_id=[])
    assert out.shape[1] == 12
    cfg = transformers.GenerationConfig(max_length=9)
    out, _ = generate(model, ids, attention_mask=mask, eos_token_id=[], generation_config=cfg,
                      max_new_tokens=None)
    assert out.shape[1] == 12   # the model's max_new_tokens=7 still wins over max_length
    model.generation_config.max_new_tokens = None
    out, _ = generate(model, ids, attention_mask=mask, eos_token_id=[], generation_config=cfg)
    assert out.shape[1] == 9


def test_mask_inferred_from_the_pad_token_as_generate_does(device):
    model = make("gpt2", device)
    ids, mask = prompts(3, 6, device=device)   # pads hold token 0, the model's pad_token_id
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    out, _ = generate(model, ids, max_new_tokens=10)
    assert torch.equal(out, ref) and torch.equal(out, hf(model, ids, mask, 10))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sequential_is_generate_bitwise_in_low_precision(device, name, dtype):
    """method='sequential' is generate's loop, the same operations in the same precision."""
    model = make(name, device, dtype)
    ids, mask = prompts(3, 6, device=device)
    for kw in ({}, {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3}):
        ref = hf(model, ids, mask, 30, eos_token_id=None, **kw)
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=30,
                            method="sequential", eos_token_id=[], **kw)
        assert torch.equal(out, ref) and sol.converged


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_certificate_is_sound(device, name, dtype):
    """Jacobi in bf16/fp16: each sample's tokens equal generate's up to its first uncertified
    position; with every position certified, all of them (converged=True)."""
    for seed in range(3):
        model = MODELS[name](seed=seed, vocab=400).to(device=device, dtype=dtype)
        ids, mask = prompts(3, 6, seed=seed, device=device, vocab=400)
        ref = hf(model, ids, mask, 30, eos_token_id=None)
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=30,
                            eos_token_id=[], throw=False)
        first = {}
        for b, t in sol.stats["uncertified"]:
            first[b] = min(first.get(b, 30), t)
        for b in range(3):
            t0 = first.get(b, 30)
            assert torch.equal(out[b, 6 : 6 + t0], ref[b, 6 : 6 + t0]), (seed, b)
        assert sol.converged == (sol.stats["uncertified"] == [])
        if sol.converged:
            assert torch.equal(out, ref)
            assert sol.stats["margin_ratio"] > 1


def test_certificate_failure_raises_with_throw():
    """An exact tie (two equal logits, which bf16 makes common) cannot be certified."""
    model = make("gpt2", "cpu", fresh=True)
    with torch.no_grad():   # token 7's embedding row equals token 5's: their logits tie exactly
        model.lm_head.weight[7] = model.lm_head.weight[5]
        model.lm_head.weight[5] += 10.0 * model.lm_head.weight[5].sign()
        model.lm_head.weight[7] = model.lm_head.weight[5]
    ids, _ = prompts(1, 4)
    out, sol = generate(model, ids, max_new_tokens=6, eos_token_id=[], throw=False)
    assert not sol.converged and (0, 1) in sol.stats["uncertified"]
    assert sol.result is Result.not_certified
    assert sol.message.endswith(sol.stats["uncertified_cause"])
    assert sol.stats["margin_ratio"] == 0.0
    with pytest.raises(paraprop_convergence(), match=r"new position 1 of sample 0 is not "
                       r"certified.*it is an exact tie in the gap between the best and the "
                       r"second-best processed score.*use method='sequential'") as e:
        generate(model, ids, max_new_tokens=6, eos_token_id=[])
    assert "float32" not in str(e.value) and "rounding difference" not in str(e.value)
    assert sol.stats["uncertified_cause"] == str(e.value)
    seq, s2 = generate(model, ids, max_new_tokens=6, eos_token_id=[], method="sequential")
    assert s2.converged and torch.equal(seq, hf(model, ids, torch.ones_like(ids), 6,
                                                eos_token_id=None))


def test_the_packed_transfer_gives_the_same_result(monkeypatch):
    """Off the CPU each pass sends the iterate and the previous pass's decisions, margins and
    fingerprints to the host in one float64 copy (on the CPU: views). Forced on the CPU, the
    copy gives the same tokens, margins, causes and repeat-check figures, bitwise (greedy and
    sampled, a padded batch with EOS, float32 and bfloat16)."""
    from paraprop.decoding.token_map import TokenMap

    ids, mask = prompts(3, 5)
    keys = ("model_calls", "margin_ratio", "uncertified", "repeat_checks", "repeat_ratio",
            "new_tokens", "fed_positions")
    for dtype in (torch.float32, torch.bfloat16):
        model = make("gpt2", "cpu", dtype)
        for kw in ({}, {"do_sample": True, "top_p": 0.9, "eos_token_id": [3]}):
            runs = []
            for packed in (False, True):
                monkeypatch.setattr(TokenMap, "PACKED", packed)
                out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=12,
                                    window=6, throw=False,
                                    generator=torch.Generator().manual_seed(1), **kw)
                runs.append((out, sol.converged, {k: sol.stats[k] for k in keys}))
            assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1:] == runs[1][1:], kw
            assert runs[0][2]["repeat_checks"] > 0


def paraprop_convergence():
    import paraprop
    return paraprop.ConvergenceError


def test_noise_is_drawn_on_the_generators_device(device):
    model = make("gpt2", device)
    ids, mask = prompts(2, 4, device=device)
    g = torch.Generator().manual_seed(11)       # a CPU generator, whatever the model's device
    out, _ = generate(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                      generator=g, eos_token_id=[])
    u = torch.rand(2, 12, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    ref, _ = generate(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                      noise=u.to(device), eos_token_id=[], method="sequential")
    assert torch.equal(out, ref)
    cpu = make("gpt2", "cpu")
    on_cpu, _ = generate(cpu, ids.cpu(), attention_mask=mask.cpu(), max_new_tokens=12,
                         do_sample=True, generator=torch.Generator().manual_seed(11),
                         eos_token_id=[])
    assert torch.equal(on_cpu, out.cpu())


def test_sampling_with_given_noise_and_adversarial_guesses(device, name, monkeypatch):
    """Guesses that are always wrong (the map's propose returns junk) cost passes, not
    exactness."""
    model = make(name, device)
    ids, mask = prompts(2, 4, device=device)
    u = torch.rand(2, 20, generator=torch.Generator().manual_seed(3),
                   dtype=torch.float64).to(device)
    ref, _ = generate(model, ids, attention_mask=mask, max_new_tokens=20, do_sample=True,
                      noise=u, method="sequential")
    from paraprop.decoding import token_map

    monkeypatch.setattr(token_map.TokenMap, "propose",
                        lambda self, x, final: torch.full_like(x, float(V - 1)))
    out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=20, do_sample=True,
                        noise=u)
    assert torch.equal(out, ref)
    assert sol.stats["model_calls"] <= 20


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


def test_margins_flag_exactly_the_decisions_a_small_change_flips():
    """The margin ratio against brute force: perturb the logits within the bound and see
    whether the decision moves (greedy, and sampling with top-k / top-p / min-p)."""
    from paraprop.decoding import settings as st
    from paraprop.decoding.processors import Pipeline

    g = torch.Generator().manual_seed(0)
    model = make("gpt2", "cpu")
    R = 512
    tokens = torch.randint(3, V, (R, 8), generator=g)
    for explicit in ({}, {"do_sample": True, "top_k": 6}, {"do_sample": True, "top_p": 0.7},
                     {"do_sample": True, "min_p": 0.2, "temperature": 0.8, "top_k": 0}):
        s = st.resolve(model, 8, {**explicit, "max_new_tokens": 1, "eos_token_id": []}, None)
        factor = 2e-3
        pipe = Pipeline(s, 8, None, "cpu", factor)
        logits = torch.randn(R, 1, V, generator=g) * 2
        u = torch.rand(R, 1, generator=g, dtype=torch.float64) if s.do_sample else None
        tok, ratio, cause = pipe.decide(logits, tokens, 0, u)
        assert bool((cause >= 0).all()) and int(cause.max()) < len(pipe.criteria())
        delta = factor * logits.abs().amax(-1, keepdim=True)
        moved = torch.zeros(R, dtype=torch.bool)
        for _ in range(100):
            noise = (torch.rand(logits.shape, generator=g) * 2 - 1) * delta
            moved |= (pipe.decide(logits + noise, tokens, 0, u)[0] != tok)[:, 0]
        # every decision a perturbation within the bound flipped has a ratio <= 1
        assert bool(moved.any()) and bool((ratio[moved, 0] <= 1).all()), explicit
        assert bool((ratio[:, 0] > 1).any()), explicit     # and the ratio is not always low


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
        pos = torch.arange(L0, L0 + input_ids.shape[1], device=input_ids.device)
        h = self.emb(input_ids) + self.pos(pos)
        q, k, v = self.qkv(h)[:, None].chunk(3, dim=-1)
        if past_key_values is not None:
            k = torch.cat([past_key_values[0][0], k], dim=-2)
            v = torch.cat([past_key_values[0][1], v], dim=-2)
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                          device=q.device).tril(L0)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(h + a[:, 0]), ((k, v),)


def test_any_module_with_the_cache_contract(device):
    torch.manual_seed(0)
    m = _TupleCacheLM().double().eval().to(device)
    ids = torch.randint(0, V, (2, 6), device=device)
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
    # sampling with generate's defaults (top_k=50) needs no transformers config either
    u = torch.rand(2, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a, _ = generate(m, ids, max_new_tokens=10, do_sample=True, noise=u.to(device))
    b, _ = generate(m, ids, max_new_tokens=10, do_sample=True, noise=u.to(device),
                    method="sequential")
    assert torch.equal(a, b)


def test_a_model_without_position_ids_takes_left_padding(device):
    """Bloom takes attention_mask but no position_ids (its ALiBi positions come from the
    mask): left-padded batches are generate's tokens, with the mask alone, as generate passes
    it."""
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.BloomForCausalLM(cfg).eval().to(device)
    ids, mask = prompts(3, 7, device=device)
    ref = hf(model, ids, mask, 12, eos_token_id=None)
    for method in ("sequential", "jacobi"):
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=12, method=method,
                            eos_token_id=[])
        assert torch.equal(out, ref) and sol.converged, method


def test_errors(name):
    model = make(name, "cpu")
    ids, mask = prompts(3, 5)
    with pytest.raises(TypeError, match="cache contract"):
        generate(torch.nn.Linear(3, 3), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
        generate(model, ids, max_new_tokens=0)
    # the one window rule of decoding and diffusion (checks.window_option): a window larger
    # than max_new_tokens is Jacobi on all of them; a method that slides none refuses one
    ref, _ = generate(model, ids, attention_mask=mask, max_new_tokens=4, method="sequential")
    out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=4, window=9)
    assert torch.equal(out, ref) and sol.converged and sol.stats["window"] == 4
    with pytest.raises(ValueError, match=r"window is an option of 'jacobi', 'gs_jacobi', not of "
                                         r"method='sequential', got window=4"):
        generate(model, ids, max_new_tokens=4, method="sequential", window=4)
    with pytest.raises(ValueError, match=r"window configures the named methods .* a solver "
                                         r"object carries its own settings"):
        generate(model, ids, max_new_tokens=4, method=solvers.SlidingJacobi(2), window=2)
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids"):
        generate(model, ids, max_new_tokens=4, attention_mask=mask[:, :4])
    with pytest.raises(ValueError, match="pad prompts on the left"):
        generate(model, ids, max_new_tokens=4, attention_mask=mask.flip(1))
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        generate(model, ids.double(), max_new_tokens=4)
    with pytest.raises(ValueError, match="top_k applies to sampling; pass do_sample=True"):
        generate(model, ids, max_new_tokens=4, top_k=3)
    with pytest.raises(ValueError, match="min_p applies to sampling"):
        generate(model, ids, max_new_tokens=4, min_p=0.1)
    with pytest.raises(ValueError, match="top_p must be a number in"):
        generate(model, ids, max_new_tokens=4, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be"):
        generate(model, ids, max_new_tokens=4, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match="repetition_penalty must be"):
        generate(model, ids, max_new_tokens=4, repetition_penalty=-1.0)
    with pytest.raises(ValueError, match=r"noise must be a float tensor of shape \(3, 4\)"):
        generate(model, ids, max_new_tokens=4, do_sample=True, noise=torch.rand(3, 5))
    with pytest.raises(ValueError, match="unknown method"):
        generate(model, ids, max_new_tokens=4, method="newton")
    with pytest.raises(ValueError, match="not supported by decoding"):
        generate(model, ids, max_new_tokens=4, method=solvers.Jacobi())
    with pytest.raises(TypeError, match="generation_config must be a transformers "
                                        "GenerationConfig or None, got dict"):
        generate(model, ids, max_new_tokens=4, generation_config={"top_k": 3})
    with pytest.raises(ValueError, match=r"max_length=4 leaves no room for new tokens after a "
                                         r"prompt of 5 positions"):
        generate(model, ids, generation_config=transformers.GenerationConfig(max_length=4))
    with pytest.raises(ValueError, match=r"attention_mask must be left padding.*inferred, as "
                                         r"generate does, from the positions holding "
                                         r"pad_token_id=0"):
        generate(model, torch.tensor([[5, 0, 7]]), max_new_tokens=3)


def test_cached_lm_never_serves_a_stale_entry():
    """CachedLM against a full pass without a cache, while tokens change under it and the
    requested ranges jump back and forth (the cases a solver may produce)."""
    from paraprop.decoding.lm import CachedLM

    model = make("gpt2", "cpu")
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


def test_the_map_is_a_function_of_the_prefix():
    """A full evaluation of the token map after the solve agrees with the window passes (it
    reuses their decisions, so a solver's verification pass cannot see a rounding flip), and
    costs no model call."""
    from paraprop.decoding import token_map

    seen = {}
    orig = token_map.TokenMap.check_final

    def spy(self, x):
        calls = self.lm.calls
        orig(self, x)
        seen["calls"] = self.lm.calls - calls
        seen["full"] = self(x)
        seen["x"] = x

    model = make("llama", "cpu")
    ids, mask = prompts(3, 5)
    try:
        token_map.TokenMap.check_final = spy
        generate(model, ids, attention_mask=mask, max_new_tokens=20)
    finally:
        token_map.TokenMap.check_final = orig
    assert seen["calls"] == 0 and torch.equal(seen["full"], seen["x"])


def test_generation_config_argument_is_not_mutated():
    model = make("gpt2", "cpu", fresh=True)
    cfg = transformers.GenerationConfig(repetition_penalty=1.2)
    before = copy.deepcopy(cfg.to_dict()), copy.deepcopy(model.generation_config.to_dict())
    ids, _ = prompts(1, 4)
    generate(model, ids, max_new_tokens=5, generation_config=cfg)
    assert (cfg.to_dict(), model.generation_config.to_dict()) == before


def test_the_settings_table_of_the_docs_names_every_field():
    """docs/decoding.md lists every field the code honours, ignores as harmless or refuses."""
    from pathlib import Path

    from paraprop.decoding import settings as st

    page = (Path(__file__).resolve().parents[1] / "docs" / "decoding.md").read_text()
    named = set(re.findall(r"`([a-z_]+)`", page))
    fields = st.HONOURED | st.HARMLESS | set(st.REFUSED)
    private = {f for f in fields if f.startswith("_")} | {"transformers_version"}
    assert sorted(fields - private - named) == []
