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
(:func:`status`); ``method="auto"`` then runs the pure-PyTorch methods, and
``method="native"`` raises saying why. ``PARAPROP_NATIVE=0`` disables the kernels. This module
holds what calls them: :func:`recurrence` (``method="native"``), the ctypes bindings, one per
kernel, and the split of the batch rows across threads.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import overload

import torch

from paraprop.scan.native_build import _DTYPES, _library, available, status
from paraprop.scan.transitions import Op

__all__ = ["available", "recurrence", "status", "supports", "why_not"]

# Below this many multiply-adds a call runs on one thread (thread hand-off costs ~20 us).
_MIN_WORK_PER_THREAD = 200_000
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def supports(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels can run on these tensors: CPU, all float32 or all float64."""
    return why_not(*tensors) is None


def why_not(*tensors: torch.Tensor | None) -> str | None:
    """``None`` when the kernels can run on ``tensors`` (``None`` values skipped), else why not:
    the tensors are not all CPU float32 or all CPU float64 (the message names the devices and
    dtypes found), or the kernels are disabled or not built (:func:`status`)."""
    ts = [t for t in tensors if t is not None]
    kinds = {(t.device.type, t.dtype) for t in ts}
    if len(kinds) != 1 or not all(d == "cpu" and dt in _DTYPES for d, dt in kinds):
        found = ", ".join(sorted(f"{d} {dt}" for d, dt in kinds))
        return (f"the native scan kernels need CPU float32/float64 tensors of one dtype, got "
                f"{found or 'none'}")
    if not available():
        return f"the native scan kernels are {status()}"
    return None


def recurrence(op: Op, b: torch.Tensor, h0: torch.Tensor | None, reverse: bool) -> torch.Tensor:
    """All states of ``h_t = A_t h_prev + b_t`` of a canonical recurrence (``b`` ``(N, T, H)``,
    ``h0`` ``(N, H)`` or None; :class:`paraprop.scan.transitions.Op`) in one native call
    (``method="native"``).

    Raises:
        RuntimeError: the kernels cannot run on these tensors (:func:`why_not` says why).
    """
    reason = why_not(b, h0, *op.tensors())
    if reason is not None:
        raise RuntimeError(f"method='native' cannot run here: {reason}")
    b = _rows_contiguous(b, 1)
    h0 = _rows_contiguous(h0, 1)
    out = torch.empty_like(b)
    if out.stride(-1) != 1:
        out = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    if op.kind == "dense":
        return dense(_rows_contiguous(op.a, 2), b, h0, out, reverse)
    if op.kind == "diag":
        return diag(_rows_contiguous(op.a, 1), b, h0, out, reverse)
    if op.kind == "lstm":   # the kernel takes W_hh (transposed steps) or W_hh^T (forward)
        W = (op.W if op.tr else op.W.t()).contiguous()
        return lstm(_rows_contiguous(op.s, 1), _rows_contiguous(op.f, 1),
                    _rows_contiguous(op.k, 1), W, op.tr, b, h0, out, reverse)
    LT = op.L.t().contiguous() if op.L is not None else None   # the kernel takes L^T and R^T
    RT = op.R.t().contiguous() if op.R is not None else None
    return factored(_rows_contiguous(op.d, 1), _rows_contiguous(op.s, 1), LT, RT, b, h0, out,
                    reverse)


@overload
def _rows_contiguous(x: torch.Tensor, feature_dims: int) -> torch.Tensor: ...
@overload
def _rows_contiguous(x: None, feature_dims: int) -> None: ...
def _rows_contiguous(x: torch.Tensor | None, feature_dims: int) -> torch.Tensor | None:
    """``x`` with its trailing ``feature_dims`` dims contiguous (batch/time strides are free)."""
    if x is None:
        return None
    shape, strides = x.shape[-feature_dims:], x.stride()[-feature_dims:]
    expect, ok = 1, True
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size > 1 and stride != expect:
            ok = False
        expect *= size
    return x if ok else x.contiguous()


def _kernel(name: str, H: int, K: int, rows_steps: int, dtype: torch.dtype):
    """The kernel ``pp_<name>`` for ``dtype`` from the library for state size ``H`` (and ``K``)
    and ``rows_steps`` (row, step) pairs (:func:`paraprop.scan.native_build._library`)."""
    return getattr(_library(H, K, rows_steps), f"pp_{name}_{_DTYPES[dtype][0]}")


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


def _plain(kind: str, a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None,
           out: torch.Tensor, reverse: bool, work_per_row: int) -> torch.Tensor:
    """The kernels whose steps are one tensor ``a`` (``pp_dense``, ``pp_diag``)."""
    N, T, H = b.shape
    fn = _kernel(kind, H, 0, N * T, b.dtype)
    a_sn, a_st = _bt_strides(a)
    b_sn, b_st = _bt_strides(b)
    o_sn, o_st = _bt_strides(out)
    h_sn = h0.stride(0) if h0 is not None else 0

    def call(n0: int, n1: int) -> None:
        fn(n1 - n0, T, H, int(reverse), _ptr(a, n0, a_sn), a_sn, a_st, _ptr(b, n0, b_sn), b_sn,
           b_st, _ptr(h0, n0, h_sn), h_sn, _ptr(out, n0, o_sn), o_sn, o_st)

    _run_split(N, work_per_row, call)
    return out


def dense(A: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None, out: torch.Tensor,
          reverse: bool) -> torch.Tensor:
    """``out[n, t] = A[n, t] @ h_prev + b[n, t]``; A (N|1, T, H, H), b/out (N, T, H), h0 (N, H)."""
    N, T, H = b.shape
    return _plain("dense", A, b, h0, out, reverse, T * H * H)


def diag(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None, out: torch.Tensor,
         reverse: bool) -> torch.Tensor:
    """``out[n, t] = a[n, t] * h_prev + b[n, t]``; a (N|1, T, H), b/out (N, T, H), h0 (N, H)."""
    N, T, H = b.shape
    return _plain("diag", a, b, h0, out, reverse, T * H)


def factored(d: torch.Tensor | None, s: torch.Tensor, LT: torch.Tensor | None,
             RT: torch.Tensor | None, b: torch.Tensor, h0: torch.Tensor | None,
             out: torch.Tensor, reverse: bool) -> torch.Tensor:
    """``A_t = diag(d_t) + L diag(s_t) R`` (see :class:`paraprop.scan.Factored`), given the
    contiguous transposes ``LT = L^T`` ``(K, H)`` and ``RT = R^T`` ``(H, K)`` (or None)."""
    N, T, H = b.shape
    K = s.shape[-1]
    fn = _kernel("factored", H, K, N * T, b.dtype)
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
    fn = _kernel("lstm", Hc, 0, N * T, b.dtype)
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
    fn = _kernel("rnn_fwd", H, 0, N * T, p.dtype)
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
    fn = _kernel("gru_fwd", H, 0, N * T, gi.dtype)
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
    fn = _kernel("lstm_fwd", H, 0, N * T, gi.dtype)
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
