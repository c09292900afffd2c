"""Smoke runs of ``paraprop bench triangular --quick`` and the triangular demo part."""

import json

import pytest
import torch

from paraprop.errors import ConvergenceError
from paraprop.models import deep_mlp
from paraprop_lab import bench
from paraprop_lab.bench import triangular
from paraprop_lab.demos import triangular as demo


def test_bench_triangular_quick(tmp_path):
    assert "triangular" in bench.suites()
    payload = triangular.run(tmp_path, quick=True, repeats=1)
    record = json.loads((tmp_path / "triangular.json").read_text())
    assert record["command"] == "paraprop bench triangular --quick"
    assert (tmp_path / "triangular.md").read_text().startswith("# triangular")
    assert (tmp_path / "triangular_steps.png").stat().st_size > 0
    for row in payload["mlp"]:
        assert row["cr_levels"] == row["log2_bound"]
        assert row["subst_levels"] == row["l"]
        assert row["grad_rel_err_f64"] <= 1e-10
        assert row["jacobi_iters"] <= row["l"]
        assert row["cr_ms"] > 0 and row["autograd_peak_mb"] > 0
    for row in payload["rnn"]:
        assert row["cr_levels"] == row["inner_levels"] + row["outer_levels"]
        assert row["grad_rel_err_f64"] <= 1e-10
    for row in payload["training"]:
        assert 1 <= row["newton_iters_max"] <= row["l"]
        assert row["max_abs_err_vs_pass"] <= 1e-4


def test_demo_part_quick(tmp_path, capsys):
    res = demo.run(tmp_path, quick=True)
    assert "cyclic reduction" in capsys.readouterr().out
    assert res["headline"] and " wins" in res["why"] and res["why"] in md_all(res)
    assert "None" not in md_all(res)
    assert res["sections"] and res["rows"]
    for row in res["rows"]:
        assert row["cr_levels"] == row["log2_bound"]
        assert row["grad_rel_err_f64"] <= 1e-10


def test_bench_records_non_convergence_but_not_other_errors(monkeypatch):
    real = triangular.mlp_backward
    state = {}

    def fake(*args, method="cyclic_reduction", **kw):
        if method == "bicgstab":
            raise state["error"]
        return real(*args, method=method, **kw)

    monkeypatch.setattr(triangular, "mlp_backward", fake)
    state["error"] = ConvergenceError("no", solution=None)
    row = triangular.mlp_row(2, 4, 1, repeats=1)
    assert row["bicgstab_iters"] == "no conv. (?)"
    state["error"] = TypeError("a bug, not a result")
    with pytest.raises(TypeError, match="a bug, not a result"):
        triangular.mlp_row(2, 4, 1, repeats=1)
    before = torch.random.get_rng_state()
    deep_mlp(3, 4, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)  # the global state is left alone


def md_all(res):
    return "\n".join(md for _, md in res["sections"])
