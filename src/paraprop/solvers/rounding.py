"""The rounding floor: the least error an estimate can certify in a dtype.

An error estimate of an iterate computed in floating point carries the rounding of the values it
compares; :func:`rounding_floor` says how much, per sample, so that the stopping rules of
:mod:`paraprop.stopping` never certify below it (:class:`~paraprop.stopping.Floor`).
"""

from __future__ import annotations

from typing import Any, cast, overload

import numpy as np
import torch

from paraprop.stopping import Floor

__all__ = ["half_ulp_bound", "rounding_floor", "rounding_floor_arrays"]


def rounding_floor(values: torch.Tensor, norm: str) -> Floor:
    """The rounding floor (:class:`~paraprop.stopping.Floor`, ``(B,)`` float64) of
    ``values`` ``(B, n, F)`` (the positions that are not final: a final one is bitwise the
    sequential value), in ``norm``.

    Where ``v = fl(f(x))`` is a value of the iterate and ``v* = fl(f(x*))`` the sequential one,
    ``|v - v*| <= |f(x) - f(x*)| + ulp(v) / 2 + ulp(v*) / 2`` (round to nearest; ``ulp(v)`` the
    spacing of the dtype's numbers above ``|v|``), and ``ulp(v*) <= max(eps |v*|, s) <=
    max(eps |v|, s) + eps |v - v*|`` (``s``: the spacing of the subnormal numbers). So an error
    estimate adds ``bound = (ulp(m) + max(eps m, s)) / 2`` at the values' largest magnitude ``m``
    and divides by ``1 - q - eps / 2`` (``slack``): that is one unit in the last place at
    ``m`` where ``m`` is a power of two, less than one and a half units otherwise, the least an
    estimate in this dtype can certify (:mod:`paraprop.stopping`). The unit of rounding
    noise is ``eps * m``. With ``norm="l2"`` both are ``eps * ||v||_2`` (a bound of the same sum
    per entry).
    """
    f = rounding_floor_arrays(values, norm)
    if isinstance(f.bound, np.ndarray):
        return Floor(torch.from_numpy(f.bound), torch.from_numpy(f.unit), f.slack)
    return f


def rounding_floor_arrays(values: torch.Tensor, norm: str) -> Floor:
    """:func:`rounding_floor`, its ``(B,)`` numbers as NumPy arrays on the host (the stopping
    rule's arithmetic runs there, :class:`~paraprop.stopping.ContractionRule`)."""
    finfo = torch.finfo(values.dtype)
    B = values.shape[0]
    if values.numel() == 0:   # every position final
        z = torch.zeros(B, dtype=torch.float64, device=values.device)
        return Floor(z, z, finfo.eps / 2)
    if norm == "max":
        peak = values.abs().amax(dim=tuple(range(1, values.dim())))
        # (B,) numbers: on the host NumPy's calls cost less than tensor operators, same
        # arithmetic (bfloat16, which NumPy lacks, stays a tensor); the Floor then holds NumPy
        # arrays, which the stopping rule's host arithmetic reads as they are (hence Any)
        m: Any = peak.numpy().astype(np.float64) if peak.device.type == "cpu" and \
            peak.dtype != torch.bfloat16 else peak.to(torch.float64)
        unit = m * finfo.eps
        return Floor(half_ulp_bound(m, values.dtype, unit), unit, finfo.eps / 2)
    flat = values.reshape(B, -1)
    unit = torch.linalg.vector_norm(flat.to(torch.float64), dim=1) * finfo.eps
    return Floor(unit, unit, finfo.eps / 2)


@overload
def half_ulp_bound(m: torch.Tensor, dtype: torch.dtype, unit: torch.Tensor | None = None
                   ) -> torch.Tensor: ...
@overload
def half_ulp_bound(m: np.ndarray, dtype: torch.dtype, unit: np.ndarray | None = None
                   ) -> np.ndarray: ...
def half_ulp_bound(m: torch.Tensor | np.ndarray, dtype: torch.dtype,
                   unit: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | np.ndarray:
    """``(ulp(m) + max(eps m, s)) / 2`` for magnitudes ``m`` (float64, values of ``dtype``):
    the most that rounding a value of size ``m`` and the sequential value near it can add to
    their difference (:func:`rounding_floor`). ``unit``: ``eps * m`` when the caller has it."""
    finfo = torch.finfo(dtype)
    sub = finfo.smallest_normal * finfo.eps           # the spacing of the subnormal numbers
    unit = m * finfo.eps if unit is None else unit
    # ulp(m) = 2^e eps for 2^e <= m < 2^(e+1): m's exponent bits alone are 2^e (float64 holds
    # every value of dtype exactly); below the normal numbers the spacing is s, and the clamp
    # makes the bound s there (where eps m < s and 2^e eps < s)
    if isinstance(m, np.ndarray):   # the same on a NumPy array
        ulp_a = (m.view(np.int64) & _EXPONENT).view(np.float64) * finfo.eps
        return np.maximum((ulp_a + unit) * 0.5, sub)
    ulp = (m.view(torch.int64) & _EXPONENT).view(torch.float64) * finfo.eps
    # (a tensor m comes with a tensor unit: the overloads pair them)
    return ((ulp + cast(torch.Tensor, unit)) * 0.5).clamp_(min=sub)


_EXPONENT = 0x7FF0000000000000   # the exponent bits of a float64
