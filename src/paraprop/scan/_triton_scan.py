"""The Triton kernels of :mod:`paraprop.scan.triton_kernels` (the GPU's counterpart of the native
C kernels). Only :mod:`paraprop.scan.triton_kernels` loads this file, once per mode (compiled for
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
- :func:`dense_scan`: dense ``H x H`` steps, ``H <= 64`` (padded to ``HP``, a power of two
  ``>= 16``): sequential in time inside a program, one matrix-vector product per step.

Both split time into ``C`` chunks when there are too few independent rows to fill the device
(``PASS``): pass 1 runs every chunk from a zero start and keeps only its transfer (``prod a`` or
the product ``P`` of its matrices, by ``tl.dot`` in IEEE float32) and its end state; a small
kernel (:func:`diag_carries`, :func:`dense_carries`) walks the ``C`` chunks to get each chunk's
true start; pass 2 re-runs every chunk from it and writes the states. With ``C = 1`` pass 0 runs
alone (one read of the inputs, one write of the states). Accumulation is float32 (float64 for
float64 inputs); inputs and outputs may be float16 or bfloat16.
"""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl
except ImportError:     # no triton: the module imports, and nothing here is ever launched
    triton, tl = None, types.SimpleNamespace(constexpr=None)


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _affine(a1, b1, a2, b2):
    """``(a1, b1)`` then ``(a2, b2)``: ``h -> a2 (a1 h + b1) + b2``."""
    return a2 * a1, a2 * b1 + b2


@_jit
def diag_scan(a_ptr, b_ptr, out_ptr, h0_ptr, start_ptr, tot_ptr,
              T, D, L,
              sa_n, sa_t, sa_d, sb_n, sb_t, sb_d, so_n, so_t, so_d, sh_n, sh_d,
              HAS_H0: tl.constexpr, REVERSE: tl.constexpr, PASS: tl.constexpr,
              ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Grid ``(cdiv(D, BLOCK_D), N, C)``; chunk ``c`` is steps ``[c L, (c + 1) L)`` in the
    scan's order (times ``T - 1 - s`` when ``REVERSE``). ``PASS`` 0: all states from ``h0``;
    1: the chunk's ``(prod a, end state from 0)`` into ``tot`` ``(N, C, 2, D)``; 2: the states
    from the chunk's start in ``start`` ``(N, C, D)``."""
    pid_d = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2)
    C = tl.num_programs(2)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    d64 = d.to(tl.int64)
    i = tl.arange(0, BLOCK_T)
    if PASS == 2:
        carry = tl.load(start_ptr + (n * C + c) * D + d64, mask=dm, other=0.0).to(ACC)
    elif HAS_H0:
        carry = tl.load(h0_ptr + n * sh_n + d64 * sh_d, mask=dm, other=0.0).to(ACC)
    else:
        carry = tl.zeros([BLOCK_D], dtype=ACC)
    prod = tl.full([BLOCK_D], 1.0, dtype=ACC)
    s_lo = c * L
    s_hi = tl.minimum(T, s_lo + L)
    for blk in range(0, tl.cdiv(s_hi - s_lo, BLOCK_T)):
        s0 = s_lo + blk * BLOCK_T
        if REVERSE:     # the block's times, increasing: [T - s0 - BLOCK_T, T - s0)
            t = T - s0 - BLOCK_T + i
            tm = t >= T - s_hi
        else:
            t = s0 + i
            tm = t < s_hi
        m = dm[:, None] & tm[None, :]
        t64 = t.to(tl.int64)
        a = tl.load(a_ptr + n * sa_n + d64[:, None] * sa_d + t64[None, :] * sa_t, mask=m,
                    other=1.0).to(ACC)
        b = tl.load(b_ptr + n * sb_n + d64[:, None] * sb_d + t64[None, :] * sb_t, mask=m,
                    other=0.0).to(ACC)
        a = tl.where(m, a, 1.0)
        b = tl.where(m, b, 0.0)
        A, B = tl.associative_scan((a, b), 1, _affine, reverse=REVERSE)
        h = A * carry[:, None] + B
        if PASS != 1:
            tl.store(out_ptr + n * so_n + d64[:, None] * so_d + t64[None, :] * so_t,
                     h.to(out_ptr.dtype.element_ty), mask=m)
        last = (i == 0) if REVERSE else (i == BLOCK_T - 1)
        carry = tl.sum(tl.where(last[None, :], h, 0.0), 1)
        if PASS == 1:
            prod = prod * tl.sum(tl.where(last[None, :], A, 0.0), 1)
    if PASS == 1:
        base = (n * C + c) * 2 * D
        tl.store(tot_ptr + base + d64, prod, mask=dm)
        tl.store(tot_ptr + base + D + d64, carry, mask=dm)


@_jit
def diag_carries(tot_ptr, h0_ptr, start_ptr, C, D, sh_n, sh_d,
                 HAS_H0: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid ``(cdiv(D, BLOCK_D), N)``: ``start[n, c] = e_{c-1}`` with ``e_{-1} = h0`` and
    ``e_c = prod_c e_{c-1} + end_c`` (the chunks' totals of pass 1)."""
    n = tl.program_id(1).to(tl.int64)
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    d64 = d.to(tl.int64)
    if HAS_H0:
        e = tl.load(h0_ptr + n * sh_n + d64 * sh_d, mask=dm, other=0.0).to(ACC)
    else:
        e = tl.zeros([BLOCK_D], dtype=ACC)
    for c in range(0, C):
        tl.store(start_ptr + (n * C + c) * D + d64, e, mask=dm)
        base = (n * C + c) * 2 * D
        p = tl.load(tot_ptr + base + d64, mask=dm, other=1.0)
        y = tl.load(tot_ptr + base + D + d64, mask=dm, other=0.0)
        e = p * e + y


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
        h = tl.zeros([HP], dtype=ACC)
    elif HAS_H0:
        h = tl.load(h0_ptr + n * sh_n + k * sh_h, mask=km, other=0.0).to(ACC)
    else:
        h = tl.zeros([HP], dtype=ACC)
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
        hn = tl.sum(At * h[None, :], 1) + bt
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
        e = tl.zeros([HP], dtype=ACC)
    for c in range(0, C):
        tl.store(start_ptr + (n * C + c) * HP + k, e)
        base = (n * C + c) * (HP + 1) * HP
        P = tl.load(tot_ptr + base + r[:, None] * HP + k[None, :])
        y = tl.load(tot_ptr + base + HP * HP + r)
        e = tl.sum(P * e[None, :], 1) + y
