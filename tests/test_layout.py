"""The layout as docs/concepts.md draws it: two top-level packages, the library ``paraprop`` and
its lab ``paraprop_lab``; every file placed in the map; the lab a leaf that the library never
imports (and, inside the lab, bench/ a leaf that nothing but the CLI imports); ``import
paraprop`` light."""

from __future__ import annotations

import ast
import re
import runpy
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGES = ("paraprop", "paraprop_lab")
ROWS = {"core", "adapter", "training", "tooling"}
COLUMNS = {"nonlinear", "linear", "both", "-"}


def _map() -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "concepts.md").read_text()
    section = text.split("### Every file", 1)[1].split("\n## ", 1)[0]
    return {m[0]: (m[1], m[2]) for m in
            re.findall(r"^\| `((?:paraprop|paraprop_lab)/[^`]+\.py)` \| (\w+) \| ([\w-]+) \|",
                       section, re.M)}


def _files() -> set[str]:
    return {p.relative_to(SRC).as_posix() for pkg in PACKAGES for p in (SRC / pkg).rglob("*.py")}


def test_every_file_has_a_row_and_a_column_in_the_map():
    placed = _map()
    files = _files()
    assert sorted(files - placed.keys()) == [], "files missing from docs/concepts.md's map"
    assert sorted(placed.keys() - files) == [], "the map lists files that do not exist"
    bad = {f: rc for f, rc in placed.items() if rc[0] not in ROWS or rc[1] not in COLUMNS}
    assert bad == {}


def _imports(source: str) -> set[str]:
    """Every module ``source`` imports: ``import`` / ``from`` statements (with the names a
    ``from`` imports, which may be modules) and ``importlib.import_module`` / ``__import__``
    of a string constant."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) in ("import_module", "__import__"))):
            out.add(node.args[0].value)
    return out


def _lab_imports(source: str) -> set[str]:
    return {m for m in _imports(source) if m == "paraprop_lab" or m.startswith("paraprop_lab.")}


def test_the_library_never_imports_the_lab():
    offenders = {}
    for path in sorted((SRC / "paraprop").rglob("*.py")):
        found = _lab_imports(path.read_text())
        if found:
            offenders[path.relative_to(SRC).as_posix()] = sorted(found)
    assert offenders == {}, "the library imports the lab (move the piece down into paraprop)"


def test_the_lab_import_check_sees_every_form():
    # the check above must be able to fail: a check that cannot fail would prove nothing
    source = ("import paraprop_lab\n"
              "from paraprop_lab.bench import collect\n"
              "def f():\n"
              "    from paraprop_lab import cli\n"
              "    import importlib\n"
              "    importlib.import_module('paraprop_lab.training')\n"
              "    __import__('paraprop_lab.demos')\n"
              "import paraprop_labels\n")
    assert _lab_imports(source) == {"paraprop_lab", "paraprop_lab.bench",
                                    "paraprop_lab.bench.collect", "paraprop_lab.cli",
                                    "paraprop_lab.training", "paraprop_lab.demos"}
    assert _lab_imports("import paraprop\nfrom paraprop.models import MADE\n") == set()


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(SRC).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _library_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """``module -> the library modules it imports`` (anywhere in it, functions too), for the
    modules ``sources`` (name -> source): ``from P import x`` is an import of ``P.x`` where that
    is a module of ``sources``, else of ``P`` (a name of its ``__init__``)."""
    graph = {}
    for name, source in sources.items():
        out = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                # (the library imports absolutely: a relative import fails the test below)
                module = "." * node.level + (node.module or "")
                for a in node.names:
                    full = f"{module}.{a.name}"
                    out.add(full if full in sources else module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[name] = {m for m in out if m in sources and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order), or ``[]``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str]:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return []

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


def _library_sources() -> dict[str, str]:
    return {_module_name(p): p.read_text() for p in (SRC / "paraprop").rglob("*.py")}


def test_the_library_imports_run_one_way():
    """No import cycle among the library's modules, counting the imports inside functions (a
    cycle dodged by a late import is still one), and no core module imports an adapter (the map's
    rows; a package's ``__init__`` re-exports its modules and is exempt)."""
    sources = _library_sources()
    graph = _library_graph(sources)
    assert _cycle(graph) == [], "an import cycle in the library"
    relative = sorted(name for name, source in sources.items()
                      if any(isinstance(n, ast.ImportFrom) and n.level
                             for n in ast.walk(ast.parse(source))))
    assert relative == [], "relative imports (the library imports absolutely)"
    roles = {_module_name(SRC / f): rc[0] for f, rc in _map().items()}
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                    if roles.get(a) == "core" and roles.get(b) == "adapter"
                    and not (SRC / a.replace(".", "/") / "__init__.py").exists())
    assert upward == [], "core modules import adapters"


