"""``paraprop.decoding.generate``: exact Jacobi decoding of causal language models.

With the sampling noise drawn up front (one uniform variate per position; greedy needs none),
the generated tokens solve a triangular system: token ``t`` is a function of the prompt, the
tokens before it and its own variate (Song et al. 2021, §5.3; Santilli et al. 2023). Jacobi
decoding iterates that system over a window of undecided tokens, one model pass per iteration,
and accepts the leading tokens that are certified: the first one (computed from accepted tokens
only) and each following one whose input did not change (:class:`~paraprop.solvers.SlidingJacobi`
at ``tol=0``). So the result is the sequential one, token for token, whatever the guesses;
guesses only decide how many tokens each model pass accepts. The accepted prefix lives in the
key/value cache (:class:`~paraprop.decoding.lm.CachedLM`), so a pass runs the window only.

The settings are ``generate``'s, read from the call, a ``generation_config`` and
``model.generation_config`` as ``generate`` reads them (:mod:`paraprop.decoding.settings`); the
scores are processed as ``generate`` processes them (:mod:`paraprop.decoding.processors`).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch

from paraprop import checks
from paraprop.decoding import model_checks
from paraprop.decoding import settings as _settings
from paraprop.decoding.gumbel import GumbelNoise, draw_key
from paraprop.decoding.lm import CachedLM, cache_keyword, forward_params
from paraprop.decoding.ngrams import NgramPool
from paraprop.decoding.processors import Pipeline
from paraprop.decoding.token_map import TokenMap, uncertified_cause
from paraprop.determinism import require_deterministic
from paraprop.errors import ConvergenceError, NotTriangularError
from paraprop.result import Result
from paraprop.solve import solve
from paraprop.solvers import GSJacobi, Sequential, SlidingJacobi, is_solver

METHODS = ("sequential", "jacobi", "gs_jacobi")
DEFAULT_WINDOW = 16
WINDOWED = ("jacobi", "gs_jacobi")   # the named methods that take a window (checks.window_option)
COUPLINGS = ("inverse_cdf", "gumbel")
ADVANCES = SlidingJacobi.ADVANCES   # ("minimum", "per-sample")
LOOKAHEAD = True               # greedy n-gram guesses from the iterates too (ngrams.py)
# batch_advance=None per device: on a CPU "minimum" (measured faster at batch 4/8/16: the wider
# block of "per-sample" costs its arithmetic there, docs/decoding.md); on CUDA "per-sample" (the
# first GPU run, an H200, the char LM at batch 8: 1.10x generate against 0.98x for "minimum")
DEFAULT_ADVANCE = {"cpu": "minimum", "cuda": "per-sample"}


def default_advance(device) -> str:
    """``batch_advance=None``'s choice on ``device`` (:data:`DEFAULT_ADVANCE`; ``"minimum"``
    on a device not measured)."""
    return DEFAULT_ADVANCE.get(torch.device(device).type, "minimum")


def generate(model, input_ids: torch.Tensor, *, max_new_tokens: int | None = None,
             method="jacobi", window: int | None = None, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
             min_new_tokens: int | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, generation_config=None,
             generator: torch.Generator | None = None, noise: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None, ngram: int = 2,
             max_iters: int | None = None, throw: bool = True, coupling: str = "inverse_cdf",
             batch_advance: str | None = None):
    """Generate tokens after ``input_ids``: the tokens of the sequential loop (greedy: of
    ``model.generate``), with the model's own generation settings, in fewer model passes.

    Every generation setting left at ``None`` comes from ``generation_config``, else from
    ``model.generation_config``, else from ``generate``'s defaults, as ``model.generate`` reads
    it (so ``do_sample=True`` alone samples with ``top_k=50``, as ``generate`` does). Settings
    that are not arguments here (``bad_words_ids``, ``sequence_bias``, ``suppress_tokens``,
    ``begin_suppress_tokens``, ``forced_bos_token_id``, ``forced_eos_token_id``,
    ``min_length``, ``max_length``, ``epsilon_cutoff``, ``remove_invalid_values``,
    ``renormalize_logits``) are honoured from a ``generation_config``. A setting that is not
    implemented (beam search, contrastive search, assisted decoding, watermarking, ...) is
    refused by name; see docs/decoding.md for the table.

    Arguments:
        model: a ``transformers`` causal LM (any decoder-only architecture with a key/value
            cache), or any module with ``forward(input_ids, past_key_values=...,
            use_cache=True)`` returning the logits and the cache (see
            :mod:`paraprop.decoding.lm`); in eval mode (a train-mode model with dropout is
            refused: :class:`paraprop.StochasticModelError`).
        input_ids: ``(B, P)`` int64 prompts, left-padded when their lengths differ.
        max_new_tokens: tokens to generate per sample (default: from the configuration, else
            ``max_length - P`` with ``generate``'s default ``max_length`` of 20 new tokens;
            fewer come back when every sample ended with EOS, as ``generate`` does).
        method: ``"jacobi"`` (:class:`~paraprop.solvers.SlidingJacobi` over ``window``
            tokens), ``"gs_jacobi"`` (blocks of ``window`` tokens, Jacobi inside each),
            ``"sequential"`` (one token per pass, the reference: ``generate``'s own loop), or a
            ``SlidingJacobi`` / ``GSJacobi`` / ``Sequential`` object.
        window: tokens per pass of ``"jacobi"`` and ``"gs_jacobi"`` (default 16; a window of
            at least ``max_new_tokens`` is Jacobi on all of them).
        do_sample: sample instead of greedy; the tokens are then a function of the noise.
        temperature, top_k, top_p, min_p: the sampling warpers of ``generate`` (``top_k=0``:
            no top-k; ``top_p=1.0``: no top-p); passing one without sampling is an error.
        repetition_penalty, no_repeat_ngram_size, min_new_tokens: ``generate``'s processors.
        eos_token_id: token(s) that end a sample; later positions get the pad token. ``[]``:
            no EOS (``None`` reads the configuration, as everywhere here).
        pad_token_id: default: the configuration's, else the first EOS token.
        generation_config: a ``transformers.GenerationConfig`` whose set fields override
            ``model.generation_config``, as for ``model.generate``.
        generator: draws the noise (one uniform variate per sample and position, float64), on
            the generator's device, then moved to the prompt's: a CPU generator gives the same
            sample on every device. Without one, the default CPU generator draws it.
        noise: the uniform variates ``(B, max_new_tokens)`` in ``[0, 1)`` instead.
        attention_mask: ``(B, P)`` of 0/1, zeros on the left padding only. Without one, a
            ``transformers`` model infers it from ``pad_token_id`` as ``generate`` does. It is
            passed with ``position_ids`` where the forward takes them, else alone (Bloom derives
            its positions from it); a forward without ``attention_mask`` takes no padding.
        ngram: guesses the undecided tokens from the continuation of the last ``ngram``
            accepted tokens seen earlier in the prompt or output (``0``: no guesses; the
            previous iterate then stays the guess). Guesses never change the result.
        max_iters: cap on passes (default: the exactness bound ``max_new_tokens``).
        throw: raise :class:`paraprop.ConvergenceError` if ``max_iters`` stops it first or a
            token is not certified (see below); ``False`` returns ``converged=False`` instead.
        coupling: how sampling turns noise into tokens. ``"inverse_cdf"`` (default): the inverse
            CDF of the processed distribution at the position's variate (``generator`` or
            ``noise``). ``"gumbel"``: the argmax of the processed scores plus Gumbel noise per
            vocabulary entry (:mod:`paraprop.decoding.gumbel`), from a counter-based generator
            keyed by one int64 drawn from ``generator`` (``noise`` is refused), which a slightly
            wrong prefix changes less, so Jacobi guesses are right more often. Both have
            ``generate``'s distribution; each coupling's tokens are those of its own sequential
            loop with the same seed (not ``model.generate``'s, nor the other coupling's).
        batch_advance: how ``"jacobi"`` moves a batch (``B > 1``) forward; the tokens are the
            same either way. ``"minimum"`` (default): each pass computes the window from the
            batch's least accepted position, so the batch advances with its slowest sample.
            ``"per-sample"``: each sample iterates its own window from its own accepted length
            (``SlidingJacobi(window, advance="per-sample")``): fewer passes, but each pass
            feeds the block from the least accepted position to the leading sample's window
            end (at most ``2 * window`` positions). ``None``: the advance of a
            ``SlidingJacobi`` passed as ``method``, else per device (:func:`default_advance`:
            ``"minimum"`` on a CPU, ``"per-sample"`` on CUDA, each measured faster there).
            ``"minimum"`` is what the other methods do (they take no ``"per-sample"``).

    Returns:
        ``(tokens, solution)``: ``tokens`` is ``(B, P + n)`` (prompt, then the new tokens) as
        ``generate`` returns it; ``solution.value`` holds all ``max_new_tokens`` positions.
        ``stats``: ``model_calls`` (forward passes, prefill included: the sequential steps;
        the sequential loop takes ``max_new_tokens``), ``decode_calls`` (after the prefill),
        ``tokens_per_call`` (new tokens per model call), ``fed_positions``, ``window``,
        ``new_tokens``, ``batch_advance`` (``"per-sample"`` at batch 1), ``processors``
        (applied, in order), ``coupling`` (``None`` when greedy), the
        certificate: ``margin_ratio`` (the smallest margin of a decision over its bound),
        ``uncertified`` (the ``(sample, position)`` pairs below the bound) and, where there is
        one, ``uncertified_cause`` (the first one's cause and fix, the message ``throw=True``
        raises); and the repeat check's ``repeat_checks`` (positions compared) and
        ``repeat_ratio`` (the largest difference over its bound).

    Raises:
        TypeError: a model without the cache contract, an encoder-decoder model, a cache that
            cannot be cut back, left-padded prompts for a forward without ``attention_mask``.
        ValueError: bad arguments or a refused setting (named, with the expected and the actual
            value); a prompt too long for the model; token ids outside the vocabulary.
        paraprop.StochasticModelError: a model in train mode with active dropout (before any
            model call), or one whose logits for the same tokens differ between two passes by
            more than the rounding bound (the repeat check, whatever ``throw`` says).
        paraprop.ConvergenceError: with ``throw=True``, see ``throw``.

    The certificate: the first new token comes from the prompt's prefill, computed as
    ``generate`` computes it. Every later token comes from a window pass, which computes its
    logits in another order than the sequential loop's one-token pass (and from key/value
    entries computed in window passes), so they round differently. A token is certified when
    its decision has a margin above a bound on that difference (``c * max|logits|``, ``c`` from
    the dtype, the depth and the positions:
    :func:`~paraprop.decoding.model_checks.rounding_factor`); otherwise
    the result says so (``converged=False``), and the message names the cause: non-finite
    logits from the model, an exact tie (of the scores, or at a setting's cut), or a margin
    within the rounding bound. ``method="sequential"`` is ``generate``'s loop and needs no
    margin.

    The repeat check: each parallel pass also recomputes the last decided position before its
    window (one more position fed, no extra model call), and its logits are compared with the
    ones it was decided from (see :class:`~paraprop.decoding.token_map.TokenMap`), so a model
    that is not a fixed function of its input is refused even where no up-front check
    recognises its randomness.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> cfg = GPT2Config(vocab_size=40, n_positions=64, n_embd=16, n_layer=1, n_head=2)
        >>> lm = GPT2LMHeadModel(cfg).eval()
        >>> ids = torch.randint(0, 40, (1, 5))
        >>> out, sol = paraprop.decoding.generate(lm, ids, max_new_tokens=12, eos_token_id=[])
        >>> ref = lm.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
        ...                   pad_token_id=0)
        >>> bool(torch.equal(out, ref)), sol.converged
        (True, True)
    """
    require_deterministic(model, argument="model", entry="decoding.generate")
    model_checks.check_causal(model)
    params = forward_params(model)          # one signature per call
    cache_keyword(model, params)
    B, P = _check_ids(input_ids)
    explicit = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                    top_k=top_k, top_p=top_p, min_p=min_p,
                    repetition_penalty=repetition_penalty,
                    no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=min_new_tokens,
                    eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    s = _settings.resolve(model, P, explicit, generation_config)
    T = s.max_new_tokens
    model_checks.check_model(model, input_ids, s.max_new_tokens, s.pad)
    attention_mask = _mask(model, input_ids, attention_mask, s)
    _check_run(B, T, window, noise, s.do_sample, ngram)
    _check_coupling(coupling, s.do_sample, noise)
    solver = _solver(method, window, T, batch_advance, input_ids.device)
    device = input_ids.device
    u: torch.Tensor | GumbelNoise | None = None
    if s.do_sample and coupling == "gumbel":
        u = GumbelNoise(draw_key(generator), B, device)
    elif s.do_sample:
        u = noise.to(device, torch.float64) if noise is not None else _draw(B, T, generator,
                                                                           device)
    tokens = torch.cat([input_ids, input_ids.new_full((B, T), s.pad)], dim=1).to(torch.long)
    mask = None
    if attention_mask is not None:
        mask = torch.cat([attention_mask.to(torch.long),
                          attention_mask.new_ones((B, T), dtype=torch.long)], dim=1)
    lm = CachedLM(model, tokens, mask, params, track=False)
    pool = None
    if ngram and not isinstance(solver, Sequential):
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None \
            else attention_mask.bool()
        rows, keep = input_ids.tolist(), real.tolist()
        # greedy: also the n-grams of the Jacobi iterates (Lookahead); sampled, an iterate's
        # token was drawn with its own position's noise, so it does not fit elsewhere
        pool = NgramPool([[t for t, k in zip(r, m, strict=True) if k]
                          for r, m in zip(rows, keep, strict=True)], ngram, solver_size(solver, T),
                         lookahead=LOOKAHEAD and not s.do_sample)
    with torch.no_grad():
        first = lm.prefill(P)
        factor, coarse = model_checks.rounding_factor(model, first, positions=P + T)
        pipe = Pipeline(s, P, attention_mask, device, factor, coupling)
        tmap = TokenMap(lm, P, T, u, pipe, s.eos, s.pad, pool, first, model=model,
                         recheck=not isinstance(solver, Sequential))
        try:
            sol = solve(tmap, tmap.start_guess(input_ids), method=solver, dim=-1, tol=0.0,
                        max_iters=max_iters, throw=throw)
        except (ConvergenceError, NotTriangularError):
            tmap.check_repeats()        # a model that is not a fixed function explains it
            raise
        if sol.converged:
            tmap.check_final(sol.value)
        repeats = tmap.check_repeats()     # (the last pass's comparison included)
    gen = sol.value.to(torch.long)
    ended = tmap.ended(gen)
    n = T
    if s.eos:
        is_eos = torch.isin(gen, torch.tensor(s.eos, device=device))
        if bool(is_eos.any(1).all()):
            n = int(is_eos.long().argmax(1).max()) + 1
    stats = {**sol.stats, "model_calls": lm.calls, "decode_calls": lm.calls - 1,
             "tokens_per_call": n / lm.calls, "fed_positions": lm.fed,
             "window": solver_size(solver, T), "new_tokens": n,
             "batch_advance": _advance(solver) if B > 1 else "per-sample",
             "processors": pipe.active, "coupling": coupling if s.do_sample else None}
    result, message = sol.result, None
    if isinstance(solver, Sequential):
        stats.update(certificate="sequential", margin_ratio=float("inf"), uncertified=[])
    else:
        live = ~ended[:, :n].cpu().numpy()
        ratio = np.where(live, tmap.ratio[:, :n], np.inf)        # (the margins: on the host)
        where = [(int(b), int(t)) for b, t in np.argwhere(ratio <= 1)]
        stats.update(certificate="margin", rounding_factor=factor, rounding_dtype=str(coarse),
                     margin_ratio=float(ratio.min()), uncertified=where,
                     repeat_checks=repeats[0], repeat_ratio=repeats[1])
        if where:
            b, t = where[0]
            stats["uncertified_cause"] = uncertified_cause(tmap, b, t, coarse, len(where))
        if where and sol.converged:
            result = Result.not_certified
            message = stats["not_converged"] = stats["uncertified_cause"]
    sol = dataclasses.replace(sol, value=gen, stats=stats, result=result)
    if message is not None and throw:
        raise ConvergenceError(message, solution=sol)
    return torch.cat([input_ids, gen[:, :n]], dim=1), sol


def solver_size(solver, T: int) -> int:
    """Tokens per pass of a decoding solver (its own default where its setting is ``None``:
    ``SlidingJacobi``'s and ``GSJacobi``'s ``size`` read only the number of positions)."""
    if isinstance(solver, Sequential):
        return 1
    return solver.size(SimpleNamespace(T=T))


def _draw(B: int, T: int, generator, device) -> torch.Tensor:
    """The variates, drawn on the generator's device (the default CPU generator without one)
    and moved: the same seed gives the same sample on every device."""
    where = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(B, T, generator=generator, dtype=torch.float64,
                      device=where).to(device)


def _mask(model, input_ids, attention_mask, s):
    """The attention mask: the given one, checked; else, for a ``transformers`` model, the one
    ``generate`` infers (the positions holding the pad token, when it is in the prompt and is
    not an EOS token); else ``None``."""
    B, P = input_ids.shape
    inferred = False
    if attention_mask is None:
        known_pad = "pad_token_id" in s.sources or bool(s.eos)   # generate's pad token
        if getattr(model, "generation_config", None) is None or not known_pad or s.pad in s.eos:
            return None
        is_pad = input_ids == s.pad
        if not bool(is_pad.any()):
            return None
        attention_mask, inferred = (~is_pad).long(), True
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, P):
        got = (tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
               else type(attention_mask).__name__)
        raise ValueError(f"attention_mask must have the shape of input_ids {(B, P)}, got {got}")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1")
    m = attention_mask.long()
    how = (f" (inferred, as generate does, from the positions holding pad_token_id={s.pad}; "
           "pass attention_mask)") if inferred else ""
    if not bool(m[:, -1].bool().all()):
        raise ValueError("attention_mask: the last prompt position of every sample must be 1 "
                         f"(pad prompts on the left, as generate expects){how}")
    if bool((m[:, 1:] < m[:, :-1]).any()):
        raise ValueError(f"attention_mask must be left padding: zeros, then ones, per row{how}")
    return attention_mask


def _advance(solver) -> str:
    """How ``solver`` moves a batch: ``"per-sample"`` or ``"minimum"``."""
    return "per-sample" if getattr(solver, "advance", None) == "per-sample" else "minimum"


def _solver(method, window, T, batch_advance=None, device="cpu"):
    if batch_advance is not None and (not isinstance(batch_advance, str)
                                      or batch_advance not in ADVANCES):
        raise ValueError(f"batch_advance must be one of {', '.join(map(repr, ADVANCES))} or "
                         f"None, got {batch_advance!r}")
    if is_solver(method):
        if not isinstance(method, (SlidingJacobi, GSJacobi, Sequential)):
            raise ValueError(f"method={method!r} is not supported by decoding; use "
                             "SlidingJacobi, GSJacobi or Sequential (or a name in "
                             f"{', '.join(METHODS)})")
        checks.window_option(window, None, WINDOWED)
        if batch_advance is not None and batch_advance != _advance(method):
            raise ValueError(f"batch_advance={batch_advance!r} disagrees with method={method!r}, "
                             f"which advances by the {_advance(method)!r}; pass one of them "
                             "(SlidingJacobi(window, advance=...) sets it on the solver)")
        return method
    checks.method_name(method, METHODS)
    window = checks.window_option(window, method, WINDOWED)
    w = min(DEFAULT_WINDOW, T) if window is None else window
    advance = default_advance(device) if batch_advance is None else batch_advance
    if method != "jacobi" and batch_advance == "per-sample":
        raise ValueError(f"batch_advance='per-sample' applies to method='jacobi' (the sliding "
                         f"window), got method={method!r}, which advances by the minimum")
    if method == "sequential":
        return Sequential()
    return SlidingJacobi(w, advance=advance) if method == "jacobi" else GSJacobi(w)


def _check_ids(input_ids) -> tuple[int, int]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or \
            input_ids.dtype not in (torch.int64, torch.int32):
        got = (f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ValueError(f"input_ids must be an integer tensor of shape (batch, prompt_length), "
                         f"got {got}")
    B, P = input_ids.shape
    if B < 1 or P < 1:
        raise ValueError(f"input_ids must hold at least one token per sample, got shape {(B, P)}")
    return B, P


def _check_coupling(coupling, do_sample: bool, noise) -> None:
    if not isinstance(coupling, str) or coupling not in COUPLINGS:
        raise ValueError(f"coupling must be one of {', '.join(map(repr, COUPLINGS))}, got "
                         f"{coupling!r}")
    if coupling == "gumbel" and not do_sample:
        raise ValueError("coupling='gumbel' applies to sampling; pass do_sample=True (greedy "
                         "decoding draws no noise)")
    if coupling == "gumbel" and noise is not None:
        raise ValueError("noise holds the inverse-CDF variates (one per position); "
                         "coupling='gumbel' computes its noise per vocabulary entry from a key "
                         "drawn from generator: pass generator instead of noise")


def _check_run(B, T, window, noise, do_sample, ngram) -> None:
    if noise is not None:
        if not do_sample:
            raise ValueError("noise is used only with do_sample=True")
        if not isinstance(noise, torch.Tensor) or noise.shape != (B, T) or \
                not noise.is_floating_point():
            got = (f"{tuple(noise.shape)} {noise.dtype}" if isinstance(noise, torch.Tensor)
                   else type(noise).__name__)
            raise ValueError(f"noise must be a float tensor of shape {(B, T)}, got {got}")
        if not bool(((noise >= 0) & (noise < 1)).all()):
            raise ValueError("noise must hold uniform variates in [0, 1)")
    checks.nonneg_int("ngram", ngram)
