"""The command line: demo smoke run, bench listing and errors, info."""

import json

import pytest

from paraprop import bench
from paraprop.bench.harness import interleaved, speedups
from paraprop.bench.report import fmt, markdown_table
from paraprop.cli import main


def test_demo_quick_writes_results(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for method in ("sequential", "jacobi", "jacobi_gs", "gs_jacobi", "plain loop"):
        assert method in out
    record = json.loads((tmp_path / "demo.json").read_text())
    rows = record["parts"]["core"]
    assert {r["method"] for r in rows} >= {"sequential", "jacobi", "jacobi_gs", "gs_jacobi"}
    assert all(r["max_abs_err"] <= 1e-4 for r in rows)
    assert (tmp_path / "demo.md").read_text().startswith("# demo")
    assert list(tmp_path.glob("*.png"))


def test_bench_lists_suites_and_rejects_unknown(capsys):
    assert "core" in bench.suites()
    assert main(["bench"]) == 0
    assert "core" in capsys.readouterr().out
    assert main(["bench", "nosuch"]) == 2
    assert "unknown benchmark suite 'nosuch'" in capsys.readouterr().err
    assert main(["bench", "core", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


def test_train_with_missing_data_exits_2(tmp_path, capsys):
    assert main(["train", "made", "--data", "mnist", "--mnist-dir", str(tmp_path),
                 "--epochs", "1"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "paraprop" in out


def test_harness_interleaves_and_reports():
    order = []
    times = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                        repeats=3, warmup=1)
    assert order == ["a", "b"] * 4
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    s = speedups({"a": [2.0, 2.0, 2.0], "b": [1.0, 1.0, 1.0]}, "a")
    assert s == {"a": 1.0, "b": 2.0}
    assert markdown_table([{"x": 1, "y": 0.5}], ["x", "y"]).splitlines()[2] == "| 1 | 0.5 |"
    assert fmt(1.5e-7) == "1.50e-07" and fmt(True) == "yes"


@pytest.mark.parametrize("argv", [["nosuch"], []])
def test_bad_command(argv):
    with pytest.raises(SystemExit):
        main(argv)


def test_report_collects_suites(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    (res / "core.md").write_text("# core\n\nCommand: `x`\n\n## t\n\n![](core_a.png)\n")
    (res / "core_a.png").write_bytes(b"png")
    out = tmp_path / "docs" / "benchmarks.md"
    assert main(["report", str(res), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## core" in text and "### t" in text and "![](img/core_a.png)" in text
    assert (tmp_path / "docs" / "img" / "core_a.png").exists()
    assert main(["report", str(tmp_path / "nothing"), "--out", str(out)]) == 2
