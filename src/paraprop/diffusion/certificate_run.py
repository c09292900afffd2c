"""The bookkeeping of one certified solve of :class:`~paraprop.diffusion.certificate.
GainCertificate`: the full trajectory, the solver's passes and their counters, the loop's own
first step and the loop from a certified prefix, within the budget of at most ``N`` sequential
model calls (:class:`_Run`); and the rounding floor and window size the stages read.
"""

from __future__ import annotations

import torch

from paraprop.diffusion.chain_checks import check_steps_finite, nonfinite_error
from paraprop.diffusion.gains import FLOOR_ULPS, StepGains
from paraprop.errors import NonFiniteError
from paraprop.solve import solve
from paraprop.solvers import Sequential, SlidingJacobi


def rounding_floor(dtype: torch.dtype, scale) -> float:
    """The error an estimate-based certificate cannot resolve in ``dtype`` at values of size
    ``scale``: :data:`~paraprop.diffusion.gains.FLOOR_ULPS` units of ``dtype``'s resolution at
    ``max(1, scale)``."""
    return FLOOR_ULPS * torch.finfo(dtype).eps * max(1.0, float(scale))


def window_of(solver, N: int) -> int:
    """The steps one call of ``solver`` evaluates at most."""
    if isinstance(solver, Sequential):
        return 1
    if isinstance(solver, SlidingJacobi):
        return min(solver.window or SlidingJacobi.DEFAULT_WINDOW, N)
    return N


class _Stop(Exception):
    """Ends a pass early (``tol=0`` and the batched calls are not the loop's bits)."""


