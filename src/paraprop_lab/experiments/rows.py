"""Device rows: each paper's headline comparison, measured on one device in one record format.

A suite that has them lists them in ``DEVICE_ROWS``: :class:`RowSpec` s, each a function of a
:class:`Context` (the device, the scale, the time left) that measures its baseline and the
parallel method side by side (interleaved rounds, medians, the ratio from the same run) and
returns records made by :func:`row`, :func:`choice` or :func:`skipped`. ``paraprop bench SUITE``
on a GPU and ``make gpu-check`` (:mod:`paraprop_lab.bench.gpu`) run them through :func:`run_specs`,
which turns an exception into a ``failed`` record (the other rows still run) and skips a row
whose estimated time no longer fits.

Two scales: ``"gpu"``, the sizes of the issue's targets, chosen to fit one GPU machine's short
window (:mod:`paraprop_lab.bench.gpu_check`), and ``"tiny"``, the same code at sizes a CPU runs in
about a second per row (``make gpu-check DEVICE=cpu`` and the test that keeps the flow from
rotting between GPU runs). Tiny figures measure nothing: their rows check the plumbing and the
deviations.

Every :func:`row` reports the largest deviation of the method's result from the sequential
result on the same device and its bound (the method's stopping tolerance, or ``0`` where the
result is bitwise); a :func:`choice` is the measurement that sets an ``auto`` choice per device
(each candidate's time, the fastest, and what ``auto`` runs now).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from paraprop_lab.experiments.harness import interleaved, median

SCALES = ("tiny", "gpu")


@dataclass
class Context:
    """What a row function gets: where it runs, at which scale, how long it may take.

    Attributes:
        device: the device of every model and tensor of the row.
        scale: ``"tiny"`` or ``"gpu"`` (:data:`SCALES`).
        repeats: timed rounds per case (``None``: each row's own choice).
        deadline: ``time.monotonic()`` by which the rows should be done (``inf``: none).
    """

    device: torch.device
    scale: str = "tiny"
    repeats: int | None = None
    deadline: float = math.inf

    def __post_init__(self):
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {self.scale!r}")

    @property
    def tiny(self) -> bool:
        return self.scale == "tiny"

    def pick(self, tiny, gpu):
        """``tiny`` at the tiny scale, ``gpu`` at the GPU scale."""
        return tiny if self.tiny else gpu

    def rounds(self, gpu: int) -> int:
        """Timed rounds of a case: ``repeats`` if given, else 1 (tiny) or ``gpu``."""
        return self.repeats or (1 if self.tiny else gpu)

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.deadline - time.monotonic()

    def time(self, cases: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1,
             desc: str = "timing") -> dict[str, float]:
        """Median seconds of each case: interleaved rounds on this device
        (:func:`paraprop_lab.experiments.harness.interleaved`)."""
        times = interleaved(cases, repeats=repeats, warmup=warmup, desc=desc, device=self.device)
        return {k: median(v) for k, v in times.items()}


@dataclass
class RowSpec:
    """One measurement of a suite's device rows.

    Attributes:
        name: ``SUITE.what``, e.g. ``"bppsa.rnn_backward"``.
        run: ``run(ctx) -> list of records``.
        seconds: its estimated wall time at the GPU scale (model training included), for the
            time budget: a row that would not fit is skipped and says so.
    """

    name: str
    run: Callable[[Context], list[dict]]
    seconds: float


def row(suite: str, name: str, *, what: str, shape: str, baseline: str, baseline_s: float,
        method: str, method_s: float, max_dev: float, bound: float | None,
        target: float | None = None, ratio: float | None = None, unit: str = "x",
        note: str = "", **extra) -> dict:
    """A measured comparison.

    Arguments:
        suite, name: where it comes from (``name`` unique within the suite).
        what: the comparison in words (the paper's headline it stands for).
        shape: the sizes measured.
        baseline, method: labels; ``baseline_s``, ``method_s``: median seconds of each.
        max_dev: the largest deviation of the method's result from the sequential result
            (absolute unless ``note`` says otherwise).
        bound: what ``max_dev`` is promised to stay within (``0``: bitwise), or ``None``.
        target: the issue's target for ``ratio`` (``ratio >= target``), or ``None``.
        ratio: the figure compared with ``target``; default ``baseline_s / method_s`` (the
            speedup, ``unit="x"``).
        unit: what ``ratio`` counts (``"x"``, or e.g. ``"of copy bandwidth"``).
        note: conditions worth a sentence (rounds, training, what was left out).
        extra: further figures (iterations, passes, ...), kept in the JSON.
    """
    if ratio is None:
        ratio = baseline_s / method_s if method_s > 0 else math.inf
    return {"kind": "row", "status": "ok", "suite": suite, "name": name, "what": what,
            "shape": shape, "baseline": baseline, "baseline_ms": 1e3 * baseline_s,
            "method": method, "method_ms": 1e3 * method_s, "ratio": ratio, "unit": unit,
            "target": target, "met": None if target is None else bool(ratio >= target),
            "max_dev": float(max_dev), "bound": bound,
            "within": None if bound is None else bool(max_dev <= bound),
            "note": note, "extra": extra}


def choice(suite: str, name: str, *, what: str, shape: str, times: dict[str, float],
           auto: str | None, auto_s: float | None = None, note: str = "") -> dict:
    """The measurement behind an ``auto`` choice: each candidate's median seconds, the fastest,
    ``auto``'s current pick (``None`` where it has no fixed pick to name) and, when it was
    timed too (``auto_s``), how much slower than the fastest ``auto`` ran."""
    fastest = min(times, key=times.get)
    return {"kind": "choice", "status": "ok", "suite": suite, "name": name, "what": what,
            "shape": shape, "times_ms": {k: 1e3 * v for k, v in times.items()},
            "fastest": fastest, "auto": auto,
            "agrees": None if auto is None else auto == fastest,
            "auto_ms": None if auto_s is None else 1e3 * auto_s,
            "auto_vs_fastest": None if auto_s is None else auto_s / times[fastest],
            "note": note}


def skipped(suite: str, name: str, reason: str, *, status: str = "skipped") -> dict:
    """A row that did not run (``status``: ``"skipped"`` or ``"failed"``), with the reason."""
    return {"kind": "row", "status": status, "suite": suite, "name": name, "reason": reason}


def run_specs(specs: Iterable[RowSpec], ctx: Context, *, log=print) -> Iterator[dict]:
    """Run each spec, yielding its records as they come: a spec whose estimate exceeds the time
    left (GPU scale) is skipped, an exception becomes a ``failed`` record with its message, and
    memory is released between specs. Each record gets the spec's ``seconds`` and device."""
    for spec in specs:
        suite, name = spec.name.split(".", 1)
        if not ctx.tiny and spec.seconds > ctx.left():
            yield skipped(suite, name, f"time budget: about {spec.seconds:.0f} s needed, "
                          f"{max(0.0, ctx.left()):.0f} s left")
            continue
        log(f"--- {spec.name} ({ctx.device}, {ctx.scale})")
        t0 = time.monotonic()
        # one row's failure must not end the others
        records = guarded(suite, name, lambda spec=spec: list(spec.run(ctx)), log=log)
        took = time.monotonic() - t0
        for rec in records:
            rec.setdefault("spec", spec.name)
            rec["spec_seconds"] = took
            rec["device"] = str(ctx.device)
            yield rec
        release(ctx.device)


@contextlib.contextmanager
def cudnn_float32(device: torch.device) -> Iterator[bool]:
    """cuDNN's float32 convolutions and RNNs in float32 for the block, on CUDA (torch's default
    there is TF32, about ``2**-11`` relative; the first GPU run's 3e-4 between paraprop's and
    torch's RNN gradients is of that size); yields whether anything changed (``False`` on the
    CPU). Through torch's per-operator flags (``torch.backends.cudnn.conv`` and ``.rnn``), set
    back to the values read on entry; inside the block the legacy ``allow_tf32`` cannot be read
    (torch calls that a mix of the two APIs, and so do ``torch.backends.cudnn.flags``), which no
    row does, and afterwards the two flags hold those values explicitly rather than following
    ``torch.backends.cudnn.fp32_precision``."""
    if device.type != "cuda":
        yield False
        return
    cudnn = torch.backends.cudnn
    old = cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision
    cudnn.conv.fp32_precision = cudnn.rnn.fp32_precision = "ieee"
    try:
        yield old != ("ieee", "ieee")
    finally:
        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = old


def guarded(suite: str, name: str, measure: Callable[[], list[dict]],
            log=print) -> list[dict]:
    """``measure()``'s records, or one ``failed`` record with the error where it raises: a
    measurement added to a row (issue 31's and 32's beside the headline ones) cannot take the
    row's other records down with it."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - the row's other records stand
        log("".join(traceback.format_exception(e)).rstrip())
        return [skipped(suite, name, f"{type(e).__name__}: {_one_line(e)}", status="failed")]


def release(device: torch.device) -> None:
    """Free what the last row left behind (Python garbage, CUDA's cached blocks)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` (``0`` for empty tensors), computed in at least float32 where the tensors
    live (the difference of two float32 values is exact to a relative ``2**-24``, and no
    float64 copy of a large result is made)."""
    if a.numel() == 0:
        return 0.0
    if a.is_floating_point() or b.is_floating_point():
        dt = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        a, b = a.to(dt), b.to(dt)
    return float((a - b).abs().max())


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``: a deviation relative to the reference's scale."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    return max_abs(a, b) / scale if scale > 0 else max_abs(a, b)


def _one_line(e: BaseException) -> str:
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return (text or type(e).__name__)[:400]
