"""Smoke test of ``paraprop bench bppsa --quick`` (measures nothing; checks the records)."""

import json

from paraprop_lab import bench
from paraprop_lab.bench import bppsa


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
    # issue 19: the native forward in every row, the physical limit, the peers, the load rows
    for row in payload["rnn_T"] + payload["wide"]:
        assert row["native_step_speedup"] == row["torch_step_ms"] / row["native_step_ms"]
    for row in payload["limit"]:
        macs = bppsa.step_macs(row["kind"], row["T"], row["batch"],
                               1 if row["kind"] == "rnn" else bppsa.WIDE[1], row["hidden"])
        assert row["gmacs"] == macs / 1e9 and row["limit_ms"] > 0
        assert row["max_step_speedup"] == row["torch_step_ms"] / row["limit_ms"]
    assert [r["kind"] for r in payload["peers"]] == ["rnn", "gru", "lstm"]
    for row in payload["long_forward"]:
        assert row["native_err"] <= 1e-5 and row["newton_err"] <= 1e-4
    (load,) = payload["load"]
    assert load["loaded_bwd_speedup"] == load["loaded_torch_bwd_ms"] / load["loaded_scan_bwd_ms"]
    assert "RNN under load" in md and "physical limit" in md


def test_step_macs_counts_the_products():
    # LSTM, T=10, batch 2, 3 inputs, hidden 4: forward 20 rows x 16 gates x (3 + 4), backward
    # 20 x 16 x (4 + 3 + 4) (hidden products, dW_ih, dW_hh)
    assert bppsa.step_macs("lstm", 10, 2, 3, 4) == 20 * 16 * (7 + 11)
    assert bppsa.step_macs("rnn", 10, 2, 3, 4) == 20 * 4 * (7 + 11)


def test_busy_core_is_started_and_stopped():
    from paraprop_lab.experiments.harness import busy_core

    with busy_core(seconds=30) as proc:
        assert proc.poll() is None
    assert proc.poll() is not None
