"""One MGRIT V-cycle's kernels on one rank's part of the levels (the algorithm:
:mod:`paraprop.multigrid.mgrit`, steps 1-5 of its notes).

:class:`VCycle` holds the levels of this rank (:class:`~paraprop.multigrid.hierarchy.LocalLevel`)
and runs the F- and C-relaxations, the FAS coarse-grid correction and the recursive V-cycle on
them, exchanging the ghost points with the neighbouring ranks over a :class:`Link`;
:class:`CorrectedSteps` is a coarse level's FAS problem in the correction form that keeps the
exactness bound in floating point. The iteration around it (the cycles, the stopping rule, the
Solution) is :func:`paraprop.multigrid.mgrit.mgrit`'s.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol, cast, overload

import torch

from paraprop.multigrid.hierarchy import Hierarchy, LocalLevel, local_levels

__all__ = ["CorrectedSteps", "Link", "VCycle"]

_RELAX_GHOST, _COARSE_GHOST = 0, 1


class Link(Protocol):
    """Point-to-point exchange between the ranks of one solve (positions in solve order).

    ``sum`` adds a float, or elementwise a list of floats, over all ranks (every rank gets the
    total; a list comes back as a list)."""

    def send(self, tensor: torch.Tensor, dest: int, tag: int) -> None: ...

    def recv(self, like: torch.Tensor, src: int, tag: int) -> torch.Tensor: ...

    def sum(self, value: float | list[float]) -> float | list[float]: ...

    def flush(self) -> None: ...


class CorrectedSteps:
    """The steps of a coarse level in correction form: the FAS coarse problem
    ``v_{n+1} = Phi^c_n(v_n) + g_{n+1}``, ``g_{n+1} = W_{n+1} - Phi^c_n(b_n)``, written around the
    base ``b`` (the values the level started from) as

        ``v_{n+1} = b_{n+1} + ((Phi^c_n(v_n) - Phi^c_n(b_n)) + r_{n+1})``, ``r = W - b``,

    with ``Phi^c_n(v_n) - Phi^c_n(b_n)`` taken as exactly ``0`` where ``v_n == b_n`` bitwise.
    In exact arithmetic both forms are the same. In floating point the FAS form does not give
    back ``b_{n+1} = W_{n+1}`` where nothing changed (``fl(a + fl(W - a)) != W``), and the
    coarse propagator, unstable for large ``c h``, amplifies those roundings along the coarse
    chain; the iterate then stalls away from the serial states. In this form a point whose
    input and residual are exactly zero keeps its value bitwise, so the exact prefix of every
    cycle stays exact and the exactness bound holds in floating point too.

    Arguments:
        stepper: the level-0 stepper (its steps are the absolute ``Phi``).
        L: the coarse level.
        B: the base values at the points ``lo .. hi``; ``P``: ``Phi^c_n(b_n)`` for the steps
            ``lo .. hi-1``; ``R``: the residuals at the points (row 0 unused).
    """

    def __init__(self, stepper, L: LocalLevel, B, P, R):
        self.inner, self.L, self.B, self.P, self.R = stepper, L, B, P, R
        self.counts = stepper.counts

    def step(self, first: int, stride: int, count: int, x: torch.Tensor, scale: float
             ) -> torch.Tensor:
        if count == 1:
            return self.step_one(first, x[0], scale)[None]
        s = self.L.stride
        i0 = (first + 1) // s - 1 - self.L.lo  # row of the first input point
        di = stride // s
        stop = i0 + di * (count - 1) + 1
        moved = (x != self.B[i0:stop:di]).reshape(count, -1).any(1)
        d = self.inner.step(first, stride, count, x, scale).sub_(self.P[i0:stop:di])
        # r + d * moved: exactly r where x == b
        d = torch.addcmul(self.R[i0 + 1 : stop + 1 : di], d,
                          moved.view(count, *[1] * (x.dim() - 1)))
        return d.add_(self.B[i0 + 1 : stop + 1 : di])

    def step_one(self, k: int, u: torch.Tensor, scale: float) -> torch.Tensor:
        i = (k + 1) // self.L.stride - 1 - self.L.lo
        d = self.inner.step_one(k, u, scale).sub_(self.P[i])
        d = torch.addcmul(self.R[i + 1], d, torch.ne(u, self.B[i]).any())
        return d.add_(self.B[i + 1])

    def sweep(self, first, stride, count, length, u0, scale, g, out_f, out_w) -> None:
        """As :meth:`paraprop.multigrid.steps._Stepper.sweep` (one batched step at a time)."""
        x = u0
        for j in range(length - 1 + (out_w is not None)):
            x = self.step(first + j * stride, length * stride, count, x, scale)
            (out_f[:, j] if j < length - 1 else out_w).copy_(x)


class VCycle:
    def __init__(self, stepper, hierarchy: Hierarchy, h: float, relax: str, c_weight: float,
                 link: Link | None, parts: list[tuple[int, int]], me: int):
        self.stepper = stepper
        self.h = h
        self.relax = relax
        self.w = c_weight
        self.link = link
        self.me, self.n_ranks = me, len(parts)
        self.levels: list[LocalLevel] = local_levels(hierarchy, parts, me)
        self._buffers: dict = {}
        # the steps of each level: the stepper itself on level 0, a CorrectedSteps view of it on
        # the coarse levels (set by coarse_correct before the level is solved)
        self.steps: dict = {0: stepper}

    # -- communication ------------------------------------------------------------------------
    # (a level has a left or right neighbour only where there are several ranks, hence a link)
    def _send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        assert self.link is not None
        self.link.send(t, dest, tag)

    def _recv(self, like: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        assert self.link is not None
        return self.link.recv(like, src, tag)

    # -- kernels ------------------------------------------------------------------------------
    def step1(self, L: LocalLevel, n: int, u: torch.Tensor) -> torch.Tensor:
        return self.steps[L.level].step_one(L.layer(n), u, self.h * L.stride)

    @overload
    def f_relax(self, L: LocalLevel, U: torch.Tensor, with_w: Literal[True]) -> torch.Tensor: ...

    @overload
    def f_relax(self, L: LocalLevel, U: torch.Tensor, with_w: Literal[False]) -> None: ...

    def f_relax(self, L: LocalLevel, U: torch.Tensor, with_w: bool) -> torch.Tensor | None:
        """F-relaxation of this rank's part of level ``L``; with ``with_w`` also the step into
        every owned C-point, ``W_p = Phi(u_{p-1})`` (on a coarse level the FAS step of
        :class:`CorrectedSteps`; returned, one row per C-point).

        The full intervals that start at a C-point are relaxed at once: one batched sweep takes
        all of them through their ``c - 1`` F-points (and the step into the next C-point). A
        segment cut by the end of the rank's range steps alone; a segment starting at the
        ghost F-point ``lo`` continues the left neighbour's segment: it waits for that rank's
        value of ``lo``, then steps serially.
        """
        c, lo, hi, tag = L.factor, L.lo, L.hi, 4 * L.level + _RELAX_GHOST
        hl = self.h * L.stride
        cs = L.owned_c_points()
        W = self.buffer(("W", L.level), len(cs), U) if with_w else None
        if L.right is not None and hi % c == 0:
            self._send(U[hi - lo], L.right, tag)
        if L.left is not None and lo % c == 0:
            U[0] = self._recv(U[0], L.left, tag)
        starts = L.local_starts()
        w_off = 0 if lo % c == 0 else 1
        steps = c if with_w else c - 1
        if len(starts):
            p0 = starts[0]
            i0 = p0 - lo
            full = (hi - p0) // c  # intervals [p, p + c] inside the range
            if full and steps:
                blk = U[i0 : i0 + full * c].view(full, c, *U.shape[1:])
                self.steps[L.level].sweep(L.layer(p0), L.stride, full, c, blk[:, 0], hl, None,
                                          blk[:, 1:],
                                          W[w_off : w_off + full] if W is not None else None)
            p = p0 + full * c
            if p < hi:  # the last segment, cut by the end of the range: F-points only
                for n in range(p, hi):
                    U[n + 1 - lo] = self.step1(L, n, U[n - lo])
        if lo % c != 0:
            if L.left is not None:
                U[0] = self._recv(U[0], L.left, tag)
            e = min(L.first_c_after(lo), hi)
            for n in range(lo, e):
                if (n + 1) % c != 0:
                    U[n + 1 - lo] = self.step1(L, n, U[n - lo])
                elif W is not None:     # the step into the C-point
                    W[0] = self.step1(L, n, U[n - lo])
                else:
                    break
        if L.right is not None and hi % c != 0:
            self._send(U[hi - lo], L.right, tag)
        return W

    def c_view(self, L: LocalLevel, U: torch.Tensor) -> torch.Tensor:
        cs = L.owned_c_points()
        return U[cs.start - L.lo :: L.c][: len(cs)] if len(cs) else U[:0]

    def c_relax(self, L: LocalLevel, U: torch.Tensor, W: torch.Tensor) -> None:
        uc = self.c_view(L, U)
        if self.w == 1.0:
            uc.copy_(W)
        else:  # u + w (W - u): a point with W == u stays bitwise unchanged
            uc.add_(W - uc, alpha=self.w)

    def residual_sq(self, L: LocalLevel, U: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """``||W - u_C||^2`` as a float64 0-d tensor (no host round trip)."""
        r = torch.linalg.vector_norm(W - self.c_view(L, U), dtype=torch.float64)
        return r * r

    def buffer(self, key, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A workspace of ``rows`` states, allocated once per solve and reused (each level's
        buffers are consumed before the level asks for them again)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] != rows:
            buf = self._buffers[key] = like.new_empty((rows, *like.shape[1:]))
        return buf

    def serial(self, L: LocalLevel, V: torch.Tensor) -> None:
        """Serial propagation of this rank's part of the coarsest level (a chain over ranks)."""
        tag = 4 * L.level + _RELAX_GHOST
        if L.left is not None:
            V[0] = self._recv(V[0], L.left, tag)
        for n in range(L.lo, L.hi):
            V[n + 1 - L.lo] = self.step1(L, n, V[n - L.lo])
        if L.right is not None:
            self._send(V[-1], L.right, tag)

    def coarse_correct(self, l: int, U: torch.Tensor, W: torch.Tensor) -> None:
        """FAS coarse-grid correction of level ``l`` (steps 3-5 of the V-cycle, without the
        final F-relaxation)."""
        L, Lc = self.levels[l], self.levels[l + 1]
        if not Lc.active:
            return
        V = self.buffer(("V", Lc.level), Lc.n_local, U)
        V[1:] = self.c_view(L, U)
        tag = 4 * Lc.level + _COARSE_GHOST
        if Lc.right is not None:
            self._send(V[-1], Lc.right, tag)
        if Lc.left is not None:
            V[0] = self._recv(V[0], Lc.left, tag)
        else:
            V[0] = U[0]  # point 0: the initial condition
        B = self.buffer(("B", Lc.level), Lc.n_local, U)
        B.copy_(V)
        P = self.stepper.step(Lc.layer(Lc.lo), Lc.stride, Lc.hi - Lc.lo, V[:-1],
                              self.h * Lc.stride)
        R = self.buffer(("R", Lc.level), Lc.n_local, U)
        R[0].zero_()
        torch.sub(W, B[1:], out=R[1:])
        self.steps[Lc.level] = CorrectedSteps(self.stepper, Lc, B, P, R)
        if l + 1 == len(self.levels) - 1:
            self.serial(Lc, V)
        else:
            self.v_cycle(l + 1, V)
        self.c_view(L, U).copy_(V[1:])

    def v_cycle(self, l: int, U: torch.Tensor) -> None:
        """One V-cycle on a coarse level ``l >= 1`` from the initial guess ``U``."""
        L = self.levels[l]
        W = self.f_relax(L, U, True)
        if self.relax == "FCF":
            self.c_relax(L, U, W)
            W = self.f_relax(L, U, True)
        self.coarse_correct(l, U, W)
        self.f_relax(L, U, False)

    def reduce(self, sq: float, change: float | None) -> tuple[float, float | None]:
        """The global residual norm (from this rank's sum of squares) and, when ``change`` is
        given, the global largest change (from this rank's): one all-reduce either way, the
        changes summed into one slot per rank."""
        if self.link is None:
            return math.sqrt(sq), change
        # (Link.sum returns a float for a float and a list for a list)
        if change is None:
            return math.sqrt(cast(float, self.link.sum(sq))), None
        vec = [0.0] * (1 + self.n_ranks)
        vec[0], vec[1 + self.me] = sq, change
        tot = cast(list[float], self.link.sum(vec))
        changes = tot[1:]
        d = math.nan if any(math.isnan(v) for v in changes) else max(changes)
        return math.sqrt(tot[0]), d
