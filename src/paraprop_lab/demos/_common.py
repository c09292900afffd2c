"""What the demo parts share: the model a part shows (the shipped checkpoint, or trained here)
and the ending of a part (its table, closing sentence and figures, printed and returned)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from paraprop_lab.demos import _weights
from paraprop_lab.experiments.plots import bar_plot
from paraprop_lab.experiments.report import markdown_table, text_table


def part_model(name: str, out_dir: Path, *, quick: bool, full: bool,
               train: Callable[[], tuple[Any, dict]]) -> tuple[Any, dict, bool]:
    """The model a part shows, ``(model, info, full)``: by default the shipped checkpoint
    ``name`` (:func:`paraprop_lab.demos._weights.load`, its description printed); with
    ``quick`` or ``full``, or where the checkpoint is missing here (then said so, and the part
    runs as ``--full``), ``train()`` (``(model, info)``; see :func:`frozen`). ``full``
    comes back as the part then runs (so ``quick or full``: trained here); ``info`` holds
    ``checkpoint``, ``trained_now`` and, for the shipped one, the ``command`` that made it.
    Creates ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (quick or full) and _weights.path(name) is None:
        print(f"{_weights.describe(name)}: missing here, so this part trains the --full "
              "model instead")
        full = True
    if quick or full:
        model, info = train()
        return model, info, full
    model = _weights.load(name)
    info = {"checkpoint": str(_weights.path(name)), "trained_now": False,
            "command": _weights.CHECKPOINTS[name]["command"]}
    print(_weights.describe(name))
    return model, info, False


def frozen(trained: tuple[Any, dict]) -> tuple[Any, dict]:
    """A training job's ``(model, info)`` with the model's gradients turned off (as the shipped
    checkpoints load)."""
    model, info = trained
    return model.requires_grad_(False), info


def part_result(title: str, rows: list[dict], columns: list[str], explained: tuple[str, str],
                plots: list[Path], *, heading: str | None = None, sample: str | None = None,
                **extra) -> dict:
    """The end of a part: prints ``heading`` (default ``title``), the table of ``columns``, the
    ``sample`` text where there is one and the closing sentence, and returns the part's result
    (:mod:`paraprop_lab.demos`), its section the table, the sample (a code block), the sentence
    and ``plots`` below it; ``extra`` entries (e.g. ``model``) join the result.

    Arguments:
        explained: the part's ``(why, headline)``, from its own ``explain(rows, ...)``.
    """
    why, headline = explained
    print(heading or title)
    print(text_table(rows, columns))
    md = markdown_table(rows, columns)
    if sample is not None:
        print("sample: " + repr(sample))
        md += "\n\n```\n" + sample + "\n```"
    print(why)
    md += "\n\n" + why + "".join(f"\n\n![]({Path(p).name})" for p in plots)
    return {"rows": rows, "sections": [(title, md)], "why": why, "headline": headline,
            "plots": list(plots), **extra}


def speedup_part(out_dir: Path, png: str, title: str, rows: list[dict], columns: list[str],
                 explained: tuple[str, str], *, plot_title: str, ylabel: str) -> dict:
    """:func:`part_result` for a part whose rows each have a ``method`` and a ``speedup`` over
    the baseline, with each method's speedup drawn as a bar (``out_dir / png``, titled
    ``plot_title``, y axis ``ylabel``)."""
    plot = bar_plot(out_dir / png, plot_title, [r["method"] for r in rows],
                    [r["speedup"] for r in rows], ylabel)
    return part_result(title, rows, columns, explained, [plot])
