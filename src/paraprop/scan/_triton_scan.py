"""The Triton kernels of :mod:`paraprop.scan.triton_kernels` (the GPU's counterpart of the native
C kernels). Only :mod:`paraprop.scan.triton_runtime` loads this file, once per mode (compiled for
CUDA tensors, interpreted for CPU tensors under ``TRITON_INTERPRET=1``), as a module of its own;
without triton the file still imports (pytest collects it) and defines nothing that runs.

Two recurrences, ``h_t = A_t h_prev + b_t`` along time with ``h_prev = h0`` (or zero) before the
first step, forward or reverse:

- :func:`diag_scan`: diagonal ``A`` (elementwise ``a``). A program owns a tile of ``BLOCK_D``
  channels and walks its span of time in blocks of ``BLOCK_T`` steps: per block one
  ``tl.associative_scan`` of the affine maps ``(a, b)`` (the composition ``(a1, b1) then (a2,
  b2) = (a2 a1, a2 b1 + b2)``, Blelloch 1990), then ``h = A_cum * carry + B_cum`` and the carry
  for the next block is ``h`` at the block's last step. Positions past the end are identity maps
  (``a = 1``, ``b = 0``), so any ``T`` works. Reverse runs the same tiles in decreasing time with
  the scan's ``reverse=True`` (the loads stay in increasing address order: vectorised).
- :func:`pair_scan`: ``2 x 2`` steps (ParaLSTM's per-unit blocks), the same tree scan on the
  six entries of the affine maps (:func:`_affine2`).
- :func:`dense_scan`: dense ``H x H`` steps, ``H <= 64`` (padded to ``HP``, a power of two
  ``>= 16``): sequential in time inside a program, one matrix-vector product per step.

Both split time into ``C`` chunks when there are too few independent rows to fill the device
(``PASS``): pass 1 runs every chunk from a zero start and keeps only its transfer (``prod a`` or
the product ``P`` of its matrices, by ``tl.dot`` in IEEE float32) and its end state; a small
kernel (:func:`diag_carries`, :func:`dense_carries`) walks the ``C`` chunks to get each chunk's
true start; pass 2 re-runs every chunk from it and writes the states. With ``C = 1`` pass 0 runs
alone (one read of the inputs, one write of the states). Accumulation is float32 (float64 for
float64 inputs); inputs and outputs may be float16 or bfloat16. Grids: rows (and tiles of
channels) on axis 0, chunks on axis 1 (CUDA allows 65535 there, ``2^31 - 1`` on axis 0).

The helpers (:func:`_jit`, :data:`_SUM`, :func:`_affine`, :func:`_block`, :func:`_at`, the
``_diag_*`` functions of the diagonal carry, :func:`_affine2` and the ``_pair_*`` functions of the
``2 x 2`` one) are shared: :mod:`paraprop.nn._triton_cells` takes them from the copy of this
module loaded in its own mode (:func:`paraprop.scan.triton_runtime.load_mode`).
"""

from __future__ import annotations

import os
import types

try:
    import triton
    import triton.language as tl
