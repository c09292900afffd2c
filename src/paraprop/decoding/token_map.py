"""The token system of :func:`paraprop.decoding.generate`: the generated tokens as a triangular
map over the key/value-cached model, with the certificate of every decision.

:class:`TokenMap` is the map the solver iterates (``window`` and ``propose`` protocols): it
decides the tokens of a window from one model pass, keeps each decision with the prefix it was
made from (a memo, so that the map is a function of the prefix), measures each decision's
margin against the rounding bound, and runs the repeat check that refuses a model that is not
a fixed function of its input. :func:`uncertified_cause` says why a token is not certified and
what to do.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from paraprop.decoding.gumbel import GumbelNoise
from paraprop.decoding.lm import CachedLM
from paraprop.decoding.ngrams import NgramPool
from paraprop.decoding.processors import Pipeline, _scale
from paraprop.errors import NotTriangularError, StochasticModelError


class TokenMap:
    """The triangular system of the generated tokens (float64 ids, ``(B, T)``), with the
    cached-prefix protocol and guesses. The noise ``u``: ``None`` (greedy), the ``(B, T)``
    uniform variates (the inverse-CDF draw), or a :class:`~paraprop.decoding.gumbel.GumbelNoise`
    (the Gumbel-max coupling; computed for the positions a pass decides).

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
        # the last pass's results, settled at the next sync: (a, valid, device tensors)
        self.pending: tuple[int, np.ndarray, list[torch.Tensor]] | None = None
        # with a lookahead pool: the rows of the iterate the next pass is fed (host lists)
        self.fed_rows: list[list[int]] | None = None
        self.stop = 0

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

    @staticmethod
    def _ended_h(gen: np.ndarray, eos: np.ndarray) -> np.ndarray:
        """:meth:`ended` of host tokens (``eos``: the EOS tokens, on the host)."""
        hit = np.logical_or.accumulate(np.isin(gen, eos), axis=1)
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
        self.stop = stop           # (the lookahead pool reads the positions [.., stop) given)
        gen = self._sync(x)
        self.stamp += 1
        self.changed[gen != self.written] = self.stamp
        self.written = gen
        lm.tokens[:, P:].copy_(x)
        np.maximum.accumulate(self.changed[:, :-1], axis=1, out=self.since[:, 1:])
        # not decided with the current prefix (and not after the sample's EOS)
        todo = self.computed[:, start:stop] < self.since[:, start:stop]
        ended: torch.Tensor | None = None
        if self.eos_h is not None:
            ended_h = self._ended_h(gen, self.eos_h)[:, start:stop]
            todo &= ~ended_h
            # (host-to-device copies before the model call, not after it: from pageable
            # memory such a copy waits for the device's queue)
            ended = torch.from_numpy(ended_h).to(self.device) if ended_h.any() else None
        need = cast(np.ndarray, todo.any(0))      # (B, n) -> (n,): an array, not a scalar
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
            pieces = [self.first[:, None]]
            if b > 1:
                pieces.append(lm.logits(P, P - 1 + b, cached))
            logits = torch.cat(pieces, 1)
        else:
            logits = lm.logits(P - 1 + a, P - 1 + b, cached)
        self.cache_gen = self.written[:, : max(0, lm.length - P)]
        u = noise = None
        if isinstance(self.u, GumbelNoise):       # the Gumbel-max coupling's noise, on demand
            noise = self.u.window(a, b, logits.shape[-1])
        elif self.u is not None:
            u = self.u[:, a:b]
        self.started = True
        if not self.recheck:          # the sequential loop: the tokens, no certificate
            tok = self.pipe.decide(logits, lm.tokens, a, u, margins=False, noise=noise)[0]
            self.tok[:, a:b] = tok if valid_d is None else torch.where(
                valid_d, self.tok[:, a:b], tok)
            return
        scale = _scale(logits)
        # the margins (none for position 0 alone: it comes from the prefill, as generate's)
        first_only = a == 0 and b == 1
        top = logits.topk(idx.shape[-1], dim=-1)      # the fingerprints (and greedy's best two)
        tok, parts = self.pipe.decide_parts(logits, lm.tokens, a, u, scale=scale,
                                            margins=not first_only, noise=noise,
                                            largest=top.values)
        new = logits.gather(-1, idx)
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
            "(expected the same logits within rounding for the same prefix)" + _beyond(r))

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
        text (positions before ``final`` are kept by the solver); ``None`` where no guess
        changes the iterate. One transfer to the host and at most one back per pass."""
        if self.pool is None:
            return None
        both = torch.cat([final.to(torch.long)[:, None], x.to(torch.long)], 1).tolist()
        spans: list[tuple[int, int, int]] = []      # (sample, first position, length)
        flat: list[int] = []                        # the continuations, one after another
        lookahead = self.pool.ahead is not None
        fed = self.fed_rows if lookahead else None
        for b, row in enumerate(both):
            f, toks = row[0], row[1:]
            if f >= self.T:
                continue
            text = self.pool.prompts[b] + toks[:f]
            self.pool.add(b, text)
            if fed is not None and f < self.stop:    # the iterate's n-grams (Lookahead)
                P = len(self.pool.prompts[b])
                self.pool.add_iterate(b, self.pool.prompts[b] + fed[b], toks[f : self.stop],
                                      P + f, P + self.stop)
            cont = list(self.pool.guess(b, text)[: self.T - f])
            if cont and cont != toks[f : f + len(cont)]:     # (the same tokens: no change)
                spans.append((b, f, len(cont)))
                flat += cont
        if lookahead:     # the iterate the next pass is fed (the guesses written in below)
            self.fed_rows = [row[1:] for row in both]
            for (b, f, n), at in zip(spans, _offsets(spans), strict=True):
                self.fed_rows[b][f : f + n] = flat[at : at + n]
        if not flat:
            return None
        # the iterate with the continuations written in (one transfer back; the rest of each
        # row is the iterate's own values)
        vals = torch.tensor(flat, dtype=x.dtype).to(x.device)
        guess = x.clone()
        at = 0
        for b, f, n in spans:
            guess[b, f : f + n] = vals[at : at + n]
            at += n
        return guess


def _offsets(spans: list[tuple[int, int, int]]) -> list[int]:
    """Where each span's tokens start in the flat list of continuations."""
    out, at = [], 0
    for _, _, n in spans:
        out.append(at)
        at += n
    return out


SMALL_EXCESS = 16.0     # a repeat difference below this many bounds may be rounding


def _beyond(r: float) -> str:
    """The repeat check's caveat for a difference of ``r`` bounds: a small one may also be
    rounding beyond the bound (the bound is 4 times the largest difference measured, on the
    shipped char LM and small random models; another model's logits may round more)."""
    if r >= SMALL_EXCESS:
        return ""
    return (f". A difference of only {r:.3g} times the bound may also be rounding beyond the "
            "bound on this model (the bound was measured on a few models, with a margin of 4; "
            "another model's logits may round more): if the model is a fixed function of its "
            "input, use method='sequential' (the sequential loop, which has no bound to "
            "exceed)")


_NUMPY = {torch.bool: np.bool_, torch.int64: np.int64, torch.float32: np.float32,
          torch.float64: np.float64}


def uncertified_cause(tmap: TokenMap, b: int, t: int, coarse: torch.dtype, count: int) -> str:
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
