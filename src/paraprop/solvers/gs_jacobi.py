"""GS-Jacobi: blocks one after another, Jacobi inside the current block (Algorithm 3)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from paraprop import checks
from paraprop.solvers.base import Solver, State, accept, settle
from paraprop.solvers.triangular import System
from paraprop.solvers.verify import final_step


@dataclass(slots=True)
class _GSJacobiState:
    blocks: int               # how many blocks
    bs: int                   # positions per block
    index: torch.Tensor       # arange(T), for the non-finite checks
    block: int = 0            # the current block
    sweep: int = 0            # sweeps of the current block so far
    # (B,) float64 per block done: its samples' error estimates (they add up)
    estimates: list[torch.Tensor] = field(default_factory=list)


class GSJacobi(Solver):
    """Blocks of ``block_size`` positions solved in order (Song et al. 2021, Algorithm 3).

    The current block is iterated by Jacobi (one call per sweep of ``fn.window`` on the block's
    positions, whose cached-prefix promise holds since the blocks before it are final; else of
    ``fn.update`` with them, or of ``fn``) until the contraction estimate of its error is within
    its share of ``tol`` (``tol * len(block) / T``: the frozen blocks' errors add up along the
    sequence) or it has had as many sweeps as positions, then frozen. Each block needs at most
    ``block_size`` sweeps, so at most ``T`` sweeps in all (Proposition 2). Per-sample stopping
    applies inside each block.

    Arguments:
        block_size: positions per block; ``None``: ``ceil(sqrt(T))``.

    Example:
        >>> W = 0.5 * torch.randn(8, 8).tril(-1)
        >>> fn = lambda x: torch.tanh(x @ W.T + 1)
        >>> ref = paraprop.solve(fn, torch.zeros(8), method="sequential")
        >>> sol = paraprop.solve(fn, torch.zeros(8), method=paraprop.solvers.GSJacobi(4), tol=0)
        >>> sol.converged, torch.equal(sol.value, ref.value)    # tol=0: bitwise
        (True, True)
    """

    name = "gs_jacobi"
    # the optional hooks of fn it calls (solvers.protocols; the final check calls fn):
    # fn.window (else fn.update, else fn)
    hooks: tuple[str, ...] = ("window", "update")

    def __init__(self, block_size: int | None = None):
        self.block_size = checks.positive_int("GSJacobi: block_size", block_size,
                                              allow_none=True)

    def __repr__(self) -> str:
        return f"GSJacobi(block_size={self.block_size!r})"

    def size(self, system: System) -> int:
        bs = self.block_size or math.ceil(math.sqrt(system.T))
        return min(bs, system.T)

    def init(self, system: System, state: State) -> None:
        bs = self.size(system)
        state.own = _GSJacobiState(math.ceil(system.T / bs), bs,
                                   torch.arange(system.T, device=state.x.device))
        state.stats = {"block_size": bs}
        state.estimated_from = torch.full((system.B,), system.T, dtype=torch.long,
                                          device=state.x.device)
        # a block is certified by reasoning (its inputs were final) or on its error estimate,
        # with the window's values: one evaluation of fn at the end checks them all
        # (paraprop.solvers.verify), within the budget of T calls
        state.verified = False

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        e: _GSJacobiState = state.own
        if system.evaluations == system.T - 1:
            # the budget's last call (every call made one more position final, so only the
            # last position is left): one evaluation of fn checks the value and gives it
            final_step(system, state, tol, norm)
            self._close(state, [state.estimate])
            return
        lo = e.block * e.bs
        hi = min(system.T, lo + e.bs)
        vals = system.window(state.x, lo, hi)
        e.sweep += 1
        # positions < lo + sweep - 1 are final; position lo + sweep - 1 is computed from them
        vals, kept = system.keep_finite(vals, lambda: state.x[:, lo:hi], lo + e.sweep - 1,
                                        e.index[lo:hi], state.active, x=state.x)
        was = state.active
        accept(system, state, lo, hi, vals, tol, norm, exact=e.sweep - 1,
               budget=tol * (hi - lo) / system.T, kept=kept)
        if tol > 0 and state.active is not was:
            # samples frozen on the estimate: the positions from the first one not computed
            # from final inputs on were not (paraprop.solvers.verify tells the two apart)
            frozen = was & ~state.active & (state.estimate > 0)
            frm = state.estimated_from
            assert frm is not None   # set by init
            state.estimated_from = torch.where(
                frozen, torch.minimum(frm, torch.full_like(frm, lo + e.sweep)), frm)
        at_bound = e.sweep >= hi - lo
        moving = settle(state, False)
        # (a block at its bound is final by the triangular structure: the one evaluation of fn
        # at the end checks every block at once, paraprop.solvers.verify)
        if at_bound or not moving:
            e.block += 1
            e.sweep = 0
            e.estimates.append(state.estimate.clone())
            state.estimate.zero_()
            state.active[:] = True  # every sample starts the next block
            state.all_active, state.n_active = True, system.B
            state.rule.reset()
            state.finished = False   # (settle: no sample left in this block)
            if e.block == e.blocks:
                self._close(state, [])

    @staticmethod
    def _close(state: State, current: list) -> None:
        """The solve is done: the frozen blocks' estimates add up along the sequence."""
        state.finished = True
        state.active = torch.zeros_like(state.active)
        state.estimate = torch.stack(state.own.estimates + current).sum(0)
