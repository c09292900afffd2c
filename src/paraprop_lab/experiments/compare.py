"""Compare every :func:`paraprop.solve` method on one triangular system, side by side.

Used by ``paraprop bench core`` and ``paraprop demo``: one reference solve, one traced solve per
method (forward difference and true error per iteration), then interleaved timing of the plain
sequential loop, the sequential solver and every method, in one run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from paraprop.solve import solve
from paraprop_lab.experiments.harness import interleaved, median


@dataclass
class MethodSpec:
    """A method to compare: its label and the keyword arguments of :func:`paraprop.solve`."""

    label: str
    kwargs: dict = field(default_factory=dict)


def compare(
    fn,
    x0: torch.Tensor,
    methods: list[MethodSpec],
    *,
    dim=-1,
    tol: float = 1e-5,
    plain: Callable[[], torch.Tensor] | None = None,
    repeats: int = 5,
    desc: str = "timing",
) -> tuple[list[dict], dict]:
    """Solve ``x = fn(x)`` with every method; time them against sequential evaluation.

    Arguments:
        fn, x0, dim, tol: the system and the stopping tolerance, as for :func:`paraprop.solve`.
        methods: the methods to compare (``sequential`` is always added as the reference).
        plain: the ordinary sequential computation without the solver (e.g. a forward pass),
            returning the same values; timed as the baseline when given.
        repeats: timed rounds (interleaved, after one warm-up round).
        desc: progress-bar label.

    Returns:
        ``(rows, curves)``: one row per method (iterations, evaluations, positions, median time,
        speedup over the baseline, max |value - sequential|) and per-method convergence curves.
    """
    ref = solve(fn, x0, method="sequential", dim=dim)
    runs: dict[str, Callable[[], object]] = {}
    if plain is not None:
        plain_err = float((plain().reshape(ref.value.shape) - ref.value).abs().max())
        runs["plain loop"] = plain
    runs["sequential"] = lambda: solve(fn, x0, method="sequential", dim=dim)
    traced: dict[str, object] = {"sequential": ref}
    curves: dict[str, dict[str, list[float]]] = {}
    for spec in methods:
        true_err: list[float] = []

        def trace(k, value, residual, _e=true_err):
            _e.append(float((value - ref.value).abs().max()))

        sol = solve(fn, x0, dim=dim, tol=tol, callback=trace, **spec.kwargs)
        traced[spec.label] = sol
        curves[spec.label] = {"forward difference": sol.residuals.tolist(),
                              "true error": true_err}
        runs[spec.label] = lambda s=spec: solve(fn, x0, dim=dim, tol=tol, **s.kwargs)

    times = interleaved(runs, repeats=repeats, warmup=1, desc=desc)
    base = median(times[next(iter(runs))])
    rows = []
    for label, ts in times.items():
        row = {"method": label, "time_ms": 1e3 * median(ts), "speedup": base / median(ts)}
        if label == "plain loop":
            row.update(iterations=ref.stats["T"], evaluations=ref.stats["T"],
                       positions=ref.stats["T"], max_abs_err=plain_err)
        else:
            sol = traced[label]
            row.update(iterations=sol.iterations, evaluations=sol.evaluations,
                       positions=sol.stats["positions"],
                       max_abs_err=float((sol.value - ref.value).abs().max()))
        rows.append(row)
    return rows, curves


COLUMNS = ["method", "iterations", "evaluations", "positions", "time_ms", "speedup",
           "max_abs_err"]
