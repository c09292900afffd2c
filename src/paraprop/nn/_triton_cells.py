"""The Triton kernels of :mod:`paraprop.nn.triton_cells`: ParaGRU's and ParaLSTM's Newton step
fused (the GPU's counterpart of ``newton_step`` in :mod:`paraprop.nn.para_gru`). Loaded by
:func:`paraprop.scan.triton_runtime.load`, once per mode; without triton the file imports and
defines nothing that runs.

One program owns a tile of units and walks its span of time in blocks of ``BLOCK_T`` steps. Per
block, from the iterate ``x`` (its previous step ``x_{t-1}``, ``h0`` before position 0) and the
input terms ``gi``: the cell's values ``y_t = cell(gi_t, x_{t-1})`` in the operations (and the
order) of :func:`paraprop.jacobians.diagonal.gru_newton_block` / ``lstm_newton_block``, the
Jacobian ``J_t = d y_t / d x_{t-1}`` (a diagonal, or a ``2 x 2`` block per unit), the residual
``r_t = y_t - x_t``, then the step's linear recurrence ``delta_t = J_t delta_{t-1} + r_t`` by one
``tl.associative_scan`` with a carry from block to block (``delta = 0`` before position ``lo``);
written out are ``y`` and ``trial = x + delta``. As in :mod:`paraprop.scan._triton_scan`, few
rows split time into chunks: pass 1 keeps each chunk's transfer and end, the carries kernel of
the scans gives each chunk's start, pass 2 writes. The combine functions, the blocks' times and
the carry code (the ``2 x 2`` one included) are :mod:`paraprop.scan._triton_scan`'s, from its copy
in this module's mode.

The cell's ``exp`` and ``tanh`` are libdevice's (CUDA's ``expf`` / ``tanhf``, what torch's CUDA
kernels call) and its divisions round to nearest; in the interpreter they are computed in
float64 and rounded. Either way they are not torch's CPU functions: the values differ from the
torch cell by rounding (a few units in the last place per step).
"""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:     # no triton: the module imports, and nothing here is ever launched
    triton, tl, libdevice = None, types.SimpleNamespace(constexpr=None), None

_scan: types.ModuleType | None      # the scan kernels in this module's mode (None: no triton)
if triton is not None:
    # The shared helpers, from the copy of the scan kernels in this module's mode (the loader
    # forces the mode while it runs this file; imported on its own, the environment's).
    from paraprop.scan import triton_runtime as _loader

    _scan = _loader.load_mode("paraprop.scan._triton_scan", _loader.loading_mode())
    _jit, _affine2, _at = _scan._jit, _scan._affine2, _scan._at
    _block, _diag_block, _diag_total = _scan._block, _scan._diag_block, _scan._diag_total
    _pair_identity, _pair_apply = _scan._pair_identity, _scan._pair_apply
    _pair_then, _pair_total = _scan._pair_then, _scan._pair_total
    INTERPRETED = _scan.INTERPRETED
else:
    _scan, INTERPRETED = None, False

    def _jit(fn):
        return fn

if INTERPRETED:         # numpy's float64 functions, rounded: libdevice does not interpret
    @_jit
    def _sigmoid(x):
        w = x.to(tl.float64)
        return (1.0 / (1.0 + tl.exp(-w))).to(x.dtype)

    @_jit
    def _tanh(x):
        w = x.to(tl.float64)
        e = tl.exp(-2.0 * tl.abs(w))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(w < 0, -t, t).to(x.dtype)
else:
    @_jit
    def _sigmoid(x):
        e = 1.0 + libdevice.exp(-x)
        if x.dtype == tl.float64:       # (float64 division rounds to nearest anyway)
            y = 1.0 / e
        else:
            y = tl.fdiv(tl.full(x.shape, 1.0, x.dtype), e, ieee_rounding=True)
        return y

    @_jit
    def _tanh(x):
        return libdevice.tanh(x)


@_jit
def _lerp(start, end, weight):
    """torch.lerp's formula: ``start + w (end - start)`` for ``w < 0.5``, else ``end - (end -
    start)(1 - w)``."""
    return tl.where(weight < 0.5, start + weight * (end - start),
                    end - (end - start) * (1.0 - weight))


