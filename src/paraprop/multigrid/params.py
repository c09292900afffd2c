"""Parameter bookkeeping shared by the modules: cached lists, stacking, gradient order.

Walking ``named_parameters()`` of a thousand blocks costs milliseconds per call, more than a
batched relaxation sweep; the lists are built once and rebuilt after ``module.to(...)`` and the
like (``_apply``). The stacked copies are made afresh for every solve: a cache keyed on tensor
versions would miss updates made through ``.data``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from paraprop.determinism import DROPOUT_ATTRIBUTES, NORM_MODULES, RANDOM_MODULES

__all__ = ["NORM_MODULES", "RANDOM_MODULES", "STATEFUL_MODULES", "BlockParams",
           "stateful_modules"]

# Module types whose training mode MGRIT cannot reproduce (paraprop.determinism's lists): norm
# layers that update running statistics, and layers that draw random numbers.
STATEFUL_MODULES = NORM_MODULES + RANDOM_MODULES


def _may_be_stochastic(m: nn.Module) -> bool:
    return isinstance(m, STATEFUL_MODULES) or any(
        getattr(m, a, None) is not None for a in DROPOUT_ATTRIBUTES)


def stateful_modules(blocks: Iterable[nn.Module]) -> list[tuple[int, str, nn.Module]]:
    """``(block index, qualified name, module)`` of every submodule of ``blocks`` that may make
    a block's training-mode output not a fixed function of its input: the types of
    :data:`paraprop.determinism.RANDOM_MODULES` and :data:`~paraprop.determinism.NORM_MODULES`,
    and modules with an attribute through which libraries apply functional dropout
    (:data:`paraprop.determinism.DROPOUT_ATTRIBUTES`); a block used at several depths is listed
    at its first. Listed once (a walk over every module); whether each one is active is decided
    at every forward (:func:`paraprop.multigrid.common.check_block_modes`)."""
    out: list[tuple[int, str, nn.Module]] = []
    seen: set[int] = set()
    for i, b in enumerate(blocks):
        if id(b) in seen:
            continue
        seen.add(id(b))
        out.extend((i, name, m) for name, m in b.named_modules() if _may_be_stochastic(m))
    return out


class BlockParams:
    """The parameters and buffers of ``blocks``, listed once.

    Arguments:
        blocks: the residual branches (their parameter objects must not be replaced; in-place
            updates are fine; call :meth:`reset` after replacing any). A block, or a
            parameter, may occur at several depths: its gradient is the sum over its uses.
    """

    def __init__(self, blocks: Sequence[nn.Module] | nn.ModuleList):
        self.blocks = blocks
        self.reset()

    def reset(self) -> None:
        self._named: list[list[tuple[str, torch.Tensor]]] | None = None
        self._bufs: list[list[tuple[str, torch.Tensor]]] | None = None
        self._stateful: list | None = None
        self._kinds: dict | None = None

    def _lists(self) -> tuple[list[list[tuple[str, torch.Tensor]]],
                              list[list[tuple[str, torch.Tensor]]]]:
        """Each block's named parameters and named buffers (listed at the first call)."""
        if self._named is None or self._bufs is None:
            self._named = [list(b.named_parameters()) for b in self.blocks]
            self._bufs = [list(b.named_buffers()) for b in self.blocks]
        return self._named, self._bufs

    def stateful(self) -> list[tuple[int, str, nn.Module]]:
        """The submodules whose training mode MGRIT cannot reproduce (listed once; see
        :func:`paraprop.multigrid.common.stateful_modules`)."""
        if self._stateful is None:
            self._stateful = stateful_modules(self.blocks)
        return self._stateful

    def floating(self) -> list[tuple[int, str, torch.Tensor]]:
        """One ``(block index, name, tensor)`` per distinct dtype and device among the blocks'
        floating parameters and buffers (the first of each), for the input checks. Summarised
        once from the cached lists and again when a representative's dtype or device changed
        (``.data`` assignments); ``.to(...)`` and the like reset it."""
        kinds = self._kinds
        if kinds is None or any((t.dtype, t.device) != k for k, (_, _, t) in kinds.items()):
            kinds = {}
            for i, (named, bufs) in enumerate(zip(*self._lists(), strict=True)):
                for name, t in (*named, *bufs):
                    if t.is_floating_point():
                        kinds.setdefault((t.dtype, t.device), (i, name, t))
            self._kinds = kinds
        return list(kinds.values())

    def buffer_versions(self) -> list[int]:
        """The version counters of every block's buffers (in-place updates bump them)."""
        return [t._version for bufs in self._lists()[1] for _, t in bufs]

    def trainable(self) -> list[torch.Tensor]:
        """Every distinct parameter that requires a gradient, in order of first use (a block,
        or a parameter, used at several depths is listed once)."""
        seen: set[int] = set()
        out = []
        for blk in self._lists()[0]:
            for _, p in blk:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def stack(self) -> tuple[dict, dict]:
        """Detached stacked copies ``name -> (n_blocks, ...)`` of parameters and buffers."""
        named, bufs = self._lists()
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
        uses: dict[int, list[tuple[int, str]]] = {}
        for i, blk in enumerate(self._lists()[0]):
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
