"""Smoke test of ``paraprop bench pararnn --quick`` (measures nothing; checks the records)."""

import json

from paraprop_lab import bench
from paraprop_lab.bench import pararnn


def test_pararnn_suite_quick(tmp_path):
    assert "pararnn" in bench.suites()
    payload = pararnn.run(tmp_path, quick=True, repeats=1)
    record = json.loads((tmp_path / "pararnn.json").read_text())
    assert record["command"] == "paraprop bench pararnn --quick --repeats 1"
    assert [r["cell"] for r in payload["rows"]] == ["ParaGRU", "ParaLSTM"]
    for row in payload["rows"]:
        assert row["speedup"] == row["sequential_ms"] / row["newton_ms"]
        assert row["err"] <= 1e-5                      # Newton's states are the loop's
        assert row["newton_iters"] >= 1
    (goal,) = payload["targets"]
    assert goal["target"].startswith("ParaGRU, T=256")
    assert "Newton vs the sequential loop" in (tmp_path / "pararnn.md").read_text()
