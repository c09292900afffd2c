"""The solve of one autoregressive part of a flow (shared by every library): the transform
inverted by :func:`paraprop.solve` within the library's own passes, its :class:`paraprop.Solution`,
and the settings every entry point validates once.

A masked autoregressive transform ``y = f(x)`` is inverted by the libraries with passes
``x <- h(x) := f_x^{-1}(y)`` from zeros. ``h`` is triangular (position ``i`` of ``h(x)`` reads
only the positions before ``i`` in the transform's order), so its fixed point is unique and
Jacobi reaches it after at most ``D`` passes (Song et al. 2021, §3, Proposition 1); stopping at
the bitwise fixed point (``tol=0``) returns exactly what the library's loop returns. The solve
never takes more passes than the library's loop (:class:`~paraprop.flows.passes.Passes` proves
from the passes which features are exact, stops the solver when the final pass will give the
inverse, or when its next pass could exceed the library's count, and then runs the library's
loop from the features proven exact). The order of the features is planned once per order
(:mod:`paraprop.flows.order`); the gradient is attached by implicit differentiation
(:mod:`paraprop.flows.gradient`).

Every entry point refuses an autoregressive network in train mode with dropout or another
stochastic layer (:func:`paraprop.flows.arguments.require_deterministic_parts`): its passes would
differ from call to call, so there is no fixed point, and the library's own loop returns a
different value each time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from paraprop import checks
from paraprop.checks import check_max_iters, check_tol
from paraprop.determinism import refuse_random_draws
from paraprop.driver import Outcome, build
from paraprop.errors import ConvergenceError
from paraprop.flows.gradient import implicit
from paraprop.flows.order import order_plan
from paraprop.flows.passes import Passes, Stop, check_finite
from paraprop.result import Result, Solution
from paraprop.solve import solve
from paraprop.solvers import METHODS, NEWTON_METHODS, make_solver

# the triangular (non-Markov) methods: Newton's family needs a Markov system
FLOW_METHODS = tuple(m for m in METHODS if m not in NEWTON_METHODS)


@dataclasses.dataclass
class Settings:
    """How each autoregressive transform is inverted (validated by :func:`settings`)."""

    solver: Any   # a solver object (paraprop.solvers.make_solver: the solver protocol)
    tol: float
    max_iters: int | None
    throw: bool


def settings(method, tol, max_iters, throw) -> Settings:
    """Validate the shared arguments once, at an entry point."""
    solver = make_solver(method, names=FLOW_METHODS)
    check_tol(tol)
    check_max_iters(max_iters)
    checks.boolean("throw", throw)
    return Settings(solver, tol, max_iters, throw)


def invert_part(h: Callable[[torch.Tensor], torch.Tensor], y: torch.Tensor,
                order: torch.Tensor | None, cfg: Settings,
                record: Callable[[Solution], None], *, passes: int,
                where: str = "") -> torch.Tensor:
    """The fixed point of ``x = h(x)`` (``h`` triangular in ``order``), differentiable, in at
    most ``passes`` evaluations of ``h`` (the library's own loop: every pass counted, the
    differentiable one included).

    Arguments:
        h: one pass of the library's inverse loop, ``x -> f_x^{-1}(y)``.
        y: the point being inverted (its shape is the shape of ``x``; the last dim is the
            features).
        order: the rank of each feature in the transform's order (``None``: natural order);
            features of equal rank form one group (they do not read each other).
        cfg: the solver settings.
        record: called with the :class:`Solution` of the inverse (``evaluations``: every pass).
        passes: the passes of the library's own loop: the budget.
        where: the part, for messages.
    """
    grad = torch.is_grad_enabled()
    with refuse_random(where, y.device):
        with torch.no_grad():
            run = tracked_solve(h, y, order, cfg, passes=passes, where=where)
        extra = 1
        if grad:
            x = implicit(h, run.x, run.groups)
        elif run.complete or run.sol is not None:   # exact already, or the solver's own value
            x, extra = run.x, 0
        else:                                       # exact but for the last group: one pass
            x = h(run.x)
    check_finite(x, where)
    record(run.solution(x.detach(), extra))
    return x


def refuse_random(where: str, device: torch.device):
    """Around an inverse: an autoregressive network that draws random numbers (a
    ``torch.randn_like`` in its ``forward``, which no list of stochastic layers knows) moves the
    device's global generator; that raises :class:`StochasticModelError` naming the part (its
    passes differ from call to call: there is no inverse to reproduce)."""
    part = f"the autoregressive part {where}" if where else "an autoregressive part"
    return refuse_random_draws(device, (
        f"paraprop.flows: the network of {part} drew random numbers during the inverse "
        f"(torch's global generator on {device} moved: torch.randn_like, dropout, ...): its "
        "passes differ from call to call, so neither the library's loop nor paraprop has an "
        "inverse to reproduce (expected a network that is a fixed function of its input). "
        "Call flow.eval() if it draws only in training mode, or remove the random "
        "operation; undo() on the paraprop.flows.accelerate handle runs the library's own "
        "loop"))


@dataclasses.dataclass
class Run:
    """What :func:`tracked_solve` found: ``x`` (feature order, no graph) is either the solver's
    own value (``sol`` set: it stopped by its own rule) or values proven exact on every group
    but possibly the last (``sol`` ``None``; ``complete``: on every group), so that one more
    pass gives the exact inverse."""

    x: torch.Tensor
    sol: Solution | None
    complete: bool
    exact: bool          # one more pass at x is the exact inverse (or x is)
    groups: int
    evaluations: int
    budget: int
    method: str
    D: int
    why: str             # how it ended, for stats["finished_by"]
    time_s: float
    cap: int | None = None
    fallback: int = 0    # passes of the library's loop after the budget stopped the solver

    def solution(self, value: torch.Tensor, extra: int) -> Solution:
        """The part's Solution, ``value`` its result, ``extra`` the passes run after the solve
        (the final or differentiable pass)."""
        total = self.evaluations + extra
        common = {"sequential_steps": total, "library_passes": self.budget,
                  "groups": self.groups, "finished_by": self.why,
                  "fallback_passes": self.fallback}
        if self.sol is not None:
            return dataclasses.replace(self.sol, value=value, evaluations=total,
                                       stats={**self.sol.stats, **common})
        common.pop("sequential_steps")
        out = Outcome(
            value, Result.successful if self.exact else Result.max_iters_reached,
            evaluations=total, positions=total * self.D, sequential_steps=total,
            bound=self.groups, error_estimate=0.0 if self.exact else float("inf"),
            stats={"T": self.D, "verification": "exact prefix" if self.exact else "none",
                   **common},
            reason=None if self.exact else (f"max_iters={self.cap} ended the passes before "
                                            "every feature was proven exact"))
        return build(self.method, out, iterations=self.evaluations, time_s=self.time_s)


def tracked_solve(h, y, order, cfg, *, passes: int, where: str = "") -> Run:
    """Solve ``x = h(x)`` from zeros, positions sorted by ``order``, in at most ``passes``
    evaluations of ``h`` together with the one pass that follows (see :class:`Passes`)."""
    start = time.perf_counter()
    D = y.shape[-1]
    plan = order_plan(order, D, y.device)
    perm, inv = plan.perm, plan.inv
    fn = h
    if perm is not None:
        def fn(xp):
            return h(xp.index_select(-1, inv)).index_select(-1, perm)

    tracker = Passes(fn, plan, budget=passes, where=where, method=cfg.solver.name)
    sol = None
    if y.numel():
        try:
            sol = solve(tracker, torch.zeros_like(y), method=cfg.solver, tol=cfg.tol,
                        max_iters=cfg.max_iters, throw=cfg.throw)
        except Stop:
            pass
    if sol is None:
        exact = tracker.finish(cfg.max_iters)
        x, complete = tracker.value(y), tracker.p_min >= tracker.G
        why = ("max_iters" if not exact else
               f"budget: the {cfg.solver.name} passes could have exceeded the library's "
               f"{passes}; {tracker.fallback} passes of the library's own loop went on from the "
               "features proven exact" if tracker.stopped == "budget" else
               "exact prefix: every feature proven exact but for the last group, which the "
               "final pass computes")
        if not exact and cfg.throw:
            raise ConvergenceError(
                f"paraprop.flows: the inverse of {where or 'an autoregressive part'} did not "
                f"converge within max_iters={cfg.max_iters} passes (the library's loop takes "
                f"{passes}); pass max_iters=None, or throw=False for the unconverged value")
    else:
        x, exact, complete, why = sol.value, sol.converged, False, "solver"
    if inv is not None:
        x = x.index_select(-1, inv)
    return Run(x=x, sol=sol, complete=complete, exact=exact, groups=tracker.G,
               evaluations=tracker.evals, budget=passes, method=cfg.solver.name, D=D, why=why,
               time_s=time.perf_counter() - start, cap=cfg.max_iters,
               fallback=tracker.fallback)


def combine(parts: list[Solution], method: str, value: torch.Tensor, time_s: float) -> Solution:
    """One Solution for solves run one after another (e.g. the transforms of a flow)."""
    residuals = torch.cat([p.residuals for p in parts]) if parts \
        else torch.empty(0, dtype=torch.float64)
    out = Outcome(
        value, next((p.result for p in parts if not p.converged), Result.successful),
        evaluations=sum(p.evaluations for p in parts),
        positions=sum(p.stats.get("positions") or 0 for p in parts),
        sequential_steps=sum(p.stats.get("sequential_steps") or 0 for p in parts),
        error_estimate=sum(p.stats.get("error_estimate") or 0.0 for p in parts),
        stats={"parts": parts},
        # why a part could not certify, where that is not max_iters (its solve's words)
        reason=next((f"part {k}: {p.stats['not_converged']}" for k, p in enumerate(parts)
                     if not p.converged and p.stats.get("not_converged")), None))
    return build(method, out, iterations=sum(p.iterations for p in parts),
                 residuals=residuals, time_s=time_s)
