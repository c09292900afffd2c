"""``make gpu-check``: one prepared command for a short run on one GPU machine.

The machine this is built for (issue 28; docs/gpu.md) is lent rarely and briefly: no network,
Python 3.12 with torch 2.11 (CUDA), Triton and transformers but no diffusers / zuko / nflows /
normflows, a bare start every time, at most 8 result files brought back (2 folders deep at
most), 10 minutes per command. So the check installs nothing from the network and is one
command with a time budget (:data:`BUDGET_S`, under 8 minutes):

1. **wheels**: the pure-Python wheels carried in ``.gpu/wheels`` (``make gpu-wheels`` downloads
   them here) installed with ``pip --no-index --no-deps`` into a temporary folder put on the
   children's ``PYTHONPATH``, beside ``src`` (paraprop itself runs from the source tree); the
   MNIST files carried in ``.gpu/mnist`` become ``PARAPROP_MNIST_DIR``;
2. **environment report** (``env.txt``): card, driver, torch, CUDA, Triton, the packages;
3. **pytest -m gpu** (``pytest.log``): the ``cuda`` half of the ``device`` fixture's tests,
   with a time limit of its own;
4. **the device rows** (:mod:`paraprop_lab.bench.gpu`) in a child process that streams every record
   to ``rows.jsonl`` as it is measured: a row that crashes the process (a CUDA error poisons
   the context) or hangs is recorded as failed and a new child takes up the remaining rows,
   until the budget ends (the rows left are recorded as skipped, with the reason);
5. **report** (``gpu.json``, ``gpu.md``, ``gpu.png``): the tables in the format ``paraprop
   report`` stores, so the figures join docs/benchmarks.md; the last rows process writes it,
   or a process of its own if that one did not end well.

Everything the check prints also goes to ``gpu-check.log``: seven files in one folder. The
parent process never touches CUDA; ``--device cpu`` runs the same flow on the CPU at tiny
sizes (``make gpu-check DEVICE=cpu``; a test runs it so the script cannot rot between GPU
runs).

Usage: ``python -m paraprop_lab.bench.gpu_check [--device cuda] [--out DIR] ...`` (``--help``).
The subcommands ``env``, ``rows`` and ``report`` are the children the check starts.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]          # the repository (src/paraprop_lab/bench/..)
SRC = ROOT / "src"
BUDGET_S = 430.0            # the whole check: with a hung last row at most 470 s, under 8 minutes
PYTEST_S = 150.0            # pytest -m gpu at most
REPORT_S = 30.0             # kept for the report at the end
MAX_FILES = 8               # what the machine brings back: 8 files, 2 folders deep
FILES = ("gpu-check.log", "env.txt", "pytest.log", "rows.jsonl", "gpu.json", "gpu.md",
         "gpu.png")
# carried packages (``make gpu-wheels``) and what the check reports the versions of
PACKAGES = ("torch", "triton", "transformers", "diffusers", "zuko", "nflows", "normflows",
            "numpy", "scikit-learn", "matplotlib", "tqdm", "huggingface-hub", "safetensors",
            "importlib-metadata", "torchvision", "jax", "pytest", "pytest-xdist",
            "pytest-timeout", "hypothesis")
# the optional packages the rows and tests import (a failing import is reported, not hidden)
IMPORTS = ("triton", "transformers", "diffusers", "zuko", "nflows", "normflows", "torchvision")
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


# -- the parent: the whole flow ------------------------------------------------------------------
class Log:
    """Print and append to ``gpu-check.log`` (flushed line by line: a killed run keeps it)."""

    def __init__(self, path: Path):
        self.file = path.open("w", buffering=1)
        self.t0 = time.monotonic()

    def __call__(self, msg: str = "") -> None:
        stamp = f"[{time.monotonic() - self.t0:6.1f} s] " if msg else ""
        for line in (msg.splitlines() or [""]):
            print(stamp + line, flush=True)
            self.file.write(stamp + line + "\n")

    def raw(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.file.write(text)

    def close(self) -> None:
        self.file.close()


def _run(cmd: list[str], *, env: dict, log: Log, timeout: float, out: Path | None = None,
         cwd: Path = ROOT) -> tuple[int | None, str]:
    """Run ``cmd`` in a process group of its own, streaming its output into the log (and into
    ``out``); returns its exit status (``None`` if it ran past ``timeout`` seconds: then the
    whole group is killed) and the last lines it printed."""
    import selectors

    text: list[str] = []
    sink = out.open("w") if out is not None else None
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + max(1.0, timeout)
    killed = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.killpg(proc.pid, 9)
            killed = True
            break
        if not sel.select(timeout=min(left, 1.0)):
            continue
        data = os.read(fd, 65536)
        if not data:                              # end of output: the process is ending
            break
        chunk = data.decode(errors="replace")
        log.raw(chunk)
        if sink:
            sink.write(chunk)
        text = (text + [chunk])[-200:]
    sel.close()
    proc.stdout.close()
    proc.wait()
    if sink:
        sink.close()
    tail = "\n".join("".join(text).splitlines()[-40:])
    return (None if killed else proc.returncode), tail


def _child(*args: str) -> list[str]:
    return [sys.executable, "-m", "paraprop_lab.bench.gpu_check", *args]


def install_wheels(wheels: Path, site: Path, env: dict, log: Log) -> str:
    """``pip install --no-index --no-deps`` of the carried wheels into ``site``."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return f"no wheels in {wheels}: nothing installed"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
           *map(str, found)]
    code, tail = _run(cmd, env=env, log=log, timeout=120)
    names = ", ".join(p.name.split("-")[0] for p in found)
    if code != 0:
        return f"pip install of {len(found)} wheels FAILED (exit {code}): {tail.strip()[-300:]}"
    return f"installed {len(found)} carried wheels into {site}: {names}"


