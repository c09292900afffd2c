"""Faults of what is read from disk (issue 27): files that are not checkpoints, checkpoints of
another model, pickled objects, configs that ask for absurd allocations, and command lines
whose ``--out`` cannot be written. Each becomes one clear error that names the file (or the
option) and what was expected, raised before any work: through the CLI in process where the CLI
reads the file, else through the loader."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from paraprop.models import MADE, MLPDenoiser, PixelCNN, TarFlow
from paraprop.models.checkpoint import build_within_budget, read_torch_file
from paraprop_lab.cli import main
from paraprop_lab.training.networks import make_network, save_checkpoint


def one_error(capsys, match: str) -> str:
    """The CLI's one line ``paraprop: error: ...`` on stderr, matching ``match``."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paraprop: error: "), err
    assert "Traceback" not in err
    assert re.search(match, lines[0]), lines[0]
    return lines[0]


class Planted:
    """A pickled object whose unpickling would create ``marker`` (it calls os.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# -- --weights: files that are not checkpoints of the network -----------------------------------
WEIGHTS = ["train", "densenet", "--arch", "mlp", "--data", "digits", "--size", "8", "--steps", "0",
           "--eval-batch", "0"]
EXPECTED = r"a mlp checkpoint \(this job's format or a plain state_dict of tensors"


@pytest.fixture
def mlp_checkpoint(tmp_path) -> Path:
    """A real checkpoint of this job for ``--arch mlp --size 8``."""
    return save_checkpoint(tmp_path / "mlp.pt", make_network("mlp", size=8), "mlp", {})


def _text(p: Path) -> None:
    p.write_text("these are my notes, not weights\n")


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _binary(p: Path) -> None:
    p.write_bytes(bytes(range(7, 200)))


def _npy(p: Path) -> None:
    import numpy as np

    with open(p, "wb") as f:
        np.save(f, np.zeros(3))


def _tensor(p: Path) -> None:
    torch.save(torch.zeros(3), p)


def _strings(p: Path) -> None:
    torch.save({"0.weight": "not a tensor"}, p)


def _made(p: Path) -> None:
    MADE(4, (8,)).save(p)


def _other_arch(p: Path) -> None:
    save_checkpoint(p, make_network("mlp", size=8, depth=2, width=8), "resnet18", {})


def _truncated(p: Path, source: Path) -> None:
    raw = source.read_bytes()
    p.write_bytes(raw[: len(raw) // 2])


def _cut_tail(p: Path, source: Path) -> None:
    p.write_bytes(source.read_bytes()[:-100])


BAD_WEIGHTS = {
    "text": (_text, rf"w: cannot be read as {EXPECTED}.*: it is a text file \(it starts with "
                    r"'these are my notes, not weights'\) \(32 bytes\)$"),
    "empty": (_empty, rf"w: cannot be read as {EXPECTED}.*: it is empty \(0 bytes\)$"),
    "binary": (_binary, r"w: cannot be read as .*: it is not a torch file \(it starts with the "
                        r"bytes 07 08 09 0a 0b 0c 0d 0e\) \(193 bytes\)$"),
    "npy": (_npy, r"w: cannot be read as .*: it is a NumPy .npy file"),
    "tensor": (_tensor, r"w: not a checkpoint \(expected a state_dict or a dict with one: names "
                        r"to tensors; it holds a Tensor\)"),
    "strings": (_strings, r"w: not a checkpoint \(.*it holds a dict that is empty or holds "
                          r"other values\)"),
    "made": (_made, rf"w: holds a paraprop MADE checkpoint, not {EXPECTED}"),
    "other-arch": (_other_arch, r"w: holds a 'resnet18' network's checkpoint, not a mlp "
                                r"checkpoint .* \(pass --arch resnet18\)"),
}


@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
def test_weights_that_are_not_checkpoints(tmp_path, capsys, monkeypatch, case):
    make, match = BAD_WEIGHTS[case]
    path = tmp_path / "w"
    make(path)
    monkeypatch.setattr("paraprop_lab.training.networks.image_data",
                        lambda *a, **k: pytest.fail("the job went on to load data"))
    assert main([*WEIGHTS, "--weights", str(path), "--out", str(tmp_path / "o.pt")]) == 2
    one_error(capsys, re.escape(str(tmp_path)) + "/" + match)
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("cut", [_truncated, _cut_tail])
def test_truncated_weights(tmp_path, capsys, mlp_checkpoint, cut):
    path = tmp_path / "cut.pt"
    cut(path, mlp_checkpoint)
    assert main([*WEIGHTS, "--weights", str(path)]) == 2
    one_error(capsys, rf"cut.pt: cannot be read as {EXPECTED}.*: it is a truncated or damaged "
                      r"torch file \(a zip archive without its central directory\) \(\d+ bytes\)")


def test_legacy_format_truncated(tmp_path, capsys):
    state = make_network("mlp", size=8).state_dict()
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    raw = (tmp_path / "old.pt").read_bytes()
    (tmp_path / "old.pt").write_bytes(raw[: len(raw) // 3])
    assert main([*WEIGHTS, "--weights", str(tmp_path / "old.pt")]) == 2
    one_error(capsys, r"old.pt: cannot be read as .*: it is a damaged or truncated pickle "
                      r"\(torch's legacy format\) \(\d+ bytes; torch.load: ")


def test_weights_with_pickled_code_are_refused_without_running_it(tmp_path, capsys):
    marker = tmp_path / "ran"
    torch.save({"state_dict": {"0.weight": torch.zeros(2, 2)}, "info": Planted(marker)},
               tmp_path / "evil.pt")
    assert main([*WEIGHTS, "--weights", str(tmp_path / "evil.pt")]) == 2
    one_error(capsys, r"evil.pt: cannot be read as .*: it holds pickled Python objects "
                      r"\((posix|os)\.system\), which torch.load\(weights_only=True\) refuses "
                      r"because loading them runs code from the file")
    assert not marker.exists()


def test_weights_missing_a_directory_or_a_fifo(tmp_path, capsys):
    assert main([*WEIGHTS, "--weights", str(tmp_path / "nope.pt")]) == 2
    one_error(capsys, rf"nope.pt: no such file \(expected {EXPECTED}")
    assert main([*WEIGHTS, "--weights", str(tmp_path)]) == 2
    one_error(capsys, rf"{re.escape(str(tmp_path))}: is a directory, not {EXPECTED}")
    os.mkfifo(tmp_path / "pipe")  # torch.load would block on it
    assert main([*WEIGHTS, "--weights", str(tmp_path / "pipe")]) == 2
    one_error(capsys, r"pipe: cannot be read as .*: it is not a regular file \(a FIFO, socket "
                      r"or device\)")


def test_weights_of_another_mlp_do_not_fit(tmp_path, capsys):
    save_checkpoint(tmp_path / "m.pt", make_network("mlp", size=8, depth=3, width=16), "mlp", {})
    assert main([*WEIGHTS, "--weights", str(tmp_path / "m.pt")]) == 2
    one_error(capsys, r"m.pt: its weights do not fit the mlp network: Error\(s\) in loading "
                      r"state_dict for Sequential: .*Missing key\(s\)")


@pytest.mark.parametrize("rows,match", [
    (10**7, r"asks for an absurd model \(num_classes=10000000\): a size or count of a "
            r"checkpoint of \d+ bytes is at most 1048576, refused before building it"),
    (600_000, r"asks for an absurd model \(num_classes=600000\): building it would need "
              r"empty.memory_format of a tensor of shape \(600000, 256\) \(585.9 MiB, after "
              r"[\d.]+ \w+\), more than the 256.0 MiB a checkpoint of \d+ bytes justifies; "
              r"refused before allocating it"),
])
def test_weights_that_claim_absurd_classes(tmp_path, capsys, rows, match):
    """A classifier of ``rows`` outputs stored as a broadcast tensor: a file of 1.5 kB whose
    shapes would make the network allocate gigabytes."""
    torch.save({"0.weight": torch.zeros(1, 1).expand(rows, 64)}, tmp_path / "huge.pt")
    assert (tmp_path / "huge.pt").stat().st_size < 4096
    assert main([*WEIGHTS, "--weights", str(tmp_path / "huge.pt")]) == 2
    one_error(capsys, r"huge.pt: the mlp config in this checkpoint " + match)


def test_good_weights_still_load(tmp_path, capsys, mlp_checkpoint):
    assert main([*WEIGHTS, "--weights", str(mlp_checkpoint), "--out", str(tmp_path / "o.pt")]) \
        == 0
    assert f"weights = loaded from {mlp_checkpoint}" in capsys.readouterr().out
    torch.save(make_network("mlp", size=8).state_dict(), tmp_path / "plain.pt")  # plain
    assert main([*WEIGHTS, "--weights", str(tmp_path / "plain.pt"), "--out",
                 str(tmp_path / "o2.pt")]) == 0


# -- model checkpoints: configs that ask for absurd allocations -----------------------------------
def tampered(tmp_path: Path, model, **config) -> Path:
    """``model``'s checkpoint with ``config`` entries replaced."""
    model.save(tmp_path / "m.pt")
    ck = torch.load(tmp_path / "m.pt", weights_only=True)
    ck["config"].update(config)
    torch.save(ck, tmp_path / "bad.pt")
    return tmp_path / "bad.pt"


