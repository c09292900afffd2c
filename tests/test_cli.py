"""The command line: demo smoke run, bench listing and errors, info; user errors as one line."""

import ast
import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paraprop_lab import bench, demos
from paraprop_lab.cli import main
from paraprop_lab.experiments import harness
from paraprop_lab.experiments.explain import fewer_passes
from paraprop_lab.experiments.harness import interleaved, speedups
from paraprop_lab.experiments.report import fmt, markdown_table, text_table
from paraprop_lab.progress import progress
from paraprop_lab.training._common import fit


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="the demo's networks part builds a torchvision DenseNet "
                           "(pip install 'paraprop[vision]')")
def test_demo_quick_writes_results(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for method in ("sequential", "jacobi", "jacobi_gs", "gs_jacobi", "plain loop"):
        assert method in out
    record = json.loads((tmp_path / "demo.json").read_text())
    rows = record["parts"]["core"]
    assert {r["method"] for r in rows} >= {"sequential", "jacobi", "jacobi_gs", "gs_jacobi"}
    assert all(r["max_abs_err"] <= 1e-4 for r in rows)
    report = (tmp_path / "demo.md").read_text()
    assert report.startswith("# demo") and "None" not in report and "None" not in out
    assert list(tmp_path.glob("*.png"))
    # every part ends with a computed "why" sentence and has a headline in the closing summary
    names = [p.__name__.rsplit(".", 1)[-1] for p in demos.parts()]
    assert [r["part"] for r in record["summary"]] == names
    for r in record["summary"]:
        assert r["headline"] != "(no headline)" and " wins" in r["why"]
        assert all(line in out for line in r["why"].splitlines())  # one line per problem
        assert all((tmp_path / png).is_file() for png in r["plots"].split(", ")
                   if png != "(no plot)")
    assert "=== Summary" in out and "## Summary" in report


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
    from paraprop.scan import native
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "paraprop" in out
    # the native kernels' status and the threads, as the library reports them
    assert f"native         {native.status()} (the C scan kernels" in out
    assert f"torch_threads  {torch.get_num_threads()}" in out
    assert "\ntriton         " in out


def test_help_is_plain_text(capsys):
    # the package docstring's reST roles and literals are shown without their markup
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "paraprop.solve" in out and ":func:" not in out and ":mod:" not in out
    assert "``" not in out
    from paraprop_lab.cli import plain
    assert plain(":func:`~paraprop.solve` and ``x``, :class:`A`") == "paraprop.solve and x, A"


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


def test_model_share_is_the_share_of_a_run_inside_the_models_forward(monkeypatch):
    # a clock that advances one unit per reading: each forward pass reads it twice (its hooks),
    # a run once at each end; the rest of the run reads it `other` times
    ticks = iter(range(10**6))
    monkeypatch.setattr(harness.time, "perf_counter", lambda: float(next(ticks)))
    model = torch.nn.Linear(2, 1)
    calls = {"n": 0}

    def run(k, other):
        def go():
            calls["n"] += 1
            for _ in range(k):
                model(torch.ones(1, 2))
            for _ in range(other):
                harness.time.perf_counter()   # time outside the model
        return go

    # a run of 3 passes and 4 other readings: 3 units inside the model (each pass's two
    # readings are one apart), 3 * 2 + 4 + 1 = 11 units from the run's first reading to its last
    assert harness.model_share(model, run(3, 4), repeats=2) == pytest.approx(3 / 11)
    assert calls["n"] == 3                       # one untimed run, then the repeats
    assert harness.model_share(model, run(0, 2)) == 0.0
    # the hooks are gone afterwards, also where the run raised
    assert not model._forward_hooks and not model._forward_pre_hooks

    def boom():
        model(torch.ones(1, 2))
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        harness.model_share(model, boom)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_progress_off_a_terminal_writes_one_line(capsys):
    interleaved({"a": lambda: None, "b": lambda: None}, repeats=2, warmup=1, desc="timing x")
    model = torch.nn.Linear(2, 1)
    fit(model, torch.randn(8, 2), lambda xb: model(xb).pow(2).mean(), epochs=2, batch_size=4,
        lr=1e-2, seed=0, progress=True, desc="train toy", label="loss")
    fit(model, torch.randn(8, 2), lambda xb: model(xb).pow(2).mean(), epochs=1, batch_size=4,
        lr=1e-2, seed=0, progress=False, desc="silent", label="loss")
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"timing x: 6/6 runs in \d+\.\d s", lines[0])
    assert re.fullmatch(r"train toy: 4/4 steps in \d+\.\d s \(loss=\d+\.\d{4}\)", lines[1])


def test_progress_on_a_terminal_is_a_live_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    for _ in progress(range(3), desc="live", file=term):
        pass
    assert "\r" in term.getvalue() and "live" in term.getvalue()
    quiet = io.StringIO()
    for _ in progress(range(3), desc="off", file=quiet, disable=True):
        pass
    assert quiet.getvalue() == ""


