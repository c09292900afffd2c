"""Triton kernels for :func:`paraprop.scan.linear_recurrence` on the GPU (``method="triton"``).

The GPU's counterpart of :mod:`paraprop.scan.native`: where the CPU runs one native C call, a
CUDA tensor runs one (or three) Triton kernels (:mod:`paraprop.scan._triton_scan` says how they
work). Two entry points a benchmark can call directly:

- :func:`diagonal_scan`: ``h_t = a_t * h_{t-1} + b_t`` elementwise along any dim, forward or
  reverse, any length, float16 / bfloat16 / float32 / float64 inputs with float32 (float64)
  accumulation;
- :func:`dense_scan`: ``h_t = A_t h_{t-1} + b_t`` with dense ``H x H`` steps, ``H <=``
  :data:`MAX_DENSE` (the BPPSA backward of small recurrent cells, and ParaLSTM's ``2 x 2``
  blocks).

triton is imported only when a kernel is first needed, never by ``import paraprop``. Where it is
missing :func:`available` is ``False`` and :func:`status` says why. CUDA tensors run the
compiled kernels; CPU tensors run them in Triton's interpreter, and only when the environment
says ``TRITON_INTERPRET=1`` (the tests do; it is far too slow for real work). While it says so,
CUDA tensors are refused (the interpreter would run them on the host): ``auto`` then runs the
torch methods and :func:`status` says why. The kernels are loaded once per mode, each mode a
module of its own (under a lock: the switch is process-wide), so the two can be used in one
process in any order.

Exactness: a tree scan groups the products and sums differently from the sequential loop, so
the results are not bitwise the loop's. Every computed state is a sum of at most ``T + 1``
terms ``(a_{s+1} ... a_t) b_s`` (and ``(a_0 ... a_t) h0``); whatever the grouping, a term's
value passes through one rounded multiplication per factor ``a`` and at most one rounded
addition per step and per block or chunk boundary, at most ``2 T + 2`` roundings in the
accumulation precision ``u`` (``2^-24`` for float32, ``2^-53`` for float64). Hence
``|h_t - h_t^exact| <= gamma_{2T+2} M_t`` with ``gamma_n = n u / (1 - n u)`` and ``M_t = sum_s
|a_{s+1} ... a_t| |b_s|`` (plus the last rounding to a float16 / bfloat16 output, half an ulp
of ``|h_t|``). The tests assert exactly this bound against float64 (tests/test_triton.py).

CUDA's grids allow ``2^31 - 1`` programs along axis 0 and 65535 along axes 1 and 2: the rows
(and tiles of channels) are flattened into axis 0, the chunks of time (at most 65535) go on
axis 1, and more rows than axis 0 holds run in several launches.
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

__all__ = ["MAX_DENSE", "available", "dense_scan", "diagonal_scan", "interpreting", "status",
           "why_not"]

# Largest state size of the dense kernel: one H x H step lives in a program's registers.
MAX_DENSE = 64
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Tile of the diagonal kernel, in values: 2048 per block of steps (16 per thread of 4 warps).
TILE = 2048
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
            origin = importlib.util.find_spec(source).origin
            name = f"{source}__{'interpreted' if interpret else 'compiled'}"
            spec = importlib.util.spec_from_file_location(name, origin)
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
                              "methods from now on (paraprop.scan.triton_kernels.status())",
                              RuntimeWarning, stacklevel=3)
            _failed.append(reason)
            raise LaunchError(reason) from e


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (0 elsewhere: no chunking by default)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def _acc(module: types.ModuleType, dtype: torch.dtype):
    return module.tl.float64 if dtype == torch.float64 else module.tl.float32


def _wide(dtype: torch.dtype) -> torch.dtype:
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
        wide = _wide(dtype)
        tot = torch.empty(tot_shape, dtype=wide, device=device)
        start = torch.empty(start_shape, dtype=wide, device=device)
        launch(None, tot, 1)
        carries(tot, start)
        launch(start, None, 2)


def _check_tensors(entry: str, **tensors: torch.Tensor | None) -> None:
    """Tensors (``h0`` may be ``None``) of one supported dtype."""
    for name, t in tensors.items():
        if t is None and name == "h0":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    b = tensors["b"]
    if b.dtype not in DTYPES:
        raise TypeError(f"{entry}: b must be float16, bfloat16, float32 or float64, got b of "
                        f"dtype {b.dtype}")
    for name, t in tensors.items():
        if t is not None and t.dtype != b.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but b has {b.dtype}; use one dtype")


# -- the diagonal scan ----------------------------------------------------------------------------
def diag_launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, h0: torch.Tensor | None,
                reverse: bool, block_t: int | None = None, chunks: int | None = None) -> None:
    """The diagonal kernel on ``(N, T, D)`` views (any strides; ``a`` may be expanded), ``h0``
    ``(N, D)`` or ``None``; writes ``out``."""
    N, T, D = b.shape
    if N == 0 or T == 0 or D == 0:
        return
    if block_t is not None:
        BT = _pow2(block_t)
        BD = min(_pow2(D), max(1, TILE // BT))
    elif b.stride(1) == 1 or D == 1:          # time contiguous: long blocks of steps
        BD = 1 if D == 1 else min(_pow2(D), 4)
        BT = min(_pow2(T), TILE // BD)
    elif b.stride(2) == 1:                    # channels contiguous: wide tiles
        BD = min(_pow2(D), 32)
        BT = min(_pow2(T), TILE // BD)
    else:
        BD = min(_pow2(D), 16)
        BT = min(_pow2(T), 64)
    BT = max(BT, 2)
    tiles = math.ceil(D / BD)
    if tiles > MAX_GRID0:
        raise ValueError(f"diagonal_scan: {D} channels per row need {tiles} programs, more than "
                         f"a CUDA grid's {MAX_GRID0}")
    if N * tiles > MAX_GRID0:               # more programs than axis 0 holds: slices of rows
        for rows in _slices(N, MAX_GRID0 // tiles):
            diag_launch(a[rows], b[rows], out[rows], None if h0 is None else h0[rows],
                        reverse, block_t, chunks)
        return
    mod = load("paraprop.scan._triton_scan", b.device)
    blocks = math.ceil(T / BT)
    C = _time_chunks(b.device, N * tiles, blocks, chunks)
    L = math.ceil(blocks / C) * BT
    C = math.ceil(T / L)
    acc = _acc(mod, b.dtype)
    hs = h0.stride() if h0 is not None else (0, 0)
    # With one channel its stride is never used: 0 tells the compiler the rows stay aligned (a
    # stride of 1 would make every offset's alignment unknown, and the loads scalar).
    hs = hs if D > 1 else (hs[0], 0)
    strides = (*(s for x in (a, b, out) for s in (x.stride(0), x.stride(1),
                                                  x.stride(2) if D > 1 else 0)), *hs)
    meta = {"HAS_H0": h0 is not None, "REVERSE": bool(reverse), "ACC": acc, "BLOCK_D": BD,
            "BLOCK_T": BT, "num_warps": 4}
    grid = (tiles * N, C)                   # program (tile of channels, row), chunk

    def launch(start, tot, PASS):
        mod.diag_scan[grid](a, b, out, h0, start, tot, T, D, L, *strides, PASS=PASS, **meta)

    def carries(tot, start):
        mod.diag_carries[(tiles * N,)](tot, h0, start, C, D, *hs, HAS_H0=h0 is not None,
                                       ACC=acc, BLOCK_D=BD)

    passes(b.device, "diag_scan", C, launch, carries, (N, C, 2, D), (N, C, D), b.dtype)


def _slices(n: int, step: int) -> list[slice]:
    """Consecutive slices of ``range(n)`` of at most ``step`` (``>= 1``) each."""
    step = max(1, step)
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def _three(x: torch.Tensor, N: int, T: int, D: int) -> torch.Tensor:
    try:
        return x.view(N, T, D)
    except RuntimeError:
        return x.reshape(N, T, D)


def diagonal_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None, *,
                  reverse: bool = False, dim: int = -1, block_t: int | None = None,
                  chunks: int | None = None) -> torch.Tensor:
    """All states of the elementwise recurrence ``h_t = a_t * h_{t-1} + b_t`` along ``dim``,
    by the Triton kernel (one ``tl.associative_scan`` per block of steps, a carry between
    blocks; see :mod:`paraprop.scan._triton_scan`).

    Forward: ``t = 0 .. T-1`` with ``h_{-1} = h0``; ``reverse=True``: ``h_t = a_t h_{t+1} +
    b_t`` for ``t = T-1 .. 0`` with ``h_T = h0``. The layout of ``(B, D, T)`` work with
    ``dim=-1`` (time contiguous) is the fastest; ``(B, T, D)`` with ``dim=-2`` is coalesced
    along ``D``; other strides work too.

    Arguments:
        a: the multipliers, ``b``'s shape or broadcasting to it.
        b: ``(..., T, ...)``, ``T`` along ``dim``, any ``T >= 1``.
        h0: the initial state, ``b``'s shape without ``dim`` (or broadcasting to it), or
            ``None`` for zero.
        reverse: run from the last step to the first.
        dim: the time dim.
        block_t: steps per block (a power of two; by default from the layout): for tests and
            tuning.
        chunks: split time into this many chunks (three kernels instead of one; by default
            only when there are too few rows to fill the device): for tests and tuning.

    Returns:
        The states, ``b``'s shape and dtype (accumulated in float32, float64 for float64).

    Raises:
        TypeError: non-tensors, mixed or unsupported dtypes.
        ValueError: shapes that do not broadcast, a bad ``dim``, ``block_t`` or ``chunks``.
        RuntimeError: no triton, or tensors the kernels cannot run on (a CPU tensor without
            ``TRITON_INTERPRET=1``; the message says which).

    Example (needs a CUDA device, or ``TRITON_INTERPRET=1`` on the CPU):
        >>> a, b = torch.rand(8, 64, 1000), torch.randn(8, 64, 1000)       # (B, D, T)
        >>> h = diagonal_scan(a, b)                                           # doctest: +SKIP
    """
    _check_tensors("diagonal_scan", a=a, b=b, h0=h0)
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse must be a bool, got {reverse!r}")
    if b.dim() < 1:
        raise ValueError(f"b must have at least one dim (time), got shape {tuple(b.shape)}")
    if not isinstance(dim, int) or not -b.dim() <= dim < b.dim():
        raise ValueError(f"dim must be an int in [{-b.dim()}, {b.dim() - 1}] for b of shape "
                         f"{tuple(b.shape)}, got {dim!r}")
    for name, v in (("block_t", block_t), ("chunks", chunks)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    dim %= b.dim()
    try:
        a = a.expand(b.shape)
    except RuntimeError:
        raise ValueError(f"a of shape {tuple(a.shape)} does not broadcast to b's "
                         f"{tuple(b.shape)}") from None
    rest = b.shape[:dim] + b.shape[dim + 1:]
    if h0 is not None:
        try:
            h0 = h0.expand(rest)
        except RuntimeError:
            raise ValueError(f"h0 must have b's shape without dim {dim}, {tuple(rest)}, or "
                             f"broadcast to it; got {tuple(h0.shape)}") from None
    require("diagonal_scan", b=b, a=a, h0=h0)
    N, T, D = math.prod(b.shape[:dim]), b.shape[dim], math.prod(b.shape[dim + 1:])
    out = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    diag_launch(_three(a, N, T, D), _three(b, N, T, D), out.view(N, T, D),
                None if h0 is None else _three(h0, N, 1, D)[:, 0], reverse, block_t, chunks)
    return out


# -- 2 x 2 steps ----------------------------------------------------------------------------------
# Tile of the 2 x 2 kernel, in rows x steps (six values per position).
PAIR_TILE = 512


def pair_launch(A: torch.Tensor, b: torch.Tensor, out: torch.Tensor, h0: torch.Tensor | None,
                reverse: bool, block_t: int | None = None, chunks: int | None = None) -> None:
    """The ``2 x 2`` kernel on ``A`` ``(N, T, 2, 2)``, ``b``, ``out`` ``(N, T, 2)`` (any
    strides), ``h0`` ``(N, 2)`` or ``None``."""
    N, T, _ = b.shape
    if N == 0 or T == 0:
        return
    BT = max(2, _pow2(block_t) if block_t is not None else min(_pow2(T), PAIR_TILE // 2))
    BN = min(_pow2(N), max(1, PAIR_TILE // BT))
    tiles, blocks = math.ceil(N / BN), math.ceil(T / BT)
    if tiles > MAX_GRID0:
        for rows in _slices(N, MAX_GRID0 * BN):
            pair_launch(A[rows], b[rows], out[rows], None if h0 is None else h0[rows], reverse,
                        block_t, chunks)
        return
    mod = load("paraprop.scan._triton_scan", b.device)
    C = _time_chunks(b.device, tiles, blocks, chunks)
    L = math.ceil(blocks / C) * BT
    C = math.ceil(T / L)
    acc = _acc(mod, b.dtype)
    hs = h0.stride() if h0 is not None else (0, 0)
    strides = (*A.stride(), *b.stride(), *out.stride(), *hs)
    meta = {"HAS_H0": h0 is not None, "REVERSE": bool(reverse), "ACC": acc, "BLOCK_N": BN,
            "BLOCK_T": BT, "num_warps": 4}

    def launch(start, tot, PASS):
        mod.pair_scan[(tiles, C)](A, b, out, h0, start, tot, T, N, L, *strides, PASS=PASS,
                                  **meta)

    def carries(tot, start):
        mod.pair_carries[(tiles,)](tot, h0, start, C, N, *hs, HAS_H0=h0 is not None, ACC=acc,
                                   BLOCK_N=BN)

    passes(b.device, "pair_scan", C, launch, carries, (N, C, 6), (N, C, 2), b.dtype)


def _time_chunks(device: torch.device, programs: int, blocks: int, chunks: int | None) -> int:
    """Chunks of time for a tree-scan kernel: ``chunks`` if given, else 1 unless ``programs``
    (independent tiles) leave the device's multiprocessors idle; then enough chunks of at least
    four blocks each to give every multiprocessor about four programs. At most
    :data:`MAX_GRID12` (the chunks are a grid axis of their own)."""
    if chunks is not None:
        return max(1, min(chunks, blocks, MAX_GRID12))
    sms = _sms(device)
    if not sms or programs >= 2 * sms:
        return 1
    return max(1, min(math.ceil(4 * sms / programs), blocks // 4, MAX_GRID12))


# -- the dense small-block scan -------------------------------------------------------------------
def dense_launch(A: torch.Tensor, b: torch.Tensor, out: torch.Tensor, h0: torch.Tensor | None,
                 reverse: bool, chunks: int | None = None) -> None:
    """The dense kernel on ``A`` ``(N, T, H, H)`` (any strides; expanded or transposed views
    are free), ``b``, ``out`` ``(N, T, H)``, ``h0`` ``(N, H)`` or ``None``."""
    N, T, H = b.shape
    if N == 0 or T == 0:
        return
    if N > MAX_GRID0:
        for rows in _slices(N, MAX_GRID0):
            dense_launch(A[rows], b[rows], out[rows], None if h0 is None else h0[rows], reverse,
                         chunks)
        return
    mod = load("paraprop.scan._triton_scan", b.device)
    HP = max(16, _pow2(H))
    if chunks is None:
        sms = _sms(b.device)
        C = 1 if not sms or N >= 4 * sms else max(1, min(T // 8, max(math.ceil(math.sqrt(T)),
                                                                     math.ceil(4 * sms / N))))
    else:
        C = chunks
    C = min(C, T, MAX_GRID12)
    L = math.ceil(T / C)
    C = math.ceil(T / L)
    acc = _acc(mod, b.dtype)
    hs = h0.stride() if h0 is not None else (0, 0)
    strides = (*A.stride(), *b.stride(), *out.stride(), *hs)
    meta = {"HAS_H0": h0 is not None, "REVERSE": bool(reverse), "ACC": acc, "HP": HP,
            "num_warps": 4}

    def launch(start, tot, PASS):
        mod.dense_scan[(N, C)](A, b, out, h0, start, tot, T, H, L, *strides, PASS=PASS,
                               **meta)

    def carries(tot, start):
        mod.dense_carries[(N,)](tot, h0, start, C, H, *hs, HAS_H0=h0 is not None, ACC=acc,
                                HP=HP)

    passes(b.device, "dense_scan", C, launch, carries, (N, C, HP + 1, HP), (N, C, HP), b.dtype)


def dense_scan(A: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None, *,
               reverse: bool = False, chunks: int | None = None) -> torch.Tensor:
    """All states of ``h_t = A_t h_{t-1} + b_t`` with dense ``H x H`` steps, ``H <=``
    :data:`MAX_DENSE`, by the Triton kernel (sequential in time within a chunk, one
    matrix-vector product per step; chunks of time in parallel when the batch is small).

    Arguments:
        A: ``(N | 1, T, H, H)`` (``1`` broadcasts; transposed views cost nothing).
        b: ``(N, T, H)``.
        h0: ``(N, H)`` or ``None``.
        reverse: ``h_t = A_t h_{t+1} + b_t`` from ``t = T-1`` down.
        chunks: the number of chunks of time (default: by the device's size): for tests and
            tuning.

    Returns:
        ``(N, T, H)`` in ``b``'s dtype.

    Raises:
        TypeError, ValueError: bad types, dtypes or shapes, ``H > MAX_DENSE``.
        RuntimeError: as :func:`diagonal_scan`.
    """
    _check_tensors("dense_scan", A=A, b=b, h0=h0)
    if b.dim() != 3:
        raise ValueError(f"b must have shape (N, T, H), got {tuple(b.shape)}")
    N, T, H = b.shape
    if A.dim() != 4 or A.shape[1:] != (T, H, H) or A.shape[0] not in (1, N):
        raise ValueError(f"A must have shape (N or 1, T, H, H) = ({N} or 1, {T}, {H}, {H}), "
                         f"got {tuple(A.shape)}")
    if H > MAX_DENSE:
        raise ValueError(f"dense_scan takes H <= {MAX_DENSE}, got H={H}")
    if h0 is not None and tuple(h0.shape) != (N, H):
        raise ValueError(f"h0 must have shape (N, H) = ({N}, {H}), got {tuple(h0.shape)}")
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool)
                               or chunks < 1):
        raise ValueError(f"chunks must be a positive int or None, got {chunks!r}")
    require("dense_scan", b=b, A=A, h0=h0)
    out = torch.empty(N, T, H, dtype=b.dtype, device=b.device)
    dense_launch(A.expand(N, T, H, H), b, out, h0, reverse, chunks)
    return out


# -- linear_recurrence(method="triton") -----------------------------------------------------------
# Largest dense copy of factored or LSTM steps that ``method="auto"`` makes to run them by
# the dense kernel (bytes); beyond it auto keeps the torch methods, which never form it.
DENSE_BUDGET = 1 << 30


def applies(op, b: torch.Tensor) -> bool:
    """Whether ``method="auto"`` picks the kernels for this canonical recurrence: CUDA
    tensors, triton, a supported dtype, and a diagonal ``A``, a dense one with a state of at
    most :data:`MAX_DENSE`, or factored / LSTM steps of that size whose dense copy fits in
    :data:`DENSE_BUDGET`."""
    if b.device.type != "cuda" or why_not(b=b, **_named(op)) is not None or failed():
        return False
    if op.kind == "diag":
        return True
    if op.H > MAX_DENSE:
        return False
    N, T, H = b.shape
    return op.kind == "dense" or N * T * H * H * b.element_size() <= DENSE_BUDGET


def _named(op) -> dict[str, torch.Tensor | None]:
    """The transition's tensors by name (``A``, or ``A.<field>`` for factored steps)."""
    if op.kind in ("dense", "diag"):
        return {"A": op.a}
    return {f"A.{name}": t for name, t in zip(op.FIELDS[op.kind], op.tensors(), strict=True)}


def recurrence(op, b: torch.Tensor, h0: torch.Tensor | None, reverse: bool) -> torch.Tensor:
    """The states ``(N, T, H)`` of a canonical recurrence (:class:`paraprop.scan.operators.Op`)
    by the kernels: diagonal ``A`` by the diagonal scan, ``2 x 2`` steps by the pair scan;
    dense, factored and LSTM ``A`` with ``H <= MAX_DENSE`` by the dense scan (factored and LSTM
    steps materialised densely)."""
    require("linear_recurrence(method='triton')", b=b, h0=h0, **_named(op))
    N, T, H = b.shape
    if op.kind != "diag" and H > MAX_DENSE:
        raise ValueError(f"method='triton' runs {op.kind} transitions with a state of at "
                         f"most {MAX_DENSE} (one H x H step per program); got H={H}: use "
                         "method='chunked' or 'blelloch'")
    out = torch.empty(N, T, H, dtype=b.dtype, device=b.device)
    if op.kind == "diag":
        diag_launch(op.a.expand(N, T, H), b, out, h0, reverse)
    elif H == 2:
        pair_launch(op.dense().expand(N, T, 2, 2), b, out, h0, reverse)
    else:
        dense_launch(op.dense().expand(N, T, H, H), b, out, h0, reverse)
    return out