INT_BOUND = r"a size or count of a checkpoint of \d+ bytes is at most 1048576, refused before " \
    r"building it"
BUDGET = r"building it would need .*, more than the 256.0 MiB a checkpoint of \d+ bytes " \
    r"justifies; refused before allocating it"

ABSURD = {  # model, config, message: the fields named, and which guard refused
    "made-features": (lambda: MADE(4, (8,)), {"features": 10**12, "order": None},
                      r"\(features=1000000000000\): " + INT_BOUND),
    "made-hidden": (lambda: MADE(4, (8,)), {"hidden": [8, 10**9]},
                    r"\(hidden\[1\]=1000000000\): " + INT_BOUND),
    "made-wide": (lambda: MADE(4, (8,)), {"features": 30000, "order": None, "hidden": [30000]},
                  r"\(features=30000, hidden\[0\]=30000\): " + BUDGET),
    "mlp-hidden": (lambda: MLPDenoiser(hidden=8, layers=1), {"hidden": 10**9},
                   r"\(hidden=1000000000\): " + INT_BOUND),
    "mlp-wide": (lambda: MLPDenoiser(hidden=8, layers=2), {"hidden": 20000},
                 r"\(hidden=20000\): building it would need .* of a tensor of shape "
                 r"\(20000, 20000\)"),
    "mlp-layers": (lambda: MLPDenoiser(hidden=8, layers=1), {"layers": 500_000},
                   r"\(layers=500000\): building it would register more than the 256 "
                   r"modules, parameters and buffers that a state dict of 4 tensors in a "
                   r"checkpoint of \d+ bytes justifies; refused"),
    "tarflow-blocks": (lambda: TarFlow(4, patch_size=2, blocks=1, layers=1, width=8, heads=2),
                       {"blocks": 10**9}, r"\(blocks=1000000000\): " + INT_BOUND),
    "tarflow-image": (lambda: TarFlow(4, patch_size=2, blocks=1, layers=1, width=8, heads=2),
                      {"image_size": 2**20}, r"\(image_size=1048576\): " + BUDGET),
    "pixelcnn-hidden": (lambda: PixelCNN(1, 4, hidden=4, layers=1, mixtures=1, levels=4),
                        {"hidden": 10**6}, r"\(hidden=1000000\): " + BUDGET),
}


