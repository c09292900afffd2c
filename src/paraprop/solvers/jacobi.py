"""Jacobi iteration: every position updated from the previous iterate at once (Algorithm 1)."""

from __future__ import annotations

import torch

from paraprop.solvers.base import State, System, accept, settle, verify_fixed_point


class Jacobi:
    """``x_k = fn(x_{k-1})``, one call of ``fn`` per sweep (Song et al. 2021, Algorithm 1).

    After sweep ``k`` the positions ``< k`` equal the sequential result exactly (Proposition 1),
    so at most ``T`` sweeps are needed, and a position ``< k - 1`` that still moves at sweep
    ``k`` proves that ``fn`` is not triangular. A sample stops early on the contraction estimate
    of its error (:mod:`paraprop.solvers.stopping`). If sweep ``T`` still moved a sample, one
    more evaluation checks that the result is a fixed point.

    Example:
        >>> W = torch.randn(6, 6).tril(-1)
        >>> sol = paraprop.solve(lambda x: torch.tanh(x @ W.T), torch.zeros(6),
        ...                      method=paraprop.solvers.Jacobi(), tol=0)
        >>> sol.iterations <= 6
        True
    """

    name = "jacobi"

    def __repr__(self) -> str:
        return "Jacobi()"

    def bound(self, system: System) -> int:
        return system.T

    def init(self, system: System, state: State) -> None:
        state.extra["k"] = 0
        state.extra["positions"] = torch.arange(system.T, device=state.x.device)
        state.verified = True  # it stops only on a sweep of fn that reproduced the iterate

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        k = state.extra["k"] + 1
        y = system.evaluate(state.x)
        # positions < k - 1 are final, position k - 1 is computed from them
        y, kept = system.keep_finite(y, state.x, k - 1, state.extra["positions"], state.active)
        accept(system, state, 0, system.T, y, tol, norm, exact=k - 1, kept=kept)
        state.extra["k"] = k
        moving = settle(state, k >= system.T)
        if k >= system.T and moving:  # the bound, still moving: verify
            verify_fixed_point(system, state, 0, system.evaluate(state.x), tol)
