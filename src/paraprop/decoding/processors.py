"""The sampling rule of ``transformers``' ``generate``, written as a deterministic function of
noise drawn up front.

``generate`` takes the last position's logits in float32, applies its logits warpers in the
order temperature, top-k, top-p (``GenerationMixin._get_logits_processor``), and draws with
``torch.multinomial``. Here the same warpers are applied (same operations, so the same scores,
which the tests check against ``transformers`` itself), and the draw is the inverse CDF of the
resulting distribution at one uniform variate per position: the token is a function of the
prefix and that variate, so the whole sample is a triangular system in the tokens.
"""

from __future__ import annotations

import torch

from paraprop import checks


def check_sampling(temperature, top_k, top_p) -> None:
    """Raise ``ValueError`` naming the argument on a bad temperature, top-k or top-p."""
    checks.positive_number("temperature", temperature, finite=True)
    checks.positive_int("top_k", top_k, allow_none=True)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")


def process_logits(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """The scores ``generate(do_sample=True)`` samples from: float32 logits divided by
    ``temperature``, then all but the ``top_k`` largest set to ``-inf``, then the smallest ones
    whose total probability stays within ``1 - top_p`` set to ``-inf`` (the largest always
    kept). ``logits`` is ``(..., V)``; the result has its shape, in float32."""
    scores = logits.to(torch.float32)
    if temperature != 1.0:
        scores = scores / temperature
    shape = scores.shape
    scores = scores.reshape(-1, shape[-1])
    if top_k is not None and top_k < shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1)                 # ascending
        mass = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = mass <= 1 - top_p
        drop[:, -1] = False                                         # keep the most likely one
        scores = scores.masked_fill(drop.scatter(1, order, drop), -torch.inf)
    return scores.reshape(shape)


def choose(scores: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """Tokens from scores ``(..., V)``: the argmax (greedy, ``u=None``), or the inverse CDF of
    ``softmax(scores)`` at the uniform variates ``u`` ``(...)`` in ``[0, 1)`` (the first token
    whose cumulative probability exceeds ``u`` times the total). Returns int64 ``(...)``."""
    if u is None:
        return scores.argmax(dim=-1)
    cdf = scores.softmax(dim=-1).to(torch.float64).cumsum(dim=-1)
    level = u.to(torch.float64)[..., None] * cdf[..., -1:]
    tok = (cdf <= level).sum(dim=-1)
    return tok.clamp(max=scores.shape[-1] - 1)
