"""The inputs and records of a chain whose steps read history
(:class:`~paraprop.diffusion.programs.HistoryProgram`: DPM-Solver++ of order 2 and 3), a part of
:class:`~paraprop.diffusion.chain.DiffusionChain`.

Step ``s`` reads the records (converted model outputs) of the ``history`` steps before it. A
window of steps gets them from the certified prefix where every sample's prefix covers them
(``exact_records``), else the chain evaluates those steps in the window's own model call from
their inputs in the iterate (:meth:`HistoryInputs.past_of`). Each step's *joint* input (its own
and the inputs of the steps it reads the records of) is what its gain is observed against
(:meth:`HistoryInputs.joint_history`).
"""

from __future__ import annotations

import torch


class HistoryInputs:
    """The history part of :class:`~paraprop.diffusion.chain.DiffusionChain` (a mixin: the
    attributes below are the chain's)."""

    history: int
    B: int
    F: int
    lo: int
    x_init: torch.Tensor
    x_lo: torch.Tensor
    x_hist: torch.Tensor
    exact: torch.Tensor
    has_next: torch.Tensor
    exact_records: torch.Tensor | None

    def inputs(self, X: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``x_s`` for the system's positions ``[start, stop)``: the input of step ``lo``, then
        the positions of ``X``."""
        if start == 0:
            return torch.cat([self.x_lo[:, None], X[:, : stop - 1]], dim=1)
        return X[:, start - 1 : stop - 1]

    def _joint(self, hist: torch.Tensor | None, xin: torch.Tensor) -> torch.Tensor:
        """``(B, n, history * F)``: the inputs of the ``history`` steps before each step of a
        window (nearest first; ``x_0`` before step 0), from the window's inputs ``xin`` and
        the inputs ``hist`` of the steps before it."""
        H, n = self.history, xin.shape[1]
        assert hist is not None
        pad = H - hist.shape[1]
        full = torch.cat([self.x_init[:, None].expand(self.B, pad, self.F), hist, xin], dim=1)
        return torch.cat([full[:, H - j: H - j + n] for j in range(1, H + 1)], dim=2)

    def joint_history(self, X: torch.Tensor) -> torch.Tensor:
        """``(B, N, history * F)``: :meth:`_joint` for every step of the full trajectory
        ``X`` ``(B, N, F)``."""
        xin = torch.cat([self.x_init[:, None], X[:, :-1]], dim=1)
        return self._joint(xin[:, :0], xin)

    def full_inputs(self, X: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """``(B, b - a, F)``: the inputs of the absolute steps ``[a, b)`` in the full
        trajectory ``X`` ``(B, N, F)`` (``x_0`` for step 0)."""
        if a == 0 and b > 0:
            return torch.cat([self.x_init[:, None], X[:, : b - 1]], dim=1)
        return X[:, a - 1: b - 1]

    def past_of(self, X: torch.Tensor, start: int, certified: int | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(hist, past)`` for :meth:`steps` of the system's steps from ``start`` on (in the
        solver's iterate ``X``): the inputs of the steps before, and their certified records
        where every sample's certified prefix covers them (``certified``: the least; else
        ``None``: the call evaluates them)."""
        if not self.history:
            return None, None
        a0 = self.lo + start
        h = min(self.history, a0)
        hist = self._sys_inputs(X, start - h, start)
        if certified is None:
            certified = int((self.exact + self.has_next).min())
        assert self.exact_records is not None   # (kept where there is history)
        past = self.exact_records[:, a0 - h: a0] if certified >= a0 else None
        return hist, past

    def _sys_inputs(self, X: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """The inputs of the system's steps ``[a, b)`` (``a`` may reach ``history`` steps
        before ``lo``: :attr:`x_hist`)."""
        hb = self.x_hist.shape[1]
        if a == b:
            return X[:, :0]
        parts = []
        if a < 0:
            parts.append(self.x_hist[:, hb + a: hb + min(b, 0)])
        if a <= 0 < b:
            parts.append(self.x_lo[:, None])
        if b > 1:
            parts.append(X[:, max(a, 1) - 1: b - 1])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)



__all__ = ["HistoryInputs"]
