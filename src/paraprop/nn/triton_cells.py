"""ParaGRU's and ParaLSTM's Newton step fused in one Triton kernel (the GPU's ``newton_step``).

:class:`paraprop.nn.para_gru.GRURecurrence` and ``LSTMRecurrence`` run their fused step
here with ``kernel="triton"``: per block of steps the cell, its Jacobian (diagonal, or ``2 x
2`` per unit), the residual and the step's linear recurrence, in one pass over the iterate and
the input terms (:mod:`paraprop.nn._triton_cells` says how). The results are those of the
torch cell's fused step up to rounding: ``y`` (the kernel cell's ``fn(x)``) and ``trial = x +
delta`` at positions ``[lo, T)``. Because the kernel's cell rounds differently from the torch
cell, a Newton solve with this step converges to the kernel cell's fixed point: ParaGRU and
ParaLSTM use it as a warm start only, and certify with the torch cell's step
(:func:`paraprop.nn.para_solve.solve_recurrence`). triton is imported only when a step first runs
(through :func:`paraprop.scan.triton_runtime.load`).

The two functions below are what the recurrences call, and what a benchmark can call directly.
"""

from __future__ import annotations

import math

import torch

from paraprop.scan import triton_runtime as rt

__all__ = ["gru_newton_step", "lstm_newton_step"]

# Values per tile (units x steps) of the fused kernels: the cell's twenty-odd temporaries per
# value must stay in registers (1024 values over 4 warps: 8 per thread each).
TILE = 1024


def _chunks(x: torch.Tensor, programs: int, blocks: int, BT: int, n: int,
            chunks: int | None) -> tuple[int, int]:
    C = rt.time_chunks(x.device, programs, blocks, chunks)
    L = math.ceil(blocks / C) * BT
    return math.ceil(n / L), L


def _nothing_to_do(entry: str, n: int, rows: int, y: torch.Tensor,
                   trial: torch.Tensor) -> bool:
    """Whether a step has no position (``n``) or no row to compute; ``ValueError`` when ``y``
    and ``trial`` differ in strides (the kernels address both with one set)."""
    if n <= 0 or rows == 0:
        return True
    if y.stride() != trial.stride():
        raise ValueError(f"{entry}: y and trial must have the same strides, got y "
                         f"{tuple(y.stride())} and trial {tuple(trial.stride())}")
    return False


