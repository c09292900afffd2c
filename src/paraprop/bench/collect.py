"""Collect the Markdown reports of several suites into one page (``docs/benchmarks.md``).

Each suite's ``NAME.md`` already carries its command, date and machine; the page keeps them,
shifts the headings one level down, and copies the referenced PNGs next to the page (``img/``).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

INTRO = """# Benchmarks

Figures quoted in the README and the docs. Every table was produced by the command above it, on
the machine it names; ratios are medians of interleaved runs (A B A B ...) from the same run.
Regenerate with `paraprop bench SUITE --out results` for each suite, then
`paraprop report results --out docs/benchmarks.md`.
"""


def collect(results: Path, out: Path, suites: list[str] | None = None) -> Path:
    """Write ``out`` from ``results/SUITE.md`` (all suites found, or ``suites`` in order)."""
    if not results.is_dir():
        raise ValueError(f"results directory {results} does not exist")
    names = suites or sorted(p.stem for p in results.glob("*.md") if p.stem != "demo")
    if not names:
        raise ValueError(f"no suite reports (*.md) in {results}")
    img = out.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    parts = [INTRO]
    for name in names:
        md = results / f"{name}.md"
        if not md.exists():
            raise ValueError(f"{md} not found (run paraprop bench {name} --out {results})")
        text = md.read_text()
        for png in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text):
            if (results / png).exists():
                shutil.copy(results / png, img / Path(png).name)
        text = re.sub(r"!\[([^\]]*)\]\(([^)/]+\.png)\)", r"![\1](img/\2)", text)
        text = re.sub(r"^(#+) ", r"#\1 ", text, flags=re.M)
        parts.append(text.strip() + "\n")
    out.write_text("\n".join(parts))
    return out
