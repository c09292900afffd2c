"""Fault tests (review s37) for the per-sample batch advance (``SlidingJacobi(advance=
"per-sample")``, ``generate(..., batch_advance="per-sample")``): at ``tol > 0`` on maps whose
samples converge at different paces and expand differences, a converged value is within
``tol`` of the sequential one; greedy decoding with the processors that read the accepted text
(repetition penalty, no-repeat n-grams, a minimum length), an EOS mid-run, odd windows and
spans, ragged left padding and the n-gram guesses off or longer gives ``model.generate``'s
tokens; a ``span`` below the default window is refused, not ignored."""

from __future__ import annotations

import pytest
import torch

import paraprop
from paraprop.decoding import generate
from paraprop.solvers import SlidingJacobi

transformers = pytest.importorskip("transformers")

from problems import RandomTriangular, Windowed  # noqa: E402
from test_decoding import V, hf, make  # noqa: E402
from test_decoding_batch_advance import Recorded  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("gain", [1.5, 6.0])
@pytest.mark.parametrize("window,span", [(2, None), (5, 7), (9, None)])
def test_per_sample_at_tol_is_within_tol_on_samples_of_different_pace(device, gain, window,
                                                                      span):
    prob = RandomTriangular((4,), (40,), (2,), seed=1, gain=gain, scale=[0.1, 0.5, 2.0, 4.0])
    prob.W, prob.c, prob.scale = (v.to(device) for v in (prob.W, prob.c, prob.scale))
    x0 = prob.x0(1).to(device)
    ref = prob.reference(x0)
    for tol in (1e-6, 1e-3, 1e-1):
        sol = paraprop.solve(Windowed(prob), x0, dim=1, tol=tol, throw=False,
                             method=SlidingJacobi(window, advance="per-sample", span=span))
        assert sol.iterations <= prob.T and sol.stats["advance"] == "per-sample"
        if sol.converged:
            assert float((sol.value - ref).abs().max()) <= tol, (tol, sol.iterations)


def _ragged(B: int, P: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P), generator=g)
    ids[0] = torch.tensor([5, 9, 17] * P)[:P]        # a sample that runs ahead (a motif)
    mask = torch.ones(B, P, dtype=torch.long)
    for b in range(1, B):
        mask[b, : (b * 3) % P] = 0                     # every sample its own padding
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


SETTINGS = [{"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}, {"min_new_tokens": 5}]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("extra", SETTINGS, ids=["repetition", "no-repeat-2", "min-new-5"])
def test_per_sample_with_processors_eos_and_odd_windows_is_generate(device, name, extra):
    model = make(name, device)
    ids, mask = _ragged(4, 7, seed=5, device=device)
    free = hf(model, ids, mask, 18, eos_token_id=None, pad_token_id=0, **extra)
    eos = int(free[2, 7 + 6])                            # sample 2 ends at its 7th new token
    ref = hf(model, ids, mask, 18, eos_token_id=eos, pad_token_id=0, **extra)
    for window, span, ngram in ((1, None, 0), (2, 3, 3), (7, 20, 2)):
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=18,
                            eos_token_id=eos, pad_token_id=0, ngram=ngram, **extra,
                            method=SlidingJacobi(window, advance="per-sample", span=span))
        assert torch.equal(out, ref), (window, span, ngram)
        assert sol.converged and sol.stats["batch_advance"] == "per-sample"
        assert sol.stats["model_calls"] <= 18


def test_a_span_below_the_default_window_is_refused_not_ignored():
    prob = RandomTriangular((4,), (100,), (), seed=0, scale=[0.1, 0.5, 1.0, 3.0])
    fn = Recorded(prob)
    with pytest.raises(ValueError, match=r"SlidingJacobi: span must be at least the window "
                                         r"\(64\), got 3"):
        paraprop.solve(fn, prob.x0(), dim=1, tol=0,
                       method=SlidingJacobi(None, advance="per-sample", span=3))
    assert fn.blocks == []   # (refused before any evaluation)
