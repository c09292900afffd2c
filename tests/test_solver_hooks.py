"""Every solver declares the optional hooks of ``fn`` it uses (``solver.hooks``), and uses no
other: a spy around a map that offers every hook records the hooks each solver calls."""

import pytest
import torch
from torch import nn

import paraprop
from paraprop import solvers
from paraprop.solvers.protocols import HOOKS

T = 12
W = torch.randn(T, T, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
W = W.tril(-1) * 0.3


class EveryHook(nn.Module):
    """``tanh(W x + 1)`` with update, window and propose, each computing ``fn``'s values."""

    def forward(self, x):
        return torch.tanh(x @ W.T + 1.0)

    def update(self, x, index):
        return self(x)[..., index]

    def window(self, x, start, stop, cache):
        return self(x)[..., start:stop], cache

    def propose(self, x, final):
        return None


class Spy:
    """Forwards everything to ``inner`` and records the hooks (keys of HOOKS) called or read."""

    def __init__(self, inner, log):
        self.__dict__.update(inner=inner, log=log)

    def __call__(self, x):
        return self.inner(x)

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if name not in HOOKS:
            return value
        if not callable(value):
            self.log.add(name)
            return value

        def called(*args, **kwargs):
            self.log.add(name)
            return value(*args, **kwargs)
        return called


SOLVERS = [solvers.Sequential(), solvers.Jacobi(), solvers.JacobiGS(block_size=4),
           solvers.GSJacobi(block_size=4), solvers.SlidingJacobi(window=4),
           solvers.TriangularAnderson()]


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s.name)
def test_solvers_use_only_the_hooks_they_declare(solver):
    used = set()
    sol = paraprop.solve(Spy(EveryHook(), used), torch.zeros(2, T, dtype=torch.float64),
                         method=solver, tol=1e-10)
    assert sol.converged
    assert used <= set(solver.hooks), (solver.name, used, solver.hooks)
    assert set(solver.hooks) <= set(HOOKS)
    if solver.hooks:   # a declared hook is one the solver really reaches for
        assert used, solver.name


@pytest.mark.parametrize("solver", [solvers.Newton(), solvers.QuasiNewton(), solvers.ELK(),
                                    solvers.QuasiELK()], ids=lambda s: s.name)
def test_newton_family_uses_only_the_markov_hooks(solver):
    torch.manual_seed(0)
    cell = nn.GRUCell(2, 3).double()
    rec = paraprop.Recurrence(cell, torch.randn(4, 10, 2, dtype=torch.float64),
                              torch.zeros(4, 3, dtype=torch.float64))
    used = set()
    spy = Spy(rec, used)
    sol = paraprop.solve(spy, torch.zeros(4, 10, 3, dtype=torch.float64), method=solver,
                         dim=1, tol=1e-9)
    assert sol.converged
    assert used <= set(solver.hooks), (solver.name, used)
    assert "linearize" in used or "newton_step" in used
