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
  fits the freeze's share ``tol * m / T`` of the tolerance: the solver's ``freeze`` rule
  (:class:`~paraprop.solvers.freezing.FreezeRule`) bounds their errors, by default from the
  sweep's changes for a map that does not expand differences, tighter or larger where a
  sensitivity or the error growth along the chain is stated (to the rule, or by the map's hooks
  ``fn.sensitivity`` and ``fn.growth``); for expanding maps state the growth or use ``tol=0``.
  (:func:`paraprop.diffusion.sample` uses a rule of its own on top:
  :class:`paraprop.diffusion.GainCertificate` carries the trajectory's defects through the gains
  it observes.)

Before each sweep ``fn.propose(x, final)``, when ``fn`` has it, may return new guesses for the
positions that are not final (``final`` ``(B,)``: positions below it are); the result does not
depend on them (Jacobi decoding takes n-gram guesses this way).

``fn`` computes only the window through ``fn.window(x, start, stop, cache)`` (the cached-prefix
protocol of :meth:`paraprop.solvers.triangular.System.window`) or ``fn.update(x, index)``; otherwise
each sweep evaluates every position and keeps the window's.

**Batches** (``B > 1`` samples). ``advance="minimum"`` (default): one window
``[start, start + window)`` from the least final position ``start`` of the samples still
iterating, so the batch advances with its slowest sample. ``advance="per-sample"``: each sample
iterates its own window ``[final_b, final_b + window)``; the sweep computes the smallest block
that holds them all, ``[start, max_b(final_b + window))``, cut at ``span`` positions (default
``2 * window``), and writes every position of a sample from its ``final_b`` to the block's end.
That is Jacobi on a window of each sample that is longer than ``window`` where another sample
is ahead, so the certificate (first writable position, its leading unchanged run, plus one) and
the ``T``-sweep bound are unchanged, and ``tol=0`` gives the sequential result; what is paid is
the block's width (a sample behind computes the positions up to the leader's window end, a
sample ahead recomputes its final positions from ``start``: kept, not written). For a map whose
cost is per position computed, the minimum is cheaper; for one that computes a rectangular block
per pass anyway (:func:`paraprop.decoding.generate` with one key/value cache), per-sample lets
the fast samples keep going.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from paraprop import checks
from paraprop.solvers.base import State
from paraprop.solvers.freezing import FreezeRule, Ramp
from paraprop.solvers.triangular import System
from paraprop.solvers.verify import final_step
from paraprop.stopping import freeze_thresholds


@dataclass(slots=True)
class _SlidingState:
    final: torch.Tensor       # (B,) long: positions < final are final
    index: torch.Tensor       # arange(T)
    start: int = 0            # the smallest final of the samples still iterating (on the host)
    stop: int = 0             # the end of the next sweep's block (on the host)
    # at tol > 0 under the default freeze premise: each position's change in its last sweep
    # (B, T) float64 (NaN: not computed by a sweep since), and each sample's largest gain
    # observed between two sweeps (B,) (0: none yet) (FreezeRule.freeze's measured gains)
    changes: torch.Tensor | None = None
    top_gain: torch.Tensor | None = None
    # per window length n: arange(n) (1, n) and the freeze thresholds (see _ramp)
    ramps: dict[int, Ramp] = field(default_factory=dict)


