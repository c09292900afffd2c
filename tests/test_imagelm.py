"""The autoregressive image model (``paraprop train imagelm``: a GPT-2-shaped model on the digits'
grey levels) sampled with ``paraprop.decoding.generate``: Jacobi decoding with top-k sampling
gives the sequential loop's image, token for token, with the Gumbel-max coupling and the inverse
CDF, in float64 and float32 (there up to an uncertified position, reported); the shipped model's
samples; the training job's pieces; the image rows of ``paraprop bench decoding``."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")

from paraprop.decoding import generate  # noqa: E402
from paraprop_lab.training import imagelm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LEVELS = 6          # the tiny models' grey levels: a vocabulary of 16 tokens


def tiny(device, dtype, seed=0):
    """An untrained image model: 1 layer, width 16 (its logits are far from flat enough to
    make every decision a near-tie: scaled up so that top-k cuts are clear)."""
    model = imagelm.image_gpt2(LEVELS, width=16, layers=1, heads=2, seed=seed)
    with torch.no_grad():
        model.transformer.wte.weight.mul_(8)
    return model.to(device=device, dtype=dtype).eval()


def _check(out, sol, ref, dtype, P=1):
    """Certified: the sequential image. float32 only: a sample may stop being certified at a
    position (reported, with its margin); before it, the tokens are the sequential ones."""
    where = sol.stats["uncertified"]
    assert sol.converged == (where == [])
    if dtype == torch.float64 or sol.converged:
        assert sol.converged and sol.stats["margin_ratio"] > 1
        assert torch.equal(out, ref)
        return
    assert len(where) <= 2 * out.shape[0], where
    assert re.search(r"decided by a margin of 0\.\d+ times the bound .* in torch\.float32",
                     sol.stats["uncertified_cause"])
    first = {b: min(t for c, t in where if c == b) for b, _ in where}
    for b in range(out.shape[0]):
        t0 = first.get(b, 64)
        assert torch.equal(out[b, P : P + t0], ref[b, P : P + t0]), b


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("coupling", ["gumbel", "inverse_cdf"])
def test_jacobi_gives_the_sequential_image(device, dtype, coupling):
    model = tiny(device, dtype)
    ids = imagelm.class_prompts([3, 0, 7], LEVELS).to(device)
    kw = dict(max_new_tokens=64, do_sample=True, top_k=4, temperature=1.0, coupling=coupling)
    for seed, b, windows in ((0, 3, ((8, 2), (64, 0))), (1, 3, ((16, 2),)),
                             (2, 1, ((16, 0), (64, 2)))):
        ref, rs = generate(model, ids[:b], method="sequential",
                           generator=torch.Generator().manual_seed(seed), **kw)
        assert rs.stats["model_calls"] == 64 and rs.stats["coupling"] == coupling
        assert rs.stats["processors"] == ["top_k"]
        assert ref.shape == (b, 65) and bool((ref[:, 1:] < LEVELS + 10).all())
        for window, ngram in windows:
            out, sol = generate(model, ids[:b], window=window, ngram=ngram, throw=False,
                                generator=torch.Generator().manual_seed(seed), **kw)
            _check(out, sol, ref, dtype)
            assert sol.stats["model_calls"] <= 64


def test_the_shipped_model_samples_digits_exactly_in_fewer_passes():
    from paraprop_lab.demos import _weights

    if _weights.path("imagelm") is None:
        pytest.skip("the shipped image model is not here")
    model = _weights.load("imagelm")
    assert imagelm.levels_of(model) == 16
    labels = [0, 1, 7]
    seq, rs = imagelm.sample_images(model, labels, seed=3, method="sequential")
    for coupling in ("gumbel", "inverse_cdf"):
        ref = seq if coupling == "gumbel" else imagelm.sample_images(
            model, labels, seed=3, method="sequential", coupling=coupling)[0]
        got, sol = imagelm.sample_images(model, labels, seed=3, window=16, coupling=coupling)
        assert sol.converged and torch.equal(got, ref), coupling
        assert sol.stats["model_calls"] < rs.stats["model_calls"] == 64
    # in float64: certified, the sequential images
    m64 = _weights.load("imagelm").double()
    for coupling in ("gumbel", "inverse_cdf"):
        ref = imagelm.sample_images(m64, labels, seed=4, method="sequential",
                                    coupling=coupling)[0]
        got, sol = imagelm.sample_images(m64, labels, seed=4, window=64, ngram=0,
                                         coupling=coupling)
        assert sol.converged and sol.stats["margin_ratio"] > 1 and torch.equal(got, ref)
    # they look like digits: mostly dark background with some bright strokes, as the data
    data = imagelm.sequences(16)[1][:, 1:]
    assert 0.3 < float((seq == 0).float().mean()) < 0.75
    assert abs(float(seq.float().mean()) - float(data.float().mean())) < 2.5


def test_quantize_and_sequences():
    images = torch.arange(17).float().div(16).repeat(4)[:64].reshape(1, 8, 8)
    q = imagelm.quantize(images, 16)
    assert q.shape == (1, 64) and q.min() == 0 and q.max() == 15
    assert torch.equal(imagelm.quantize(images, 17)[0, :17], torch.arange(17))
    assert bool((q[0, 1:17] >= q[0, :16]).all())                 # monotone
    img = imagelm.dequantize(q, 16)
    assert img.shape == (1, 1, 8, 8) and img.min() == -1 and img.max() == 1
    train, held = imagelm.sequences(8)
    assert train.shape == (1797 - imagelm.HELD_OUT, 65) and held.shape == (imagelm.HELD_OUT, 65)
    assert bool((train[:, 0] >= 8).all()) and bool((train[:, 1:] < 8).all())
    with pytest.raises(ValueError, match="levels must be an int >= 2"):
        imagelm.quantize(images, 1)
    with pytest.raises(ValueError, match=r"labels must be a list of digits 0..9, got \[3, 10\]"):
        imagelm.class_prompts([3, 10], 16)


def test_training_lowers_the_loss_and_the_model_round_trips(tmp_path):
    train, held = imagelm.sequences(4)
    model = imagelm.image_gpt2(4, width=16, layers=1, heads=2)
    with torch.no_grad():
        before = float(imagelm.pixel_loss(model, held))
    hist = imagelm.train_imagelm(model, train[:256], epochs=2, batch_size=64, lr=1e-2,
                                 progress=False)
    assert not model.training and len(hist) == 2
    with torch.no_grad():
        assert float(imagelm.pixel_loss(model, held)) < before
    path = imagelm.save_imagelm(model, tmp_path / "m")
    again = imagelm.load_imagelm(path)
    ids = train[:2]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="seq must be int64 of shape .N, 65., got torch.int64 "
                                         r"\(3, 10\)"):
        imagelm.train_imagelm(model, train[:3, :10], epochs=1)
    with pytest.raises(ValueError, match="width must be a multiple of heads=3, got width=16"):
        imagelm.image_gpt2(4, width=16, heads=3)
    meta = json.loads((path / imagelm.META).read_text())
    (path / imagelm.META).write_text(json.dumps({**meta, "levels": 5}))
    with pytest.raises(ValueError, match="levels=5, but config.json has 4 grey levels"):
        imagelm.load_imagelm(path)
    (path / imagelm.META).unlink()
    with pytest.raises(FileNotFoundError, match="not a saved image model .no imagelm.json"):
        imagelm.load_imagelm(path)


def test_a_weights_file_of_another_config_is_refused(tmp_path):
    a = imagelm.save_imagelm(imagelm.image_gpt2(4, width=16, layers=1, heads=2), tmp_path / "a")
    b = imagelm.save_imagelm(imagelm.image_gpt2(4, width=32, layers=1, heads=2), tmp_path / "b")
    (a / imagelm.WEIGHTS_FILE).write_bytes((b / imagelm.WEIGHTS_FILE).read_bytes())
    with pytest.raises(ValueError, match="model.safetensors: does not match config.json"):
        imagelm.load_imagelm(a)


def test_the_job_trains_saves_and_draws(tmp_path, capsys):
    import argparse

    p = argparse.ArgumentParser()
    imagelm.add_arguments(p)
    args = p.parse_args(["--epochs", "1", "--width", "16", "--layers", "1", "--levels", "4",
                         "--out", str(tmp_path / "m"), "--png", str(tmp_path / "s.png")])
    assert imagelm.run(args) == 0
    assert (tmp_path / "s.png").stat().st_size > 0
    assert imagelm.levels_of(imagelm.load_imagelm(tmp_path / "m")) == 4
    out = capsys.readouterr().out
    assert "trained an image model (4 grey levels) on the digits: NLL" in out
    assert imagelm.checkpoint_name(epochs=60) == "imagelm_l16_e60"
    assert imagelm.checkpoint_name(epochs=3, width=32, levels=8) == "imagelm_l8_e3_w32"


def test_the_bench_image_section_quick(tmp_path):
    from paraprop_lab.experiments import decoding_images as di

    sections, payload = di.section(tmp_path, quick=True, repeats=1)
    rows = payload["images"]
    assert [(r["coupling"], r["method"]) for r in rows] == [
        ("gumbel", "sequential"), ("gumbel", "jacobi (window 16, 2-gram guesses)"),
        ("inverse_cdf", "sequential"), ("inverse_cdf", "jacobi (window 16, 2-gram guesses)")]
    assert all(r["same_image"] is True for r in rows)
    assert rows[0]["model_calls"] == 128 and rows[0]["tokens_per_call"] == 1.0
    assert all(r["model_calls"] < 128 for r in rows[1::2])
    assert (tmp_path / payload["images_png"]).stat().st_size > 0 and payload["images_png_same"]
    assert "Target: at least 2.5x fewer model passes" in sections[0][1]
    assert set(payload["images_target"]["rows"]) == {
        "gumbel, batch 1, jacobi (window 16, 2-gram guesses)",
        "inverse_cdf, batch 1, jacobi (window 16, 2-gram guesses)"}


def test_the_target_reads_passes_time_and_the_image():
    from paraprop_lab.experiments.decoding_images import target

    def row(method, calls, speed, same=True):
        return {"coupling": "gumbel", "batch": 1, "method": method, "fewer_calls": calls,
                "vs_sequential": speed, "same_image": same}

    rows = [row("sequential", 1.0, 1.0), row("a", 2.6, 1.6), row("b", 2.4, 2.0),
            row("c", 3.0, 1.4), row("d", 3.0, 2.0, same=False)]
    got = target(rows)
    assert got["met"] and got["rows"] == {"gumbel, batch 1, a": True, "gumbel, batch 1, b": False,
                                          "gumbel, batch 1, c": False,
                                          "gumbel, batch 1, d": False}
    assert not target(rows[2:])["met"]


def test_a_model_in_train_mode_is_refused():
    """The shipped config trains with dropout 0.1: sampling it in train mode has no sequential
    result, and generate says so before any model call."""
    import paraprop

    model = imagelm.image_gpt2(LEVELS, width=16, layers=1, heads=2, dropout=0.1).train()
    with pytest.raises(paraprop.StochasticModelError, match=r"model\.eval\(\)"):
        imagelm.sample_images(model, [1])
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        imagelm.image_gpt2(LEVELS, dropout=1.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_llama_shaped_image_model_too(device, dtype):
    """The same sequences on a Llama-shaped model (rotary positions, RMSNorm, SwiGLU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=LEVELS + 10, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=65, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8)
    model = model.to(device=device, dtype=dtype).eval()
    ids = imagelm.class_prompts([5, 9], LEVELS).to(device)
    kw = dict(max_new_tokens=64, do_sample=True, top_k=4, coupling="gumbel")
    ref, _ = generate(model, ids, method="sequential",
                      generator=torch.Generator().manual_seed(0), **kw)
    for window in (16, 64):
        out, sol = generate(model, ids, window=window, ngram=0, throw=False,
                            generator=torch.Generator().manual_seed(0), **kw)
        _check(out, sol, ref, dtype)
        assert sol.stats["model_calls"] <= 64


