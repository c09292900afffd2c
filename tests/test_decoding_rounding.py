"""The decoding certificate's rounding bound against what it bounds, on the shipped trained char
LM (``charlm_s2000_l2_w64``, float32): the logits of window passes and of one pass over the
whole sequence differ from the sequential loop's one-token passes by less than the bound
``rounding_factor`` gives, with the margin of 4 that its ``k`` was sized with (decoding.md);
and the bound's form (dtype, depth, positions)."""

from __future__ import annotations

import pytest
import torch

from paraprop.decoding import model_checks

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def charlm():
    from paraprop_lab.demos import _weights

    if _weights.path("charlm") is None:
        pytest.skip("the shipped char LM checkpoint is missing (an install without the weights)")
    return _weights.load("charlm")


def test_the_char_lms_rounding_stays_within_a_quarter_of_the_bound(charlm):
    from paraprop_lab.demos import _weights
    from paraprop_lab.experiments.decoding import prompts
    from paraprop_lab.experiments.decoding_rounding import loop, prefill, windows

    model, vocab = charlm
    ids = prompts(vocab, _weights.held_out_text(vocab), 3)
    P, new = ids.shape[1], 64
    worst = 0.0
    with torch.no_grad():
        for i in range(3):
            seq, ref = loop(model, ids[i : i + 1], new, sample=i == 1, seed=i)
            factor, coarse = model_checks.rounding_factor(model, ref.float(), positions=P + new)
            assert coarse == torch.float32
            bound = factor * ref.abs().amax(-1)
            for way in (windows, prefill):
                diff = (way(model, seq, P, new) - ref).abs().amax(-1)
                assert bool((diff > 0).any()), "the passes should round differently"
                worst = max(worst, float((diff / bound).max()))
    assert worst <= 0.25, f"the char LM's rounding reached {worst:.3g} of the bound"


def test_the_bounds_form():
    """``k * eps * sqrt(layers * max(1, positions / 256))``, plus 8 float32 eps for the scores
    of a float64 model; the dtype is the coarsest the model computes in."""
    lin = torch.nn.Linear(3, 3)
    eps32 = torch.finfo(torch.float32).eps
    logits = torch.zeros(1, 3)
    c, d = model_checks.rounding_factor(lin, logits)
    assert d == torch.float32 and c == pytest.approx(model_checks.K_FLOAT32 * eps32)
    c4, _ = model_checks.rounding_factor(lin, logits, positions=4 * model_checks.POSITIONS)
    assert c4 == pytest.approx(2 * c)
    c, _ = model_checks.rounding_factor(lin, logits, positions=model_checks.POSITIONS)
    assert c == pytest.approx(model_checks.K_FLOAT32 * eps32)
    c, d = model_checks.rounding_factor(lin.double(), logits.double())
    assert d == torch.float64
    assert c == pytest.approx(model_checks.K_FLOAT32 * torch.finfo(torch.float64).eps
                              + model_checks.K_SCORES * eps32)
    c, d = model_checks.rounding_factor(lin.bfloat16(), logits.bfloat16())
    assert d == torch.bfloat16
    assert c == pytest.approx(model_checks.K_16BIT * torch.finfo(torch.bfloat16).eps)
    # a float32 model whose logits come out in float16: float16's bound
    c, d = model_checks.rounding_factor(lin.float(), logits.half())
    assert d == torch.float16 and c == pytest.approx(model_checks.K_16BIT * 2.0 ** -10)


def test_the_depth_of_a_model_without_a_configuration_is_counted_from_its_layers():
    """(review s35) a custom module without a config counted as one layer, about sqrt(L) too
    tight a bound for a deep one: its modules that sum products bound the depth now."""
    from paraprop.decoding.model_checks import num_layers, rounding_factor

    class Deep(torch.nn.Module):
        def __init__(self, depth):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(depth))

    shallow, deep = Deep(1), Deep(16)
    assert num_layers(shallow) == 1 and num_layers(deep) == 16
    logits = torch.ones(1, 5)
    assert rounding_factor(deep, logits)[0] == pytest.approx(4 * rounding_factor(shallow,
                                                                                   logits)[0])
    assert num_layers(lambda ids: ids) == 1
