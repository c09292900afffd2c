"""Progress bars that read well in a terminal and in a log file.

On a terminal, :func:`progress` is a live tqdm bar that disappears when done. When the stream is
not a terminal (output piped or redirected to a file), a live bar would write a run of ``\\r``
updates; there the bar is replaced by a counter that writes one line when it is closed (or its
iterable is exhausted), e.g. ``demo made: 12/12 runs in 0.8 s``. Every progress bar of the
lab (timing harness, training jobs) goes through :func:`progress`; it sits above both so that the
training jobs import nothing of :mod:`paraprop_lab.experiments`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

from tqdm import tqdm


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class SummaryLine:
    """Stands in for a tqdm bar off a terminal: counts updates and, once closed, writes one
    line ``DESC: N/TOTAL UNIT in S s (POSTFIX)``. Supports the tqdm calls the package uses:
    iteration, ``update``, ``set_postfix``, ``set_description``, ``close`` and ``with``."""

    def __init__(self, iterable: Iterable | None, *, total: int | None, desc: str, unit: str,
                 file) -> None:
        self.iterable = iterable
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.total, self.desc, self.unit, self.file = total, desc, unit, file
        self.n = 0
        self.postfix = ""
        self.closed = False
        self._t0 = time.perf_counter()

    def __iter__(self):
        try:
            for item in self.iterable:  # type: ignore[union-attr]
                yield item
                self.n += 1
        finally:
            self.close()

    def __len__(self) -> int:
        return self.total or 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self) -> None:
        pass

    def line(self) -> str:
        """The summary line (without its newline)."""
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        took = time.perf_counter() - self._t0
        text = f"{self.desc + ': ' if self.desc else ''}{count} {self.unit} in {took:.1f} s"
        return text + (f" ({self.postfix})" if self.postfix else "")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        sys.stdout.flush()  # keep the line after what was printed before it in a shared log
        self.file.write(self.line() + "\n")
        self.file.flush()


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", disable: bool = False, file=None):
    """A progress bar over ``iterable`` (or updated by hand up to ``total``).

    Arguments:
        iterable: what to iterate over, or ``None`` for a bar advanced with ``update()``.
        total: the expected count (taken from ``len(iterable)`` when omitted).
        desc: the label, e.g. ``"train made"``.
        unit: what is counted, e.g. ``"runs"`` or ``"steps"``.
        disable: no bar and no line at all.
        file: the stream (default: standard error).

    Returns:
        A tqdm bar (removed when done) when ``file`` is a terminal; otherwise a
        :class:`SummaryLine` that writes one line when closed. Both support iteration,
        ``update``, ``set_postfix``, ``close`` and use as a context manager.
    """
    file = sys.stderr if file is None else file
    if disable:
        return tqdm(iterable, total=total, disable=True)
    if _is_terminal(file):
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, file=file)
    return SummaryLine(iterable, total=total, desc=desc, unit=unit, file=file)
