"""Progress bars that read well in a terminal and in a log file.

On a terminal, :func:`progress` is a live tqdm bar that disappears when done. When the stream is
not a terminal (output piped or redirected to a file), a live bar would write a run of ``\\r``
updates; there the bar is replaced by a :class:`SummaryLine`, which writes whole lines instead:
while it runs, a line at least every :data:`INTERVAL` seconds with the count, the time so far and
an estimate of the time left (``demo made: 5/12 runs, 6.1 s so far, about 8.5 s left``), also
while one long step keeps the count still (a background thread writes it), and one line when it
is closed or its iterable is exhausted (``demo made: 12/12 runs in 14.6 s``).

Every progress bar of the lab (timing harness, training jobs) goes through :func:`progress`; it
sits above both so that the training jobs import nothing of :mod:`paraprop_lab.experiments`.
The bars write to standard error unless :func:`lines_to` names another stream (``paraprop
demo`` sends them to standard output, so that ``paraprop demo | cat`` shows them in order with
the tables). :class:`Heartbeat` covers the stretches no bar counts: it writes a line when its
stream has been silent for :data:`INTERVAL` seconds.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from tqdm import tqdm

INTERVAL = 5.0        # seconds between the running lines of a bar off a terminal
TICK = 1.0            # seconds between the background thread's looks at the open bars
_default_file = None  # the stream of the bars when none is given (None: standard error)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def seconds(s: float) -> str:
    """``8.5 s``, ``95 s``, ``2 min 05 s``: a duration in words that a log reader scans."""
    if s < 10:
        return f"{s:.1f} s"
    if s < 100:
        return f"{s:.0f} s"
    m, r = divmod(int(round(s)), 60)
    return f"{m} min {r:02d} s"


class _Ticker:
    """One daemon thread that calls ``tick()`` on every open :class:`SummaryLine` (and
    :class:`Heartbeat`) every :data:`TICK` seconds, so that a step longer than the interval
    still gets its lines. It starts with the first one registered (a registration also wakes it
    at once) and stops when none is left."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: weakref.WeakSet = weakref.WeakSet()
        self._thread: threading.Thread | None = None
        self._poke = threading.Event()

    def add(self, item) -> None:
        with self._lock:
            self._items.add(item)
            if self._thread is None:  # the thread clears it, under this lock, as it ends
                self._thread = threading.Thread(target=self._loop, name="paraprop-progress",
                                                daemon=True)
                self._thread.start()
        self._poke.set()

    def remove(self, item) -> None:
        with self._lock:
            self._items.discard(item)

    def _loop(self) -> None:
        while True:
            self._poke.wait(TICK)
            self._poke.clear()
            with self._lock:
                items = list(self._items)
                if not items:
                    self._thread = None
                    return
            for item in items:
                try:
                    item.tick()
                except Exception:  # a closed stream must not kill the thread  # noqa: BLE001
                    pass


_ticker = _Ticker()


class SummaryLine:
    """Stands in for a tqdm bar off a terminal: counts updates, writes a running line every
    ``interval`` seconds (count, time so far, estimate) and, once closed, one final line
    ``DESC: N/TOTAL UNIT in S s (POSTFIX)``. Supports the tqdm calls the package uses:
    iteration, ``update``, ``set_postfix``, ``set_description``, ``close`` and ``with``.

    Arguments:
        iterable, total, desc, unit, file: as for :func:`progress`.
        interval: seconds between running lines (:data:`INTERVAL`).
        clock: the time source (``time.perf_counter``; tests pass a fake one).
        ticker: start the background thread that writes running lines during long steps
            (tests call :meth:`tick` themselves instead).
    """

    def __init__(self, iterable: Iterable | None, *, total: int | None, desc: str, unit: str,
                 file, interval: float = INTERVAL, clock: Callable[[], float] = time.perf_counter,
                 ticker: bool = True) -> None:
        self.iterable = iterable
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.total, self.desc, self.unit, self.file = total, desc, unit, file
        self.interval, self.clock = interval, clock
        self.n = 0
        self.postfix = ""
        self.closed = False
        self._lock = threading.Lock()
        self._t0 = clock()
        self._last_line = self._t0
        if ticker:
            _ticker.add(self)

    def __iter__(self):
        try:
            for item in self.iterable:  # type: ignore[union-attr]
                yield item
                self.update()
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
        self.tick()

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self) -> None:
        pass

    def elapsed(self) -> float:
        return self.clock() - self._t0

    def running_line(self) -> str:
        """The line written while it runs: ``DESC: N/TOTAL UNIT, S so far, about R left``
        (the estimate is the time so far per unit done, times the units left; before the
        first unit is done, or without a total, there is none)."""
        took = self.elapsed()
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        text = f"{self.desc + ': ' if self.desc else ''}{count} {self.unit}, {seconds(took)} so far"
        if self.total is not None and 0 < self.n < self.total:
            text += f", about {seconds(took / self.n * (self.total - self.n))} left"
        elif self.total is not None and self.n == 0:
            text += ", first one still running"
        return text + (f" ({self.postfix})" if self.postfix else "")

    def line(self) -> str:
        """The final line (without its newline)."""
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        text = f"{self.desc + ': ' if self.desc else ''}{count} {self.unit} in " \
               f"{self.elapsed():.1f} s"
        return text + (f" ({self.postfix})" if self.postfix else "")

    def tick(self) -> None:
        """Write the running line if ``interval`` seconds passed since the last line."""
        with self._lock:
            if self.closed or self.clock() - self._last_line < self.interval:
                return
            self._write(self.running_line())

    def _write(self, text: str) -> None:
        self._last_line = self.clock()
        if self.file is not sys.stdout:
            sys.stdout.flush()  # keep the line after what was printed before it in a shared log
        self.file.write(text + "\n")
        self.file.flush()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._write(self.line())
        _ticker.remove(self)


