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
from paraprop.decoding import settings as _settings
from paraprop.decoding.lm import CachedLM, cache_keyword, forward_params
from paraprop.decoding.ngrams import NgramPool
from paraprop.decoding.processors import Pipeline, _scale
from paraprop.determinism import require_deterministic
from paraprop.errors import ConvergenceError, NotTriangularError, StochasticModelError
from paraprop.result import Result
from paraprop.solve import solve
from paraprop.solvers import GSJacobi, Sequential, SlidingJacobi, is_solver

METHODS = ("sequential", "jacobi", "gs_jacobi")
DEFAULT_WINDOW = 16


def generate(model, input_ids: torch.Tensor, *, max_new_tokens: int | None = None,
             method="jacobi", window: int | None = None, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
             min_new_tokens: int | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, generation_config=None,
             generator: torch.Generator | None = None, noise: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None, ngram: int = 2,
             max_iters: int | None = None, throw: bool = True):
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
        window: tokens per pass (default 16, at most ``max_new_tokens``).
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

    Returns:
        ``(tokens, solution)``: ``tokens`` is ``(B, P + n)`` (prompt, then the new tokens) as
        ``generate`` returns it; ``solution.value`` holds all ``max_new_tokens`` positions.
        ``stats``: ``model_calls`` (forward passes, prefill included: the sequential steps;
        the sequential loop takes ``max_new_tokens``), ``decode_calls`` (after the prefill),
        ``tokens_per_call`` (new tokens per model call), ``fed_positions``, ``window``,
        ``new_tokens``, ``batch_advance``, ``processors`` (applied, in order), the
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
    the dtype and the depth: :func:`~paraprop.decoding.settings.rounding_factor`); otherwise
    the result says so (``converged=False``), and the message names the cause: non-finite
    logits from the model, an exact tie (of the scores, or at a setting's cut), or a margin
    within the rounding bound. ``method="sequential"`` is ``generate``'s loop and needs no
    margin.

    The repeat check: each parallel pass also recomputes the last decided position before its
    window (one more position fed, no extra model call), and its logits are compared with the
    ones it was decided from (see :class:`_TokenMap`), so a model that is not a fixed function
    of its input is refused even where no up-front check recognises its randomness.

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
    _settings.check_causal(model)
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
    _settings.check_model(model, input_ids, s)
    attention_mask = _mask(model, input_ids, attention_mask, s)
    _check_run(B, T, window, noise, s.do_sample, ngram)
    solver = _solver(method, window, T)
    device = input_ids.device
    u = None
    if s.do_sample:
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
        pool = NgramPool([[t for t, k in zip(r, m, strict=True) if k]
                          for r, m in zip(rows, keep, strict=True)], ngram, solver_size(solver, T))
    with torch.no_grad():
        first = lm.prefill(P)
        factor, coarse = _settings.rounding_factor(model, first)
        pipe = Pipeline(s, P, attention_mask, device, factor)
        tmap = _TokenMap(lm, P, T, u, pipe, s.eos, s.pad, pool, first, model=model,
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
             "batch_advance": "minimum" if B > 1 else "per-sample",
             "processors": pipe.active}
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
            stats["uncertified_cause"] = _cause(tmap, b, t, coarse, len(where))
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


class _TokenMap:
    """The triangular system of the generated tokens (float64 ids, ``(B, T)``), with the
    cached-prefix protocol and guesses.

    Each decision is kept with the pass that made it (a memo): a position whose prefix has not
    changed since it was decided gets the same token without a model call, so the map is a
    function of the prefix even where two passes of different shapes would round differently
    (a full evaluation, e.g. a solver's verification, agrees with the window passes). A position
    computed again with the same prefix (a sample ahead of the batch's window) keeps its first
    decision, and the smaller margin of the two.

    **The repeat check.** With ``recheck`` (every parallel method), each pass also recomputes
    the last position before the first undecided one, whose prefix has not changed since it was
    decided (one more position fed; no extra model call). Its logits, and those of any other
    position computed again with the same prefix, are compared with the ones it was decided
    from (the ``FINGERPRINT`` largest logits of the first computation): a difference above the
    rounding bound of the margins means the model is not a fixed function of its input
    (:class:`paraprop.StochasticModelError`, raised at the next pass's host sync or at the end).
    Without ``recheck`` (the sequential loop, which computes each position once, from its final
    prefix, so that nothing is ever computed twice) no fingerprints are kept, and no margins:
    that loop is the reference and needs no certificate.

    **Where the bookkeeping runs.** The tokens, the decisions the window returns and the
    margins' arithmetic stay on the model's device. The memo (which position was decided with
    which prefix), the repeat check's comparison and the merge of a position's margins are
    small ``(B, T)`` integer and float arrays kept on the host (NumPy), fed by the pass's one
    transfer: each pass sends the iterate and the previous pass's decisions, margins and
    fingerprints to the host in one copy (a view on the CPU), and the comparison of a pass is
    made there, at the next pass's sync, which raises as before.
    """

    markov = False
    FINGERPRINT = 8       # logits kept per position for the repeat check (the largest ones)
    # the pass's transfer as one float64 copy (True), as views (False: the CPU), or by the
    # device (None: one copy off the CPU); the tests run the copy on the CPU
    PACKED: bool | None = None

    def __init__(self, lm: CachedLM, P: int, T: int, u, pipe: Pipeline, eos: list[int],
                 pad: int, pool: NgramPool | None, first: torch.Tensor, model=None,
                 recheck: bool = False):
        self.lm, self.P, self.T, self.u = lm, P, T, u
        self.pipe, self.pad, self.pool = pipe, pad, pool
        self.model, self.recheck = model, recheck
        self.started = False                    # position 0 decided (from the prefill)
        dev = self.device = lm.tokens.device
        self.eos = torch.tensor(eos, dtype=torch.long, device=dev) if eos else None
        self.eos_h = np.array(eos, dtype=np.int64) if eos else None
        self.first = first                      # the prefill's logits of position 0
        B = lm.tokens.shape[0]
        self.stamp = 0
        # host: the tokens written last time (never modified in place: a new array per pass),
        # the stamp of each position's latest change and of the latest change before it
        # (since[:, t] = max(changed[:, :t])), and of its decision: a decision is valid while
        # computed >= since
        self.written = lm.tokens[:, P:].cpu().numpy().copy()
        self.changed = np.zeros((B, T), dtype=np.int64)
        self.since = np.zeros((B, T), dtype=np.int64)
        self.computed = np.full((B, T), -1, dtype=np.int64)
        # the generated tokens the cache's entries after the prompt were computed from
        self.cache_gen = self.written[:, : max(0, lm.length - P)]
        self.tok = torch.zeros(B, T, dtype=torch.long, device=dev)    # decisions (device)
        self.tok_h = np.zeros((B, T), dtype=np.int64)                 # the same, on the host
        self.ratio = np.full((B, T), np.inf)
        # the criterion of the smallest margin (Pipeline.criteria), -1: non-finite logits,
        # -2: two computations from the same prefix chose different tokens
        self.cause = np.zeros((B, T), dtype=np.int64)
        K = min(self.FINGERPRINT, first.shape[-1])
        self.fp_idx = np.zeros((B, T, K), dtype=np.int64)
        self.fp_val = np.zeros((B, T, K), dtype=np.float64)
        self.fp_scale = np.zeros((B, T), dtype=np.float32)
        self.worst = 0.0            # the largest repeat difference over its bound so far
        self.compared = 0
        self.pending = None         # the last pass's results, settled at the next sync

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.window(x, 0, self.T, None)[0]

    def start_guess(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first iterate: the first token (decided from the prefill, no model call), then
        the n-gram guesses or the last prompt token repeated."""
        B = input_ids.shape[0]
        x = input_ids[:, -1:].to(torch.float64).repeat(1, self.T)
        x[:, :1] = self.window(x, 0, 1, None)[0]
        guess = self.propose(x, torch.ones(B, dtype=torch.long, device=x.device))
        if guess is not None:
            x[:, 1:] = guess[:, 1:]
        return x

    def update(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if index.numel() == 1:                 # the sequential loop: one sync
            lo = int(index)
            hi = lo + 1
        else:
            lo, hi = int(index[0]), int(index[-1]) + 1
        if hi - lo != index.numel():
            full = self.window(x, 0, self.T, None)[0]
            return full.index_select(1, index)
        return self.window(x, lo, hi, None)[0]

    def ended(self, gen: torch.Tensor) -> torch.Tensor:
        """``(B, T)``: the positions after a sample's first EOS (they get the pad token)."""
        if self.eos is None:
            return torch.zeros_like(gen, dtype=torch.bool)
        hit = torch.isin(gen, self.eos).long().cumsum(1) > 0               # EOS at or before t
        return torch.cat([hit.new_zeros(hit.shape[0], 1), hit[:, :-1]], 1)

    def _ended_h(self, gen: np.ndarray) -> np.ndarray:
        """:meth:`ended` of host tokens."""
        hit = np.logical_or.accumulate(np.isin(gen, self.eos_h), axis=1)
        out = np.zeros_like(hit)
        out[:, 1:] = hit[:, :-1]
        return out

    def _sync(self, x: torch.Tensor) -> np.ndarray:
        """The pass's one transfer to the host: the iterate ``x`` as host token ids, with the
        previous pass's results (settled here: the repeat check raises here)."""
        pend = self.pending
        tensors = [x.detach()] + ([] if pend is None else pend[2])
        packed = self.device.type != "cpu" if self.PACKED is None else self.PACKED
        if not packed:
            arrays = [t.numpy() for t in tensors]
        else:   # one copy, as float64 (exact for the ids), back to each tensor's dtype
            flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
            arrays, at = [], 0
            for t in tensors:
                arrays.append(flat[at : at + t.numel()].reshape(t.shape).astype(
                    _NUMPY[t.dtype], copy=False))
                at += t.numel()
        if pend is not None:
            self.pending = None
            self._settle(pend[0], pend[1], *arrays[1:])
        return arrays[0].astype(np.int64)

    def window(self, x: torch.Tensor, start: int, stop: int, cache):
        P, lm = self.P, self.lm
        gen = self._sync(x)
        self.stamp += 1
        self.changed[gen != self.written] = self.stamp
        self.written = gen
        lm.tokens[:, P:].copy_(x)
        np.maximum.accumulate(self.changed[:, :-1], axis=1, out=self.since[:, 1:])
        # not decided with the current prefix (and not after the sample's EOS)
        todo = self.computed[:, start:stop] < self.since[:, start:stop]
        ended = None
        if self.eos_h is not None:
            ended = self._ended_h(gen)[:, start:stop]
            todo &= ~ended
            # (host-to-device copies before the model call, not after it: from pageable
            # memory such a copy waits for the device's queue)
            ended = torch.from_numpy(ended).to(self.device) if ended.any() else None
        need = todo.any(0)
        if need.any():
            a = start + int(need.argmax())
            b = stop - int(need[::-1].argmax())
            if self.recheck and a > 0:
                a -= 1      # the repeat check: one decided position, recomputed
            self._decide(a, b, self._cache_valid())
        out = self.tok[:, start:stop]
        if ended is not None:
            out = torch.where(ended, self.pad, out)
        return out.to(x.dtype), None

    def _cache_valid(self) -> int:
        """The cache's valid length: the prompt's entries (never written) and the leading ones
        computed from the current tokens."""
        k = self.cache_gen.shape[1]
        if k == 0:
            return self.lm.length
        diff = (self.cache_gen != self.written[:, :k]).any(0)
        return self.P + (int(diff.argmax()) if diff.any() else k)

    def _decide(self, a: int, b: int, cached: int) -> None:
        """Decide the positions ``[a, b)`` from the current buffer (one model pass; ``cached``
        is the cache's valid length); the comparison of the positions decided before with the
        same prefix with the ones they were decided from, and the merge of their margins, are
        made on the host at the next sync (:meth:`_settle`)."""
        P, lm = self.P, self.lm
        valid = self.computed[:, a:b] >= self.since[:, a:b]     # decided with this prefix
        self.computed[:, a:b] = np.where(valid, self.computed[:, a:b], self.stamp)
        # (host-to-device copies before the model call: see window)
        valid_d = torch.from_numpy(valid).to(self.device) if valid.any() else None
        if self.recheck:
            idx = torch.from_numpy(self.fp_idx[:, a:b]).to(self.device)
        if a == 0 and not self.started:                   # position 0: from the prefill
            parts = [self.first[:, None]]
            if b > 1:
                parts.append(lm.logits(P, P - 1 + b, cached))
            logits = torch.cat(parts, 1)
        else:
            logits = lm.logits(P - 1 + a, P - 1 + b, cached)
        self.cache_gen = self.written[:, : max(0, lm.length - P)]
        u = None if self.u is None else self.u[:, a:b]
        self.started = True
        if not self.recheck:          # the sequential loop: the tokens, no certificate
            tok = self.pipe.decide(logits, lm.tokens, a, u, margins=False)[0]
            self.tok[:, a:b] = tok if valid_d is None else torch.where(
                valid_d, self.tok[:, a:b], tok)
            return
        scale = _scale(logits)
        # the margins (none for position 0 alone: it comes from the prefill, as generate's)
        first_only = a == 0 and b == 1
        tok, parts = self.pipe.decide_parts(logits, lm.tokens, a, u, scale=scale,
                                            margins=not first_only)
        new = logits.gather(-1, idx)
        top = logits.topk(idx.shape[-1], dim=-1)
        top_val = top.values
        if logits.dtype not in _NUMPY:         # 16-bit logits: float64 for the host (exact)
            new, top_val = new.to(torch.float64), top_val.to(torch.float64)
        self.tok[:, a:b] = tok if valid_d is None else torch.where(valid_d, self.tok[:, a:b],
                                                                    tok)
        self.pending = (a, valid, [tok, scale, new, top_val, top.indices, *(parts or [])])

    def _settle(self, a: int, valid: np.ndarray, tok, scale, new, top_val, top_idx,
                *parts) -> None:
        """A pass's results, on the host: its margins (:meth:`Pipeline.ratios`), the repeat
        check of the positions ``[a, b)`` decided before with the same prefix (``valid``:
        raises if it fails), the fingerprints of the others, and the merge of the margins (a
        position computed again with the same prefix keeps its first decision and the smaller
        margin; another decision is a near-tie)."""
        b = a + valid.shape[1]
        new, top_val = new.astype(np.float64, copy=False), top_val.astype(np.float64, copy=False)
        if parts:
            ratio, cause = self.pipe.ratios(list(parts))
        else:       # position 0 alone, from the prefill
            ratio, cause = np.full(valid.shape, np.inf), np.zeros(valid.shape, dtype=np.int64)
        if a == 0:          # computed by the prefill, exactly as generate's first step
            ratio[:, 0] = np.inf
        old = self.fp_val[:, a:b]
        bound = self.pipe.factor * np.maximum(scale, self.fp_scale[:, a:b]).astype(np.float64)
        both = valid[..., None]
        ok = both & np.isfinite(new) & np.isfinite(old)
        with np.errstate(all="ignore"):
            r = np.where(ok, np.abs(new - old) / bound[..., None], 0.0)
        r[np.isnan(r)] = 0.0                                   # 0/0: no difference
        self.compared += int(valid.sum())
        at = int(r.argmax())
        if r.flat[at] > self.worst:
            self.worst = float(r.flat[at])
            if self.worst > 1:
                n, K = r.shape[1], r.shape[2]
                i, t, k = at // (n * K), (at // K) % n, at % K
                self._stochastic(self.worst, i, a + t, int(self.fp_idx[i, a + t, k]),
                                 float(old[i, t, k]), float(new[i, t, k]), float(bound[i, t]))
        self.fp_idx[:, a:b] = np.where(both, self.fp_idx[:, a:b], top_idx)
        self.fp_val[:, a:b] = np.where(both, old, top_val)
        self.fp_scale[:, a:b] = np.where(valid, self.fp_scale[:, a:b], scale)
        old_tok, old_ratio, old_cause = self.tok_h[:, a:b], self.ratio[:, a:b], \
            self.cause[:, a:b]
        flip = valid & (tok != old_tok)          # same prefix, another decision: a near-tie
        if a == 0:
            flip[:, 0] = False                   # the prefill's token stands
        keep = valid & (old_ratio <= ratio)
        # the kept decision's cause (a non-finite one stays)
        cause = np.where(keep | (valid & (old_cause == -1)), old_cause, cause)
        self.ratio[:, a:b] = np.where(flip, 0.0, np.where(keep, old_ratio, ratio))
        self.cause[:, a:b] = np.where(flip & (cause != -1), -2, cause)
        self.tok_h[:, a:b] = np.where(valid, old_tok, tok)

    def settle(self) -> None:
        """Settle the last pass's results (one transfer; the repeat check raises here)."""
        if self.pending is not None:
            self._sync(self.tok.new_zeros((self.tok.shape[0], 0), dtype=torch.float64))

    def check_repeats(self) -> tuple[int, float]:
        """Raise :class:`~paraprop.StochasticModelError` if a repeat check failed; else the
        number of repeats compared and the largest difference over its bound."""
        self.settle()
        return self.compared, self.worst

    def _stochastic(self, r: float, b: int, t: int, tok: int, old: float, new: float,
                    bound: float) -> None:
        model = self.model
        training = []
        if isinstance(model, torch.nn.Module):
            training = [name for name, m in model.named_modules() if m.training]
        if training:
            where = ("model is in train mode" if "" in training else
                     f"model is in eval mode but {len(training)} of its modules are in train "
                     f"mode (e.g. {training[0]!r})")
            mode = (f"{where}, where one of its layers draws random numbers that paraprop's "
                    "check of train-mode layers does not recognise (router jitter noise, "
                    "functional dropout under another attribute name, a custom layer calling "
                    "torch.rand*, ...); call model.eval() first")
        else:
            mode = ("model is in eval mode, so its forward draws random numbers (or reads a "
                    "state that changes between calls) even there; make its forward a fixed "
                    "function of its input")
        raise StochasticModelError(
            f"decoding.generate: the model gave different logits for the same tokens in two "
            f"passes: at new position {t} of sample {b}, the logit of token "
            f"{tok} was {old:.9g}, then {new:.9g} from the same prefix, a difference of "
            f"{r:.3g} times the rounding bound ({bound:.3g}) between passes of different "
            "shapes. So it is not a fixed function of its input, and there is no sequential "
            f"result to reproduce (its tokens would change from run to run): the {mode} "
            "(expected the same logits within rounding for the same prefix)")

    def padded(self, b: int) -> bool:
        """Whether sample ``b``'s prompt is left-padded."""
        return self.lm.mask is not None and not bool(self.lm.mask[b, : self.P].all())

    def check_final(self, x: torch.Tensor) -> None:
        """Every accepted token must be the decision made from its final prefix (one
        evaluation of the map; no model call when the memo covers every position)."""
        y = self(x)
        if not torch.equal(y, x):
            b, t = (int(i) for i in (y != x).nonzero()[0])
            raise NotTriangularError(
                f"decoding.generate: the accepted token at new position {t} of sample {b} is not "
                "what the model gives for its accepted prefix; the model's logits at a position "
                "read later tokens (is it causal?) or its cache served stale entries")

    def propose(self, x: torch.Tensor, final: torch.Tensor):
        """Guesses for the undecided tokens: the n-gram continuation of each sample's accepted
        text (positions before ``final`` are kept by the solver). One transfer to the host and
        at most one back per pass."""
        if self.pool is None:
            return None
        both = torch.cat([final.to(torch.long)[:, None], x.to(torch.long)], 1).tolist()
        rows, changed = [], False
        for b, row in enumerate(both):
            f, toks = row[0], row[1:]
            rows.append(toks)
            if f >= self.T:
                continue
            text = self.pool.prompts[b] + toks[:f]
            self.pool.add(b, text)
            cont = self.pool.guess(b, text)[: self.T - f]
            if cont:
                toks[f : f + len(cont)] = cont
                changed = True
        if not changed:
            return None
        return torch.tensor(rows, dtype=x.dtype, device=x.device)


_NUMPY = {torch.bool: np.bool_, torch.int64: np.int64, torch.float32: np.float32,
          torch.float64: np.float64}


def _cause(tmap: _TokenMap, b: int, t: int, coarse: torch.dtype, count: int) -> str:
    """Why the token at new position ``t`` of sample ``b`` is not certified, and what to do:
    the model's logits are not finite; two computations from the same prefix chose different
    tokens; an exact tie (of the model's scores or at a setting's cut); or a margin within the
    rounding bound."""
    r, c = float(tmap.ratio[b, t]), int(tmap.cause[b, t])
    head = (f"decoding.generate: the token at new position {t} of sample {b} is not certified "
            f"({count} such token(s); stats['uncertified'] lists them): ")
    tail = "; pass throw=False to get these tokens with converged=False"
    seq = ("use method='sequential' (generate's own loop, its tokens bitwise)"
           + (f" or a float32 model instead of {coarse}" if torch.finfo(coarse).bits <= 16
              else ""))
    if c == -1:
        dtype = tmap.first.dtype
        why = (f"the model's logits for it are not finite (NaN, +inf, or all -inf in {dtype}), "
               "as its forward computed them for this prefix before any processing: not a "
               "rounding difference; no decision from them is certain, and generate decides "
               "from the same non-finite scores. ")
        if tmap.padded(b):
            why += (f"Sample {b}'s prompt is left-padded, and some models compute non-finite "
                    f"values at padded positions in {dtype} (a fully masked attention row) that "
                    "then reach the real ones: generate the padded prompts one at a time, "
                    "without padding")
        else:
            why += (f"Check the model's weights and this prompt in {dtype} (model(input_ids)"
                    ".logits shows them); remove_invalid_values=True replaces them as generate "
                    "does")
        return head + why + tail
    if c == -2:
        return (head + "two computations of its logits from the same prefix (passes of "
                "different shapes) chose different tokens, with logits within the rounding "
                f"bound in {coarse} of each other: a near-tie that rounding decides, so the "
                f"sequential loop may choose either; {seq}" + tail)
    crit = tmap.pipe.criteria()[c]
    if r == 0:
        if c == 0:
            what = ("the model's (processed) scores tie exactly there, and a tie is broken by "
                    "the order of computation, which differs between a window pass and the "
                    "sequential loop's one-token pass")
            fix = seq
        else:
            what = ("the setting's cut falls between two equal values exactly, so the order of "
                    "computation decides which side each lands on")
            fix = f"change that setting, or {seq}"
        return head + f"it is an exact tie in {crit}: {what}; {fix}" + tail
    return (head + f"it was decided by a margin of {r:.3g} times the bound on the rounding "
            f"difference between a window pass and the sequential loop's one-token pass in "
            f"{coarse} (the margin: {crit}), so the sequential loop may choose another token "
            f"there (and differ after it); for generate's tokens in this dtype {seq}" + tail)


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


def _solver(method, window, T):
    if is_solver(method):
        if not isinstance(method, (SlidingJacobi, GSJacobi, Sequential)):
            raise ValueError(f"method={method!r} is not supported by decoding; use "
                             "SlidingJacobi, GSJacobi or Sequential (or a name in "
                             f"{', '.join(METHODS)})")
        if window is not None:
            raise ValueError("window is set by the solver object here; pass window=None, got "
                             f"window={window!r}")
        return method
    checks.method_name(method, METHODS)
    w = min(DEFAULT_WINDOW, T) if window is None else window
    if method == "sequential":
        return Sequential()
    return SlidingJacobi(w) if method == "jacobi" else GSJacobi(w)


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


def _check_run(B, T, window, noise, do_sample, ngram) -> None:
    if window is not None:
        checks.positive_int("window", window)
        if window > T:
            raise ValueError(f"window must be at most max_new_tokens={T}, got window={window}")
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
