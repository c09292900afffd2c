"""Sentences that say which method won a measurement, and why, in the run's own numbers.

Every demo section ends with one such sentence. It is computed from the rows just measured (the
winner, the ratio, the counts that explain it: passes or sweeps against sequential steps, and
what one pass costs in sequential steps on this machine), never written in advance, so it stays
true on a machine where another method wins.
"""

from __future__ import annotations


def num(x: float) -> str:
    """A count or ratio for a sentence: ``704``, ``25.6``, ``2.06``, ``0.0258``."""
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 0.01 or a == 0:
        return f"{x:.3g}"
    return f"{x:.2g}"


def plural(word: str, n: float = 2) -> str:
    """``word`` for one, its plural otherwise (``pass`` -> ``passes``, ``step`` -> ``steps``)."""
    if n == 1:
        return word
    return word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")


def pass_cost(time_method: float, passes: int, time_base: float, steps: int) -> float:
    """The time of one parallel pass of a method, in sequential steps of the baseline."""
    return (time_method / max(passes, 1)) / (time_base / max(steps, 1))


def fewer_passes(method: str, baseline: str, *, speedup: float, passes: int, steps: int,
                 cost: float, pass_word: str = "pass", step_word: str = "step",
                 detail: str = "", winner: str | None = None,
                 winner_speedup: float | None = None) -> str:
    """Why a method that replaces ``steps`` sequential steps by ``passes`` parallel passes won or
    lost against ``baseline``; one sentence.

    With ``cost`` from :func:`pass_cost` on the same medians, ``speedup = (steps / passes) /
    cost`` exactly: the method wins when a pass costs fewer sequential steps than it replaces.

    Arguments:
        method, baseline: labels, e.g. ``"jacobi"`` and ``"the plain loop"``.
        speedup: the baseline's median time over the method's.
        passes, steps: the method's parallel passes and the baseline's sequential steps.
        cost: one pass in baseline steps (:func:`pass_cost`).
        pass_word, step_word: what a pass and a step are called (``"sweep"``, ``"loop step"``).
        detail: what one pass does, e.g. ``" (all 64 positions at once)"``.
        winner, winner_speedup: the fastest method when it is neither ``method`` nor
            ``baseline`` (its speedup over the baseline).

    Example:
        >>> fewer_passes("jacobi", "the plain loop", speedup=2.0, passes=8, steps=64, cost=4.0,
        ...              pass_word="sweep", step_word="loop step")  # doctest: +NORMALIZE_WHITESPACE
        'On this machine, jacobi wins: it needs 8 sweeps instead of 64 loop steps (8x fewer),
        and one sweep costs 4 loop steps here, so it runs at 2.00x the plain loop.'
    """
    needs = (f"{passes} {plural(pass_word, passes)} instead of {steps} "
             f"{plural(step_word, steps)}")
    one = f"one {pass_word}{detail} costs {num(cost)} {plural(step_word, cost)} here"
    if winner is None:
        winner = method if speedup > 1 else baseline
    lead = f"On this machine, {winner} wins"
    if winner not in (method, baseline) and winner_speedup is not None:
        lead += f" ({winner_speedup:.2f}x {baseline})"
    subject = "it" if winner == method else method
    if speedup > 1:
        why = (f"{subject} needs {needs} ({num(steps / max(passes, 1))}x fewer), and {one}, so "
               f"it runs at {speedup:.2f}x {baseline}")
    else:
        why = (f"{subject} needs {needs}, but {one}, more than the {num(steps / max(passes, 1))} "
               f"each {pass_word} replaces, so it runs at {speedup:.2f}x {baseline}")
    return f"{lead}: {why}."
