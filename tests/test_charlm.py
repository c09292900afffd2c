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


# -- the Llama-shaped char LM (issue 32: the peer table on a GPT-2- and a Llama-shaped model) ----
TINY = {"width": 16, "layers": 2, "heads": 2, "context": 32}


@pytest.fixture
def llama_dir(tmp_path):
    from paraprop.models.charlm import char_llama, save_charlm

    vocab = CharVocab("abcdef?")
    return save_charlm(char_llama(len(vocab), **TINY), vocab, tmp_path / "lm")


def test_char_llama_has_the_sizes_asked():
    from paraprop.models.charlm import char_gpt2, char_llama

    model = char_llama(11, width=16, layers=3, heads=4, context=40, seed=1)
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and c.model_type == "llama"
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.intermediate_size, c.max_position_embeddings) == \
        (11, 16, 3, 4, 4, 64, 40)
    assert len(model.model.layers) == 3
    assert c.attention_dropout == 0.0 and c.tie_word_embeddings
    assert c.bos_token_id is None and c.eos_token_id is None and c.pad_token_id is None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (64, 16)
    assert torch.equal(char_llama(11, width=16, layers=3, heads=4, context=40,
                                  seed=1).lm_head.weight, model.lm_head.weight)  # seeded
    # comparable sizes: the default shapes of both (vocabulary 103, as the bench's)
    n_llama = sum(p.numel() for p in char_llama(103).parameters())
    n_gpt2 = sum(p.numel() for p in char_gpt2(103).parameters())
    assert 1.0 < n_llama / n_gpt2 < 1.3
    with pytest.raises(ValueError, match="width must be a multiple of heads=4, got width=10"):
        char_llama(10, width=10, heads=4)
    with pytest.raises(ValueError, match="layers must be a positive int, got 0"):
        char_llama(10, layers=0)
    with pytest.raises(ValueError, match="vocab_size must be a positive int, got -1"):
        char_llama(-1)


def test_llama_round_trip_gives_the_same_logits(llama_dir, device):
    from paraprop.models.charlm import char_llama, load_charlm

    model, vocab = load_charlm(llama_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert vocab.chars == "abcdef?"
    fresh = char_llama(len(vocab), **TINY).eval()   # the saved one: the same seed
    ids = torch.tensor([[0, 3, 1, 4, 1, 5, 2, 6, 5, 3]], device=device)
    with torch.no_grad():
        a = fresh.to(device)(ids).logits
        b = model.to(device)(ids).logits
    assert torch.equal(a, b)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _edit(d, **fields):
    import json

    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, **fields)))


