"""Smoke runs of ``paraprop bench fusion --quick`` and the fusion demo part (no timing asserted)."""

import json

from paraprop_lab import bench, demos
from paraprop_lab.bench import fusion as fusion_suite
from paraprop_lab.demos import fusion as fusion_demo


def test_bench_fusion_quick(tmp_path):
    assert "fusion" in bench.suites()
    payload = fusion_suite.run(tmp_path, quick=True, repeats=1)
    record = json.loads((tmp_path / "fusion.json").read_text())
    assert record["command"] == "paraprop bench fusion --quick --repeats 1"
    rows = record["rows"]
    assert {r["mode"] for r in rows} == set(fusion_suite.MODES)
    assert all(r["bitwise_equal"] for r in rows)  # every fused copy trained to the same bits
    assert all(r["step_ms"] > 0 and r["forward_ms"] > 0 for r in rows)
    assert {r["mode"] for r in payload["memory_rows"]} == set(fusion_suite.MODES)
    assert all(r["peak_MiB"] > 0 for r in payload["memory_rows"])
    assert (tmp_path / "fusion.md").read_text().startswith("# fusion")
    assert (tmp_path / "fusion_saving.png").stat().st_size > 0


def test_demo_part_fusion_quick(tmp_path, capsys):
    assert fusion_demo in demos.parts()
    res = fusion_demo.run(tmp_path, quick=True)
    assert [r["mode"] for r in res["rows"]] == list(fusion_demo.MODES)
    assert res["headline"] and " wins" in res["why"] and res["why"] in md_all(res)
    assert "None" not in md_all(res)
    assert all(r["bitwise_equal"] for r in res["rows"])
    assert len({r["final_loss"] for r in res["rows"]}) == 1
    heading, md = res["sections"][0]
    assert "bitwise_equal" in md and "Adam on the digits" in heading
    assert "backward+overlap" in capsys.readouterr().out


def md_all(res):
    return "\n".join(md for _, md in res["sections"])
