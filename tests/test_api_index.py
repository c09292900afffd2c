"""The API reference reads right: its index names what each package holds, every public class and
function shows a short example, and no reference page repeats its package's docstring.

- docs/reference/index.md has one row per package of ``paraprop.SUBPACKAGES``, and that row's
  one-line description names (in backticks) every public class the package exports (its
  ``__all__``; functions and constants may be summed up in words).
- Every public class and function of a reference page (a package's ``__all__``, and the
  ``__all__`` of the modules it exports) has an ``Example:`` section with doctest lines (they run
  under ``--doctest-modules``). ``NO_EXAMPLE_YET`` lists the names still without one; a name that
  gains an example must leave the list (the test fails on a stale entry).
- The prose of a reference page (its title and guide links) shares no run of ``RUN`` words with
  the docstring of the package it renders: the docstring is the page's introduction.
- The griffe extension (docs/_ext/griffe_house_style.py) hides dunders, ``__post_init__``, module
  constants, undocumented instance attributes and private bases from the rendered reference.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import types
from pathlib import Path

import pytest

import paraprop

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
RUN = 6  # words in a row that count as a repeated sentence
TARGET = re.compile(r"^:::\s+([\w.]+)\s*$", flags=re.M)

# public names of other packages' pages that have no ``Example:`` yet (nn, flows, decoding,
# diffusion: their docstrings belong to their packages' owners)
NO_EXAMPLE_YET = {
    "paraprop.decoding": {"choose", "process_logits"},
    "paraprop.diffusion": {"BatchVarianceWarning", "DiffusionChain", "StepTable", "draw_noise",
                           "step_table"},
    "paraprop.flows": {"Accelerated"},
    "paraprop.nn": {"AutogradBackward", "JacobiBackward", "ParallelForward", "ScanBackward",
                    "SequentialForward"},
}


def _index_rows() -> dict[str, str]:
    """``paraprop.<name>`` -> its row of docs/reference/index.md."""
    rows = {}
    for line in (REFERENCE / "index.md").read_text().splitlines():
        if m := re.match(r"^\|\s*\[`(paraprop(?:\.\w+)?)`\]\([^)]*\)\s*\|(.*)\|\s*$", line):
            rows[m.group(1)] = m.group(2)
    return rows


def _public_classes(module: types.ModuleType) -> list[str]:
    return [n for n in module.__all__ if inspect.isclass(getattr(module, n))]


@pytest.mark.parametrize("name", paraprop.SUBPACKAGES)
def test_index_row_names_every_public_class(name):
    package = f"paraprop.{name}"
    rows = _index_rows()
    assert package in rows, f"docs/reference/index.md has no row for `{package}`"
    named = set(re.findall(r"`(\w+)`", rows[package]))
    missing = [c for c in _public_classes(importlib.import_module(package)) if c not in named]
    assert not missing, (f"the index row of {package} does not name (in backticks) the public "
                         f"classes {missing}")


def test_index_rows_link_to_existing_pages():
    text = (REFERENCE / "index.md").read_text()
    for target in re.findall(r"\]\(([\w.]+\.md)(?:#[\w.-]*)?\)", text):
        assert (REFERENCE / target).exists(), target


def _documented_modules() -> list[str]:
    """The packages with a reference page, and the modules they export (rendered there too)."""
    out = []
    for page in sorted(REFERENCE.glob("*.md")):
        for target in TARGET.findall(page.read_text()):
            try:
                module = importlib.import_module(target)
            except ImportError:
                continue  # a function's own block (``::: paraprop.solve.solve``)
            if hasattr(module, "__all__") and target not in out:
                out.append(target)
    return out


def _callables(module_name: str) -> dict[str, object]:
    module = importlib.import_module(module_name)
    return {n: getattr(module, n) for n in module.__all__
            if inspect.isclass(getattr(module, n)) or inspect.isfunction(getattr(module, n))}


def _has_example(obj) -> bool:
    doc = obj.__doc__ or ""  # its own docstring (inspect.getdoc would read a base's)
    return bool(re.search(r"^\s*Examples?:\s*$", doc, flags=re.M)) and ">>>" in doc


@pytest.mark.parametrize("module_name", _documented_modules())
def test_every_public_class_and_function_has_an_example(module_name):
    known = NO_EXAMPLE_YET.get(module_name, set())
    names = _callables(module_name)
    missing = sorted(n for n, obj in names.items() if not _has_example(obj) and n not in known)
    assert not missing, f"{module_name}: public names without an 'Example:' section: {missing}"
    stale = sorted(n for n in known if n not in names or _has_example(names[n]))
    assert not stale, f"{module_name}: remove from NO_EXAMPLE_YET (they have one now): {stale}"


def _words(text: str) -> list[str]:
    text = re.sub(r":\w+:`~?([\w.]+)`", r"\1", text)           # Sphinx roles
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)        # Markdown links
    return re.findall(r"[a-z0-9]+", text.lower())


def _runs(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + RUN]) for i in range(len(words) - RUN + 1)}


def _prose(page: Path) -> str:
    """A page's text outside its ``:::`` blocks, anchors and headings."""
    lines, out, in_block = page.read_text().splitlines(), [], False
    for line in lines:
        if line.startswith(":::"):
            in_block = True
            continue
        if in_block and (line.startswith(" ") or not line.strip()):
            continue
        in_block = False
        if not line.startswith(("#", "[](){")):
            out.append(line)
    return "\n".join(out)


