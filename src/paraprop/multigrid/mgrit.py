"""FAS/MGRIT: solve all the layers of a residual stack at once (Kirby et al. 2020, Algorithm 1).

The forward pass of ``u_{n+1} = u_n + h F_n(u_n)`` (and its adjoint, a linear problem of the same
shape) is the nonlinear lower-triangular system ``A(u) = g``: ``A(u)_0 = u_0``,
``A(u)_{n+1} = u_{n+1} - Phi_n(u_n)``, ``g = (x, 0, ..., 0)``. Serial propagation is one solver;
MGRIT (Falgout et al. 2014; the FAS variant of Falgout, Manteuffel, O'Neill and Schroder 2017) is
another, in which all intervals between C-points are relaxed concurrently and only a short coarse
problem is sequential.

One V-cycle on level ``l`` (points ``0..N_l``, C-points every ``c_l``-th):

1. F-relaxation: from every C-point, propagate the ``c - 1`` F-points of its interval (all
   intervals at once); the step into the next C-point gives ``W_p = Phi(u_{p-1}) + g_p``.
2. C-relaxation (FCF only): ``u_p <- W_p`` at the C-points (weighted: ``w W_p + (1 - w) u_p``),
   then F-relaxation again.
3. FAS restriction by injection: ``v_m = u_{mc}``; the coarse right-hand side
   ``g^c_m = r_{mc} + A^c(v)_m = W_{mc} - Phi^c_{m-1}(v_{m-1})`` with the coarse step
   ``Phi^c(v) = v + c h F(v)``.
4. Coarse solve: serial propagation on the coarsest level, else one V-cycle there.
5. Correction by injection ``u_{mc} <- v_m`` and F-relaxation (ideal interpolation); on level 0
   the step into each C-point gives the residual ``r_p = W_p - u_p`` of the new iterate.

Because the last step of every cycle is an F-relaxation, the iterate after each cycle is
consistent at the F-points and its residual is exactly ``(W_p - u_p)`` at the C-points: the
recorded history ``r_0, r_1, ...`` is the residual of the initial guess and of each cycle's
result (global 2-norm over C-points, batch and features). When ``r = 0`` the C-points satisfy the
fine equations, so the F-relaxed states are the serial ones; in exact arithmetic that happens
after at most ``N // c_0`` cycles.

The solver works on one rank's contiguous range of layers (see
:class:`paraprop.multigrid.hierarchy.LocalLevel`); a single process is the one-rank case, and
:mod:`paraprop.distributed` supplies the point-to-point link between ranks. Every rank runs the
same control flow, so each send has its receive.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from paraprop.multigrid.common import (
    RELAX,
    check_c_weight,
    check_max_cycles,
    check_relax,
    check_step_size,
    check_tol,
)
from paraprop.multigrid.hierarchy import Hierarchy, LocalLevel, local_levels

__all__ = ["RELAX", "Link", "MGRITResult", "mgrit", "residual_norm"]

_RELAX_GHOST, _COARSE_GHOST = 0, 1


class Link(Protocol):
    """Point-to-point exchange between the ranks of one solve (positions in solve order)."""

    def send(self, tensor: torch.Tensor, dest: int, tag: int) -> None: ...

    def recv(self, like: torch.Tensor, src: int, tag: int) -> torch.Tensor: ...

    def sum(self, value: float) -> float: ...

    def flush(self) -> None: ...


@dataclass
class MGRITResult:
    """The result of :func:`mgrit`.

    Attributes:
        states: this rank's level-0 points ``lo .. hi`` (one process: all ``u_0 .. u_N``),
            shape ``(hi - lo + 1, *x.shape)``; row 0 is a copy of the left neighbour's last
            point on other ranks.
        residuals: ``[r_0, r_1, ..., r_K]``: the residual norm of the initial guess and after
            each cycle (empty for one level, which is exact serial propagation).
        cycles: V-cycles done.
        converged: ``residuals[-1] <= tol``; ``True`` for one level (exact serial
            propagation); ``None`` with ``tol=None`` on two or more levels (not checked:
            ``max_cycles`` cycles were done whatever the residual; see ``residuals``).
        convergence_factor: ``(r_K / r_0) ** (1 / K)``, the mean reduction per cycle (nan when
            undefined).
        stats: ``evaluations`` (layer evaluations, the hardware-independent work), ``calls``
            (sequential launches, batched or not), ``time_s``, ``levels``, ``coarsening``,
            ``relax``.
        parameter_grads: with ``collect=True`` and an adjoint stepper, the parameter gradients
            accumulated during the final relaxation (one dict per local block in depth order),
            when that relaxation was known to be the last (``tol=None`` or one level); else
            ``None``.
    """

    states: torch.Tensor
    residuals: list[float]
    cycles: int
    converged: bool | None
    convergence_factor: float
    stats: dict = field(default_factory=dict)
    parameter_grads: list[dict[str, torch.Tensor]] | None = None


class _Solver:
    def __init__(self, stepper, hierarchy: Hierarchy, h: float, relax: str, c_weight: float,
                 link: Link | None, parts: list[tuple[int, int]], me: int):
        self.stepper = stepper
        self.h = h
        self.relax = relax
        self.w = c_weight
        self.link = link
        self.levels: list[LocalLevel] = local_levels(hierarchy, parts, me)
        self._buffers: dict = {}

    # -- communication ------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self.link.send(t, dest, tag)

    def _recv(self, like: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        return self.link.recv(like, src, tag)

    # -- kernels ------------------------------------------------------------------------------
    def step1(self, L: LocalLevel, n: int, u: torch.Tensor) -> torch.Tensor:
        return self.stepper.step_one(L.layer(n), u, self.h * L.stride)

    def f_relax(self, L: LocalLevel, U: torch.Tensor, G: torch.Tensor | None, with_w: bool
                ) -> torch.Tensor | None:
        """F-relaxation of this rank's part of level ``L``; with ``with_w`` also the step into
        every owned C-point, ``W_p = Phi(u_{p-1}) + g_p`` (returned, one row per C-point).

        The full intervals that start at a C-point are relaxed at once: one batched sweep takes
        all of them through their ``c - 1`` F-points (and the step into the next C-point). A
        segment cut by the end of the rank's range steps alone; a segment starting at the
        ghost F-point ``lo`` continues the left neighbour's segment: it waits for that rank's
        value of ``lo``, then steps serially.
        """
        c, lo, hi, tag = L.c, L.lo, L.hi, 4 * L.level + _RELAX_GHOST
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
                g = None if G is None else \
                    G[i0 + 1 : i0 + 1 + full * c].view(full, c, *U.shape[1:])[:, :steps]
                self.stepper.sweep(L.layer(p0), L.stride, full, c, blk[:, 0], hl, g,
                                   blk[:, 1:], W[w_off : w_off + full] if with_w else None)
            p = p0 + full * c
            if p < hi:  # the last segment, cut by the end of the range: F-points only
                for n in range(p, hi):
                    out = self.step1(L, n, U[n - lo])
                    if G is not None:
                        out += G[n + 1 - lo]
                    U[n + 1 - lo] = out
        if lo % c != 0:
            if L.left is not None:
                U[0] = self._recv(U[0], L.left, tag)
            e = min(L.first_c_after(lo), hi)
            for n in range(lo, e):
                into_c = (n + 1) % c == 0
                if into_c and not with_w:
                    break
                out = self.step1(L, n, U[n - lo])
                if G is not None:
                    out += G[n + 1 - lo]
                if into_c:
                    W[0] = out
                else:
                    U[n + 1 - lo] = out
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
        else:
            uc.mul_(1.0 - self.w).add_(W, alpha=self.w)

    def residual_sq(self, L: LocalLevel, U: torch.Tensor, W: torch.Tensor) -> float:
        r = torch.linalg.vector_norm(W - self.c_view(L, U), dtype=torch.float64)
        return float(r) ** 2

    def buffer(self, key, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A workspace of ``rows`` states, allocated once per solve and reused (each level's
        buffers are consumed before the level asks for them again)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] != rows:
            buf = self._buffers[key] = like.new_empty((rows, *like.shape[1:]))
        return buf

    def serial(self, L: LocalLevel, V: torch.Tensor, G: torch.Tensor | None) -> None:
        """Serial propagation of this rank's part of the coarsest level (a chain over ranks)."""
        tag = 4 * L.level + _RELAX_GHOST
        if L.left is not None:
            V[0] = self._recv(V[0], L.left, tag)
        for n in range(L.lo, L.hi):
            out = self.step1(L, n, V[n - L.lo])
            if G is not None:
                out += G[n + 1 - L.lo]
            V[n + 1 - L.lo] = out
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
        Gc = self.buffer(("G", Lc.level), Lc.n_local, U)
        Gc[0] = V[0]
        Gc[1:] = W - self.stepper.step(Lc.layer(Lc.lo), Lc.stride, Lc.hi - Lc.lo, V[:-1],
                                       self.h * Lc.stride)
        if l + 1 == len(self.levels) - 1:
            self.serial(Lc, V, Gc)
        else:
            self.v_cycle(l + 1, V, Gc)
        self.c_view(L, U).copy_(V[1:])

    def v_cycle(self, l: int, U: torch.Tensor, G: torch.Tensor) -> None:
        """One V-cycle on a coarse level ``l >= 1`` from the initial guess ``U``."""
        L = self.levels[l]
        W = self.f_relax(L, U, G, True)
        if self.relax == "FCF":
            self.c_relax(L, U, W)
            W = self.f_relax(L, U, G, True)
        self.coarse_correct(l, U, W)
        self.f_relax(L, U, G, False)

    def norm(self, sq: float) -> float:
        return math.sqrt(self.link.sum(sq) if self.link is not None else sq)


