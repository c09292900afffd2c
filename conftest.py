"""Shared set-up for the docstring examples (``--doctest-modules`` over ``src/paraprop`` and
``src/paraprop_lab``).

Every docstring example runs with ``torch``, ``nn`` (``torch.nn``), ``F``
(``torch.nn.functional``) and ``paraprop`` already imported, on top of its own module's names,
and starts from ``torch.manual_seed(0)`` (so the outputs it shows are the outputs it gets) on
one PyTorch thread.
"""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from _pytest.doctest import DoctestItem

import paraprop

# Entry points that would run their work when imported (pytest already skips __main__.py files).
collect_ignore = ["src/paraprop/distributed/__main__.py"]

# Optional dependencies (extras in pyproject.toml). Without one, the docstring examples that import
# it are skipped, and so are the doctests of modules that import it at the top (those modules are
# not collected: importing them would fail). `make test-oldest` runs this way, with no torchvision.
OPTIONAL = {"torchvision": "vision"}
MISSING = sorted(m for m in OPTIONAL if importlib.util.find_spec(m) is None)
_SRC = Path(__file__).resolve().parent / "src"


def _imports(text: str, *, top_level: bool) -> list[str]:
    indent = "" if top_level else r"\s*"
    return [m for m in MISSING
            if re.search(rf"^{indent}(?:import [^\n#]*\b{m}\b|from {m}\b)", text, flags=re.M)]


def pytest_report_header(config):
    if MISSING:
        return [f"optional modules missing: {', '.join(MISSING)} (the doctests and tests that "
                "need them are skipped)"]


def pytest_ignore_collect(collection_path, config):
    path = Path(collection_path)
    if MISSING and path.suffix == ".py" and path.is_relative_to(_SRC):
        return bool(_imports(path.read_text(), top_level=True)) or None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if MISSING and isinstance(item, DoctestItem):
            needs = _imports("".join(e.source for e in item.dtest.examples), top_level=False)
            if needs:
                extra = OPTIONAL[needs[0]]
                item.add_marker(pytest.mark.skip(
                    reason=f"needs {needs[0]} (pip install 'paraprop[{extra}]')"))


@pytest.fixture(autouse=True)
def _docstring_examples(request):
    """Imports and a fixed seed for doctests; other tests are left exactly as they were."""
    if not isinstance(request.node, DoctestItem):
        yield
        return
    namespace = request.getfixturevalue("doctest_namespace")
    namespace.update(torch=torch, nn=torch.nn, F=torch.nn.functional, paraprop=paraprop)
    state, threads = torch.random.get_rng_state(), torch.get_num_threads()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny examples: one thread is faster, and immune to a busy machine
    yield
    torch.set_num_threads(threads)
    torch.random.set_rng_state(state)
