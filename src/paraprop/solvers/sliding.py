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
  maps state ``fn.growth`` or use ``tol=0``. (:func:`paraprop.diffusion.sample` states
  neither: it certifies its trajectory by a final check of its own against the loop's step
  map, carried through the gains it observes.)

Before each sweep ``fn.propose(x, final)``, when ``fn`` has it, may return new guesses for the
positions that are not final (``final`` ``(B,)``: positions below it are); the result does not
depend on them (Jacobi decoding takes n-gram guesses this way).

``fn`` computes only the window through ``fn.window(x, start, stop, cache)`` (the cached-prefix
protocol of :meth:`paraprop.solvers.triangular.System.window`) or ``fn.update(x, index)``; otherwise
each sweep evaluates every position and keeps the window's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paraprop import checks
from paraprop.errors import ProtocolError
from paraprop.solvers.base import State
from paraprop.solvers.protocols import HOOKS
from paraprop.solvers.rounding import half_ulp_bound
from paraprop.solvers.triangular import System
from paraprop.solvers.verify import final_step
from paraprop.stopping import freeze_budget, freeze_thresholds


@dataclass(slots=True)
class _SlidingState:
    final: torch.Tensor       # (B,) long: positions < final are final
    index: torch.Tensor       # arange(T)
    start: int = 0            # the smallest final of the samples still iterating (on the host)
    # per window length n: arange(n) (1, n) and the freeze thresholds (see _ramp)
    ramps: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class SlidingJacobi:
    """Jacobi over a sliding window of ``window`` positions (see the module doc).

    Arguments:
        window: positions iterated at once (``None``: 64); ``1`` is sequential evaluation,
            ``T`` is Jacobi restricted to the positions not yet final.

    Counters: ``stats["positions"]`` (positions computed) and ``iterations`` (parallel sweeps).
    One evaluation of ``fn`` at the end checks the value, at every ``tol``, within ``T`` calls
    in all (:mod:`paraprop.solvers.verify`); on the way, each call of ``fn.window`` and
    ``fn.propose`` is checked not to modify ``x``.

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
    # the optional hooks of fn it calls (solvers.protocols; the final check calls fn):
    # fn.window (else fn.update, else fn), fn.propose, fn.sensitivity, fn.growth
    hooks: tuple[str, ...] = ("window", "update", "propose", "sensitivity", "growth")
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
        state.own = _SlidingState(torch.zeros(B, dtype=torch.long, device=dev),
                                  torch.arange(system.T, device=dev))
        state.stats = {"window": self.size(system)}
        # the first position each sample froze on an estimate (T: none)
        state.estimated_from = torch.full((B,), system.T, dtype=torch.long, device=dev)
        state.gain = lambda: _residual_gain(system)
        state.premise = lambda: _premise(system)
        # positions are certified by reasoning (their inputs were final) or on an estimate,
        # with the window's values: one evaluation of fn at the end checks them
        # (paraprop.solvers.verify), within the budget of T calls
        state.verified = False

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        e: _SlidingState = state.own
        if system.evaluations == system.T - 1:
            # the budget's last call (every sweep made one more position final, so only the
            # last position is left): one evaluation of fn checks the value and gives it
            final_step(system, state, tol, norm)
            e.final = torch.full_like(e.final, system.T)
            return
        final, T = e.final, system.T
        act = state.active
        start = e.start
        stop = min(T, start + self.size(system))
        n = stop - start
        pos = e.index[start:stop]
        vals = system.window(state.x, start, stop)
        old = state.x[:, start:stop]
        # the first writable position of each sample is computed from final inputs only
        vals, kept = system.keep_finite(vals, old, final, pos, act, x=state.x)
        # only positions that are not final yet (recomputing a final one may differ by
        # rounding); a sample that is done has final = T, so none of its positions is
        writable = pos[None, :] >= final[:, None]                           # (B, n)
        new = torch.where(writable[:, :, None], vals, old)
        d = (new - old).abs_()
        d_pos = (d.amax(dim=2) if norm == "max" else d.pow(2).sum(2).sqrt()).to(torch.float64)
        if kept is not None:  # a kept value did not come from its inputs: it counts as moved
            d_pos = torch.where(kept & writable, torch.inf, d_pos)
        old.copy_(new)

        # certified: the first writable position, plus a leading run of unchanged ones, plus
        # one (the positions before the first writable one are unchanged, d_pos = 0)
        cs = d_pos.cumsum(1)
        lead = (cs == 0).sum(1)                           # leading unchanged positions
        exact_to = (lead + 1).clamp(max=n)
        new_final = start + exact_to
        if tol > 0:
            new_final = new_final + self._freeze(system, state, start, stop, d_pos, cs,
                                                 writable, exact_to, new_final, tol, norm)
        # (at most stop: a sample that is done keeps final = T)
        e.final = torch.maximum(final, new_final)
        state.sample_iterations += act
        state.active = e.final < T
        state.residual = d_pos.max() if n else 0.0
        # the iteration's one synchronisation: where the next window starts (T: done)
        e.start = int(e.final.min())
        state.finished = e.start >= T
        if not state.finished:
            guess = system.propose(state.x, e.final, e.start)
            if guess is not None:
                system.check_finite(guess, hook="propose")
                free = e.index[None, :] >= e.final[:, None]
                state.x.copy_(torch.where(free[:, :, None], guess, state.x))

    def _freeze(self, system, state, start, stop, d_pos, cs, writable, shift, new_final, tol,
                norm):
        """``(B,)``: how many positions after the certified ones may be frozen at ``tol > 0``
        (see the module doc); logs each freeze's estimate in ``stats["freeze_estimates"]``."""
        T, n = system.T, stop - start
        act = state.active
        log = state.stats.get("freeze_estimates")
        if log is None:
            log = state.stats["freeze_estimates"] = torch.zeros(
                system.B, T, dtype=torch.float64, device=d_pos.device)
        # A position computed from inputs with errors e_i has an error <= max_i e_i when the
        # map does not expand differences; the input errors are at most the changes of the
        # sweep plus the new values' own errors, so error(x_new[j]) <= sum_{i<j} d_i over
        # the non-final positions (the final ones have d = 0).
        est = cs - d_pos
        sens = _hook_tensor(system, "sensitivity")
        if sens is not None:
            # fn states how much a change at position i moves the later positions (lam_i):
            # error(x_new[j]) <= sum_{i<j} lam_i (d_i + error(x_new[i])), which solves to
            # sum_{i<j} lam_i d_i / (1 - sum_{i<j} lam_i) while that sum is below 1
            lam = sens[:, start:stop].to(est.dtype)
            lam = torch.where(lam.isnan(), torch.ones_like(lam), lam)
            lam = torch.where(writable, lam, torch.zeros_like(lam))
            wsum = (lam * d_pos).cumsum(1) - lam * d_pos
            total = lam.cumsum(1) - lam
            tight = torch.where(total < 1, wsum / (1 - total), torch.inf)
            est = torch.minimum(est, tight)
        ar, thresholds = _ramp(state.own, n, tol, T, d_pos.device)
        at = ar + shift[:, None]                 # the candidates, from the first one not final
        raw = est.gather(1, at.clamp(max=n - 1)).masked_fill_(at >= n, float("inf"))
        # a value computed from inputs within est of the sequential ones is within est plus
        # the rounding of both (paraprop.solvers.rounding.rounding_floor), at the scale of that
        # position's own values
        vals = state.x[:, start:stop]
        eps = torch.finfo(vals.dtype).eps
        if norm == "max":
            floor = half_ulp_bound(vals.abs().amax(dim=2).to(torch.float64), vals.dtype)
        else:
            floor = torch.linalg.vector_norm(vals.to(torch.float64), dim=2) * eps
        cand = (raw + floor.gather(1, at.clamp(max=n - 1))) / (1 - eps / 2)
        growth = _hook_tensor(system, "growth")
        if growth is not None:
            # fn says how much an error at each position grows by the end of the chain:
            # a freeze must fit its share after that growth
            g = growth.gather(1, new_final.clamp(max=T - 1)[:, None]).to(cand.dtype)
            # (at least 1: the certificate bounds every position's error, not only the last
            # one's, so a chain that shrinks errors does not enlarge a freeze's share)
            cand = cand * g.clamp(min=1)
        m = freeze_budget(cand, tol, T, thresholds)
        if m.device.type == "cpu" and not bool(m.any()):   # no freeze (known on the host)
            return m
        froze = act & (m > 0)
        frm = state.estimated_from
        state.estimated_from = torch.where(froze, torch.minimum(frm, new_final), frm)
        block = ar < m[:, None]
        worst = torch.where(block, raw, torch.zeros_like(raw)).amax(1)
        worst = torch.where(froze, worst, 0.0)
        state.estimate = state.estimate + torch.where(
            froze, torch.where(block, cand, torch.zeros_like(cand)).amax(1), 0.0)
        # where each freeze began and its estimate: a caller that knows how errors grow along
        # its map can propagate them (paraprop.diffusion does)
        log.scatter_add_(1, new_final.clamp(max=T - 1)[:, None], worst[:, None])
        return m


