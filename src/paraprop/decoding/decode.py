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
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from paraprop import checks
from paraprop.decoding.lm import CachedLM, cache_keyword
from paraprop.decoding.ngrams import NgramPool
from paraprop.decoding.processors import check_sampling, choose, process_logits
from paraprop.result import Solution
from paraprop.solve import solve
from paraprop.solvers import GSJacobi, Sequential, SlidingJacobi, is_solver

METHODS = ("sequential", "jacobi", "gs_jacobi")
DEFAULT_WINDOW = 16


def generate(model, input_ids: torch.Tensor, *, max_new_tokens: int, method="jacobi",
             window: int | None = None, do_sample: bool = False, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None, noise: torch.Tensor | None = None,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None, ngram: int = 2,
             max_iters: int | None = None, throw: bool = True) -> tuple[torch.Tensor, Solution]:
    """Generate ``max_new_tokens`` tokens after ``input_ids``; the same tokens as the
    sequential loop (and, greedy, as ``model.generate(do_sample=False)``) in fewer passes.

    Arguments:
        model: a ``transformers`` causal LM (any architecture with a key/value cache), or any
            module with ``forward(input_ids, past_key_values=..., use_cache=True)`` returning
            the logits and the cache (see :mod:`paraprop.decoding.lm`).
        input_ids: ``(B, P)`` int64 prompts, left-padded when their lengths differ.
        max_new_tokens: tokens to generate per sample (fewer come back when every sample
            ended with EOS, as ``generate`` does).
        method: ``"jacobi"`` (:class:`~paraprop.solvers.SlidingJacobi` over ``window``
            tokens), ``"gs_jacobi"`` (blocks of ``window`` tokens, Jacobi inside each),
            ``"sequential"`` (one token per pass, the reference: ``generate``'s own loop), or a
            ``SlidingJacobi`` / ``GSJacobi`` / ``Sequential`` object.
        window: tokens per pass (default 16, at most ``max_new_tokens``).
        do_sample: sample instead of greedy; the tokens are then a function of the noise.
        temperature, top_k, top_p: the warpers of ``generate``, applied as it applies them
            (temperature, then top-k, then top-p, on float32 logits). Note that ``generate``
            defaults to ``top_k=50``; here ``None`` means no top-k.
        generator: draws the noise (one uniform variate per sample and position).
        noise: the uniform variates ``(B, max_new_tokens)`` in ``[0, 1)`` instead.
        eos_token_id: token(s) that end a sample; later positions get ``pad_token_id``.
        pad_token_id: default: ``model.config.pad_token_id``, else the first EOS token.
        attention_mask: ``(B, P)`` of 0/1, zeros on the left padding only.
        ngram: guesses the undecided tokens from the continuation of the last ``ngram``
            accepted tokens seen earlier in the prompt or output (``0``: no guesses; the
            previous iterate then stays the guess). Guesses never change the result.
        max_iters: cap on passes (default: the exactness bound ``max_new_tokens``).
        throw: raise :class:`paraprop.ConvergenceError` if ``max_iters`` stops it first.

    Returns:
        ``(tokens, solution)``: ``tokens`` is ``(B, P + n)`` (prompt, then the new tokens) as
        ``generate`` returns it; ``solution.value`` holds all ``max_new_tokens`` positions.
        ``stats``: ``model_calls`` (forward passes, prefill included: the sequential steps),
        ``tokens_per_call`` (new tokens per decoding pass), ``positions`` (token positions
        computed), ``window``, ``batch_advance`` (the window starts at the batch's least
        accepted length; a sample ahead of it recomputes tokens it already has).

    Raises:
        TypeError: a model without the cache contract.
        ValueError: bad arguments (named, with the expected and the actual value).

    Floating-point fine print: a window pass and a one-token pass compute the same logits in
    a different order, so they may round differently; a token can differ from the sequential
    one only where two scores (greedy) or a variate and a cumulative probability (sampling) tie
    to within that rounding. In float64 this does not happen in practice (the tests compare
    with ``generate`` there).
    """
    B, P, T = _validate(model, input_ids, max_new_tokens, window, attention_mask, noise,
                        do_sample, temperature, top_k, top_p, ngram)
    solver = _solver(method, window, T)
    eos = _token_list("eos_token_id", eos_token_id)
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = eos[0] if eos else 0
    checks.nonneg_int("pad_token_id", pad_token_id)
    device = input_ids.device
    u = None
    if do_sample:
        u = noise if noise is not None else torch.rand(B, T, generator=generator,
                                                       dtype=torch.float64, device=device)
    tokens = torch.cat([input_ids, input_ids.new_full((B, T), pad_token_id)], dim=1)
    mask = None
    if attention_mask is not None:
        mask = torch.cat([attention_mask.to(torch.long),
                          attention_mask.new_ones((B, T), dtype=torch.long)], dim=1)
    lm = CachedLM(model, tokens, mask)
    pool = None
    if ngram and not isinstance(solver, Sequential):
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None \
            else attention_mask.bool()
        pool = NgramPool([row[keep].tolist() for row, keep in zip(input_ids, real, strict=True)],
                         ngram, solver_size(solver, T))
    tmap = _TokenMap(lm, P, T, u, dict(temperature=temperature, top_k=top_k, top_p=top_p),
                     eos, pad_token_id, pool)
    with torch.no_grad():
        lm.prefill(P - 1)
        sol = solve(tmap, torch.full((B, T), float(pad_token_id), dtype=torch.float64,
                                     device=device),
                    method=solver, dim=-1, tol=0.0, max_iters=max_iters, throw=throw)
    gen = sol.value.to(torch.long)
    n = T
    if eos:
        is_eos = torch.isin(gen, torch.tensor(eos, device=device))
        if bool(is_eos.any(1).all()):
            n = int(is_eos.long().argmax(1).max()) + 1
    decode_calls = lm.calls - (1 if P > 1 else 0)
    stats = {**sol.stats, "model_calls": lm.calls, "decode_calls": decode_calls,
             "tokens_per_call": n / max(decode_calls, 1), "fed_positions": lm.fed,
             "window": solver_size(solver, T), "new_tokens": n,
             "batch_advance": "minimum" if B > 1 else "per-sample"}
    sol = dataclasses.replace(sol, value=gen, stats=stats)
    return torch.cat([input_ids, gen[:, :n]], dim=1), sol


