"""paraprop.driver: one loop for every iterative method, and the one place a Solution is built."""

import ast
import importlib
from pathlib import Path

import pytest
import torch
from torch import nn

import paraprop
from paraprop import Result, driver
from paraprop.driver import COUNTERS, Outcome, build, run

SRC = Path(paraprop.__file__).parent

# every iterative entry point: (module whose `run` it calls, a call of it)
ENTRY_POINTS = {
    "paraprop.solve": lambda: paraprop.solve(
        lambda x: torch.tanh(x.cumsum(-1) - x), torch.zeros(2, 6), method="jacobi", tol=1e-6),
    "paraprop.linalg.entry": lambda: paraprop.linalg.solve(
        paraprop.linalg.BlockBidiagonal([0.5 * torch.eye(3)] * 4, lower=True),
        torch.ones(2, 15), method="jacobi"),
    "paraprop.scan.jacobi": lambda: paraprop.scan.jacobi_recurrence(
        0.3 * torch.ones(1, 8, 2, 2), torch.ones(1, 8, 2), tol=1e-6),
    "paraprop.linalg.mlp": lambda: paraprop.linalg.mlp_forward(
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), torch.ones(2, 3),
        points=paraprop.linalg.activation_points(
            nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), torch.ones(2, 3))),
    "paraprop.multigrid.mgrit": lambda: paraprop.multigrid.mgrit(
        paraprop.multigrid.ForwardStepper(
            [nn.Sequential(nn.Linear(2, 2), nn.Tanh()) for _ in range(8)]),
        torch.ones(3, 2), paraprop.multigrid.Hierarchy.build(8, coarsening=2, levels=2), 0.1),
}


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_iterative_entry_point_runs_through_the_driver(module, monkeypatch):
    mod = importlib.import_module(module)
    seen = []

    def counting(method, **kw):
        assert isinstance(method, driver.Method), type(method)
        seen.append(method.name)
        return run(method, **kw)

    monkeypatch.setattr(mod, "run", counting)
    sol = ENTRY_POINTS[module]()
    assert len(seen) == 1 and sol.method == seen[0]
    assert set(COUNTERS) <= set(sol.stats) and sol.stats["time_s"] > 0
    assert isinstance(sol.result, Result)


def test_solution_is_built_only_by_the_driver():
    # no module of the library calls Solution(...) except paraprop/driver.py
    calls = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Solution":
                calls.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert [c.split(":")[0] for c in calls] == ["driver.py"], calls


class _Count:
    """A toy method: halves its error each step, stops below tol."""

    name = "toy"

    def __init__(self, tol):
        self.tol, self.err, self.inited = tol, 1.0, False

    def init(self):
        self.inited = True

    def stopped(self):
        return self.err <= self.tol

    def step(self):
        self.err /= 2
        return torch.tensor(self.err)

    def outcome(self, iterations):
        ok = self.stopped()
        return Outcome(torch.zeros(1), Result.successful if ok else Result.max_iters_reached,
                       evaluations=iterations, error_estimate=self.err, stats={"own": 1})


def test_run_loop_history_counters_and_throw():
    m = _Count(1 / 16)
    sol = run(m, max_iters=10, entry="toy", throw=True, tol=1 / 16)
    assert m.inited and sol.iterations == 4 and sol.converged
    assert sol.residuals.tolist() == [0.5, 0.25, 0.125, 0.0625]      # one transfer, float64
    assert sol.residuals.dtype == torch.float64
    assert sol.stats["own"] == 1 and sol.stats["positions"] is None
    assert sol.stats["error_estimate"] == 1 / 16
    with pytest.raises(paraprop.ConvergenceError, match=r"toy: method='toy' did not converge "
                       r"within max_iters=2 iterations \(last residual 0.25 > tol=0.0625\)"):
        run(_Count(1 / 16), max_iters=2, entry="toy", throw=True, tol=1 / 16,
            measure="residual")
    sol = run(_Count(1 / 16), max_iters=2, entry="toy", throw=False, tol=1 / 16)
    assert sol.result is Result.max_iters_reached and sol.iterations == 2
    seen = []
    run(_Count(0.3), max_iters=5, entry="toy", throw=True, tol=0.3,
        callback=lambda k, r: seen.append((k, float(r))))
    assert seen == [(1, 0.5), (2, 0.25)]


def test_build_refuses_a_common_counter_in_the_own_stats():
    out = Outcome(torch.zeros(1), Result.successful, evaluations=1, bound=3,
                  stats={"bound": 4})
    with pytest.raises(ValueError, match=r"stats\['bound'\] is a common counter; pass it as "
                       r"Outcome.bound"):
        build("m", out, iterations=1)
    ok = build("m", Outcome(torch.zeros(1), Result.successful, evaluations=1,
                            stats={"bound": 4}), iterations=1)
    assert ok.stats["bound"] == 4       # where the counter was left None, the stats give it
