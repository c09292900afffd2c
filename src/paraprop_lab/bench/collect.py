"""``paraprop report``: the page ``docs/benchmarks.md``, generated and nothing but generated.

Two inputs, both kept in the repository:

- ``benchmarks/reports/SUITE.md``: each suite's report exactly as ``paraprop bench SUITE`` wrote
  it (its command, date and machine, then its tables). ``paraprop report results`` first copies
  the reports of a fresh run from ``results/`` (and their PNGs into ``docs/img/``), replacing the
  stored ones of the same suites.
- ``benchmarks/notes/SUITE.md`` (optional): the words a person adds to a suite's figures: the
  conditions of the run, the targets met or missed and why. ``_intro.md`` goes under the page's
  introduction. A re-run replaces a report, never a note.

The page is then rendered from the stored reports (alphabetical order) and notes: each suite's
headings move one level down, its note follows its command and date lines, and its images point
into ``img/``. The reports of a GPU (``gpu.md``, from ``make gpu-check``, and ``SUITE_cuda.md``,
from ``paraprop bench SUITE --device cuda``) come last, one level further down, under a section
"On the GPU" that opens with the note ``_gpu.md`` (rendered even before a first GPU run, to say
where those figures come from: docs/gpu.md). A test renders the page again and compares: a hand
edit of the page itself fails it, so every word lives in a report or a note.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

INTRO = """# Benchmarks

Figures quoted in the README and the docs. Every table was produced by the command above it, on
the machine it names; ratios are medians of interleaved runs (A B A B ...) from the same run.
Regenerate with `paraprop bench SUITE --out results` for each suite, then
`paraprop report results`: it stores the new reports in `benchmarks/reports/` and writes this
page from them and the notes in `benchmarks/notes/` (do not edit the page itself). The figures
of a GPU come from `make gpu-check` ([gpu.md](gpu.md)) and close the page.
"""

REPORTS = Path("benchmarks/reports")
NOTES = Path("benchmarks/notes")
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)/]+\.png)\)")


def store(results: Path, reports: Path, img: Path, suites: list[str] | None = None) -> list[str]:
    """Copy ``results/SUITE.md`` (all found, or ``suites``) into ``reports`` and the PNGs they
    show into ``img``; returns the suites copied."""
    if not results.is_dir():
        raise ValueError(f"results directory {results} does not exist")
    names = suites or sorted(p.stem for p in results.glob("*.md") if p.stem != "demo")
    if not names:
        raise ValueError(f"no suite reports (*.md) in {results}")
    reports.mkdir(parents=True, exist_ok=True)
    img.mkdir(parents=True, exist_ok=True)
    for name in names:
        md = results / f"{name}.md"
        if not md.exists():
            raise ValueError(f"{md} not found (run paraprop bench {name} --out {results})")
        text = md.read_text()
        for png in _IMAGE.findall(text):
            if (results / png[1]).exists():
                shutil.copy(results / png[1], img / png[1])
        (reports / f"{name}.md").write_text(text)
    return names


def _split_header(text: str) -> tuple[list[str], str]:
    """A report's generated command and date lines, and the rest (from its first heading on)."""
    lines = text.strip("\n").split("\n")
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    head: list[str] = []
    while lines and (not lines[0].strip() or lines[0].startswith(("Command: `", "Date: "))):
        line = lines.pop(0)
        if line.strip():
            head.append(line)
    return head, "\n".join(lines)


def is_gpu(name: str) -> bool:
    """Whether a stored report holds GPU figures: ``gpu`` (``make gpu-check``), ``gpu_WHAT``
    (another run of the check kept beside it, e.g. a rerun of some rows: stored under that
    name) or ``SUITE_cuda`` (``paraprop bench SUITE --device cuda``)."""
    return name == "gpu" or name.startswith("gpu_") or name.endswith("_cuda")


def _section(name: str, reports: Path, notes: Path, level: int) -> str:
    """One stored report as a section at heading ``level`` (its own headings below it)."""
    head, body = _split_header((reports / f"{name}.md").read_text())
    body = re.sub(r"^(#+) ", lambda m: "#" * (level - 1) + m.group(1) + " ", body, flags=re.M)
    body = _IMAGE.sub(r"![\1](img/\2)", body)
    section = ["#" * level + f" {name}", ""]
    if head:
        section += [*head, ""]
    note = notes / f"{name}.md"
    if note.exists():
        section += [note.read_text().strip("\n"), ""]
    section.append(body.strip("\n"))
    return "\n".join(section) + "\n"


def render(reports: Path, notes: Path) -> str:
    """The page from the stored reports and notes."""
    names = sorted(p.stem for p in reports.glob("*.md"))
    if not names:
        raise ValueError(f"no stored suite reports (*.md) in {reports}")
    parts = [INTRO]
    intro = notes / "_intro.md"
    if intro.exists():
        parts.append(intro.read_text().strip("\n") + "\n")
    parts += [_section(n, reports, notes, 2) for n in names if not is_gpu(n)]
    gpus = [n for n in names if is_gpu(n)]
    gpu_note = notes / "_gpu.md"
    if gpus or gpu_note.exists():
        text = gpu_note.read_text().strip("\n") if gpu_note.exists() else ""
        parts.append("## On the GPU\n" + (f"\n{text}\n" if text else ""))
        parts += [_section(n, reports, notes, 3) for n in gpus]
    return "\n".join(parts)


def collect(results: Path | None, out: Path, suites: list[str] | None = None, *,
            reports: Path = REPORTS, notes: Path = NOTES) -> Path:
    """Store the fresh reports of ``results`` (if given), then write the page ``out``."""
    if results is not None:
        store(results, reports, out.parent / "img", suites)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(reports, notes))
    return out
