"""Parameter bookkeeping shared by the modules: cached lists, stacking, gradient order.

Walking ``named_parameters()`` of a thousand blocks costs milliseconds per call, more than a
batched relaxation sweep; the lists are built once and rebuilt after ``module.to(...)`` and the
like (``_apply``). The stacked copies are made afresh for every solve: a cache keyed on tensor
versions would miss updates made through ``.data``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["BlockParams"]


class BlockParams:
    """The parameters and buffers of ``blocks``, listed once.

    Arguments:
        blocks: the residual branches (their parameter objects must not be replaced; in-place
            updates are fine; call :meth:`reset` after replacing any). A block, or a
            parameter, may occur at several depths: its gradient is the sum over its uses.
    """

    def __init__(self, blocks: Sequence[nn.Module]):
        self.blocks = blocks
        self.reset()

    def reset(self) -> None:
        self._named: list[list[tuple[str, torch.Tensor]]] | None = None
        self._bufs: list[list[tuple[str, torch.Tensor]]] | None = None

    def _build(self) -> None:
        if self._named is None:
            self._named = [list(b.named_parameters()) for b in self.blocks]
            self._bufs = [list(b.named_buffers()) for b in self.blocks]

    def trainable(self) -> list[torch.Tensor]:
        """Every distinct parameter that requires a gradient, in order of first use (a block,
        or a parameter, used at several depths is listed once)."""
        self._build()
        seen: set[int] = set()
        out = []
        for blk in self._named:
            for _, p in blk:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def stack(self) -> tuple[dict, dict]:
        """Detached stacked copies ``name -> (n_blocks, ...)`` of parameters and buffers."""
        self._build()
        named, bufs = self._named, self._bufs
        with torch.no_grad():
            params = {n: torch.stack([blk[i][1] for blk in named])
                      for i, (n, _) in enumerate(named[0])}
            buffers = {n: torch.stack([blk[i][1] for blk in bufs])
                       for i, (n, _) in enumerate(bufs[0])}
        return params, buffers

    def order(self, per_block: list[dict[str, torch.Tensor]], params: Sequence[torch.Tensor]
              ) -> list[torch.Tensor]:
        """The gradient of each of ``params`` from ``per_block`` (one dict per block): the sum
        over every depth (and name) at which the parameter occurs."""
        self._build()
        uses: dict[int, list[tuple[int, str]]] = {}
        for i, blk in enumerate(self._named):
            for n, p in blk:
                uses.setdefault(id(p), []).append((i, n))
        out = []
        for p in params:
            (i, n), *rest = uses[id(p)]
            g = per_block[i][n]
            if rest:
                g = g.clone()
                for j, m in rest:
                    g += per_block[j][m]
            out.append(g)
        return out
