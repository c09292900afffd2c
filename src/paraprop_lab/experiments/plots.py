"""Plots shared by suites and the demo (matplotlib, headless)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def save_figure(fig, path: Path, *, dpi: int = 110) -> Path:
    """Lay out ``fig``, write it to ``path`` (parents created), close it; return ``path``."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


# What each curve of convergence_plot measures, in words (panel title, y-axis label).
_CONVERGENCE_PANELS = {
    "forward difference": ("change from the previous iteration",
                           "largest change of any value (max abs)"),
    "true error": ("distance to the sequential result",
                   "largest difference from sequential (max abs)"),
}


def convergence_plot(path: Path, title: str, curves: dict[str, dict[str, list[float]]],
                     tol: float | None = None) -> Path:
    """Forward difference and true error per iteration (Song et al. 2021, Fig. 1 style).

    Arguments:
        path: the PNG to write.
        title: figure title.
        curves: method -> {"forward difference": [...], "true error": [...]}.
        tol: drawn as a horizontal line when given.
    """
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    floor = 1e-17
    for ax, key in zip(axes, ("forward difference", "true error"), strict=True):
        for method, series in curves.items():
            ys = [max(v, floor) for v in series.get(key, [])]
            if ys:
                ax.semilogy(range(1, len(ys) + 1), ys, marker=".", label=method)
        if tol is not None:
            ax.axhline(tol, color="grey", ls="--", lw=0.8, label=f"stopping tolerance {tol:g}")
        ax.set_xlabel("parallel iteration (sweep)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(_CONVERGENCE_PANELS[key][0])
        ax.set_ylabel(_CONVERGENCE_PANELS[key][1] + f"\n(exact zero drawn at {floor:g})")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
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
    ax.set_xticks(range(len(labels)), [textwrap.fill(x, 14) for x in labels], fontsize=8)
    ax.set_ylabel(textwrap.fill(ylabel, 40))
    ax.set_title(title, fontsize=10)
    return save_figure(fig, path, dpi=110)
