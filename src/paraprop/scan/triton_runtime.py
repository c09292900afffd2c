"""Where and how the Triton kernels run: availability, the interpreter switch, loading the kernel
modules once per mode, the record of a failed launch, and the launch geometry the scans
(:mod:`paraprop.scan.triton_kernels`) and the fused Newton steps (:mod:`paraprop.nn.triton_cells`)
share.

triton is imported only when a kernel is first needed, never by ``import paraprop``. Where it is
missing :func:`available` is ``False`` and :func:`status` says why. CUDA tensors run the
compiled kernels; CPU tensors run them in Triton's interpreter, and only when the environment
says ``TRITON_INTERPRET=1`` (the tests do; it is far too slow for real work). While it says so,
CUDA tensors are refused (the interpreter would run them on the host): ``method="auto"`` then
runs the torch methods and :func:`status` says why. The kernel modules are loaded once per mode,
each mode a module of its own (under a lock: the switch is process-wide), so the two can be used
in one process in any order. A kernel that fails to compile or launch raises
:class:`LaunchError` and is recorded (:func:`failed`): ``auto`` and ParaGRU's and ParaLSTM's warm
start stop picking the kernels.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import threading
import types
import warnings

import torch

__all__ = ["LaunchError", "available", "failed", "interpreting", "require", "status", "why_not"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# CUDA's grid limits: programs along axis 0, and along axes 1 and 2.
MAX_GRID0 = 2 ** 31 - 1
MAX_GRID12 = 65535

_loaded: dict[tuple[str, bool], types.ModuleType] = {}
_missing: list[str] = []
# Held while a kernel module is loaded: the mode switch changes os.environ and triton's knobs
# for the whole process, and a module must be executed once per mode.
_lock = threading.RLock()
# While a load forces the switch: the user's TRITON_INTERPRET (None: unset), which
# :func:`interpreting` reads meanwhile (other threads must not see the forced value), and, for
# the loading thread, the mode being loaded (:func:`loading_mode`).
_outer: list[str | None] = []
_loading = threading.local()
# The values triton reads as true for TRITON_INTERPRET (case-insensitive).
_TRUE = ("1", "true", "on", "yes")


def _import_error() -> str | None:
    if not _missing:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
            _missing.append("")
        except ImportError as e:
            _missing.append(f"triton is not installed ({e})")
    return _missing[0] or None


def available() -> bool:
    """Whether triton can be imported (the kernels may still need a CUDA tensor to run)."""
    return _import_error() is None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is set (to ``1``, ``true``, ``on`` or ``yes``, as triton
    reads it): CPU tensors may then run the kernels, and CUDA tensors may not (the interpreter
    would run them on the host). The user's setting, also while a load forces the switch."""
    outer = _outer[:1]                      # (one read: another thread may pop it)
    raw = outer[0] if outer else os.environ.get("TRITON_INTERPRET")
    return (raw or "0").strip().lower() in _TRUE


def loading_mode() -> bool:
    """The mode of the kernel module this thread is loading (a kernel module asks, to load the
    helpers it shares in its own mode), or, outside a load, :func:`interpreting`."""
    mode = getattr(_loading, "mode", None)
    return interpreting() if mode is None else mode


# Why CUDA tensors are refused while the interpreter is switched on.
INTERPRETER_ON_CUDA = ("TRITON_INTERPRET is set: Triton's interpreter would run the kernels on "
                       "the host, so CUDA tensors are refused (the torch methods run "
                       "instead); unset TRITON_INTERPRET to compile them")


def status() -> str:
    """``"ok (...)"`` with the triton version and the modes, or ``"unavailable: <why>"``."""
    err = _import_error()
    if err:
        return f"unavailable: {err}"
    import triton
    if interpreting():
        modes = f"CPU tensors interpreted, CUDA tensors refused ({INTERPRETER_ON_CUDA})"
    else:
        modes = "CUDA tensors compiled, CPU tensors refused (set TRITON_INTERPRET=1 to interpret)"
    broken = f"; auto avoids them: {failed()}" if failed() else ""
    return f"ok (triton {triton.__version__}; {modes}{broken})"


def why_not(**tensors: torch.Tensor | None) -> str | None:
    """``None`` if the kernels can run on the named ``tensors`` (``None`` values are skipped;
    one device, one supported dtype), else the reason, naming the argument, for an error
    message."""
    err = _import_error()
    if err:
        return err
    named = [(name, t) for name, t in tensors.items() if t is not None]
    first, device = named[0][0], named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            return f"{name} is on {t.device} but {first} is on {device}; use one device"
    if device.type == "cpu":
        if not interpreting():
            return ("the Triton kernels run on CUDA tensors; CPU tensors run them only in "
                    "Triton's interpreter, with TRITON_INTERPRET=1 set (slow: for tests)")
    elif device.type == "cuda":
        if interpreting():
            return INTERPRETER_ON_CUDA
    else:
        return f"the Triton kernels run on CUDA tensors, not on {device.type} ({first})"
    for name, t in named:
        if t.dtype not in DTYPES:
            return (f"the Triton kernels take float16, bfloat16, float32 or float64; {name} "
                    f"has dtype {t.dtype}")
    return None


def require(what: str, **tensors: torch.Tensor | None) -> None:
    """Raise ``RuntimeError`` naming ``what`` if the kernels cannot run on the named
    ``tensors``."""
    reason = why_not(**tensors)
    if reason is not None:
        raise RuntimeError(f"{what} cannot run here: {reason}")