class Heartbeat:
    """Writes ``PREFIX: still working, S so far`` to ``file`` whenever nothing was written
    to it for ``interval`` seconds, between :meth:`start` and :meth:`stop` (or inside
    ``with``); ``label`` can change on the way (``heartbeat.label = "part 3 of 12"``).

    It watches the stream through :meth:`wrap`: the returned object writes through to
    ``file`` and records when it last did (the caller installs it, e.g. as ``sys.stdout``).

    Arguments:
        file: the stream to watch and write to.
        interval: seconds of silence before a line.
        clock: the time source (tests pass a fake one).
        ticker: start the background thread (tests call :meth:`tick` themselves).
    """

    def __init__(self, file, *, interval: float = 2 * INTERVAL,
                 clock: Callable[[], float] = time.perf_counter, ticker: bool = True) -> None:
        self.file, self.interval, self.clock = file, interval, clock
        self.label = ""
        self.at_line_start = True  # the last write ended a line (a live bar's does not)
        self.last_write = clock()
        self._since = clock()
        self._ticker = ticker
        self._on = False
        self._lock = threading.Lock()

    def wrap(self):
        return _Stamped(self)

    def start(self, label: str = "") -> None:
        """Start watching; ``label`` names what is running (the time counts from here)."""
        self.label = label
        self._since = self.last_write = self.clock()
        self._on = True
        if self._ticker:
            _ticker.add(self)

    def stop(self) -> None:
        self._on = False
        _ticker.remove(self)

    def __enter__(self):
        self.start(self.label)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def tick(self) -> None:
        with self._lock:
            now = self.clock()
            if not self._on or now - self.last_write < self.interval:
                return
            self.file.write(("" if self.at_line_start else "\n")
                            + f"{self.label + ': ' if self.label else ''}still working, "
                            f"{seconds(now - self._since)} so far\n")
            self.at_line_start = True
            self.file.flush()
            self.last_write = now


class _Stamped:
    """A stream that writes through to its heartbeat's file and stamps each write."""

    def __init__(self, beat: Heartbeat) -> None:
        self._beat = beat

    def write(self, s: str) -> int:
        with self._beat._lock:
            n = self._beat.file.write(s)
            if s:
                self._beat.last_write = self._beat.clock()
                self._beat.at_line_start = s.endswith("\n")
            return n

    def flush(self) -> None:
        self._beat.file.flush()

    def isatty(self) -> bool:
        return _is_terminal(self._beat.file)

    def __getattr__(self, name):
        return getattr(self._beat.file, name)


@contextlib.contextmanager
def lines_to(file):
    """Within the block, bars without a ``file`` write to ``file`` (default: standard error)."""
    global _default_file
    before, _default_file = _default_file, file
    try:
        yield file
    finally:
        _default_file = before


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", disable: bool = False, file=None):
    """A progress bar over ``iterable`` (or updated by hand up to ``total``).

    Arguments:
        iterable: what to iterate over, or ``None`` for a bar advanced with ``update()``.
        total: the expected count (taken from ``len(iterable)`` when omitted).
        desc: the label, e.g. ``"train made"``.
        unit: what is counted, e.g. ``"runs"`` or ``"steps"``.
        disable: no bar and no line at all.
        file: the stream (default: the one :func:`lines_to` set, else standard error).

    Returns:
        A tqdm bar (removed when done) when ``file`` is a terminal; otherwise a
        :class:`SummaryLine` that writes a running line every :data:`INTERVAL` seconds and one
        line when closed. Both support iteration, ``update``, ``set_postfix``, ``close`` and use
        as a context manager.
    """
    if file is None:
        file = sys.stderr if _default_file is None else _default_file
    if disable:
        return tqdm(iterable, total=total, disable=True)
    if _is_terminal(file):
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, file=file)
    return SummaryLine(iterable, total=total, desc=desc, unit=unit, file=file)
