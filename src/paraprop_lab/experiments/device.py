"""The device a benchmark runs on: its name checked once, its record, timing on it.

``paraprop bench SUITE`` measures on the CPU by default; a suite's ``run(..., device="cuda")``
(and :mod:`paraprop_lab.bench.gpu`, the rows of ``make gpu-check``) measures on a GPU. Everything
device-specific of the benchmarks is here: :func:`resolve` turns the user's ``device`` into a
:class:`torch.device` (or a ``ValueError`` naming what was asked and what is there),
:func:`record` says which card, driver, torch and Triton measured a figure, and :func:`synchronize`
makes a wall-clock time cover the work queued on the device (the harness calls it before and
after every timed call: on a GPU a time then includes the host's launch overhead, as a user
sees it, not only the kernels).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform

import torch

DEVICES = ("cpu", "cuda", "cuda:N")


def resolve(device: str | torch.device | None, *, default: str = "cpu") -> torch.device:
    """The :class:`torch.device` of a benchmark's ``device`` argument.

    Arguments:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a :class:`torch.device`, ``"auto"`` (CUDA
            where present, else the CPU) or ``None`` (``default``).
        default: what ``None`` means.

    Raises:
        ValueError: an unknown device, or CUDA asked for where torch sees none (the message says
            which torch it is and whether it was built with CUDA at all).
    """
    if device is None:
        device = default
    if isinstance(device, str) and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r} "
                         f"(the benchmarks measure on the CPU or on CUDA only)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = (f"built with CUDA {torch.version.cuda}" if torch.version.cuda
                     else "a CPU-only build")
            raise ValueError(f"device={device!r} but torch {torch.__version__} ({built}) sees no "
                             f"CUDA device; use device='cpu'")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"device={device!r} but there are {n} CUDA device(s) (cuda:0 .. "
                             f"cuda:{n - 1})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def synchronize(device: torch.device | None = None) -> None:
    """Wait for the work queued on ``device`` (every CUDA device where ``None``; nothing to
    wait for on the CPU)."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def version(package: str) -> str | None:
    """An installed distribution's version, without importing it (``None`` if absent)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def card(device: torch.device) -> dict:
    """What a GPU is: name, compute capability, memory, multiprocessors (empty on the CPU)."""
    if device.type != "cuda":
        return {}
    p = torch.cuda.get_device_properties(device)
    out = {"name": p.name, "capability": f"{p.major}.{p.minor}",
           "memory_gib": round(p.total_memory / 2**30, 1),
           "multiprocessors": p.multi_processor_count}
    l2 = getattr(p, "L2_cache_size", None)
    if l2:
        out["l2_mib"] = round(l2 / 2**20, 1)
    return out


def host() -> dict:
    """When, and on which host: the date, CPU count, torch's threads, torch, Python, the
    platform and the processor (what :func:`record` and
    :func:`paraprop_lab.experiments.harness.machine_info` start with)."""
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


def record(device: torch.device) -> dict:
    """Where and when a figure was measured: the date, the host, torch and its CUDA, Triton,
    and for a GPU its name (``device`` then reads ``cuda:NAME``, as the reports print it)."""
    info = {**host(), "device": "cpu"}
    if device.type == "cuda":
        gpu = card(device)
        info.update(device=f"cuda:{gpu['name']}", gpu=gpu, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), triton=version("triton"))
    return info
