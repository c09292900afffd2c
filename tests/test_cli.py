"""The command line: demo smoke run, bench listing and errors, info; user errors as one line."""

import json
import re
import subprocess
import sys

import pytest

from paraprop import bench
from paraprop.cli import main
from paraprop.experiments.harness import interleaved, speedups
from paraprop.experiments.report import fmt, markdown_table


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


# -- user errors: one line 'paraprop: error: ...' on stderr, exit status 2, no traceback ----------
def _one_error_line(err: str, match: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("paraprop: error: ") and "Traceback" not in err
    assert re.search(match, lines[0]), lines[0]


@pytest.mark.parametrize("argv,match", [
    (["bench", "nosuch"], r"unknown benchmark suite 'nosuch'; available: .*core"),
    (["bench", "core", "--repeats", "0"], r"--repeats must be >= 1, got 0"),
    (["train", "made", "--epochs", "0"], r"epochs and batch_size must be >= 1, got 0, 100"),
    (["train", "made", "--hidden", "0", "--epochs", "1"],
     r"hidden must be a non-empty tuple of positive ints, got \(0,\)"),
    (["train", "pixelcnn", "--layers", "0"], r"layers must be a positive int, got 0"),
    (["report", "{tmp}/nothing"], r"results directory .*nothing does not exist"),
    (["report", "{tmp}", "--suites", "nosuch"], r"nosuch.md not found"),
])
def test_user_errors_print_one_line_and_exit_2(tmp_path, capsys, argv, match):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, match)


def test_missing_data_dir_is_one_line(tmp_path, capsys):
    assert main(["train", "made", "--data", "mnist", "--mnist-dir", str(tmp_path / "nowhere"),
                 "--epochs", "1"]) == 2
    _one_error_line(capsys.readouterr().err, r"nowhere: no such MNIST directory \(from "
                                              r"mnist_dir\)")


def test_unusable_out_dir_fails_before_any_work(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr("paraprop.demos.parts", lambda: pytest.fail("the demo ran"))
    assert main(["demo", "--quick", "--out", str(tmp_path / "file" / "sub")]) == 2
    _one_error_line(capsys.readouterr().err, r"--out .*file/sub: cannot create the results "
                                              r"directory \(Not a directory\)")


@pytest.mark.parametrize("argv,match", [
    (["train", "nosuch"], r"argument job: invalid choice: 'nosuch' .*\(see 'paraprop train "
                          r"--help'\)"),
    (["train", "made", "--epochs", "abc"], r"argument --epochs: invalid int value: 'abc'"),
    (["train", "made", "--conditional", "poisson"], r"argument --conditional: invalid choice: "
                                                    r"'poisson'"),
    (["bench", "core", "--repeats", "x"], r"argument --repeats: invalid int value: 'x'"),
    (["info", "--foo"], r"unrecognized arguments: --foo \(see 'paraprop --help'\)"),
])
def test_bad_command_lines_print_one_line_and_exit_2(capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    _one_error_line(capsys.readouterr().err, match)


def test_debug_shows_the_traceback_and_bugs_keep_theirs(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"results directory .*nothing does not exist"):
        main(["--debug", "report", str(tmp_path / "nothing")])

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr("paraprop.cli._cmd_info", bug)
    with pytest.raises(KeyError, match="a bug"):
        main(["info"])


def test_help_documents_errors_and_debug(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--debug" in out and "paraprop: error: MESSAGE" in out and "status 2" in out


def test_console_script_user_error_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "paraprop.cli", "bench", "nosuch"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    _one_error_line(proc.stderr, r"unknown benchmark suite 'nosuch'")
