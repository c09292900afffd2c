"""Every benchmark suite takes ``device``: the suites with GPU rows run them there, the others
refuse any device but the CPU by name; the GPU reports join docs/benchmarks.md last."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from paraprop_lab import bench
from paraprop_lab.bench import collect, gpu
from paraprop_lab.bench import scan as scan_suite
from paraprop_lab.experiments.rows_report import cpu_only

SUITES = [n for n in bench.suites() if n != "gpu"]


def test_every_suite_takes_a_device_and_says_what_it_does_with_it():
    for name in SUITES:
        mod = bench.load(name)
        param = inspect.signature(mod.run).parameters.get("device")
        assert param is not None and param.default is None, name
        rows = getattr(mod, "DEVICE_ROWS", None)
        assert (rows is None) != (getattr(mod, "CPU_ONLY", None) is None), name
        for spec in rows or []:
            assert spec.name.split(".", 1)[0] == name and spec.seconds > 0
    with_rows = {n for n in SUITES if hasattr(bench.load(n), "DEVICE_ROWS")}
    assert {"scan", "pararnn", "bppsa", "newton", "made", "pixelcnn", "decoding", "diffusion",
            "tarflow"} <= with_rows
    assert {s.name.split(".", 1)[0] for s in gpu.specs()} == with_rows


def _fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("name", ["fusion", "jacobians", "networks"])
def test_suites_without_device_rows_refuse_a_gpu_by_name(name, monkeypatch, tmp_path):
    _fake_cuda(monkeypatch)          # nothing runs: the refusal comes first
    mod = bench.load(name)
    with pytest.raises(ValueError, match=rf"paraprop bench {name} measures on the CPU only, "
                                         r"not on cuda:0: .*paraprop bench gpu"):
        mod.run(tmp_path, quick=True, device="cuda")
    assert list(tmp_path.iterdir()) == []
    cpu_only(name, None, "x")          # the CPU (or no device) passes
    cpu_only(name, "cpu", "x")


def test_every_suite_with_device_rows_sends_a_device_to_its_own_rows(monkeypatch, tmp_path):
    # with_device_rows: off the CPU a suite runs its DEVICE_ROWS by device_suite, under its own
    # name, with the caller's quick and repeats; its CPU measurement does not start
    from paraprop_lab.experiments import rows_report

    _fake_cuda(monkeypatch)
    calls = []
    monkeypatch.setattr(rows_report, "device_suite",
                        lambda out, suite, specs, dev, **kw: calls.append(
                            (out, suite, specs, dev, kw)) or {"suite": suite})
    with_rows = [n for n in SUITES if hasattr(bench.load(n), "DEVICE_ROWS") and n != "scan"]
    assert len(with_rows) >= 12
    for name in with_rows:
        mod = bench.load(name)
        assert mod.run(tmp_path, quick=True, repeats=2, device="cuda") == {"suite": name}
        out, suite, specs, dev, kw = calls.pop()
        assert (out, suite, dev, kw) == (tmp_path, name, torch.device("cuda", 0),
                                         {"quick": True, "repeats": 2})
        assert specs is mod.DEVICE_ROWS
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_a_gpu_suite_without_cuda_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match=r"device='cuda' but torch .* sees no CUDA device"):
        bench.load("made").run(tmp_path, quick=True, device="cuda")
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, cuda:N, got 'tpu'"):
        bench.load("newton").run(tmp_path, quick=True, device="tpu")


def test_scan_suite_quick_on_the_cpu(tmp_path):
    payload = scan_suite.run(tmp_path, quick=True, repeats=1)
    record = json.loads((tmp_path / "scan.json").read_text())
    assert record["command"] == "paraprop bench scan --quick --repeats 1"
    assert payload["machine"]["device"] == "cpu"
    ok = {r["name"] for r in record["records"] if r["status"] == "ok"}
    assert {"bandwidth.sequential", "bandwidth.blelloch", "bandwidth.chunked"} <= ok
    assert any(n.startswith("algorithm.") for n in ok)
    md = (tmp_path / "scan.md").read_text()
    assert "## Rows: baseline vs method" in md and "## auto choices" in md
    assert (tmp_path / "scan.png").exists()


def test_gpu_reports_render_last_under_their_own_section(tmp_path):
    reports, notes = tmp_path / "reports", tmp_path / "notes"
    reports.mkdir()
    notes.mkdir()
    body = "Command: `x`  \nDate: d\n\n## Rows\n\n![](p.png)\n"
    for name in ("made", "gpu", "made_cuda", "core"):
        (reports / f"{name}.md").write_text(f"# {name}\n\n{body}")
    (notes / "_gpu.md").write_text("Words about the GPU runs.")
    page = collect.render(reports, notes)
    heads = [ln for ln in page.splitlines() if ln.startswith("#")]
    assert heads == ["# Benchmarks", "## core", "### Rows", "## made", "### Rows",
                     "## On the GPU", "### gpu", "#### Rows", "### made_cuda", "#### Rows"]
    assert "## On the GPU\n\nWords about the GPU runs.\n" in page
    assert page.count("![](img/p.png)") == 4
    (notes / "_gpu.md").unlink()
    for name in ("gpu", "made_cuda"):
        (reports / f"{name}.md").unlink()
    assert "On the GPU" not in collect.render(reports, notes)     # nothing to say: no section
    assert collect.is_gpu("gpu") and collect.is_gpu("bppsa_cuda") and not collect.is_gpu("core")
    assert collect.is_gpu("gpu_rerun") and not collect.is_gpu("gpus")


def _cli_has_device() -> bool:
    from paraprop_lab import cli

    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return any("--device" in a.option_strings for a in sub.choices["bench"]._actions)


def test_the_command_line_forwards_the_device(tmp_path, capsys):
    from paraprop_lab import cli

    if not _cli_has_device():
        pytest.skip("paraprop bench has no --device option yet (cli.py, another area: the "
                    "suites take device= already)")
    assert cli.main(["bench", "scan", "--quick", "--repeats", "1", "--device", "cpu",
                     "--out", str(tmp_path)]) == 0
    assert (tmp_path / "scan.md").exists()
    if not torch.cuda.is_available():
        assert cli.main(["bench", "made", "--quick", "--device", "cuda", "--out",
                         str(tmp_path)]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err
