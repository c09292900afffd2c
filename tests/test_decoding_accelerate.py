"""paraprop.decoding.accelerate: model.generate through paraprop where every setting of the call
is implemented (the tokens of transformers' own generate, bitwise), and transformers' generate
itself, with a named FallThroughWarning, everywhere else."""

from __future__ import annotations

import copy
import pickle
import re
import warnings

import pytest
import torch

import paraprop
from paraprop import FallThroughWarning
from paraprop.decoding import accelerate, generate

transformers = pytest.importorskip("transformers")

V = 53
pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt2(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=96, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=96,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def prompts(B=3, P=6, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    if B > 1:   # left padding of different lengths
        mask[1, : P // 2] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def served(handle, calls=1):
    return handle.counters.served == calls and handle.counters.fell_through == 0


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_greedy_is_generates_with_the_models_own_config(device, make):
    """The model's generation_config as a pretrained model ships it (a repetition penalty and
    no-repeat n-grams), a left-padded batch: bitwise generate's tokens, in fewer passes."""
    model = make().to(device)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.no_repeat_ngram_size = 3
    ids, mask = prompts(device=device)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    with accelerate(model) as handle:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, ref) and served(handle)
    assert handle.counters.model_calls <= 30 and handle.counters.new_tokens == out.shape[1] - 6
    assert handle.solution is not None and handle.solution.converged
    assert "generate" not in vars(model)   # undone on exit


def test_positional_inputs_a_generation_config_and_keywords_merge_as_generate_merges():
    model = _gpt2()
    ids, mask = prompts(B=2)
    cfg = transformers.GenerationConfig(max_new_tokens=25, repetition_penalty=1.2)
    kw = dict(attention_mask=mask, no_repeat_ngram_size=2, eos_token_id=None,
              suppress_tokens=[7, 8])
    ref = model.generate(ids, cfg, **kw)
    handle = accelerate(model, window=8)
    try:
        out = model.generate(ids, cfg, **kw)
        again = model.generate(input_ids=ids, generation_config=cfg, **kw)
    finally:
        handle.undo()
    assert torch.equal(out, ref) and torch.equal(again, ref) and served(handle, 2)
    assert out.shape[1] == ids.shape[1] + 25   # eos_token_id=None: no EOS, as generate
    assert not (out[:, ids.shape[1]:] == 7).any()
    handle.undo()   # again: nothing
    assert not handle.active and "generate" not in vars(model)


def _fall(model, ids, mask, match, **kw):
    """One call that must fall through with ``match``; returns (accelerated, plain) outputs,
    each after torch.manual_seed(0), and the handle."""
    torch.manual_seed(0)
    ref = model.generate(ids, attention_mask=mask, **kw)
    with accelerate(model) as handle:
        torch.manual_seed(0)
        with pytest.warns(FallThroughWarning, match=match):
            out = model.generate(ids, attention_mask=mask, **kw)
    assert handle.counters.fell_through == 1 and handle.counters.served == 0
    assert re.search(match, handle.reasons[0][1])
    return out, ref, handle


@pytest.mark.parametrize(("kw", "match"), [
    ({"do_sample": True, "top_k": 10}, r"it samples: generate draws with torch\.multinomial"),
    ({"num_beams": 2}, r"refused the call: .*num_beams"),
    ({"logits_processor": "list"}, r"logits_processor is set"),
    ({"return_dict_in_generate": True, "output_scores": True},
     r"return_dict_in_generate=True asks for more than the tokens"),
    ({"use_cache": False}, r"use_cache=False is passed"),
    ({"pad_token_id": None}, r"pad_token_id=None is passed"),
], ids=["sampling", "beams", "processor", "dict", "no-cache", "pad-none"])
def test_what_paraprop_does_not_implement_falls_through_by_name(kw, match):
    model = _gpt2()
    ids, mask = prompts(B=2)
    if kw.get("logits_processor") == "list":
        kw = {"logits_processor": transformers.LogitsProcessorList(
            [transformers.TemperatureLogitsWarper(0.7)])}
    out, ref, _ = _fall(model, ids, mask, match, max_new_tokens=12, **kw)
    if isinstance(ref, torch.Tensor):
        assert torch.equal(out, ref)
    else:
        assert torch.equal(out.sequences, ref.sequences)


def test_other_model_arguments_and_a_streamer_fall_through():
    model = _gpt2()
    ids, mask = prompts(B=1)
    embeds = model.get_input_embeddings()(ids)
    torch.manual_seed(0)
    ref = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=6,
                         do_sample=False)
    with accelerate(model) as handle:
        with pytest.warns(FallThroughWarning, match="no .batch, length. tensor of token ids"):
            out = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=6,
                                 do_sample=False)
        streamed = []

        class Streamer(transformers.generation.BaseStreamer):
            def put(self, value):
                streamed.append(value)

            def end(self):
                streamed.append(None)

        with pytest.warns(FallThroughWarning, match="streamer is set"):
            model.generate(ids, max_new_tokens=4, do_sample=False, streamer=Streamer())
        assert len(streamed) == 6 and streamed[-1] is None   # the prompt, 4 tokens, the end
        with pytest.warns(FallThroughWarning, match=r"model arguments \['position_ids'\]"):
            model.generate(ids, max_new_tokens=4, do_sample=False,
                           position_ids=torch.arange(6)[None])
    assert torch.equal(out, ref) and handle.counters.fell_through == 3