def test_the_job_checks_its_outputs_before_training(tmp_path, capsys, monkeypatch):
    from paraprop_lab.cli import main

    def trained(*a, **k):
        pytest.fail("trained before the outputs were checked")

    monkeypatch.setattr(imagelm, "train_imagelm", trained)
    assert main(["train", "imagelm", "--out", str(tmp_path / "m"), "--png", str(tmp_path)]) == 2
    assert re.search(r"--png .*: is a directory; expected the path of a file to write, e.g. "
                     r".*imagelm.png$", capsys.readouterr().err.strip())
    (tmp_path / "f").write_text("x")
    assert main(["train", "imagelm", "--out", str(tmp_path / "f")]) == 2
    assert re.search(r"--out .*f: is a file, not a directory; expected the directory to save "
                     r"the model in$", capsys.readouterr().err.strip())


def test_the_bench_trains_its_own_model_where_none_is_shipped(tmp_path, monkeypatch):
    from paraprop_lab.demos import _weights
    from paraprop_lab.experiments import decoding_images as di

    monkeypatch.setattr(_weights, "WEIGHTS", tmp_path / "none")
    model, what = di.image_model(tmp_path, quick=True)
    assert what == f"the suite's model {tmp_path / 'imagelm_l16_e1_n256'} (no shipped one)"
    assert not model.training and imagelm.levels_of(model) == 16
    again, _ = di.image_model(tmp_path, quick=True)          # loaded, not trained again
    ids = imagelm.class_prompts([2], 16)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
