"""Blelloch's scan over a list whose elements differ in shape and layout (a ragged scan).

:func:`paraprop.scan.associative_scan` scans a stacked tensor and combines many pairs in one
call. The elements of some scans cannot be stacked: the transposed Jacobians of a chain of
layers (BPPSA, :mod:`paraprop.jacobians.bppsa`) differ in shape, some are sparse CSR and the
first is a vector. :func:`ragged_scan` scans such a list one combine at a time, with Blelloch's
tree written recursively: the up-sweep combines neighbouring pairs, level by level; the
down-sweep hands every prefix to the odd positions below it and combines it into the even ones.
``levels`` caps the tree as in BPPSA §5.3: beyond that many levels the remaining prefix is
scanned sequentially (deep levels multiply large, dense-ish products that a plain linear scan
avoids).

Every step that combines something is recorded (level, phase, number of combines and, with a
``cost`` function, the sum and the largest of each measure), so the cost of a scan can be
analysed without timing it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from paraprop import checks

__all__ = ["ragged_scan"]


def ragged_scan(elems: Sequence, combine: Callable, *, levels: int | None = None,
                cost: Callable | None = None) -> tuple[list, list[dict]]:
    """Inclusive scan ``y_i = x_0 ⊕ x_1 ⊕ ... ⊕ x_i`` of a list, by Blelloch's tree.

    Arguments:
        elems: a non-empty sequence of elements of any shapes or types that ``combine``
            accepts.
        combine: ``combine(a, b)`` returns ``a ⊕ b`` (``a`` the earlier element in scan
            order); it must be associative, need not be commutative, and is called once per
            pair.
        levels: tree levels run as a tree (BPPSA §5.3); the prefix left at that depth is
            scanned sequentially. ``None``: the full tree (``floor(log2 n)`` levels); ``0``: a
            sequential scan (``n - 1`` dependent combines).
        cost: ``cost(a, b, out)`` returns a dict of numbers measuring one combine
            ``out = combine(a, b)`` (e.g. its FLOPs and the size of ``out``); ``None``:
            nothing is measured.

    Returns:
        ``(prefixes, steps)``: ``prefixes[i] = x_0 ⊕ ... ⊕ x_i`` (``prefixes[0]`` is
        ``elems[0]`` itself), and one record per step that combined something, in execution
        order: ``{"level", "phase", "combines"}`` (``phase``: ``"up"`` or ``"down"``, whose
        combines are independent of each other, or ``"linear"``, whose combines depend on
        each other in turn) and, for every key ``k`` of ``cost``'s dicts, ``k`` (the sum over
        the step's combines) and ``"max_" + k`` (the largest).

    Raises:
        TypeError: ``combine`` or ``cost`` not callable.
        ValueError: an empty ``elems``, ``levels`` not a non-negative int or ``None``.

    Example:
        >>> mats = [torch.randn(2, 3), torch.randn(3, 4), torch.randn(4, 1)]
        >>> prefixes, steps = ragged_scan(mats, lambda a, b: a @ b)
        >>> [tuple(p.shape) for p in prefixes]
        [(2, 3), (2, 4), (2, 1)]
        >>> [(s["phase"], s["combines"]) for s in steps]
        [('up', 1), ('down', 1)]
    """
    checks.callable_arg("combine", combine)
    checks.callable_arg("cost", cost, allow_none=True)
    checks.nonneg_int("levels", levels, allow_none=True)
    elems = list(elems)
    if not elems:
        raise ValueError("elems is empty; a scan needs at least one element")
    steps: list[dict] = []
    return _scan(elems, combine, levels, 0, cost, steps), steps


def _record(steps: list[dict], level: int, phase: str, measures: list[dict | None]) -> None:
    if not measures:
        return
    step = {"level": level, "phase": phase, "combines": len(measures)}
    if measures[0] is not None:
        for key in measures[0]:
            values = [cast(dict, m)[key] for m in measures]     # cost given: all dicts
            step[key] = sum(values)
            step["max_" + key] = max(values)
    steps.append(step)


def _scan(xs: list, combine: Callable, levels: int | None, level: int, cost: Callable | None,
          steps: list[dict]) -> list:
    n = len(xs)
    if n == 1:
        return list(xs)

    def measured(a, b, sink: list):
        out = combine(a, b)
        sink.append(None if cost is None else cost(a, b, out))
        return out

    if levels is not None and level >= levels:  # the capped top: a linear scan
        out = [xs[0]]
        measures: list[dict | None] = []
        for x in xs[1:]:
            out.append(measured(out[-1], x, measures))
        _record(steps, level, "linear", measures)
        return out
    # up-sweep: neighbouring pairs, all independent
    measures = []
    pairs = [measured(xs[2 * i], xs[2 * i + 1], measures) for i in range(n // 2)]
    _record(steps, level, "up", measures)
    sub = _scan(pairs, combine, levels, level + 1, cost, steps)
    # down-sweep: odd positions are the pair prefixes; even ones combine the previous prefix
    out, measures = [xs[0]], []
    for i in range(1, n):
        out.append(sub[i // 2] if i % 2 == 1 else measured(sub[i // 2 - 1], xs[i], measures))
    _record(steps, level, "down", measures)
    return out
