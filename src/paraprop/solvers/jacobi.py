"""Jacobi iteration: every position updated from the previous iterate at once (Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paraprop import checks
from paraprop.solvers.base import Solver, State, accept, last_from_x0, settle
from paraprop.solvers.triangular import System


@dataclass(slots=True)
class _JacobiState:
    k: int                    # sweeps done
    positions: torch.Tensor   # arange(T), for the non-finite checks


class Jacobi(Solver):
    """``x_k = fn(x_{k-1})``, one call of ``fn`` per sweep (Song et al. 2021, Algorithm 1).

    After sweep ``k`` the positions ``< k`` equal the sequential result exactly (Proposition 1),
    so at most ``T`` sweeps are needed (as many calls as the sequential loop), and a position
    ``< k - 1`` that still moves at sweep ``k`` proves that ``fn`` is not triangular. A sample
    stops early on the contraction estimate of its error (:mod:`paraprop.stopping`).
    Sweep ``T`` computes the last position as the sequential loop does (from the final
    positions, with ``x0``'s value at the last one) and checks every other position.

    Example:
        >>> W = torch.randn(6, 6).tril(-1)
        >>> sol = paraprop.solve(lambda x: torch.tanh(x @ W.T), torch.zeros(6),
        ...                      method=paraprop.solvers.Jacobi(), tol=0)
        >>> sol.iterations <= 6
        True
    """

    name = "jacobi"
    # the optional hooks of fn this solver calls (paraprop.solvers.protocols): fn only
    hooks: tuple[str, ...] = ()

    def __init__(self, accumulation: bool = True):
        # at tol > 0, hold back a stop where the sweep's changes carried along the positions
        # exceed tol (paraprop.solvers.base._accumulated); False for a caller whose own final
        # check certifies the value and uses the stop only to end its iterations (the
        # diffusion certificate)
        self.accumulation = checks.boolean("Jacobi: accumulation", accumulation)

    def __repr__(self) -> str:
        return "Jacobi()" if self.accumulation else "Jacobi(accumulation=False)"

    def init(self, system: System, state: State) -> None:
        state.own = _JacobiState(0, torch.arange(system.T, device=state.x.device))
        state.verified = True  # it stops only on a sweep of fn that reproduced the iterate

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        own: _JacobiState = state.own
        k = own.k + 1
        if k == system.T:
            # the last sweep the budget allows (T calls, as the sequential loop): positions
            # < T - 1 are final, and position T - 1 is computed from them as the sequential
            # loop's last step does, with x0's value there (so its value is that loop's even if
            # it reads itself); the sweep checks every other position
            last_from_x0(system, state)
        y = system.evaluate(state.x)
        # positions < k - 1 are final, position k - 1 is computed from them
        y, kept = system.keep_finite(y, state.x, k - 1, own.positions, state.active,
                                     x=state.x)
        accept(system, state, 0, system.T, y, tol, norm, exact=k - 1, kept=kept,
               chain=self.accumulation)
        own.k = k
        settle(state, k >= system.T)
