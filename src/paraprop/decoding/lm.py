"""A causal language model seen through its key/value-cache contract.

The contract is the one ``transformers``' causal LMs follow: ``model(input_ids, <cache>=past,
use_cache=True)`` returns the logits of the new positions and the cache extended by them, where
``<cache>`` is ``past_key_values`` (or ``cache``, its name from ``transformers`` 5). Optional
keywords ``attention_mask`` and ``position_ids`` are passed when the forward accepts them, as
``generate`` passes them: left padding needs ``attention_mask``; a model without
``position_ids`` derives its positions from the mask itself (Bloom's ALiBi), as in
``generate``. The returned cache is cropped with its own ``crop`` method (a ``transformers``
``Cache``) or, for a tuple of per-layer ``(key, value)`` tensors shaped ``(batch, heads,
length, head_dim)``, by slicing.

:class:`CachedLM` keeps one cache for a batch of sequences and remembers which tokens its
entries were computed from (or leaves that to its caller, ``track=False``, who passes the valid
length), so a request for the logits of positions ``[a, b)`` reuses exactly the entries that are
still valid and recomputes the rest.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

CACHE_NAMES = ("past_key_values", "cache")


def cache_keyword(model, params=None) -> str:
    """The keyword under which ``model``'s forward takes the cache; ``TypeError`` naming the
    contract if it has none. ``params``: the forward's parameters (:func:`forward_params`),
    where the caller has them."""
    if params is None:
        params = forward_params(model)
    for name in reversed(CACHE_NAMES):   # prefer the current name where both exist
        if name in params:
            return name
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "past_key_values"
    raise TypeError(f"model {type(model).__name__} has no key/value-cache contract: its forward "
                    "takes neither past_key_values nor cache (expected forward(input_ids, "
                    "past_key_values=..., use_cache=True) returning logits and the cache)")


def forward_params(model):
    """The parameters of ``model.forward``'s signature (``TypeError`` naming the contract
    where ``model`` is not callable or has no forward). A bound method's are kept per
    function (its signature without ``self`` is the same for every instance): reading a
    decorated forward's signature costs ~0.05 ms, once per call of ``generate`` otherwise."""
    fwd = getattr(model, "forward", None)
    if not callable(model) or fwd is None:
        raise TypeError(f"model must be a torch module with forward(input_ids, "
                        f"past_key_values=..., use_cache=True), got {type(model).__name__}")
    func = getattr(fwd, "__func__", None)
    if func is None or getattr(fwd, "__self__", None) is not model:
        return inspect.signature(fwd).parameters
    try:
        return _SIGNATURES[func]
    except (KeyError, TypeError):      # TypeError: a function that takes no weak reference
        params = inspect.signature(fwd).parameters
        try:
            _SIGNATURES[func] = params
        except TypeError:
            pass
        return params


