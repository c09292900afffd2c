"""Native (C) sequential kernels for :func:`paraprop.scan.linear_recurrence` on the CPU: the
bindings.

On a small CPU a PyTorch operator costs a few microseconds of dispatch, so ``T`` small steps of
``h_t = A_t h_{t-1} + b_t`` cost ``T`` times that however small ``H`` is. These kernels run the
whole recurrence in one call: the sequential algorithm without per-step dispatch (the same
``O(T H^2)`` work, none of the ``H``-fold extra work of a tree scan), with the independent batch
rows split across threads.

The C source is ``kernels.c`` beside this module (package data). :mod:`paraprop.scan.native_build`
compiles it on first use with the system C compiler into a per-user cache directory, checks
what it loads the way ssh checks its files, and says why when the kernels cannot be used
(:func:`status`); every caller then falls back to the pure-PyTorch algorithms.
``PARAPROP_NATIVE=0`` disables the kernels. This module holds what calls them: the ctypes
bindings, one per kernel, and the split of the batch rows across threads.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import torch

from paraprop.scan.native_build import _DTYPES, _library, available, status

__all__ = ["available", "status", "supports"]

# Below this many multiply-adds a call runs on one thread (thread hand-off costs ~20 us).
_MIN_WORK_PER_THREAD = 200_000
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def supports(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels can run on these tensors: CPU, all float32 or all float64."""
    ts = [t for t in tensors if t is not None]
    return (bool(ts) and all(t.device.type == "cpu" and t.dtype in _DTYPES for t in ts)
            and len({t.dtype for t in ts}) == 1 and available())


