"""Guesses for the undecided tokens: continuations of n-grams seen before (the Lookahead idea,
Fu et al. 2024). Any guess keeps Jacobi decoding exact, since a token is accepted only when the
model, fed the accepted prefix, produces it; a good guess only makes acceptance come sooner."""

from __future__ import annotations


class NgramPool:
    """For each sample, the latest continuation of up to ``length`` tokens after every
    ``key``-token n-gram of its text (prompt and accepted tokens).

    Arguments:
        texts: one list of token ids per sample (its prompt without padding), kept as
            ``prompts``.
        key: tokens in a key.
        length: tokens in a continuation.
    """

    def __init__(self, texts: list[list[int]], key: int, length: int):
        self.key, self.length = key, length
        self.prompts = texts
        self.pools: list[dict] = [{} for _ in texts]
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

    def guess(self, b: int, text: list[int]) -> tuple[int, ...]:
        """The continuation recorded for the last ``key`` tokens of ``text`` (empty if none)."""
        if len(text) < self.key:
            return ()
        return self.pools[b].get(tuple(text[-self.key :]), ())