@pytest.mark.parametrize("page", sorted(REFERENCE.glob("*.md")), ids=lambda p: p.name)
def test_reference_page_does_not_repeat_its_docstring(page):
    prose = _runs(_words(_prose(page)))
    for target in TARGET.findall(page.read_text()):
        try:
            module = importlib.import_module(target)
        except ImportError:
            continue
        shared = prose & _runs(_words(module.__doc__ or ""))
        assert not shared, (f"{page.name} repeats {target}'s docstring: "
                            f"{' '.join(sorted(shared)[0])!r}...; the docstring is the page's "
                            f"introduction, the page keeps its title and guide links")


@pytest.mark.parametrize("page", sorted(REFERENCE.glob("*.md")), ids=lambda p: p.name)
def test_package_page_prose_is_its_guide_links(page):
    if page.name == "index.md" or not TARGET.search(page.read_text()):
        return  # the index and the lab's page are prose
    paragraphs = [p.strip() for p in _prose(page).split("\n\n") if p.strip()]
    extra = [p for p in paragraphs if not p.startswith("Guide:")]
    assert not extra, (f"{page.name}: the package's docstring introduces the page; keep only a "
                       f"'Guide: ...' line besides the title, not {extra[0][:80]!r}")


def test_index_says_how_to_serve_the_site_with_search():
    text = (REFERENCE / "index.md").read_text()
    assert "mkdocs serve" in text and "search" in text


# --- the griffe extension -----------------------------------------------------------------------

griffe = pytest.importorskip("griffe")


@pytest.fixture(scope="module")
def package():
    """paraprop as the reference reads it: loaded by griffe with the house extension."""
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import griffe_house_style
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    extensions = griffe.load_extensions(griffe_house_style.HouseStyle())
    return griffe.load("paraprop", search_paths=[ROOT / "src"], extensions=extensions,
                       resolve_aliases=True, resolve_external=False)


def test_extension_removes_constants_dunders_and_undocumented_attributes(package):
    multigrid = package["multigrid"]
    assert "DEFAULT_TOL" not in multigrid.members                # the package's alias
    assert "DEFAULT_TOL" not in multigrid.members["mgrit"].members  # the module's constant
    assert "FORWARD_TOL" not in package["nn"].members
    assert {"mgrit", "ParallelResidualStack", "CostModel"} <= set(multigrid.members)
    cost = multigrid["CostModel"]
    assert "__post_init__" not in cost.members and "forward_s" not in cost.members
    init = [p.name for p in cost["__init__"].parameters]      # the dataclass's signature stays
    assert init[:3] == ["self", "forward_s", "adjoint_s"]
    stepper = multigrid["AdjointStepper"]
    assert "blocks" not in stepper.members                      # undocumented instance attribute
    assert "parameter_grads" in stepper.members
    jacobi = package["solvers"]["Jacobi"]
    assert not any(n.startswith("__") and n != "__init__" for n in jacobi.members)  # __repr__
    assert "__init__" in package["multigrid"]["ParallelResidualStack"].members


def test_extension_reads_the_house_example_heading(package):
    doc = package["solvers"]["Jacobi"].docstring.value
    assert "Examples:" in doc and not re.search(r"^\s*Example:\s*$", doc, flags=re.M)


def test_class_template_leaves_out_private_bases():
    template = (ROOT / "docs/_ext/templates/python/material/class.html.jinja").read_text()
    assert '{% extends "_base/class.html.jinja" %}' in template
    assert 'startswith("_")' in template and "{% block bases scoped %}" in template
    config = (ROOT / "mkdocs.yml").read_text()
    assert "custom_templates: docs/_ext/templates" in config