_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class CachedLM:
    """``model`` with one key/value cache over a batch of token sequences.

    Arguments:
        model: the causal LM (see the module doc for the contract).
        tokens: ``(B, L)`` int64, the full token buffer (prompt, then generated positions);
            the caller writes generated tokens into it.
        attention_mask: ``(B, L)`` 0/1 or ``None`` (no padding).
        params: the forward's parameters (:func:`forward_params`), where the caller has them.
        track: keep a copy of the tokens the cache's entries were computed from, for
            :meth:`valid_length` (one copy per pass); ``False`` where the caller tracks them
            itself and passes ``valid`` to :meth:`logits`.

    Counters: ``calls`` (forward passes) and ``fed`` (token positions fed to the model);
    ``length``: the cache's length (positions).
    """

    def __init__(self, model, tokens: torch.Tensor, attention_mask: torch.Tensor | None,
                 params=None, track: bool = True):
        self.model = model
        if params is None:
            params = forward_params(model)
        self.key = cache_keyword(model, params)
        self.tokens = tokens
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None     # no padding: the model's own causal mask, as generate does
        self.mask = attention_mask
        self.pass_mask = attention_mask is not None and "attention_mask" in params
        self.pass_pos = attention_mask is not None and "position_ids" in params
        if attention_mask is not None and not self.pass_mask:
            raise TypeError(
                f"model {type(model).__name__}: the prompts are left-padded (attention_mask has "
                "zeros) but its forward takes no attention_mask keyword, so it would attend to "
                "the padding; pass prompts without padding (the unpadded prompts one at a time, "
                "or a batch of prompts of equal length) and no attention_mask")
        if attention_mask is not None and self.pass_pos:   # else positions from the mask (Bloom)
            pos = attention_mask.long().cumsum(-1) - 1
            self.position_ids = pos.masked_fill(attention_mask == 0, 0)
        self.keep_logits = "logits_to_keep" in params
        self.past: Any = None     # the model's cache: a transformers Cache, or legacy tuples
        self.track = track
        self.cached = tokens[:, :0]      # the tokens the cache entries were computed from
        self.length = 0
        self.calls = 0
        self.fed = 0

    def valid_length(self) -> torch.Tensor:
        """How many leading cache entries were computed from the buffer's current tokens (a
        0-d tensor on the buffer's device: the caller syncs it with its own scalars)."""
        if not self.track:
            raise RuntimeError("CachedLM(track=False) keeps no copy of the cache's tokens; "
                               "pass valid to logits")
        n = self.cached.shape[1]
        same = (self.cached == self.tokens[:, :n]).all(0)
        return same.long().cumprod(0).sum()

    def logits(self, a: int, b: int, valid: int | None = None) -> torch.Tensor:
        """Logits ``(B, b - a, V)`` predicting the tokens at positions ``a + 1 .. b`` of the
        buffer, i.e. the model's outputs at positions ``[a, b)``, reusing the valid cache
        (``valid``: :meth:`valid_length` for the current buffer, when the caller has it)."""
        if valid is None:
            valid = int(self.valid_length())
        valid = min(valid, a)
        self._crop(valid)
        out = self._forward(valid, b)
        return out[:, a - valid :]

    def prefill(self, n: int) -> torch.Tensor:
        """Fill the cache with the first ``n`` positions of the buffer in one pass and return
        the logits ``(B, V)`` of the last one: ``generate``'s first step, computed as it
        computes it (one pass over the prompt, the head applied to the last position only)."""
        self._crop(0)
        return self._forward(0, n, keep=1)[:, -1]

    def _crop(self, length: int) -> None:
        n = self.length
        if length >= n:
            return
        if length == 0:
            self.past = None
        elif callable(getattr(self.past, "crop", None)):
            try:
                self.past.crop(length - n)      # a negative count removes that many positions
            except RuntimeError as e:           # e.g. a sliding-window or linear-attention layer
                raise TypeError(
                    f"model {type(self.model).__name__}: its cache "
                    f"({type(self.past).__name__}) cannot be cut back to the accepted prefix, "
                    "which Jacobi decoding needs after each pass (transformers says: "
                    f"{e}); use method='sequential' or model.generate") from e
        else:
            self.past = tuple(tuple(t[..., :length, :] for t in layer) for layer in self.past)
        self.length = length
        if self.track:
            self.cached = self.cached[:, :length]

    def _forward(self, a: int, b: int, keep: int = 0) -> torch.Tensor:
        kw: dict[str, Any] = {self.key: self.past, "use_cache": True}
        if self.pass_mask and self.mask is not None:
            kw["attention_mask"] = self.mask[:, :b]
        if self.pass_pos:
            kw["position_ids"] = self.position_ids[:, a:b]
        if keep and self.keep_logits:
            kw["logits_to_keep"] = keep
        out = self.model(self.tokens[:, a:b], **kw)
        if isinstance(out, tuple):
            logits, past = out[0], out[1]
        else:
            logits = out.logits
            past = getattr(out, "cache", None)   # transformers 5 (the old name warns there)
            if past is None:
                past = getattr(out, "past_key_values", None)
        if past is None:
            raise TypeError(f"model {type(self.model).__name__} returned no cache with "
                            "use_cache=True (expected .past_key_values, .cache, or a tuple "
                            "(logits, cache))")
        self.past = past
        self.length = b
        if self.track:
            self.cached = self.tokens[:, :b].clone()
        self.calls += 1
        self.fed += b - a
        return logits