@pytest.mark.parametrize("fields,match", [
    ({"model_type": "mistral"}, r"lm/config.json: model_type='mistral', not 'gpt2' or 'llama' "
                                r"\(the model types a char LM can have\)"),
    ({"hidden_size": 32}, r"lm/config.json: hidden_size=32 does not match the weights "
                          r"\(model.embed_tokens.weight in model.safetensors has shape "
                          r"\[7, 16\]\); refused before building the model"),
    ({"vocab_size": 10**12}, r"lm/config.json: vocab_size=1000000000000 does not match the "
                             r"weights \(model.embed_tokens.weight"),
    ({"num_hidden_layers": 3}, r"lm/config.json: num_hidden_layers=3 does not match the weights "
                               r"\(model.safetensors holds 2 layers\)"),
    ({"num_hidden_layers": 1}, r"num_hidden_layers=1 does not match the weights "
                               r"\(model.safetensors holds 2 layers\)"),
    ({"intermediate_size": 10**8}, r"lm/config.json: intermediate_size=100000000 does not match "
                                   r"the weights \(model.layers.0.mlp.gate_proj.weight in "
                                   r"model.safetensors has shape \[64, 16\], the config makes "
                                   r"it \[100000000, 16\]\)"),
    ({"num_key_value_heads": 1}, r"lm/config.json: head_dim=8, num_key_value_heads=1 does not "
                                 r"match the weights \(model.layers.0.self_attn.k_proj.weight "
                                 r"in model.safetensors has shape \[16, 16\], the config makes "
                                 r"it \[8, 16\]\)"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=2 is not a multiple of "
                                 r"num_key_value_heads=3"),
    ({"num_attention_heads": 3}, r"hidden_size=16 is not a multiple of num_attention_heads=3"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings must be a positive int, got 0"),
    ({"num_key_value_heads": None}, r"num_key_value_heads must be a positive int, got None"),
    ({"head_dim": "x"}, r"head_dim must be null or a positive int, got 'x'"),
    ({"hidden_act": "nope"}, r"transformers cannot build a Llama from it "
                             r"\(hidden_act=\"nope\" is not known to it\)"),
])
def test_load_refuses_a_llama_config_that_disagrees(llama_dir, monkeypatch, fields, match):
    import transformers

    from paraprop.models.charlm import load_charlm

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", no_loading)
    _edit(llama_dir, **fields)
    with pytest.raises(ValueError, match=match):
        load_charlm(llama_dir)


def test_load_refuses_llama_weights_that_miss_a_tensor(llama_dir):
    from safetensors.torch import load_file, save_file

    from paraprop.models.charlm import load_charlm

    weights = llama_dir / "model.safetensors"
    good = load_file(weights)
    assert "lm_head.weight" not in good  # tied: saved once
    save_file({k: v for k, v in good.items() if k != "model.layers.1.post_attention_layernorm"
               ".weight"}, weights)
    with pytest.raises(ValueError, match=r"lm/model.safetensors: no tensor "
                                         r"model.layers.1.post_attention_layernorm.weight "
                                         r"\(shape \[16\]\), which a Llama of config.json has"):
        load_charlm(llama_dir)
    save_file(good, weights)
    _edit(llama_dir, attention_bias=True)
    with pytest.raises(ValueError, match=r"no tensor model.layers.0.self_attn.q_proj.bias"):
        load_charlm(llama_dir)
    _edit(llama_dir, attention_bias=False, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"no tensor lm_head.weight \(shape \[7, 16\]\)"):
        load_charlm(llama_dir)
    _edit(llama_dir, tie_word_embeddings=True)
    save_file({**good, "model.layers.0.extra": torch.zeros(2)}, weights)
    with pytest.raises(ValueError, match=r"holds a tensor model.layers.0.extra \(shape \[2\]\) "
                                         r"that a Llama of config.json does not have"):
        load_charlm(llama_dir)


def test_llama_training_caches_and_reloads(tmp_path):
    from paraprop_lab.training.charlm import checkpoint_dir, trained_charlm

    kw = {"width": 16, "layers": 1, "heads": 2, "context": 64}
    model, vocab, info = trained_charlm(tmp_path, arch="llama", steps=30, progress=False, **kw)
    assert info["trained_now"] and model.config.model_type == "llama"
    assert info["checkpoint"] == str(tmp_path / "charlm_llama_s30_c64_h2_l1_w16")
    assert info["loss"][-1] < info["loss"][0]
    again, vocab2, info2 = trained_charlm(tmp_path, arch="llama", steps=30, progress=False, **kw)
    assert not info2["trained_now"] and vocab2.chars == vocab.chars
    ids = vocab.encode("The for statement")[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert checkpoint_dir("results", steps=1500) == checkpoint_dir("results", steps=1500,
                                                                   arch="gpt2")
    assert str(checkpoint_dir("results", steps=1500)) == "results/charlm_s1500"
    assert str(checkpoint_dir("results", steps=1500, arch="llama")) == \
        "results/charlm_llama_s1500"


def test_arch_and_context_are_checked(tmp_path):
    from types import SimpleNamespace

    from paraprop.models.charlm import char_gpt2, char_llama, save_charlm
    from paraprop_lab.training.charlm import checkpoint_dir, context, train_charlm, trained_charlm

    with pytest.raises(ValueError, match=r"arch must be one of 'gpt2', 'llama', got 'rwkv'"):
        trained_charlm(tmp_path, arch="rwkv", steps=1)
    model = char_llama(7, width=8, layers=1, heads=2, context=16)
    assert context(model) == ("max_position_embeddings", 16)
    assert context(char_gpt2(7, width=8, layers=1, heads=2, context=24)) == ("n_positions", 24)
    with pytest.raises(ValueError, match=r"length must be at most the model's context "
                                         r"max_position_embeddings=16, got length=20"):
        train_charlm(model, torch.zeros(100, dtype=torch.long), steps=1, length=20)
    with pytest.raises(ValueError, match=r"model: a char LM of model_type 'gpt2' or 'llama' "
                                         r"expected, got model_type='bert'"):
        context(SimpleNamespace(config=SimpleNamespace(model_type="bert")))
    # a GPT-2 left where the Llama's cache is: refused, not served as the Llama
    path = checkpoint_dir(tmp_path, steps=1, arch="llama", width=8, layers=1, heads=2,
                          context=16)
    save_charlm(char_gpt2(4, width=8, layers=1, heads=2, context=16), CharVocab("abc?"), path)
    with pytest.raises(ValueError, match=r"config.json: model_type='gpt2', but the cache of "
                                         r"arch='llama' was asked for"):
        trained_charlm(tmp_path, arch="llama", steps=1, width=8, layers=1, heads=2, context=16)


def test_cli_job_llama(tmp_path, capsys):
    import json

    from paraprop_lab.cli import main

    out = tmp_path / "lm"
    rc = main(["train", "charlm", "--arch", "llama", "--steps", "2", "--width", "16",
               "--layers", "1", "--heads", "2", "--out", str(out)])
    assert rc == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    printed = capsys.readouterr().out
    assert "trained a Llama-shaped char LM" in printed and "greedy sample" in printed


def test_peer_table_of_the_llama_char_lm():
    """The bench's peer section on a (tiny, untrained) Llama-shaped char LM: every run gives
    generate's tokens, the table is titled with the model and its rows go to its key."""
    from paraprop.models.charlm import char_llama
    from paraprop_lab.experiments import decoding_peers
    from paraprop_lab.experiments.decoding import prompts
    from paraprop_lab.training.charlm import corpus

    vocab, _, held = corpus()
    model = char_llama(len(vocab), width=16, layers=1, heads=2, context=128).eval()
    model.requires_grad_(False)
    sections, payload = decoding_peers.section(
        model, vocab, held, prompts(vocab, held, 4), quick=True, repeats=1,
        model_name="Llama-shaped char LM", key="peers_llama")
    (title, table), = sections
    assert title.startswith("Llama-shaped char LM, greedy, batch 1, 32 new tokens")
    rows = payload["peers_llama"]
    assert [r["method"] for r in rows] == [
        "generate", "prompt lookup k=3, n-gram 2", "paraprop jacobi (window 16)",
        "paraprop accelerate(model), generate's call"]
    assert all(r["same tokens"] for r in rows) and "| generate |" in table
    assert all(1 <= r["model passes"] <= 32 for r in rows)


def test_bench_runs_the_peer_table_for_both_char_lms(tmp_path, monkeypatch):
    """``paraprop bench decoding``'s wiring (its own measurements stubbed out, the char LMs
    tiny and untrained): the peer table of the GPT-2-shaped char LM under its keys as before,
    then the Llama-shaped one's (asked for with ``arch="llama"``, 20 steps in quick mode)."""
    from pathlib import Path

    from paraprop.models.charlm import char_gpt2, char_llama
    from paraprop_lab.bench import decoding as bench
    from paraprop_lab.training.charlm import corpus

    vocab = corpus()[0]
    asked = []

    def tiny(out_dir, *, arch="gpt2", **kw):
        asked.append((arch, kw))
        build = char_llama if arch == "llama" else char_gpt2
        model = build(len(vocab), width=16, layers=1, heads=2, context=128).eval()
        return model, vocab, {"checkpoint": f"{arch}-dir", "trained_now": False}

    monkeypatch.setattr(bench, "trained_charlm", tiny)
    monkeypatch.setattr(bench, "case_rows", lambda *a, **k: [dict.fromkeys(bench.COLUMNS, 0)])
    monkeypatch.setattr(bench, "plot", lambda path, table: Path(path))
    monkeypatch.setattr(bench.decoding_images, "section", lambda *a, **k: ([], {}))
    payload = bench.run(tmp_path, quick=True, repeats=1)
    assert asked == [("gpt2", {"steps": 20}), ("llama", {"steps": 20})]
    assert payload["model"]["checkpoint"] == "gpt2-dir"
    assert payload["model_llama"]["checkpoint"] == "llama-dir"
    for key in ("peers", "peers_llama"):
        assert len(payload[key]) == 4 and all(r["same tokens"] for r in payload[key])
    report = next(tmp_path.glob("*.md")).read_text()
    gpt2 = report.index("GPT-2-shaped char LM, greedy, batch 1, 32 new tokens")
    assert report.index("Llama-shaped char LM, greedy, batch 1, 32 new tokens") > gpt2


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_case_rows_report_the_models_own_time_and_the_ceiling(sample):
    """The bench rows' ``model_ms`` (time inside the model's forward passes) and ``ceiling``
    (the row's sequential loop time over it), on a tiny untrained char LM: every method's
    tokens are its sequential loop's, and the ceiling is that ratio (no wall-clock threshold)."""
    from paraprop.models.charlm import char_gpt2
    from paraprop_lab.experiments.decoding import COLUMNS, SEQUENTIAL, case_rows

    model = char_gpt2(23, width=16, layers=1, heads=2, context=64).eval().requires_grad_(False)
    ids = torch.randint(1, 23, (1, 5), generator=torch.Generator().manual_seed(0))
    rows = case_rows(model, ids, 6, sample=sample, window=4, repeats=1, desc="tiny")
    seq = {r["method"]: r for r in rows if r["method"].startswith(SEQUENTIAL)}
    for r in rows:
        assert set(COLUMNS) <= set(r) and 0 < r["model_ms"] <= 1e3 * r["time_s"]
        if r["method"] != "transformers generate":
            assert r["same_tokens"] is True
        own = seq[SEQUENTIAL + (" (Gumbel-max coupling)" if "Gumbel" in r["method"] else "")]
        assert r["ceiling"] == pytest.approx(own["time_s"] * 1e3 / r["model_ms"])