@_jit
def gru_step(gi_ptr, x_ptr, h0_ptr, w_ptr, bh_ptr, y_ptr, trial_ptr, start_ptr, tot_ptr,
             T, H, lo, L,
             sg_n, sg_t, sg_k, sg_h, sx_n, sx_t, sx_h, sy_n, sy_t, sy_h, sh_n, sh_h,
             HAS_B: tl.constexpr, PASS: tl.constexpr, ACC: tl.constexpr,
             BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """ParaGRU: grid ``(cdiv(H, BLOCK_H) B, C)`` (program ``p`` is tile ``p % cdiv(H,
    BLOCK_H)`` of sample ``p // cdiv(H, BLOCK_H)``); states ``(B, T, H)``, ``gi`` ``(B, T, 3,
    H)`` (gates r, z, n), ``w``, ``bh`` ``(3, H)``, ``h0`` ``(B, H)``. Chunk ``c`` is positions
    ``[lo + c L, lo + (c + 1) L)``; ``PASS`` as :func:`paraprop.scan._triton_scan.diag_scan`
    (pass 1's ``tot`` ``(B, C, 2, H)``, pass 2's ``start`` ``(B, C, H)``)."""
    tiles = (H + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    n = (pid // tiles).to(tl.int64)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    u = (pid % tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
    um = u < H
    u64 = u.to(tl.int64)
    i = tl.arange(0, BLOCK_T)
    wr = tl.load(w_ptr + u64, mask=um, other=0.0).to(ACC)[:, None]
    wz = tl.load(w_ptr + H + u64, mask=um, other=0.0).to(ACC)[:, None]
    wn = tl.load(w_ptr + 2 * H + u64, mask=um, other=0.0).to(ACC)[:, None]
    if HAS_B:
        br = tl.load(bh_ptr + u64, mask=um, other=0.0).to(ACC)[:, None]
        bz = tl.load(bh_ptr + H + u64, mask=um, other=0.0).to(ACC)[:, None]
        bn = tl.load(bh_ptr + 2 * H + u64, mask=um, other=0.0).to(ACC)[:, None]
    h0 = tl.load(h0_ptr + n * sh_n + u64 * sh_h, mask=um, other=0.0).to(ACC)
    if PASS == 2:
        carry = tl.load(start_ptr + (n * C + c) * H + u64, mask=um, other=0.0).to(ACC)
    else:
        carry = tl.full([BLOCK_H], 0.0, dtype=ACC)
    prod = tl.full([BLOCK_H], 1.0, dtype=ACC)
    s_lo = lo + c * L
    s_hi = tl.minimum(T, s_lo + L)
    for blk in range(0, (s_hi - s_lo + BLOCK_T - 1) // BLOCK_T):
        t64, m = _block(T, s_lo + blk * BLOCK_T, s_hi, i, um, BLOCK_T, False)
        px = x_ptr + n * sx_n + u64[:, None] * sx_h + t64[None, :] * sx_t
        x = tl.load(px, mask=m, other=0.0).to(ACC)
        first = (t64 == 0)[None, :]
        hp = tl.load(px - sx_t, mask=m & ~first, other=0.0).to(ACC)
        hp = tl.where(first, h0[:, None], hp)
        pg = gi_ptr + n * sg_n + u64[:, None] * sg_h + t64[None, :] * sg_t
        gr = tl.load(pg, mask=m, other=0.0).to(ACC)
        gz = tl.load(pg + sg_k, mask=m, other=0.0).to(ACC)
        gn = tl.load(pg + 2 * sg_k, mask=m, other=0.0).to(ACC)
        if HAS_B:
            ghr = br + wr * hp
            ghz = bz + wz * hp
            ghn = bn + wn * hp
        else:
            ghr = wr * hp
            ghz = wz * hp
            ghn = wn * hp
        r = _sigmoid(ghr + gr)
        z = _sigmoid(ghz + gz)
        nv = _tanh(gn + r * ghn)
        y = _lerp(nv, hp, z)
        # a = z + (1 - z) [(h' - n) w_z + (1 - n^2) r (w_n + (1 - r) gh_n w_r)]
        q = _lerp(wn + ghn * wr, wn, r) * r
        q = q - q * nv * nv
        q = q + (y - nv) * wz
        a = tl.where(m, _lerp(q, 1.0, z), 1.0)
        res = tl.where(m, y - x, 0.0)
        delta, carry, prod = _diag_block(a, res, carry, prod, (i == BLOCK_T - 1)[None, :], PASS,
                                         False)
        if PASS != 1:
            po = n * sy_n + u64[:, None] * sy_h + t64[None, :] * sy_t
            tl.store(y_ptr + po, y.to(y_ptr.dtype.element_ty), mask=m)
            tl.store(trial_ptr + po, (x + delta).to(trial_ptr.dtype.element_ty), mask=m)
    if PASS == 1:
        _diag_total(tot_ptr + (n * C + c) * 2 * H, H, u64, prod, carry, um)


@_jit
def lstm_step(gi_ptr, x_ptr, h0_ptr, w_ptr, y_ptr, trial_ptr, start_ptr, tot_ptr,
              T, U, H, lo, L,
              sg_k, sg_b, sg_h, sg_t, sx_u, sx_t, sx_c, sy_u, sy_t, sy_c, sh_u, sh_c,
              PASS: tl.constexpr, ACC: tl.constexpr, BLOCK_U: tl.constexpr,
              BLOCK_T: tl.constexpr):
    """ParaLSTM: grid ``(cdiv(U, BLOCK_U), C)`` over the ``U = B H`` units; states ``(U, T,
    2)`` (``(h, c)``), ``gi`` ``(4, B, H, T)`` (gates i, f, g, o; both biases included), ``w``
    ``(4, H)``, ``h0`` ``(U, 2)``. Pass 1's ``tot`` is ``(U, C, 6)``, pass 2's ``start`` ``(U,
    C, 2)`` (:func:`paraprop.scan._triton_scan.pair_carries`)."""
    c = tl.program_id(1)
    C = tl.num_programs(1)
    u = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    um = u < U
    u64 = u.to(tl.int64)
    j = u64 % H
    gbase = (u64 // H) * sg_b + j * sg_h
    steps = tl.arange(0, BLOCK_T)
    wi = tl.load(w_ptr + j, mask=um, other=0.0).to(ACC)[:, None]
    wf = tl.load(w_ptr + H + j, mask=um, other=0.0).to(ACC)[:, None]
    wg = tl.load(w_ptr + 2 * H + j, mask=um, other=0.0).to(ACC)[:, None]
    wo = tl.load(w_ptr + 3 * H + j, mask=um, other=0.0).to(ACC)[:, None]
    h0 = tl.load(h0_ptr + u64 * sh_u, mask=um, other=0.0).to(ACC)
    c0 = tl.load(h0_ptr + u64 * sh_u + sh_c, mask=um, other=0.0).to(ACC)
    if PASS == 2:
        k0 = tl.load(start_ptr + (u64 * C + c) * 2, mask=um, other=0.0).to(ACC)
        k1 = tl.load(start_ptr + (u64 * C + c) * 2 + 1, mask=um, other=0.0).to(ACC)
    else:
        k0 = tl.full([BLOCK_U], 0.0, dtype=ACC)
        k1 = tl.full([BLOCK_U], 0.0, dtype=ACC)
    p00, p01, p10, p11 = _pair_identity(BLOCK_U, ACC)
    s_lo = lo + c * L
    s_hi = tl.minimum(T, s_lo + L)
    for blk in range(0, (s_hi - s_lo + BLOCK_T - 1) // BLOCK_T):
        t64, m = _block(T, s_lo + blk * BLOCK_T, s_hi, steps, um, BLOCK_T, False)
        px = x_ptr + u64[:, None] * sx_u + t64[None, :] * sx_t
        xh = tl.load(px, mask=m, other=0.0).to(ACC)
        xc = tl.load(px + sx_c, mask=m, other=0.0).to(ACC)
        first = (t64 == 0)[None, :]
        hp = tl.where(first, h0[:, None], tl.load(px - sx_t, mask=m & ~first, other=0.0).to(ACC))
        cp = tl.where(first, c0[:, None],
                      tl.load(px - sx_t + sx_c, mask=m & ~first, other=0.0).to(ACC))
        pg = gi_ptr + gbase[:, None] + t64[None, :] * sg_t
        ig = _sigmoid(tl.load(pg, mask=m, other=0.0).to(ACC) + wi * hp)
        f = _sigmoid(tl.load(pg + sg_k, mask=m, other=0.0).to(ACC) + wf * hp)
        g = _tanh(tl.load(pg + 2 * sg_k, mask=m, other=0.0).to(ACC) + wg * hp)
        o = _sigmoid(tl.load(pg + 3 * sg_k, mask=m, other=0.0).to(ACC) + wo * hp)
        cy = f * cp + ig * g
        tc = _tanh(cy)
        hy = o * tc
        # the 2 x 2 block (jacobians/diagonal.py): q = dc'/dh, k = o (1 - tanh(c')^2)
        q = (f - f * f) * cp * wf
        q = q + (ig - ig * ig) * g * wi
        q = q + (ig - ig * (g * g)) * wg
        k = o - o * (tc * tc)
        j00 = tl.where(m, (o - o * o) * tc * wo + k * q, 1.0)
        j01 = tl.where(m, k * f, 0.0)
        j10 = tl.where(m, q, 0.0)
        j11 = tl.where(m, f, 1.0)
        r0 = tl.where(m, hy - xh, 0.0)
        r1 = tl.where(m, cy - xc, 0.0)
        M00, M01, M10, M11, V0, V1 = tl.associative_scan((j00, j01, j10, j11, r0, r1), 1,
                                                         _affine2)
        d0, d1 = _pair_apply(M00, M01, M10, M11, V0, V1, k0, k1)
        if PASS != 1:
            po = u64[:, None] * sy_u + t64[None, :] * sy_t
            tl.store(y_ptr + po, hy.to(y_ptr.dtype.element_ty), mask=m)
            tl.store(y_ptr + po + sy_c, cy.to(y_ptr.dtype.element_ty), mask=m)
            tl.store(trial_ptr + po, (xh + d0).to(trial_ptr.dtype.element_ty), mask=m)
            tl.store(trial_ptr + po + sy_c, (xc + d1).to(trial_ptr.dtype.element_ty), mask=m)
        last = (steps == BLOCK_T - 1)[None, :]
        k0 = _at(last, d0)
        k1 = _at(last, d1)
        if PASS == 1:
            p00, p01, p10, p11 = _pair_then(last, M00, M01, M10, M11, p00, p01, p10, p11)
    if PASS == 1:
        _pair_total(tot_ptr + (u64 * C + c) * 6, p00, p01, p10, p11, k0, k1, um)