except ImportError:     # no triton: the module imports, and nothing here is ever launched
    triton, tl = None, types.SimpleNamespace(constexpr=None)


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def _interpreted() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Whether this copy of the module is the interpreted one (the loader forces the mode while it
# runs the file; triton reads it when a function is decorated).
INTERPRETED = triton is not None and _interpreted()


@_jit
def _add(x, y):
    return x + y


# The sums of the kernels: the interpreter adds with numpy when it is given triton's own sum
# (any other combine runs element by element in Python); compiled, our own function, so that
# nothing here depends on the mode triton's standard library was imported in.
_SUM = getattr(getattr(tl, "standard", None), "_sum_combine", None) if INTERPRETED else None
_SUM = _SUM if _SUM is not None else _add


@_jit
def _affine(a1, b1, a2, b2):
    """``(a1, b1)`` then ``(a2, b2)``: ``h -> a2 (a1 h + b1) + b2``."""
    return a2 * a1, a2 * b1 + b2


@_jit
def _block(T, s0, s_hi, i, rows, BLOCK_T: tl.constexpr, REVERSE: tl.constexpr):
    """The times (int64) of the block of steps ``[s0, s0 + BLOCK_T)`` in scan order (``i`` is
    ``arange(BLOCK_T)``; ``REVERSE``: step ``s`` is time ``T - 1 - s``), in increasing order
    (the loads stay vectorised), and the mask (``rows`` by times) of the valid rows' steps
    before step ``s_hi``."""
    if REVERSE:     # the block's times, increasing: [T - s0 - BLOCK_T, T - s0)
        t = T - s0 - BLOCK_T + i
        tm = t >= T - s_hi
    else:
        t = s0 + i
        tm = t < s_hi
    return t.to(tl.int64), rows[:, None] & tm[None, :]


@_jit
def _diag_block(a, b, carry, prod, last, PASS: tl.constexpr, REVERSE: tl.constexpr):
    """One block of the diagonal scan (rows by steps): the states ``h`` from each row's
    ``carry``, the carry for the next block (``h`` at the step ``last`` marks) and, in pass 1,
    the chunk's transfer ``prod`` extended by the block's."""
    A, B = tl.associative_scan((a, b), 1, _affine, reverse=REVERSE)
    h = A * carry[:, None] + B
    if PASS == 1:
        prod = prod * _at(last, A)
    return h, _at(last, h), prod


@_jit
def _diag_total(ptr, D, d, prod, end, mask):
    """A chunk's transfer ``prod`` and end state ``end`` for channels ``d``: ``2 D`` values
    per row from ``ptr``."""
    tl.store(ptr + d, prod, mask=mask)
    tl.store(ptr + D + d, end, mask=mask)


@_jit
def _at(last, x):
    """``x`` at the one step of each row that ``last`` marks (the block's last in scan order)."""
    return tl.reduce(tl.where(last, x, 0.0), 1, _SUM)


@_jit
def diag_scan(a_ptr, b_ptr, out_ptr, h0_ptr, start_ptr, tot_ptr,
              T, D, L,
              sa_n, sa_t, sa_d, sb_n, sb_t, sb_d, so_n, so_t, so_d, sh_n, sh_d,
              HAS_H0: tl.constexpr, REVERSE: tl.constexpr, PASS: tl.constexpr,
              ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Grid ``(cdiv(D, BLOCK_D) N, C)`` (program ``p`` is tile ``p % cdiv(D, BLOCK_D)`` of row
    ``p // cdiv(D, BLOCK_D)``); chunk ``c`` is steps ``[c L, (c + 1) L)`` in the scan's order
    (times ``T - 1 - s`` when ``REVERSE``). ``PASS`` 0: all states from ``h0``; 1: the chunk's
    ``(prod a, end state from 0)`` into ``tot`` ``(N, C, 2, D)``; 2: the states from the
    chunk's start in ``start`` ``(N, C, D)``."""
    tiles = (D + BLOCK_D - 1) // BLOCK_D
    pid = tl.program_id(0)
    pid_d = pid % tiles
    n = (pid // tiles).to(tl.int64)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    d64 = d.to(tl.int64)
    i = tl.arange(0, BLOCK_T)
    if PASS == 2:
        carry = tl.load(start_ptr + (n * C + c) * D + d64, mask=dm, other=0.0).to(ACC)
    elif HAS_H0 and PASS == 0:
        carry = tl.load(h0_ptr + n * sh_n + d64 * sh_d, mask=dm, other=0.0).to(ACC)
    else:
        carry = tl.full([BLOCK_D], 0.0, dtype=ACC)
    prod = tl.full([BLOCK_D], 1.0, dtype=ACC)
    s_lo = c * L
    s_hi = tl.minimum(T, s_lo + L)
    for blk in range(0, (s_hi - s_lo + BLOCK_T - 1) // BLOCK_T):
        t64, m = _block(T, s_lo + blk * BLOCK_T, s_hi, i, dm, BLOCK_T, REVERSE)
        a = tl.load(a_ptr + n * sa_n + d64[:, None] * sa_d + t64[None, :] * sa_t, mask=m,
                    other=1.0).to(ACC)
        b = tl.load(b_ptr + n * sb_n + d64[:, None] * sb_d + t64[None, :] * sb_t, mask=m,
                    other=0.0).to(ACC)
        a = tl.where(m, a, 1.0)
        b = tl.where(m, b, 0.0)
        last = ((i == 0) if REVERSE else (i == BLOCK_T - 1))[None, :]
        h, carry, prod = _diag_block(a, b, carry, prod, last, PASS, REVERSE)
        if PASS != 1:
            tl.store(out_ptr + n * so_n + d64[:, None] * so_d + t64[None, :] * so_t,
                     h.to(out_ptr.dtype.element_ty), mask=m)
    if PASS == 1:
        _diag_total(tot_ptr + (n * C + c) * 2 * D, D, d64, prod, carry, dm)


@_jit
def diag_carries(tot_ptr, h0_ptr, start_ptr, C, D, sh_n, sh_d,
                 HAS_H0: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid ``(cdiv(D, BLOCK_D) N,)`` (as :func:`diag_scan`'s axis 0): ``start[n, c] =
    e_{c-1}`` with ``e_{-1} = h0`` and ``e_c = prod_c e_{c-1} + end_c`` (the chunks' totals of
    pass 1)."""
    tiles = (D + BLOCK_D - 1) // BLOCK_D
    pid = tl.program_id(0)
    n = (pid // tiles).to(tl.int64)
    d = (pid % tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    d64 = d.to(tl.int64)
    if HAS_H0:
        e = tl.load(h0_ptr + n * sh_n + d64 * sh_d, mask=dm, other=0.0).to(ACC)
    else:
        e = tl.full([BLOCK_D], 0.0, dtype=ACC)
    for c in range(0, C):
        tl.store(start_ptr + (n * C + c) * D + d64, e, mask=dm)
        base = (n * C + c) * 2 * D
        p = tl.load(tot_ptr + base + d64, mask=dm, other=1.0)
        y = tl.load(tot_ptr + base + D + d64, mask=dm, other=0.0)
        e = p * e + y


@_jit
def _affine2(a00, a01, a10, a11, u0, u1, b00, b01, b10, b11, v0, v1):
    """``(A, u)`` then ``(B, v)`` for ``2 x 2`` matrices: ``x -> B (A x + u) + v``."""
    return (b00 * a00 + b01 * a10, b00 * a01 + b01 * a11, b10 * a00 + b11 * a10,
            b10 * a01 + b11 * a11, b00 * u0 + b01 * u1 + v0, b10 * u0 + b11 * u1 + v1)


@_jit
def _pair_identity(BLOCK: tl.constexpr, ACC: tl.constexpr):
    """The entries of the ``2 x 2`` identity, ``BLOCK`` rows of them."""
    one = tl.full([BLOCK], 1.0, dtype=ACC)
    zero = tl.full([BLOCK], 0.0, dtype=ACC)
    return one, zero, zero, one


@_jit
def _pair_apply(M00, M01, M10, M11, V0, V1, c0, c1):
    """The scanned maps ``(M, V)`` (rows by steps) applied to each row's carry ``(c0, c1)``."""
    return (M00 * c0[:, None] + M01 * c1[:, None] + V0,
            M10 * c0[:, None] + M11 * c1[:, None] + V1)


@_jit
def _pair_then(last, M00, M01, M10, M11, p00, p01, p10, p11):
    """``Q P`` with ``Q`` the scanned ``2 x 2`` map at the step ``last`` marks: the transfer of
    a chunk so far, ``P``, extended by one block."""
    q00 = _at(last, M00)
    q01 = _at(last, M01)
    q10 = _at(last, M10)
    q11 = _at(last, M11)
    return (q00 * p00 + q01 * p10, q00 * p01 + q01 * p11, q10 * p00 + q11 * p10,
            q10 * p01 + q11 * p11)


@_jit
def _pair_total(ptr, p00, p01, p10, p11, e0, e1, mask):
    """A chunk's transfer ``P`` and end state ``e``: six values per row from ``ptr``."""
    tl.store(ptr, p00, mask=mask)
    tl.store(ptr + 1, p01, mask=mask)
    tl.store(ptr + 2, p10, mask=mask)
    tl.store(ptr + 3, p11, mask=mask)
    tl.store(ptr + 4, e0, mask=mask)
    tl.store(ptr + 5, e1, mask=mask)


@_jit
def pair_scan(A_ptr, b_ptr, out_ptr, h0_ptr, start_ptr, tot_ptr,
              T, N, L,
              sA_n, sA_t, sA_i, sA_j, sb_n, sb_t, sb_h, so_n, so_t, so_h, sh_n, sh_h,
              HAS_H0: tl.constexpr, REVERSE: tl.constexpr, PASS: tl.constexpr,
              ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """:func:`diag_scan` for ``2 x 2`` steps (ParaLSTM's blocks): grid ``(cdiv(N, BLOCK_N),
    C)``, a tile of ``BLOCK_N`` rows, the scan of the affine maps ``(A_t, b_t)`` by
    :func:`_affine2`. Pass 1 keeps ``(P, end)`` in ``tot`` ``(N, C, 6)``, pass 2 reads
    ``start`` ``(N, C, 2)``."""
    row = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    nm = row < N
    r64 = row.to(tl.int64)
    i = tl.arange(0, BLOCK_T)
    if PASS == 2:
        c0 = tl.load(start_ptr + (r64 * C + c) * 2, mask=nm, other=0.0).to(ACC)
        c1 = tl.load(start_ptr + (r64 * C + c) * 2 + 1, mask=nm, other=0.0).to(ACC)
    elif HAS_H0 and PASS == 0:
        c0 = tl.load(h0_ptr + r64 * sh_n, mask=nm, other=0.0).to(ACC)
        c1 = tl.load(h0_ptr + r64 * sh_n + sh_h, mask=nm, other=0.0).to(ACC)
    else:
        c0 = tl.full([BLOCK_N], 0.0, dtype=ACC)
        c1 = tl.full([BLOCK_N], 0.0, dtype=ACC)
    p00, p01, p10, p11 = _pair_identity(BLOCK_N, ACC)
    s_lo = c * L
    s_hi = tl.minimum(T, s_lo + L)
    for blk in range(0, (s_hi - s_lo + BLOCK_T - 1) // BLOCK_T):
        t64, m = _block(T, s_lo + blk * BLOCK_T, s_hi, i, nm, BLOCK_T, REVERSE)
        pa = A_ptr + r64[:, None] * sA_n + t64[None, :] * sA_t
        m00 = tl.where(m, tl.load(pa, mask=m, other=1.0).to(ACC), 1.0)
        m01 = tl.where(m, tl.load(pa + sA_j, mask=m, other=0.0).to(ACC), 0.0)
        m10 = tl.where(m, tl.load(pa + sA_i, mask=m, other=0.0).to(ACC), 0.0)
        m11 = tl.where(m, tl.load(pa + sA_i + sA_j, mask=m, other=1.0).to(ACC), 1.0)
        pb = b_ptr + r64[:, None] * sb_n + t64[None, :] * sb_t
        v0 = tl.where(m, tl.load(pb, mask=m, other=0.0).to(ACC), 0.0)
        v1 = tl.where(m, tl.load(pb + sb_h, mask=m, other=0.0).to(ACC), 0.0)
        M00, M01, M10, M11, V0, V1 = tl.associative_scan(
            (m00, m01, m10, m11, v0, v1), 1, _affine2, reverse=REVERSE)
        h0, h1 = _pair_apply(M00, M01, M10, M11, V0, V1, c0, c1)
        if PASS != 1:
            po = out_ptr + r64[:, None] * so_n + t64[None, :] * so_t
            tl.store(po, h0.to(out_ptr.dtype.element_ty), mask=m)
            tl.store(po + so_h, h1.to(out_ptr.dtype.element_ty), mask=m)
        last = ((i == 0) if REVERSE else (i == BLOCK_T - 1))[None, :]
        c0 = _at(last, h0)
        c1 = _at(last, h1)
        if PASS == 1:       # P <- (the block's map) P
            p00, p01, p10, p11 = _pair_then(last, M00, M01, M10, M11, p00, p01, p10, p11)
    if PASS == 1:
        _pair_total(tot_ptr + (r64 * C + c) * 6, p00, p01, p10, p11, c0, c1, nm)


@_jit
def pair_carries(tot_ptr, h0_ptr, start_ptr, C, N, sh_n, sh_h,
                 HAS_H0: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_N),)``: the chunks' starts for :func:`pair_scan` (``e_c = P_c
    e_{c-1} + end_c``, ``e_{-1} = h0``)."""
    row = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = row < N
    r64 = row.to(tl.int64)
    if HAS_H0:
        e0 = tl.load(h0_ptr + r64 * sh_n, mask=nm, other=0.0).to(ACC)
        e1 = tl.load(h0_ptr + r64 * sh_n + sh_h, mask=nm, other=0.0).to(ACC)
    else:
        e0 = tl.full([BLOCK_N], 0.0, dtype=ACC)
        e1 = tl.full([BLOCK_N], 0.0, dtype=ACC)
    for c in range(0, C):
        tl.store(start_ptr + (r64 * C + c) * 2, e0, mask=nm)
        tl.store(start_ptr + (r64 * C + c) * 2 + 1, e1, mask=nm)
        base = (r64 * C + c) * 6
        p00 = tl.load(tot_ptr + base, mask=nm, other=1.0)
        p01 = tl.load(tot_ptr + base + 1, mask=nm, other=0.0)
        p10 = tl.load(tot_ptr + base + 2, mask=nm, other=0.0)
        p11 = tl.load(tot_ptr + base + 3, mask=nm, other=1.0)
        y0 = tl.load(tot_ptr + base + 4, mask=nm, other=0.0)
        y1 = tl.load(tot_ptr + base + 5, mask=nm, other=0.0)
        e0, e1 = p00 * e0 + p01 * e1 + y0, p10 * e0 + p11 * e1 + y1


@_jit
def dense_scan(A_ptr, b_ptr, out_ptr, h0_ptr, start_ptr, tot_ptr,
               T, H, L,
               sA_n, sA_t, sA_i, sA_j, sb_n, sb_t, sb_h, so_n, so_t, so_h, sh_n, sh_h,
               HAS_H0: tl.constexpr, REVERSE: tl.constexpr, PASS: tl.constexpr,
               ACC: tl.constexpr, HP: tl.constexpr):
    """Grid ``(N, C)``: ``h_t = A_t h_prev + b_t`` with dense ``A_t`` ``(H, H)``, step by step
    (``A[n, t, i, j]`` at ``sA_n n + sA_t t + sA_i i + sA_j j``: a transposed view is free).
    ``PASS`` as :func:`diag_scan`; pass 1 keeps ``P = A_last ... A_first`` (``tot`` ``(N, C,
    HP + 1, HP)``: ``P`` then the end state), pass 2 reads ``start`` ``(N, C, HP)``."""
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    r = tl.arange(0, HP)                    # row index i (outputs)
    k = tl.arange(0, HP)                    # column index j (inputs)
    rm = r < H
    km = k < H
    Am = rm[:, None] & km[None, :]
    if PASS == 2:
        h = tl.load(start_ptr + (n * C + c) * HP + k).to(ACC)
    elif PASS == 1:
        h = tl.full([HP], 0.0, dtype=ACC)
    elif HAS_H0:
        h = tl.load(h0_ptr + n * sh_n + k * sh_h, mask=km, other=0.0).to(ACC)
    else:
        h = tl.full([HP], 0.0, dtype=ACC)
    P = tl.where(r[:, None] == k[None, :], 1.0, 0.0).to(ACC)
    s_lo = c * L
    s_hi = tl.minimum(T, s_lo + L)
    for s in range(s_lo, s_hi):
        if REVERSE:
            t = tl.cast(T - 1 - s, tl.int64)
        else:
            t = tl.cast(s, tl.int64)
        At = tl.load(A_ptr + n * sA_n + t * sA_t + r[:, None] * sA_i + k[None, :] * sA_j,
                     mask=Am, other=0.0).to(ACC)
        bt = tl.load(b_ptr + n * sb_n + t * sb_t + r * sb_h, mask=rm, other=0.0).to(ACC)
        hn = tl.reduce(At * h[None, :], 1, _SUM) + bt
        if PASS != 1:
            tl.store(out_ptr + n * so_n + t * so_t + r * so_h, hn.to(out_ptr.dtype.element_ty),
                     mask=rm)
        else:
            P = tl.dot(At, P, input_precision="ieee")
        h = hn
    if PASS == 1:
        base = (n * C + c) * (HP + 1) * HP
        tl.store(tot_ptr + base + r[:, None] * HP + k[None, :], P)
        tl.store(tot_ptr + base + HP * HP + r, h)


@_jit
def dense_carries(tot_ptr, h0_ptr, start_ptr, C, H, sh_n, sh_h,
                  HAS_H0: tl.constexpr, ACC: tl.constexpr, HP: tl.constexpr):
    """Grid ``(N,)``: ``start[n, c] = e_{c-1}``, ``e_c = P_c e_{c-1} + y_c`` (pass 1's totals)."""
    n = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, HP)
    k = tl.arange(0, HP)
    if HAS_H0:
        e = tl.load(h0_ptr + n * sh_n + k * sh_h, mask=k < H, other=0.0).to(ACC)
    else:
        e = tl.full([HP], 0.0, dtype=ACC)
    for c in range(0, C):
        tl.store(start_ptr + (n * C + c) * HP + k, e)
        base = (n * C + c) * (HP + 1) * HP
        P = tl.load(tot_ptr + base + r[:, None] * HP + k[None, :])
        y = tl.load(tot_ptr + base + HP * HP + r)
        e = tl.reduce(P * e[None, :], 1, _SUM) + y
