"""The ``paraprop`` command: ``demo``, ``bench SUITE``, ``info``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import paraprop
from paraprop import bench, demos, training
from paraprop.bench.harness import machine_info
from paraprop.bench.report import write_results


def _cmd_demo(args) -> int:
    out = Path(args.out)
    t0 = time.perf_counter()
    sections, summary = [], {}
    for part in demos.parts():
        print(f"\n=== {part.TITLE} ===")
        res = part.run(out, quick=args.quick)
        sections += res.get("sections", [])
        summary[part.__name__.rsplit(".", 1)[-1]] = res.get("rows", [])
    payload = {"machine": machine_info(), "quick": args.quick, "parts": summary}
    js, md = write_results(out, "demo", payload, sections,
                           "paraprop demo" + (" --quick" if args.quick else ""))
    took = time.perf_counter() - t0
    print(f"\nDone in {took:.1f} s. Results: {md}, {js} and PNG plots in {out}/")
    return 0


def _cmd_bench(args) -> int:
    if args.suite is None or args.suite == "list":
        for name, desc in bench.suites().items():
            print(f"{name:12s} {desc}")
        return 0
    try:
        suite = bench.load(args.suite)
    except ValueError as e:
        print(f"paraprop bench: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    suite.run(out, quick=args.quick, repeats=args.repeats)
    print(f"\nResults: {out}/{args.suite}.json, {out}/{args.suite}.md and PNG plots in {out}/")
    return 0


def _cmd_report(args) -> int:
    from paraprop.bench.collect import collect

    try:
        out = collect(Path(args.results), Path(args.out), args.suites)
    except ValueError as e:
        print(f"paraprop report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _cmd_info(args) -> int:
    info = machine_info()
    print(f"paraprop {paraprop.__version__}")
    for k, v in info.items():
        print(f"{k:14s} {v}")
    print(f"{'interop':14s} {torch.get_num_interop_threads()} threads")
    print(f"{'suites':14s} {', '.join(bench.suites())}")
    return 0


def _guarded(run):
    """A training job whose data cannot be read exits 2 with the reason, not a traceback."""
    from paraprop.data import IDXError

    def wrapped(args) -> int:
        try:
            return run(args)
        except IDXError as e:
            print(f"paraprop train: {e}", file=sys.stderr)
            return 2

    return wrapped


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paraprop", description=paraprop.__doc__)
    p.add_argument("--version", action="version", version=f"paraprop {paraprop.__version__}")
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
    b.set_defaults(func=_cmd_bench)

    t = sub.add_parser("train", help="train a model used by the demos and benchmarks")
    jobs = t.add_subparsers(dest="job", required=True)
    for name, job in training.jobs().items():
        jp = jobs.add_parser(name, help=getattr(job, "HELP", ""))
        job.add_arguments(jp)
        jp.set_defaults(func=_guarded(job.run))

    r = sub.add_parser("report", help="collect suites' Markdown results into one page")
    r.add_argument("results", help="results directory (NAME.md and PNG plots)")
    r.add_argument("--out", default="docs/benchmarks.md", help="the page to write")
    r.add_argument("--suites", nargs="*", default=None, help="suite names, in order")
    r.set_defaults(func=_cmd_report)

    i = sub.add_parser("info", help="versions, threads, device")
    i.set_defaults(func=_cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "repeats", None) is not None and args.repeats < 1:
        print(f"paraprop: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
