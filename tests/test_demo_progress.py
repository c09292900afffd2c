"""Progress off a terminal (``paraprop demo | cat``, a log file): running lines with the count,
the time so far and an estimate at least every few seconds, also during one long step; the
heartbeat for stretches no bar counts; the demo's thread choice under load. Fake clocks, never
wall time."""

from __future__ import annotations

import io
import re
import threading

import pytest

from paraprop_lab import progress as prog
from paraprop_lab.cli import demo_threads


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _bar(clock, total=10, **kw):
    out = io.StringIO()
    bar = prog.SummaryLine(None, total=total, desc="demo x", unit="runs", file=out,
                           interval=5.0, clock=clock, ticker=False, **kw)
    return bar, out


def test_running_lines_carry_count_elapsed_and_estimate():
    clock = Clock()
    bar, out = _bar(clock)
    clock.t += 3.0
    bar.update(2)                       # 3 s: under the interval, no line yet
    assert out.getvalue() == ""
    clock.t += 3.0
    bar.update(1)                       # 6 s, 3 of 10 done: 2 s per run, 7 runs left
    assert out.getvalue().splitlines() == ["demo x: 3/10 runs, 6.0 s so far, about 14 s left"]
    clock.t += 2.0
    bar.tick()                          # 2 s after the last line: nothing
    assert len(out.getvalue().splitlines()) == 1
    clock.t += 3.5
    bar.tick()                          # a long step keeps the count still: a line anyway
    assert out.getvalue().splitlines()[-1] == "demo x: 3/10 runs, 12 s so far, about 27 s left"
    bar.set_postfix(loss="0.1234")
    clock.t += 8.5
    bar.update(7)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[-2] == "demo x: 10/10 runs, 20 s so far (loss=0.1234)"   # done: no estimate
    assert lines[-1] == "demo x: 10/10 runs in 20.0 s (loss=0.1234)"
    bar.close()                         # closing twice writes nothing more
    clock.t += 60
    bar.tick()                          # nor does a tick after the end
    assert out.getvalue().splitlines() == lines


def test_no_gap_longer_than_the_interval_while_a_first_step_runs():
    clock = Clock()
    bar, out = _bar(clock, total=3)
    stamps = []
    for _ in range(100):                # 25 s in quarter seconds, the count never moving
        clock.t += 0.25
        before = len(out.getvalue().splitlines())
        bar.tick()
        if len(out.getvalue().splitlines()) > before:
            stamps.append(clock.t)
    assert out.getvalue().splitlines()[0] == ("demo x: 0/3 runs, 5.0 s so far, first one still "
                                              "running")
    gaps = [b - a for a, b in zip([100.0, *stamps], stamps, strict=False)]
    assert len(stamps) == 5 and max(gaps) <= 5.0


def test_without_a_total_the_line_has_no_estimate():
    clock = Clock()
    bar, out = _bar(clock, total=None)
    clock.t += 7
    bar.update(4)
    assert out.getvalue().splitlines() == ["demo x: 4 runs, 7.0 s so far"]


def test_iterating_counts_and_closes():
    clock = Clock()
    out = io.StringIO()
    for _ in prog.SummaryLine(range(4), total=None, desc="it", unit="steps", file=out,
                              clock=clock, ticker=False):
        clock.t += 2
    assert out.getvalue().splitlines() == ["it: 3/4 steps, 6.0 s so far, about 2.0 s left",
                                           "it: 4/4 steps in 8.0 s"]


def test_the_background_thread_writes_during_a_long_step(monkeypatch):
    monkeypatch.setattr(prog, "TICK", 0.01)
    clock = Clock()
    written = threading.Event()

    class Out(io.StringIO):
        def write(self, s):
            n = super().write(s)
            written.set()
            return n

    out = Out()
    bar = prog.SummaryLine(None, total=2, desc="long", unit="runs", file=out, clock=clock)
    clock.t += 6                        # the step has run 6 s; nobody calls update or tick
    assert written.wait(timeout=30), "the ticker thread wrote no line"
    bar.close()
    assert out.getvalue().splitlines()[0] == "long: 0/2 runs, 6.0 s so far, first one still running"


def test_heartbeat_writes_after_silence_only():
    clock = Clock()
    raw = io.StringIO()
    beat = prog.Heartbeat(raw, interval=10.0, clock=clock, ticker=False)
    out = beat.wrap()
    beat.start("[2/12] made")
    clock.t += 6
    out.write("a table\n")              # output resets the silence
    clock.t += 9
    beat.tick()
    assert raw.getvalue() == "a table\n"
    clock.t += 1.5
    beat.tick()                         # 10.5 s of silence
    assert raw.getvalue().splitlines()[-1] == "[2/12] made: still working, 16 s so far"
    clock.t += 5
    beat.tick()                         # its own line counts as output
    assert len(raw.getvalue().splitlines()) == 2
    beat.stop()
    clock.t += 100
    beat.tick()
    assert len(raw.getvalue().splitlines()) == 2
    assert out.isatty() is False
    beat.start("bar")
    out.write("\rlive bar 3/10")        # a terminal's live bar leaves the line open
    clock.t += 11
    beat.tick()
    assert raw.getvalue().endswith("\rlive bar 3/10\nbar: still working, 11 s so far\n")


def test_lines_to_sends_bars_to_the_stream_given(capsys):
    out = io.StringIO()
    with prog.lines_to(out):
        with prog.progress(total=2, desc="here", unit="runs") as bar:
            bar.update(2)
    assert re.fullmatch(r"here: 2/2 runs in \d+\.\d s\n", out.getvalue())
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("s, text", [(0.04, "0.0 s"), (8.46, "8.5 s"), (95.4, "95 s"),
                                     (125, "2 min 05 s"), (3600, "60 min 00 s")])
def test_seconds(s, text):
    assert prog.seconds(s) == text


@pytest.mark.parametrize("env, load, cores, current, want", [
    ({}, 0.2, 2, 2, 2),                  # quiet: all threads
    ({}, 1.3, 2, 2, 1),                  # one core taken by another job
    ({}, 6.5, 2, 2, 1),                  # heavily loaded: never below one
    ({"OMP_NUM_THREADS": "2"}, 6.5, 2, 2, 2),   # the user's explicit choice is kept
    ({}, None, 2, 2, 2),                 # no load average on this platform
    ({}, 2.0, 8, 8, 6),
])
def test_demo_threads(env, load, cores, current, want):
    n, note = demo_threads(env, load, cores, current)
    assert n == want
    assert (note == "") == (n == current)
    if note:
        assert f"load average {load:.1f} on {cores} cores" in note and f"with {n} thread" in note
