"""The positions of a window that share a formula (:class:`Sel`), as the readers of
:mod:`~paraprop.diffusion.readers` apply a window's steps of one kind together."""

from __future__ import annotations

import torch


class Sel:
    """Positions of a window that share a formula: a slice (an arithmetic progression) or an
    index tensor; ``rel`` relative to the window, which starts at step ``start``."""

    def __init__(self, rel: list[int], start: int):
        self.rel = rel
        self.start = start
        self.n = len(rel)
        step = rel[1] - rel[0] if len(rel) > 1 else 1
        self.sliced = step > 0 and all(b - a == step for a, b in zip(rel, rel[1:], strict=False))
        self._step = step
        self._index: dict[torch.device, torch.Tensor] = {}

    def take(self, t: torch.Tensor, shift: int = 0) -> torch.Tensor:
        """Rows ``rel + shift`` of ``t``."""
        if self.sliced:
            a = self.rel[0] + shift
            return t[a: a + self._step * (self.n - 1) + 1: self._step]
        key = t.device
        if key not in self._index:
            self._index[key] = torch.tensor(self.rel, dtype=torch.long, device=t.device)
        return t.index_select(0, self._index[key] + shift)

    def put(self, out: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` into the rows ``rel`` of ``out``."""
        if self.sliced:
            a = self.rel[0]
            out[a: a + self._step * (self.n - 1) + 1: self._step] = value
        else:
            out.index_copy_(0, self.take(torch.arange(out.shape[0], device=out.device)), value)


__all__ = ["Sel"]
