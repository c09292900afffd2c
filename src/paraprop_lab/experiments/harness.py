"""The shared benchmark harness: machine record, warm-up, interleaved timing, medians, ratios.

Benchmarks are not tests: they measure and report, they never assert on time. Every suite times
its baseline and its methods in the same run, interleaved (A B A B ...), so that a change of machine
load hits all of them alike, and reports medians and the ratios of those medians.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch

from paraprop_lab.experiments.device import host, record, resolve, synchronize
from paraprop_lab.progress import progress


def machine_info(device: torch.device | str | None = None) -> dict:
    """Where and when a figure was measured: on ``device`` when given
    (:func:`paraprop_lab.experiments.device.record`: a GPU's name, CUDA and Triton too), else this
    machine with the CUDA device it has, if any."""
    if device is not None:
        return record(resolve(device))
    gpu = torch.cuda.is_available()
    return {**host(), "device": f"cuda:{torch.cuda.get_device_name()}" if gpu else "cpu"}


def interleaved(
    cases: dict[str, Callable[[], object]],
    *,
    repeats: int = 5,
    warmup: int = 1,
    desc: str = "timing",
    device: torch.device | None = None,
) -> dict[str, list[float]]:
    """Time every case ``repeats`` times, interleaved, after ``warmup`` untimed rounds.

    Arguments:
        cases: name -> zero-argument callable; the first is the baseline by convention.
        repeats: timed rounds; each round runs every case once, in order.
        warmup: untimed rounds first (allocations, caches, lazy initialisation).
        desc: label of the progress bar (one summary line when the output is not a terminal:
            :func:`paraprop_lab.progress.progress`).
        device: the device the cases run on: each timed call starts and ends with a
            synchronization of it, so that its time covers the work it queued
            (:func:`paraprop_lab.experiments.device.synchronize`; ``None``: every CUDA device in
            use).

    Returns:
        name -> list of wall times in seconds, one per round.
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    with progress(total=(warmup + repeats) * len(cases), desc=desc, unit="runs") as bar:
        for r in range(warmup + repeats):
            for name, run in cases.items():
                synchronize(device)
                t0 = time.perf_counter()
                run()
                synchronize(device)
                dt = time.perf_counter() - t0
                if r >= warmup:
                    times[name].append(dt)
                bar.update()
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def speedups(times: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """Ratio of the baseline's median time to each case's median time (same run)."""
    base = median(times[baseline])
    return {name: base / median(ts) for name, ts in times.items()}


def model_share(model: torch.nn.Module, run: Callable[[], object], *, repeats: int = 3,
                device: torch.device | None = None) -> float:
    """The share of ``run``'s time spent inside ``model``'s forward passes, in the fastest of
    ``repeats`` runs (after one untimed run), measured by a forward pre-hook and hook that
    synchronise ``device``. A table's ``model_ms`` is this share of the method's median time
    (so never more than it, whatever the machine did between the two measurements), and the
    baseline's time over that is the method's *ceiling*: the speedup it would reach if
    everything around the model cost nothing. The hooks are removed afterwards."""
    spent: list[float] = []
    start: list[float] = []

    def before(_module, _args):
        synchronize(device)
        start.append(time.perf_counter())

    def after(_module, _args, _out):
        synchronize(device)
        spent.append(time.perf_counter() - start.pop())

    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    try:
        run()
        best, share = float("inf"), 0.0
        for _ in range(repeats):
            spent.clear()
            t0 = time.perf_counter()
            run()
            synchronize(device)
            total = time.perf_counter() - t0
            if total < best:
                best, share = total, min(1.0, sum(spent) / total) if total > 0 else 0.0
    finally:
        for h in handles:
            h.remove()
    return share


def model_seconds(model: torch.nn.Module, cases: dict[str, Callable[[], object]],
                  times: dict[str, list[float]], *, repeats: int = 3) -> dict[str, float]:
    """Per case of an :func:`interleaved` timing, the seconds spent inside ``model`` (a table's
    ``model_ms``): :func:`model_share` of a run times the case's median time ``times``."""
    return {k: median(times[k]) * model_share(model, run, repeats=repeats)
            for k, run in cases.items()}


@contextlib.contextmanager
def threads(n: int | None):
    """Run with ``n`` intra-op threads (``None``: unchanged), restoring the setting after."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def busy_core(seconds: float = 600.0):
    """Keep one core busy with a second process while the block runs (a machine shared with
    another job): a Python busy loop that stops by itself after ``seconds`` at the latest, and
    is stopped when the block ends.

    Yields:
        The :class:`subprocess.Popen` of the busy process.
    """
    import subprocess
    import sys

    code = (f"import time\nend = time.monotonic() + {float(seconds)}\n"
            "while time.monotonic() < end: pass\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.2)          # let it start spinning
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def matmul_rate(rows: int, inner: int, cols: int, repeats: int = 5,
                dtype: torch.dtype = torch.float32) -> float:
    """The machine's measured matrix-product rate, in multiply-adds per second, on a product of
    the shape a benchmark's own step performs (``(rows, inner) @ (inner, cols)``, torch's
    threads as set): the rate that turns a step's multiply-add count into its physical limit."""
    a = torch.randn(rows, inner, dtype=dtype)
    b = torch.randn(inner, cols, dtype=dtype)
    out = torch.empty(rows, cols, dtype=dtype)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return rows * inner * cols / best