class _Run:
    """The bookkeeping of one certified solve: the full trajectory, the passes and their
    counters, and the budget of at most ``N`` sequential model calls."""

    def __init__(self, chain, cap: int, callback, strict: bool = False):
        self.chain = chain
        N, B, F = chain.N, chain.B, chain.F
        self.X = chain.x_init[:, None, :].expand(B, N, F).clone()
        self.cap = cap                 # sequential model calls allowed (at most N)
        chain.cap = cap
        self.callback = callback
        self.passes = 0
        self.iterations = 0          # parallel iterations, all passes together
        self.residuals: list[torch.Tensor] = []
        self.positions = 0
        self.per_sample = torch.zeros(B, dtype=torch.long)
        self.fallback_steps = 0
        self.fallback_from: int | None = None   # the first step the loop's fallback computed
        self.floor = 0.0
        self.tol_resolvable = False
        self.strict = strict          # stop once the batched calls differ from the loop
        self.loop_bitwise: bool | None = None
        self.loop_gap = 0.0
        # the steps whose batched evaluation was compared with the loop's call of B rows
        self.checked_steps: list[int] = []
        # the batch variance's probe (certificate_stages.probe_batch_variance): the steps from
        # probed_from on have been probed
        self.probed_from = chain.N
        # the step the last step's batch variance check would have compared, where the budget
        # had no call left for it (certificate._last_step_check)
        self.late_unchecked: int | None = None
        # the steps' gains, observed while the chain reports to it (chain.observer)
        self.gains = StepGains(B, N, F, chain.dtype, chain.work, chain.device)

    @property
    def left(self) -> int:
        return self.cap - self.chain.model_calls

    def solve(self, solver, lo: int, tol: float, max_iters: int, keep: torch.Tensor,
              until: int | None = None, hopeless=None):
        """One pass of ``solver`` on the steps ``[lo, N)`` from the current trajectory; the
        samples ``keep`` (certified already) keep their values. With ``until``, the pass ends
        once every other sample's certified prefix reaches it (one host sync per iteration),
        unless ``hopeless(scale)`` (the certified values' largest) says an estimate will not
        pay: then it runs on to the end, without observing gains; returns ``None`` where it
        ended early or on :class:`_Stop`."""
        chain, X = self.chain, self.X
        saved = X[keep].clone()
        chain.restart(X, lo)
        self.passes += 1
        offset = self.iterations
        cb = None
        if self.callback is not None:
            def cb(k, v, r):
                full = X.clone()
                full[:, lo:] = v
                full[keep] = saved
                self.callback(offset + k, full, r)
        last = {}
        seen_residuals = []
        any_kept = bool(keep.any())

        def progress() -> tuple[float, float]:
            # the least certified prefix of the samples iterating, and the scale of the
            # certified values (an iterate far from the answer may be far larger): one host
            # sync (on the host, two reads)
            certified = chain.certified()
            reach = certified[~keep].min() if any_kept else certified.min()
            scale = chain.exact_values.abs().max()
            if chain.host:
                return float(reach), float(scale)
            return tuple(torch.stack([reach.double(), scale.double()]).tolist())

        def watch(k, v, r):
            self.iterations = offset + k
            seen_residuals.append(r)
            if cb is not None:
                cb(k, v, r)
            if self.strict and chain.irreproducible_seen:   # (no extra sync: read in window)
                last["value"] = v.clone()
                raise _Stop
            if until is not None and "finish" not in last:
                reach, scale = progress()
                if hopeless is not None and hopeless(scale):
                    last["finish"] = True
                    chain.observer = None
                elif reach >= until:
                    last["value"] = v.clone()
                    raise _Stop

        chain.frozen = keep if any_kept else None
        try:
            sol = solve(chain, X[:, lo:].clone(), method=solver, dim=1, tol=tol,
                        max_iters=max_iters, throw=False, callback=watch)
        except NonFiniteError as e:
            # the solver saw a non-finite value the chain did not repair: the direct step from
            # exact inputs, the loop's own (named as the loop would find it)
            bad = chain.nonfinite_step
            if bool((bad >= 0).any()):
                step = int(bad[bad >= 0].min())
                raise nonfinite_error(step, int((bad == step).nonzero()[0])) from e
            raise
        except _Stop:
            chain.frozen = None
            X[:, lo:] = last["value"]
            X[keep] = saved
            self._compare()
            self.residuals.append(torch.tensor([float(v) for v in seen_residuals],
                                               dtype=torch.float64))
            self.positions += int(chain.certified().sum()) // chain.B
            return None
        chain.frozen = None
        X[:, lo:] = sol.value
        X[keep] = saved
        self._compare()
        self.residuals.append(sol.residuals)
        self.positions += sol.stats.get("positions", 0)
        self.per_sample += sol.stats["sample_iterations"].reshape(-1)
        return sol

    def first_step(self) -> None:
        """The loop's own first step (``B`` rows): position 0, certified, and the reference
        that the batched calls' step 0 is compared with."""
        chain = self.chain
        hist = chain.x_init[:, None][:, :0] if chain.history else None
        past = chain.exact_records[:, :0] if chain.exact_records is not None else None
        y = chain.steps(chain.x_init[:, None], 0, 1, hist, past)[:, 0]
        check_steps_finite(y[:, None])
        self.X[:, 0] = y
        chain.exact_values[:, 0] = y
        if chain.exact_records is not None:
            chain.exact_records[:, 0] = chain.records_out[:, 0]
        chain.exact = torch.maximum(chain.exact, torch.ones_like(chain.exact))
        self.positions += 1
        self.per_sample += 1

    def finish(self) -> None:
        """Read the batch-variance comparison (one host sync, after the solve)."""
        self._compare()

    def _compare(self) -> None:
        """After a pass: did the batched calls give the loop's bits (step 0's model output,
        and every certified step they recomputed)?"""
        chain = self.chain
        if not chain.diagnosed and bool(chain.irreproducible):
            chain.diagnose()   # StochasticModelError for a model that is not deterministic
        if chain.loop_gap is None:
            if chain.model_calls and chain.max_rows == chain.B:
                self.loop_bitwise = True   # every call had the loop's rows
            return
        self.loop_gap = float(chain.loop_gap)
        self.loop_bitwise = not bool(chain.irreproducible)

    def sequential(self, start: int, keep: torch.Tensor,
                   records: torch.Tensor | None = None) -> None:
        """The loop from ``start`` to the end: from the certified prefix, or from a later
        position with the records of the steps before it (``records``, a program with
        history: :meth:`~paraprop.diffusion.chain.DiffusionChain.sequential`)."""
        saved = self.X[keep].clone()
        self.chain.restart(self.X, start)
        self.chain.sequential(self.X, start, records, ignore=keep)
        self.X[keep] = saved
        self.fallback_steps += self.chain.N - start
        self.fallback_from = start if self.fallback_from is None else \
            min(self.fallback_from, start)
        self.positions += self.chain.N - start
        self.per_sample += self.chain.N - start



__all__ = ["rounding_floor", "window_of"]