def solver_size(solver, T: int) -> int:
    """Tokens per pass of a decoding solver (its own default where its setting is ``None``:
    ``SlidingJacobi``'s and ``GSJacobi``'s ``size`` read only the number of positions)."""
    if isinstance(solver, Sequential):
        return 1
    return solver.size(SimpleNamespace(T=T))


class _TokenMap:
    """The triangular system of the generated tokens (float64 ids, ``(B, T)``), with the
    cached-prefix protocol and guesses."""

    markov = False

    def __init__(self, lm: CachedLM, P: int, T: int, u, warpers: dict, eos: list[int],
                 pad: int, pool: NgramPool | None):
        self.lm, self.P, self.T, self.u = lm, P, T, u
        self.warpers, self.pad, self.pool = warpers, pad, pool
        self.eos = torch.tensor(eos, dtype=torch.long, device=lm.tokens.device) if eos else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.window(x, 0, self.T, None)[0]

    def update(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        lo, hi = int(index[0]), int(index[-1]) + 1
        if hi - lo != index.numel():
            full = self.window(x, 0, self.T, None)[0]
            return full.index_select(1, index)
        return self.window(x, lo, hi, None)[0]

    def window(self, x: torch.Tensor, start: int, stop: int, cache):
        P, lm = self.P, self.lm
        gen = x.to(torch.long)
        lm.tokens[:, P:] = gen
        ended = None
        if self.eos is not None:
            hit = torch.isin(gen, self.eos).long().cumsum(1) > 0    # EOS at or before t
            ended = torch.cat([hit.new_zeros(hit.shape[0], 1), hit[:, :-1]], 1)[:, start:stop]
            if start > 0 and bool(hit[:, start - 1].all()):        # every sample has ended
                return x.new_full((x.shape[0], stop - start), float(self.pad)), None
        logits = lm.logits(P - 1 + start, P - 1 + stop)
        if self.u is None:   # greedy: generate's argmax of the float32 logits
            tok = choose(logits.to(torch.float32), None)
        else:
            tok = choose(process_logits(logits, **self.warpers), self.u[:, start:stop])
        if ended is not None:
            tok = torch.where(ended, self.pad, tok)
        return tok.to(x.dtype), None

    def propose(self, x: torch.Tensor, final: torch.Tensor):
        """Guesses for the undecided tokens: the n-gram continuation of each sample's accepted
        text (positions before ``final`` are kept by the solver)."""
        if self.pool is None:
            return None
        out = None
        rows = x.to(torch.long).tolist()    # one transfer for the whole batch
        for b, f in enumerate(final.tolist()):
            if f >= self.T:
                continue
            text = self.pool.prompts[b] + rows[b][:f]
            self.pool.add(b, text)
            cont = self.pool.guess(b, text)[: self.T - f]
            if cont:
                if out is None:
                    out = x.clone()
                out[b, f : f + len(cont)] = torch.tensor(cont, dtype=x.dtype, device=x.device)
        return out


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


def _token_list(name: str, value) -> list[int]:
    if value is None:
        return []
    items = [value] if not isinstance(value, (list, tuple)) else list(value)
    for v in items:
        checks.nonneg_int(name, v)
    return items


def _validate(model, input_ids, max_new_tokens, window, attention_mask, noise, do_sample,
              temperature, top_k, top_p, ngram) -> tuple[int, int, int]:
    cache_keyword(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or \
            input_ids.dtype not in (torch.int64, torch.int32):
        got = (f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ValueError(f"input_ids must be an integer tensor of shape (batch, prompt_length), "
                         f"got {got}")
    B, P = input_ids.shape
    if B < 1 or P < 1:
        raise ValueError(f"input_ids must hold at least one token per sample, got shape {(B, P)}")
    T = checks.positive_int("max_new_tokens", max_new_tokens)
    if window is not None:
        checks.positive_int("window", window)
        if window > T:
            raise ValueError(f"window must be at most max_new_tokens={T}, got window={window}")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, P):
            got = (tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                   else type(attention_mask).__name__)
            raise ValueError(f"attention_mask must have the shape of input_ids {(B, P)}, got "
                             f"{got}")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 and 1")
        if not bool(attention_mask[:, -1].bool().all()):
            raise ValueError("attention_mask: the last prompt position of every sample must be "
                             "1 (pad prompts on the left, as generate expects)")
        m = attention_mask.long()
        if bool((m[:, 1:] < m[:, :-1]).any()):
            raise ValueError("attention_mask must be left padding: zeros, then ones, per row")
    checks.boolean("do_sample", do_sample)
    check_sampling(temperature, top_k, top_p)
    if not do_sample and (temperature != 1.0 or top_k is not None or top_p is not None):
        raise ValueError("temperature, top_k and top_p apply to sampling; pass do_sample=True "
                         f"(got temperature={temperature}, top_k={top_k}, top_p={top_p})")
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
    return B, P, T
