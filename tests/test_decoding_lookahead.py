"""The lookahead n-gram pool of greedy Jacobi decoding (``NgramPool(lookahead=True)``): n-grams
of the Jacobi iterates themselves, keyed by the tokens each one was computed from, and guesses
extended by chained lookups. Guesses never change the tokens (greedy: ``generate``'s, also with
a pool fed garbage); sampling keeps the text's n-grams only."""

from __future__ import annotations

import random

import pytest
import torch

from paraprop.decoding import generate
from paraprop.decoding.ngrams import NgramPool

transformers = pytest.importorskip("transformers")

from test_decoding import hf, make, prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_iterates_ngrams_are_keyed_by_what_they_were_computed_from():
    pool = NgramPool([[1, 2, 3]], key=2, length=4, lookahead=True)
    # the pass was fed the text 1 2 3 | 7 8 9 (positions 3-5 undecided) and gave 4 5 6 there:
    # 4 was computed after (2, 3), 5 after (3, 7), 6 after (7, 8)
    pool.add_iterate(0, [1, 2, 3, 7, 8, 9], [4, 5, 6], 3, 6)
    assert pool.ahead == [{(2, 3): 4, (3, 7): 5, (7, 8): 6}]
    pool.add_iterate(0, [1, 2, 3, 7, 8, 9], [0, 0, 0], 3, 6)     # a key keeps its first token
    assert pool.ahead == [{(2, 3): 4, (3, 7): 5, (7, 8): 6}]
    # a guess: the text's continuation first, then one lookup at a time (text, then iterates)
    assert pool.guess(0, [5, 2, 3]) == (4,)            # (2, 3) -> 4 from the iterates, then
    pool.add(0, [1, 2, 3, 4, 3, 7, 1])                 # (3, 4): nothing. The text's n-grams
    assert pool.guess(0, [9, 3, 7]) == (1,)            # win: (3, 7) -> 1, not the iterate's 5
    assert pool.guess(0, [0, 2, 3]) == (4, 3, 7, 1)    # the text's, `length` tokens
    pool.add_iterate(0, [1, 2, 3, 7, 1, 5], [9, 8], 4, 6)      # (3, 7) kept; (7, 1) -> 8
    assert pool.ahead[0][(7, 1)] == 8
    assert pool.guess(0, [0, 4, 3]) == (7, 1, 8)       # text (4, 3) -> 7 1, iterates (7, 1) -> 8
    plain = NgramPool([[1, 2, 3]], key=2, length=4)
    plain.add_iterate(0, [1, 2, 3, 7], [4], 3, 4)          # without lookahead: nothing kept
    assert plain.ahead is None and plain.guess(0, [1, 2]) == (3,)


def test_the_lookahead_pool_is_fed_greedy_only(monkeypatch):
    made: list[NgramPool] = []
    init = NgramPool.__init__

    def spy(self, *args, **kw):
        init(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(NgramPool, "__init__", spy)
    model = make("gpt2", "cpu")
    ids, mask = prompts(3, 6)
    generate(model, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[])
    assert made[-1].ahead is not None and any(len(p) > 0 for p in made[-1].ahead)
    generate(model, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[],
             do_sample=True, generator=torch.Generator().manual_seed(0))
    assert made[-1].ahead is None


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("advance", ["minimum", "per-sample"])
def test_garbage_in_the_lookahead_pool_never_changes_the_tokens(device, name, advance,
                                                              monkeypatch):
    """The pool records a random token for every key it is given: the guesses are wrong, the
    tokens are still generate's (a guess only decides how soon a token is accepted)."""
    rng = random.Random(0)

    def garbage(self, b, fed, gave, lo, hi):
        assert self.ahead is not None
        for i in range(max(lo, self.key), hi):
            self.ahead[b][tuple(fed[i - self.key : i])] = rng.randrange(3, 53)

    monkeypatch.setattr(NgramPool, "add_iterate", garbage)
    model = make(name, device)
    ids, mask = prompts(4, 6, device=device)
    ref = hf(model, ids, mask, 40, eos_token_id=None)
    out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=40, eos_token_id=[],
                        window=8, batch_advance=advance)
    assert torch.equal(out, ref) and sol.converged