@contextlib.contextmanager
def _mode(interpret: bool):
    """Triton's interpreter switch, forced for the duration (triton reads it when a kernel is
    decorated): the environment variable and, where triton has them, its knobs. Called under
    :data:`_lock`; :func:`interpreting` keeps answering with the user's setting meanwhile."""
    import triton

    old = os.environ.get("TRITON_INTERPRET")
    outermost = not _outer
    if outermost:
        _outer.append(old)                  # first: interpreting() never sees the forced value
    previous = getattr(_loading, "mode", None)
    _loading.mode = interpret
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    knobs = getattr(triton, "knobs", None)
    try:
        if knobs is not None and hasattr(knobs, "runtime") and hasattr(knobs.runtime, "scope"):
            with knobs.runtime.scope():
                knobs.runtime.interpret = interpret
                yield
        else:
            yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
        _loading.mode = previous
        if outermost:
            _outer.pop()


def load(source: str, device: torch.device) -> types.ModuleType:
    """The kernel module ``source`` (e.g. ``"paraprop.scan._triton_scan"``) in the mode that
    runs on ``device``: compiled for CUDA tensors, interpreted for the others (the callers
    refuse CUDA tensors while ``TRITON_INTERPRET`` is set: :func:`why_not`)."""
    return load_mode(source, device.type != "cuda")


def load_mode(source: str, interpret: bool) -> types.ModuleType:
    """The kernel module ``source`` interpreted or compiled. Each mode is loaded once, as a
    module of its own, under a lock (the mode switch is process-wide). A kernel module that
    uses another one's helpers (``_triton_cells`` those of ``_triton_scan``) loads it here, in
    its own mode."""
    with _lock:
        key = (source, bool(interpret))
        module = _loaded.get(key)
        if module is None:
            found = importlib.util.find_spec(source)
            name = f"{source}__{'interpreted' if interpret else 'compiled'}"
            spec = (importlib.util.spec_from_file_location(name, found.origin)
                    if found is not None and found.origin is not None else None)
            if spec is None or spec.loader is None:
                raise ImportError(f"the kernel module {source!r} has no source file to load")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                with _mode(bool(interpret)):
                    spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            _loaded[key] = module
        return module


class LaunchError(RuntimeError):
    """A Triton kernel failed to compile or launch (the cause is chained)."""


_failed: list[str] = []


def failed() -> str | None:
    """Why a kernel failed in this process (``auto`` then stops picking the kernels), or
    ``None``."""
    return _failed[0] if _failed else None


@contextlib.contextmanager
def on(device: torch.device, what: str):
    """Launch ``what`` on ``device`` (Triton launches on the current CUDA device). A kernel
    that fails (one this triton cannot compile, say) raises :class:`LaunchError` and is
    recorded, with a warning the first time: from then on ``auto`` (and ParaGRU's and
    ParaLSTM's step on CUDA) use the torch methods, so that one broken kernel does not stop
    everything else on the device."""
    context = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with context:
        try:
            yield
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:
            reason = f"{what} failed: {type(e).__name__}: {str(e)[:500]}"
            if not _failed:
                warnings.warn(f"the Triton kernel {reason}; method='auto' uses the torch "
                              "methods from now on (paraprop.scan.triton_runtime.status())",
                              RuntimeWarning, stacklevel=3)
            _failed.append(reason)
            raise LaunchError(reason) from e


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (0 elsewhere: no chunking by default)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def acc_type(module: types.ModuleType, dtype: torch.dtype):
    return module.tl.float64 if dtype == torch.float64 else module.tl.float32


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def passes(device: torch.device, what: str, C: int, launch, carries, tot_shape: tuple,
           start_shape: tuple, dtype: torch.dtype) -> None:
    """Run a scan kernel over ``C`` chunks of time, under :func:`on` (``what`` names it in a
    failure). One chunk: pass 0 alone, ``launch(None, None, 0)``. Several: pass 1 keeps every
    chunk's totals in ``tot`` (``launch(None, tot, 1)``), ``carries(tot, start)`` walks the
    chunks for their true starts, pass 2 re-runs them from there (``launch(start, None, 2)``);
    ``tot`` and ``start`` are allocated with the shapes given, in the accumulation dtype of
    ``dtype``."""
    with on(device, what):
        if C == 1:
            launch(None, None, 0)
            return
        wide = wide_dtype(dtype)
        tot = torch.empty(tot_shape, dtype=wide, device=device)
        start = torch.empty(start_shape, dtype=wide, device=device)
        launch(None, tot, 1)
        carries(tot, start)
        launch(start, None, 2)


def slices(n: int, step: int) -> list[slice]:
    """Consecutive slices of ``range(n)`` of at most ``step`` (``>= 1``) each."""
    step = max(1, step)
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def time_chunks(device: torch.device, programs: int, blocks: int, chunks: int | None) -> int:
    """Chunks of time for a tree-scan kernel: ``chunks`` if given, else 1 unless ``programs``
    (independent tiles) leave the device's multiprocessors idle; then enough chunks of at least
    four blocks each to give every multiprocessor about four programs. At most
    :data:`MAX_GRID12` (the chunks are a grid axis of their own)."""
    if chunks is not None:
        return max(1, min(chunks, blocks, MAX_GRID12))
    sms = multiprocessors(device)
    if not sms or programs >= 2 * sms:
        return 1
    return max(1, min(math.ceil(4 * sms / programs), blocks // 4, MAX_GRID12))
