"""The transition matrices ``A_t`` of a linear recurrence, in three storage forms.

- dense: a tensor ``(..., T, H, H)``;
- diagonal: a tensor ``(..., T, H)`` (``A_t = diag(a_t)``);
- :class:`Factored`: ``A_t = diag(d_t) + L diag(s_t) R`` with ``L`` and ``R`` shared by all steps.
  This is the form of the analytic transposed Jacobians of recurrent cells (BPPSA, Wang et al.
  2020, Appendix E): for a tanh RNN ``J_t^T = W_hh^T diag(1 - h_t^2)``, for a GRU a diagonal
  plus three scaled copies of ``W_hh^T`` blocks. Applying it costs ``O(H K)`` and needs
  no ``(T, H, H)`` array in memory.

:class:`Op` is the internal, canonical view the algorithms work on: every per-step tensor has the
layout ``(N | 1, T, ...)`` (``N`` flattened batch rows; a leading 1 is a batch broadcast) and the
shared matrices are 2-D. ``Op`` can apply a slice of steps to vectors or matrices, be transposed,
be sliced or flipped in time and be materialised densely.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Factored", "Op"]


@dataclass(frozen=True)
class Factored:
    """Transition matrices ``A_t = diag(diag_t) + left @ diag(scale_t) @ right``.

    Arguments:
        scale: ``(..., T, K)``, the per-step scales ``s_t``.
        left: ``(H, K)`` shared matrix, or ``None`` for ``[I, I, ..., I]`` (``K / H`` identity
            blocks side by side: the sum of the ``K / H`` blocks of ``diag(s_t) R h``).
        right: ``(K, H)`` shared matrix, or ``None`` for ``[I; I; ...; I]`` (the state repeated
            ``K / H`` times). With both ``None``, ``K`` must be a multiple of ``H``.
        diag: ``(..., T, H)`` per-step diagonal ``d_t``, or ``None`` (zero).

    Example (the transposed Jacobians of a tanh RNN, BPPSA):
        >>> W = torch.randn(20, 20); h = torch.tanh(torch.randn(16, 100, 20))
        >>> A = Factored(scale=1 - h**2, left=W.T)            # J_t^T = W^T diag(1 - h_t^2)
    """

    scale: torch.Tensor
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None
    diag: torch.Tensor | None = None


class Op:
    """Canonical transitions: ``kind`` in ``{"dense", "diag", "factored"}``.

    ``a`` is the dense ``(N|1, T, H, H)`` or diagonal ``(N|1, T, H)`` tensor; for ``factored``,
    ``d`` ``(N|1, T, H)`` or ``None``, ``s`` ``(N|1, T, K)``, ``L`` ``(H, K)`` or ``None``,
    ``R`` ``(K, H)`` or ``None``. Slicing keeps the time dim at position 1 until
    :meth:`at` drops it.
    """

    def __init__(self, kind: str, H: int, *, a=None, d=None, s=None, L=None, R=None):
        self.kind, self.H = kind, H
        self.a, self.d, self.s, self.L, self.R = a, d, s, L, R

    # -- shape ----------------------------------------------------------------------------------
    @property
    def K(self) -> int:
        return self.s.shape[-1]

    @property
    def per_step(self) -> list[str]:
        return ["a"] if self.kind != "factored" else ["d", "s"]

    def map_steps(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Op:
        """A new Op with ``fn`` applied to every per-step tensor (shared matrices kept)."""
        new = Op(self.kind, self.H, a=self.a, d=self.d, s=self.s, L=self.L, R=self.R)
        for name in self.per_step:
            t = getattr(self, name)
            if t is not None:
                setattr(new, name, fn(t))
        return new

    def at(self, t: int) -> Op:
        """Step ``t`` only: per-step tensors lose their time dim (``(N|1, ...)``)."""
        return self.map_steps(lambda x: x[:, t])

    def batch_rows(self) -> int:
        """1 when the transitions are shared by all batch rows, else ``N``."""
        t = self.a if self.kind != "factored" else self.s
        return t.shape[0]

    # -- algebra ----------------------------------------------------------------------------------
    def transpose(self) -> Op:
        """``A_t^T`` for every step (dense: a transposed view; factored: swap and transpose
        ``L`` and ``R``)."""
        if self.kind == "dense":
            return Op("dense", self.H, a=self.a.transpose(-1, -2))
        if self.kind == "diag":
            return self
        return Op("factored", self.H, d=self.d, s=self.s,
                  L=None if self.R is None else self.R.t(),
                  R=None if self.L is None else self.L.t())

    def _right(self, x: torch.Tensor, mat: bool) -> torch.Tensor:
        """``R x`` (x: ``(..., H)`` vectors or ``(..., H, M)`` matrices)."""
        reps = self.K // self.H
        if self.R is None and reps == 1:
            return x
        if mat:
            return self.R @ x if self.R is not None else x.repeat(*([1] * (x.dim() - 2)), reps, 1)
        return x @ self.R.t() if self.R is not None else x.repeat(*([1] * (x.dim() - 1)), reps)

    def _left(self, u: torch.Tensor, mat: bool) -> torch.Tensor:
        """``L u`` (u: ``(..., K)`` vectors or ``(..., K, M)`` matrices)."""
        if self.L is not None:
            return self.L @ u if mat else u @ self.L.t()
        H = self.H
        if self.K == H:
            return u
        if mat:
            return u.unflatten(-2, (-1, H)).sum(-3)
        return u.unflatten(-1, (-1, H)).sum(-2)

    def apply(self, x: torch.Tensor, mat: bool = False) -> torch.Tensor:
        """``A x`` with the per-step tensors of this Op broadcast against ``x``.

        ``x`` is ``(..., H)`` (``mat=False``) or ``(..., H, M)`` (``mat=True``); the leading dims
        of ``x`` line up with the leading (batch[, time]) dims of the per-step tensors.
        """
        if self.kind == "dense":
            return self.a @ x if mat else (self.a @ x.unsqueeze(-1)).squeeze(-1)
        if self.kind == "diag":
            return self.a.unsqueeze(-1) * x if mat else self.a * x
        u = self._right(x, mat)
        u = u * (self.s.unsqueeze(-1) if mat else self.s)
        out = self._left(u, mat)
        if self.d is not None:
            out = out + (self.d.unsqueeze(-1) * x if mat else self.d * x)
        return out

    def dense(self) -> torch.Tensor:
        """The matrices themselves: ``(N|1, T, H, H)`` (diagonal ones are embedded)."""
        if self.kind == "dense":
            return self.a
        if self.kind == "diag":
            return torch.diag_embed(self.a)
        eye = torch.eye(self.H, dtype=self.s.dtype, device=self.s.device)
        return self.apply(eye.expand(*self.s.shape[:-1], self.H, self.H), mat=True)

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.a] if self.kind != "factored" else [self.d, self.s, self.L, self.R]
