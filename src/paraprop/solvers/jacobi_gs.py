"""Jacobi-GS: all blocks in parallel, positions inside a block one after another (Algorithm 2)."""

from __future__ import annotations

import math

import torch

from paraprop.solvers._settings import positive_int_or_none
from paraprop.solvers.base import State, System, accept, verify_fixed_point


class JacobiGS:
    """Positions split into contiguous blocks of ``block_size`` (Song et al. 2021, Algorithm 2).

    One iteration is a Gauss-Seidel sweep through the ``block_size`` offsets: step ``j`` updates
    offset ``j`` of every block at once (one call of ``fn``, or of ``fn.update`` with those
    positions), always from the newest values. After iteration ``k`` the first ``k`` blocks are
    exact (Proposition 2), so at most ``ceil(T / block_size)`` iterations. A sample stops early on
    the contraction estimate of its error.

    Arguments:
        block_size: positions per block; ``None``: ``ceil(sqrt(T))``, which balances the
            ``block_size`` calls per iteration against the ``T / block_size`` iterations.
    """

    name = "jacobi_gs"

    def __init__(self, block_size: int | None = None):
        self.block_size = positive_int_or_none("block_size", block_size, "JacobiGS")

    def __repr__(self) -> str:
        return f"JacobiGS(block_size={self.block_size!r})"

    def size(self, system: System) -> int:
        bs = self.block_size or math.ceil(math.sqrt(system.T))
        return min(bs, system.T)

    def bound(self, system: System) -> int:
        return math.ceil(system.T / self.size(system))

    def init(self, system: System, state: State) -> None:
        device = state.x.device
        bs = self.size(system)
        # offset j of every block: positions j, j + bs, j + 2 bs, ... below T
        state.extra["offsets"] = [torch.arange(j, system.T, bs, device=device) for j in range(bs)]
        state.extra["k"] = 0
        state.extra["stats"] = {"block_size": bs}

    def _sweep(self, system: System, state: State) -> torch.Tensor:
        work = state.x.clone()
        for index in state.extra["offsets"]:
            vals = system.update(work, index)
            system.check_finite(vals, index)
            work.index_copy_(1, index, vals)
        return work

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        k = state.extra["k"] + 1
        work = self._sweep(system, state)
        exact = min((k - 1) * self.size(system), system.T)
        accept(system, state, 0, system.T, work, tol, norm, exact=exact)
        state.extra["k"] = k
        at_bound = k >= self.bound(system)
        state.finished = at_bound or not bool(state.active.any())
        if at_bound and bool(state.active.any()):  # still moving at the bound: verify
            verify_fixed_point(system, state, 0, self._sweep(system, state), tol)
