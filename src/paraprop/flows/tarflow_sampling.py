"""Sampling paraprop's TarFlow: its stack of blocks inverted last to first, each block by a method
of its own, and the per-block plan of ``method="auto"``.

A block is inverted by a triangular method of :func:`paraprop.solve` on its
:class:`~paraprop.flows.tarflow_inverse.BlockInverse`, or by the KV-cached loop
(:func:`~paraprop.flows.tarflow_inverse.sequential_cached`). The plan of ``"auto"`` ranks the
blocks by how fast their inversions converge (after Liu & Qin 2025, "Accelerate TarFlow Sampling
with GS-Jacobi Iteration"): :func:`calibrate` inverts calibration latents with each candidate and
keeps the cheapest per block. Everything here works on patches ``(N, T, P)``; the model
(:class:`paraprop.models.TarFlow`) cuts the images into patches, validates the arguments and
documents what each setting promises.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paraprop import checks
from paraprop.driver import Outcome, build
from paraprop.flows.part_solve import FLOW_METHODS
from paraprop.flows.tarflow_inverse import BlockInverse, sequential_cached
from paraprop.result import Result, Solution, ensure_converged
from paraprop.solve import solve
from paraprop.solvers import GSJacobi, Jacobi, is_solver, make_solver

__all__ = ["CACHED_SHARE", "TARFLOW_METHODS", "calibrate", "invert"]

# "auto" hands a block to the KV-cached loop (tol > 0) only if the loop's rounding deviation
# from the exact inverse, measured at calibration, is at most this share of tol
CACHED_SHARE = 0.25
# the names TarFlow.inverse takes: the model's own KV-cached loop (named as PixelCNN's cached
# sampler), the triangular methods of paraprop.solve (the flows' set: Newton's family needs a
# Markov system), and "auto", a measured choice per block (as nn's "auto")
TARFLOW_METHODS = ("sequential_cached", *FLOW_METHODS, "auto")

# a flow's blocks (TarFlow.blocks, an nn.ModuleList), last inverted first
Blocks = nn.ModuleList | Sequence[nn.Module]
# what inverts one block: "sequential_cached" or a solver object (any object with the solver
# protocol, paraprop.solvers.is_solver: a structural check, hence Any)
BlockMethod = Any


def block_method(method, argument: str) -> BlockMethod:
    """``"sequential_cached"`` or the solver object of a :func:`paraprop.solve` method (one
    block's ``method``; ``argument`` names it in messages)."""
    if isinstance(method, str):
        checks.one_of(argument, method, TARFLOW_METHODS[:-1])
        if method == "sequential_cached":
            return method
    return make_solver(method, argument=argument, names=FLOW_METHODS)


def method_name(method: BlockMethod) -> str:
    """The name of a block's method (``stats["methods"]``)."""
    return method if isinstance(method, str) else str(method.name)


def invert_block(block: nn.Module, z: torch.Tensor, method: BlockMethod, tol: float,
                 max_iters: int | None, chunk: int, measured: float | None = None) -> Solution:
    """The inverse of one block at its output ``z`` ``(N, T, P)`` (the block's own order): the
    Solution of its solve, or of the KV-cached loop (``measured``: the loop's deviation measured
    at calibration, its error estimate in an ``"auto"`` plan; ``None``: asked for by name, its
    own reference)."""
    if method == "sequential_cached":
        start = time.perf_counter()
        x = sequential_cached(block, z)
        T = z.shape[1]
        # asked for by name, the loop is its own reference (estimate 0: it is the result of
        # the KV-cached loop); handed a block by "auto", its deviation from the exact
        # inverse measured at calibration (at most CACHED_SHARE * tol)
        est = 0.0 if measured is None else measured
        out = Outcome(x, Result.successful, evaluations=T - 1, positions=T - 1,
                      sequential_steps=T - 1, bound=T - 1, error_estimate=est,
                      stats={"T": T, "error_estimate_source": "the loop itself"
                             if measured is None else "calibration"})
        return build("sequential_cached", out, iterations=T - 1,
                     time_s=time.perf_counter() - start)
    f = BlockInverse(block, z, chunk)
    sol = solve(f, f.x0, method=method, dim=-2, tol=tol, max_iters=max_iters, throw=False)
    sol.stats["chunks"] = f.chunks
    return sol


def invert(blocks: Blocks, h: torch.Tensor, plan: Sequence[BlockMethod],
           measured: Sequence[float | None], *, tol: float, max_iters: int | None,
           chunk: int) -> tuple[torch.Tensor, list[Solution]]:
    """``(x, solutions)``: the patches ``x`` whose image through the blocks is ``h``
    ``(N, T, P)`` (the blocks inverted last to first, odd blocks in reverse patch order, block
    ``k`` by ``plan[k]``), and each block's Solution, block order."""
    sols: list[Solution] = []
    with torch.no_grad():
        for k in reversed(range(len(blocks))):
            hk = h.flip(1) if k % 2 else h
            sol = invert_block(blocks[k], hk, plan[k], tol, max_iters, chunk, measured[k])
            sols.append(sol)
            h = sol.value.flip(1) if k % 2 else sol.value
    return h, sols[::-1]


def solution(images: torch.Tensor, sols: list[Solution], plan: Sequence[BlockMethod], method,
             start: float, *, throw: bool, tol: float, max_iters: int | None) -> Solution:
    """The one Solution of ``TarFlow.inverse`` (its docstring lists the stats) from the blocks'
    (block order), timed from ``start``; raises :class:`paraprop.ConvergenceError` with
    ``throw`` if a block did not converge."""
    name = method if isinstance(method, str) else \
        method.name if is_solver(method) else "per_block"
    evaluations = sum(s.evaluations for s in sols)
    out = Outcome(
        images, next((s.result for s in sols if not s.converged), Result.successful),
        evaluations=evaluations,
        positions=sum(s.stats.get("positions") or 0 for s in sols),
        sequential_steps=sum(s.stats.get("sequential_steps") or 0 for s in sols),
        error_estimate=sum(s.stats.get("error_estimate") or 0.0 for s in sols),
        stats={"blocks": sols, "methods": [method_name(m) for m in plan],
               "model_calls": evaluations,
               "chunks": sum(s.stats.get("chunks", 0) for s in sols),
               "error_estimates": [s.stats.get("error_estimate", 0.0) for s in sols]},
        residuals=torch.cat([s.residuals for s in sols]))
    sol = build(name, out, iterations=sum(s.iterations for s in sols),
                residuals=out.residuals, time_s=time.perf_counter() - start)
    # the first block (in inversion order) that could not certify for another reason than
    # max_iters (e.g. a tol=0 value that fn(x) reproduces only to rounding) says why
    why = next((f"block {k}: {sols[k].stats['not_converged']}"
                for k in reversed(range(len(sols)))
                if not sols[k].converged and sols[k].stats.get("not_converged")), None)
    if why is not None:
        sol.stats["not_converged"] = why
    return ensure_converged(sol, throw, entry="TarFlow.inverse", max_iters=max_iters,
                            tol=tol, measure="error estimate of a block",
                            hint="a block's solve stopped at max_iters"
                            if why is None else "", reason=why)


def calibrate(blocks: Blocks, h: torch.Tensor, *, tol: float, chunk: int,
              cost: str) -> tuple[list[BlockMethod], list[float]]:
    """The plan of ``TarFlow.calibrate`` (which documents it) from the calibration latents
    ``h`` (patches), and per block the cached loop's measured deviation from the exact inverse
    (``inf`` where it was not measured: ``tol=0``)."""
    K, T = len(blocks), h.shape[1]
    candidates: list[BlockMethod] = [Jacobi(), GSJacobi(chunk)]
    if tol > 0:   # not at tol=0, whose promise is the bits of "sequential"
        candidates.append("sequential_cached")
    costs: list[list[float]] = []    # per candidate, per block
    deviation = [math.inf] * K
    for m in candidates:
        runs = [invert(blocks, h, [m] * K, [None] * K, tol=tol, max_iters=None, chunk=chunk)[1]
                for _ in range(2 if cost == "time" else 1)]
        if cost == "time":
            costs.append([min(r[k].stats["time_s"] for r in runs) for k in range(K)])
        elif m == "sequential_cached":   # T - 1 calls of one position: a call and a chunk
            costs.append([2 * (T - 1)] * K)
        else:
            costs.append([b.stats["chunks"] + b.evaluations for b in runs[0]])
        if m == "sequential_cached":   # only where its rounding is well within tol
            deviation = cached_deviation(blocks, h, runs[0], chunk)
            costs[-1] = [c if d <= CACHED_SHARE * tol else math.inf
                         for c, d in zip(costs[-1], deviation, strict=True)]
    plan = [candidates[min(range(len(candidates)), key=lambda i: (c[i], i))]
            for c in zip(*costs, strict=True)]
    return plan, deviation


def cached_deviation(blocks: Blocks, h: torch.Tensor, run: list[Solution],
                     chunk: int) -> list[float]:
    """Per block (block order): ``max |x - x*|`` of the KV-cached loop's inverse ``x`` in
    ``run`` (its blocks' Solutions) against the exact inverse ``x*`` of the same input
    (``GSJacobi(chunk)`` at ``tol=0``, bitwise the sequential solve)."""
    out = [math.inf] * len(blocks)
    with torch.no_grad():
        for k in reversed(range(len(blocks))):
            hk = h.flip(1) if k % 2 else h
            f = BlockInverse(blocks[k], hk, chunk)
            exact = solve(f, f.x0, method=GSJacobi(chunk), dim=-2, tol=0.0,
                          throw=False).value
            got = run[k].value
            out[k] = float((got - exact).abs().max())
            h = got.flip(1) if k % 2 else got
    return out