def _lab_imports(path: Path) -> set[str]:
    """The ``paraprop_lab`` modules a file imports (``import`` and ``from`` forms, any depth)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        out.update(n for n in names if n.split(".")[0] == "paraprop_lab")
    return out


def test_the_training_jobs_import_nothing_of_the_measurements():
    # one direction only: experiments imports training (the models it measures), never the
    # reverse; the progress bars both use sit above them (paraprop_lab.progress)
    import paraprop_lab.training

    folder = Path(paraprop_lab.training.__file__).parent
    found = {f.name: sorted(m for m in _lab_imports(f) if m.startswith(
        ("paraprop_lab.experiments", "paraprop_lab.bench", "paraprop_lab.demos",
         "paraprop_lab.cli"))) for f in folder.glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}
    assert "paraprop_lab.progress" in _lab_imports(folder / "_common.py")   # the check sees it
    assert _lab_imports(folder.parent / "experiments" / "diffusion.py") >= {
        "paraprop_lab.training.ddpm"}


def test_tables_have_no_none_cells():
    rows = [{"a": 1, "b": None}, {"a": 2}]
    md, txt = markdown_table(rows, ["a", "b"]), text_table(rows, ["a", "b"])
    assert "None" not in md + txt
    assert md.splitlines()[2:] == ["| 1 | - |", "| 2 | - |"]
    assert fmt(None) == "-"


def test_why_sentence_follows_the_numbers():
    win = fewer_passes("jacobi", "the loop", speedup=2.0, passes=8, steps=64, cost=4.0,
                       pass_word="sweep", step_word="loop step")
    assert win.startswith("On this machine, jacobi wins: it needs 8 sweeps instead of 64 loop")
    assert "costs 4 loop steps here, so it runs at 2.00x the loop." in win
    lose = fewer_passes("jacobi", "the loop", speedup=0.5, passes=8, steps=64, cost=16.0)
    assert lose.startswith("On this machine, the loop wins: jacobi needs 8 passes")
    assert "more than the 8 each pass replaces, so it runs at 0.50x the loop." in lose
    other = fewer_passes("jacobi", "the loop", speedup=0.5, passes=8, steps=64, cost=16.0,
                         winner="the cached loop", winner_speedup=1.3)
    assert other.startswith("On this machine, the cached loop wins (1.30x the loop): jacobi")


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
    reports, notes = tmp_path / "reports", tmp_path / "notes"
    notes.mkdir()
    (notes / "core.md").write_text("Measured on a quiet machine.\n")
    (notes / "_intro.md").write_text("General conditions.\n")
    (reports / "made.md").parent.mkdir()
    (reports / "made.md").write_text("# made\n\nCommand: `m`  \nDate: d\n\n## s\n\nold\n")
    flags = ["--out", str(out), "--reports", str(reports), "--notes", str(notes)]
    assert main(["report", str(res), *flags]) == 0
    text = out.read_text()
    assert "## core" in text and "### t" in text and "![](img/core_a.png)" in text
    assert (tmp_path / "docs" / "img" / "core_a.png").exists()
    assert (reports / "core.md").read_text() == (res / "core.md").read_text()  # stored
    # the note follows the command line, before the tables; the stored made report stays
    assert text.index("Command: `x`") < text.index("Measured on a quiet") < text.index("### t")
    assert "General conditions." in text and "## made" in text and "old" in text
    # without a results directory the page is re-rendered from what is stored, identically
    assert main(["report", *flags]) == 0 and out.read_text() == text
    assert main(["report", str(tmp_path / "nothing"), *flags]) == 2


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
    (["report", "--reports", "{tmp}/none"], r"no stored suite reports \(\*.md\) in .*none"),
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
    monkeypatch.setattr("paraprop_lab.demos.parts", lambda: pytest.fail("the demo ran"))
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

    monkeypatch.setattr("paraprop_lab.cli._cmd_info", bug)
    with pytest.raises(KeyError, match="a bug"):
        main(["info"])


def test_help_documents_errors_and_debug(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--debug" in out and "paraprop: error: MESSAGE" in out and "status 2" in out


def test_console_script_user_error_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "paraprop_lab.cli", "bench", "nosuch"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    _one_error_line(proc.stderr, r"unknown benchmark suite 'nosuch'")


def test_demo_skips_a_part_whose_optional_extra_is_missing(tmp_path, capsys, monkeypatch):
    import types

    from paraprop_lab import demos

    ran = []
    needs = types.ModuleType("paraprop_lab.demos.needs")
    needs.TITLE, needs.REQUIRES = "needs a missing extra", ("no_such_module_for_paraprop",)
    needs.run = lambda out, quick: ran.append("needs")
    plain = types.ModuleType("paraprop_lab.demos.plain")
    plain.TITLE = "runs"
    plain.run = lambda out, quick: ran.append("plain") or {"headline": "ran", "rows": []}
    monkeypatch.setattr(demos, "parts", lambda: [needs, plain])
    assert demos.missing_requirements(needs) == ["no_such_module_for_paraprop"]
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ran == ["plain"]
    assert "skipped: needs no_such_module_for_paraprop" in out
