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
after at most ``N // c_0`` cycles (the exactness bound).

Stopping rule. The residual does not bound the error: the error ``e = u - u*`` solves the block
bidiagonal system ``e_{m+1} = J_m e_m - r_{m+1}`` over the C-points (``J_m``: the Jacobian of
``c`` fine steps), so ``e = A^{-1} r`` adds up the residuals of all earlier C-points, and for a
stack that accumulates small steps (``J ~ I``) ``||A^{-1}||`` grows like the number of C-points.
Nor does the size of the last correction. The solver instead estimates the error of the iterate
from the per-cycle change ``d_k = max |u_k - u_{k-1}|`` over all points (C and F) and its
observed rate ``q = max(d_k / d_{k-1}, d_{k-1} / d_{k-2})``: an iteration that contracts the error
by ``q < 1`` per cycle is within ``q / (1 - q) * d_k`` of its limit, the serial states. It stops
when that estimate and ``d_k`` are ``<= tol`` (at the earliest after three cycles, so that two
rates agree), when ``d_k`` or the residual is exactly zero (a bitwise fixed point), or at the
exactness bound, where the result is the serial one whatever the estimate said. A cycle that
does not contract (``q >= 1``, as happens while MGRIT's coarse steps are poor) gives no estimate,
so the solve goes on (to the bound, unless ``max_iters`` ends it: then it did not converge).
See ``docs/multigrid.md`` for a worked example.

The solver works on one rank's contiguous range of layers (see
:class:`paraprop.multigrid.hierarchy.LocalLevel`; the cycle's kernels:
:class:`paraprop.multigrid.vcycle.VCycle`); a single process is the one-rank case, and
:mod:`paraprop.distributed` supplies the point-to-point link between ranks. Every rank runs the
same control flow, so each send has its receive; the residual and the change are reduced over
the ranks by one all-reduce per cycle, so every rank takes the same decision.
"""

from __future__ import annotations

import math

import torch

from paraprop import checks
from paraprop.driver import Outcome, run
from paraprop.multigrid.common import (
    DEFAULT_TOL,
    RELAX,
    check_block_modes,
    check_c_weight,
    check_input,
    floating_tensors,
    run_batched,
    stateful_modules,
    warn_unchecked,
)
from paraprop.multigrid.hierarchy import Hierarchy
from paraprop.multigrid.vcycle import Link, VCycle
from paraprop.result import Result, Solution, ensure_converged

__all__ = ["RELAX", "Link", "mgrit", "residual_norm", "run_mgrit"]


class _ErrorEstimate:
    """The stopping rule of the module notes: per-cycle changes ``d_k`` -> error estimate."""

    def __init__(self):
        self.changes: list[float] = []

    def update(self, d: float) -> float:
        """Record ``d_k``; return the estimate of ``max |u_k - u*|`` (``inf``: none yet)."""
        self.changes.append(d)
        if d == 0:
            return 0.0
        if not math.isfinite(d) or len(self.changes) < 3:
            return math.inf
        d2, d1 = self.changes[-3], self.changes[-2]
        q = max(d / d1, d1 / d2)
        return q / (1.0 - q) * d if q < 1 else math.inf


def _max_change(U: torch.Tensor, prev: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """``max |U - prev|`` over all entries as a float64 0-d tensor on ``U``'s device (in chunks
    of rows: no full-size temporary; no host round trip); ``nan`` if either holds a NaN."""
    parts = [(U[i : i + chunk] - prev[i : i + chunk]).abs().amax()
             for i in range(0, U.shape[0], chunk)]
    return torch.stack(parts).amax().to(torch.float64)


def _scalars(*ts: torch.Tensor) -> list[float]:
    """0-d tensors as floats in one transfer (the one host round trip of a cycle)."""
    return torch.stack(ts).tolist()


def mgrit(
    stepper,
    x: torch.Tensor,
    hierarchy: Hierarchy,
    step_size: float,
    *,
    relax: str = "FCF",
    max_iters: int | None = None,
    tol: float | None = DEFAULT_TOL,
    throw: bool = True,
    c_weight: float = 1.0,
    init: torch.Tensor | None = None,
    link: Link | None = None,
    parts: list[tuple[int, int]] | None = None,
    me: int = 0,
    collect: bool = False,
) -> Solution:
    """Solve ``u_{n+1} = u_n + h F_n(u_n)``, ``u_0 = x`` by FAS/MGRIT V-cycles.

    A low-level entry point (the stepper defines ``F``); most users want
    :class:`paraprop.multigrid.ParallelResidualStack`.

    Arguments:
        stepper: a :class:`~paraprop.multigrid.steps.ForwardStepper` or
            :class:`~paraprop.multigrid.steps.AdjointStepper` over this rank's layers.
        x: the initial condition ``u_0`` (on other ranks than the first: any tensor of the same
            shape and dtype; it is the default initial guess at the C-points). Its dtype and
            device must be those of the stepper's blocks.
        hierarchy: levels and coarsening factors (:meth:`Hierarchy.build`).
        step_size: ``h``.
        relax: ``"F"`` or ``"FCF"`` relaxation.
        max_iters: the most V-cycles (``>= 0``); ``None``: the exactness bound
            (``hierarchy.exact_cycles()``, after which the result is the serial one in exact
            arithmetic; twice that where ``tol=0`` stops only at a zero residual, below).
        tol: stop once the estimated ``max |u - serial|`` over all states is ``<= tol`` (the
            stopping rule of the module notes). ``0``: bitwise the serial states: a zero
            residual, or the bound with ``relax="FCF"`` and ``c_weight=1`` (whose C-relaxation
            copies the fine step; with ``"F"`` or a weighted C-relaxation the coarse correction
            reaches the serial states at the bound only up to rounding, so those stop at a zero
            residual, bitwise, a cycle or two later).
            ``None``: exactly ``max_iters`` cycles, not checked (a warning says so when that is
            fewer than the bound): ``converged=False``, ``stats["checked"] = False``, never an
            error.
        throw: with a ``tol``, raise :class:`paraprop.ConvergenceError` when ``max_iters`` ends
            the solve before the estimate reaches ``tol`` (``False``: return the unconverged
            :class:`~paraprop.Solution`).
        c_weight: weight ``w`` of the C-relaxation ``u <- w W + (1 - w) u`` (FCF only).
        init: initial guess at this rank's level-0 C-points, shape ``(n_c, *x.shape)`` (a warm
            start); ``None`` copies ``x``.
        link: the exchange between ranks (``None`` for one process).
        parts: every rank's step range ``[a, b)`` in solve order (``None``: ``[(0, N)]``).
        me: this rank's position in ``parts``.
        collect: with an :class:`~paraprop.multigrid.steps.AdjointStepper`, accumulate the
            parameter gradients during the final relaxation (``stats["parameter_grads"]``).

    Returns:
        A :class:`paraprop.Solution`: ``value`` holds this rank's level-0 points ``lo .. hi``
        (one process: all ``u_0 .. u_N``), shape ``(hi - lo + 1, *x.shape)``, row 0 a copy of
        the left neighbour's last point on other ranks; ``method`` is ``"mgrit"`` (``"sequential"``
        for one level); ``iterations`` the V-cycles done; ``evaluations`` the layer evaluations
        (the hardware-independent work); ``converged`` is ``True`` when the error estimate
        reached ``tol``, the residual or the change was exactly zero, or the bound was reached
        (and the residual is finite; at ``tol=0``: a zero residual, or the bound with FCF and
        ``c_weight=1``); ``residuals`` ``[r_0, r_1, ..., r_K]``, the residual norm
        of the initial guess and after each cycle (empty for one level). ``stats``: ``checked``
        (``False`` only for ``tol=None`` stopped before the bound), ``error_estimate`` (the
        estimate when it stopped: ``0.0`` at the bound or a zero residual/change; ``inf`` when
        there was none; ``nan`` when not checked), ``changes`` (``d_1 .. d_K``; empty when not
        checked), ``bound`` (the exactness bound in cycles), ``tol``, ``convergence_factor``
        (``(r_K / r_0) ** (1 / K)``, nan when undefined), ``calls`` (sequential launches),
        ``time_s``, ``levels``, ``coarsening``, ``relax``, ``parameter_grads`` (with
        ``collect=True`` and an adjoint stepper: the parameter gradients accumulated during the
        final relaxation, one dict per local block in depth order, when that relaxation was
        known to be the last: ``tol=None`` or one level; else ``None``).

    Raises:
        ValueError / TypeError: a bad argument (named, with its value), an ``x`` whose dtype or
            device differs from the blocks', a block in training mode with BatchNorm (running
            statistics), dropout or another stochastic layer
            (:class:`paraprop.StochasticModelError`), an ``init`` of the wrong shape, a block
            that changes the state's shape, or a batched stepper with ``tol=0`` or a bf16 /
            fp16 ``x`` (its rounding differs from the serial loop's; pass ``batched=False``).
        paraprop.ConvergenceError: ``tol`` not reached within ``max_iters`` cycles (or the
            iterate became non-finite) and ``throw=True``; ``.solution`` holds the result.
        paraprop.distributed.PeerError: (across ranks) a peer died or hangs.

    Example:
        >>> from paraprop.multigrid import ForwardStepper
        >>> blocks = [torch.nn.Linear(4, 4) for _ in range(16)]
        >>> stepper = ForwardStepper(blocks)
        >>> sol = mgrit(stepper, torch.randn(2, 4), Hierarchy.build(16, levels=2, coarsening=4),
        ...             0.1)
        >>> sol.value.shape, sol.converged, sol.stats["error_estimate"] <= 1e-5
        (torch.Size([17, 2, 4]), True, True)
    """
    _validate(x, hierarchy, step_size, relax, max_iters, tol, c_weight, parts, me)
    blocks = getattr(stepper, "blocks", None)
    if blocks is not None:
        offset = getattr(stepper, "a", stepper.offset)
        check_input(x, floating_tensors(blocks), offset)
        check_block_modes(stateful_modules(blocks), offset)
    if getattr(stepper, "batched", False):
        name = type(stepper).__name__
        run_batched(f"mgrit ({name}(batched=True))", True, True, x.dtype, tol,
                    remedy=f"pass a {name}(..., batched=False), whose steps are the serial "
                           "loop's")
    bound = hierarchy.exact_cycles()
    if tol is None and hierarchy.levels > 1 and max_iters is not None and max_iters < bound:
        warn_unchecked("mgrit", max_iters, bound)
    return run_mgrit(stepper, x, hierarchy, step_size, relax=relax, max_iters=max_iters,
                     tol=tol, throw=throw, c_weight=c_weight, init=init, link=link, parts=parts,
                     me=me, collect=collect)


def run_mgrit(stepper, x, hierarchy, step_size, *, relax="FCF", max_iters=None,
              tol=DEFAULT_TOL, throw=True, c_weight=1.0, init=None, link=None, parts=None, me=0,
              collect=False, entry: str = "mgrit") -> Solution:
    """:func:`mgrit` without its argument checks and warning (for the modules, which check once
    at construction and warn there, and for the cost model); ``entry`` names the caller in a
    :class:`~paraprop.ConvergenceError`."""
    parts = parts if parts is not None else [(0, hierarchy.n_steps)]
    solver = VCycle(stepper, hierarchy, float(step_size), relax, float(c_weight), link, parts,
                     me)
    bound = hierarchy.exact_cycles()
    # At the bound the states are the serial ones bitwise only where the C-relaxation copies
    # the fine step into the C-points (FCF, c_weight=1). F-relaxation, or a weighted
    # C-relaxation, gets there through the coarse correction b + (W - b), which rounds: at the
    # bound those states are the serial ones up to rounding (measured: a few ulp), and one or
    # two cycles later bitwise. So tol=0 (bitwise) stops there only at a zero residual, with
    # room for twice the bound by default.
    bitwise_bound = relax == "FCF" and c_weight == 1
    settle = tol == 0 and hierarchy.levels > 1 and not bitwise_bound
    cap = (2 * bound if settle else bound) if max_iters is None else max_iters
    cycles = _Cycles(solver, stepper, x, hierarchy, tol, cap, bound, settle, init, link,
                     collect and callable(getattr(stepper, "begin_collect", None)))
    with torch.no_grad():
        sol = run(cycles, max_iters=cap, entry=entry, throw=False, tol=tol)
    if tol is None:
        return sol
    hint = ("the iterate became non-finite (coarse steps of c * h overflowed?); use smaller "
            "coarsening factors or fewer levels" if not cycles.finite else
            f"tol=0 with relax={relax!r}, c_weight={c_weight:g} stops only at a zero residual "
            "(the bitwise serial states): its coarse correction reaches them up to rounding at "
            "the exactness bound and bitwise a cycle or two later; raise max_iters (None: twice "
            "the bound), use relax='FCF' with c_weight=1, or a tol > 0" if settle else
            "raise max_iters (None: the exactness bound, the serial result) or tol")
    return ensure_converged(sol, throw, entry=entry, max_iters=cap, tol=tol,
                            last=sol.stats["error_estimate"], hint=hint)


class _Cycles:
    """MGRIT's cycles as a :class:`paraprop.driver.Method`: ``init`` relaxes the initial guess
    and measures its residual, each ``step`` is one cycle (C-relaxation for FCF, the coarse
    correction, F-relaxation) and returns the cycle's residual; the error estimate of the
    changes (:class:`_ErrorEstimate`) is the stopping rule."""

    def __init__(self, solver, stepper, x, hierarchy, tol, cap, bound, settle, init, link,
                 collect):
        self.solver, self.stepper, self.x, self.hierarchy = solver, stepper, x, hierarchy
        self.tol, self.cap, self.bound, self.settle = tol, cap, bound, settle
        self.guess, self.link, self.collect = init, link, collect
        self.name = "mgrit" if hierarchy.levels > 1 else "sequential"
        self.checking = tol is not None
        self.residuals: list[float] = []
        self.rule = _ErrorEstimate()
        self.estimate = math.inf if self.checking else math.nan
        self.stop = False  # by the rule, a zero residual or a zero change
        self.cycles = 0
        # The parameter gradients of the adjoint can be accumulated during the final relaxation
        # (one VJP per layer with respect to state and parameters) when it is known to be
        # final.
        self.collected = False
        self.finite = True

    def _final(self, k: int) -> bool:   # is the relaxation after cycle k the last one?
        if self.collect and self.tol is None and k == self.cap:
            self.stepper.begin_collect()
            self.collected = True
        return self.collected

    def init(self) -> None:
        solver, x = self.solver, self.x
        L0 = self.L0 = solver.levels[0]
        U = self.U = x.new_empty((L0.n_local, *x.shape))
        U[0] = x
        if self.hierarchy.levels == 1:
            if self.collect:
                self.stepper.begin_collect()
                self.collected = True
            solver.serial(L0, U)
            return
        uc = solver.c_view(L0, U)
        if self.guess is not None:
            if self.guess.shape != uc.shape:
                raise ValueError(f"init must have shape {tuple(uc.shape)} (this rank's "
                                 f"C-points), got {tuple(self.guess.shape)}")
            uc.copy_(self.guess)
        else:
            uc.copy_(x.expand_as(uc))
        self._final(0)
        self.W = solver.f_relax(L0, U, True)
        (sq,) = _scalars(solver.residual_sq(L0, U, self.W))
        r, _ = solver.reduce(sq, None)
        self.residuals.append(r)
        self.prev = U.clone() if self.checking and self.cap > 0 else None
        if self.checking and r == 0:
            self.stop, self.estimate = True, 0.0

    def stopped(self) -> bool:
        return self.hierarchy.levels == 1 or self.stop or not math.isfinite(self.residuals[-1])

    def step(self) -> float:
        solver, L0, U = self.solver, self.L0, self.U
        if solver.relax == "FCF":
            solver.c_relax(L0, U, self.W)
            self.W = solver.f_relax(L0, U, True)
        solver.coarse_correct(0, U, self.W)
        self._final(self.cycles + 1)
        self.W = solver.f_relax(L0, U, True)
        self.cycles += 1
        change = None
        sq = solver.residual_sq(L0, U, self.W)
        if self.checking:    # the residual and the change in one transfer
            assert self.prev is not None       # (kept whenever a checked solve has cycles)
            sq, change = _scalars(sq, _max_change(U, self.prev))
            self.prev.copy_(U)
        else:
            (sq,) = _scalars(sq)
        r, d = solver.reduce(sq, change)
        self.residuals.append(r)
        if self.checking:
            self.estimate = self.rule.update(d)
            if r == 0:
                self.estimate = 0.0
            self.stop = self.estimate <= self.tol and (d <= self.tol or self.estimate == 0.0)
            if self.settle:   # a bitwise fixed point of the cycle may still round (above)
                self.stop = r == 0
        return r

    def outcome(self, iterations: int) -> Outcome:
        if self.link is not None:
            self.link.flush()
        grads = self.stepper.end_collect() if self.collected else None
        residuals, cycles, hierarchy = self.residuals, self.cycles, self.hierarchy
        finite = self.finite = not residuals or math.isfinite(residuals[-1])
        estimate = self.estimate
        if hierarchy.levels == 1:
            converged, checked, estimate = True, True, 0.0
        elif finite and (residuals[-1] == 0 or (cycles >= self.bound and not self.settle)):
            converged, checked, estimate = True, True, 0.0
        else:
            converged, checked = finite and self.stop, self.checking
        factor = math.nan
        if cycles and residuals[0] > 0:
            factor = (residuals[-1] / residuals[0]) ** (1.0 / cycles)
        return Outcome(
            self.U, Result.successful if converged else Result.unchecked if not checked
            else Result.max_iters_reached,
            evaluations=self.stepper.counts.evaluations, bound=self.bound,
            error_estimate=estimate, residuals=torch.tensor(residuals, dtype=torch.float64),
            stats={"checked": checked, "changes": self.rule.changes, "tol": self.tol,
                   "convergence_factor": factor, "calls": self.stepper.counts.calls,
                   "levels": hierarchy.levels, "coarsening": list(hierarchy.coarsening),
                   "relax": self.solver.relax, "parameter_grads": grads})


def _validate(x, hierarchy, step_size, relax, max_iters, tol, c_weight, parts, me) -> None:
    """Check :func:`mgrit`'s arguments once; errors name the argument and the value."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    if not isinstance(hierarchy, Hierarchy):
        raise TypeError(f"hierarchy must be a Hierarchy (Hierarchy.build(...)), got "
                        f"{type(hierarchy).__name__}")
    checks.positive_number("step_size", step_size, finite=True)
    checks.one_of("relax", relax, RELAX)
    checks.nonneg_int("max_iters", max_iters, allow_none=True)  # None: the exactness bound
    checks.nonneg_number("tol", tol, allow_none=True)
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
    used by the solver.

    Example:
        >>> from paraprop.multigrid import ForwardStepper
        >>> stepper = ForwardStepper([nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        ...                           for _ in range(6)])
        >>> u = [torch.randn(2, 4)]
        >>> with torch.no_grad():                        # the serial states u_0 .. u_6
        ...     for block in stepper.blocks:
        ...         u.append(u[-1] + 0.5 * block(u[-1]))
        >>> residual_norm(stepper, torch.stack(u), 0.5, x=u[0]) < 1e-6   # rounding only
        True
        >>> residual_norm(stepper, torch.zeros(7, 2, 4), 0.5) > 0.1
        True
    """
    with torch.no_grad():
        n = states.shape[0] - 1
        nxt = stepper.step(stepper.offset, 1, n, states[:-1], step_size)
        sq = (states[1:] - nxt).double().pow(2).sum()
        if x is not None:
            sq = sq + (states[0] - x).double().pow(2).sum()
    return float(sq.sqrt())
