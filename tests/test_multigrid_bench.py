"""Smoke tests of the multigrid benchmark suite, demo part and training job (small sizes)."""

import json

import numpy as np
import pytest

from paraprop.data import IDXError
from paraprop.multigrid import UncheckedResultWarning
from paraprop_lab.bench import multigrid as suite
from paraprop_lab.bench import suites
from paraprop_lab.cli import main
from paraprop_lab.demos import multigrid as demo
from paraprop_lab.training import jobs
from paraprop_lab.training.resnet_mg import load_data, train


@pytest.mark.slow
def test_bench_quick_writes_every_section(tmp_path):
    # its fixed-cycle rows (2 V-cycles, tol=None) are unchecked on purpose, and say so
    with pytest.warns(UncheckedResultWarning, match="max_iters=2 runs a fixed number"):
        payload = suite.run(tmp_path, quick=True, repeats=1)
    assert "multigrid" in suites()
    rec = json.loads((tmp_path / "multigrid.json").read_text())
    assert rec["suite"] == "multigrid" and rec["quick"] is True
    assert {r["depth"] for r in rec["residuals"]["rows"]} == {64, 256}
    assert all(r["cycles_to_1e-9"] is not None for r in rec["residuals"]["rows"])
    methods = {r["method"] for r in rec["forward"]["rows"]}
    assert "serial forward" in methods and "MG vmap (3 lv, c=4, FCF)" in methods
    # 2 gloo ranks (torchrun) reproduce the single-process forward pass
    assert max(rec["torchrun"]["rel_diff"].values()) <= 1e-6
    assert {r["workers"] for r in rec["cost_model"]["rows"]} == {4, 8, 16}
    assert rec["training"]["rows"][0]["mg_acc"] > 20  # learns (10 classes)
    md = (tmp_path / "multigrid.md").read_text()
    for heading in ("Residual per cycle", "batched MG forward", "torchrun", "Cost model",
                    "Training"):
        assert heading in md
    assert len(list(tmp_path.glob("multigrid_*.png"))) == 4
    assert payload["elapsed_s"] > 0


def test_demo_part(tmp_path, capsys):
    res = demo.run(tmp_path, quick=True)
    assert demo.ORDER == 50 and demo.TITLE
    assert res["headline"] and " wins" in res["why"] and res["why"] in md_all(res)
    assert "None" not in md_all(res)
    rows = {r["case"]: r for r in res["rows"]}
    assert rows["forward, 2 levels, c=4, FCF"]["max_abs_err"] <= 1e-11
    assert rows["ParallelResidualStack, to tol 1e-12"]["max_abs_err"] <= 1e-11
    assert "gradients rel. err" in rows["ParallelResidualStack, 2 cycles"]["note"]
    three = next(r for c, r in rows.items() if c.startswith("3 ranks"))
    assert three["max_abs_err"] <= 1e-12
    assert res["sections"][0][0] == demo.TITLE
    assert "ParallelResidualStack" in capsys.readouterr().out


def test_train_job_digits(tmp_path, capsys):
    assert "resnet-mg" in jobs()
    out = tmp_path / "hist.json"
    with pytest.warns(UncheckedResultWarning, match="max_iters=2 runs a fixed number"):
        assert main(["train", "resnet-mg", "--data", "digits", "--depth", "8", "--coarsening",
                     "2", "--epochs", "1", "--batch-size", "128", "--out", str(out)]) == 0
    hist = json.loads(out.read_text())
    assert hist["config"]["depth"] == 8 and hist["config"]["cycles"] == 2
    ep = hist["epochs"][0]
    assert ep["test_acc"] > 20 and ep["mean_final_residual"] > 0
    assert "test accuracy" in capsys.readouterr().out


def test_train_job_errors(capsys):
    assert main(["train", "resnet-mg", "--depth", "3", "--levels", "3"]) == 2
    assert "needs at least 16 layers, got 3" in capsys.readouterr().err
    assert main(["train", "resnet-mg", "--threads", "-1"]) == 2
    assert "--threads must be >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown data set 'cifar'; choose 'digits' or 'mnist'"):
        load_data("cifar")


def _write_idx(path, array):
    codes = {np.dtype(np.uint8): 0x08}
    head = bytes([0, 0, codes[array.dtype], array.ndim])
    head += b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(head + array.tobytes())


def _fake_mnist(directory, n=30):
    rng = np.random.default_rng(0)
    directory.mkdir()
    _write_idx(directory / "t10k-images-idx3-ubyte",
               rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
    _write_idx(directory / "t10k-labels-idx1-ubyte", (np.arange(n) % 10).astype(np.uint8))
    return directory


def test_mnist_without_training_files_splits_the_test_files(tmp_path):
    d = _fake_mnist(tmp_path / "mnist")
    tx, _, vx, _, split = load_data("mnist", mnist_dir=str(d), seed=3)
    assert (len(tx), len(vx)) == (24, 6)
    assert split == "MNIST t10k files (no training files), seeded split (seed 3): 24 train / 6 test"
    hist = train(data="mnist", mnist_dir=str(d), depth=4, levels=2, coarsening=2, channels=2,
                 epochs=1, batch_size=12, progress=False)
    assert hist["config"]["split"] == split.replace("seed 3", "seed 0")
    assert (hist["config"]["train_size"], hist["config"]["test_size"]) == (24, 6)


def test_corrupt_mnist_training_files_are_an_error(tmp_path):
    """A corrupt training file must not fall back to splitting the test files."""
    d = _fake_mnist(tmp_path / "mnist")
    (d / "train-images-idx3-ubyte").write_bytes(b"\x12\x34\x56\x78 not an IDX file")
    _write_idx(d / "train-labels-idx1-ubyte", np.zeros(3, dtype=np.uint8))
    with pytest.raises(IDXError, match="train-images-idx3-ubyte: bad magic number 12345678"):
        load_data("mnist", mnist_dir=str(d))


def md_all(res):
    return "\n".join(md for _, md in res["sections"])