def mgrit(
    stepper,
    x: torch.Tensor,
    hierarchy: Hierarchy,
    step_size: float,
    *,
    relax: str = "FCF",
    max_cycles: int = 2,
    tol: float | None = None,
    c_weight: float = 1.0,
    init: torch.Tensor | None = None,
    link: Link | None = None,
    parts: list[tuple[int, int]] | None = None,
    me: int = 0,
    collect: bool = False,
) -> MGRITResult:
    """Solve ``u_{n+1} = u_n + h F_n(u_n)``, ``u_0 = x`` by FAS/MGRIT V-cycles.

    A low-level entry point (the stepper defines ``F``); most users want
    :class:`paraprop.multigrid.ParallelResidualStack`.

    Arguments:
        stepper: a :class:`~paraprop.multigrid.steps.ForwardStepper` or
            :class:`~paraprop.multigrid.steps.AdjointStepper` over this rank's layers.
        x: the initial condition ``u_0`` (on other ranks than the first: any tensor of the same
            shape and dtype; it is the default initial guess at the C-points).
        hierarchy: levels and coarsening factors (:meth:`Hierarchy.build`).
        step_size: ``h``.
        relax: ``"F"`` or ``"FCF"`` relaxation.
        max_cycles: the most V-cycles (``>= 0``).
        tol: stop when the residual norm is ``<= tol``; ``None``: do exactly ``max_cycles``.
        c_weight: weight ``w`` of the C-relaxation ``u <- w W + (1 - w) u`` (FCF only).
        init: initial guess at this rank's level-0 C-points, shape ``(n_c, *x.shape)`` (a warm
            start); ``None`` copies ``x``.
        link: the exchange between ranks (``None`` for one process).
        parts: every rank's step range ``[a, b)`` in solve order (``None``: ``[(0, N)]``).
        me: this rank's position in ``parts``.
        collect: with an :class:`~paraprop.multigrid.steps.AdjointStepper`, accumulate the
            parameter gradients during the final relaxation (see ``parameter_grads``).

    Returns:
        An :class:`MGRITResult`.

    Raises:
        ValueError / TypeError: a bad argument (named, with its value), an ``init`` of the wrong
            shape, or a block that changes the state's shape.
        paraprop.distributed.PeerError: (across ranks) a peer died or hangs.

    Example:
        >>> blocks = [torch.nn.Linear(4, 4) for _ in range(16)]
        >>> stepper = ForwardStepper(blocks)
        >>> res = mgrit(stepper, torch.randn(2, 4), Hierarchy.build(16, levels=2, coarsening=4),
        ...             0.1, max_cycles=4)
        >>> res.states.shape, res.residuals[-1] < 1e-5
        (torch.Size([17, 2, 4]), True)
    """
    _validate(x, hierarchy, step_size, relax, max_cycles, tol, c_weight, parts, me)
    parts = parts if parts is not None else [(0, hierarchy.n_steps)]
    solver = _Solver(stepper, hierarchy, float(step_size), relax, float(c_weight), link, parts,
                     me)
    L0 = solver.levels[0]
    t0 = time.perf_counter()
    U = x.new_empty((L0.n_local, *x.shape))
    U[0] = x
    residuals: list[float] = []
    cycles = 0
    # The parameter gradients of the adjoint can be accumulated during the final relaxation
    # (one VJP per layer with respect to state and parameters) when it is known to be final.
    collect = collect and callable(getattr(stepper, "begin_collect", None))
    collected = False
    with torch.no_grad():
        if hierarchy.levels == 1:
            if collect:
                stepper.begin_collect()
                collected = True
            solver.serial(L0, U, None)
        else:
            uc = solver.c_view(L0, U)
            if init is not None:
                if init.shape != uc.shape:
                    raise ValueError(f"init must have shape {tuple(uc.shape)} (this rank's "
                                     f"C-points), got {tuple(init.shape)}")
                uc.copy_(init)
            else:
                uc.copy_(x.expand_as(uc))

            def final(k: int) -> bool:  # is the relaxation after cycle k the last one?
                nonlocal collected
                if collect and tol is None and k == max_cycles:
                    stepper.begin_collect()
                    collected = True
                return collected

            final(0)
            W = solver.f_relax(L0, U, None, True)
            residuals.append(solver.norm(solver.residual_sq(L0, U, W)))
            while cycles < max_cycles and not (tol is not None and residuals[-1] <= tol):
                if relax == "FCF":
                    solver.c_relax(L0, U, W)
                    W = solver.f_relax(L0, U, None, True)
                solver.coarse_correct(0, U, W)
                final(cycles + 1)
                W = solver.f_relax(L0, U, None, True)
                residuals.append(solver.norm(solver.residual_sq(L0, U, W)))
                cycles += 1
        if link is not None:
            link.flush()
    grads = stepper.end_collect() if collected else None
    elapsed = time.perf_counter() - t0
    if hierarchy.levels == 1:
        converged: bool | None = True
    elif tol is None:
        converged = None  # not checked
    else:
        converged = residuals[-1] <= tol
    factor = float("nan")
    if cycles and residuals[0] > 0:
        factor = (residuals[-1] / residuals[0]) ** (1.0 / cycles)
    return MGRITResult(
        states=U, residuals=residuals, cycles=cycles, converged=converged,
        convergence_factor=factor,
        stats={"evaluations": stepper.counts.evaluations, "calls": stepper.counts.calls,
               "time_s": elapsed, "levels": hierarchy.levels,
               "coarsening": list(hierarchy.coarsening), "relax": relax},
        parameter_grads=grads,
    )