@pytest.mark.parametrize("case", list(ABSURD))
def test_absurd_config_is_refused_by_field(tmp_path, case):
    make, config, match = ABSURD[case]
    model = make()
    path = tampered(tmp_path, model, **config)
    kind = type(model).__name__
    with pytest.raises(ValueError, match=rf"bad.pt: the {kind} config in this checkpoint asks "
                                         rf"for an absurd model {match}"):
        type(model).load(path)


def test_absurd_unet_config(tmp_path):
    pytest.importorskip("diffusers")
    from paraprop.models.denoisers import load_unet, save_unet, small_unet

    save_unet(small_unet(4, widths=(8, 8)), tmp_path / "u.pt")
    ck = torch.load(tmp_path / "u.pt", weights_only=True)
    ck["config"]["block_out_channels"] = [8, 100_000]
    torch.save(ck, tmp_path / "u.pt")
    with pytest.raises(ValueError, match=r"u.pt: the UNet2DModel config in this checkpoint asks "
                                         r"for an absurd model \(block_out_channels\[1\]=100000"
                                         r"\): " + BUDGET):
        load_unet(tmp_path / "u.pt")


def test_a_constructor_that_swallows_exceptions_is_still_stopped(tmp_path):
    """The refusal is not an Exception, so a constructor's ``except Exception`` cannot turn
    it into a half-built model."""

    def careless(n):
        try:
            return torch.nn.Linear(n, n)
        except Exception:  # noqa: BLE001 - the point of the test
            return torch.nn.Linear(1, 1)

    with pytest.raises(ValueError, match=r"f.pt: the Careless config in this checkpoint asks "
                                         r"for an absurd model \(n=60000\)"):
        build_within_budget(careless, {"n": 60000}, path=tmp_path / "f.pt", kind="Careless",
                            file_bytes=1000, tensors=2)
    assert build_within_budget(careless, {"n": 4}, path="f.pt", kind="Careless",
                               file_bytes=1000, tensors=2).weight.shape == (4, 4)


