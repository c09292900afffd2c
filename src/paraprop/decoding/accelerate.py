"""``paraprop.decoding.accelerate``: a model's own ``model.generate(...)`` through paraprop.

:func:`accelerate` replaces ``generate`` on the model instance (never its class) by a method that
reads the call as ``transformers`` would (the positional ``inputs``, a ``generation_config``,
generation settings and model arguments as keywords), and runs it through
:func:`paraprop.decoding.generate` where paraprop implements every setting of the call: greedy
decoding with the model's ``generation_config`` and the processors it lists, or, where the user
chose a coupling (``accelerate(model, coupling="gumbel")``), sampling. Everything else falls
through to ``transformers``' own ``generate``, unchanged, with a :class:`FallThroughWarning`
once per reason and the reason recorded on the handle:

* arguments paraprop does not implement: ``logits_processor`` / ``stopping_criteria`` lists,
  ``prefix_allowed_tokens_fn``, ``assistant_model``, ``streamer``, negative prompts,
  ``custom_generate``, ``synced_gpus``; output dictionaries (``return_dict_in_generate``,
  ``output_scores``, ...); model arguments other than ``attention_mask`` (``inputs_embeds``,
  ``past_key_values``, ...); a generation setting passed as ``None``;
* sampling without a coupling: ``generate`` draws its tokens with ``torch.multinomial`` from
  the global random state, which no parallel method can reproduce token for token; with a
  coupling the tokens are those of paraprop's sequential sampler for that coupling (the same
  distribution, not ``generate``'s draws), keyed from the global random state;
* a setting :func:`paraprop.decoding.generate` refuses (beam search, ``num_return_sequences >
  1``, ... : its message is the reason), a model it refuses (one in train mode with dropout),
  and a result it does not certify (``converged=False``: the tokens of ``generate`` are
  computed then, so a fall through never returns an uncertified token).

So the tokens returned are always ``generate``'s (greedy: bitwise, as paraprop's tests check
against ``generate`` itself) or, for sampling with a coupling, paraprop's sequential sampler's.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings
from typing import Any

import torch

from paraprop import checks
from paraprop.decoding.decode import ADVANCES, _solver, generate
from paraprop.errors import FallThroughWarning
from paraprop.result import Solution

PATCH = "_paraprop_decoding_accelerate"   # the instance attribute naming the handle
# generate's settings that paraprop.decoding.generate takes as arguments
ARGUMENTS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p",
             "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "eos_token_id",
             "pad_token_id")
# generate's own arguments besides inputs and generation_config: any of them set falls through
NOT_SERVED = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
              "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids",
              "negative_prompt_attention_mask", "custom_generate")
# generation flags asking for more than the tokens
OUTPUTS = ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
           "output_hidden_states")
COUPLINGS = (None, "gumbel", "inverse_cdf")


@dataclasses.dataclass
class Counters:
    """What the accelerated ``generate`` did since :func:`accelerate`."""

    calls: int = 0          # generate calls
    served: int = 0         # calls whose tokens paraprop computed (and certified)
    fell_through: int = 0   # calls transformers' generate computed
    model_calls: int = 0    # model passes of the served calls (prefill included)
    new_tokens: int = 0     # new tokens of the served calls (per sample)


class Accelerated:
    """The handle :func:`accelerate` returns: ``undo()`` restores ``model.generate``; a
    context manager that undoes on exit.

    Attributes:
        model: the accelerated model.
        settings: :func:`paraprop.decoding.generate`'s ``method``, ``window``, ``ngram``,
            ``max_iters``, ``batch_advance`` and ``coupling`` (``None``: sampling falls
            through), as given.
        counters: :class:`Counters`.
        reasons: ``(call, reason)`` of every fall through (``call`` numbered from 1).
        solution: the last served call's :class:`paraprop.Solution` (``None`` before any).
        active: ``False`` once undone.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> lm = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2))
        >>> handle = paraprop.decoding.accelerate(lm.eval())
        >>> handle.active, type(vars(lm)["generate"]).__name__
        (True, '_Generate')
        >>> handle.undo()
        >>> handle.active, "generate" in vars(lm)
        (False, False)
    """

    def __init__(self, model, settings: dict[str, Any]):
        self.model = model
        self.settings = settings
        self.counters = Counters()
        self.reasons: list[tuple[int, str]] = []
        self.solution: Solution | None = None
        self._warned: set[str] = set()
        self._saved = model.__dict__.get("generate", _MISSING)
        original = model.generate
        model.__dict__["generate"] = _Generate(self, original)
        model.__dict__[PATCH] = _Mark(self)
        self.active = True

    def undo(self) -> None:
        """Restore ``model.generate`` (again: nothing)."""
        if not self.active:
            return
        d = self.model.__dict__
        if self._saved is _MISSING:
            d.pop("generate", None)
        else:
            d["generate"] = self._saved
        d.pop(PATCH, None)
        self.active = False

    def __enter__(self) -> Accelerated:
        return self

    def __exit__(self, *exc) -> None:   # undone, also on an exception (which propagates)
        self.undo()

    def __repr__(self) -> str:
        return (f"Accelerated({type(self.model).__name__}, method={self.settings['method']!r}, "
                f"{'active' if self.active else 'undone'})")

    def __reduce__(self):
        raise TypeError("an Accelerated handle (from paraprop.decoding.accelerate) cannot be "
                        "pickled or copied: it patches a live model; pickle, torch.save or "
                        "copy.deepcopy the model (it copies as the plain model)")

    # -- one generate call -------------------------------------------------------------------
    def generate(self, original, args, kwargs):
        self.counters.calls += 1
        plan = _plan(self, original, args, kwargs)
        if isinstance(plan, str):
            return self._fall(plan, original, args, kwargs)
        ids, call = plan
        try:
            tokens, sol = generate(self.model, ids, **call, throw=False)
        except (ValueError, NotImplementedError, TypeError) as e:
            return self._fall(f"paraprop.decoding.generate refused the call: {e}", original,
                              args, kwargs)
        if not sol.converged:
            cause = sol.stats.get("uncertified_cause") or sol.stats.get("reason") or \
                "not certified"
            return self._fall(f"paraprop's tokens were not certified ({cause})", original, args,
                              kwargs)
        self.solution = sol
        self.counters.served += 1
        self.counters.model_calls += int(sol.stats["model_calls"])
        self.counters.new_tokens += int(tokens.shape[1] - ids.shape[1])
        return tokens

    def _fall(self, reason: str, original, args, kwargs):
        self.counters.fell_through += 1
        self.reasons.append((self.counters.calls, reason))
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"paraprop.decoding.accelerate: this generate call runs transformers' "
                          f"own generate: {reason}", FallThroughWarning, stacklevel=4)
        return original(*args, **kwargs)


def accelerate(model, *, method="jacobi", window: int | None = None, ngram: int = 2,
               max_iters: int | None = None, coupling: str | None = None,
               batch_advance: str | None = None) -> Accelerated:
    """Make ``model.generate(...)`` run through :func:`paraprop.decoding.generate` wherever
    paraprop implements every setting of the call, and through ``transformers``' own
    ``generate`` otherwise (see the module doc for what falls through and why).

    Applied once it stays until ``undo()``; as a context manager it is undone on exit.
    ``pickle``, ``torch.save`` and ``copy.deepcopy`` of the model copy the plain model.

    Arguments:
        model: a ``transformers`` causal LM (or any model whose ``generate`` has
            ``transformers``' signature and that :func:`paraprop.decoding.generate` takes).
        method, window, ngram, max_iters, batch_advance: as in
            :func:`paraprop.decoding.generate` (``batch_advance=None``: its default).
        coupling: ``None`` (default): sampling calls fall through (``generate``'s draws cannot
            be reproduced token for token); ``"gumbel"`` or ``"inverse_cdf"``: sampling calls
            run through paraprop with that coupling, keyed from the global random state
            (``torch.manual_seed`` makes them reproducible), and return the tokens of
            paraprop's sequential sampler for it.

    Returns:
        An :class:`Accelerated` handle (``undo()``, context manager, ``counters``,
        ``reasons``, ``solution``).

    Raises:
        TypeError: ``model`` has no ``generate`` method.
        ValueError: ``model`` is already accelerated; a bad ``coupling``, ``window``,
            ``ngram``, ``max_iters`` or ``batch_advance``; a ``method`` that
            :func:`~paraprop.decoding.generate` refuses, or one that ``window`` or
            ``batch_advance`` does not fit (e.g. ``"gs_jacobi"`` with ``"per-sample"``).

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> cfg = GPT2Config(vocab_size=40, n_positions=64, n_embd=16, n_layer=1, n_head=2)
        >>> lm = GPT2LMHeadModel(cfg).eval()
        >>> ids = torch.randint(0, 40, (1, 5))
        >>> ref = lm.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
        ...                   pad_token_id=0)
        >>> with paraprop.decoding.accelerate(lm) as handle:
        ...     out = lm.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
        ...                       pad_token_id=0)
        >>> bool(torch.equal(out, ref)), handle.counters.served
        (True, 1)
    """
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"model must have a generate method (a transformers causal LM), got "
                        f"{type(model).__name__}")
    if isinstance(model.__dict__.get(PATCH), _Mark):
        raise ValueError("model is already accelerated by paraprop.decoding.accelerate; call "
                         "undo() on its handle first")
    checks.one_of("coupling", coupling, COUPLINGS)
    checks.positive_int("window", window, allow_none=True)
    checks.nonneg_int("ngram", ngram)
    checks.positive_int("max_iters", max_iters, allow_none=True)
    if batch_advance is not None:
        checks.one_of("batch_advance", batch_advance, ADVANCES)
    # the method, its window and the batch advance together, as generate checks them (a
    # conflict is refused here, not at every call)
    _solver(method, window, window or 1, batch_advance)
    return Accelerated(model, {"method": method, "window": window, "ngram": ngram,
                               "max_iters": max_iters, "coupling": coupling,
                               "batch_advance": batch_advance})


def _plan(handle: Accelerated, original, args, kwargs):
    """The call as :func:`paraprop.decoding.generate`'s ``(input_ids, arguments)``, or the
    reason it falls through (a string)."""
    try:
        bound = inspect.signature(original).bind(*args, **kwargs).arguments
    except TypeError as e:
        return f"its arguments do not bind to generate's signature ({e})"
    extra = dict(bound.pop("kwargs", {}))
    for name in NOT_SERVED:
        value = bound.get(name)
        if value is not None and not (name in ("logits_processor", "stopping_criteria")
                                      and len(value) == 0):
            return f"{name} is set (paraprop.decoding.generate does not take it)"
    ids = bound.get("inputs")
    if ids is None:
        ids = extra.pop("input_ids", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return ("no (batch, length) tensor of token ids as inputs (inputs_embeds and other "
                "inputs are generate's)")
    gc = bound.get("generation_config")
    fields = _config_fields(handle.model, gc)
    explicit: dict[str, Any] = {}
    others: dict[str, Any] = {}
    model_kw: dict[str, Any] = {}
    for k, v in extra.items():
        if k in ARGUMENTS or k in fields:
            if v is None and k == "eos_token_id":
                v = []   # generate: no EOS (the keyword overrides the configuration's)
            elif v is None:
                return (f"{k}=None is passed (generate's handling of an explicit None is its "
                        "own)")
            (explicit if k in ARGUMENTS else others)[k] = v
        else:
            model_kw[k] = v
    mask = model_kw.pop("attention_mask", None)
    merged = _merged(handle.model, gc, others)
    if model_kw.pop("use_cache", merged.get("use_cache", True)) is not True:
        return "use_cache=False is passed (generate then recomputes every prefix)"
    if model_kw:
        return (f"model arguments {sorted(model_kw)} are passed (paraprop takes "
                "attention_mask only)")
    for flag in OUTPUTS:
        if merged.get(flag):
            return f"{flag}=True asks for more than the tokens"
    sampling = explicit.get("do_sample", merged.get("do_sample"))
    coupling = handle.settings["coupling"]
    if sampling and coupling is None:
        return ("it samples: generate draws with torch.multinomial from the global random "
                "state, which no parallel method reproduces token for token; pass "
                "accelerate(model, coupling='gumbel') to sample through paraprop (the same "
                "distribution, paraprop's sequential sampler's tokens)")
    if others:
        gc = copy.deepcopy(gc if gc is not None else handle.model.generation_config)
        gc.update(**others)
    call = dict(explicit, generation_config=gc, attention_mask=mask,
                method=handle.settings["method"], window=handle.settings["window"],
                ngram=handle.settings["ngram"], max_iters=handle.settings["max_iters"],
                batch_advance=handle.settings["batch_advance"])
    if sampling:
        call["coupling"] = coupling
    return ids, call


def _config_fields(model, gc) -> set[str]:
    """The names of generation settings (a ``GenerationConfig``'s fields)."""
    base = gc if gc is not None else getattr(model, "generation_config", None)
    to_dict = getattr(base, "to_dict", None)
    return set(to_dict()) if callable(to_dict) else set()


def _merged(model, gc, others: dict) -> dict:
    """The generation settings of the call that are not ``None``: the model's configuration,
    then ``generation_config``'s, then the keywords."""
    out: dict = {}
    for cfg in (getattr(model, "generation_config", None), gc):
        to_dict = getattr(cfg, "to_dict", None)
        if callable(to_dict):
            out.update({k: v for k, v in to_dict().items() if v is not None})
    out.update(others)
    return out


class _Generate:
    """The patched ``generate`` of one model (an instance attribute). Pickled or deep-copied
    it becomes the class's method of the copy: a copied model is the plain model."""

    __slots__ = ("__wrapped__", "handle", "original")

    def __init__(self, handle: Accelerated, original):
        self.handle, self.original, self.__wrapped__ = handle, original, original

    def __call__(self, *args, **kwargs):
        return self.handle.generate(self.original, args, kwargs)

    def __reduce__(self):
        return (getattr, (self.handle.model, "generate"))

    @property
    def __signature__(self):
        return inspect.signature(self.original)


class _Mark:
    """The model's record of its handle; pickled or copied it is ``None``."""

    __slots__ = ("handle",)

    def __init__(self, handle: Accelerated):
        self.handle = handle

    def __reduce__(self):
        return (_none, ())


def _none() -> None:
    return None


_MISSING = object()
