"""Plots shared by suites and the demo (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: Path, *, dpi: int = 110) -> Path:
    """Lay out ``fig``, write it to ``path`` (parents created), close it; return ``path``."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


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
    for ax, key in zip(axes, ("forward difference", "true error"), strict=True):
        for method, series in curves.items():
            ys = [max(v, 1e-17) for v in series.get(key, [])]
            if ys:
                ax.semilogy(range(1, len(ys) + 1), ys, marker=".", label=method)
        if tol is not None:
            ax.axhline(tol, color="grey", ls="--", lw=0.8, label=f"tol={tol:g}")
        ax.set_xlabel("parallel iteration")
        ax.set_title(key)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("max |.| (floor 1e-17)")
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path, dpi=110)


def bar_plot(path: Path, title: str, labels: list[str], values: list[float], ylabel: str) -> Path:
    """A simple bar chart (e.g. speedups of several methods)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, values, color="tab:blue")
    ax.axhline(1.0, color="grey", lw=0.8)
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.2g}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return save_figure(fig, path, dpi=110)