def test_good_checkpoints_load_unchanged(tmp_path):
    for model in (MADE(6, (16, 16)), MLPDenoiser(hidden=16, layers=2),
                  TarFlow(4, patch_size=2, blocks=2, layers=1, width=8, heads=2),
                  PixelCNN(1, 4, hidden=4, layers=2, mixtures=1, levels=4)):
        model.save(tmp_path / "m.pt")
        back = type(model).load(tmp_path / "m.pt")
        for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items(),
                                   strict=True):
            assert k == k2 and torch.equal(a, b)


def test_model_checkpoint_with_pickled_code(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"kind": "MADE", "config": {"features": 4, "hidden": [8]},
                "state_dict": {}, "extra": Planted(marker)}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match=r"evil.pt: cannot be read as a paraprop MADE "
                                         r"checkpoint: it holds pickled Python objects"):
        MADE.load(tmp_path / "evil.pt")
    assert not marker.exists()


def test_read_torch_file_keeps_torch_reason_for_a_damaged_torch_file(tmp_path):
    import zipfile

    with zipfile.ZipFile(tmp_path / "z.pt", "w") as z:
        z.writestr("notes.txt", "hi")
    with pytest.raises(ValueError, match=r"z.pt: cannot be read as X: it is a zip archive that "
                                         r"torch cannot read as a torch file \(\d+ bytes; "
                                         r"torch.load: RuntimeError: "):
        read_torch_file(tmp_path / "z.pt", "X")


# -- char LM directories ---------------------------------------------------------------------------
@pytest.fixture
def charlm_dir(tmp_path) -> Path:
    pytest.importorskip("transformers")
    from paraprop.data.text import CharVocab
    from paraprop.models.charlm import char_gpt2, save_charlm

    vocab = CharVocab("abc?")
    return save_charlm(char_gpt2(len(vocab), width=8, layers=2, heads=2, context=16), vocab,
                       tmp_path / "lm")


@pytest.mark.parametrize("field,value,match", [
    ("vocab_size", 10**12, r"vocab_size=1000000000000 does not match the weights "
                           r"\(transformer.wte.weight in model.safetensors has shape \[4, 8\]\); "
                           r"refused before building the model"),
    ("n_embd", 10**9, r"n_embd=1000000000 does not match the weights \(transformer.wte.weight"),
    ("n_positions", 10**9, r"n_positions=1000000000 does not match the weights "
                           r"\(transformer.wpe.weight in model.safetensors has shape \[16, 8\]\)"),
    ("n_layer", 10**6, r"n_layer=1000000 does not match the weights \(model.safetensors holds 2 "
                       r"layers\)"),
    ("n_head", 0, r"n_head must be a positive int, got 0"),
    ("model_type", "t5", r"model_type='t5', not 'gpt2'"),
    # not among the sizes checked first: found by the model built on the meta device
    ("n_inner", 10**8, r"n_inner=100000000 does not match the weights "
                       r"\(transformer.h.0.mlp.c_fc.weight in model.safetensors has shape "
                       r"\[8, 32\], the config makes it \[8, 100000000\]\); refused before "
                       r"building the model"),
    ("n_inner", 31, r"n_inner=31 does not match the weights \(transformer.h.0.mlp.c_fc.weight "
                    r"in model.safetensors has shape \[8, 32\], the config makes it \[8, 31\]"),
    ("n_inner", "x", r"n_inner must be null or a positive int, got 'x'"),
    ("n_inner", 0, r"n_inner must be null or a positive int, got 0"),
    ("activation_function", "nope", r"transformers cannot build a GPT-2 from it "
                                    r"\(activation_function=\"nope\" is not known to it\) "
                                    r"\(KeyError: 'nope'\)"),
])
def test_charlm_config_is_checked_against_the_weights(charlm_dir, field, value, match):
    from paraprop.models.charlm import load_charlm

    cfg = json.loads((charlm_dir / "config.json").read_text())
    cfg[field] = value
    (charlm_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"lm/config.json: " + match):
        load_charlm(charlm_dir)


