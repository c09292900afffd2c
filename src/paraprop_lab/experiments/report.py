"""Writing benchmark and demo results: ``NAME.json``, ``NAME.md`` (Markdown tables) and PNGs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

NA = "-"  # a cell with no value: not measured or not applicable (the table's note says which)


def fmt(v) -> str:
    """A table cell: short floats, ints as they are, ``-`` for no value (``None`` or missing)."""
    if v is None:
        return NA
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v == 0:
            return "0"
        if math.isnan(v) or math.isinf(v):
            return str(v)
        a = abs(v)
        if a >= 1e4 or a < 1e-3:
            return f"{v:.2e}"
        if a >= 100:
            return f"{v:.0f}"
        return f"{v:.3g}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def text_table(rows: list[dict], columns: list[str]) -> str:
    """A fixed-width table for the terminal: numbers right-aligned, text left-aligned."""
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    text = [any(isinstance(r.get(c), str) for r in rows) for c in columns]

    def line(values) -> str:
        return "  ".join(v.ljust(w) if t else v.rjust(w)
                         for v, w, t in zip(values, widths, text, strict=True)).rstrip()

    return "\n".join([line(columns), "  ".join("-" * w for w in widths),
                      *(line(row) for row in cells)])


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return v


def write_results(out_dir: Path, name: str, payload: dict, sections: list[tuple[str, str]],
                  command: str) -> tuple[Path, Path]:
    """Write ``out_dir/name.json`` (everything) and ``out_dir/name.md`` (the tables).

    Arguments:
        out_dir: the results directory (created if missing).
        name: file stem, e.g. the suite's name.
        payload: the full record (machine, settings, raw times, rows).
        sections: ``(heading, markdown)`` pairs for the Markdown report.
        command: the command line that produced the results.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / f"{name}.json"
    js.write_text(json.dumps(_jsonable({"command": command, **payload}), indent=2) + "\n")
    machine = payload.get("machine", {})
    lines = [
        f"# {name}",
        "",
        f"Command: `{command}`  ",
        f"Date: {machine.get('date', '?')}; machine: {machine.get('cpu_count', '?')} cores "
        f"({machine.get('processor', '?')}), torch {machine.get('torch', '?')}, "
        f"{machine.get('torch_threads', '?')} threads, {machine.get('device', '?')}.",
        "",
    ]
    for heading, md in sections:
        lines += [f"## {heading}", "", md, ""]
    md_path = out_dir / f"{name}.md"
    md_path.write_text("\n".join(lines))
    return js, md_path
