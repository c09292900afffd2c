"""How a sliding window freezes positions before they are final: :class:`FreezeRule`.

After a sweep, :class:`~paraprop.solvers.SlidingJacobi` knows some positions exact (computed from
final inputs). At ``tol > 0`` it may also freeze the next ``m`` positions when their error bound
fits the freeze's share ``tol * m / T`` of the tolerance, so that all freezes together stay within
``tol`` (:func:`~paraprop.stopping.freeze_budget`). The bound of a position is the sum of the
sweep's changes at the non-final positions before it (a map that does not expand differences,
``|f_j(x) - f_j(y)| <= max_{i<j} |x_i - y_i|``), or, where the rule knows more:

* ``sensitivity`` ``(B, T)``: how much a change at position ``i`` moves the later positions
  (``lam_i``); the bound is ``sum_{i<j} lam_i d_i / (1 - sum_{i<j} lam_i)`` where smaller;
* ``growth`` ``(B, T)``: how much an error at a position grows by the end of the chain; a freeze
  must fit its share after that growth.

Where neither is stated, the rule measures: :class:`~paraprop.solvers.SlidingJacobi` passes the
gains observed between sweeps (a position's change over the last sweep's change of the position
before it), which the estimate and the growth after a freeze take where above 1 (no freeze on an
estimate before one is observed): a map that expands differences without saying so (an
accumulating map from a warm start: 1.39x ``tol`` under the plain premise) is seen.

Both come from the rule's arguments, else from the map's hooks ``fn.sensitivity`` and
``fn.growth`` (:mod:`paraprop.solvers.protocols`), so any chain whose error growth is known can
state it, as a hook of its own or to the solver. The final check of the solve
(:mod:`paraprop.solvers.verify`) verifies what the freezes assumed, with the gain the rule states
(:meth:`FreezeRule.residual_gain`).
"""

from __future__ import annotations

import torch

from paraprop.errors import ProtocolError
from paraprop.solvers.base import State
from paraprop.solvers.protocols import HOOKS
from paraprop.solvers.rounding import half_ulp_bound
from paraprop.solvers.triangular import System
from paraprop.stopping import freeze_budget

