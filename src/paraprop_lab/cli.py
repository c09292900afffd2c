"""The ``paraprop`` command: ``demo``, ``bench SUITE``, ``train JOB``, ``report``, ``info``.

A user error (an unknown suite or job, a bad option value, a missing or unreadable file or data
directory, an argument the library refuses) prints one line ``paraprop: error: MESSAGE`` to
stderr and exits with status 2, without a traceback; ``--debug`` shows the traceback instead.
Other exceptions are bugs and keep their traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from pathlib import Path

import torch

import paraprop
from paraprop.errors import ConvergenceError, NonFiniteError
from paraprop.optim.errors import FusionError
from paraprop_lab import bench, demos, training
from paraprop_lab.experiments.harness import machine_info, threads
from paraprop_lab.experiments.report import markdown_table, text_table, write_results
from paraprop_lab.progress import Heartbeat, lines_to, seconds
from paraprop_lab.training._common import check_out_dir, check_out_file

# Exceptions that report a user error (bad arguments, files or data): one line, exit status 2.
USER_ERRORS = (ValueError, TypeError, OSError, ConvergenceError, NonFiniteError, FusionError)


def _cmd_demo(args) -> int:
    if args.quick and args.full:
        raise ValueError("--quick and --full exclude each other: --quick is a smoke run at tiny "
                         "sizes, --full the long version that trains every model")
    mode = "quick" if args.quick else "full" if args.full else "default"
    out = _out_dir(args.out)
    parts = demos.parts()
    n, note = demo_threads(os.environ, _load_average(), os.cpu_count() or 1,
                           torch.get_num_threads())
    beat = Heartbeat(sys.stdout)
    with contextlib.redirect_stdout(beat.wrap()), threads(n):
        with lines_to(sys.stdout), beat:
            return _demo_parts(parts, mode, out, beat, note)


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on this platform
        return None


def demo_threads(environ, load: float | None, cores: int, current: int) -> tuple[int, str]:
    """The intra-op threads the demo times with, and a note when it takes fewer than
    ``current``: one per core that other jobs leave free (by the 1-minute load average), at
    least one. Under load a multi-threaded kernel waits at every parallel region for a thread
    that another job has descheduled, so 2-thread timings of small operators stall by 10-50x on
    2 busy cores; the baseline and the method always run with the same threads. An explicit
    ``OMP_NUM_THREADS`` is kept as it is.

    Example:
        >>> demo_threads({}, 3.2, 2, 2)[0], demo_threads({}, 0.1, 2, 2)
        (1, (2, ''))
    """
    if "OMP_NUM_THREADS" in environ or load is None or current <= 1:
        return current, ""
    free = max(1, min(current, int(cores - load + 0.5)))
    if free >= current:
        return current, ""
    return free, (f"Other jobs are running (load average {load:.1f} on {cores} cores), so the "
                  f"demo times with {free} thread{'s' if free > 1 else ''} instead of {current}: "
                  "threads that wait for a busy core stall every small operator, and the "
                  "baseline and the method share the same setting. OMP_NUM_THREADS=N overrides.")


def _demo_header(parts: list, mode: str, out: Path, note: str = "") -> float:
    """Print what the demo will do and how long it takes; returns the expected seconds."""
    expected = sum(demos.expected_seconds(p, mode) for p in parts)
    print(f"paraprop demo: {len(parts)} parts" + (
        f", about {seconds(expected)} (as measured on a 2-core CPU; this machine has "
        f"{os.cpu_count()} cores; longer while other jobs run)"
        if expected else "") + ".")
    if mode == "default":
        print("The models that take minutes to train are loaded from checkpoints shipped with "
              "paraprop; 'paraprop demo --full' trains them here instead (more than an hour).")
    elif mode == "full":
        print("--full: every model is trained here first, with progress lines; the parts also "
              "time larger sizes.")
    else:
        print("--quick: a smoke run at tiny sizes with barely trained models; its figures show "
              "nothing about speed.")
    print("Parts where paraprop wins on this CPU come first; where a method loses here, its part "
          "says why and where it wins instead.")
    print(f"Every part checks its result against the sequential computation. Results: "
          f"{out}/demo.md, demo.json and PNG plots.")
    if note:
        print(note)
    return expected


def _demo_parts(parts: list, mode: str, out: Path, beat: Heartbeat, note: str) -> int:
    t0 = time.perf_counter()
    expected = _demo_header(parts, mode, out, note)
    sections, summary, headlines = [], {}, []
    done_expected = 0.0
    for i, part in enumerate(parts, 1):
        name = part.__name__.rsplit(".", 1)[-1]
        print(f"\n=== [{i}/{len(parts)}] {part.TITLE} ===")
        beat.start(f"[{i}/{len(parts)}] {name}")
        t_part = time.perf_counter()
        missing = demos.missing_requirements(part)
        if missing:  # an optional extra is not installed: say so and go on
            why = demos.skip_note(missing)
            print(why)
            headlines.append({"part": name, "headline": why, "plots": "(no plot)", "why": why,
                              "seconds": 0.0})
        else:
            res = demos.run_part(part, out, mode)
            sections += res.get("sections", [])
            summary[name] = res.get("rows", [])
            headlines.append({**demos.summary_row(name, res, out),
                              "seconds": time.perf_counter() - t_part})
        took, total = time.perf_counter() - t_part, time.perf_counter() - t0
        done_expected += demos.expected_seconds(part, mode)
        left = sum(demos.expected_seconds(p, mode) for p in parts[i:])
        if left and done_expected:  # the rest, at the pace of the parts so far
            togo = f"; about {seconds(left * total / done_expected)} to go"
        else:
            togo = ""
        print(f"--- {name}: done in {seconds(took)} ({seconds(total)} so far{togo})")
    beat.start("summary")
    sections.append(("Summary", markdown_table(headlines, demos.SUMMARY_COLUMNS)))
    payload = {"machine": machine_info(), "mode": mode, "threads_note": note,
               "quick": mode == "quick", "expected_seconds": expected, "parts": summary,
               "summary": headlines}
    js, md = write_results(out, "demo", payload, sections,
                           "paraprop demo" + {"quick": " --quick", "full": " --full"}.get(mode, ""))
    took = time.perf_counter() - t0
    print(f"\n=== Summary (plots in {out}/) ===")
    print(text_table(headlines, demos.SUMMARY_COLUMNS))
    print(f"\nDone in {seconds(took)}. Results: {md}, {js} and PNG plots in {out}/")
    return 0


def _cmd_bench(args) -> int:
    if args.suite is None or args.suite == "list":
        for name, desc in bench.suites().items():
            print(f"{name:12s} {desc}")
        return 0
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    suite = bench.load(args.suite)
    out = _out_dir(args.out)
    kw = {} if args.device is None else {"device": args.device}
    suite.run(out, quick=args.quick, repeats=args.repeats, **kw)
    print(f"\nResults: {out}/ ({args.suite}*.json, .md and PNG plots)")
    return 0


def _cmd_report(args) -> int:
    from paraprop_lab.bench.collect import collect

    results = None if args.results is None else Path(args.results)
    check_out_file(args.out, example="benchmarks.md")
    out = collect(results, Path(args.out), args.suites, reports=Path(args.reports),
                  notes=Path(args.notes))
    print(f"wrote {out} (reports: {args.reports}, notes: {args.notes})")
    return 0


def _cmd_info(args) -> int:
    info = machine_info()
    print(f"paraprop {paraprop.__version__}")
    for k, v in info.items():
        print(f"{k:14s} {v}")
    print(f"{'interop':14s} {torch.get_num_interop_threads()} threads")
    from paraprop.scan import native
    print(f"{'native':14s} {native.status()} (the C scan kernels; PARAPROP_NATIVE=0 "
          "disables them)")
    print(f"{'triton':14s} {_triton_status()}")
    print(f"{'suites':14s} {', '.join(bench.suites())}")
    return 0


def _triton_status() -> str:
    """Whether the Triton kernels can run: a CUDA device and triton, or why not."""
    import importlib.metadata  # read, not imported: only the kernel modules import triton
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "not installed (the GPU kernels fall back to the torch algorithms)"
    where = ("a CUDA device" if torch.cuda.is_available() else
             "no CUDA device: the torch algorithms run (TRITON_INTERPRET=1 runs the kernels "
             "on the CPU, for tests)")
    return f"{version}, {where}"


def plain(text: str) -> str:
    """A docstring as terminal text: reST roles and literals without their markup
    (``:func:`paraprop.solve``` -> ``paraprop.solve``, ````x```` -> ``x``)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)