def gru_newton_step(gi: torch.Tensor, x: torch.Tensor, h0: torch.Tensor, w: torch.Tensor,
                    b: torch.Tensor | None, lo: int, y: torch.Tensor, trial: torch.Tensor, *,
                    block_t: int | None = None, chunks: int | None = None) -> None:
    """ParaGRU's fused Newton step at the iterate ``x`` from position ``lo``: writes ``y[:,
    lo:] = fn(x)`` and ``trial[:, lo:] = x + delta`` (``delta_t = a_t delta_{t-1} + y_t -
    x_t``, ``delta_{lo-1} = 0``, ``a_t`` the Jacobian's diagonal).

    Arguments:
        gi: the input terms ``(B, T, 3, H)`` (gates r, z, n; any strides).
        x: the iterate ``(B, T, H)``; ``y``, ``trial``: outputs like it.
        h0: ``(B, H)``. w, b: the diagonal weights and the hidden bias ``(3, H)`` (``b`` may
            be ``None``).
        lo: the first position that is not exact yet.
        block_t, chunks: steps per block and chunks of time (defaults by size and device):
            for tests and tuning.
    """
    B, T, H = x.shape
    n = T - lo
    if _nothing_to_do("gru_newton_step", n, B, y, trial):
        return
    if block_t is not None:
        BT = max(2, rt.pow2(block_t))
        BH = min(rt.pow2(H), max(1, TILE // BT))
    else:
        BH = min(rt.pow2(H), 32)
        BT = max(2, min(rt.pow2(n), TILE // BH))
    tiles, blocks = math.ceil(H / BH), math.ceil(n / BT)
    if B * tiles > rt.MAX_GRID0:            # more programs than axis 0 holds: slices of samples
        for rows in rt.slices(B, rt.MAX_GRID0 // tiles):
            gru_newton_step(gi[rows], x[rows], h0[rows], w, b, lo, y[rows], trial[rows],
                            block_t=block_t, chunks=chunks)
        return
    mod = rt.load("paraprop.nn._triton_cells", x.device)
    C, L = _chunks(x, B * tiles, blocks, BT, n, chunks)
    acc = rt.acc_type(mod, x.dtype)
    strides = (*gi.stride(), *x.stride(), *y.stride(), *h0.stride())
    meta = {"HAS_B": b is not None, "ACC": acc, "BLOCK_H": BH, "BLOCK_T": BT, "num_warps": 4}
    args = (gi, x, h0, w, b, y, trial)
    grid = (tiles * B, C)                   # program (tile of units, sample), chunk

    def launch(start, tot, PASS):
        mod.gru_step[grid](*args, start, tot, T, H, lo, L, *strides, PASS=PASS, **meta)

    def carries(tot, start):
        scan = rt.load("paraprop.scan._triton_scan", x.device)
        scan.diag_carries[(tiles * B,)](tot, None, start, C, H, 0, 0, HAS_H0=False, ACC=acc,
                                        BLOCK_D=BH)

    rt.passes(x.device, "gru_step", C, launch, carries, (B, C, 2, H), (B, C, H), x.dtype)


def lstm_newton_step(gi: torch.Tensor, x: torch.Tensor, h0: torch.Tensor, w: torch.Tensor,
                     lo: int, y: torch.Tensor, trial: torch.Tensor, *,
                     block_t: int | None = None, chunks: int | None = None) -> None:
    """ParaLSTM's fused Newton step, as :func:`gru_newton_step` with ``2 x 2`` Jacobian
    blocks per unit.

    Arguments:
        gi: the input terms ``(4, B, H, T)`` (gates i, f, g, o; both biases included).
        x: the iterate ``(B H, T, 2)`` (``(h, c)`` per unit and step); ``y``, ``trial``:
            outputs like it.
        h0: ``(B H, 2)``. w: the diagonal weights ``(4, H)``.
        lo, block_t, chunks: as :func:`gru_newton_step`.
    """
    U, T, _ = x.shape
    H = w.shape[1]
    n = T - lo
    if _nothing_to_do("lstm_newton_step", n, U, y, trial):
        return
    mod = rt.load("paraprop.nn._triton_cells", x.device)
    BT = max(2, rt.pow2(block_t) if block_t is not None else min(rt.pow2(n), TILE // 4))
    BU = min(rt.pow2(U), max(1, TILE // 2 // BT))
    tiles, blocks = math.ceil(U / BU), math.ceil(n / BT)
    C, L = _chunks(x, tiles, blocks, BT, n, chunks)
    acc = rt.acc_type(mod, x.dtype)
    strides = (gi.stride(0), gi.stride(1), gi.stride(2), gi.stride(3), *x.stride(),
               *y.stride(), *h0.stride())
    meta = {"ACC": acc, "BLOCK_U": BU, "BLOCK_T": BT, "num_warps": 4}
    args = (gi, x, h0, w, y, trial)

    def launch(start, tot, PASS):
        mod.lstm_step[(tiles, C)](*args, start, tot, T, U, H, lo, L, *strides, PASS=PASS,
                                  **meta)

    def carries(tot, start):
        scan = rt.load("paraprop.scan._triton_scan", x.device)
        scan.pair_carries[(tiles,)](tot, None, start, C, U, 0, 0, HAS_H0=False, ACC=acc,
                                    BLOCK_N=BU)

    rt.passes(x.device, "lstm_step", C, launch, carries, (U, C, 6), (U, C, 2), x.dtype)
