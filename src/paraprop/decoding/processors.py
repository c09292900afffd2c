"""The logits processing of ``transformers``' ``generate``, position by position, and the
margins by which each token was decided.

``generate`` takes the last position's logits in float32, applies its logits processors and then,
when sampling, its warpers, in the order ``GenerationMixin._get_logits_processor`` builds them,
and picks the argmax or draws with ``torch.multinomial``. :class:`Pipeline` applies the same
processors, built from the same public ``transformers`` classes in the same order, to each
position of a window with that position's own prefix ``input_ids[:, :P + t]`` (which keeps the
tokens a triangular system: a position's scores depend only on its prefix). Temperature, top-k
and top-p are :func:`process_logits` (the same operations as ``transformers``' warpers, so the
same scores, without importing ``transformers``). The draw is the inverse CDF of the processed
distribution at one uniform variate per position (:func:`choose`), so a token is a function of
its prefix and its variate.

Each decision also gets a **margin ratio**: how far the decision is from flipping, relative to a
bound ``delta`` on the rounding difference of the logits between two ways of computing them (see
:func:`paraprop.decoding.model_checks.rounding_factor`); a ratio above 1 means that no change of the
logits within ``delta`` changes the token. Greedy: the gap between the best and the second best
processed score against ``2 * gain * delta``, where ``gain`` is how much the processors scale a
score (``1 / temperature`` and the repetition penalty). Sampling: the distance of the variate
from the boundaries of its token's interval of the cumulative distribution, and the distance of
each filter (top-k, top-p, min-p, epsilon) from its threshold, against the change that ``delta``
can cause.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from paraprop.decoding import gumbel as _gumbel


def process_logits(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """The scores ``generate(do_sample=True)`` samples from: float32 logits divided by
    ``temperature``, then all but the ``top_k`` largest set to ``-inf``, then the smallest ones
    whose total probability stays within ``1 - top_p`` set to ``-inf`` (the largest always
    kept). ``logits`` is ``(..., V)``; the result has its shape, in float32."""
    return _warp(logits.to(torch.float32), temperature, top_k, top_p)[-1]


def _warp(scores: torch.Tensor, temperature, top_k, top_p) -> list[torch.Tensor]:
    """The scores after temperature, after top-k and after top-p (each stage, in order)."""
    if temperature != 1.0:
        scores = scores / temperature
    stages = [scores]
    shape = scores.shape
    flat = scores.reshape(-1, shape[-1])
    if top_k is not None and top_k < shape[-1]:
        kth = torch.topk(flat, top_k, dim=-1).values[:, -1:]
        flat = flat.masked_fill(flat < kth, -torch.inf)
    stages.append(flat.reshape(shape))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(flat, dim=-1)                   # ascending
        mass = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = mass <= 1 - top_p
        drop[:, -1] = False                                         # keep the most likely one
        flat = flat.masked_fill(drop.scatter(1, order, drop), -torch.inf)
    stages.append(flat.reshape(shape))
    return stages


def choose(scores: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """Tokens from scores ``(..., V)``: the argmax (greedy, ``u=None``), or the inverse CDF of
    ``softmax(scores)`` at the uniform variates ``u`` ``(...)`` in ``[0, 1)`` (the first token
    whose cumulative probability exceeds ``u`` times the total). Returns int64 ``(...)``."""
    if u is None:
        return scores.argmax(dim=-1)
    return _draw(scores, _cdf(scores), u)[0]


def _cdf(scores: torch.Tensor) -> torch.Tensor:
    """The cumulative distribution of ``softmax(scores)`` in float64 ``(..., V)``."""
    return scores.softmax(dim=-1).to(torch.float64).cumsum(dim=-1)


def _draw(scores: torch.Tensor, cdf: torch.Tensor,
          u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`choose`'s draw from the distribution ``cdf`` (:func:`_cdf`), and the level
    ``u * total`` ``(...)`` it was drawn at."""
    level = u.to(torch.float64) * cdf[..., -1]
    tok = (cdf <= level[..., None]).sum(dim=-1)
    return tok.clamp(max=scores.shape[-1] - 1), level


