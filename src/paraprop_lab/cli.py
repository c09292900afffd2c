"""The ``paraprop`` command: ``demo``, ``bench SUITE``, ``train JOB``, ``report``, ``info``.

A user error (an unknown suite or job, a bad option value, a missing or unreadable file or data
directory, an argument the library refuses) prints one line ``paraprop: error: MESSAGE`` to
stderr and exits with status 2, without a traceback; ``--debug`` shows the traceback instead.
Other exceptions are bugs and keep their traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import paraprop
from paraprop.errors import ConvergenceError, NonFiniteError
from paraprop.optim.errors import FusionError
from paraprop_lab import bench, demos, training
from paraprop_lab.experiments.harness import machine_info
from paraprop_lab.experiments.report import markdown_table, text_table, write_results
from paraprop_lab.training._common import check_out_dir, check_out_file

# Exceptions that report a user error (bad arguments, files or data): one line, exit status 2.
USER_ERRORS = (ValueError, TypeError, OSError, ConvergenceError, NonFiniteError, FusionError)


def _cmd_demo(args) -> int:
    out = _out_dir(args.out)
    t0 = time.perf_counter()
    sections, summary, headlines = [], {}, []
    for part in demos.parts():
        print(f"\n=== {part.TITLE} ===")
        name = part.__name__.rsplit(".", 1)[-1]
        missing = demos.missing_requirements(part)
        if missing:  # an optional extra is not installed: say so and go on
            why = f"skipped: needs {', '.join(missing)} (pip install 'paraprop[vision]')"
            print(why)
            headlines.append({"part": name, "headline": why, "plots": "(no plot)", "why": why})
            continue
        res = part.run(out, quick=args.quick)
        sections += res.get("sections", [])
        summary[name] = res.get("rows", [])
        headlines.append(demos.summary_row(name, res, out))
    sections.append(("Summary", markdown_table(headlines, demos.SUMMARY_COLUMNS)))
    payload = {"machine": machine_info(), "quick": args.quick, "parts": summary,
               "summary": headlines}
    js, md = write_results(out, "demo", payload, sections,
                           "paraprop demo" + (" --quick" if args.quick else ""))
    took = time.perf_counter() - t0
    print(f"\n=== Summary (plots in {out}/) ===")
    print(text_table(headlines, demos.SUMMARY_COLUMNS))
    print(f"\nDone in {took:.1f} s. Results: {md}, {js} and PNG plots in {out}/")
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
    print(f"{'suites':14s} {', '.join(bench.suites())}")
    return 0


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
    p = _Parser(prog="paraprop", description=paraprop.__doc__, epilog=_EPILOG)
    p.add_argument("--version", action="version", version=f"paraprop {paraprop.__version__}")
    p.add_argument("--debug", action="store_true",
                   help="on a user error, show the traceback instead of one line")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the main job: every capability on the embedded data")
    d.add_argument("--quick", action="store_true", help="fewer timing rounds (a smoke run)")
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