def pytest_command(extra: str | None, workers: int) -> list[str]:
    """``pytest -m gpu`` (or the selection in ``extra``), one line per result at the end.

    The GPU machine has plugins the project does not use; pytest-benchmark warns when xdist is
    active, and the suite's ``filterwarnings = error`` turned that warning into an internal error
    before any test ran (the first GPU run, 2026-11-28): it is blocked (``-p no:benchmark``;
    blocking a plugin that is not installed is a no-op)."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:benchmark",
           "-v", "-rfEs",
           "--tb=short", "--durations=15", "--timeout=120"]
    if workers > 0 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    return cmd + (shlex.split(extra) if extra else ["-m", "gpu"])


def _summary(text: str) -> str:
    """pytest's last summary line (``== 3 passed, 2 skipped in 4.1s ==``), or ``"-"``."""
    lines = [ln.strip("= \n") for ln in text.splitlines()
             if re.search(r"\b(passed|failed|skipped|error|deselected|no tests ran)\b", ln)
             and " in " in ln]
    return lines[-1] if lines else "-"


def _done_specs(jsonl: Path) -> tuple[set[str], str | None]:
    """The row specs finished in ``jsonl``, and the one started but not finished (if any)."""
    done, started = set(), None
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:     # a line cut off by a killed child
                continue
            if rec.get("event") == "start":
                started = rec["spec"]
            elif rec.get("event") == "end":
                done.add(rec["spec"])
                started = None
    return done, started