class Pipeline:
    """``generate``'s logits processing for one call (see the module doc).

    Arguments:
        s: the effective settings (:class:`paraprop.decoding.settings.Settings`).
        P: the prompt length (padding included).
        attention_mask: ``(B, P)`` or ``None``; the repetition penalty skips left padding where
            the installed ``generate`` does.
        device: where the processors' tensors live.
        factor: the rounding bound's factor ``c`` (``delta = c * max|logits|`` per position).
        coupling: how a sampled token is drawn: ``"inverse_cdf"`` (one variate per position)
            or ``"gumbel"`` (Gumbel noise per vocabulary entry: :mod:`paraprop.decoding.gumbel`).
    """

    def __init__(self, s, P: int, attention_mask: torch.Tensor | None, device, factor: float,
                 coupling: str = "inverse_cdf"):
        self.s, self.P, self.factor = s, P, factor
        self.gumbel = bool(s.do_sample) and coupling == "gumbel"
        self.procs = _processors(s, P, attention_mask, device)
        self.post = _post_warpers(s) if s.do_sample else []
        self.normalize = None
        if s.renormalize_logits:
            from transformers.generation.logits_process import LogitNormalization
            self.normalize = LogitNormalization()
        gain = 1.0
        if s.repetition_penalty is not None:
            gain = max(s.repetition_penalty, 1 / s.repetition_penalty)
        if s.do_sample:
            gain /= s.temperature
        self.gain = gain

    @property
    def active(self) -> list[str]:
        """The names of the processors and warpers applied, in order (for ``stats``)."""
        names = [type(p).__name__ for p in self.procs]
        if self.s.do_sample:
            names += [n for n, on in (("temperature", self.s.temperature != 1.0),
                                      ("top_k", self.s.top_k is not None),
                                      ("top_p", self.s.top_p is not None)) if on]
            names += [type(p).__name__ for p in self.post]
        if self.normalize is not None:
            names.append("LogitNormalization")
        return names

    def process(self, logits: torch.Tensor, tokens: torch.Tensor,
                first: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The processed scores ``(B, n, V)`` float32 that ``generate`` picks from (greedy) or
        samples from, for the logits ``(B, n, V)`` of the positions ``first .. first + n - 1``;
        ``tokens`` is the token buffer (prompt, then the generated positions), whose prefix
        ``[:, :P + t]`` the processors of position ``t`` read. Also the intermediate stages of
        the sampling warpers (for the margins)."""
        scores = logits.to(torch.float32)
        if self.procs:
            rows = []
            for i in range(scores.shape[1]):
                ids = tokens[:, : self.P + first + i]
                sc = scores[:, i]
                for proc in self.procs:
                    sc = proc(ids, sc)
                rows.append(sc)
            scores = torch.stack(rows, 1)
        stages = []
        if self.s.do_sample:
            s = self.s
            stages = _warp(scores, s.temperature, s.top_k, s.top_p)
            scores = stages[-1]
            shape = scores.shape
            for proc in self.post:
                stages.append(scores)
                scores = proc(None, scores.reshape(-1, shape[-1])).reshape(shape)
        if self.normalize is not None:
            scores = self.normalize(None, scores.reshape(-1, scores.shape[-1])).reshape(
                scores.shape)
        return scores, stages

    def criteria(self) -> list[str]:
        """What each margin of :meth:`decide` measures, by its index in ``cause`` (for the
        messages): the decision itself, then each sampling filter's cut."""
        s = self.s
        if not s.do_sample:
            return ["the gap between the best and the second-best processed score"]
        out = ["the gap between the best and the second-best perturbed score (processed score "
               "plus Gumbel noise)" if self.gumbel else
               "the variate's distance to the edge of its token's interval of the cumulative "
               "distribution"]
        if s.top_k is not None:
            out.append(f"top_k={s.top_k}'s cut (the {s.top_k}-th score against the next one)")
        if s.top_p is not None:
            out += [f"top_p={s.top_p}'s cut (the cumulative mass at the cut)",
                    f"top_p={s.top_p}'s cut (the two scores on both sides of it)"]
        for proc in self.post:
            if type(proc).__name__ == "MinPLogitsWarper":
                out.append(f"min_p={s.min_p}'s threshold (a score against the best one)")
            else:
                out.append(f"epsilon_cutoff={s.epsilon_cutoff}'s threshold (a probability)")
        return out

    def decide(self, logits: torch.Tensor, tokens: torch.Tensor, first: int,
               u: torch.Tensor | None, *, scale: torch.Tensor | None = None,
               margins: bool = True, noise: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Tokens, margin ratios and causes ``(B, n)`` for the logits of the positions
        ``first .. first + n - 1`` (see :meth:`process`), with the variates ``u`` ``(B, n)`` when
        sampling (``noise``: the Gumbel noise ``(B, n, V)`` instead, with the Gumbel-max
        coupling). ``cause`` is the index in :meth:`criteria` of the smallest margin, or ``-1``
        where the model's logits are not finite (NaN, ``+inf``, or all ``-inf``). ``scale``:
        :func:`_scale` of ``logits`` where the caller has it. ``margins=False``: the tokens
        only (ratio and cause ``None``), for the sequential loop, which needs no certificate.

        The margins' last steps are elementwise arithmetic on ``(B, n)`` values, made on the
        host (:meth:`decide_parts`, then :meth:`ratios`: one transfer; Jacobi decoding defers
        it to its next sync); the ratios are the same bits either way."""
        tok, parts = self.decide_parts(logits, tokens, first, u, scale=scale, margins=margins,
                                       noise=noise)
        if parts is None:
            return tok, None, None
        ratio, cause = self.ratios([p.cpu().numpy() for p in parts])
        return (tok, torch.from_numpy(ratio).to(tok.device),
                torch.from_numpy(cause).to(tok.device))

    def decide_parts(self, logits: torch.Tensor, tokens: torch.Tensor, first: int,
                     u: torch.Tensor | None, *, scale: torch.Tensor | None = None,
                     margins: bool = True, noise: torch.Tensor | None = None,
                     largest: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The part of :meth:`decide` on the logits' device: the tokens ``(B, n)``, and the
        small tensors (each ``(B, n)`` or ``(B, n, 2)``, no bfloat16) that :meth:`ratios`
        makes the margin ratios from (``None`` with ``margins=False``). ``largest``: the
        largest logits in descending order ``(B, n, K)`` (``logits.topk(K).values``), where the
        caller has them; greedy decoding then reads its best two scores there when nothing
        changes the logits before the argmax (the same values as a ``topk(2)``)."""
        scores, stages = self.process(logits, tokens, first)
        top = None
        if noise is not None:                   # the Gumbel-max coupling
            tok, top = _gumbel.perturbed_top(scores, noise, margins=margins)
        elif u is None:
            tok = scores.argmax(dim=-1)
        else:
            cdf = _cdf(scores)
            tok, level = _draw(scores, cdf, u)
        if not margins:
            return tok, None
        if scale is None:
            scale = _scale(logits)
        # 2 * delta, delta = c * max|logits| * gain: the (B, n) score-space bound (doubling
        # is exact, so this is bitwise 2 * (c * scale * gain))
        delta2 = (2 * self.factor) * scale
        if self.gain != 1.0:
            delta2 = delta2 * self.gain
        finite = logits.amax(-1).isfinite()     # amax is NaN with a NaN, inf with an inf
        if top is not None:
            # the gap of the best two perturbed scores, as greedy's, and the filters' cuts
            assert noise is not None   # (top comes from the Gumbel branch only)
            return tok, [finite, delta2, top,
                         *self._filter_ratios(stages, delta2, torch.expm1(delta2) / 4,
                                              gumbel=(tok, noise))]
        if u is None:
            # the best two processed scores (their gap is the decision's margin)
            if scores.shape[-1] < 2:
                top = delta2[..., None]
            elif largest is not None and scores is logits and largest.shape[-1] >= 2:
                top = largest[..., :2]          # (no processing: the scores are the logits)
            else:
                top = scores.topk(2, dim=-1).values
            return tok, [finite, delta2, top]
        # a normalised cumulative mass c moves by at most c (1 - c) (e^{2 delta} - 1)
        rel = torch.expm1(delta2) / 4
        # the cumulative mass below and at the drawn token (the edges of its interval)
        edges = cdf.gather(-1, torch.stack([tok - 1, tok], -1).clamp(min=0))
        return tok, [finite, rel, cdf[..., -1], level, edges, tok,
                     *self._filter_ratios(stages, delta2, rel)]

    def ratios(self, parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The margin ratios (float64) and causes (int64) ``(B, n)`` of :meth:`decide`, on the
        host, from :meth:`decide_parts`'s tensors (as NumPy arrays of their dtypes): the same
        IEEE operations as on the device, so the same bits."""
        finite = parts[0]
        with np.errstate(all="ignore"):
            if self.gumbel:
                ratios = [_gumbel.gap_ratio(parts[2], parts[1])] + list(parts[3:])
            elif self.s.do_sample:
                rel, total, level, edges, tok = parts[1:6]
                ratios = [_draw_margin(edges, total, level, tok) / rel] + list(parts[6:])
            else:
                delta2, top = parts[1:3]
                if top.shape[-1] < 2:            # one token: no second best
                    gap = np.full(delta2.shape, np.inf, dtype=np.float32)
                else:
                    hi, lo = top[..., 0], top[..., 1]
                    gap = np.where(lo == -np.inf, np.float32(np.inf), hi - lo)
                ratios = [gap / delta2]
            if len(ratios) == 1:
                one = ratios[0].astype(np.float64)              # (a new array)
                one[np.isnan(one)] = 0.0                         # 0/0: an exact tie
                return one, np.where(finite, 0, -1).astype(np.int64, copy=False)
            stacked = np.stack([r.astype(np.float64) for r in ratios])
        stacked[np.isnan(stacked)] = 0.0                     # 0/0: an exact tie
        cause = stacked.argmin(0)
        ratio = np.take_along_axis(stacked, cause[None], 0)[0]
        return ratio, np.where(finite, cause, -1).astype(np.int64)

    def _filter_ratios(self, stages, delta2, rel,
                       gumbel: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> list[torch.Tensor]:
        s, out = self.s, []
        if s.top_k is not None:
            if s.top_k < stages[0].shape[-1]:
                cut = _gap(stages[0], s.top_k) / delta2
                if gumbel is not None and (s.top_p is None or s.top_p >= 1.0) and not self.post:
                    # the Gumbel-max decision when top-k is the only filter: a cut within the
                    # bound changes it only where the chosen token could leave the set or a
                    # token that could enter could beat it (_cut_moot)
                    tok, noise = gumbel
                    cut = torch.where(_cut_moot(stages[0], stages[1], tok, noise, delta2,
                                                s.top_k), torch.inf, cut)
                out.append(cut)
            else:
                out.append(torch.full_like(delta2, torch.inf))
        if s.top_p is not None:
            ordered = torch.sort(stages[1], dim=-1).values                  # ascending
            mass = ordered.softmax(dim=-1).cumsum(dim=-1)[..., :-1]
            out.append((mass - (1 - s.top_p)).abs().amin(-1) / rel)
            # two nearly equal scores on both sides of the cut may trade places
            k = (mass <= 1 - s.top_p).sum(-1, keepdim=True)                 # tokens dropped
            kept = ordered.gather(-1, k)
            dropped = ordered.gather(-1, (k - 1).clamp(min=0))
            gap = torch.where((k > 0) & (dropped > -torch.inf), kept - dropped, torch.inf)
            out.append(gap[..., 0] / delta2)
        for stage, proc in zip(stages[3:], self.post, strict=True):
            # the best token is always kept (the warpers' min_tokens_to_keep=1): only the
            # others can cross the threshold
            best = stage.argmax(-1, keepdim=True)
            if type(proc).__name__ == "MinPLogitsWarper":
                if s.min_p <= 0:
                    out.append(torch.full_like(delta2, torch.inf))
                    continue
                rel_logp = stage - stage.amax(-1, keepdim=True)
                dist = (rel_logp - math.log(s.min_p)).abs()
            else:   # EpsilonLogitsWarper
                dist = (stage.log_softmax(-1) - math.log(s.epsilon_cutoff)).abs()
            dist = dist.scatter(-1, best, torch.inf)
            out.append(_finite_min(dist, stage) / delta2)
        return out


def _scale(logits: torch.Tensor) -> torch.Tensor:
    """``max |logit|`` over the finite logits of each position, float32 ``(B, n)``."""
    # (nan_to_num makes a new tensor, so the in-place abs leaves the logits alone)
    return logits.to(torch.float32).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs_().amax(-1)


def _gap(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The gap between the ``k``-th and the ``(k + 1)``-th largest score (``inf`` where the
    latter is ``-inf`` or there is none)."""
    if scores.shape[-1] <= k:
        return torch.full(scores.shape[:-1], torch.inf, device=scores.device)
    top = torch.topk(scores, k + 1, dim=-1).values
    hi, lo = top[..., k - 1], top[..., k]
    return torch.where(lo == -torch.inf, torch.inf, hi - lo)


def _cut_moot(scores: torch.Tensor, kept: torch.Tensor, tok: torch.Tensor, noise: torch.Tensor,
              delta2: torch.Tensor, k: int) -> torch.Tensor:
    """``(B, n)`` bool: where top-k's cut cannot change a Gumbel-max decision, whatever the
    rounding moves each score by (at most half of ``delta2``), even where the cut itself is
    within it. ``scores``: the scores entering top-k, ``kept``: after it (``-inf`` outside),
    ``tok``: the decision, ``noise``: its Gumbel noise (float64). The sequential pass keeps the
    chosen token ``j`` where fewer than ``k`` other scores lie within ``delta2`` below ``j``'s
    or above it; a token it may keep that this pass dropped has a score within ``delta2`` of
    the ``k``-th largest (the ``k``-th moves by at most half of ``delta2``), and must not come
    within ``delta2`` of ``j``'s perturbed score (plus the float64 rounding of the additions,
    as :func:`~paraprop.decoding.gumbel.gap_ratio` takes it). The tokens both passes keep are
    the Gumbel margin's own (the gap of the best two perturbed scores)."""
    sc = scores.to(torch.float64)        # (the comparisons in float64: no rounding of theirs)
    d = delta2[..., None].to(torch.float64)
    sj = sc.gather(-1, tok[..., None])
    stays = (sc >= sj - d).sum(-1) - 1 <= k - 1
    kth = torch.topk(sc, k, dim=-1).values[..., -1:]
    dropped = (kept == -torch.inf) & (sc > -torch.inf) & (sc >= kth - d)
    pj = sj + noise.gather(-1, tok[..., None])
    pi = sc + noise
    slack = 2.0 ** -51 * (pi.abs() + pj.abs())
    beats = dropped & (pi >= pj - d - slack)
    return stays & ~beats.any(-1)


def _finite_min(dist: torch.Tensor, stage: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(stage), dist, torch.inf).amin(-1)


def _draw_margin(edges: np.ndarray, total: np.ndarray, level: np.ndarray,
                 tok: np.ndarray) -> np.ndarray:
    """The distance (as a fraction of the total mass) of the draw's level (:func:`_draw`) from
    the inner boundaries of the chosen token's interval of the cumulative distribution:
    ``edges`` holds the cumulative mass at the token before it and at the token (float64,
    ``(..., 2)``), ``total`` the whole mass (the boundaries at 0 and at the total do not
    move). On the host, in float64."""
    lo = np.where(tok > 0, edges[..., 0], 0.0)
    hi = edges[..., 1]
    below = np.where(lo > 0, level - lo, np.inf)
    above = np.where(hi < total, hi - level, np.inf)
    return np.minimum(below, above) / total


def _processors(s, P: int, attention_mask, device) -> list:
    """The logits processors of ``generate`` for these settings, in its order
    (``GenerationMixin._get_logits_processor``), from ``transformers``' public classes."""
    wanted = (s.sequence_bias is not None or s.repetition_penalty is not None
              or s.no_repeat_ngram_size > 0 or s.bad_words_ids is not None
              or (s.eos and (s.min_length > 0 or (s.min_new_tokens or 0) > 0))
              or s.forced_bos_token_id is not None or s.forced_eos_token_id is not None
              or s.remove_invalid_values or s.suppress_tokens is not None
              or s.begin_suppress_tokens is not None)
    if not wanted:
        return []
    try:
        from transformers.generation import logits_process as lp
    except ImportError as e:   # pragma: no cover - transformers is there in the test environments
        raise ImportError("decoding.generate: the logits processors (repetition_penalty, "
                          "no_repeat_ngram_size, ...) need transformers installed") from e
    eos = torch.tensor(s.eos, dtype=torch.long, device=device) if s.eos else None
    out: list[lp.LogitsProcessor] = []
    if s.sequence_bias is not None:
        out.append(lp.SequenceBiasLogitsProcessor(sequence_bias=s.sequence_bias))
    if s.repetition_penalty is not None:
        out.append(_repetition_penalty(lp, s.repetition_penalty, attention_mask))
    if s.no_repeat_ngram_size > 0:
        out.append(lp.NoRepeatNGramLogitsProcessor(s.no_repeat_ngram_size))
    if s.bad_words_ids is not None:
        out.append(lp.NoBadWordsLogitsProcessor(s.bad_words_ids, eos))
    if eos is not None and s.min_length > 0:
        out.append(lp.MinLengthLogitsProcessor(s.min_length, eos, device=device))
    if eos is not None and (s.min_new_tokens or 0) > 0:
        out.append(lp.MinNewTokensLengthLogitsProcessor(P, s.min_new_tokens, eos,
                                                        device=device))
    if s.forced_bos_token_id is not None:
        out.append(lp.ForcedBOSTokenLogitsProcessor(s.forced_bos_token_id))
    if s.forced_eos_token_id is not None:
        out.append(lp.ForcedEOSTokenLogitsProcessor(s.max_length, s.forced_eos_token_id,
                                                    device=device))
    if s.remove_invalid_values:
        out.append(lp.InfNanRemoveLogitsProcessor())
    if s.suppress_tokens is not None:
        out.append(lp.SuppressTokensLogitsProcessor(s.suppress_tokens, device=device))
    if s.begin_suppress_tokens is not None:
        begin = P if (P > 1 or s.forced_bos_token_id is None) else P + 1
        out.append(lp.SuppressTokensAtBeginLogitsProcessor(s.begin_suppress_tokens, begin,
                                                           device=device))
    return out


def _repetition_penalty(lp, penalty: float, attention_mask):
    """``generate``'s repetition penalty: transformers >= 5.18 skips the left padding of each
    prompt (its ``prompt_ignore_length`` per sample); older ones penalise it too, as their
    ``generate`` does (their class refuses a tensor there)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        padding = (attention_mask != 0).int().argmax(dim=1)
        try:
            return lp.RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=padding)
        except (TypeError, ValueError):
            pass
    return lp.RepetitionPenaltyLogitsProcessor(penalty)


def _post_warpers(s) -> list:
    """The warpers after top-p that are supported (min-p, epsilon), in ``generate``'s order."""
    if s.min_p is None and s.epsilon_cutoff is None:
        return []
    from transformers.generation import logits_process as lp
    out: list[lp.LogitsProcessor] = []
    if s.min_p is not None:
        out.append(lp.MinPLogitsWarper(min_p=s.min_p))
    if s.epsilon_cutoff is not None:
        out.append(lp.EpsilonLogitsWarper(epsilon=s.epsilon_cutoff))
    return out
