"""The MGRIT grid hierarchy over the depth of a residual network, and its split across ranks.

A residual stack ``u_{n+1} = u_n + h F_n(u_n)``, ``n = 0 .. N-1``, is a time-stepping problem on
the points ``0 .. N`` (Kirby et al. 2020, eq. 1). Level 0 has the ``N`` fine steps; level ``l+1``
keeps every ``c_l``-th point of level ``l`` (the C-points) and steps over them with the step size
``c_l`` times larger (Falgout et al. 2014, §2; Kirby et al., Algorithm 1, "injection restriction
every c-th layer, coarse step H = c h").

Step ``n`` of level ``l`` maps point ``n`` to ``n + 1`` and uses the parameters of fine layer
``(n + 1) s_l - 1`` where ``s_l = c_0 ... c_{l-1}``: the last fine layer of the interval it
spans. (This injection of the parameters keeps every step on the rank that owns the point it
computes; at level 0 it is layer ``n`` itself.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paraprop import checks

__all__ = ["Hierarchy", "LocalLevel", "split_layers"]


@dataclass(frozen=True)
class Hierarchy:
    """Level sizes of an MGRIT hierarchy over ``n_steps`` fine steps.

    Attributes:
        n_steps: ``N``, the number of fine steps (residual layers).
        coarsening: ``(c_0, ..., c_{L-2})``, the coarsening factor between consecutive levels.

    Example:
        >>> Hierarchy.build(10, levels=2, coarsening=4).sizes
        (10, 2)
    """

    n_steps: int
    coarsening: tuple[int, ...]

    @staticmethod
    def build(n_steps: int, *, levels: int, coarsening: int | tuple[int, ...] | list[int]
              ) -> Hierarchy:
        """Validate and build a hierarchy.

        Arguments:
            n_steps: the number of fine steps (layers), ``>= 1``.
            levels: the number of levels, ``>= 1``; ``1`` means serial propagation.
            coarsening: one factor ``>= 2`` for every level, or one per coarsening
                (``levels - 1`` entries).

        Raises:
            ValueError: a bad value (named), or too few steps for the levels: every
                coarse level must keep at least one step (``n_steps >= c_0 ... c_{L-2}``).
        """
        checks.positive_int("the number of layers", n_steps)
        checks.positive_int("levels", levels)
        if isinstance(coarsening, list | tuple):
            cs = tuple(coarsening)
            if len(cs) != levels - 1:
                raise ValueError(f"coarsening={coarsening!r} must have levels - 1 = {levels - 1} "
                                 "entries (one per coarsening) or be a single int")
        else:
            cs = (coarsening,) * (levels - 1)
        for c in cs if cs else (coarsening,):
            checks.positive_int("coarsening", c, minimum=2)  # c < 2 does not coarsen
        need = math.prod(cs)
        if n_steps < need:
            raise ValueError(f"levels={levels} with coarsening {cs} needs at least {need} layers, "
                             f"got {n_steps} (every coarse level keeps at least one step)")
        return Hierarchy(n_steps, cs)

    @property
    def levels(self) -> int:
        return len(self.coarsening) + 1

    @property
    def strides(self) -> tuple[int, ...]:
        """``s_l``: fine steps per step of level ``l`` (``s_0 = 1``)."""
        out = [1]
        for c in self.coarsening:
            out.append(out[-1] * c)
        return tuple(out)

    @property
    def sizes(self) -> tuple[int, ...]:
        """``N_l = N // s_l``: steps on each level."""
        return tuple(self.n_steps // s for s in self.strides)

    def exact_cycles(self) -> int:
        """Cycles after which MGRIT reproduces serial propagation in exact arithmetic.

        Every cycle makes at least one more fine C-point exact (the relaxation and the coarse
        correction keep an exact prefix exact), so ``N_1`` cycles suffice; ``1`` with one level.
        """
        return self.sizes[1] if self.levels > 1 else 1


@dataclass(frozen=True)
class LocalLevel:
    """One rank's part of one level.

    The rank owns the fine steps ``[a, b)``; on level ``l`` it owns the points ``(lo, hi]`` with
    ``lo = a // s_l``, ``hi = b // s_l`` and the steps ``lo .. hi-1``. Its arrays hold the points
    ``lo .. hi``: index 0 is a ghost copy of point ``lo`` (owned by a rank to the left, or the
    initial condition on the first rank).

    Attributes:
        level: ``l``.
        lo, hi: the point range (``hi == lo``: the rank owns no point on this level).
        c: the coarsening factor to the next level (``None`` on the coarsest level).
        stride: ``s_l``.
        left, right: positions (in solve order) of the nearest ranks that own points on this
            level, or ``None``.
    """

    level: int
    lo: int
    hi: int
    c: int | None
    stride: int
    left: int | None
    right: int | None

    @property
    def active(self) -> bool:
        return self.hi > self.lo

    @property
    def n_local(self) -> int:
        return self.hi - self.lo + 1

    def layer(self, n: int) -> int:
        """The fine step whose parameters level step ``n`` uses."""
        return (n + 1) * self.stride - 1

    @property
    def factor(self) -> int:
        """``c``, on a level that has a coarser one (the coarsest has no C-points)."""
        if self.c is None:
            raise ValueError(f"level {self.level} is the coarsest: it has no coarsening factor "
                             "and no C-points")
        return self.c

    # C-points (multiples of c) in the owned range (lo, hi], and segment starts in [lo, hi).
    def first_c_after(self, p: int) -> int:
        return (p // self.factor + 1) * self.factor

    def owned_c_points(self) -> range:
        return range(self.first_c_after(self.lo), self.hi + 1, self.factor)

    def local_starts(self) -> range:
        """C-points in ``[lo, hi)``: the starts of the segments relaxed without waiting."""
        c = self.factor
        first = self.lo if self.lo % c == 0 else self.first_c_after(self.lo)
        return range(first, self.hi, c)


def local_levels(h: Hierarchy, parts: list[tuple[int, int]], me: int) -> list[LocalLevel]:
    """The :class:`LocalLevel` of every level for the rank at position ``me`` of ``parts``."""
    out = []
    for l, s in enumerate(h.strides):
        ranges = [(a // s, b // s) for a, b in parts]
        lo, hi = ranges[me]
        left = next((r for r in range(me - 1, -1, -1) if ranges[r][1] > ranges[r][0]), None)
        right = next((r for r in range(me + 1, len(parts)) if ranges[r][1] > ranges[r][0]), None)
        c = h.coarsening[l] if l < len(h.coarsening) else None
        out.append(LocalLevel(l, lo, hi, c, s, left, right))
    return out


def split_layers(n_layers: int, world: int, sizes: list[int] | None = None
                 ) -> list[tuple[int, int]]:
    """Contiguous layer ranges ``[a, b)`` for ``world`` ranks.

    Arguments:
        n_layers: the number of layers.
        world: the number of ranks.
        sizes: layers per rank (must sum to ``n_layers``, each ``>= 1``); ``None`` splits as
            evenly as possible (the first ``n_layers % world`` ranks get one more).

    Raises:
        ValueError: fewer layers than ranks, or bad ``sizes``.

    Example:
        >>> split_layers(10, 3)
        [(0, 4), (4, 7), (7, 10)]
    """
    checks.positive_int("world", world)
    if sizes is None:
        if n_layers < world:
            raise ValueError(f"{n_layers} layers cannot be split over {world} ranks "
                             "(every rank needs at least one layer)")
        q, r = divmod(n_layers, world)
        sizes = [q + (i < r) for i in range(world)]
    sizes = list(sizes)
    if len(sizes) != world or any(not isinstance(s, int) or s < 1 for s in sizes) \
            or sum(sizes) != n_layers:
        raise ValueError(f"sizes={sizes!r} must be {world} positive ints summing to {n_layers}")
    out, a = [], 0
    for s in sizes:
        out.append((a, a + s))
        a += s
    return out
