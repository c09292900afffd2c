"""The text corpus, its vocabulary, and the char-LM training job (tiny settings)."""

from __future__ import annotations

import pytest
import torch

from paraprop.data import CharVocab, load_text

pytest.importorskip("transformers")


# tiny transformers: one intra-op thread is as fast, and immune to a busy machine
pytestmark = pytest.mark.usefixtures("one_thread")


def test_text_ships_with_python_and_round_trips():
    text = load_text()
    assert len(text) > 100_000 and "for" in text
    vocab = CharVocab.of(text)
    sample = text[:500]
    assert vocab.decode(vocab.encode(sample)) == sample
    assert vocab.decode(vocab.encode("\u2603")) == "?"      # unknown -> fallback


def test_vocab_errors():
    with pytest.raises(ValueError, match="must not repeat"):
        CharVocab("aab")
    with pytest.raises(ValueError, match="fallback"):
        CharVocab("abc")


def test_training_lowers_the_loss_and_reloads(tmp_path):
    from paraprop_lab.training.charlm import corpus, trained_charlm, validation_loss

    kw = {"width": 16, "layers": 1, "heads": 2, "context": 64}
    model, vocab, info = trained_charlm(tmp_path, steps=30, progress=False, **kw)
    assert info["trained_now"] and info["loss"][-1] < info["loss"][0]
    again, vocab2, info2 = trained_charlm(tmp_path, steps=30, progress=False, **kw)
    assert not info2["trained_now"] and vocab2.chars == vocab.chars
    _, _, held = corpus(vocab)
    assert validation_loss(again, held[:2000], length=32) == pytest.approx(
        validation_loss(model, held[:2000], length=32), rel=1e-5)
    ids = vocab.encode("The for statement")[None]
    a = model.generate(ids, max_new_tokens=10, do_sample=False)
    b = again.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b)


def test_cli_job(tmp_path, capsys):
    from paraprop_lab.cli import main

    out = tmp_path / "lm"
    rc = main(["train", "charlm", "--steps", "3", "--width", "16", "--layers", "1",
               "--heads", "2", "--out", str(out)])
    assert rc == 0 and (out / "vocab.json").is_file()
    assert "greedy sample" in capsys.readouterr().out


def test_load_errors(tmp_path):
    from paraprop.models.charlm import char_gpt2, load_charlm

    with pytest.raises(FileNotFoundError, match="not a saved char LM"):
        load_charlm(tmp_path)
    with pytest.raises(ValueError, match="width must be a multiple of heads"):
        char_gpt2(10, width=10, heads=4)
