"""The Gumbel-max coupling of sampled decoding (``generate(..., coupling="gumbel")``).

A token is ``argmax_v(scores_v + g_{b,t,v})``, where ``scores`` are the processed scores
``generate`` samples from (temperature, top-k, top-p, ... applied; ``-inf`` entries never win)
and ``g`` is standard Gumbel noise ``-log(-log(u))``. The argmax of scores plus independent
Gumbel noise is distributed as ``softmax(scores)`` (the Gumbel-max trick), so the tokens have
``generate``'s distribution. Unlike the inverse-CDF draw, a token stays the same when a small
change of the prefix moves the scores a little: the noise, not the order of the vocabulary,
decides it, so Jacobi guesses made from a slightly wrong prefix are right more often.

The uniforms ``u`` come from a counter-based generator: SplitMix64 (Steele, Lea and Flood
2014) on int64 tensors, keyed by ``(key, sample, position, vocabulary entry)``. A position's
noise is computed when a pass needs it, on the scores' device, from its indices alone: nothing
of size ``T x V`` is stored, and it does not depend on the prefix, the window, the batch size
or the order in which the positions are computed. The integer arithmetic wraps modulo
``2**64`` (two's complement, as ``torch`` int64 arithmetic does on every device), so the
uniforms are the same bits on every device; the logarithms of the last step may round
differently on another device's math library (in the last bit of float64).
"""

from __future__ import annotations

import numpy as np
import torch


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN = _signed(0x9E3779B97F4A7C15)     # SplitMix64's increment (2**64 / the golden ratio)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """The logical right shift of int64 ``x`` by ``k`` (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (bijective; wraps modulo ``2**64``)."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniforms(bits: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in the open interval ``(0, 1)`` from int64 hashes: the top 52 bits
    plus one half, times ``2**-52`` (exact: at most 53 significant bits)."""
    return (_shr(bits, 12).to(torch.float64) + 0.5) * 2.0 ** -52


class GumbelNoise:
    """The Gumbel noise of one call: ``g[b, t, v]`` for sample ``b`` (its row in the batch),
    new position ``t`` and vocabulary entry ``v``, computed on demand (:meth:`window`).

    The hash chain: ``row = mix64(key + (b + 1) * GOLDEN)``, ``pos = mix64(row + (t + 1) *
    GOLDEN)``, then the SplitMix64 stream seeded by ``pos``: ``u[v] = uniform(mix64(pos +
    (v + 1) * GOLDEN))``.

    The noise of a block of positions from the first one asked for is kept (:data:`BLOCK`
    values at most; a pure function of the indices, so keeping it changes nothing): the
    sequential loop and the sliding window then hash once per block instead of once per pass.

    Arguments:
        key: the int64 key (:func:`draw_key` draws one from a generator).
        batch: the number of samples.
        device: where the noise is computed (the model's device: no transfer).
    """

    BLOCK = 1 << 16      # noise values kept (float64): a block of positions when they fit

    def __init__(self, key: int, batch: int, device):
        self.key, self.device = key, torch.device(device)
        rows = torch.arange(1, batch + 1, dtype=torch.int64, device=self.device)
        self.rows = mix64(rows * GOLDEN + key)
        self._vocab: torch.Tensor | None = None
        self._kept: tuple[int, torch.Tensor] | None = None     # (first position, noise)

    def window(self, start: int, stop: int, vocab: int) -> torch.Tensor:
        """The noise ``(B, stop - start, vocab)`` float64 of the new positions
        ``start .. stop - 1``."""
        kept = self._kept
        if kept is not None and kept[1].shape[-1] == vocab and kept[0] <= start and \
                stop <= kept[0] + kept[1].shape[1]:
            return kept[1][:, start - kept[0] : stop - kept[0]]
        block = max(stop - start, self.BLOCK // max(1, self.rows.shape[0] * vocab))
        noise = self.compute(start, start + block, vocab)
        self._kept = (start, noise)
        return noise[:, : stop - start]

    def compute(self, start: int, stop: int, vocab: int) -> torch.Tensor:
        """The noise of the positions ``start .. stop - 1``, hashed now (see the class doc)."""
        if self._vocab is None or self._vocab.shape[0] != vocab:
            self._vocab = torch.arange(1, vocab + 1, dtype=torch.int64,
                                       device=self.device) * GOLDEN
        t = torch.arange(start + 1, stop + 1, dtype=torch.int64, device=self.device)
        pos = mix64(self.rows[:, None] + t * GOLDEN)
        u = uniforms(mix64(pos[..., None] + self._vocab))
        return -torch.log(-torch.log(u))


def draw_key(generator: torch.Generator | None) -> int:
    """One int64 key from ``generator`` (on its device; the default CPU generator without one),
    so that a seeded generator gives the same noise on every device."""
    where = generator.device if generator is not None else torch.device("cpu")
    return int(torch.randint(-(2 ** 63), 2 ** 63 - 1, (1,), generator=generator,
                             dtype=torch.int64, device=where))


def perturbed_top(scores: torch.Tensor, noise: torch.Tensor, *,
                  margins: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Gumbel-max decision: the tokens ``(B, n)`` (the argmax of the float32 ``scores`` plus
    the float64 ``noise``, added in float64) and, with ``margins``, the best two perturbed
    scores ``(B, n, 2)`` float64 (the second ``-inf`` with one vocabulary entry)."""
    perturbed = scores.to(torch.float64) + noise
    tok = perturbed.argmax(dim=-1)
    if not margins:
        return tok, None
    if perturbed.shape[-1] > 1:
        return tok, perturbed.topk(2, dim=-1).values
    return tok, torch.cat([perturbed, torch.full_like(perturbed, -torch.inf)], -1)


def gap_ratio(top: np.ndarray, delta2: np.ndarray) -> np.ndarray:
    """The margin ratio of a Gumbel-max decision, on the host: the gap between the best and the
    second-best perturbed score, less the float64 rounding of the two additions, against
    ``delta2`` (twice the bound on a processed score's rounding difference: the noise is the same
    bits in both computations). ``inf`` where only one entry is finite; 0 where the gap is within
    the additions' rounding (an exact tie included); ``nan`` (made 0 by the caller) where that
    gap and ``delta2`` are both 0."""
    hi, lo = top[..., 0], top[..., 1]
    with np.errstate(all="ignore"):
        gap = (hi - lo) - 2.0 ** -51 * (np.abs(hi) + np.abs(lo))
        gap = np.where(lo == -np.inf, np.inf, np.maximum(gap, 0.0))
        return gap / delta2.astype(np.float64)
