"""``make gpu-check``: its flow end to end on the CPU at tiny sizes (so that it cannot rot between
GPU runs), the device rows' records and runner, the device helpers of the benchmarks.

The GPU figures themselves come from a run on a GPU machine (docs/gpu.md); nothing here asserts
on time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paraprop_lab.bench import gpu, gpu_check
from paraprop_lab.experiments import device as devmod
from paraprop_lab.experiments import rows_recurrent
from paraprop_lab.experiments.rows import Context, RowSpec, choice, max_abs, row, run_specs, skipped

ROOT = Path(__file__).resolve().parents[1]


# -- the whole flow, on the CPU ---------------------------------------------------------------
@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    # the test step runs this file's gpu-marked case only: it skips on the CPU (exit 0)
    res = subprocess.run(
        [sys.executable, str(ROOT / "src/paraprop_lab/bench/gpu_check.py"), "--device", "cpu",
         "--out", str(out), "--wheels", str(tmp_path / "none"),
         "--pytest-args", "tests/test_gpu_check.py -m gpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(gpu_check.FILES)
    assert len(names) <= gpu_check.MAX_FILES and gpu_check.limits(out) == []

    events = [json.loads(ln) for ln in (out / "rows.jsonl").read_text().splitlines()]
    started = [e["spec"] for e in events if e.get("event") == "start"]
    ended = [e["spec"] for e in events if e.get("event") == "end"]
    assert started == ended == [s.name for s in gpu.specs()]       # every row, in order

    record = json.loads((out / "gpu.json").read_text())
    assert record["machine"]["device"] == "cpu" and record["scale"] == "tiny"
    recs = record["records"]
    assert [r for r in recs if r["status"] == "failed"] == []
    # on the CPU only the Triton rows may be missing, and they say why
    assert all("Triton" in r["reason"] or "triton" in r["reason"]
               for r in recs if r["status"] == "skipped")
    rows = [r for r in recs if r["status"] == "ok" and r["kind"] == "row"]
    assert {r["suite"] for r in rows} == {s.name.split(".")[0] for s in gpu.specs()} == {
        "scan", "newton", "bppsa", "made", "pixelcnn", "pararnn", "decoding", "diffusion",
        "tarflow", "core", "flows", "triangular", "multigrid"}
    for r in rows:      # every parallel result is the sequential one within its bound
        assert r["within"] is not False, r
        assert r["baseline_ms"] > 0 and r["method_ms"] > 0
    assert "skipped" in record["pytest"]["summary"] and record["pytest"]["exit"] == 0
    md = (out / "gpu.md").read_text()
    # the command as it ran (options beyond the folder and device: the script, not make)
    assert md.startswith("# gpu\n\nCommand: `PYTHONPATH=src python3 src/paraprop_lab/bench/"
                         "gpu_check.py --out $OUT --device cpu --wheels ")
    for heading in ("## Environment and tests", "## Rows: baseline vs method", "## auto choices",
                    "![](gpu.png)"):
        assert heading in md
    env_txt = (out / "env.txt").read_text()
    assert "device         cpu" in env_txt and "imports: triton ok, transformers ok" in env_txt
    assert "== 4. device rows" in (out / "gpu-check.log").read_text()


# -- pieces of the flow --------------------------------------------------------------------------
def test_limits_name_what_would_not_come_back(tmp_path):
    assert gpu_check.limits(tmp_path) == []
    for i in range(9):
        (tmp_path / f"f{i}.txt").write_text("x")
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_text("x")
    (tmp_path / "odd name.txt").write_text("x")
    problems = gpu_check.limits(tmp_path)
    assert problems[0] == "11 files, at most 8 come back"
    assert "a/b/c/deep.txt: more than 2 folders deep" in problems
    assert "odd name.txt: a name with characters that do not come back" in problems


def test_done_specs_resume_after_a_killed_row(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    assert gpu_check._done_specs(jsonl) == (set(), None)
    lines = [{"event": "start", "spec": "a.x"}, {"kind": "row"}, {"event": "end", "spec": "a.x"},
             {"event": "start", "spec": "b.y"}]
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "ro')
    assert gpu_check._done_specs(jsonl) == ({"a.x"}, "b.y")


def test_report_names_the_rows_no_process_reached(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    rec = row("made", "jacobi_vs_ancestral", what="w", shape="x", baseline="b", baseline_s=2.0,
              method="m", method_s=1.0, max_dev=0.0, bound=1e-5, target=26.0)
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in (
        {"event": "start", "spec": "made.jacobi"}, rec, {"event": "end", "spec": "made.jacobi"})))
    args = gpu_check._child_parser("report").parse_args(
        ["--jsonl", str(jsonl), "--env", str(tmp_path / "none.json"), "--pytest",
         str(tmp_path / "none.json"), "--out", str(tmp_path), "--device", "cpu", "--scale",
         "tiny", "--command", "make gpu-check", "--only", "made", "decoding"])
    assert gpu_check.report_child(args) == 0
    recs = json.loads((tmp_path / "gpu.json").read_text())["records"]
    assert [(r["suite"], r["name"], r["status"]) for r in recs] == [
        ("made", "jacobi_vs_ancestral", "ok"), ("decoding", "greedy", "skipped")]
    assert recs[1]["reason"].startswith("not reached: the check's time budget ended")
    assert "| decoding | greedy | skipped | not reached" in (
        tmp_path / "gpu.md").read_text()


def test_a_row_that_kills_its_process_is_recorded_and_the_rest_go_on(tmp_path, monkeypatch):
    """The parent's loop: a rows process that dies inside a row (a CUDA error, or killed past its
    time) leaves a failed record for that row, and a new process takes up the others."""
    calls = []

    def fake_run(cmd, *, env, log, timeout, out=None, cwd=None):
        step = cmd[3] if cmd[1] == "-m" and cmd[2] == "paraprop_lab.bench.gpu_check" else "?"
        calls.append((step, cmd))
        if step == "env":
            Path(cmd[cmd.index("--json") + 1]).write_text("{}")
            return 0, ""
        jsonl = Path(cmd[cmd.index("--jsonl") + 1])
        if step == "rows" and len([c for c in calls if c[0] == "rows"]) == 1:
            gpu_check._append(jsonl, {"event": "start", "spec": "made.jacobi"})
            return None, "...\nRuntimeError: CUDA error: an illegal memory access"
        if step == "rows":
            assert cmd[cmd.index("--skip") + 1] == "made.jacobi"
            gpu_check._append(jsonl, {"event": "start", "spec": "decoding.greedy"})
            gpu_check._append(jsonl, {"event": "end", "spec": "decoding.greedy"})
            return 0, ""
        raise AssertionError(cmd)

    monkeypatch.setattr(gpu_check, "_run", fake_run)
    args = gpu_check.build_parser().parse_args(
        ["--device", "cpu", "--out", str(tmp_path), "--no-pytest", "--only", "made",
         "decoding", "--wheels", str(tmp_path / "none")])
    args.pytest_workers = 0
    assert gpu_check.check(args) == 1                       # a row failed
    assert [c[0] for c in calls] == ["env", "rows", "rows"]  # the second one wrote the report
    recs = [json.loads(ln) for ln in (tmp_path / "rows.jsonl").read_text().splitlines()]
    failed = [r for r in recs if r.get("status") == "failed"]
    assert [(r["suite"], r["name"]) for r in failed] == [("made", "jacobi")]
    assert failed[0]["reason"].startswith("the process ended in this row (killed past its time)")
    assert "illegal memory access" in failed[0]["reason"]
    assert "row made.jacobi ended its process" in (tmp_path / "gpu-check.log").read_text()


def test_pytest_summary_and_command():
    text = "....s\n=========== 4 passed, 1 skipped, 3 deselected in 2.01s ===========\n"
    assert gpu_check._summary(text) == "4 passed, 1 skipped, 3 deselected in 2.01s"
    assert gpu_check._summary("nothing") == "-"
    cmd = gpu_check.pytest_command("tests/test_x.py -k 'a or b'", workers=0)
    assert cmd[-3:] == ["tests/test_x.py", "-k", "a or b"]
    assert gpu_check.pytest_command(None, workers=0)[-2:] == ["-m", "gpu"]
    # the GPU machine's pytest-benchmark warns under xdist; with filterwarnings=error that was an
    # internal error before any test ran (first GPU run): the command blocks the plugin
    assert "no:benchmark" in cmd and cmd[cmd.index("no:benchmark") - 1] == "-p"


def test_gpu_suite_specs_order_and_selection():
    names = [s.name for s in gpu.specs()]
    assert names[:len(gpu.ORDER)] == [n for n in gpu.ORDER if n in names]
    assert set(gpu.ORDER) <= set(names)           # every row of the order exists
    assert [s.name for s in gpu.specs(["made"])] == ["made.jacobi"]
    assert [s.name for s in gpu.specs(["bppsa.gru", "newton"])] == ["newton.gru_forward",
                                                                   "bppsa.gru"]
    with pytest.raises(ValueError, match=r"unknown device rows \['nope'\]"):
        gpu.specs(["nope"])


def test_gpu_suite_needs_cuda_at_gpu_sizes():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="measures at GPU sizes and needs a CUDA device"):
        gpu.context(None, quick=False, repeats=None)
    assert gpu.context(None, quick=True, repeats=None).device.type == "cpu"


# -- the records and their runner -------------------------------------------------------------
def test_row_and_choice_records():
    r = row("s", "n", what="w", shape="x", baseline="b", baseline_s=2.0, method="m",
            method_s=0.5, max_dev=1e-7, bound=1e-5, target=3.0)
    assert (r["ratio"], r["met"], r["within"]) == (4.0, True, True)
    assert (r["baseline_ms"], r["method_ms"]) == (2000.0, 500.0)
    r = row("s", "n", what="w", shape="x", baseline="b", baseline_s=1.0, method="m",
            method_s=1.0, max_dev=1.0, bound=0.0, ratio=0.5, unit="of copy bandwidth",
            target=0.7)
    assert (r["met"], r["within"]) == (False, False)
    c = choice("s", "c", what="w", shape="x", times={"a": 2.0, "b": 1.0}, auto="a", auto_s=3.0)
    assert (c["fastest"], c["agrees"], c["auto_vs_fastest"]) == ("b", False, 3.0)


def test_run_specs_turns_failures_and_budget_into_records():
    def boom(ctx):
        raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    def fine(ctx):
        return [skipped("s", "fine", "nothing to do")]

    ctx = Context(torch.device("cpu"), "tiny")
    recs = list(run_specs([RowSpec("s.boom", boom, 1), RowSpec("s.fine", fine, 1)], ctx,
                          log=lambda m: None))
    assert recs[0]["status"] == "failed" and recs[0]["spec"] == "s.boom"
    assert (recs[0]["suite"], recs[0]["name"]) == ("s", "boom")
    assert recs[0]["reason"] == ("RuntimeError: CUDA error: an illegal memory access was "
                                 "encountered")
    assert recs[1]["reason"] == "nothing to do" and recs[1]["device"] == "cpu"
    late = Context(torch.device("cpu"), "gpu", deadline=0.0)        # long past
    (rec,) = run_specs([RowSpec("s.fine", fine, 30)], late, log=lambda m: None)
    assert rec["status"] == "skipped" and rec["reason"].startswith("time budget: about 30 s")
    with pytest.raises(ValueError, match="scale must be one of tiny, gpu, got 'huge'"):
        Context(torch.device("cpu"), "huge")


# -- the device helpers ----------------------------------------------------------------------
def test_resolve_names_the_device_and_what_is_there():
    assert devmod.resolve(None) == torch.device("cpu")
    assert devmod.resolve("cpu") == torch.device("cpu")
    assert devmod.resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"device must be one of cpu, cuda, cuda:N, got 'gpu'"):
        devmod.resolve("gpu")
    with pytest.raises(ValueError, match=r"measure on the CPU or on CUDA only"):
        devmod.resolve("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda' but torch .* sees no CUDA device"):
            devmod.resolve("cuda")


def test_record_says_where_a_figure_was_measured():
    info = devmod.record(torch.device("cpu"))
    assert info["device"] == "cpu" and info["torch"] == torch.__version__
    assert "gpu" not in info and info["date"][:2] == "20"
    assert devmod.version("torch") is not None and devmod.version("no-such-package") is None


def test_device_timing_and_deviation(device):
    """The harness on the ``device`` fixture (the cuda case runs under ``make test-gpu``)."""
    ctx = Context(device, "tiny", repeats=2)
    x = torch.randn(64, 64, device=device)
    times = ctx.time({"mm": lambda: x @ x, "add": lambda: x + x}, repeats=2, desc="t")
    assert set(times) == {"mm", "add"} and all(t > 0 for t in times.values())
    assert max_abs(x, x) == 0.0 and max_abs(x[:0], x[:0]) == 0.0
    assert max_abs(x.half(), x) <= 1e-2 * float(x.abs().max())
    devmod.synchronize(device)


def test_scan_rows_on_device(device):
    """The scan rows at tiny sizes on the ``device`` fixture: every algorithm's result is the
    sequential one within float32 rounding, and the copy is the baseline of each row."""
    recs = rows_recurrent.scan_bandwidth(Context(device, "tiny"))
    ok = [r for r in recs if r["status"] == "ok"]
    assert {r["name"] for r in ok} >= {"bandwidth.sequential", "bandwidth.blelloch",
                                      "bandwidth.chunked"}
    for r in ok:
        assert r["baseline"] == "copy" and math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert r["max_dev"] <= 1e-5
    assert [r["name"] for r in recs if r["status"] != "ok"] == (
        [] if device.type == "cuda" and rows_recurrent.triton_available() is None
        else ["bandwidth.triton", "bandwidth.triton_kernel"])


def test_the_baseline_runs_without_cudnn_where_cudnn_refuses_the_input():
    """The first GPU run: cuDNN refused torch.nn.GRU over T=100000 (CUDNN_STATUS_NOT_SUPPORTED)
    and the Newton row failed; the baseline is now torch's kernel with cuDNN off, said in the
    note. Other errors still fail the row."""
    import types

    from torch import nn

    from paraprop_lab.experiments.rows_recurrent import cudnn_or_not

    class Picky(nn.Module):
        def __init__(self, message):
            super().__init__()
            self.message, self.calls = message, []

        def forward(self, x):
            self.calls.append(torch.backends.cudnn.enabled)
            if torch.backends.cudnn.enabled:
                raise RuntimeError(self.message)
            return (x, None)

    x = types.SimpleNamespace(device=torch.device("cuda"), shape=(100000, 16, 1))
    picky = Picky("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ...")
    base, note = cudnn_or_not(picky, x)
    assert base is not picky and "cuDNN refused this input" in note and "T=100000" in note
    assert base(x)[0] is x and picky.calls == [True, False]
    assert torch.backends.cudnn.enabled                          # restored
    with pytest.raises(RuntimeError, match="out of memory"):
        cudnn_or_not(Picky("CUDA out of memory"), x)
    cpu = torch.zeros(3, 1, 1)
    assert cudnn_or_not(picky, cpu) == (picky, "")               # the CPU: never probed


def test_the_report_names_the_command_that_ran():
    """The second GPU run (a part of the rows, no tests) was reported as `make gpu-check`: the
    report now names `make gpu-check` only where nothing else was chosen."""
    r = gpu_check.report_command
    assert r(["--device", "cuda", "--out", "/root/out"]) == "make gpu-check"
    assert r(["--out=/x", "--device=cpu"]) == "make gpu-check DEVICE=cpu"
    part = r(["--out", "/root/out", "--no-pytest", "--only", "bppsa.rnn", "decoding",
              "--budget", "240"])
    assert part.endswith("gpu_check.py --out $OUT --no-pytest --only bppsa.rnn decoding "
                         "--budget 240")
    assert "--device cpu --budget 5" in r(["--device", "cpu", "--budget", "5"])
