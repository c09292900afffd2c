"""Sequential evaluation: one Gauss-Seidel sweep, position by position (the reference result)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paraprop.solvers.base import Solver, State
from paraprop.solvers.triangular import System


@dataclass(slots=True)
class _SequentialState:
    t: int                # the next position to compute
    index: torch.Tensor   # arange(T), sliced for fn.update's one-position index


class Sequential(Solver):
    """Evaluate position ``t`` from the final positions ``< t``, for ``t = 0 .. T-1``.

    This is how a feedforward computation is normally run: ``T`` dependent steps, each one call of
    ``fn`` (or of ``fn.update(x, [t])`` when ``fn`` provides it). Every other method returns this
    result. It has no stopping rule: all ``T`` steps are always taken.

    Example:
        >>> W = torch.randn(6, 6).tril(-1)
        >>> sol = paraprop.solve(lambda x: torch.tanh(x @ W.T + 1), torch.zeros(6),
        ...                      method=paraprop.solvers.Sequential())
        >>> sol.iterations, sol.evaluations, sol.converged
        (6, 6, True)
    """

    name = "sequential"
    # the optional hooks of fn it calls (solvers.protocols; the final check calls fn):
    # fn.update for one position per step (else fn)
    hooks: tuple[str, ...] = ("update",)

    def init(self, system: System, state: State) -> None:
        state.own = _SequentialState(0, torch.arange(system.T, device=state.x.device))

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        own: _SequentialState = state.own
        t = own.t
        # the reference loop: one position per call, its hooks trusted as the user's own loop
        # would (a copy of x per call to check them would cost T copies)
        state.x[:, t : t + 1] = system.update(state.x, own.index[t : t + 1],
                                              guard=False, check=False)
        state.sample_iterations += 1
        state.residual = None  # one pass, no forward difference
        own.t = t + 1
        state.finished = t + 1 == system.T
        if state.finished:  # the first non-finite position in order is the one that went wrong
            system.check_finite(state.x, hook="update" if system.fast else "fn")
