"""Sliding-window Jacobi: Jacobi on a window of positions that advances past the final ones.

Song et al. (2021) sample PixelCNN++ with GS-Jacobi over a sliding window of rows; ParaDiGMS
(Shih et al. 2023) slides a window of denoising steps. Both iterate Jacobi on the positions
``[start, start + window)`` only and move ``start`` past the leading positions that are done.
Here "done" is certified, not guessed:

* after a sweep, position ``p`` (the first one not yet final) is exact, since it was computed
  from final positions only; so is every following position whose value did not change in the
  sweep, and the one after that run (by induction: a position computed from final, unchanged
  inputs is final). With ``tol=0`` only these are frozen, and the result is the sequential one
  in at most ``T`` sweeps;
* with ``tol > 0`` the window may also freeze the next ``m`` positions when their error bound
  fits the freeze's share ``tol * m / T`` of the tolerance (after the growth ``fn.growth``
  ``(B, T)`` of an error at that position by the end of the chain, when ``fn`` states one).
  When ``fn`` states its sensitivities ``fn.sensitivity`` ``(B, T)`` (how much a change at
  position ``i`` moves the later positions, e.g. a diffusion step's increment), the bound is
  ``sum_{i<j} lam_i d_i / (1 - sum_{i<j} lam_i)`` where that is smaller. The plain bound of
  position ``j`` is the sum of the sweep's changes at the non-final positions before it, which
  bounds its error when the map does not expand differences (``|f_j(x) - f_j(y)| <=
  max_{i<j} |x_i - y_i|``, e.g. a residual step with a contracting increment); for expanding
  maps state ``fn.growth`` or use ``tol=0`` (:func:`paraprop.diffusion.sample` does the
  former from the gains it observes).

Before each sweep ``fn.propose(x, final)``, when ``fn`` has it, may return new guesses for the
positions that are not final (``final`` ``(B,)``: positions below it are); the result does not
depend on them (Jacobi decoding takes n-gram guesses this way).

``fn`` computes only the window through ``fn.window(x, start, stop, cache)`` (the cached-prefix
protocol of :meth:`paraprop.solvers.base.System.window`) or ``fn.update(x, index)``; otherwise
each sweep evaluates every position and keeps the window's.
"""

from __future__ import annotations

import torch

from paraprop import checks
from paraprop.solvers.base import State, System
from paraprop.solvers.stopping import freeze_budget