def _out_dir(out: str) -> Path:
    """The results directory, created and checked writable before any work (an unusable
    ``--out``, a file, a directory that cannot be created or written in, fails at once)."""
    return check_out_dir(out, what="the results directory")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``paraprop: error: MESSAGE (see 'PROG --help')``."""

    def error(self, message: str):
        self.exit(2, f"paraprop: error: {message} (see '{self.prog} --help')\n")


_EPILOG = ("Errors: a user error (an unknown suite or job, a bad option value, a missing or "
           "unreadable file or data directory, an argument the library refuses) prints one line "
           "'paraprop: error: MESSAGE' to stderr and exits with status 2; --debug shows its "
           "traceback instead. Any other exception is a bug and shows its traceback.")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="paraprop", description=plain(paraprop.__doc__), epilog=_EPILOG)
    p.add_argument("--version", action="version", version=f"paraprop {paraprop.__version__}")
    p.add_argument("--debug", action="store_true",
                   help="on a user error, show the traceback instead of one line")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the main job: every capability on the embedded data, in "
                                    "a few minutes")
    d.add_argument("--quick", action="store_true",
                   help="a smoke run: tiny sizes, barely trained models (for tests)")
    d.add_argument("--full", action="store_true",
                   help="the long version: train every model here (more than an hour on 2 "
                        "cores) instead of loading the shipped checkpoints, larger sizes")
    d.add_argument("--out", default="results", help="results directory (default: results)")
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser("bench", help="run a benchmark suite ('paraprop bench' lists them)")
    b.add_argument("suite", nargs="?", help="suite name, or 'list'")
    b.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    b.add_argument("--repeats", type=int, default=None, help="timed rounds per case")
    b.add_argument("--out", default="results", help="results directory (default: results)")
    b.add_argument("--device", default=None,
                   help="cpu (default), cuda or cuda:N: the device the suite runs on "
                        "(docs/gpu.md)")
    b.set_defaults(func=_cmd_bench)

    t = sub.add_parser("train", help="train a model used by the demos and benchmarks")
    jobs = t.add_subparsers(dest="job", required=True)
    for name, job in training.jobs().items():
        jp = jobs.add_parser(name, help=getattr(job, "HELP", ""))
        job.add_arguments(jp)
        jp.set_defaults(func=job.run)

    r = sub.add_parser("report", help="store suites' reports and write docs/benchmarks.md")
    r.add_argument("results", nargs="?", default=None,
                   help="a results directory (NAME.md and PNG plots) whose reports replace the "
                        "stored ones; omitted: re-render the page from what is stored")
    r.add_argument("--out", default="docs/benchmarks.md", help="the page to write")
    r.add_argument("--suites", nargs="*", default=None, help="suites to store (default: all)")
    r.add_argument("--reports", default="benchmarks/reports", help="the stored suite reports")
    r.add_argument("--notes", default="benchmarks/notes", help="the hand-written notes")
    r.set_defaults(func=_cmd_report)

    i = sub.add_parser("info", help="versions, threads, device")
    i.set_defaults(func=_cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Bad command lines exit through argparse (``SystemExit(2)``, one line on stderr); a user error
    raised while running (:data:`USER_ERRORS`) prints ``paraprop: error: MESSAGE`` and returns
    2, or propagates with ``--debug``.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"paraprop: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
