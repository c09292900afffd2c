"""Stopping rules that bound the error, not the last step.

A rule that stops when the last step is small (``||x_k - x_{k-1}|| <= tol``) is wrong for maps
that accumulate small steps: on ``h_t = h_{t-1} + tanh(W h_{t-1} + b) / T`` every Jacobi sweep
moves the iterate by about ``1 / T``, so that rule stops after one sweep with an error of almost
the whole answer. paraprop's rules estimate the distance to the exact (sequential) solution:

* **Contraction estimate** (Jacobi family; quasi-Newton and the damped methods on their steps).
  With ``d_k = ||x_k - x_{k-1}||`` and the observed rate ``q``, the largest of the last
  :data:`RATES` ratios ``d_j / d_{j-1}``, an iteration that contracts by ``q < 1`` is within
  ``q / (1 - q) * d_k`` of its fixed point. Three ratios, not one or two: Jacobi on a triangular
  map that expands differences (a flow inverse with large scales) shows transient growth, a
  step that drops 40x in one sweep and grows 7x in the next, while the error barely moves
  (``tests/test_tarflow.py``, ``test_expanding_block_stops_within_tol``); the estimate is still
  an estimate, and ``tol=0`` or the windowed methods' growth budgets are the tools for maps
  that expand strongly. A sample stops when that estimate and ``d_k`` itself
  are ``<= tol``, or when ``d_k == 0`` (a bitwise fixed point of a triangular system is its
  unique solution). A map that accumulates small steps has ``q ~ 1`` and never stops early: it
  runs to the exactness bound, where the value is the sequential result.
* **Newton step** (exact Newton): the step ``delta = (I - J)^{-1} r`` is the linearised error of
  the iterate, accumulation included, and the new iterate's error is far below it
  (quadratic convergence). A sample stops when ``||delta|| <= tol``.
* **Exact prefix** (all of them): after ``k`` iterations the first positions are exact by the
  triangular structure (Song et al. 2021, Prop. 1-2); at the bound everything is.

All of them add the rounding floor of the dtype (one unit in the last place at the values' scale:
what two evaluations from inputs within rounding of each other can differ by) and ignore ratios
over steps at the rounding level (:class:`ContractionRule`): in bf16 and fp16 a ``tol`` below the
floor is certified only by a bitwise fixed point or the exactness bound.

Windowed methods freeze positions before the whole sample is done. Each freeze may introduce its
error estimate into the positions after it, so a freeze of ``m`` of the ``T`` positions is allowed
only with an estimate ``<= tol * m / T``: the errors added by all freezes sum to at most ``tol``
when the map does not amplify errors along the sequence.
"""

from __future__ import annotations

import torch

__all__ = ["NOISE", "RATES", "ContractionRule", "freeze_budget"]

RATES = 3  # ratios d_j / d_{j-1} the contraction estimate takes the largest of
NOISE = 4  # a step within this many rounding floors is rounding noise (no ratio)

