"""A text corpus that ships with Python itself: the documentation topics of ``pydoc_data``
(about 460,000 characters of the language reference), and a character vocabulary for it."""

from __future__ import annotations

import torch


def load_text() -> str:
    """The ``pydoc_data.topics`` pages joined in sorted topic order (nothing is downloaded).

    Example:
        >>> text = load_text()
        >>> len(text) > 100_000, "lambda" in text
        (True, True)
    """
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


class CharVocab:
    """Characters <-> token ids; unknown characters encode as ``fallback``.

    Arguments:
        chars: the characters, in id order.
        fallback: the character unknown ones map to (must be in ``chars``).

    Example:
        >>> vocab = CharVocab.of("hello world")
        >>> len(vocab), vocab.encode("hold!")
        (9, tensor([4, 6, 5, 2, 1]))
        >>> vocab.decode(vocab.encode("hold!"))          # "!" is not in the text
        'hold?'
    """

    def __init__(self, chars: str, fallback: str = "?"):
        if len(set(chars)) != len(chars):
            raise ValueError("chars must not repeat a character")
        if fallback not in chars:
            raise ValueError(f"fallback {fallback!r} must be one of chars")
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}
        self.fallback = self.index[fallback]

    @classmethod
    def of(cls, text: str) -> CharVocab:
        """The sorted characters of ``text`` (with ``"?"``)."""
        return cls("".join(sorted(set(text) | {"?"})))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """int64 ids of ``text``."""
        return torch.tensor([self.index.get(c, self.fallback) for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        """The text of a sequence of ids."""
        return "".join(self.chars[int(i)] for i in ids)