def test_charlm_absurd_inner_size_is_refused_before_allocating(charlm_dir, monkeypatch):
    """The reviewer's case: n_inner=10**8 is a ValueError naming config.json and the field,
    raised before transformers builds (or allocates) anything."""
    import transformers

    from paraprop.models.charlm import load_charlm

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", no_loading)
    cfg = json.loads((charlm_dir / "config.json").read_text())
    (charlm_dir / "config.json").write_text(json.dumps(dict(cfg, n_inner=10**8)))
    with pytest.raises(ValueError, match=r"lm/config.json: n_inner=100000000 does not match"):
        load_charlm(charlm_dir)


def test_charlm_default_inner_size_against_other_weights(tmp_path):
    """Weights of n_inner=20 under a config that leaves n_inner null (4 n_embd = 32): the
    fields that decide the tensor's size are named."""
    pytest.importorskip("transformers")
    from paraprop.data.text import CharVocab
    from paraprop.models.charlm import char_gpt2, load_charlm, save_charlm

    vocab = CharVocab("abc?")
    model = char_gpt2(len(vocab), width=8, layers=1, heads=2, context=16)
    model.config.n_inner = 20
    d = save_charlm(type(model)(model.config), vocab, tmp_path / "lm")
    assert load_charlm(d)[0].config.n_inner == 20  # saved and loaded as it is
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, n_inner=None)))
    with pytest.raises(ValueError, match=r"lm/config.json: n_embd=8, n_inner=null does not "
                                         r"match the weights \(transformer.h.0.mlp.c_fc.weight "
                                         r"in model.safetensors has shape \[8, 20\], the "
                                         r"config makes it \[8, 32\]\)"):
        load_charlm(d)


def test_charlm_weights_missing_or_with_extra_tensors(charlm_dir):
    """A tensor the config has but the weights lack is refused (transformers would fill it
    with random values), and so is one the config does not have; a tied tensor saved once is
    fine."""
    from safetensors.torch import load_file, save_file

    from paraprop.models.charlm import load_charlm

    weights = charlm_dir / "model.safetensors"
    good = load_file(weights)
    assert "lm_head.weight" not in good  # tied to transformer.wte.weight, saved once
    save_file({k: v for k, v in good.items() if k != "transformer.h.1.ln_2.bias"}, weights)
    with pytest.raises(ValueError, match=r"lm/model.safetensors: no tensor "
                                         r"transformer.h.1.ln_2.bias \(shape \[8\]\), which a "
                                         r"GPT-2 of config.json has; not the weights of this "
                                         r"config"):
        load_charlm(charlm_dir)
    save_file({**good, "transformer.h.0.extra": torch.zeros(3)}, weights)
    with pytest.raises(ValueError, match=r"lm/model.safetensors: holds a tensor "
                                         r"transformer.h.0.extra \(shape \[3\]\) that a GPT-2 "
                                         r"of config.json does not have"):
        load_charlm(charlm_dir)
    cfg = json.loads((charlm_dir / "config.json").read_text())
    (charlm_dir / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=False)))
    save_file(good, weights)
    with pytest.raises(ValueError, match=r"lm/model.safetensors: no tensor lm_head.weight "
                                         r"\(shape \[4, 8\]\)"):
        load_charlm(charlm_dir)
    (charlm_dir / "config.json").write_text(json.dumps(cfg))
    model, _ = load_charlm(charlm_dir)
    assert torch.equal(model.lm_head.weight, good["transformer.wte.weight"])