class ContractionRule:
    """Per-sample contraction estimate over successive differences ``d_k`` (shape ``(B,)``).

    Call :meth:`update` once per iteration with the new differences of the samples that iterated;
    it returns ``(stop, estimate)``: which samples may stop, and the estimated error of each.

    **Rounding.** In floating point the iteration is ``x_{k+1} = fl(f(x_k))`` and the sequential
    result ``x* = fl(f(x*))``; two evaluations from inputs within ``e`` of each other differ by
    up to ``q e`` plus a rounding flip ``r`` (one unit in the last place at the values' scale,
    the ``floor``). So ``|x_k - x*| <= (q d_k + r) / (1 - q)``, and that is the estimate. A step
    ``d_{j-1} <= NOISE * r`` is rounding noise: a ratio over it says nothing about contraction
    (an accumulating map moving one unit in the last place per sweep shows ratios near 1 or
    anything else), so it counts as no contraction, and such a sample does not stop early on it
    (it goes on to a bitwise fixed point or the exactness bound). A ``tol`` below the floor can
    only be met bitwise; :attr:`blocked` records the largest floor that kept a sample from
    stopping, for the message when ``max_iters`` ends the solve first.
    """

    def __init__(self, B: int, device, dtype=torch.float64):
        nan = torch.full((B,), float("nan"), dtype=dtype, device=device)
        self.d_prev = nan                  # d_{k-1}
        # the previous RATES - 1 ratios d_j / d_{j-1} (0 before they exist) and their
        # denominators d_{j-1} (inf before they exist: a missing ratio restricts nothing), in
        # a ring written in place; only their maximum is read, so their order does not matter
        self.q_prev = torch.zeros(RATES - 1, B, dtype=dtype, device=device)
        self.den_prev = torch.full((RATES - 1, B), float("inf"), dtype=dtype, device=device)
        self._slot = 0
        # the largest rounding floor that kept a sample from stopping (0: none did)
        self.blocked = torch.zeros((), dtype=dtype, device=device)

    def reset(self) -> None:
        """Forget the history: a new problem starts (the next block of GS-Jacobi)."""
        self.d_prev.fill_(float("nan"))
        self.q_prev.zero_()
        self.den_prev.fill_(float("inf"))

    def _record(self, d, q, den, active) -> None:
        i = self._slot
        self._slot = (i + 1) % (RATES - 1)
        torch.where(active, torch.nan_to_num(q, nan=0.0), self.q_prev[i], out=self.q_prev[i])
        torch.where(active, den, self.den_prev[i], out=self.den_prev[i])
        torch.where(active, d, self.d_prev, out=self.d_prev)

    def update(self, d: torch.Tensor, tol: float, active: torch.Tensor,
               budget: float | None = None, rate: torch.Tensor | None = None,
               floor=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Record ``d`` (``(B,)``) for the ``active`` samples; return ``(stop, estimate)``.

        ``budget`` (default ``tol``) is the bound the estimate must meet; ``d`` itself must also
        be ``<= tol``. A change at the rounding level is a change: even one unit in the last
        place per step accumulates (``tests/test_faults_solve.py``).

        ``rate`` (``(B,)``, optional) is the observed contraction of the map itself,
        ``||fn(x_k) - fn(x_{k-1})|| / ||x_k - x_{k-1}||`` with ``||x_k - x_{k-1}||`` the
        previous ``d``, for methods whose iterates are not ``fn``'s own (Anderson); ``d`` is
        then the residual ``||fn(x_k) - x_k||``, and the estimate bounds the error of
        ``fn(x_k)``. Without it the rate is ``d_k / d_{k-1}``.

        ``floor`` (``(B,)`` float64, or a callable returning it, evaluated only when a sample
        may stop): the rounding floor of the values (:func:`paraprop.solvers.base.rounding_floor`;
        ``None``: exact arithmetic). A ratio whose denominator is within :data:`NOISE` floors
        is rounding noise and gives no estimate.
        """
        d = d.to(self.d_prev.dtype)
        den = self.d_prev
        q_now = d / den if rate is None else rate.to(d.dtype)
        small = d <= tol
        # no sample can stop: record and go on (on a CPU the test is free and saves the
        # estimate; on an accelerator it would cost a synchronisation, so it is skipped there)
        if d.device.type == "cpu" and not bool((small & active).any()):
            self._record(d, q_now, den, active)
            return torch.zeros_like(active), torch.full_like(d, float("inf"))
        r = floor() if callable(floor) else floor
        r = torch.zeros_like(d) if r is None else r.to(d.dtype)
        signal = NOISE * r
        # a ratio over a denominator at the noise level is no estimate (the first iteration's
        # ratio is NaN: none yet; a missing older one, over a NaN or inf denominator, is 0)
        trusted = torch.where(den <= signal, torch.inf, q_now)   # NaN q_now: no estimate yet
        older = torch.where(self.den_prev <= signal, torch.inf, self.q_prev).amax(0)
        q = torch.maximum(trusted, older)
        zero = d == 0
        est = torch.where(q < 1, (q * d + r) / (1 - q), torch.inf).masked_fill_(zero, 0.0)
        limit = tol if budget is None else budget
        stop = zero | (small & (est <= limit))
        held = active & small & ~stop
        if d.device.type != "cpu" or bool(held.any()):
            # held by the rounding: the estimate in exact arithmetic would have stopped it
            raw = torch.maximum(q_now, self.q_prev.amax(0))
            held = held & (raw < 1) & (raw / (1 - raw) * d <= limit)
            self.blocked = torch.maximum(self.blocked, torch.where(held, r, 0.0).amax())
        self._record(d, q_now, den, active)
        return stop & active, est


def freeze_budget(est: torch.Tensor, tol: float, T: int) -> torch.Tensor:
    """How many leading positions may be frozen by the rule of the module doc.

    ``est`` is ``(B, n)``: the error estimate of each of the ``n`` leading candidate positions
    (``inf`` where there is none). Returns ``(B,)`` long: the largest ``m`` with
    ``max(est[:, :m]) <= tol * m / T`` (``0`` if none).
    """
    B, n = est.shape
    if n == 0 or tol <= 0:
        return torch.zeros(B, dtype=torch.long, device=est.device)
    running = est.cummax(dim=1).values
    m = torch.arange(1, n + 1, device=est.device, dtype=est.dtype)
    ok = running <= tol * m / T
    # the largest m where ok holds (ok need not be monotone in m)
    idx = torch.where(ok, m.to(torch.long).expand(B, n), torch.zeros(B, n, dtype=torch.long,
                                                                      device=est.device))
    return idx.amax(dim=1)