def _validate(x, hierarchy, step_size, relax, max_cycles, tol, c_weight, parts, me) -> None:
    """Check :func:`mgrit`'s arguments once; errors name the argument and the value."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    if not isinstance(hierarchy, Hierarchy):
        raise TypeError(f"hierarchy must be a Hierarchy (Hierarchy.build(...)), got "
                        f"{type(hierarchy).__name__}")
    check_step_size(step_size)
    check_relax(relax)
    check_max_cycles(max_cycles, minimum=0, allow_none=False)
    check_tol(tol)
    check_c_weight(c_weight)
    if parts is not None:
        ok = (len(parts) >= 1 and parts[0][0] == 0 and parts[-1][1] == hierarchy.n_steps
              and all(a < b for a, b in parts)
              and all(p[1] == q[0] for p, q in zip(parts, parts[1:], strict=False)))
        if not ok:
            raise ValueError(f"parts={parts!r} must be contiguous non-empty ranges covering "
                             f"[0, {hierarchy.n_steps})")
        if not 0 <= me < len(parts):
            raise ValueError(f"me={me!r} must index parts (0 .. {len(parts) - 1})")


def residual_norm(stepper, states: torch.Tensor, step_size: float, x: torch.Tensor | None = None
                  ) -> float:
    """``||A(u) - g||``: the 2-norm of ``u_{n+1} - u_n - h F_n(u_n)`` over all fine steps (and
    ``u_0 - x`` when ``x`` is given), for states ``(N + 1, *S)`` of one process. A check, not
    used by the solver."""
    with torch.no_grad():
        n = states.shape[0] - 1
        nxt = stepper.step(stepper.offset, 1, n, states[:-1], step_size)
        sq = (states[1:] - nxt).double().pow(2).sum()
        if x is not None:
            sq = sq + (states[0] - x).double().pow(2).sum()
    return float(sq.sqrt())