def _ramp(e: _SlidingState, n: int, tol: float, T: int, device
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``arange(n)`` ``(1, n)`` and the freeze thresholds of :func:`freeze_budget` for ``n``
    candidates, made once per window length of a solve."""
    cache = e.ramps
    if n not in cache:
        cache[n] = (torch.arange(n, device=device)[None, :],
                    freeze_thresholds(n, tol, T, device))
    return cache[n]


def _residual_gain(system: System) -> torch.Tensor | None:
    """``(B, T)``: how much a position may move per unit change of the positions before it,
    as the map's statements allow, for the final check at ``tol > 0``
    (:mod:`paraprop.solvers.verify`): 1 (the plain estimate's premise, a map that does not
    expand differences), or more where ``fn.sensitivity`` (the sum of the stated
    sensitivities of the earlier positions) or ``fn.growth`` (the gain of the step,
    ``growth[t - 1] / growth[t]``) say so; infinite where they say nothing finite."""
    sens = _hook_tensor(system, "sensitivity")
    growth = _hook_tensor(system, "growth")
    if sens is None and growth is None:
        return None
    # bounds of sizes: a negative one (or a growth of 0) is no bound at all
    for name, v, low in (("sensitivity", sens, "< 0"), ("growth", growth, "<= 0")):
        if v is not None:
            bad = v < 0 if name == "sensitivity" else v <= 0
            if bool(bad.any()):
                b, t = (int(i) for i in bad.nonzero()[0])
                raise ProtocolError(
                    f"{HOOKS[name]} must state upper bounds of sizes (NaN where unknown), got "
                    f"{float(v[b, t]):.3g} {low} at position {system.unravel_position(t)} of "
                    f"sample {system.unravel_sample(b)}")
    ref = sens if sens is not None else growth
    L = torch.ones(system.B, system.T, dtype=torch.float64, device=ref.device)
    if sens is not None:
        lam = sens.to(torch.float64)
        lam = torch.where(lam.isnan(), torch.ones_like(lam), lam)
        L = torch.maximum(L, lam.cumsum(1) - lam)
    if growth is not None:
        g = growth.to(torch.float64)
        step = torch.ones_like(L)
        step[:, 1:] = g[:, :-1] / g[:, 1:]
        L = torch.maximum(L, torch.nan_to_num(step, nan=torch.inf))
    return torch.nan_to_num(L, nan=torch.inf)


def _premise(system: System) -> str:
    """What the freeze estimates rely on, for the final check's message."""
    stated = [HOOKS[h] for h in ("sensitivity", "growth")
              if getattr(system.fn, h, None) is not None]
    plain = "a map that does not expand differences between positions"
    if not stated:
        return f"{plain} (state fn.growth for one that does)"
    verb = "states" if len(stated) == 1 else "state"
    return f"{plain}, or where tighter the bounds that {' and '.join(stated)} {verb}"


def _hook_tensor(system: System, name: str) -> torch.Tensor | None:
    """``fn.sensitivity`` or ``fn.growth`` as ``(B, T)``, ``None`` where ``fn`` states none;
    anything else breaks the hook's promise (:mod:`paraprop.solvers.protocols`)."""
    value = getattr(system.fn, name, None)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.numel() != system.B * system.T or \
            not value.is_floating_point():
        got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
               if isinstance(value, torch.Tensor) else type(value).__name__)
        raise ProtocolError(f"{HOOKS[name]} must be None or a floating-point tensor of "
                            f"batch x positions = {system.B} x {system.T} values, got {got}")
    return value.reshape(system.B, system.T)