def test_a_fall_through_warns_once_per_reason():
    model = _gpt2()
    ids, mask = prompts(B=1)
    with accelerate(model) as handle, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False)
    assert sum(issubclass(w.category, FallThroughWarning) for w in seen) == 1
    assert [c for c, _ in handle.reasons] == [1, 2, 3]


def test_a_train_mode_model_falls_through_to_generates_own_run():
    model = _gpt2(resid_pdrop=0.3)
    model.train()
    ids, mask = prompts(B=1)
    out, ref, _ = _fall(model, ids, mask, r"refused the call: .*model\.eval\(\)",
                        max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)


def test_uncertified_tokens_fall_through():
    """All-zero logits: every greedy decision is an exact tie, which paraprop does not
    certify; generate's own tokens come back (its argmax takes the first index)."""
    model = _gpt2()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    ids, mask = prompts(B=1)
    out, ref, _ = _fall(model, ids, mask, r"not certified .*tie", max_new_tokens=6,
                        do_sample=False, eos_token_id=None)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("coupling", ["gumbel", "inverse_cdf"])
def test_sampling_with_a_coupling_is_paraprops_sequential_sampler(coupling):
    model = _gpt2()
    model.generation_config.do_sample = True      # a pretrained model's sampling config
    model.generation_config.temperature = 0.8
    model.generation_config.top_k = 20
    ids, mask = prompts(B=2)
    with accelerate(model, coupling=coupling) as handle:
        torch.manual_seed(5)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20)
    torch.manual_seed(5)
    ref, sol = generate(model, ids, attention_mask=mask, max_new_tokens=20,
                        method="sequential", coupling=coupling)
    assert torch.equal(out, ref) and served(handle)
    assert handle.solution.stats["coupling"] == coupling


def test_copies_are_plain_models_and_the_handle_is_not_copied():
    model = _gpt2()
    ids, mask = prompts(B=1)
    with accelerate(model) as handle:
        twin = copy.deepcopy(model)
        loaded = pickle.loads(pickle.dumps(model))
        for other in (twin, loaded):
            assert other.__dict__.get("_paraprop_decoding_accelerate") is None
            out = other.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
            assert out.shape == (1, 11)
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            pickle.dumps(handle)
    assert handle.counters.calls == 0   # the copies' calls were not the model's


def test_bad_arguments_are_refused_by_name():
    model = _gpt2()
    with pytest.raises(ValueError,
                       match=r"unknown coupling='gumbell'; choose one of None, gumbel, inverse"):
        accelerate(model, coupling="gumbell")
    with pytest.raises(ValueError, match="window"):
        accelerate(model, window=0)
    # a method the window or the batch advance does not fit: refused up front, not per call
    with pytest.raises(ValueError, match=r"batch_advance='per-sample' applies to "
                                         r"method='jacobi' \(the sliding window\), got "
                                         r"method='gs_jacobi'"):
        accelerate(model, method="gs_jacobi", batch_advance="per-sample")
    with pytest.raises(ValueError, match=r"window is an option of 'jacobi', 'gs_jacobi', not "
                                         r"of method='sequential', got window=4"):
        accelerate(model, method="sequential", window=4)
    with pytest.raises(ValueError, match=r"unknown method='bogus'"):
        accelerate(model, method="bogus")
    assert not {"generate", "_paraprop_decoding_accelerate"} & set(model.__dict__)
    with pytest.raises(TypeError, match="must have a generate method"):
        accelerate(torch.nn.Linear(2, 2))
    with accelerate(model), pytest.raises(ValueError, match="already accelerated"):
        accelerate(model)
    assert repr(paraprop.decoding.accelerate(model)).startswith("Accelerated(GPT2LMHeadModel")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_model_gets_generates_tokens_served_or_not(dtype):
    """In bfloat16/float16 a window pass rounds apart from generate's one-token pass: what
    paraprop serves is certified (generate's tokens), anything else falls through to generate
    itself; either way the call returns generate's tokens."""
    model = _gpt2().to(dtype)
    model.generation_config.repetition_penalty = 1.2
    ids, mask = prompts(B=2)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    with accelerate(model) as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore", FallThroughWarning)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, ref)
    assert handle.counters.served + handle.counters.fell_through == 1
    if handle.counters.served:
        assert handle.solution is not None and handle.solution.converged
    else:
        assert "not certified" in handle.reasons[0][1]
