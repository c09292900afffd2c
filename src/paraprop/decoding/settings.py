"""The generation settings of :func:`paraprop.decoding.generate`, resolved as ``transformers``'
``generate`` resolves them, and the checks of the model and the prompt.

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
import math
from dataclasses import dataclass, field

import torch

from paraprop import checks

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


# -- the model and the prompt ------------------------------------------------------------------

def _text_config(model):
    cfg = getattr(model, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text()
        except TypeError:
            return cfg
    return cfg


def max_positions(model, cfg=None) -> int | None:
    """``config.max_position_embeddings`` (``n_positions`` for GPT-2), or ``None``
    (``cfg``: the model's text configuration, where the caller has it)."""
    cfg = _text_config(model) if cfg is None else cfg
    for name in ("max_position_embeddings", "n_positions"):
        v = getattr(cfg, name, None)
        if checks.is_int(v) and v > 0:
            return v
    return None


def vocab_size(model, cfg=None) -> int | None:
    """The token ids the model embeds: its input embedding's rows (``get_input_embeddings``),
    else ``config.vocab_size``, else ``None`` (``cfg``: as for :func:`max_positions`)."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (AttributeError, NotImplementedError):
            emb = None
        rows = getattr(emb, "num_embeddings", None)
        if checks.is_int(rows) and rows > 0:
            return rows
    v = getattr(_text_config(model) if cfg is None else cfg, "vocab_size", None)
    return v if checks.is_int(v) and v > 0 else None


def num_layers(model) -> int:
    """``config.num_hidden_layers`` (``n_layer`` for GPT-2), or 1 when the model does not say."""
    cfg = _text_config(model)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        v = getattr(cfg, name, None)
        if checks.is_int(v) and v > 0:
            return v
    return 1


def check_causal(model) -> None:
    """Refuse an encoder-decoder model (T5, BART, ...): it is not a causal LM."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        raise TypeError(f"decoding.generate: model {type(model).__name__} is an encoder-decoder "
                        "model (config.is_encoder_decoder=True), not a causal LM; decoding "
                        "needs a decoder-only causal LM (e.g. GPT-2, Llama, Mistral)")


def check_model(model, input_ids: torch.Tensor, s: Settings) -> None:
    """Refuse, with a clear message, what the cache-cropping token system cannot run: a sliding
    or chunked attention window that would bind, more positions than the model has, token ids
    outside the vocabulary, or a prompt on another device than the model."""
    name = type(model).__name__
    P, T = input_ids.shape[1], s.max_new_tokens
    total = P + T
    tcfg = _text_config(model)
    sw = sliding_window(tcfg)
    if sw is not None and total > sw:
        raise ValueError(
            f"decoding.generate: model {name} has sliding-window attention (sliding_window={sw}), "
            f"and the prompt ({P} positions) plus max_new_tokens={T} make {total} > {sw} "
            "positions: its cache drops positions that the cropping of Jacobi decoding needs. "
            f"Keep prompt length + max_new_tokens <= {sw} (where the window never binds and "
            "the tokens are generate's), or use model.generate")
    chunk = getattr(tcfg, "attention_chunk_size", None)
    if checks.is_int(chunk) and chunk > 0 and total > chunk:
        raise ValueError(f"decoding.generate: model {name} has chunked attention "
                         f"(attention_chunk_size={chunk}) and the prompt ({P}) plus "
                         f"max_new_tokens={T} make {total} > {chunk} positions; keep them "
                         f"within {chunk}")
    limit = max_positions(model, tcfg)
    if limit is not None and total > limit:
        raise ValueError(f"decoding.generate: the prompt ({P} positions) plus max_new_tokens={T} "
                         f"make {total} positions, more than the model's "
                         f"max_position_embeddings={limit}; shorten the prompt or generate at "
                         f"most {max(limit - P, 0)} new tokens")
    V = vocab_size(model, tcfg)
    lo, hi = torch.stack(torch.aminmax(input_ids)).tolist()       # one sync
    if lo < 0:
        raise ValueError(f"input_ids holds the negative token id {lo}; token ids must be in "
                         f"[0, {V if V is not None else 'vocab_size'})")
    if V is not None:
        if hi >= V:
            raise ValueError(f"input_ids holds the token id {hi}, outside the model's vocabulary "
                             f"of vocab_size={V} (ids must be in [0, {V}))")
        if s.pad >= V:
            raise ValueError(f"pad_token_id={s.pad} is outside the model's vocabulary of "
                             f"vocab_size={V}; it is fed to the model after EOS and as the "
                             "first guess, so it must be in [0, vocab_size)")
    params = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    if params is not None and params.device != input_ids.device:
        raise ValueError(f"input_ids is on {input_ids.device} but model {name} is on "
                         f"{params.device}; move them to the same device")


def sliding_window(cfg) -> int | None:
    """The attention window of a sliding-window model, or ``None`` when none applies:
    Mistral-style ``sliding_window``; Qwen2-style ``use_sliding_window``; and ``layer_types``
    with ``"sliding_attention"`` layers (Gemma, Qwen2 with ``max_window_layers``)."""
    sw = getattr(cfg, "sliding_window", None)
    if not checks.is_int(sw) or sw <= 0:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return sw if "sliding_attention" in types else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return sw


def rounding_factor(model, logits: torch.Tensor) -> tuple[float, torch.dtype]:
    """The factor ``c`` of the low-precision certificate's bound ``c * max|logits|`` on the
    difference between the logits of a window pass and of the sequential loop's one-token pass,
    and the dtype it was taken for: the coarsest of the logits' dtype, the model's floating
    parameter dtypes, an enabled autocast dtype, and float32 (the scores are processed in
    float32, as ``generate`` processes them). ``c = k * eps * sqrt(layers)`` with ``k = 2`` for
    16-bit types and ``8`` otherwise (see decoding.md: the differences measured on the test
    models stayed below half of it)."""
    dtypes = {logits.dtype, torch.float32}
    if isinstance(model, torch.nn.Module):     # each module's own parameters: one walk
        dtypes |= {p.dtype for m in model.modules() for p in m._parameters.values()
                   if p is not None and p.is_floating_point()}
    elif hasattr(model, "parameters"):
        dtypes |= {p.dtype for p in model.parameters() if p.is_floating_point()}
    kind = logits.device.type
    if torch.is_autocast_enabled(kind):
        dtypes.add(torch.get_autocast_dtype(kind))
    coarse = max(dtypes, key=lambda d: torch.finfo(d).eps)
    eps = torch.finfo(coarse).eps
    k = 2.0 if torch.finfo(coarse).bits <= 16 else 8.0
    return k * eps * math.sqrt(num_layers(model)), coarse
