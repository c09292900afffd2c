"""The code in the README and the docs runs as written."""

import re
from pathlib import Path

import pytest
import torch

import paraprop

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/solve.md", "docs/recurrences.md"])
def test_examples_run(doc, capsys):
    blocks = _python_blocks(ROOT / doc)
    assert blocks, f"{doc} has no python example"
    for code in blocks[:1] if doc == "README.md" else blocks:
        exec(compile(code, doc, "exec"), {"torch": torch, "paraprop": paraprop})
