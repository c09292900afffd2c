"""GS-Jacobi: blocks one after another, Jacobi inside the current block (Algorithm 3)."""

from __future__ import annotations

import math

import torch

from paraprop.solvers.base import State, System, accept, verify_fixed_point


class GSJacobi:
    """Blocks of ``block_size`` positions are solved in order; the current block is iterated
    by Jacobi (one call of ``fn``, or of ``fn.update`` with the block's positions, per sweep)
    until its forward difference is ``<= tol`` or it has had as many sweeps as positions, then
    frozen. Each block needs at most ``block_size`` sweeps, so at most ``T`` sweeps in all
    (Song et al. 2021, Proposition 2). Per-sample stopping applies inside each block.
    """

    name = "gs_jacobi"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def bound(self, system: System) -> int:
        return system.T

    def init(self, system: System, state: State) -> None:
        state.extra.update(block=0, sweep=0, blocks=math.ceil(system.T / self.block_size))

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        e = state.extra
        lo = e["block"] * self.block_size
        hi = min(system.T, lo + self.block_size)
        index = torch.arange(lo, hi, device=state.x.device)
        vals = system.update(state.x, index)
        system.check_finite(vals, index)
        e["sweep"] += 1
        accept(system, state, lo, hi, vals, tol, norm, exact=e["sweep"] - 1)
        if e["sweep"] >= hi - lo and bool(state.active.any()):  # block bound, still moving
            verify_fixed_point(system, state, lo, system.update(state.x, index), tol)
        if e["sweep"] >= hi - lo or not bool(state.active.any()):
            e["block"] += 1
            e["sweep"] = 0
            state.active[:] = True  # every sample starts the next block
            state.finished = e["block"] == e["blocks"]
