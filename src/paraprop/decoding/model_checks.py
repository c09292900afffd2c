"""What :func:`paraprop.decoding.generate` reads of the model and checks before it decodes: the
model's configuration (positions, vocabulary, depth, attention window; :func:`max_positions`,
:func:`vocab_size`, :func:`num_layers`, :func:`sliding_window`), the refusals of a model or
prompt that the cache-cropping token system cannot run (:func:`check_causal`,
:func:`check_model`), and the rounding bound of the certificate (:func:`rounding_factor`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from paraprop import checks


def _text_config(model):
    cfg = getattr(model, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text()
        except TypeError:
            return cfg
    return cfg


def _positive_int(obj, *names: str) -> int | None:
    """The first of ``obj``'s attributes ``names`` that is a positive int, else ``None``."""
    for name in names:
        v: Any = getattr(obj, name, None)       # a configuration's attribute: anything
        if checks.is_int(v) and v > 0:
            return v
    return None


def max_positions(model, cfg=None) -> int | None:
    """``config.max_position_embeddings`` (``n_positions`` for GPT-2), or ``None``
    (``cfg``: the model's text configuration, where the caller has it)."""
    return _positive_int(_text_config(model) if cfg is None else cfg,
                         "max_position_embeddings", "n_positions")


def vocab_size(model, cfg=None) -> int | None:
    """The token ids the model embeds: its input embedding's rows (``get_input_embeddings``),
    else ``config.vocab_size``, else ``None`` (``cfg``: as for :func:`max_positions`)."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (AttributeError, NotImplementedError):
            emb = None
        rows = _positive_int(emb, "num_embeddings")
        if rows is not None:
            return rows
    return _positive_int(_text_config(model) if cfg is None else cfg, "vocab_size")


def num_layers(model) -> int:
    """``config.num_hidden_layers`` (``n_layer`` for GPT-2); where the model has no such
    configuration, the number of its modules that sum products (``nn.Linear``, convolutions,
    ``nn.MultiheadAttention``; at least 1): a transformer layer holds several, so the count
    bounds its depth from above, and the rounding bound that grows with the depth is not too
    tight for a deep model without a configuration."""
    said = _positive_int(_text_config(model), "num_hidden_layers", "n_layer", "num_layers")
    if said is not None:
        return said
    if isinstance(model, torch.nn.Module):
        sums = (torch.nn.Linear, torch.nn.Bilinear, torch.nn.MultiheadAttention,
                torch.nn.modules.conv._ConvNd)
        return max(1, sum(isinstance(m, sums) for m in model.modules()))
    return 1


def check_causal(model) -> None:
    """Refuse an encoder-decoder model (T5, BART, ...): it is not a causal LM."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        raise TypeError(f"decoding.generate: model {type(model).__name__} is an encoder-decoder "
                        "model (config.is_encoder_decoder=True), not a causal LM; decoding "
                        "needs a decoder-only causal LM (e.g. GPT-2, Llama, Mistral)")


def check_model(model, input_ids: torch.Tensor, max_new_tokens: int, pad: int) -> None:
    """Refuse, with a clear message, what the cache-cropping token system cannot run for
    ``max_new_tokens`` after ``input_ids``, with the pad token ``pad``: a sliding or chunked
    attention window that would bind, more positions than the model has, token ids outside the
    vocabulary, or a prompt on another device than the model."""
    name = type(model).__name__
    P, T = input_ids.shape[1], max_new_tokens
    total = P + T
    # the three limits on the positions, each refused with its own remedy
    span = f"the prompt ({P} positions) plus max_new_tokens={T} make {total}"
    tcfg = _text_config(model)
    sw = sliding_window(tcfg)
    if sw is not None and total > sw:
        raise ValueError(
            f"decoding.generate: model {name} has sliding-window attention (sliding_window={sw}), "
            f"and {span} > {sw} positions: its cache drops positions that the cropping of "
            f"Jacobi decoding needs. Keep prompt length + max_new_tokens <= {sw} (where the "
            "window never binds and the tokens are generate's), or use model.generate")
    chunk = _positive_int(tcfg, "attention_chunk_size")
    if chunk is not None and total > chunk:
        raise ValueError(f"decoding.generate: model {name} has chunked attention "
                         f"(attention_chunk_size={chunk}) and {span} > {chunk} positions; keep "
                         f"them within {chunk}")
    limit = max_positions(model, tcfg)
    if limit is not None and total > limit:
        raise ValueError(f"decoding.generate: {span} positions, more than the model's "
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
        if pad >= V:
            raise ValueError(f"pad_token_id={pad} is outside the model's vocabulary of "
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
    sw = _positive_int(cfg, "sliding_window")
    if sw is None:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return sw if "sliding_attention" in types else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return sw


K_FLOAT32 = 200.0     # k for float32 and float64 models (measured: up to 49.4 on the char LM)
K_16BIT = 10.0        # k for bfloat16 and float16 (measured: up to 2.35, float16)
K_SCORES = 8.0        # float32 eps of the processed scores, for a float64 model
POSITIONS = 256       # the positions the k were measured over (up to 304: 48 + 256)


def rounding_factor(model, logits: torch.Tensor,
                    positions: int = 1) -> tuple[float, torch.dtype]:
    """The factor ``c`` of the low-precision certificate's bound ``c * max|logits|`` on the
    difference between the logits of a window pass and of the sequential loop's one-token pass,
    and the dtype the model computes in: the coarsest of the logits' dtype, the model's floating
    parameter dtypes and an enabled autocast dtype.

    ``c = k * eps * sqrt(layers * max(1, positions / 256))``, plus ``8 * eps`` of float32 for a
    model finer than float32: the scores are processed in float32, as ``generate`` processes
    them, so two float64 logits that differ by a rounding may round to neighbouring float32
    values, and the processing itself runs on passes of different shapes (8: the float32
    allowance the test models' processing was measured within before).
    ``k`` (:data:`K_FLOAT32`, :data:`K_16BIT`) is 4 times the largest difference measured, in
    units of ``eps * sqrt(layers) * max|logits|`` (``python -m
    paraprop_lab.experiments.decoding_rounding``: the shipped trained char LM and random GPT-2
    and Llama models, 8 prompts x 256 new tokens: 49 in float32 and 44 in float64, both on the
    char LM, and 2.35 in float16 on 32 of its prompts). ``positions`` is the most positions a
    decision reads (prompt plus new tokens): beyond the 256 measured, the bound grows as the
    square root of the positions, as the rounding of attention's sums over them does (see
    decoding.md)."""
    dtypes = {logits.dtype}
    if isinstance(model, torch.nn.Module):     # each module's own parameters: one walk
        dtypes |= {p.dtype for m in model.modules() for p in m._parameters.values()
                   if p is not None and p.is_floating_point()}
    elif hasattr(model, "parameters"):
        dtypes |= {p.dtype for p in model.parameters() if p.is_floating_point()}
    kind = logits.device.type
    if torch.is_autocast_enabled(kind):
        dtypes.add(torch.get_autocast_dtype(kind))
    dtypes = {d for d in dtypes if d.is_floating_point} or {torch.float32}
    coarse = max(dtypes, key=lambda d: torch.finfo(d).eps)
    eps, eps32 = torch.finfo(coarse).eps, torch.finfo(torch.float32).eps
    k = K_16BIT if torch.finfo(coarse).bits <= 16 else K_FLOAT32
    grow = max(1.0, positions / POSITIONS)
    scores = K_SCORES * eps32 if eps < eps32 else 0.0
    return k * eps * math.sqrt(num_layers(model) * grow) + scores, coarse