class SlidingJacobi:
    """Jacobi over a sliding window of ``window`` positions (see the module doc).

    Arguments:
        window: positions iterated at once (``None``: 64); ``1`` is sequential evaluation,
            ``T`` is Jacobi restricted to the positions not yet final.

    Counters: ``stats["positions"]`` (positions computed) and ``iterations`` (parallel sweeps).
    It does not check that ``fn`` is triangular (run ``"jacobi"`` for that).

    Example:
        >>> W = torch.randn(16, 16).tril(-1) * 0.3
        >>> fn = lambda x: torch.tanh(x @ W.T + 1)
        >>> sol = paraprop.solve(fn, torch.zeros(16), method=paraprop.solvers.SlidingJacobi(4),
        ...                      tol=0)
        >>> ref = paraprop.solve(fn, torch.zeros(16), method="sequential")
        >>> bool((sol.value - ref.value).abs().max() < 1e-6)
        True
    """

    name = "sliding_jacobi"
    DEFAULT_WINDOW = 64

    def __init__(self, window: int | None = None):
        self.window = checks.positive_int("SlidingJacobi: window", window, allow_none=True)

    def __repr__(self) -> str:
        return f"SlidingJacobi(window={self.window!r})"

    def size(self, system: System) -> int:
        return min(self.window or self.DEFAULT_WINDOW, system.T)

    def bound(self, system: System) -> int:
        return system.T

    def init(self, system: System, state: State) -> None:
        B = system.B
        dev = state.x.device
        state.extra.update(
            final=torch.zeros(B, dtype=torch.long, device=dev),  # positions < final are final
            stats={"window": self.size(system)},
        )

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        e = state.extra
        final, T = e["final"], system.T
        act = final < T
        start = int(final[act].min()) if bool(act.any()) else T
        stop = min(T, start + self.size(system))
        n = stop - start
        vals = system.window(state.x, start, stop)
        system.check_finite(vals, torch.arange(start, stop, device=vals.device))
        old = state.x[:, start:stop]
        pos = torch.arange(start, stop, device=vals.device)
        # only positions that are not final yet (recomputing a final one may differ by rounding)
        writable = (pos[None, :] >= final[:, None]) & act[:, None]          # (B, n)
        d = (vals - old).abs()
        d_pos = (d.amax(dim=2) if norm == "max" else d.pow(2).sum(2).sqrt()).to(torch.float64)
        d_pos = torch.where(writable, d_pos, torch.zeros_like(d_pos))
        old.copy_(torch.where(writable[:, :, None], vals, old))

        # certified: the first writable position, plus a leading run of unchanged ones, plus one
        off = (final - start).clamp(min=0)                                  # (B,)
        rel = torch.arange(n, device=vals.device)[None, :] - off[:, None]   # position - final
        unchanged = (d_pos == 0) | (rel < 0)
        run = torch.where(unchanged, 0, 1).cumsum(1)                        # changes so far
        first_change = (run == 0).sum(1)                                    # leading unchanged
        exact_to = torch.minimum(torch.maximum(first_change + 1, off + 1),
                                 torch.full_like(off, n))
        new_final = start + exact_to
        if tol > 0:   # estimated: the changes before a position bound its error
            # A position computed from inputs with errors e_i has an error <= max_i e_i when the
            # map does not expand differences; the input errors are at most the changes of the
            # sweep plus the new values' own errors, so error(x_new[j]) <= sum_{i<j} d_i over
            # the non-final positions (the final ones have d = 0).
            est = d_pos.cumsum(1) - d_pos
            sens = getattr(system.fn, "sensitivity", None)
            if isinstance(sens, torch.Tensor):
                # fn states how much a change at position i moves the later positions (lam_i):
                # error(x_new[j]) <= sum_{i<j} lam_i (d_i + error(x_new[i])), which solves to
                # sum_{i<j} lam_i d_i / (1 - sum_{i<j} lam_i) while that sum is below 1
                lam = sens.reshape(system.B, T)[:, start:stop].to(est.dtype)
                lam = torch.where(lam.isnan(), torch.ones_like(lam), lam)
                lam = torch.where(writable, lam, torch.zeros_like(lam))
                wsum = (lam * d_pos).cumsum(1) - lam * d_pos
                total = lam.cumsum(1) - lam
                tight = torch.where(total < 1, wsum / (1 - total), torch.inf)
                est = torch.minimum(est, tight)
            shift = new_final - start
            ar = torch.arange(n, device=vals.device)[None, :]
            idx = (ar + shift[:, None]).clamp(max=n - 1)
            cand = torch.where(ar + shift[:, None] < n, est.gather(1, idx),
                               torch.full_like(est, float("inf")))
            raw = cand
            growth = getattr(system.fn, "growth", None)
            if isinstance(growth, torch.Tensor):
                # fn says how much an error at each position grows by the end of the chain:
                # a freeze must fit its share after that growth
                g = growth.reshape(system.B, T).gather(1, new_final.clamp(max=T - 1)[:, None])
                cand = cand * g.to(cand.dtype)
            m = freeze_budget(cand, tol, T)
            if bool((m > 0).any()):
                block = ar < m[:, None]
                worst = torch.where(block, raw, torch.zeros_like(raw)).amax(1)
                worst = torch.where(act & (m > 0), worst, 0.0)
                state.estimate = state.estimate + torch.where(
                    act & (m > 0), torch.where(block, cand, torch.zeros_like(cand)).amax(1), 0.0)
                # where each freeze began and its estimate: a caller that knows how errors
                # grow along its map can propagate them (paraprop.diffusion does)
                log = e["stats"].setdefault("freeze_estimates", torch.zeros(
                    system.B, T, dtype=torch.float64, device=vals.device))
                log.scatter_add_(1, new_final.clamp(max=T - 1)[:, None], worst[:, None])
            new_final = new_final + m
        e["final"] = torch.where(act, torch.maximum(final, new_final), final)
        state.sample_iterations += act.long()
        state.active = e["final"] < T
        state.residual = float(d_pos.max()) if n else 0.0
        state.finished = not bool(state.active.any())
        propose = getattr(system.fn, "propose", None)
        if callable(propose) and not state.finished:
            _take_guesses(system, state, propose(system.user(state.x), e["final"]))


def _take_guesses(system: System, state: State, guess) -> None:
    """Write ``fn.propose``'s guesses into the positions that are not final (any guess keeps
    the result exact: a position is accepted only when its inputs reproduce it)."""
    if guess is None:
        return
    if not isinstance(guess, torch.Tensor) or guess.shape != system.shape or \
            guess.dtype != system.dtype:
        got = (f"{tuple(guess.shape)} {guess.dtype}" if isinstance(guess, torch.Tensor)
               else type(guess).__name__)
        raise ValueError(f"fn.propose(x, final) must return None or a tensor shaped like x "
                         f"{tuple(system.shape)} {system.dtype}, got {got}")
    g = system.canon(guess)
    system.check_finite(g)
    free = torch.arange(system.T, device=g.device)[None, :] >= state.extra["final"][:, None]
    state.x.copy_(torch.where(free[:, :, None], g, state.x))
