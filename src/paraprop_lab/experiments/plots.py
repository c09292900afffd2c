"""Plots shared by suites and the demo (matplotlib, headless)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def save_figure(fig, path: Path, *, dpi: int = 110) -> Path:
    """Lay out ``fig``, write it to ``path`` (parents created), close it; return ``path``.

    The saved area is the drawn one (``bbox_inches="tight"``), so a long title, a suptitle or
    a label sticking out of the figure is never clipped."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight", pad_inches=0.12)
    plt.close(fig)
    return path


# What each curve of convergence_plot measures, in words (panel title, y-axis label).
_CONVERGENCE_PANELS = {
    "forward difference": ("change from the previous iteration",
                           "largest change of any value (max abs)"),
    "true error": ("distance to the sequential result",
                   "largest difference from sequential (max abs)"),
}


def log_iterations_axis(ax, last: int) -> None:
    """An x axis of iterations 1..``last`` on a log scale, ticked at whole numbers (1, 2, 5,
    10, 20, 50, ...), so that a method that stops after 5 iterations and one that runs 300 are
    both readable."""
    ax.set_xscale("log")
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
             if t * 1.5 <= last or t == last]
    if ticks[-1] < last:
        ticks.append(last)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlim(0.8, max(last, 2) * 1.25)


def convergence_plot(path: Path, title: str, curves: dict[str, dict[str, list[float]]],
                     tol: float | None = None) -> Path:
    """Forward difference and true error per iteration (Song et al. 2021, Fig. 1 style).

    Where one method runs far longer than another (GS-Jacobi's hundreds of sweeps, block by
    block, beside Jacobi's twenty), iterations are on a log axis, so that every method is
    visible; a method with many iterations is a thin line drawn under the others, and each
    method's last iteration is circled. Both panels have their own tick labels.

    Arguments:
        path: the PNG to write.
        title: figure title.
        curves: method -> {"forward difference": [...], "true error": [...]}.
        tol: drawn as a horizontal line when given.
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    floor = 1e-17
    lengths = [len(s.get(k, [])) for s in curves.values() for k in _CONVERGENCE_PANELS
               if s.get(k)]
    last = max(lengths, default=1)
    log_x = last > 30 and last > 4 * min(lengths)  # a long run beside short ones
    for ax, key in zip(axes, ("forward difference", "true error"), strict=True):
        for i, (method, series) in enumerate(curves.items()):
            ys = [max(v, floor) for v in series.get(key, [])]
            if not ys:
                continue
            many = len(ys) > 40
            xs = range(1, len(ys) + 1)
            ax.plot(xs, ys, color=f"C{i}", lw=0.9 if many else 1.6,
                    marker=None if many else ".", alpha=0.75 if many else 1.0,
                    zorder=2 if many else 3, label=method)
            ax.plot([len(ys)], [ys[-1]], marker="o", ms=6, mfc="none", color=f"C{i}", zorder=4)
        ax.set_yscale("log")
        if tol is not None:
            ax.axhline(tol, color="grey", ls="--", lw=0.8, label=f"stopping tolerance {tol:g}")
        if log_x:
            ax.set_xlabel("parallel iteration (sweep), log scale")
            log_iterations_axis(ax, last)
        else:
            ax.set_xlabel("parallel iteration (sweep)")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(_CONVERGENCE_PANELS[key][0], fontsize=10)
        ax.set_ylabel(_CONVERGENCE_PANELS[key][1] + f"\n(exact zero drawn at {floor:g})",
                      fontsize=9)
        ax.tick_params(labelleft=True)
        ax.grid(True, which="major", alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 110), fontsize=11)
    return save_figure(fig, path, dpi=110)


def bar_plot(path: Path, title: str, labels: list[str], values: list[float], ylabel: str,
             *, suffix: str = "x") -> Path:
    """A bar chart of several methods' values (e.g. speedups; 1 is marked), each bar labelled
    with its value and ``suffix``, long method names wrapped."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(labels)), 3.8))
    ax.bar(range(len(labels)), values, color="tab:blue")
    ax.axhline(1.0, color="grey", lw=0.8)
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.3g}{suffix}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)),
                  [textwrap.fill(x, 16, break_long_words=False) for x in labels], fontsize=8)
    ax.set_ylabel(textwrap.fill(ylabel, 40))
    ax.set_title(textwrap.fill(title, 90), fontsize=10)
    return save_figure(fig, path, dpi=110)


def time_bars(path: Path, title: str, groups: list[tuple[str, list[tuple[str, float, str]]]],
              xlabel: str = "wall time per call (ms, log scale)") -> Path:
    """Horizontal bars of wall times, one group per comparison (e.g. one flow library), each
    bar labelled with its value and a note (e.g. ``"2352 passes"``), on a log axis so that a
    74x difference stays readable.

    Arguments:
        groups: ``[(group label, [(bar label, milliseconds, note), ...]), ...]``.
    """
    bars = [(g, label, ms, note) for g, items in groups for label, ms, note in items]
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.55 * len(bars) + 0.3 * len(groups)))
    y, ticks, names = 0.0, [], []
    for gi, (group, items) in enumerate(groups):
        for bi, (label, ms, note) in enumerate(items):
            ax.barh(y, ms, color=f"C{bi}", height=0.7)
            shown = f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"
            ax.text(ms * 1.08, y, f"{shown} ms, {note}", va="center", fontsize=9)
            ticks.append(y)
            names.append(f"{group}:\n{label}" if group else textwrap.fill(label, 24))
            y += 1
        y += 0.6 if gi < len(groups) - 1 else 0
    ax.set_xscale("log")
    lo = min(b[2] for b in bars)
    hi = max(b[2] for b in bars)
    ax.set_xlim(lo / 2, hi * 12)
    ax.set_yticks(ticks, names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", which="major", alpha=0.3)
    ax.set_title(textwrap.fill(title, 90), fontsize=10)
    return save_figure(fig, path, dpi=110)