def test_charlm_files_that_are_not_a_char_lm(charlm_dir):
    from paraprop.models.charlm import load_charlm

    model, vocab = load_charlm(charlm_dir)
    assert len(vocab) == 4 and not model.training
    (charlm_dir / "vocab.json").write_text(json.dumps({"chars": "abcd?"}))
    with pytest.raises(ValueError, match=r"lm/vocab.json: 5 characters, but config.json says "
                                         r"vocab_size=4"):
        load_charlm(charlm_dir)
    (charlm_dir / "vocab.json").write_text("not json")
    with pytest.raises(ValueError, match=r"lm/vocab.json: not valid JSON"):
        load_charlm(charlm_dir)
    (charlm_dir / "vocab.json").write_text(json.dumps({"chars": "abc?"}))
    weights = charlm_dir / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[:50])
    with pytest.raises(ValueError, match=r"model.safetensors: cannot be read as safetensors "
                                         r"weights \(.*\); the file is truncated or damaged"):
        load_charlm(charlm_dir)
    weights.unlink()
    torch.save({}, charlm_dir / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"model.safetensors: no such file \(expected "
                                                r"the weights that save_pretrained writes\); "
                                                r"pytorch_model.bin is pickle-based"):
        load_charlm(charlm_dir)


# -- --out: checked before any work ----------------------------------------------------------------
@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A directory in which nothing can be created (a read-only one for a normal user; for root,
    who ignores modes, a directory of /sys if it refuses too)."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        os.chmod(d, 0o555)
        yield d
        os.chmod(d, 0o755)
        return
    import tempfile

    try:
        fd, name = tempfile.mkstemp(dir="/sys")
    except OSError:
        yield Path("/sys")
        return
    os.close(fd)
    os.unlink(name)
    pytest.skip("no directory refuses writes to root here")


DENIED = r"\((Permission denied|Read-only file system|Operation not permitted)\)$"

# Each job, with the function its run() calls first for data or training (it must not be
# reached) and a file name its --out error suggests.
JOBS = {
    "made": (["--epochs", "1"], "paraprop_lab.training.made.made_data", "made_digits.pt"),
    "pixelcnn": (["--epochs", "1"], "paraprop_lab.training.pixelcnn.pixel_data",
                 "pixelcnn_digits.pt"),
    "tarflow": (["--epochs", "1"], "paraprop_lab.training.tarflow._train", "tarflow_digits_e1.pt"),
    "ddpm": (["--epochs", "1"], "paraprop_lab.training.ddpm.ddpm_data", "ddpm_moons.pt"),
    "densenet": (["--arch", "mlp", "--steps", "1"], "paraprop_lab.training.networks.make_network",
                 "networks_mlp_mnist.pt"),
}


def _forbid(monkeypatch, target: str) -> None:
    monkeypatch.setattr(target, lambda *a, **k: pytest.fail(f"{target} ran before --out was "
                                                            "checked"))


@pytest.mark.parametrize("job", list(JOBS))
def test_out_is_a_directory(tmp_path, capsys, monkeypatch, job):
    args, first, example = JOBS[job]
    _forbid(monkeypatch, first)
    assert main(["train", job, *args, "--out", str(tmp_path)]) == 2
    one_error(capsys, rf"--out {re.escape(str(tmp_path))}: is a directory; expected the path "
                      rf"of a file to write, e.g. {re.escape(str(tmp_path / example))}$")


@pytest.mark.parametrize("job", list(JOBS))
def test_out_cannot_be_written(tmp_path, capsys, monkeypatch, unwritable, job):
    args, first, _ = JOBS[job]
    _forbid(monkeypatch, first)
    out = unwritable / "model.pt"
    assert main(["train", job, *args, "--out", str(out)]) == 2
    one_error(capsys, rf"--out {re.escape(str(out))}: cannot write in "
                      rf"{re.escape(str(unwritable))} " + DENIED)


