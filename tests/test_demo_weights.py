"""The checkpoints that ``paraprop demo`` ships (``src/paraprop_lab/weights/``): each reloads and
reproduces the figures recorded when it was made, with the command that made it; a few MB in
all; the demo's parts load them instead of training."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from paraprop_lab.demos import _weights

NAMES = list(_weights.CHECKPOINTS)
REQUIRES = {"charlm": "transformers", "ddpm": "diffusers", "flowmatch": "diffusers",
            "imagelm": "transformers"}


def test_held_out_text_is_the_training_jobs_cut():
    from paraprop_lab.training.charlm import corpus

    vocab, _, held = corpus()
    assert torch.equal(_weights.held_out_text(vocab), held)


def test_manifest_lists_every_checkpoint_with_its_command_size_and_hash():
    rec = _weights.manifest()
    assert set(rec) - {"_recorded"} == set(NAMES)
    total = 0
    for name in NAMES:
        c, r = _weights.CHECKPOINTS[name], rec[name]
        assert r["command"] == c["command"] and r["file"] == c["file"]
        assert r["command"].startswith("OMP_NUM_THREADS=1 paraprop train ")
        assert f"--out src/paraprop_lab/weights/{c['file']}" in r["command"]
        p = _weights.path(name)
        assert p is not None, f"{c['file']} is missing from {_weights.WEIGHTS}"
        sha, size = _weights._sha256(p)
        assert (sha, size) == (r["sha256"], r["bytes"]), f"{name}: not the recorded file"
        total += size
    assert total <= 4_500_000, f"the shipped checkpoints take {total} bytes"


@pytest.mark.parametrize("name", NAMES)
def test_reloading_reproduces_the_recorded_figures(name):
    if name in REQUIRES and importlib.util.find_spec(REQUIRES[name]) is None:
        pytest.skip(f"needs {REQUIRES[name]}")
    rec = _weights.manifest()[name]
    got = _weights.figures(name)
    assert math.isclose(got["fingerprint"], rec["fingerprint"], rel_tol=_weights.RTOL)
    if got["quality"] is None:  # the MNIST MADE where the MNIST files are absent
        assert name == "made"
        pytest.skip("no MNIST files here: the NLL on MNIST is not recomputed (the fingerprint "
                    "was)")
    if name == "charlm" and got["text_sha256"] != rec["text_sha256"]:
        pytest.skip("this Python's documentation text differs from the one the loss was "
                    "recorded on (the fingerprint matched)")
    assert math.isclose(got["quality"], rec["quality"], rel_tol=_weights.RTOL), rec["quality_name"]


def test_a_changed_weight_changes_the_fingerprint():
    model = _weights.load("made")
    before = _weights.figures("made", model)["fingerprint"]
    for p in model.parameters():
        p.data += 0.01
    assert not math.isclose(_weights.figures("made", model)["fingerprint"], before,
                            rel_tol=_weights.RTOL)


def test_unknown_and_missing_checkpoints(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown checkpoint 'nope'; choose from made, charlm"):
        _weights.path("nope")
    monkeypatch.setattr(_weights, "WEIGHTS", tmp_path)
    assert _weights.path("made") is None
    with pytest.raises(FileNotFoundError, match="the shipped checkpoint is missing .made by: "
                                                 "OMP_NUM_THREADS=1 paraprop train made"):
        _weights.load("made")
