"""paraprop.Result: every Solution carries a result code, and converged derives from it."""

import dataclasses
import pickle

import pytest
import torch
from torch import nn

import paraprop
from paraprop import Result, Solution


def _fn(T=12):
    W = torch.randn(T, T, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    W = W.tril(-1) * 0.3
    return lambda x: torch.tanh(x @ W.T + 1.0), torch.zeros(3, T, dtype=torch.float64)


def test_converged_solve_is_successful():
    fn, x0 = _fn()
    sol = paraprop.solve(fn, x0, method="jacobi", tol=1e-10)
    assert sol.result is Result.successful and sol.converged
    assert sol.message == Result.successful.value


def test_max_iters_is_max_iters_reached():
    fn, x0 = _fn()
    sol = paraprop.solve(fn, x0, method="jacobi", tol=1e-12, max_iters=2, throw=False)
    assert sol.result is Result.max_iters_reached and not sol.converged
    with pytest.raises(paraprop.ConvergenceError, match="within max_iters=2") as e:
        paraprop.solve(fn, x0, method="jacobi", tol=1e-12, max_iters=2)
    assert e.value.solution.result is Result.max_iters_reached


def test_failed_final_check_is_not_certified():
    # a map whose update disagrees with its full evaluation in the last bit: the tol=0 final
    # check cannot certify the Jacobi-GS value, which reads not_certified (not max_iters)
    T = 10
    W = torch.randn(T, T, generator=torch.Generator().manual_seed(1)).tril(-1) * 0.4

    class Map(nn.Module):
        def forward(self, x):
            return torch.tanh(x @ W.T + 1.0)

        def update(self, x, index):
            return torch.nextafter(self(x)[..., index], torch.tensor(2.0))

    sol = paraprop.solve(Map(), torch.zeros(2, T), method="jacobi", tol=0, throw=False)
    assert sol.result is Result.successful   # plain Jacobi never calls update
    for method in (paraprop.solvers.JacobiGS(block_size=5), paraprop.solvers.GSJacobi(5)):
        sol = paraprop.solve(Map(), torch.zeros(2, T), method=method, tol=0, throw=False)
        assert sol.result is Result.not_certified and not sol.converged
        assert sol.stats["verification"] == "failed"
        assert sol.message.startswith(Result.not_certified.value + ": fn(x) at the final value")


def test_solution_constructor_result_and_converged():
    v, r = torch.zeros(2), torch.zeros(0, dtype=torch.float64)
    assert Solution(v, "m", 1, 1, True, r, {}).result is Result.successful
    assert Solution(v, "m", 1, 1, False, r, {}).result is Result.max_iters_reached
    assert Solution(v, "m", 1, 1, False, r, {"checked": False}).result is Result.unchecked
    s = Solution(v, "m", 1, 1, residuals=r, stats={}, result=Result.not_certified)
    assert not s.converged
    with pytest.raises(ValueError, match="converged=True contradicts result=not_certified"):
        Solution(v, "m", 1, 1, True, r, {}, result=Result.not_certified)
    with pytest.raises(TypeError, match="result must be a paraprop.Result, got 'ok'"):
        Solution(v, "m", 1, 1, residuals=r, stats={}, result="ok")
    with pytest.raises(TypeError, match="Solution needs result="):
        Solution(v, "m", 1, 1)
    # dataclasses.replace and pickling keep the code (and converged follows it)
    t = dataclasses.replace(s, result=Result.successful)
    assert t.converged and t.method == "m"
    u = pickle.loads(pickle.dumps(s))
    assert u.result is Result.not_certified and not u.converged
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.result = Result.successful