def _append(jsonl: Path, rec: dict) -> None:
    with jsonl.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def check(args) -> int:
    """The whole flow; returns 0 when every step ran and nothing failed, 1 otherwise (the
    files are written either way)."""
    t0 = time.monotonic()
    end = t0 + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        (out / name).unlink(missing_ok=True)
    log = Log(out / "gpu-check.log")
    scale = args.scale or ("gpu" if args.device.startswith("cuda") else "tiny")
    log(f"paraprop gpu-check: device {args.device}, scale {scale}, budget {args.budget:.0f} s, "
        f"out {out}")
    work = Path(tempfile.mkdtemp(prefix="paraprop-gpu-check-"))
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", MPLBACKEND="Agg", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")   # JAX must not take the GPU's memory
    path = [str(SRC), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    steps = {}

    log("== 1. carried wheels and data")
    site = work / "site"
    steps["wheels"] = install_wheels(Path(args.wheels), site, env, log)
    if site.is_dir():
        path.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(path)
    mnist = Path(args.mnist)
    if "PARAPROP_MNIST_DIR" not in env and mnist.is_dir() and any(mnist.iterdir()):
        env["PARAPROP_MNIST_DIR"] = str(mnist.resolve())
    steps["mnist"] = env.get("PARAPROP_MNIST_DIR", "not found: MNIST rows use the digits")
    log(f"{steps['wheels']}; MNIST: {steps['mnist']}")

    log("== 2. environment report")
    code, tail = _run(_child("env", "--device", args.device, "--out", str(out / "env.txt"),
                             "--json", str(work / "env.json"), "--steps", json.dumps(steps)),
                      env=env, log=log, timeout=60)
    ok = code == 0
    if not ok:
        log(f"environment report failed (exit {code}): the device is not usable; stopping")

    pytest = {"summary": "not run", "exit": None}
    if ok and not args.no_pytest:
        log("== 3. pytest")
        cmd = pytest_command(args.pytest_args, args.pytest_workers)
        limit = min(args.pytest_timeout, max(10.0, end - time.monotonic() - 60))
        t = time.monotonic()
        code, tail = _run(cmd, env=env, log=log, timeout=limit, out=out / "pytest.log")
        text = (out / "pytest.log").read_text()
        pytest = {"command": " ".join(cmd[2:]), "exit": code, "killed": code is None,
                  "seconds": time.monotonic() - t,
                  "summary": (_summary(text) if code is not None
                              else f"killed after {limit:.0f} s: {_summary(text)}")}
        log(f"pytest: {pytest['summary']} (exit {code})")
    (work / "pytest.json").write_text(json.dumps(pytest))

    jsonl = out / "rows.jsonl"
    report_args = ["--env", str(work / "env.json"), "--pytest", str(work / "pytest.json"),
                   "--out", str(out), "--command", args.command]
    reported = False
    only = ["--only", *args.only] if args.only else []
    if ok:
        log("== 4. device rows")
        while True:
            left = end - REPORT_S - time.monotonic()
            done, started = _done_specs(jsonl)
            if left < 20:
                break
            cmd = _child("rows", "--device", args.device, "--scale", scale, "--jsonl",
                         str(jsonl), "--seconds", f"{left - 15:.1f}", "--skip", *sorted(done),
                         *(["--repeats", str(args.repeats)] if args.repeats else []), *only,
                         "--report", *report_args)
            # the rows stop 15 s early (their own report), the process is killed 10 s late
            code, tail = _run(cmd, env=env, log=log, timeout=left + 10)
            done, started = _done_specs(jsonl)
            if code == 0:
                reported = True
                break
            why = "killed past its time" if code is None else f"exit {code}"
            if started is None:
                log(f"the rows process ended ({why}) outside a row; stopping")
                break
            suite, name = started.split(".", 1)
            _append(jsonl, {"kind": "row", "status": "failed", "suite": suite, "name": name,
                            "reason": f"the process ended in this row ({why}): "
                            + " | ".join(tail.strip().splitlines()[-3:])[-400:]})
            _append(jsonl, {"event": "end", "spec": started})
            log(f"row {started} ended its process ({why}); going on with a new one")

    if not reported:        # the last rows process did not get to write it
        log("== 5. report")
        code, tail = _run(_child("report", "--jsonl", str(jsonl), "--device", args.device,
                                 "--scale", scale, *report_args, *only), env=env, log=log,
                          timeout=REPORT_S + 30)
        reported = code == 0
    problems = limits(out)
    for p in problems:
        log(f"LIMIT: {p}")
    took = time.monotonic() - t0
    files = sorted(p for p in out.rglob("*") if p.is_file())
    log(f"done in {took:.0f} s; {len(files)} files in {out}: "
        + ", ".join(f"{p.name} ({p.stat().st_size // 1024} KiB)" for p in files))
    failed = _failed(jsonl)
    if failed:
        log(f"failed rows: {', '.join(failed)}")
    shutil.rmtree(work, ignore_errors=True)
    tests_ok = pytest.get("exit") == 0 or pytest["summary"] == "not run"
    good = ok and reported and not problems and not failed and tests_ok
    log.close()
    return 0 if good else 1


def _failed(jsonl: Path) -> list[str]:
    if not jsonl.exists():
        return []
    recs = [json.loads(ln) for ln in jsonl.read_text().splitlines() if ln.startswith("{")]
    return [f"{r['suite']}.{r['name']}" for r in recs if r.get("status") == "failed"]


def limits(out: Path) -> list[str]:
    """What the machine would not bring back from ``out``: more than :data:`MAX_FILES` files,
    a file deeper than 2 folders, a name with other characters than letters, digits, ``.``,
    ``_`` and ``-``, a file over 16 MiB."""
    problems = []
    files = [p for p in out.rglob("*") if p.is_file()]
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files, at most {MAX_FILES} come back")
    for p in files:
        rel = p.relative_to(out)
        if len(rel.parts) > 3:
            problems.append(f"{rel}: more than 2 folders deep")
        if not all(_NAME.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name with characters that do not come back")
        if p.stat().st_size > 16 * 2**20:
            problems.append(f"{rel}: over 16 MiB")
    return problems


# -- the children ------------------------------------------------------------------------------
def source_id() -> str:
    """The commit (and whether the tree differs from it) where git is there, else a hash of
    the source files of both packages (the GPU machine gets a copy of the tree without ``.git``)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT,
                                   text=True, capture_output=True, timeout=10).stdout.strip()
            return f"git {head.stdout.strip()}" + (" (src differs from it)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    h = hashlib.sha256()
    for p in sorted([*(SRC / "paraprop").rglob("*.py"), *(SRC / "paraprop").rglob("*.c"),
                     *(SRC / "paraprop_lab").rglob("*.py")]):
        h.update(p.relative_to(SRC).as_posix().encode() + b"\0" + p.read_bytes())
    return f"sha256 of src/paraprop{{,_lab}}/**.{{py,c}} {h.hexdigest()[:12]} (no git here)"


def env_report(args) -> int:
    """``env``: the environment report (text) and its record (JSON); exit 1 if the device
    cannot be used."""
    import torch

    import paraprop
    from paraprop.scan import METHODS
    from paraprop_lab.experiments.device import record, resolve, version

    lines = [f"paraprop gpu-check environment, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
             f"python {sys.version.split()[0]} ({sys.executable})",
             f"paraprop {paraprop.__version__} from {Path(paraprop.__file__).parent}; "
             f"{source_id()}",
             f"scan methods: {', '.join(METHODS)}"]
    info = {"steps": json.loads(args.steps), "source": source_id()}
    try:
        dev = resolve(args.device)
        machine = record(dev)
        if dev.type == "cuda":
            x = torch.ones(1024, device=dev)
            torch.cuda.synchronize(dev)
            assert float(x.sum()) == 1024.0
    except Exception as e:  # noqa: BLE001 - reported, and the check stops
        lines.append(f"DEVICE {args.device} NOT USABLE: {type(e).__name__}: {e}")
        Path(args.out).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 1
    info["machine"] = machine
    for k, v in machine.items():
        lines.append(f"{k:14s} {v}")
    smi = shutil.which("nvidia-smi")
    if smi and dev.type == "cuda":
        try:
            res = subprocess.run([smi], text=True, capture_output=True, timeout=20)
            lines += ["", "nvidia-smi:", res.stdout.rstrip()]
        except (OSError, subprocess.SubprocessError) as e:
            lines.append(f"nvidia-smi failed: {e}")
    vers = {p: version(p) for p in PACKAGES}
    info["packages"] = vers
    lines += ["", "packages: " + ", ".join(f"{k} {v or '(absent)'}" for k, v in vers.items())]
    info["imports"] = imports = {}
    for mod in IMPORTS:         # a package that is there but does not import skips its tests
        try:
            importlib.import_module(mod)
            imports[mod] = "ok"
        except Exception as e:  # noqa: BLE001 - reported
            imports[mod] = f"FAILS: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    lines += ["imports: " + ", ".join(f"{k} {v}" for k, v in imports.items())]
    lines += ["", *(f"{k}: {v}" for k, v in info["steps"].items())]
    lines += [f"env {k}={os.environ.get(k, '')}" for k in
              ("PYTHONPATH", "PARAPROP_MNIST_DIR", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")]
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.json).write_text(json.dumps(info, default=str))
    print("\n".join(lines))
    return 0


def rows_child(args) -> int:
    """``rows``: the device rows, each record appended to ``--jsonl`` as it comes, between a
    ``start`` and an ``end`` event per row (the parent reads them to resume after a crash)."""
    from paraprop_lab.bench import gpu
    from paraprop_lab.experiments.rows import run_specs

    deadline = time.monotonic() + args.seconds
    ctx = gpu.context(args.device, quick=args.scale == "tiny", repeats=args.repeats,
                      deadline=deadline)
    jsonl = Path(args.jsonl)
    for spec in gpu.specs(args.only or None):
        if spec.name in args.skip:
            continue
        _append(jsonl, {"event": "start", "spec": spec.name})
        for rec in run_specs([spec], ctx):
            _append(jsonl, json.loads(json.dumps(rec, default=str)))
        _append(jsonl, {"event": "end", "spec": spec.name})
    if args.report is not None:      # ``--report --env ... --out ...``: the report too
        report = _child_parser("report").parse_args(
            ["--jsonl", args.jsonl, "--device", args.device, "--scale", args.scale,
             *args.report, *(["--only", *args.only] if args.only else [])])
        return report_child(report)
    return 0


def report_child(args) -> int:
    """``report``: ``gpu.json``, ``gpu.md`` and ``gpu.png`` from the records."""
    from paraprop_lab.bench import gpu
    from paraprop_lab.experiments.report import markdown_table
    from paraprop_lab.experiments.rows import skipped
    from paraprop_lab.experiments.rows_report import write

    jsonl = Path(args.jsonl)
    records = [r for r in (json.loads(ln) for ln in jsonl.read_text().splitlines()
                           if ln.startswith("{")) if "event" not in r] if jsonl.exists() else []
    done, _ = _done_specs(jsonl)
    for spec in gpu.specs(args.only or None):      # rows no process got to: say so
        if spec.name not in done:
            records.append(skipped(*spec.name.split(".", 1), "not reached: the check's time "
                                   "budget ended before this row"))
    env = json.loads(Path(args.env).read_text()) if Path(args.env).exists() else {}
    pytest = json.loads(Path(args.pytest).read_text()) if Path(args.pytest).exists() else {}
    machine = env.get("machine", {"device": args.device})
    gpu = machine.get("gpu", {})
    envrows = [{"item": k, "value": v} for k, v in [
        ("card", ", ".join(f"{k} {v}" for k, v in gpu.items()) or machine.get("device")),
        ("torch / CUDA / cuDNN / Triton", f"{machine.get('torch')} / {machine.get('cuda')} / "
         f"{machine.get('cudnn')} / {machine.get('triton')}"),
        ("python", machine.get("python")), ("source", env.get("source")),
        ("imports", ", ".join(f"{k} {v}" for k, v in env.get("imports", {}).items())),
        ("carried", env.get("steps", {}).get("wheels")),
        ("MNIST", env.get("steps", {}).get("mnist")),
        ("pytest", f"`{pytest.get('command', '-')}`: {pytest.get('summary')}")]]
    extra = [("Environment and tests", markdown_table(envrows, ["item", "value"]))]
    write(Path(args.out), "gpu", records, machine, args.command, extra=extra,
          payload={"scale": args.scale, "environment": env, "pytest": pytest})
    print(f"wrote {args.out}/gpu.json, gpu.md" + (", gpu.png" if (Path(args.out) / "gpu.png")
                                                  .exists() else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The check's options (the subcommands ``env``, ``rows``, ``report`` have their own)."""
    c = argparse.ArgumentParser(prog="python -m paraprop_lab.bench.gpu_check",
                                description=__doc__.split("\n\n")[0])
    c.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    c.add_argument("--out", default=os.environ.get("OUT") or "results/gpu-check",
                   help="the results folder (default: $OUT if set, else results/gpu-check)")
    c.add_argument("--scale", choices=["tiny", "gpu"], default=None,
                   help="row sizes (default: gpu on CUDA, tiny on the CPU)")
    c.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for the whole check (default {BUDGET_S:.0f})")
    c.add_argument("--pytest-timeout", type=float, default=PYTEST_S,
                   help=f"seconds for pytest at most (default {PYTEST_S:.0f})")
    c.add_argument("--pytest-workers", type=int, default=None,
                   help="pytest-xdist workers where installed (default 8 on CUDA, 0 on CPU)")
    c.add_argument("--pytest-args", default=None,
                   help="the tests to run instead of '-m gpu', one string (e.g. "
                        "'tests/test_x.py -k name')")
    c.add_argument("--no-pytest", action="store_true", help="skip the test step")
    c.add_argument("--only", nargs="*", default=None, help="only these rows or suites")
    c.add_argument("--repeats", type=int, default=None, help="timed rounds per case")
    c.add_argument("--wheels", default=str(ROOT / ".gpu" / "wheels"),
                   help="carried wheels to install (default .gpu/wheels)")
    c.add_argument("--mnist", default=str(ROOT / ".gpu" / "mnist"),
                   help="carried MNIST files (default .gpu/mnist)")
    c.add_argument("--command", default=None,
                   help="the command in the report (default: `make gpu-check` where only "
                        "--out and --device were given, else this script with its options)")
    return c


def report_command(argv: list[str]) -> str:
    """What the report names as its command: ``make gpu-check`` (``DEVICE=cpu``) where only the
    folder and the device were chosen, else this script with every option but ``--out`` (the
    second GPU run, a part of the rows, was reported as ``make gpu-check``)."""
    rest, device, i = [], "cuda", 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name in ("--out", "--device"):
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            if name == "--device":
                device = value
        else:
            rest.append(a)
        i += 1
    if not rest:
        return "make gpu-check" + ("" if device == "cuda" else f" DEVICE={device}")
    opts = [*([] if device == "cuda" else ["--device", device]), *rest]
    return ("PYTHONPATH=src python3 src/paraprop_lab/bench/gpu_check.py --out $OUT "
            + " ".join(shlex.quote(a) for a in opts))


def _child_parser(step: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m paraprop_lab.bench.gpu_check {step}")
    if step == "env":
        for name in ("--device", "--out", "--json"):
            p.add_argument(name, required=True)
        p.add_argument("--steps", default="{}")
    elif step == "rows":
        p.add_argument("--device", required=True)
        p.add_argument("--scale", required=True, choices=["tiny", "gpu"])
        p.add_argument("--jsonl", required=True)
        p.add_argument("--seconds", type=float, required=True)
        p.add_argument("--skip", nargs="*", default=[])
        p.add_argument("--only", nargs="*", default=None)
        p.add_argument("--repeats", type=int, default=None)
        p.add_argument("--report", nargs=argparse.REMAINDER, default=None,
                       help="then write the report: the report step's --env, --pytest, "
                            "--out and --command")
    else:
        for name in ("--jsonl", "--env", "--pytest", "--out", "--device", "--scale",
                     "--command"):
            p.add_argument(name, required=True)
        p.add_argument("--only", nargs="*", default=None)
    return p


CHILDREN = {"env": env_report, "rows": rows_child, "report": report_child}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in CHILDREN:
        return CHILDREN[argv[0]](_child_parser(argv[0]).parse_args(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.command is None:
        args.command = report_command(argv)
    if args.pytest_workers is None:
        args.pytest_workers = 8 if args.device.startswith("cuda") else 0
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
