"""The code in the README and the docs runs as written.

Every ```python block of README.md and docs/*.md runs, the blocks of one page in order in one
namespace that starts empty (a page imports what it uses); ```text blocks are not run. The
docstring examples of the package run as doctests (``--doctest-modules``, see conftest.py).
"""

import importlib.util
import linecache
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTIONAL = {"torchvision": "vision"}  # modules of pyproject.toml's extras, by extra


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_python_fence_is_found():
    for page in PAGES:
        fences = re.findall(r"^```python\s*$", page.read_text(), flags=re.M)
        assert len(_python_blocks(page)) == len(fences), page.name


@pytest.mark.filterwarnings("ignore::paraprop.multigrid.UncheckedResultWarning")  # documented
@pytest.mark.parametrize("page", [p for p in PAGES if _python_blocks(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(page, tmp_path, monkeypatch, capsys):
    code = "".join(_python_blocks(page))
    for module, extra in OPTIONAL.items():  # a page that imports an optional dependency
        imports = re.search(rf"^\s*(?:import [^\n#]*\b{module}\b|from {module}\b)", code, re.M)
        if imports and importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install 'paraprop[{extra}]')")
    # a page's files land in a scratch folder; a torchrun script runs as a world of one rank
    monkeypatch.chdir(tmp_path)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    namespace = {"__name__": "__docs__"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small examples: one thread is faster, and immune to a busy machine
    try:
        for i, code in enumerate(_python_blocks(page)):
            name = f"{page.name}, python block {i + 1}"
            linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # tracebacks
            exec(compile(code, name, "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