class SlidingJacobi:
    """Jacobi over a sliding window of ``window`` positions (see the module doc).

    Arguments:
        window: positions iterated at once (``None``: 64); ``1`` is sequential evaluation,
            ``T`` is Jacobi restricted to the positions not yet final.
        freeze: the freeze accounting at ``tol > 0`` (``None``: :class:`FreezeRule` ``()``,
            which reads the map's ``fn.growth`` and ``fn.sensitivity``).
        advance: how a batch of samples moves (see the module doc): ``"minimum"`` (one window
            from the least final position) or ``"per-sample"`` (each sample's own window, in
            one block at most ``span`` wide).
        span: the widest block of ``advance="per-sample"`` (``None``: twice the window; at
            least the window).

    Counters: ``stats["positions"]`` (positions computed), ``iterations`` (parallel sweeps) and
    ``stats["advance"]``.
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

    ADVANCES = ("minimum", "per-sample")

    def __init__(self, window: int | None = None, freeze: FreezeRule | None = None, *,
                 advance: str = "minimum", span: int | None = None):
        self.window = checks.positive_int("SlidingJacobi: window", window, allow_none=True)
        if not isinstance(advance, str) or advance not in self.ADVANCES:
            raise ValueError(f"SlidingJacobi: advance must be one of "
                             f"{', '.join(map(repr, self.ADVANCES))}, got {advance!r}")
        self.advance = advance
        self.span = checks.positive_int("SlidingJacobi: span", span, allow_none=True)
        if span is not None and advance != "per-sample":
            raise ValueError(f"SlidingJacobi: span (the widest block of advance='per-sample') "
                             f"applies to advance='per-sample' only, got span={span!r} with "
                             f"advance={advance!r}")
        if span is not None and window is not None and span < window:
            raise ValueError(f"SlidingJacobi: span must be at least the window ({window}), got "
                             f"{span}")
        if freeze is not None and not isinstance(freeze, FreezeRule):
            raise TypeError(f"SlidingJacobi: freeze must be a paraprop.solvers.FreezeRule or "
                            f"None, got {type(freeze).__name__}")
        self.freeze = FreezeRule() if freeze is None else freeze

    def __repr__(self) -> str:
        extra = ""
        if self.freeze.growth is not None or self.freeze.sensitivity is not None:
            extra += f", freeze={self.freeze!r}"
        if self.advance != "minimum":
            extra += f", advance={self.advance!r}"
        if self.span is not None:
            extra += f", span={self.span!r}"
        return f"SlidingJacobi(window={self.window!r}{extra})"

    def size(self, system: System) -> int:
        return min(self.window or self.DEFAULT_WINDOW, system.T)

    def widest(self, system: System) -> int:
        """The widest block a sweep computes: the window, or with ``advance="per-sample"``
        ``span`` (default twice the window)."""
        w = self.size(system)
        if self.advance == "minimum":
            return w
        return min(system.T, max(w, self.span if self.span is not None else 2 * w))

    def bound(self, system: System) -> int:
        return system.T

    def init(self, system: System, state: State) -> None:
        if self.span is not None and self.span < self.size(system):
            # (a window given was checked at construction; this is the default one's)
            raise ValueError(f"SlidingJacobi: span must be at least the window "
                             f"({self.size(system)}), got {self.span}")
        B = system.B
        dev = state.x.device
        state.own = _SlidingState(torch.zeros(B, dtype=torch.long, device=dev),
                                  torch.arange(system.T, device=dev))
        state.stats = {"window": self.size(system), "advance": self.advance}
        e = state.own
        e.stop = min(system.T, self.size(system))
        # the first position each sample froze on an estimate (T: none)
        state.estimated_from = torch.full((B,), system.T, dtype=torch.long, device=dev)
        state.gain = lambda: self.freeze.residual_gain(system)
        state.premise = lambda: self.freeze.premise(system)
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
        start, stop = e.start, e.stop
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
            ramp = _ramp(e, n, tol, T, d_pos.device)
            gains = None
            if self.freeze.measures(system):
                gains = _observe(e, state.x, start, stop, d_pos, writable, norm)
            new_final = new_final + self.freeze.freeze(system, state, start, stop, d_pos, cs,
                                                       writable, exact_to, new_final, tol, norm,
                                                       ramp, gains)
        # (at most stop: a sample that is done keeps final = T)
        e.final = torch.maximum(final, new_final)
        state.sample_iterations += act
        state.active = e.final < T
        state.residual = d_pos.max() if n else 0.0
        # the iteration's one synchronisation: where the next window starts (T: done) and,
        # per sample, where it ends
        w = self.size(system)
        if self.advance == "minimum" or e.final.shape[0] == 1:
            e.start = int(e.final.min())
            e.stop = min(T, e.start + w)
        else:
            lead = torch.where(state.active, e.final, -1).max()
            e.start, top = (int(v) for v in torch.stack([e.final.min(), lead]).tolist())
            e.stop = min(T, top + w, e.start + self.widest(system))
        state.finished = e.start >= T
        if not state.finished:
            guess = system.propose(state.x, e.final, e.start)
            if guess is not None:
                system.check_finite(guess, hook="propose")
                free = e.index[None, :] >= e.final[:, None]
                state.x.copy_(torch.where(free[:, :, None], guess, state.x))

def _observe(e: _SlidingState, x: torch.Tensor, start: int, stop: int, d_pos: torch.Tensor,
             writable: torch.Tensor, norm: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gains of the window's positions observed between this sweep and the last one that
    computed them: ``g_t = |fn(x)_t - fn(x')_t| / |x_{t-1} - x'_{t-1}|`` (this sweep's change at
    ``t`` over the last one's at ``t - 1``), where both positions were computed by the last
    sweep and that change is above the rounding level (NaN elsewhere); returns ``(g, top)``:
    ``g`` ``(B, n)``, ``top`` ``(B,)`` each sample's largest gain observed so far (0: none).
    Records this sweep's changes for the next."""
    B, T = d_pos.shape[0], x.shape[1]
    if e.changes is None:
        e.changes = torch.full((B, T), float("nan"), dtype=torch.float64, device=d_pos.device)
        e.top_gain = torch.zeros(B, dtype=torch.float64, device=d_pos.device)
    assert e.top_gain is not None
    prev = e.changes[:, start:stop]
    before = e.changes[:, max(start - 1, 0):stop - 1]
    if start == 0:   # position 0 reads no other position
        before = torch.cat([torch.full_like(prev[:, :1], float("nan")), before], dim=1)
    # a change within 4 units of the dtype at the input position's own scale is rounding: it
    # measures no gain
    eps = torch.finfo(x.dtype).eps
    lo = max(start - 1, 0)
    scale = x[:, lo:stop - 1].abs().amax(2).to(torch.float64) if stop - 1 > lo else \
        torch.zeros(B, 0, dtype=torch.float64, device=x.device)
    if start == 0:
        scale = torch.cat([torch.zeros(B, 1, dtype=torch.float64, device=x.device), scale],
                          dim=1)
    noise = 4 * eps * scale.clamp(min=1e-300) * (1.0 if norm == "max" else
                                                  math.sqrt(x[0, 0].numel()))
    seen = writable & ~prev.isnan() & (before > noise)
    g = torch.where(seen, d_pos / torch.where(seen, before, 1.0), float("nan"))
    if g.shape[1]:
        e.top_gain = torch.fmax(e.top_gain, torch.nan_to_num(g, nan=0.0).amax(1))
    e.changes[:, start:stop] = torch.where(writable, d_pos, float("nan"))
    return g, e.top_gain


def _ramp(e: _SlidingState, n: int, tol: float, T: int, device) -> Ramp:
    """``arange(n)`` ``(1, n)`` and the freeze thresholds of :func:`freeze_budget` for ``n``
    candidates, made once per window length of a solve."""
    cache = e.ramps
    if n not in cache:
        cache[n] = (torch.arange(n, device=device)[None, :],
                    freeze_thresholds(n, tol, T, device))
    return cache[n]
