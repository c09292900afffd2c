"""Triangular Anderson acceleration of the fixed-point iteration ``x <- fn(x)`` (ParaTAA).

Anderson acceleration (Anderson 1965; Walker & Ni 2011) extrapolates from the last few iterates
``x^(l)`` and residuals ``r^(l) = fn(x^(l)) - x^(l)``: with the differences ``dX``, ``dR`` of the
``m`` most recent ones it takes ``x + r - (dX + dR) gamma``, ``gamma`` the least-squares
coefficients that make ``r - dR gamma`` smallest. Tang et al. (2024, "Accelerating Parallel
Sampling of Diffusion Models") make it *triangular* for systems like ours: position ``j`` fits
its own ``gamma_j`` to the residuals of positions ``<= j`` only (the ones it depends on), which
is an approximate inverse Jacobian with the system's lower-triangular structure. On diffusion
chains it needs several times fewer iterations than plain Picard iteration.

What this implementation adds, so that the result is the sequential one:

* **Exact prefix.** The positions before the first non-final one are final; that one, and a
  following run of positions whose residual is exactly zero, are computed from final inputs and
  take ``fn``'s value, not the extrapolated one. So at least one more position is final after
  every iteration, and ``T`` iterations give the exact result whatever the extrapolation does.
* **Stopping rule.** Extrapolated iterates say nothing reliable about how much ``fn``
  contracts (an estimate from them let a sample stop at twice ``tol``), so once a sample's
  residual ``||fn(x) - x||`` is ``<= tol`` it continues with plain fixed-point steps
  ``x <- fn(x)``, and stops on the Jacobi rule over those: the residual and its contraction
  estimate ``q / (1 - q) * d`` are ``<= tol`` (:class:`~paraprop.stopping.ContractionRule`).
  This usually costs one or two iterations more than stopping on the residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from paraprop import checks
from paraprop.solvers.base import Solver, State, check_final, last_from_x0, sync
from paraprop.solvers.rounding import rounding_floor
from paraprop.solvers.triangular import System


@dataclass(slots=True)
class _AndersonState:
    final: torch.Tensor       # (B,) long: positions < final are final
    index: torch.Tensor       # arange(T)
    picard: torch.Tensor      # (B,) bool: finishing with plain steps
    lo: int = 0               # the smallest final of the samples still iterating (on the host)
    # the last iterates and their residuals
    xs: list[torch.Tensor] = field(default_factory=list)
    rs: list[torch.Tensor] = field(default_factory=list)


class TriangularAnderson(Solver):
    """Triangular Anderson acceleration (see the module doc): one call of ``fn`` per iteration.

    Arguments:
        memory: iterates kept (``None``: 3); ``1`` is plain fixed-point (Jacobi) iteration.
            ParaTAA recommends 2 to 5.
        regularization: Tikhonov weight of the least-squares fits, relative to the size of
            their normal equations (``None``: 1e-6).

    Counters: ``iterations`` (calls of ``fn``) and ``stats["positions"]``. Like Jacobi it
    checks that final positions do not move (``NotTriangularError``).

    Example:
        >>> W = torch.randn(32, 32).tril(-1) * 0.2
        >>> def fn(x):  # x_t = 0.9 x_{t-1} + 0.1 tanh(W x)_{t-1} + 0.05: a slow chain
        ...     step = x * 0.9 + torch.tanh(x @ W.T) * 0.1 + 0.05
        ...     return torch.cat([torch.full_like(x[..., :1], 0.05), step[..., :-1]], -1)
        >>> ref = paraprop.solve(fn, torch.zeros(2, 32), method="sequential")
        >>> sol = paraprop.solve(fn, torch.zeros(2, 32), tol=1e-6,
        ...                      method=paraprop.solvers.TriangularAnderson(memory=3))
        >>> bool((sol.value - ref.value).abs().max() <= 1e-5)
        True
    """

    name = "anderson"
    # the optional hooks of fn this solver calls (paraprop.solvers.protocols): fn only
    hooks: tuple[str, ...] = ()
    DEFAULT_MEMORY = 3
    DEFAULT_REGULARIZATION = 1e-6

    def __init__(self, memory: int | None = None, regularization: float | None = None):
        self.memory = checks.positive_int("TriangularAnderson: memory", memory, allow_none=True)
        self.regularization = checks.nonneg_number("TriangularAnderson: regularization",
                                                   regularization, finite=True, allow_none=True)
        self._residual_stop = False

    def residual_stop(self) -> TriangularAnderson:
        """This solver, stopping a sample where its residual is ``<= tol``, without the plain
        steps of the stopping rule (module doc): for a caller that certifies the value itself
        and uses the stop only to end its iterations (the diffusion certificate's final
        check); not public, as its stop certifies nothing."""
        other = TriangularAnderson(self.memory, self.regularization)
        other._residual_stop = True
        return other

    def __repr__(self) -> str:
        return f"TriangularAnderson(memory={self.memory!r})"

    @property
    def m(self) -> int:
        return self.memory or self.DEFAULT_MEMORY

    def init(self, system: System, state: State) -> None:
        B, dev = system.B, state.x.device
        state.own = _AndersonState(final=torch.zeros(B, dtype=torch.long, device=dev),
                                   index=torch.arange(system.T, device=dev),
                                   picard=torch.zeros(B, dtype=torch.bool, device=dev))
        # its certificate comes from fn's own values: at tol=0 it stops only where fn(x) == x
        # bitwise, or at the bound, whose last evaluation computes the last position from the
        # final ones
        state.verified = True

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        e: _AndersonState = state.own
        X, T = state.x, system.T
        final, act = e.final, state.active
        pos = e.index
        # the samples whose last position is all that is left compute it as the sequential
        # loop does, with x0's value there (the budget: T calls, none left to verify after)
        last = act & (final == T - 1)
        if X.device.type != "cpu" or bool(last.any()):   # (free to ask on the host)
            last_from_x0(system, state, last)
        Y = system.evaluate(X)
        # position `final` is computed from final inputs; later ones may hold an overflowed
        # iterate's value, which keeps the old one and counts as not converged
        Y, kept = system.keep_finite(Y, X, final, pos, act, x=X)
        R = Y - X
        per_pos = R.abs().amax(dim=2) if norm == "max" else R.pow(2).sum(2).sqrt()  # (B, T)
        lo = e.lo
        if lo > 0:  # final positions were computed from final inputs: they must not move
            check_final(system, per_pos[:, :lo], tol, act)
        if kept is not None:
            per_pos = torch.where(kept, torch.inf, per_pos)

        # the exact prefix: position `final` and a run of zero residuals after it
        behind = pos[None, :] < final[:, None]
        nonzero = (per_pos != 0) & ~behind
        first = torch.where(nonzero, pos[None, :], torch.full_like(nonzero, T, dtype=torch.long))
        new_final = torch.minimum(first.amin(dim=1) + 1, torch.full_like(final, T))
        exact = pos[None, :] < new_final[:, None]                      # (B, T)

        # stopping: the extrapolated iterates say nothing about fn's contraction, so a sample
        # whose residual reaches tol finishes with plain fixed-point steps, and stops on the
        # contraction rule over those (exactly the Jacobi rule)
        d = per_pos.amax(dim=1).to(torch.float64) if norm == "max" else \
            torch.linalg.vector_norm(R.reshape(R.shape[0], -1), dim=1).to(torch.float64)
        if kept is not None:
            d = torch.where(kept.any(dim=1), torch.inf, d)
        picard = e.picard
        rate = torch.where(picard, d / state.rule.d_prev, torch.full_like(d, float("nan")))
        stop, est = state.rule.update(torch.where(act, d, torch.zeros_like(d)), tol, act,
                                      rate=rate, floor=lambda: rounding_floor(Y, norm))
        stop = stop | (act & (new_final >= T))
        e.picard = picard | (act & (d <= tol))
        if self._residual_stop:   # (a caller that certifies the value itself: see residual_stop)
            stop = stop | (act & (d <= tol))

        # the next iterate: fn's value on the exact prefix and for stopping samples, the
        # triangular Anderson extrapolation elsewhere
        e.xs.append(X.clone())
        e.rs.append(R)
        for kept_iterates in (e.xs, e.rs):
            del kept_iterates[: -self.m]
        new = Y if len(e.xs) < 2 else self._extrapolate(X, R, e.xs, e.rs)
        take_y = exact | stop[:, None] | e.picard[:, None]
        new = torch.where(take_y[:, :, None], Y, new)
        # an extrapolation that overflowed takes fn's value: the iterate stays finite (on the
        # host one reduction says whether any did; an accelerator replaces without asking)
        if new.device.type != "cpu" or not math.isfinite(float(new.sum())):
            new = torch.where(torch.isfinite(new), new, Y)
        X.copy_(torch.where(act[:, None, None], new, X))

        state.estimate = torch.where(stop & (new_final < T), est, state.estimate)
        e.final = torch.where(act, torch.maximum(final, new_final), final)
        state.sample_iterations += act.long()
        state.active = act & ~stop
        state.residual = torch.where(act, d, torch.zeros_like(d)).max()
        # the iteration's one synchronisation: samples left, and the smallest final among them
        n_left, next_lo = sync(state.active.sum(), torch.where(state.active, e.final, T).min())
        e.lo = int(next_lo)
        state.finished = n_left == 0

    def _extrapolate(self, X, R, xs, rs) -> torch.Tensor:
        """``x + r - (dX + dR) gamma``, ``gamma`` fitted per position on the positions ``<= j``."""
        dX = torch.stack([b - a for a, b in zip(xs, xs[1:], strict=False)])   # (h, B, T, F)
        dR = torch.stack([b - a for a, b in zip(rs, rs[1:], strict=False)])
        h = dX.shape[0]
        work = torch.float64
        dRw = dR.to(work)
        gram = torch.einsum("ibtf,jbtf->btij", dRw, dRw).cumsum(dim=1)       # (B, T, h, h)
        rhs = torch.einsum("ibtf,btf->bti", dRw, R.to(work)).cumsum(dim=1)   # (B, T, h)
        reg = self.regularization if self.regularization is not None else \
            self.DEFAULT_REGULARIZATION
        scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True)     # (B, T, 1)
        eye = torch.eye(h, dtype=work, device=X.device)
        lam = (reg * scale + torch.finfo(work).tiny)[..., None] * eye
        gamma = torch.linalg.solve(gram + lam, rhs.unsqueeze(-1)).squeeze(-1)  # (B, T, h)
        gamma = torch.nan_to_num(gamma, nan=0.0, posinf=0.0, neginf=0.0).to(X.dtype)
        corr = torch.einsum("ibtf,bti->btf", dX + dR, gamma)
        return X + R - corr


def _norm(v: torch.Tensor, norm: str) -> torch.Tensor:
    flat = v.reshape(v.shape[0], -1)
    out = flat.abs().amax(dim=1) if norm == "max" else torch.linalg.vector_norm(flat, dim=1)
    return out.to(torch.float64)
