"""Sequential evaluation: one Gauss-Seidel sweep, position by position (the reference result)."""

from __future__ import annotations

import torch

from paraprop.solvers.base import State, System, accept


class Sequential:
    """Evaluate position ``t`` from the final positions ``< t``, for ``t = 0 .. T-1``.

    This is how a feedforward computation is normally run: ``T`` dependent steps, each one call of
    ``fn`` (or of ``fn.update(x, [t])`` when ``fn`` provides it). Every other method returns this
    result. It has no stopping rule: all ``T`` steps are always taken.
    """

    name = "sequential"

    def bound(self, system: System) -> int:
        return system.T

    def init(self, system: System, state: State) -> None:
        state.extra["t"] = 0

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        t = state.extra["t"]
        index = torch.tensor([t], device=state.x.device)
        new = system.update(state.x, index)
        system.check_finite(new, index)
        accept(state, t, t + 1, new, -1.0, norm)  # tol < 0: no sample stops early
        state.extra["t"] = t + 1
        state.finished = t + 1 == system.T