def test_the_import_direction_check_can_fail():
    # the checks above must be able to fail: a cycle through a late import is found, and a
    # from-import of a package's module counts as an import of that module
    sources = {"p": "", "p.a": "from p import b\n",
               "p.b": "def f():\n    from p.a import g\n", "p.c": "import p.a\n"}
    graph = _library_graph(sources)
    assert graph["p.a"] == {"p.b"} and graph["p.b"] == {"p.a"} and graph["p.c"] == {"p.a"}
    assert _cycle(graph) in (["p.a", "p.b", "p.a"], ["p.b", "p.a", "p.b"])
    assert _cycle({"p.a": {"p.b"}, "p.b": set()}) == []


def test_bench_is_a_leaf_of_the_lab():
    offenders = []
    for path in (SRC / "paraprop_lab").rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("paraprop_lab/bench/") or rel == "paraprop_lab/cli.py":
            continue
        if any(m == "paraprop_lab.bench" or m.startswith("paraprop_lab.bench.")
               for m in _imports(path.read_text())):
            offenders.append(rel)
    assert offenders == []


def test_import_paraprop_is_light():
    # what `import paraprop` adds to what `import torch` loads: paraprop and the standard
    # library, nothing else (no lab, no matplotlib, transformers, diffusers, ...)
    code = ("import sys; import torch; before = {m.split('.')[0] for m in sys.modules}; "
            "import paraprop; after = {m.split('.')[0] for m in sys.modules}; "
            "print(' '.join(sorted(after - before - set(sys.stdlib_module_names))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    added = set(out.stdout.split())
    assert added == {"paraprop"}
    assert not added & {"paraprop_lab", "matplotlib", "transformers", "diffusers"}


def test_the_lab_names_are_not_library_attributes():
    import paraprop

    for name in ("bench", "cli", "demos", "experiments", "training"):
        assert name not in paraprop.SUBPACKAGES
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(paraprop, name)


def test_the_command_is_the_labs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"paraprop": "paraprop_lab.cli:main"}
    find = project["tool"]["setuptools"]["packages"]["find"]
    assert {"paraprop", "paraprop_lab"} <= set(find["include"])
    module, _, attr = project["project"]["scripts"]["paraprop"].partition(":")
    __import__(module)
    assert callable(getattr(sys.modules[module], attr))


def test_python_dash_m_paraprop_lab_is_the_command(capsys, monkeypatch):
    import paraprop

    monkeypatch.setattr(sys, "argv", ["paraprop", "--version"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("paraprop_lab", run_name="__main__")
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"paraprop {paraprop.__version__}"


def test_the_map_is_read_from_the_page():
    # the parser above must see the table: a check that cannot fail would prove nothing
    placed = _map()
    assert placed["paraprop/solve.py"] == ("core", "nonlinear")
    assert placed["paraprop_lab/bench/collect.py"] == ("tooling", "-")


def test_benchmarks_page_is_generated_from_stored_reports_and_notes():
    from paraprop_lab.bench.collect import render

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    rendered = render(ROOT / "benchmarks" / "reports", ROOT / "benchmarks" / "notes")
    assert page == rendered, ("docs/benchmarks.md differs from `paraprop report`'s rendering: "
                              "edit benchmarks/notes/ or re-run the suite, not the page")
