"""Smoke tests of the multigrid benchmark suite, demo part and training job (small sizes)."""

import json

import pytest

from paraprop.bench import multigrid as suite
from paraprop.bench import suites
from paraprop.cli import main
from paraprop.demos import multigrid as demo
from paraprop.training import jobs


@pytest.mark.slow
def test_bench_quick_writes_every_section(tmp_path):
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
    assert main(["train", "resnet-mg", "--data", "digits", "--depth", "8", "--coarsening",
                 "2", "--epochs", "1", "--batch-size", "128", "--out", str(out)]) == 0
    hist = json.loads(out.read_text())
    assert hist["config"]["depth"] == 8 and hist["config"]["cycles"] == 2
    ep = hist["epochs"][0]
    assert ep["test_acc"] > 20 and ep["mean_final_residual"] > 0
    assert "test accuracy" in capsys.readouterr().out


def test_train_job_errors(capsys):
    assert main(["train", "resnet-mg", "--depth", "3", "--levels", "3"]) == 2
    assert "needs at least 16 layers, got 3" in capsys.readouterr().out
    assert main(["train", "resnet-mg", "--threads", "-1"]) == 2
    assert "--threads must be >= 0" in capsys.readouterr().out
