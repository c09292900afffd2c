"""Guesses for the undecided tokens: continuations of n-grams seen before (the Lookahead idea,
Fu et al. 2024). Any guess keeps Jacobi decoding exact, since a token is accepted only when the
model, fed the accepted prefix, produces it; a good guess only makes acceptance come sooner.

Two sources: the sample's text (prompt and accepted tokens), and, with ``lookahead``, the Jacobi
iterates themselves: after each pass, the token the model gave at a position after the accepted
prefix, keyed by the ``key`` tokens before that position in the previous iterate (the ones it
was computed from), as Lookahead decoding's n-grams along the iteration's trajectory. A guess
is the text's continuation, extended one lookup at a time (the text's n-grams first, then the
iterates') up to ``length`` tokens."""

from __future__ import annotations


class NgramPool:
    """For each sample, the latest continuation of up to ``length`` tokens after every
    ``key``-token n-gram of its text (prompt and accepted tokens).

    Arguments:
        texts: one list of token ids per sample (its prompt without padding), kept as
            ``prompts``.
        key: tokens in a key.
        length: tokens in a continuation.
        lookahead: also record the n-grams of the Jacobi iterates (:meth:`add_iterate`) and
            extend guesses by chained lookups.
    """

    def __init__(self, texts: list[list[int]], key: int, length: int, lookahead: bool = False):
        self.key, self.length = key, length
        self.prompts = texts
        self.pools: list[dict] = [{} for _ in texts]
        # the iterates' n-grams: key -> the one token the model gave after it (first seen)
        self.ahead: list[dict] | None = [{} for _ in texts] if lookahead else None
        self.seen = [0] * len(texts)       # text positions whose n-grams are complete
        for b, text in enumerate(texts):
            self.add(b, text)

    def add(self, b: int, text: list[int]) -> None:
        """Record the n-grams of ``text`` (the sample's whole text so far) that the last call
        had not seen complete."""
        k, g, pool = self.key, self.length, self.pools[b]
        n = len(text)
        for i in range(max(0, self.seen[b] - k - g), n - k):
            cont = tuple(text[i + k : i + k + g])
            key = tuple(text[i : i + k])
            if len(cont) == g or key not in pool:
                pool[key] = cont
        self.seen[b] = n

    def add_iterate(self, b: int, fed: list[int], gave: list[int], lo: int, hi: int) -> None:
        """Record the iterate's n-grams after a pass: ``fed``, the sample's text as the pass
        was fed it (prompt, then the iterate); ``gave``, the tokens the pass gave at text
        positions ``[lo, hi)``, each computed from the tokens before it in ``fed``. A key keeps
        its first token."""
        if self.ahead is None:
            return
        k, pool = self.key, self.ahead[b]
        for i in range(max(lo, k), hi):
            key = tuple(fed[i - k : i])
            if key not in pool:
                pool[key] = gave[i - lo]

    def guess(self, b: int, text: list[int]) -> tuple[int, ...]:
        """The continuation recorded for the last ``key`` tokens of ``text`` (empty if none);
        with ``lookahead``, extended by chained lookups up to ``length`` tokens."""
        k = self.key
        if len(text) < k:
            return ()
        pool = self.pools[b]
        got = pool.get(tuple(text[-k:]), ())
        ahead = self.ahead[b] if self.ahead is not None else None
        if ahead is None:
            return got
        out = list(got)
        while len(out) < self.length:
            key = tuple((text[-k:] + out)[-k:])
            nxt = pool.get(key, ())
            if nxt:
                out += nxt
            elif key in ahead:
                out.append(ahead[key])
            else:
                break
        return tuple(out[: self.length])
