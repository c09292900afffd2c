"""The generation settings of :func:`paraprop.decoding.generate`, resolved as ``transformers``'
``generate`` resolves them (the model's own checks: :mod:`paraprop.decoding.model_checks`).

``generate`` reads its settings from, in order of priority: the arguments of the call, a
``generation_config`` passed to it, ``model.generation_config`` (a pretrained model's own
settings), then its global defaults (``GenerationConfig._get_default_generation_params``:
``top_k=50`` among them). :func:`resolve` does the same, and then sorts every field that is set:

* **honoured**: the lengths, the special tokens, greedy or sampling, and every logits processor
  that keeps the tokens a triangular system (each position's scores depend only on its prefix);
* **harmless**: fields that do not change greedy or sampled tokens of a decoder-only model
  (output flags, beam-only settings with one beam, assistant settings without an assistant);
* **refused**: everything else (beam search, contrastive search, assisted decoding, watermarking,
  guidance, constraints, stop strings, ...), by name, with its value and where it came from.
  A field this module does not know is refused too, so that a new ``transformers`` setting is
  never ignored silently.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from paraprop import checks
from paraprop.decoding.model_checks import max_positions

# generate's global defaults (transformers 5: GenerationConfig._get_default_generation_params;
# transformers 4 has them as the GenerationConfig() defaults), for the fields read here
DEFAULTS = {
    "max_length": 20, "min_length": 0, "do_sample": False, "temperature": 1.0, "top_k": 50,
    "top_p": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "epsilon_cutoff": 0.0,
    "remove_invalid_values": False, "renormalize_logits": False,
}

# the fields resolve() honours (each one is read below)
HONOURED = frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature",
    "top_k", "top_p", "min_p", "epsilon_cutoff", "repetition_penalty", "no_repeat_ngram_size",
    "bad_words_ids", "sequence_bias", "suppress_tokens", "begin_suppress_tokens",
    "forced_bos_token_id", "forced_eos_token_id", "eos_token_id", "pad_token_id",
    "remove_invalid_values", "renormalize_logits",
})

# fields that do not change the tokens of greedy or sampled decoding of a decoder-only model
HARMLESS = frozenset({
    "output_attentions", "output_hidden_states", "output_scores", "output_logits",
    "return_dict_in_generate", "transformers_version", "_from_model_config", "_commit_hash",
    "_original_object_hash",
    "bos_token_id",            # used only to start a generation without a prompt
    "decoder_start_token_id",  # encoder-decoder models only
    "use_cache",               # the tokens are those of the cached loop (see decoding.md)
    "cache_config", "max_cache_len", "compile_config", "disable_compile",
    "length_penalty", "early_stopping", "low_memory",            # beam search only
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind", "is_assistant",  # with an assistant only
    "max_matching_ngram_size",                                    # prompt lookup only
    "continuous_batching_config",
    "return_legacy_cache",                                        # transformers 4: cache format
})

# fields refused unless they hold their neutral value: field -> (neutral values, what to do)
REFUSED = {
    "num_beams": ((1,), "beam search keeps several hypotheses per sample, which is not one "
                  "triangular system; use num_beams=1 (greedy or sampling)"),
    "num_beam_groups": ((1,), "group beam search is not implemented; use num_beam_groups=1"),
    "diversity_penalty": ((0.0,), "it applies to group beam search only, which is not "
                          "implemented; use diversity_penalty=0.0"),
    "penalty_alpha": ((0.0,), "contrastive search re-ranks candidates with their hidden "
                      "states; use penalty_alpha=None (greedy)"),
    "num_return_sequences": ((1,), "one sequence per prompt is generated; repeat the prompts "
                             "instead (input_ids.repeat_interleave(n, 0))"),
    "typical_p": ((1.0,), "typical sampling is not implemented; use top_p or min_p"),
    "eta_cutoff": ((0.0,), "eta sampling is not implemented; use epsilon_cutoff or min_p"),
    "top_h": ((), "top-h sampling is not implemented; use top_p or min_p"),
    "encoder_repetition_penalty": ((1.0,), "it is an encoder-decoder setting; use "
                                   "repetition_penalty"),
    "encoder_no_repeat_ngram_size": ((0,), "it is an encoder-decoder setting; use "
                                     "no_repeat_ngram_size"),
    "exponential_decay_length_penalty": ((), "the length penalty on EOS is not implemented; "
                                         "use min_new_tokens or forced_eos_token_id"),
    "guidance_scale": ((1.0,), "classifier-free guidance runs a second, unconditional model "
                       "pass; it is not implemented"),
    "constraints": ((), "constrained beam search is not implemented"),
    "force_words_ids": ((), "constrained beam search is not implemented"),
    "stop_strings": ((), "stop strings need the tokenizer; use eos_token_id"),
    "max_time": ((), "a time limit makes the output depend on the speed of the machine; use "
                 "max_new_tokens"),
    "watermarking_config": ((), "watermarking is not implemented"),
    "dola_layers": ((), "DoLa decoding contrasts layers; it is not implemented"),
    "prompt_lookup_num_tokens": ((), "paraprop does its own parallel decoding (with n-gram "
                                 "guesses: the ngram argument)"),
    "assistant_early_exit": ((), "assisted decoding is not implemented; paraprop does its own "
                             "parallel decoding"),
    "assistant_ensemble_weight": ((), "assisted decoding is not implemented"),
    "speculation_type": ((), "speculative decoding is not implemented; paraprop does its own "
                         "parallel decoding"),
    "use_mtp": ((False,), "multi-token prediction heads are not used; use use_mtp=False"),
    "token_healing": ((False,), "token healing needs the tokenizer; heal the prompt first"),
    "prefill_chunk_size": ((), "the prompt is prefilled in one pass, as generate does without "
                           "it; unset prefill_chunk_size"),
    "forced_decoder_ids": ((), "forced decoder ids (Whisper, transformers 4) are not "
                           "implemented; use forced_bos_token_id or suppress_tokens"),
    "generation_kwargs": (({},), "extra generate keyword arguments (for an assistant, "
                          "transformers 4) are not implemented"),
    "cache_implementation": (("dynamic", "hybrid"), "paraprop decodes with the model's "
                             "dynamic cache, cropped to the accepted prefix; unset "
                             "cache_implementation"),
}

# settings that only apply to sampling (an explicit one without do_sample=True is refused)
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "epsilon_cutoff")


@dataclass
class Settings:
    """The effective settings of one call (see the module doc)."""

    max_new_tokens: int
    max_length: int
    do_sample: bool
    eos: list[int]
    pad: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    epsilon_cutoff: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int = 0
    min_length: int = 0
    min_new_tokens: int | None = None
    bad_words_ids: list | None = None
    sequence_bias: object = None
    suppress_tokens: list | None = None
    begin_suppress_tokens: list | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: object = None
    remove_invalid_values: bool = False
    renormalize_logits: bool = False
    sources: dict = field(default_factory=dict)   # field -> where its value came from


def _config_dict(cfg, name: str) -> dict:
    if cfg is None:
        return {}
    to_dict = getattr(cfg, "to_dict", None)
    if not callable(to_dict):
        raise TypeError(f"{name} must be a transformers GenerationConfig or None, got "
                        f"{type(cfg).__name__}")
    return {k: v for k, v in to_dict().items() if v is not None}


@functools.cache
def _known_fields() -> frozenset[str] | None:
    """The fields of the installed ``GenerationConfig`` (``None`` without transformers), read
    once per process (a default ``GenerationConfig`` and its ``to_dict`` cost ~0.1 ms)."""
    try:
        from transformers import GenerationConfig
    except ImportError:
        return None
    return frozenset(GenerationConfig().to_dict())


def resolve(model, P: int, explicit: dict, generation_config=None) -> Settings:
    """The effective settings for a prompt of ``P`` positions (see the module doc).

    Arguments:
        model: the model (its ``generation_config`` is read when it has one).
        P: the prompt length (padding included), as ``generate`` counts it.
        explicit: the settings passed to the call (``None`` values mean "not passed").
        generation_config: a ``GenerationConfig`` passed to the call, or ``None``.

    Raises:
        ValueError: a refused setting (named, with its value, where it came from and what to
            use instead), or a bad value of an honoured one.
    """
    layers = [("the default", DEFAULTS),
              ("model.generation_config",
               _config_dict(getattr(model, "generation_config", None),
                            "model.generation_config")),
              ("generation_config", _config_dict(generation_config, "generation_config")),
              ("the argument", {k: v for k, v in explicit.items() if v is not None})]
    merged, sources = {}, {}
    for source, values in layers:
        for k, v in values.items():
            merged[k], sources[k] = v, source
    _refuse(merged, sources)
    get = merged.get

    do_sample = checks.boolean("do_sample", get("do_sample"))
    for name in SAMPLING:
        if not do_sample and explicit.get(name) is not None:
            raise ValueError(f"{name} applies to sampling; pass do_sample=True (got {name}="
                             f"{explicit[name]!r} with do_sample=False)")
    eos = _token_list("eos_token_id", get("eos_token_id"))
    pad = get("pad_token_id")
    if pad is None:
        pad = eos[0] if eos else 0      # generate: the first EOS pads; without EOS it is unused
    checks.nonneg_int("pad_token_id", pad)

    # lengths, as generate's _prepare_generated_length
    max_length_set = any("max_length" in values for _, values in layers[1:])
    T = get("max_new_tokens")
    if T is not None:
        checks.positive_int("max_new_tokens", T)
    else:
        max_length = checks.positive_int("max_length", get("max_length"))
        if not max_length_set:          # generate's default: 20 new tokens, within the positions
            max_length = max_length + P
            limit = max_positions(model)
            if limit is not None:
                max_length = min(max_length, limit)
        if max_length <= P:
            raise ValueError(f"max_length={max_length} leaves no room for new tokens after a "
                             f"prompt of {P} positions; pass max_new_tokens")
        T = max_length - P
    min_new = get("min_new_tokens")
    checks.nonneg_int("min_new_tokens", min_new, allow_none=True)
    min_length = checks.nonneg_int("min_length", get("min_length"))
    if min_new is not None:
        min_length = min_new + P

    s = Settings(max_new_tokens=T, max_length=P + T, do_sample=do_sample, eos=eos, pad=pad,
                 min_length=min_length, min_new_tokens=min_new, sources=sources)
    s.repetition_penalty = _number_or_none("repetition_penalty", get("repetition_penalty"),
                                           neutral=1.0, positive=True)
    s.no_repeat_ngram_size = checks.nonneg_int("no_repeat_ngram_size",
                                               get("no_repeat_ngram_size"))
    s.bad_words_ids = get("bad_words_ids")
    s.sequence_bias = get("sequence_bias")
    s.suppress_tokens = get("suppress_tokens")
    s.begin_suppress_tokens = get("begin_suppress_tokens")
    s.forced_bos_token_id = checks.nonneg_int("forced_bos_token_id",
                                              get("forced_bos_token_id"), allow_none=True)
    s.forced_eos_token_id = get("forced_eos_token_id")
    if s.forced_eos_token_id is not None:
        _token_list("forced_eos_token_id", s.forced_eos_token_id)
    s.remove_invalid_values = bool(checks.boolean("remove_invalid_values",
                                                  get("remove_invalid_values")))
    s.renormalize_logits = bool(checks.boolean("renormalize_logits", get("renormalize_logits")))
    if do_sample:
        s.temperature = checks.positive_number("temperature", get("temperature"), finite=True)
        top_k = checks.nonneg_int("top_k", get("top_k"))
        s.top_k = top_k or None                          # generate: 0 means no top-k
        top_p = get("top_p")
        if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        s.top_p = top_p if top_p < 1.0 else None
        min_p = get("min_p")
        if min_p is not None and (isinstance(min_p, bool) or not isinstance(min_p, int | float)
                                  or not 0 <= min_p <= 1):
            raise ValueError(f"min_p must be a number in [0, 1], got {min_p!r}")
        s.min_p = min_p
        eps = get("epsilon_cutoff")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < 1:
            raise ValueError(f"epsilon_cutoff must be a number in [0, 1), got {eps!r}")
        s.epsilon_cutoff = eps if eps > 0 else None
    return s


def _refuse(merged: dict, sources: dict) -> None:
    known = _known_fields()
    for name, value in merged.items():
        if name in HONOURED or name in HARMLESS:
            continue
        if name in REFUSED:
            neutral, why = REFUSED[name]
            if value in neutral:
                continue
            want = " or ".join(repr(v) for v in neutral) if neutral else "None"
            raise ValueError(f"decoding.generate: the generation setting {name}={value!r} (from "
                             f"{sources[name]}) is not supported: {why} (expected {want})")
        if name in DEFAULTS or (known is not None and name not in known):
            continue     # a global default, or a custom entry that generate does not read either
        raise ValueError(f"decoding.generate: the generation setting {name}={value!r} (from "
                         f"{sources[name]}) is not known to paraprop, so it cannot promise "
                         "generate's tokens with it; unset it (expected None)")


def _number_or_none(name: str, value, *, neutral: float, positive: bool):
    if value is None:
        return None
    if positive:
        checks.positive_number(name, value, finite=True)
    return None if value == neutral else float(value)


def _token_list(name: str, value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    items = [value] if not isinstance(value, list | tuple) else list(value)
    for v in items:
        checks.nonneg_int(name, v)
    return items
