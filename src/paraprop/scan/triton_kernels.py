"""Triton kernels for :func:`paraprop.scan.linear_recurrence` on the GPU (``method="triton"``):
the host side of :mod:`paraprop.scan._triton_scan`.

The GPU's counterpart of :mod:`paraprop.scan.native`: where the CPU runs one native C call, a
CUDA tensor runs one (or three) Triton kernels (:mod:`paraprop.scan._triton_scan` says how they
work). Two entry points a benchmark can call directly:

- :func:`diagonal_scan`: ``h_t = a_t * h_{t-1} + b_t`` elementwise along any dim, forward or
  reverse, any length, float16 / bfloat16 / float32 / float64 inputs with float32 (float64)
  accumulation;
- :func:`dense_scan`: ``h_t = A_t h_{t-1} + b_t`` with dense ``H x H`` steps, ``H <=``
  :data:`MAX_DENSE` (the BPPSA backward of small recurrent cells, and ParaLSTM's ``2 x 2``
  blocks).

Where the kernels run, how they are loaded (once per mode: compiled for CUDA tensors,
interpreted for CPU tensors under ``TRITON_INTERPRET=1``), what a failed launch does and the
launch geometry shared with :mod:`paraprop.nn.triton_cells` are
:mod:`paraprop.scan.triton_runtime`'s (``triton_runtime.status()`` says whether they can run and
why not).

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

import math

import torch

from paraprop.scan import triton_runtime as rt

__all__ = ["MAX_DENSE", "dense_scan", "diagonal_scan"]

# Largest state size of the dense kernel: one H x H step lives in a program's registers.
MAX_DENSE = 64
# Tile of the diagonal kernel, in values: 2048 per block of steps (16 per thread of 4 warps).
TILE = 2048

def _check_tensors(entry: str, **tensors: torch.Tensor | None) -> None:
    """Tensors (``h0`` may be ``None``) of one supported dtype."""
    for name, t in tensors.items():
        if t is None and name == "h0":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    b = tensors["b"]
    assert b is not None        # a tensor: checked above
    if b.dtype not in rt.DTYPES:
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
        BT = rt.pow2(block_t)
        BD = min(rt.pow2(D), max(1, TILE // BT))
    elif b.stride(1) == 1 or D == 1:          # time contiguous: long blocks of steps
        BD = 1 if D == 1 else min(rt.pow2(D), 4)
        BT = min(rt.pow2(T), TILE // BD)
    elif b.stride(2) == 1:                    # channels contiguous: wide tiles
        BD = min(rt.pow2(D), 32)
        BT = min(rt.pow2(T), TILE // BD)
    else:
        BD = min(rt.pow2(D), 16)
        BT = min(rt.pow2(T), 64)
    BT = max(BT, 2)
    tiles = math.ceil(D / BD)
    if tiles > rt.MAX_GRID0:
        raise ValueError(f"diagonal_scan: {D} channels per row need {tiles} programs, more than "
                         f"a CUDA grid's {rt.MAX_GRID0}")
    if N * tiles > rt.MAX_GRID0:               # more programs than axis 0 holds: slices of rows
        for rows in rt.slices(N, rt.MAX_GRID0 // tiles):
            diag_launch(a[rows], b[rows], out[rows], None if h0 is None else h0[rows],
                        reverse, block_t, chunks)
        return
    mod = rt.load("paraprop.scan._triton_scan", b.device)
    blocks = math.ceil(T / BT)
    C = rt.time_chunks(b.device, N * tiles, blocks, chunks)
    L = math.ceil(blocks / C) * BT
    C = math.ceil(T / L)
    acc = rt.acc_type(mod, b.dtype)
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

    rt.passes(b.device, "diag_scan", C, launch, carries, (N, C, 2, D), (N, C, D), b.dtype)


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
    rt.require("diagonal_scan", b=b, a=a, h0=h0)
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
    BT = max(2, rt.pow2(block_t) if block_t is not None else min(rt.pow2(T), PAIR_TILE // 2))
    BN = min(rt.pow2(N), max(1, PAIR_TILE // BT))
    tiles, blocks = math.ceil(N / BN), math.ceil(T / BT)
    if tiles > rt.MAX_GRID0:
        for rows in rt.slices(N, rt.MAX_GRID0 * BN):
            pair_launch(A[rows], b[rows], out[rows], None if h0 is None else h0[rows], reverse,
                        block_t, chunks)
        return
    mod = rt.load("paraprop.scan._triton_scan", b.device)
    C = rt.time_chunks(b.device, tiles, blocks, chunks)
    L = math.ceil(blocks / C) * BT
    C = math.ceil(T / L)
    acc = rt.acc_type(mod, b.dtype)
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

    rt.passes(b.device, "pair_scan", C, launch, carries, (N, C, 6), (N, C, 2), b.dtype)


# -- the dense small-block scan -------------------------------------------------------------------
def dense_launch(A: torch.Tensor, b: torch.Tensor, out: torch.Tensor, h0: torch.Tensor | None,
                 reverse: bool, chunks: int | None = None) -> None:
    """The dense kernel on ``A`` ``(N, T, H, H)`` (any strides; expanded or transposed views
    are free), ``b``, ``out`` ``(N, T, H)``, ``h0`` ``(N, H)`` or ``None``."""
    N, T, H = b.shape
    if N == 0 or T == 0:
        return
    if N > rt.MAX_GRID0:
        for rows in rt.slices(N, rt.MAX_GRID0):
            dense_launch(A[rows], b[rows], out[rows], None if h0 is None else h0[rows], reverse,
                         chunks)
        return
    mod = rt.load("paraprop.scan._triton_scan", b.device)
    HP = max(16, rt.pow2(H))
    if chunks is None:
        sms = rt.multiprocessors(b.device)
        C = 1 if not sms or N >= 4 * sms else max(1, min(T // 8, max(math.ceil(math.sqrt(T)),
                                                                     math.ceil(4 * sms / N))))
    else:
        C = chunks
    C = min(C, T, rt.MAX_GRID12)
    L = math.ceil(T / C)
    C = math.ceil(T / L)
    acc = rt.acc_type(mod, b.dtype)
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

    rt.passes(b.device, "dense_scan", C, launch, carries, (N, C, HP + 1, HP), (N, C, HP),
              b.dtype)


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
    rt.require("dense_scan", b=b, A=A, h0=h0)
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
    if b.device.type != "cuda" or rt.why_not(b=b, **_named(op)) is not None or rt.failed():
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
    """The states ``(N, T, H)`` of a canonical recurrence (:class:`paraprop.scan.transitions.Op`)
    by the kernels: diagonal ``A`` by the diagonal scan, ``2 x 2`` steps by the pair scan;
    dense, factored and LSTM ``A`` with ``H <= MAX_DENSE`` by the dense scan (factored and LSTM
    steps materialised densely)."""
    rt.require("linear_recurrence(method='triton')", b=b, h0=h0, **_named(op))
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