@pytest.mark.parametrize("job", ["made", "ddpm"])
def test_out_below_a_file(tmp_path, capsys, monkeypatch, job):
    args, first, _ = JOBS[job]
    _forbid(monkeypatch, first)
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "sub" / "m.pt"
    assert main(["train", job, *args, "--out", str(out)]) == 2
    one_error(capsys, rf"--out {re.escape(str(out))}: cannot create its directory "
                      rf"{re.escape(str(out.parent))} \({re.escape(str(tmp_path / 'file'))} is a "
                      r"file\)$")
    assert not (tmp_path / "sub").exists()


def test_out_missing_folders_are_not_created_before_training(tmp_path, monkeypatch):
    """The check leaves nothing behind: a folder that does not exist yet is made by the save."""
    from paraprop_lab.training._common import check_out_file

    out = tmp_path / "a" / "b" / "m.pt"
    assert check_out_file(out) == out
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []


def test_ddpm_png_is_checked_too(tmp_path, capsys, monkeypatch):
    _forbid(monkeypatch, "paraprop_lab.training.ddpm.ddpm_data")
    assert main(["train", "ddpm", "--out", str(tmp_path / "m.pt"), "--png", str(tmp_path)]) == 2
    one_error(capsys, rf"--png {re.escape(str(tmp_path))}: is a directory; expected the path "
                      r"of a file to write, e.g. .*ddpm_moons.png$")


def test_charlm_out_is_a_file(tmp_path, capsys, monkeypatch):
    _forbid(monkeypatch, "paraprop_lab.training.charlm.corpus")
    (tmp_path / "f").write_text("x")
    assert main(["train", "charlm", "--out", str(tmp_path / "f")]) == 2
    one_error(capsys, rf"--out {re.escape(str(tmp_path / 'f'))}: is a file, not a directory; "
                      r"expected the directory to save the model in$")


def test_resnet_mg_out_is_a_directory(tmp_path, capsys, monkeypatch):
    _forbid(monkeypatch, "paraprop_lab.training.resnet_mg.train")
    assert main(["train", "resnet-mg", "--out", str(tmp_path)]) == 2
    assert re.search(r"--out .*: is a directory; expected the path of a file to write, e.g. "
                     r".*history.json", capsys.readouterr().err)


def test_bench_and_demo_out_cannot_be_written(tmp_path, capsys, monkeypatch, unwritable):
    class Suite:
        def run(self, *a, **k):
            pytest.fail("the suite ran before --out was checked")

    monkeypatch.setattr("paraprop_lab.bench.load", lambda name: Suite())
    monkeypatch.setattr("paraprop_lab.demos.parts", lambda: pytest.fail("the demo ran"))
    out = unwritable / "results"
    assert main(["bench", "core", "--out", str(out)]) == 2
    one_error(capsys, rf"--out {re.escape(str(out))}: cannot create the results directory "
                      + DENIED)
    assert main(["demo", "--out", str(unwritable)]) == 2
    one_error(capsys, rf"--out {re.escape(str(unwritable))}: cannot write in "
                      rf"{re.escape(str(unwritable))} " + DENIED)
    (tmp_path / "file").write_text("x")
    assert main(["bench", "core", "--out", str(tmp_path / "file")]) == 2
    one_error(capsys, r"file: is a file, not a directory; expected the results directory$")


