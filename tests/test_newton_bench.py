"""Smoke test of ``paraprop bench newton --quick`` (measures nothing; checks the records)."""

import json
import math

from paraprop_lab import bench
from paraprop_lab.bench import newton


def _positive(v) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v > 0


def test_newton_suite_quick(tmp_path):
    assert "newton" in bench.suites()
    payload = newton.run(tmp_path, quick=True, repeats=1)
    record = json.loads((tmp_path / "newton.json").read_text())
    assert record["command"] == "paraprop bench newton --quick --repeats 1"
    assert record["suite"] == "newton" and record["quick"] is True
    gru = record["gru"]
    cfg = newton.QUICK
    # quick mode has no budget: every cell of the grid is measured, forward and backward
    cells = {(H, T) for H in cfg.hidden for T in cfg.lengths}
    assert {(r["hidden"], r["T"]) for r in gru["forward"]} == cells
    assert {(r["hidden"], r["T"]) for r in gru["backward"]} == cells
    assert all("skipped" not in v for row in gru["coverage"] for v in row.values()
               if isinstance(v, str))
    for row in gru["forward"]:
        assert row["rounds"] == 1
        for m in newton.METHODS:
            assert _positive(row[f"{m}_ms"]) and _positive(row[f"{m}_speedup"])
            assert math.isclose(row[f"{m}_speedup"], row["torch_ms"] / row[f"{m}_ms"])
            assert 1 <= row[f"{m}_iters"] <= row["T"]
            assert row[f"{m}_err"] <= newton.STATE_TOL       # same states as torch.nn.GRU
    for row in gru["backward"]:
        for m in newton.METHODS:
            assert _positive(row[f"{m}_speedup"])
            assert row[f"{m}_grad_err"] <= 1e-4               # float32 gradients near autograd's
    sine = record["sine"]
    rows = [r for r in sine["rows"] if r["method"] != "sequential"]
    assert {r["method"] for r in rows} == {"newton", "elk"}
    assert sorted(r["damping"] for r in rows if r["method"] == "elk") == sorted(cfg.dampings)
    for r in rows:
        assert 1 <= r["iterations"] <= r["max_iters"]
        assert len(r["residuals"]) == r["iterations"]
        if r["converged"]:
            assert r["max_err"] <= 1e-4 and r["exact_prefix"] == r["T"]
    assert len(sine["wave"]) > 0 and sine["train_loss_last"] > 0
    targets = {t["target"]: t for t in record["targets"]}
    assert len(targets) == 5 and all(isinstance(t["met"], bool) for t in targets.values())
    for png in payload["plots"]:
        assert (tmp_path / png).stat().st_size > 0
    md = (tmp_path / "newton.md").read_text()
    assert md.startswith("# newton")
    for heading in ("Targets", "Measured cells", "GRU forward", "forward+backward", "sine-wave"):
        assert heading in md