# arange(n) (1, n) and the freeze thresholds of freeze_budget for n candidates
Ramp = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class FreezeRule:
    """The freeze accounting of :class:`~paraprop.solvers.SlidingJacobi` at ``tol > 0`` (see the
    module doc).

    Arguments:
        growth: ``None`` (the map's ``fn.growth``, if any) or a floating-point tensor of
            ``B * T`` values: how much an error at each position grows by the end of the chain
            (an upper bound; NaN where unknown).
        sensitivity: ``None`` (the map's ``fn.sensitivity``, if any) or a floating-point tensor
            of ``B * T`` values: how much a change at each position moves the later ones.

    Example:
        >>> W = torch.randn(16, 16).tril(-1) * 0.3
        >>> fn = lambda x: 2 * torch.tanh(x @ W.T + 1)   # expands differences up to 2x a step
        >>> rule = paraprop.solvers.FreezeRule(growth=2.0 ** torch.arange(16.0).flip(0))
        >>> sol = paraprop.solve(fn, torch.zeros(16), tol=1e-4,
        ...                      method=paraprop.solvers.SlidingJacobi(4, freeze=rule))
        >>> ref = paraprop.solve(fn, torch.zeros(16), method="sequential")
        >>> bool((sol.value - ref.value).abs().max() <= 1e-4)
        True
    """

    def __init__(self, growth: torch.Tensor | None = None,
                 sensitivity: torch.Tensor | None = None):
        for name, v in (("growth", growth), ("sensitivity", sensitivity)):
            if v is not None and not (isinstance(v, torch.Tensor) and v.is_floating_point()):
                got = f"a {v.dtype} tensor" if isinstance(v, torch.Tensor) else type(v).__name__
                raise TypeError(f"FreezeRule: {name} must be None or a floating-point tensor "
                                f"of batch x positions values, got {got}")
        self.growth = growth
        self.sensitivity = sensitivity

    def __repr__(self) -> str:
        said = [n for n in ("growth", "sensitivity") if getattr(self, n) is not None]
        return f"FreezeRule({', '.join(f'{n}=...' for n in said)})"

    def measures(self, system: System) -> bool:
        """Whether the freezes rest on gains measured along the sweeps: neither the rule nor
        the map states a sensitivity or a growth (the default premise)."""
        return self._given(system, "sensitivity") is None and \
            self._given(system, "growth") is None

    def freeze(self, system: System, state: State, start: int, stop: int, d_pos: torch.Tensor,
               cs: torch.Tensor, writable: torch.Tensor, shift: torch.Tensor,
               new_final: torch.Tensor, tol: float, norm: str,
               ramp: Ramp, gains: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> torch.Tensor:
        """``(B,)``: how many positions after the certified ones the window ``[start, stop)``
        may freeze at ``tol > 0`` (see the module doc), from the sweep's changes ``d_pos``
        ``(B, n)`` (``cs`` their cumulative sums), the positions still ``writable``, the
        certified ones (``shift`` from ``start``, ``new_final`` absolute) and ``ramp``:
        ``arange(n)`` ``(1, n)`` and :func:`~paraprop.stopping.freeze_thresholds` for ``n``.
        Adds each freeze's estimate to ``state.estimate`` and marks ``state.estimated_from``.
        ``gains`` (where :meth:`measures`): the window's gains observed between sweeps ``(B,
        n)`` (NaN: not observed) and each sample's largest ``(B,)``, which the estimate and
        the error growth after a freeze take where above 1."""
        T, n = system.T, stop - start
        act = state.active
        # A position computed from inputs with errors e_i has an error <= max_i e_i when the
        # map does not expand differences; the input errors are at most the changes of the
        # sweep plus the new values' own errors, so error(x_new[j]) <= sum_{i<j} d_i over
        # the non-final positions (the final ones have d = 0).
        est = cs - d_pos
        if gains is not None:
            # the gains observed along the sweeps, where above 1 (a map that expands
            # differences; unobserved: the sample's largest): error(x_new[j]) <= g_j
            # (d_{j-1} + error(x_new[j-1])), so E_j = G_j sum_{i<j} d_i / G_i with G the
            # running product of the gains
            g, top = gains
            g = torch.where(g.isnan(), top[:, None], g).clamp(min=1.0)
            G = g.cumprod(1)
            w = d_pos / G
            est = torch.maximum(est, G * (w.cumsum(1) - w))
        sens = self._sizes(system, "sensitivity")
        if sens is not None:
            # the rule (or fn) states how much a change at position i moves the later
            # positions (lam_i):
            # error(x_new[j]) <= sum_{i<j} lam_i (d_i + error(x_new[i])), which solves to
            # sum_{i<j} lam_i d_i / (1 - sum_{i<j} lam_i) while that sum is below 1
            lam = sens[:, start:stop].to(est.dtype)
            lam = torch.where(lam.isnan(), torch.ones_like(lam), lam)
            lam = torch.where(writable, lam, torch.zeros_like(lam))
            wsum = (lam * d_pos).cumsum(1) - lam * d_pos
            total = lam.cumsum(1) - lam
            tight = torch.where(total < 1, wsum / (1 - total), torch.inf)
            est = torch.minimum(est, tight)
        ar, thresholds = ramp
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
        growth = self._sizes(system, "growth")
        if gains is not None:
            # an error frozen at a position grows by the largest gain observed (at least 1)
            # at every later position, to the end of the chain
            # (no gain observed yet, before a second sweep of the window: no freeze on an
            # estimate)
            seen = gains[1] > 0
            top = gains[1].clamp(min=1.0)
            left = (T - 1 - new_final.clamp(max=T - 1)).to(torch.float64)
            grow = torch.where(seen, torch.exp(left * top.log()), torch.inf)
            cand = cand * grow[:, None].to(cand.dtype)
        elif growth is not None:
            # the rule (or fn) says how much an error at each position grows by the end of
            # the chain: a freeze must fit its share after that growth
            g = growth.gather(1, new_final.clamp(max=T - 1)[:, None]).to(cand.dtype)
            # (at least 1: the certificate bounds every position's error, not only the last
            # one's, so a chain that shrinks errors does not enlarge a freeze's share)
            cand = cand * g.clamp(min=1)
        m = freeze_budget(cand, tol, T, thresholds)
        if m.device.type == "cpu" and not bool(m.any()):   # no freeze (known on the host)
            return m
        froze = act & (m > 0)
        frm = state.estimated_from
        assert frm is not None   # (made by SlidingJacobi.init)
        state.estimated_from = torch.where(froze, torch.minimum(frm, new_final), frm)
        block = ar < m[:, None]
        state.estimate = state.estimate + torch.where(
            froze, torch.where(block, cand, torch.zeros_like(cand)).amax(1), 0.0)
        return m

    def residual_gain(self, system: System) -> torch.Tensor | None:
        """``(B, T)``: how much a position may move per unit change of the positions before it,
        as the map's statements allow, for the final check at ``tol > 0``
        (:mod:`paraprop.solvers.verify`): 1 (the plain estimate's premise, a map that does not
        expand differences), or more where ``fn.sensitivity`` (the sum of the stated
        sensitivities of the earlier positions) or ``fn.growth`` (the gain of the step,
        ``growth[t - 1] / growth[t]``) say so; infinite where they say nothing finite."""
        sens = self._sizes(system, "sensitivity")
        growth = self._sizes(system, "growth")
        if sens is None and growth is None:
            return None
        # bounds of sizes: a negative one (or a growth of 0) is no bound at all
        for name, v, low in (("sensitivity", sens, "< 0"), ("growth", growth, "<= 0")):
            if v is not None:
                bad = v < 0 if name == "sensitivity" else v <= 0
                if bool(bad.any()):
                    b, t = (int(i) for i in bad.nonzero()[0])
                    raise self._error(name)(
                        f"{self._label(name)} must state upper bounds of sizes (NaN where "
                        f"unknown), got "
                        f"{float(v[b, t]):.3g} {low} at position {system.unravel_position(t)} of "
                        f"sample {system.unravel_sample(b)}")
        ref = sens if sens is not None else growth
        assert ref is not None
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

    def premise(self, system: System) -> str:
        """What the freeze estimates rely on, for the final check's message."""
        stated = [self._label(h) for h in ("sensitivity", "growth")
                  if self._given(system, h) is not None]
        plain = "a map that does not expand differences between positions"
        if not stated:
            return f"{plain} (state fn.growth, or FreezeRule(growth=...), for one that does)"
        verb = "states" if len(stated) == 1 else "state"
        return f"{plain}, or where tighter the bounds that {' and '.join(stated)} {verb}"

    def _sizes(self, system: System, name: str) -> torch.Tensor | None:
        """The rule's ``growth`` or ``sensitivity`` (else ``fn``'s hook of that name) as
        ``(B, T)``, ``None`` where neither states one; anything else is refused (a hook's: it
        breaks its promise, :mod:`paraprop.solvers.protocols`)."""
        value = self._given(system, name)
        if value is None:
            return None
        if not isinstance(value, torch.Tensor) or value.numel() != system.B * system.T or \
                not value.is_floating_point():
            got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                   if isinstance(value, torch.Tensor) else type(value).__name__)
            raise self._error(name)(
                f"{self._label(name)} must be None or a floating-point tensor of batch x "
                f"positions = {system.B} x {system.T} values, got {got}")
        return value.reshape(system.B, system.T)

    def _given(self, system: System, name: str):
        own = self.growth if name == "growth" else self.sensitivity
        return own if own is not None else getattr(system.fn, name, None)

    def _label(self, name: str) -> str:
        own = self.growth if name == "growth" else self.sensitivity
        return HOOKS[name] if own is None else f"FreezeRule({name}=...)"

    def _error(self, name: str) -> type[ValueError]:
        own = self.growth if name == "growth" else self.sensitivity
        return ProtocolError if own is None else ValueError
