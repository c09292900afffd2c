"""What the timed demo parts share: the ending of a part that compares methods by speedup."""

from __future__ import annotations

from pathlib import Path

from paraprop_lab.experiments.plots import bar_plot
from paraprop_lab.experiments.report import markdown_table, text_table


def speedup_part(out_dir: Path, png: str, title: str, rows: list[dict], columns: list[str],
                 explained: tuple[str, str], *, plot_title: str, ylabel: str) -> dict:
    """The end of a part whose rows each have a ``method`` and a ``speedup`` over the baseline:
    prints ``title``, the table of ``columns`` and the closing sentence, draws each method's
    speedup as a bar (``out_dir / png``, titled ``plot_title``, y axis ``ylabel``) and returns the
    part's result (:mod:`paraprop_lab.demos`).

    Arguments:
        explained: the part's ``(why, headline)``, from its own ``explain(rows, ...)``.
    """
    why, headline = explained
    print(title)
    print(text_table(rows, columns))
    print(why)
    plot = bar_plot(out_dir / png, plot_title, [r["method"] for r in rows],
                    [r["speedup"] for r in rows], ylabel)
    md = markdown_table(rows, columns) + "\n\n" + why + f"\n\n![]({plot.name})"
    return {"rows": rows, "sections": [(title, md)], "why": why, "headline": headline,
            "plots": [plot]}
