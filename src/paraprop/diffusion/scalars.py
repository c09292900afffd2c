"""How PyTorch reads a scheduler's 0-d float32 coefficient ``c`` in an elementwise operation
with a sample ``t``, written for a column of per-step coefficients broadcasting over a window
of samples, so that the window's result is the diffusers step's bit for bit.

In float32 and float64 a product reads ``c`` exactly. In bfloat16 and float16 (computed in
float32, rounded to the dtype) it depends on the operand order and on where ``c`` lives: on the
CPU ``c * t`` rounds ``c`` to the dtype first (it is cast to the common dtype), while ``t * c``
and ``t / c`` read it at full precision (the CPU kernels take a scalar second operand as is); on
CUDA/XPU a CPU scalar is read at full precision in both, and ``t / c`` is ``t * (1 / c)`` (in
every dtype: BinaryDivTrueKernel); a coefficient on the device is rounded to the dtype first.
Measured on the CPU by ``tests/test_diffusion_readers.py``; the CUDA rules are read from
PyTorch's kernels, as in :mod:`~paraprop.diffusion.schedulers`.
"""

from __future__ import annotations

import torch

from paraprop.diffusion.schedulers import RECIPROCAL_DIVISION


def _narrow(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def mul(c: torch.Tensor, t: torch.Tensor, on_device: bool = False) -> torch.Tensor:
    """diffusers' ``c * t`` for a 0-d float32 coefficient ``c`` (here a column broadcasting over
    ``t``), written coefficient first: PyTorch rounds ``c`` to a bfloat16/float16 ``t``'s dtype
    first (as the common dtype), except a CPU scalar on CUDA/XPU, which it reads at full
    precision; the product is computed in float32 and rounded. ``on_device``: ``c`` lives on
    ``t``'s device (not a CPU scalar)."""
    dt = t.dtype
    if not _narrow(dt):
        return c.to(dt) * t
    if t.device.type == "cpu" or on_device:
        c = c.to(dt)
    return (c.float() * t.float()).to(dt)


def tmul(t: torch.Tensor, c: torch.Tensor, on_device: bool = False) -> torch.Tensor:
    """diffusers' ``t * c`` (the coefficient second): the CPU kernel of a bfloat16/float16
    product reads a scalar second operand at full precision (as CUDA reads a CPU scalar); a
    coefficient on ``t``'s CUDA device is rounded to the dtype first."""
    dt = t.dtype
    if not _narrow(dt):
        return t * c.to(dt)
    if on_device and t.device.type != "cpu":
        c = c.to(dt)
    return (t.float() * c.float()).to(dt)


def div(t: torch.Tensor, c: torch.Tensor, on_device: bool = False) -> torch.Tensor:
    """diffusers' ``t / c``: the CPU kernel reads a scalar divisor at full precision; on
    CUDA/XPU a CPU scalar divides as ``t * (1 / c)`` (``1 / c`` in the operation's precision),
    a divisor on the device is rounded to a bfloat16/float16 dtype first."""
    dt = t.dtype
    reciprocal = not on_device and t.device.type in RECIPROCAL_DIVISION
    if not _narrow(dt):
        c = c.to(dt)
        return t * (1 / c) if reciprocal else t / c
    if reciprocal:
        return (t.float() * (1 / c.float())).to(dt)
    if on_device and t.device.type != "cpu":
        c = c.to(dt)
    return (t.float() / c.float()).to(dt)
