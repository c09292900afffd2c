"""ELK's damped Newton step: the parallel Kalman filter of a linearised recurrence.

:class:`~paraprop.solvers.ELK` and :class:`~paraprop.solvers.QuasiELK` (Gonzalez et al. 2024,
"Towards scalable and stable parallelization of nonlinear RNNs") damp the Newton step of
:mod:`paraprop.solvers.newton`: the step is the Kalman-filtered mean of the linearised
recurrence seen as a linear Gaussian model whose states are observed at zero with variance
``1 / lambda``, computed by the parallel filter of Sarkka and Garcia-Fernandez (2021), one
associative scan (:func:`paraprop.scan.associative_scan`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from paraprop.scan import associative_scan

__all__ = ["kalman_step"]


def kalman_step(J: torch.Tensor, r: torch.Tensor, lam: float) -> torch.Tensor:
    """ELK's damped Newton step (Gonzalez et al. 2024, in the filter form of their reference
    code): ``delta_0 = r_0`` and, for ``t >= 1``, the Kalman-filtered means of the linear
    Gaussian model ``delta_t = J_t delta_{t-1} + r_t + q_t``, ``0 = delta_t + v_t`` with
    ``q ~ N(0, I)`` and ``v ~ N(0, I / lam)``, by the parallel filter of Sarkka and
    Garcia-Fernandez (2021): one associative scan over the elements ``(A, b, C, eta, Jm)``.

    ``lam -> 0`` gives Newton's step, ``lam -> inf`` no step; in between the gain damps each
    step by the accumulated uncertainty, i.e. most where the Jacobian products grow.
    ``J`` is dense ``(B, n, H, H)`` or diagonal ``(B, n, H)`` (quasi-ELK); ``r`` is ``(B, n, H)``.
    """
    B, n, H = r.shape
    if n == 1:
        return r.clone()
    k = _DENSE if J.dim() == 4 else _DIAG
    c = 1.0 / (1.0 + lam)             # (I - K) for a unit prior: sigma^2 / (1 + sigma^2)
    w = 1.0 - c                       # the gain K = 1 / (1 + sigma^2)
    eye = k.eye(H, r)
    Jn, rn = J[:, 1:], r[:, 1:]
    A = c * Jn
    b = c * rn
    C = (c * eye).expand_as(Jn).clone()
    eta = -w * k.mv(k.t(Jn), rn)
    Jm = w * k.mm(k.t(Jn), Jn)
    # the first free position: prior mean J_1 delta_0 + r_1 with delta_0 = r_0 exact, cov I
    b[:, 0] = c * (k.mv(Jn[:, 0], r[:, 0]) + rn[:, 0])
    A[:, 0] = 0
    eta[:, 0] = 0
    Jm[:, 0] = 0

    def combine(x, y):
        Ai, bi, Ci, ei, Ji = x
        Aj, bj, Cj, ej, Jj = y
        M = k.inv(eye + k.mm(Ci, Jj))     # C and Jm are symmetric: (I + Jj Ci)^-1 = M^T
        AjM = k.mm(Aj, M)
        AiN = k.mm(k.t(Ai), k.t(M))
        return [k.mm(AjM, Ai), k.mv(AjM, bi + k.mv(Ci, ej)) + bj,
                k.mm(k.mm(AjM, Ci), k.t(Aj)) + Cj, k.mv(AiN, ej - k.mv(Jj, bi)) + ei,
                k.mm(k.mm(AiN, Jj), Ai) + Ji]

    means = associative_scan([A, b, C, eta, Jm], combine, dim=1)[1]
    return torch.cat([r[:, :1], means], 1)



class _Algebra(NamedTuple):
    """The matrix operations of :func:`kalman_step` on one form of the Jacobians: dense
    ``(..., H, H)`` matrices, or diagonal ones stored as ``(..., H)`` vectors, on which the same
    formulas run elementwise."""

    eye: Callable[[int, torch.Tensor], torch.Tensor]            # the identity, like a tensor
    t: Callable[[torch.Tensor], torch.Tensor]                   # the transpose
    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]    # matrix times matrix
    mv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]    # matrix times vector
    inv: Callable[[torch.Tensor], torch.Tensor]                 # the inverse


_DENSE = _Algebra(
    eye=lambda H, like: torch.eye(H, dtype=like.dtype, device=like.device),
    t=lambda a: a.transpose(-1, -2),
    mm=torch.matmul,
    mv=lambda a, v: (a @ v.unsqueeze(-1)).squeeze(-1),
    inv=torch.linalg.inv,
)
_DIAG = _Algebra(
    eye=lambda H, like: torch.ones(H, dtype=like.dtype, device=like.device),
    t=lambda a: a,
    mm=torch.mul,
    mv=torch.mul,
    inv=torch.reciprocal,
)
