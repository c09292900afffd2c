"""The decoding bench's peer rows (transformers' prompt lookup against paraprop): every run's
tokens are generate's, the passes are counted, the ratios are taken from one table."""

from __future__ import annotations

import pytest
import torch

from paraprop_lab.experiments import decoding_peers

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_prompt_rows_compare_equal_tokens_and_count_passes():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=30, n_positions=64, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(3, 30, (1, 12), generator=torch.Generator().manual_seed(1))
    rows = decoding_peers.prompt_rows(model, ids, 10, label="p", repeats=1, lookups=(3,),
                                      ngrams=(2,))
    names = [r["method"] for r in rows]
    assert names == ["generate", "prompt lookup k=3, n-gram 2", "paraprop jacobi (window 16)",
                     "paraprop accelerate(model), generate's call"]
    assert all(r["same tokens"] for r in rows)
    assert rows[0]["model passes"] == 10 and rows[0]["x generate"] == 1.0
    assert rows[1]["x best lookup"] == 1.0
    assert all(1 <= r["model passes"] <= 10 for r in rows[2:])
