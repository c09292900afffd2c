"""The package's layout as docs/concepts.md draws it: every file placed in the map, and bench/ a
leaf that nothing but the CLI imports."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
ROWS = {"core", "adapter", "training", "tooling"}
COLUMNS = {"nonlinear", "linear", "both", "-"}


def _map() -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "concepts.md").read_text()
    section = text.split("### Every file", 1)[1].split("\n## ", 1)[0]
    return {m[0]: (m[1], m[2]) for m in
            re.findall(r"^\| `(paraprop/[^`]+\.py)` \| (\w+) \| ([\w-]+) \|", section, re.M)}


def _files() -> set[str]:
    return {str(p.relative_to(SRC)) for p in (SRC / "paraprop").rglob("*.py")}


def test_every_file_has_a_row_and_a_column_in_the_map():
    placed = _map()
    files = _files()
    assert sorted(files - placed.keys()) == [], "files missing from docs/concepts.md's map"
    assert sorted(placed.keys() - files) == [], "the map lists files that do not exist"
    bad = {f: rc for f, rc in placed.items() if rc[0] not in ROWS or rc[1] not in COLUMNS}
    assert bad == {}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_bench_is_a_leaf():
    offenders = []
    for path in (SRC / "paraprop").rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("paraprop/bench/") or rel == "paraprop/cli.py":
            continue
        if any(m == "paraprop.bench" or m.startswith("paraprop.bench.")
               for m in _imports(path)):
            offenders.append(rel)
    assert offenders == []


def test_the_map_is_read_from_the_page():
    # the parser above must see the table: a check that cannot fail would prove nothing
    placed = _map()
    assert placed["paraprop/solve.py"] == ("core", "nonlinear")
    assert placed["paraprop/bench/collect.py"] == ("tooling", "-")


def test_benchmarks_page_is_generated_from_stored_reports_and_notes():
    from paraprop.bench.collect import render

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    rendered = render(ROOT / "benchmarks" / "reports", ROOT / "benchmarks" / "notes")
    assert page == rendered, ("docs/benchmarks.md differs from `paraprop report`'s rendering: "
                              "edit benchmarks/notes/ or re-run the suite, not the page")