def test_report_out_is_checked_before_collecting(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("paraprop_lab.bench.collect.collect",
                        lambda *a, **k: pytest.fail("collected before --out was checked"))
    assert main(["report", "--out", str(tmp_path)]) == 2
    one_error(capsys, r"is a directory; expected the path of a file to write, e.g. "
                      r".*benchmarks.md$")


def test_a_good_out_is_used(tmp_path, capsys):
    out = tmp_path / "new" / "made.pt"
    assert main(["train", "made", "--epochs", "1", "--hidden", "8", "--out", str(out)]) == 0
    assert MADE.load(out).features == 64
    shutil.rmtree(tmp_path / "new")


# -- --out that names no file, --weights that hold NaN / inf (issue 27, probe 1 item 15) -----------
@pytest.mark.parametrize("job", list(JOBS))
@pytest.mark.parametrize("end", ["/", "/.", "/.."])
def test_out_ending_as_a_directory_is_refused(tmp_path, capsys, monkeypatch, job, end):
    """``--out newdir/`` names a directory that does not exist yet: Path() drops the separator,
    and the job wrote a file named newdir."""
    args, first, example = JOBS[job]
    _forbid(monkeypatch, first)
    out = f"{tmp_path / 'newdir'}{end}"
    assert main(["train", job, *args, "--out", out]) == 2
    what = "a path separator" if end == "/" else repr(end[1:])
    one_error(capsys, rf"--out {re.escape(out)}: ends with {re.escape(what)}, so it names a "
                      rf"directory; expected the path of a file to write, e.g. .*{example}$")
    assert not (tmp_path / "newdir").exists()


@pytest.mark.parametrize("command", [
    ["train", "made", "--epochs", "1"], ["train", "pixelcnn", "--epochs", "1"],
    ["train", "tarflow", "--epochs", "1"], ["train", "ddpm", "--epochs", "1"],
    ["train", "densenet", "--arch", "mlp"], ["train", "charlm"], ["train", "resnet-mg"],
    ["demo"], ["bench", "core"], ["report"]], ids=lambda c: " ".join(c[:2]))
def test_an_empty_out_is_refused_not_replaced_by_the_default(capsys, monkeypatch, command):
    for target in ("paraprop_lab.training.made.made_data",
                   "paraprop_lab.training.pixelcnn.pixel_data",
                   "paraprop_lab.training.tarflow._train", "paraprop_lab.training.ddpm.ddpm_data",
                   "paraprop_lab.training.networks.make_network",
                   "paraprop_lab.training.charlm.corpus",
                   "paraprop_lab.training.resnet_mg.train", "paraprop_lab.demos.parts",
                   "paraprop_lab.bench.collect.collect"):
        _forbid(monkeypatch, target)

    class Suite:
        def run(self, *a, **k):
            pytest.fail("the suite ran before --out was checked")

    monkeypatch.setattr("paraprop_lab.bench.load", lambda name: Suite())
    assert main([*command, "--out", ""]) == 2
    err = capsys.readouterr().err   # (resnet-mg prints its own prefix)
    assert re.search(r"--out '': empty; expected .* \(leave the option out for the default\)$",
                     err.strip()), err


def test_ddpm_empty_png_is_refused(tmp_path, capsys, monkeypatch):
    _forbid(monkeypatch, "paraprop_lab.training.ddpm.ddpm_data")
    assert main(["train", "ddpm", "--out", str(tmp_path / "m.pt"), "--png", ""]) == 2
    one_error(capsys, r"--png '': empty; expected the path of a file to write")


@pytest.mark.parametrize(("value", "kind"), [(float("nan"), "NaN"), (float("inf"), "inf"),
                                             (-float("inf"), "inf")])
def test_weights_with_non_finite_values_are_refused(tmp_path, capsys, monkeypatch, value, kind):
    """Weights holding NaN / inf trained to loss NaN without a word."""
    _forbid(monkeypatch, "paraprop_lab.training.networks.train_network")
    model = make_network("mlp", size=8)
    with torch.no_grad():
        model[3].bias[[1, 4]] = value
    path = save_checkpoint(tmp_path / "bad.pt", model, "mlp", {})
    assert main([*WEIGHTS[:-4], "--steps", "1", "--eval-batch", "0", "--weights", str(path),
                 "--out", str(tmp_path / "o.pt")]) == 2
    one_error(capsys, rf"bad.pt: tensor '3.bias' holds 2 non-finite values \({kind}\) among its "
                      r"256; expected finite weights \(training from them gives a loss of NaN")
    torch.save({k: v for k, v in model.state_dict().items()}, tmp_path / "plain.pt")
    assert main([*WEIGHTS, "--weights", str(tmp_path / "plain.pt")]) == 2   # a plain state_dict
    one_error(capsys, r"plain.pt: tensor '3.bias' holds 2 non-finite values")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_checkpoint_with_non_finite_weights_is_refused_at_load(tmp_path, bad):
    path = tmp_path / "made.pt"
    m = MADE(6, (16,))
    m.save(path)
    ckpt = torch.load(path, weights_only=True)
    name = next(k for k, v in ckpt["state_dict"].items() if v.is_floating_point())
    ckpt["state_dict"][name].view(-1)[0] = bad
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=rf"{path}: tensor {name!r} holds 1 non-finite values"):
        MADE.load(path)