def _threads(N: int, work_per_row: int) -> int:
    n = min(torch.get_num_threads(), N, max(1, (N * work_per_row) // _MIN_WORK_PER_THREAD))
    return max(1, n)


def _run_split(N: int, work_per_row: int, call) -> None:
    """Run ``call(n0, n1)`` over batch rows ``[0, N)`` on up to ``torch.get_num_threads()``
    threads (ctypes releases the GIL during the call).

    The rows are cut into about four pieces per thread that the threads take from a shared
    counter, the calling thread included: on a machine shared with other jobs a descheduled
    thread then delays only its current piece, not a fixed half of the work.
    """
    global _pool, _pool_size
    k = _threads(N, work_per_row)
    if k == 1:
        call(0, N)
        return
    if _pool is None or _pool_size < k - 1:  # the calling thread is one of the k
        _pool = ThreadPoolExecutor(max_workers=k - 1, thread_name_prefix="paraprop-scan")
        _pool_size = k - 1
    pieces = min(N, 4 * k)
    bounds = [N * i // pieces for i in range(pieces + 1)]
    counter = itertools.count()  # next() on it is atomic under the GIL

    def worker() -> None:
        while (i := next(counter)) < pieces:
            call(bounds[i], bounds[i + 1])

    futures = [_pool.submit(worker) for _ in range(k - 1)]
    worker()
    for f in futures:
        f.result()


def _ptr(t: torch.Tensor | None, n0: int, sn: int) -> int | None:
    if t is None:
        return None
    return t.data_ptr() + n0 * sn * t.element_size()


def _bt_strides(t: torch.Tensor | None) -> tuple[int, int]:
    """(batch, time) strides in elements of a (N, T, ...) tensor; 0 for a broadcast batch."""
    if t is None:
        return 0, 0
    return (t.stride(0) if t.shape[0] > 1 else 0), t.stride(1)


def dense(A: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None, out: torch.Tensor,
          reverse: bool) -> torch.Tensor:
    """``out[n, t] = A[n, t] @ h_prev + b[n, t]``; A (N|1, T, H, H), b/out (N, T, H), h0 (N, H)."""
    N, T, H = b.shape
    lib = _library(H, 0, N * T)
    suffix = _DTYPES[b.dtype][0]
    fn = getattr(lib, f"pp_dense_{suffix}")
    A_sn, A_st = _bt_strides(A)
    b_sn, b_st = _bt_strides(b)
    o_sn, o_st = _bt_strides(out)
    h_sn = h0.stride(0) if h0 is not None else 0

    def call(n0: int, n1: int) -> None:
        fn(n1 - n0, T, H, int(reverse), _ptr(A, n0, A_sn), A_sn, A_st, _ptr(b, n0, b_sn), b_sn,
           b_st, _ptr(h0, n0, h_sn), h_sn, _ptr(out, n0, o_sn), o_sn, o_st)

    _run_split(N, T * H * H, call)
    return out


def diag(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None, out: torch.Tensor,
         reverse: bool) -> torch.Tensor:
    """``out[n, t] = a[n, t] * h_prev + b[n, t]``; a (N|1, T, H), b/out (N, T, H), h0 (N, H)."""
    N, T, H = b.shape
    lib = _library(H, 0, N * T)
    fn = getattr(lib, f"pp_diag_{_DTYPES[b.dtype][0]}")
    a_sn, a_st = _bt_strides(a)
    b_sn, b_st = _bt_strides(b)
    o_sn, o_st = _bt_strides(out)
    h_sn = h0.stride(0) if h0 is not None else 0

    def call(n0: int, n1: int) -> None:
        fn(n1 - n0, T, H, int(reverse), _ptr(a, n0, a_sn), a_sn, a_st, _ptr(b, n0, b_sn), b_sn,
           b_st, _ptr(h0, n0, h_sn), h_sn, _ptr(out, n0, o_sn), o_sn, o_st)

    _run_split(N, T * H, call)
    return out


def factored(d: torch.Tensor | None, s: torch.Tensor, LT: torch.Tensor | None,
             RT: torch.Tensor | None, b: torch.Tensor, h0: torch.Tensor | None,
             out: torch.Tensor, reverse: bool) -> torch.Tensor:
    """``A_t = diag(d_t) + L diag(s_t) R`` (see :class:`paraprop.scan.Factored`), given the
    contiguous transposes ``LT = L^T`` ``(K, H)`` and ``RT = R^T`` ``(H, K)`` (or None)."""
    N, T, H = b.shape
    K = s.shape[-1]
    lib = _library(H, K, N * T)
    fn = getattr(lib, f"pp_factored_{_DTYPES[b.dtype][0]}")
    d_sn, d_st = _bt_strides(d)
    s_sn, s_st = _bt_strides(s)
    b_sn, b_st = _bt_strides(b)
    o_sn, o_st = _bt_strides(out)
    h_sn = h0.stride(0) if h0 is not None else 0
    Lp = LT.data_ptr() if LT is not None else None
    Rp = RT.data_ptr() if RT is not None else None

    def call(n0: int, n1: int) -> None:
        fn(n1 - n0, T, H, K, int(reverse), _ptr(d, n0, d_sn), d_sn, d_st, _ptr(s, n0, s_sn),
           s_sn, s_st, Lp, Rp, _ptr(b, n0, b_sn), b_sn, b_st, _ptr(h0, n0, h_sn), h_sn,
           _ptr(out, n0, o_sn), o_sn, o_st)

    _run_split(N, T * H * K * 2, call)
    return out


def lstm(s: torch.Tensor, f: torch.Tensor, k: torch.Tensor, W: torch.Tensor, transposed: bool,
         b: torch.Tensor, h0: torch.Tensor | None, out: torch.Tensor,
         reverse: bool) -> torch.Tensor:
    """:class:`paraprop.scan.LSTMFactored` steps on the state ``[h; c]`` (``b`` ``(N, T, 2Hc)``),
    given ``W = W_hh`` ``(4Hc, Hc)`` when ``transposed``, else ``W = W_hh^T`` ``(Hc, 4Hc)``,
    contiguous."""
    N, T, H2 = b.shape
    Hc = H2 // 2
    lib = _library(Hc, 0, N * T)
    fn = getattr(lib, f"pp_lstm_{_DTYPES[b.dtype][0]}")
    s_sn, s_st = _bt_strides(s)
    f_sn, f_st = _bt_strides(f)
    k_sn, k_st = _bt_strides(k)
    b_sn, b_st = _bt_strides(b)
    o_sn, o_st = _bt_strides(out)
    h_sn = h0.stride(0) if h0 is not None else 0
    Wp = W.data_ptr()

    def call(n0: int, n1: int) -> None:
        fn(n1 - n0, T, Hc, int(transposed), int(reverse), _ptr(s, n0, s_sn), s_sn, s_st,
           _ptr(f, n0, f_sn), f_sn, f_st, _ptr(k, n0, k_sn), k_sn, k_st, Wp,
           _ptr(b, n0, b_sn), b_sn, b_st, _ptr(h0, n0, h_sn), h_sn, _ptr(out, n0, o_sn), o_sn,
           o_st)

    _run_split(N, T * Hc * Hc * 8, call)
    return out


# -- the cells' forward recurrences (paraprop.nn forward="native") --------------------------------
# Each takes time-major (T, B, .) tensors: the input terms of every step (computed beforehand in
# one matrix product), the transposed hidden weights W_hh^T contiguous, and writes the states (and
# optionally what the scan backward needs) into time-major outputs. Batch rows run on threads.

def _tb(t: torch.Tensor | None) -> tuple[int, int]:
    """(batch, time) strides in elements of a time-major (T, B, ...) tensor."""
    return (0, 0) if t is None else (t.stride(1), t.stride(0))


def _row(t: torch.Tensor | None, n0: int) -> int | None:
    return None if t is None else t.data_ptr() + n0 * t.stride(1) * t.element_size()


def _row0(t: torch.Tensor | None, n0: int) -> int | None:
    """Pointer to batch row ``n0`` of a ``(B, H)`` initial state."""
    return None if t is None else t.data_ptr() + n0 * t.stride(0) * t.element_size()


def rnn_forward(p: torch.Tensor, WT: torch.Tensor, h0: torch.Tensor | None, out: torch.Tensor,
                relu: bool) -> torch.Tensor:
    """``out_t = act(p_t + W_hh out_{t-1})``: ``p``/``out`` ``(T, B, H)`` (``p`` holds
    ``W_ih x_t`` and both biases), ``WT = W_hh^T`` contiguous, ``h0`` ``(B, H)`` or None
    (zeros); ``act`` is tanh, or ReLU with ``relu``."""
    T, N, H = p.shape
    fn = getattr(_library(H, 0, N * T), f"pp_rnn_fwd_{_DTYPES[p.dtype][0]}")
    p_sn, p_st = _tb(p)
    o_sn, o_st = _tb(out)
    h_sn = h0.stride(0) if h0 is not None else 0
    Wp = WT.data_ptr()

    def call(n0: int, n1: int) -> None:
        fn(n1 - n0, T, H, int(relu), _row(p, n0), p_sn, p_st, Wp, _row0(h0, n0), h_sn,
           _row(out, n0), o_sn, o_st)

    _run_split(N, T * H * H, call)
    return out


def gru_forward(gi: torch.Tensor, WT: torch.Tensor, b_hh: torch.Tensor | None,
                h0: torch.Tensor | None, out: torch.Tensor,
                factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
    """torch's GRU steps: ``gi`` ``(T, B, 3H)`` = ``W_ih x_t + b_ih``, ``WT = W_hh^T``
    ``(H, 3H)`` contiguous, ``b_hh`` ``(3H,)`` or None, ``h0`` ``(B, H)`` or None; the states
    into ``out`` ``(T, B, H)``, and with ``factors = (z, s, dn)`` (``(T, B, H)``,
    ``(T, B, 3H)``, ``(T, B, H)``) the factors of the transposed Jacobians
    (:func:`paraprop.jacobians.cells.gru_scale`)."""
    T, N, G = gi.shape
    H = G // 3
    fn = getattr(_library(H, 0, N * T), f"pp_gru_fwd_{_DTYPES[gi.dtype][0]}")
    z, s, dn = factors if factors is not None else (None, None, None)
    g_sn, g_st = _tb(gi)
    o_sn, o_st = _tb(out)
    strides = [_tb(z), _tb(s), _tb(dn)]
    h_sn = h0.stride(0) if h0 is not None else 0
    Wp, bp = WT.data_ptr(), (b_hh.data_ptr() if b_hh is not None else None)

    def call(n0: int, n1: int) -> None:
        fn(n1 - n0, T, H, _row(gi, n0), g_sn, g_st, Wp, bp, _row0(h0, n0), h_sn,
           _row(out, n0), o_sn, o_st, _row(z, n0), *strides[0], _row(s, n0), *strides[1],
           _row(dn, n0), *strides[2])

    _run_split(N, T * H * H * 3, call)
    return out


def lstm_forward(gi: torch.Tensor, WT: torch.Tensor, h0: torch.Tensor | None,
                 c0: torch.Tensor | None, out: torch.Tensor, cell: torch.Tensor,
                 factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
    """torch's LSTM steps: ``gi`` ``(T, B, 4H)`` = ``W_ih x_t + b_ih + b_hh``,
    ``WT = W_hh^T`` ``(H, 4H)`` contiguous, ``h0``/``c0`` ``(B, H)`` or None; the hidden
    states into ``out`` and the cells into ``cell`` (``(T, B, H)``), and with
    ``factors = (s, f, k)`` (``(T, B, 4H)``, ``(T, B, H)``, ``(T, B, H)``) the factors of
    :func:`paraprop.jacobians.cells.lstm_scale`."""
    T, N, G = gi.shape
    H = G // 4
    fn = getattr(_library(H, 0, N * T), f"pp_lstm_fwd_{_DTYPES[gi.dtype][0]}")
    s, f, k = factors if factors is not None else (None, None, None)
    g_sn, g_st = _tb(gi)
    strides = [_tb(t) for t in (out, cell, s, f, k)]
    h_sn = h0.stride(0) if h0 is not None else 0
    c_sn = c0.stride(0) if c0 is not None else 0
    Wp = WT.data_ptr()

    def call(n0: int, n1: int) -> None:
        fn(n1 - n0, T, H, _row(gi, n0), g_sn, g_st, Wp, _row0(h0, n0), h_sn, _row0(c0, n0),
           c_sn, *[v for t, st in zip((out, cell, s, f, k), strides, strict=True)
                   for v in (_row(t, n0), *st)])

    _run_split(N, T * H * H * 4, call)
    return out
