"""Smoke test of ``paraprop bench bppsa --quick`` (measures nothing; checks the records)."""

import json

from paraprop import bench
from paraprop.bench import bppsa


def test_bppsa_suite_quick(tmp_path, capsys):
    assert "bppsa" in bench.suites()
    payload = bppsa.run(tmp_path, quick=True, repeats=1)
    record = json.loads((tmp_path / "bppsa.json").read_text())
    assert record["command"] == "paraprop bench bppsa --quick --repeats 1"
    assert [r["kind"] for r in payload["wide"]] == ["gru", "lstm"]
    for key in ("rnn_T", "rnn_batch", "gru", "wide"):
        assert payload[key], key
        for row in payload[key]:
            assert row["repeats"] == 1
            assert row["torch_bwd_ms"] > 0 and row["scan_bwd_ms"] > 0
            assert row["bwd_speedup"] == row["torch_bwd_ms"] / row["scan_bwd_ms"]
            assert row["grad_rel_err"] <= 1e-5      # float32 gradients equal autograd's
    curves = payload["jacobi"]["curves"]
    assert {"torch autograd", "scan (exact)"} <= set(curves)
    for c in curves.values():
        assert len(c["loss"]) == len(c["time_s"]) > 0
        assert all(b >= a for a, b in zip(c["time_s"], c["time_s"][1:], strict=False))
    for png in payload["plots"]:
        assert (tmp_path / png).stat().st_size > 0
    md = (tmp_path / "bppsa.md").read_text()
    assert md.startswith("# bppsa") and "GRU at the IRMAS shapes" in md
    assert "GRU and LSTM, T=100, hidden 64, batch 8" in md
