"""The certificate of :func:`paraprop.diffusion.sample`: the stopping rule of a chain of steps
whose trajectory must be the loop's, within ``tol`` or bit for bit.

:class:`GainCertificate` runs a solver on a :class:`~paraprop.diffusion.chain.DiffusionChain`
and decides, per sample, what is certified; the solver's own estimate only stops iterating:

* ``tol`` at or below the rounding floor, and any ``tol`` in bfloat16/float16: the loop's bits
  only (the chain's exact prefixes: a position computed from exact inputs, equal to its direct
  step, is exact), with the loop itself from the certified prefix where the budget asks;
* above it, passes of the solver at a lower ``tol`` (at most :data:`PASSES`), each followed by
  the final check: the trajectory's defects under the loop's step map, carried through the
  steps' gains observed on every evaluation (:mod:`paraprop.diffusion.gains`), plus the rounding
  floor; a sample whose bound exceeds ``tol`` goes on from its certified prefix.

Every pass, check and fallback together takes at most ``N`` model calls in sequence (the
loop's). The chain reports its evaluations to the certificate's gains record
(``chain.observer``); nothing else passes between them.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from paraprop.diffusion.chain_checks import check_steps_finite, nonfinite_error
from paraprop.diffusion.gains import (
    FLOOR_ULPS,
    StepGains,
    bounds,
    carried_gains,
    output_gain,
    output_gains,
)
from paraprop.errors import NonFiniteError
from paraprop.solve import solve
from paraprop.solvers import Jacobi, Sequential, SlidingJacobi

# dtypes whose tol > 0 is certified by the loop's bits only (docs/diffusion.md)
NARROW = (torch.bfloat16, torch.float16)
# passes of the estimate stage at most (each followed by the final check)
PASSES = 3
# defects of one unit each at this many positions that would use half of tol make the
# estimate stage give way to the exact result at once (_estimate_stage)
HOPELESS = 8
SCALE = 4.0   # the least trajectory scale the solver's estimate allows rounding for


class Certified(NamedTuple):
    """What :meth:`GainCertificate.solve` found: ``run`` (the trajectory ``run.X`` and the
    counters), per sample ``done`` (certified), ``bitwise`` (certified bit for bit) and
    ``estimate`` (the accepted bound, ``0`` where bitwise), and ``reason`` (why not, or
    ``None``)."""
    run: _Run
    done: torch.Tensor
    bitwise: torch.Tensor
    estimate: torch.Tensor
    reason: str | None


class GainCertificate:
    """The stopping rule of a diffusion chain at ``tol`` (see the module doc), within
    ``max_iters`` model calls in sequence (default and at most the chain's ``N``).

    Example:
        >>> from diffusers import DDIMScheduler
        >>> from paraprop.diffusion import DiffusionChain, draw_noise, step_table
        >>> table = step_table(DDIMScheduler(), 20)
        >>> noise = draw_noise(table, (2, 3), generator=torch.Generator().manual_seed(0))
        >>> chain = DiffusionChain(lambda x, t: 0.1 * x, table, noise[0], noise[1:])
        >>> found = GainCertificate(tol=1e-3).solve(chain, paraprop.solvers.Jacobi())
        >>> bool(found.done.all()), chain.model_calls <= 20
        (True, True)
    """

    def __init__(self, tol: float, max_iters: int | None = None):
        self.tol = tol
        self.max_iters = max_iters

    def __repr__(self) -> str:
        return f"GainCertificate(tol={self.tol!r}, max_iters={self.max_iters!r})"

    def solve(self, chain, solver, callback=None) -> Certified:
        """Run ``solver`` on ``chain`` under this rule; ``callback(iteration, trajectory,
        residual)`` after each parallel iteration."""
        with torch.no_grad():
            return _solve_certified(chain, solver, self.tol, self.max_iters, callback)


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
        self.floor = 0.0
        self.tol_resolvable = False
        self.strict = strict          # stop once the batched calls differ from the loop
        self.loop_bitwise: bool | None = None
        self.loop_gap = 0.0
        # the steps whose batched evaluation was compared with the loop's call of B rows
        self.checked_steps: list[int] = []
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
        empty = chain.x_init[:, None][:, :0] if chain.history else None
        y = chain.steps(chain.x_init[:, None], 0, 1, empty, empty)[:, 0]
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

    def sequential(self, start: int, keep: torch.Tensor) -> None:
        """The loop from ``start`` (the certified prefix) to the end."""
        saved = self.X[keep].clone()
        self.chain.restart(self.X, start)
        self.chain.sequential(self.X, start)
        self.X[keep] = saved
        self.fallback_steps += self.chain.N - start
        self.positions += self.chain.N - start
        self.per_sample += self.chain.N - start


def _solve_certified(chain, solver, tol, max_iters, callback) -> Certified:
    """Solve the chain within ``N`` sequential model calls (``max_iters`` if fewer) and
    certify every sample (:func:`_passes`).

    The first call of a parallel solve is the loop's own first step (``B`` rows), and the first
    batched call evaluates the model on step 0 again, among ``n * B`` rows. A model whose
    kernels round a row differently in such a batch (batch variance), or nondeterministic
    kernels, show a difference there, at a certified step computed again, or at the last step
    (:func:`_last_step_check`): ``stats["loop_bitwise"] = False`` (a difference beyond batch
    variance is a stochastic model:
    :meth:`~paraprop.diffusion.chain.DiffusionChain.diagnose`). The parallel fixed point is
    then the sequential trajectory as the *batched* calls compute each step, not the loop's
    bit for bit. Where only the loop's bits certify ``tol`` (``tol=0``, below the rounding
    floor, bfloat16/float16) the solve stops with ``converged=False``; above it the final
    check carries the measured difference at every step, and a ``BatchVarianceWarning`` says
    so where it may matter.

    Returns a :class:`Certified`.
    """
    N = chain.N
    cap = N if max_iters is None else min(max_iters, N)
    run = _Run(chain, cap, callback)
    done, bitwise, estimate, reason = _passes(run, chain, solver, tol, max_iters, cap)
    # the gap the final checks carried (measured at step 0, before any check)
    checked_gap = 0.0 if chain.loop_gap is None else float(chain.loop_gap)
    if chain.loop_gap is not None:
        run.checked_steps.append(0)
    late = _last_step_check(run, chain)
    run.finish()
    if run.loop_bitwise is False:
        where = "step 0" if late is None else f"step {late}"
        what = (f"the model rounds differently on the batched calls ({chain.max_rows} rows) "
                f"than on the loop's ({chain.B} rows): its output for {where} differs by "
                f"{run.loop_gap:.3g} (batch-variant kernels; a difference beyond their "
                "rounding would have been refused as a stochastic model)")
        if not run.tol_resolvable:   # tol=0, below the rounding floor, or narrow: bits only
            done = torch.zeros_like(done)
            hint = (f"a tol above the dtype's rounding floor "
                    f"({rounding_floor(chain.dtype, SCALE):.3g} at values of size {SCALE:g})"
                    if chain.dtype not in NARROW else "a wider dtype (in bfloat16 and "
                    "float16 any tol is certified by the loop's bits only)")
            reason = (f"{what}, so no parallel method gives the loop's bits; use "
                      f"method='sequential' for them, or {hint}")
        else:
            # a sample certified against the batched calls' map is within the batch variance
            # carried along the chain of the loop's (the final check's bound, no defects); one
            # certified on an estimate has the gap its check carried already, and the rest of
            # a larger one found at a later step on top (the bound is linear in the defects)
            exact = done & (estimate == 0)
            more = run.loop_gap - checked_gap
            if bool(exact.any()) or (more > 0 and bool(done.any())):
                gains = carried_gains(run.gains.gain, chain.B, chain.N, chain.device,
                                      chain.history)
                full = torch.full_like(chain.exact, chain.N)
                out_gains = output_gains(chain.table).to(chain.device)
                E, _, _ = bounds(run.X, run.X, full, gains, chain.dtype,
                                 2 * run.loop_gap * out_gains, loop=False)
                if more > 0:
                    added, _, _ = bounds(run.X, run.X, full, gains, chain.dtype,
                                         2 * more * out_gains, loop=False)
                    estimate = torch.where(done & ~exact, estimate + added, estimate)
                estimate = torch.where(exact, E, estimate)
                done = done & ~(estimate > tol)
                if not bool(done.all()):
                    reason = (f"{what}; carried along the chain, that difference may exceed "
                              f"tol={tol:g} (bound {float(E.max()):.3g}): use "
                              "method='sequential' for the loop's sample")
            if bool(done.all()) and \
                    chain.N * output_gain(chain.table) * run.loop_gap > tol / 100:
                warnings.warn(f"diffusion.sample: {what}; the error estimate includes that "
                              "difference at every step, carried along the chain (measured at "
                              "step 0 and the last step only: compare with "
                              "method='sequential' once)",
                              BatchVarianceWarning, stacklevel=3)
        bitwise = torch.zeros_like(bitwise)
    return Certified(run, done, bitwise, estimate, reason)


def _last_step_check(run, chain) -> int | None:
    """The batch-variance spot check of a later step: where the last step's value came from a
    batched call (not from the loop's fallback) and the budget has a call left, the loop's own
    call of ``B`` rows computes step ``N - 1`` from its input in the final trajectory once more,
    and compares it with the batched calls' step from the same input (the certified value of a
    sample certified bit for bit; else the last observed evaluation, where it was at this
    input). A difference is batch variance at a later step (step 0's comparison cannot see a
    model that rounds apart only there): it raises ``chain.loop_gap`` (in model-output units,
    through the step's reaction to its model output) and marks the calls irreproducible.
    Returns ``N - 1`` where it found a difference larger than step 0's, else ``None``."""
    N, B = chain.N, chain.B
    if N < 2 or chain.max_rows <= B or run.fallback_steps > 0 or run.left < 1:
        return None
    u = run.X[:, N - 2]
    ref = run.X[:, N - 1]
    has = chain.certified() >= N
    seen = run.gains.last_inputs
    hist = past = None
    if chain.history:
        # the step reads the records of the steps before it: the certified ones for the
        # samples certified to the end, else those its last evaluation read (where that was
        # at this input and these inputs of the steps before)
        h = min(chain.history, N - 1)
        hist = chain.full_inputs(run.X, N - 1 - h, N - 1)
        past = chain.exact_records[:, N - 1 - h: N - 1]
        read = run.gains.last_read
        if seen is not None and seen[1] is not None and read is not None:
            now = chain.joint_history(run.X)[:, N - 1]
            fresh = (seen[0][:, N - 1] == u).all(1) & (seen[1][:, N - 1] == now).all(1) & ~has
            used = read[:, N - 1].reshape(chain.B, chain.history, chain.F)[:, chain.history - h:]
            past = torch.where(fresh[:, None, None], used, past)
            ref = torch.where(fresh[:, None], run.gains.last_outputs[:, N - 1], ref)
            has = has | fresh
    elif seen is not None:
        fresh = (seen[0][:, N - 1] == u).all(1) & ~has
        ref = torch.where(fresh[:, None], run.gains.last_outputs[:, N - 1], ref)
        has = has | fresh
    if not bool(has.any()):
        return None
    observer, chain.observer = chain.observer, None
    y = chain.steps(u[:, None], N - 1, N, hist, past)[:, 0]
    chain.observer = observer
    run.checked_steps.append(N - 1)
    d = (y.to(torch.float64) - ref.to(torch.float64)).abs().amax(1)
    d = torch.where(has, d.nan_to_num(nan=math.inf), 0.0).max()
    if float(d) == 0:
        return None
    # (a step with history: its own model output's reaction; the records are the same)
    own = getattr(chain.table, "own_output_gains", None)
    k = float((own() if own is not None else output_gains(chain.table))[N - 1])
    gap = d / k if k > 0 else torch.full_like(d, math.inf)
    old = chain.loop_gap
    chain.loop_gap = gap if old is None else torch.maximum(old, gap.to(old))
    chain.irreproducible = torch.ones_like(chain.irreproducible)
    return N - 1 if old is None or float(gap) > float(old) else None


class BatchVarianceWarning(RuntimeWarning):
    """The model's output for a row depends on the other rows of its batch: a parallel sample
    is the sequential one as the batched calls compute each step, which differs from the
    loop's by that rounding (carried in the estimate)."""


def _passes(run, chain, solver, tol, max_iters, cap):
    """The passes of :func:`_solve_certified`:

    * Estimate stage (``tol`` above the rounding floor of the initial noise's scale, not in
      bfloat16/float16): the solver runs at half of ``tol`` less that floor, then the final
      check decides
      (:func:`_estimate_stage`, :func:`_check`).
    * Exact stage, for the samples left (:func:`_exact_stage`).

    Returns ``(done, bitwise, estimate, reason)``: per sample, certified at all, certified
    bitwise, and the accepted estimate (``0`` where bitwise).
    """
    N, B = chain.N, chain.B
    done = torch.zeros(B, dtype=torch.bool, device=chain.device)
    estimate = torch.zeros(B, dtype=torch.float64, device=chain.device)
    # the floor at a scale the trajectory may grow to: twice the initial noise's, and at least
    # 4 (unit-variance noise, data in [-1, 1]); a tol at or below it is finished exactly
    floor0 = rounding_floor(chain.dtype, max(SCALE, 2 * float(chain.x_init.abs().max())))
    # an estimate can resolve tol in this dtype: above the floor, and not in bfloat16/float16,
    # whose steps' gains at the scale of their rounding cannot be measured (see _check)
    run.tol_resolvable = tol > floor0 and chain.dtype not in NARROW
    run.strict = not run.tol_resolvable   # only the loop's bits can certify such a tol
    if isinstance(solver, Sequential) or N == 1:
        if cap < N:
            return done, done, estimate, (f"the loop needs num_inference_steps={N} model "
                                          f"calls, more than max_iters={max_iters}")
        run.sequential(0, done)
        return ~done, ~done, estimate, None
    # the gains of the steps, observed on every call, carry the final check's defects
    chain.observer = run.gains if run.tol_resolvable else None
    if window_of(solver, N) > 1:   # (a window of one step: every call is the loop's)
        run.first_step()
    if run.tol_resolvable:
        done, estimate = _estimate_stage(run, chain, solver, tol, max(floor0, tol / 64))
    by_estimate = done & (estimate > 0)   # (an accepted estimate includes a floor > 0)
    done, estimate = _exact_stage(run, chain, solver, done, estimate, tol)
    by_estimate = by_estimate | (done & (estimate > 0))
    chain.observer = None
    reason = None
    if not bool(done.all()):
        reason = (f"the budget of {cap} sequential model calls (num_inference_steps={N}"
                  f"{'' if max_iters is None else f', max_iters={max_iters}'}) ran out before "
                  "the result was certified; a parallel method never takes more model calls in "
                  "sequence than the loop")
    return done, done & ~by_estimate, estimate, reason


def _estimate_stage(run, chain, solver, tol, floor0):
    """Passes of the solver at ``tol`` less ``floor0``, each sample stopped on its own estimate,
    each pass leaving a call for the final check (:func:`_check`), which decides: the solver's
    estimate only stops the iteration, it certifies nothing. Where the check leaves samples,
    another pass from their certified prefix at a ``tol`` lowered by what the check found (at
    most :data:`PASSES`).

    A sliding window of ``w < N`` steps first runs exactly (its freezes from exact inputs
    only) until every sample's certified prefix reaches ``N - w``, so that the steps left fit
    one window: the estimate passes and their check then cost one call each (a check of
    estimate freezes spread over the chain would cost a call per window of them)."""
    N, B = chain.N, chain.B
    done = torch.zeros(B, dtype=torch.bool, device=chain.device)
    estimate = torch.zeros(B, dtype=torch.float64, device=chain.device)
    window = window_of(solver, N)
    tail = solver
    lo = 0
    eps = torch.finfo(chain.dtype).eps

    def hopeless(scale: float, left: int) -> bool:
        # defects of one unit of the dtype at the trajectory's scale at HOPELESS of the
        # positions left would use half of tol: an estimate is unlikely to be certified
        return min(left, HOPELESS) * eps * max(1.0, scale) > tol / 2

    if window < N:
        # leave the loop from the certified prefix its calls (each call certifies one)
        if run.left < 2 or run.solve(solver, 0, 0.0, run.left - 1, done, until=N - window,
                                     hopeless=lambda scale: hopeless(scale, window)) is not None:
            return done, estimate   # (ran to the end: exact, or out of budget)
        lo = int(chain.certified().min())
        tail = Jacobi(accumulation=False)   # (the final check certifies: _check)
    if hopeless(float(run.X.abs().max()), N - lo):   # exactly at once
        return done, estimate
    inner = (tol - floor0) / 2
    for _ in range(PASSES):
        # every call certifies a position at least: no more calls than the loop from the
        # certified prefix, less one for the final check (a solver that stops on its
        # estimate early leaves it more)
        budget = min(run.left, N - lo) - 1
        if budget < 1:
            break
        before = chain.model_calls
        run.solve(tail, lo, inner, budget, done)
        # the loop from a later position where it costs no more than this pass did
        done, estimate, bound = _check(run, chain, done, estimate, tol, window,
                                       chain.model_calls - before)
        if bound is None or bool(done.all()):
            break
        worst = float(bound[~done].max())
        inner = inner * min(0.5, tol / worst) if math.isfinite(worst) else inner / 4
        # an estimate cannot resolve changes within the rounding floor at the trajectory's
        # scale: there the exact stage costs no more than another estimate pass
        if inner <= 8 * rounding_floor(chain.dtype, float(run.X[~done].abs().max())):
            break
        lo = int(chain.certified()[~done].min())
    return done, estimate


def _check(run, chain, done, estimate, tol, window, loop_limit=None):
    """The certificate of ``tol > 0``: the returned trajectory's own defects under the loop's
    step map, carried to every later position through the steps' observed gains.

    With ``y_s`` the direct step of position ``s`` from its input in ``X`` (bitwise the loop's
    step, :func:`_direct`: one call per ``window``
    steps whose last evaluation is not at their current input, none where the solver's last
    iterate was evaluated already) and ``r_s = |y_s - X_s|``, the error ``e_s`` of position
    ``s`` against the loop's trajectory obeys ``|e_s| <= g_s |e_{s-1}| + r_s + rho_s``: ``g_s``
    the gain of step ``s`` (the largest ``|d step_s(x)| / |d x|`` observed, in this dtype, for
    input changes above the rounding level; a step never observed counts as unbounded) and
    ``rho_s`` what rounding may add to a difference between two inputs (:data:`RHO_ULPS` units
    of the dtype at the values' scale). Positions before the first defect are exact (their
    values are the direct steps from exact inputs). The bound of a sample is the largest
    ``|e_s|`` the recurrence allows (:func:`~paraprop.diffusion.gains.bounds`); it is accepted
    where ``<= tol``. Where it is not, and the loop from some position ``q`` would finish the
    sample within ``tol`` (the error at ``q - 1`` carried on, plus the rounding of the steps
    after it) within the budget (and ``loop_limit`` calls), the loop does so. Returns the new
    ``(done, estimate)`` and the bounds found ``(B,)`` (``None`` where the check was not
    affordable, or cost as much as the loop)."""
    N = chain.N
    undone = ~done
    chain.commit(run.X, undone)
    hist = chain.joint_history(run.X) if chain.history else None
    start = run.gains.stale_from(run.X, chain.x_init, chain.exact, undone, hist)
    calls = -(-(N - start) // window)
    # the loop from the certified prefix is exact: where it costs no more than the check,
    # the exact stage takes it
    if calls > run.left or calls >= N - int(chain.certified()[undone].min()):
        return done, estimate, None
    y = _direct(run, start, window)
    p = chain.learn_exact(run.X, y, undone, run.gains.last_records)
    # a sample whose last position is now known is exact
    whole = undone & (chain.certified() >= N)
    chain.commit(run.X, whole)
    p = torch.where(whole, N, p)
    gap = 0.0 if chain.loop_gap is None else float(chain.loop_gap)
    extra = None
    if gap > 0:
        # the batched calls' map is not the loop's (batch variance, measured at step 0): each
        # step may differ from the loop's by the output difference times the step's reaction
        # to it (twice the measured one); no position is the loop's bit for bit
        extra = 2 * gap * output_gains(chain.table).to(chain.device)
    gains = carried_gains(run.gains.gain, chain.B, N, chain.device, chain.history)
    E, _, rho = bounds(run.X, y, p, gains, chain.dtype, extra, loop=False)
    ok = undone & (E <= tol)
    by_estimate = ok & (p < N)
    estimate = torch.where(by_estimate, E, estimate)
    run.floor = max(run.floor, float(torch.where(by_estimate, rho, 0).max()))
    done = done | ok
    left = ~done
    if not bool(left.any()):
        return done, estimate, E
    # the loop from q finishes every sample left within tol: the latest such q it can afford
    # (the bounds of the loop from each q: computed again, where some sample is left)
    _, F, _ = bounds(run.X, y, p, gains, chain.dtype, extra)
    q = torch.arange(N + 1, device=F.device)
    limit = run.left if loop_limit is None else min(run.left, loop_limit)
    fits = ((F <= tol) | ~left[:, None]).all(0) & (N - q <= limit) & (q > 0)
    if not bool(fits.any()):
        return done, estimate, E
    start = int(torch.where(fits, q, -1).max())
    run.sequential(start, done)
    exact = chain.certified() >= N
    bound = F[:, start]
    by_estimate = left & ~exact
    estimate = torch.where(by_estimate, bound, estimate)
    run.floor = max(run.floor, float(torch.where(by_estimate, rho, 0).max()))
    return done | left, estimate, torch.where(left, bound, E)


def _exact_stage(run, chain, solver, done, estimate, tol):
    """The samples not ``done``, exactly: one pass that certifies at least one position per
    call (capped to leave the loop the rest), then the loop from the certified prefix; the
    first batched call starts at step 0 (the batch-variance check, :func:`_solve_certified`).
    Where the budget cannot carry the loop and ``tol`` is resolvable, the pass leaves a call
    for the final check (:func:`_check`) instead. Returns the new ``(done, estimate)``."""
    N = chain.N
    passed = False
    if bool(done.all()):   # (certified by the estimate stage: nothing to commit)
        return torch.ones_like(done), estimate
    while True:
        certified = chain.certified()
        chain.commit(run.X, ~done)
        left = ~done & (certified < N)
        if not bool(left.any()):
            return torch.ones_like(done) | done, estimate
        first = int(certified[left].min())   # the loop would go on from here
        keep = ~left
        affordable = run.left >= N - first
        if passed or N - first <= 1:
            if not affordable:
                break
            run.sequential(first, keep)
            continue
        # each call certifies a position; one call is left for a solver's last verification
        # (or the final check)
        steps = min(run.left, N - first) - 1 if affordable else run.left - 1
        if steps < 1:
            break
        # the first batched call computes step 0 again: the batch-variance check
        lo = 0 if chain.loop_gap is None else first
        if run.solve(solver, lo, 0.0, steps, keep) is None:   # not the loop's bits
            return done, estimate
        passed = True
    exact = chain.certified() >= N
    chain.commit(run.X, exact & ~done)
    done = done | exact
    if run.tol_resolvable and not bool(done.all()):
        done, estimate, _ = _check(run, chain, done, estimate, tol, window_of(solver, N))
    return done, estimate


def _direct(run, start: int, window: int) -> torch.Tensor:
    """``(B, N, F)``: the direct step of every position of ``run.X`` from its input there
    (bitwise the loop's step from that input), evaluating the steps ``[start, N)`` again in
    calls of at most ``window`` steps, observed as any; the steps before ``start`` are their
    last evaluations (:meth:`~paraprop.diffusion.gains.StepGains.stale_from`)."""
    chain, X = run.chain, run.X
    xin = torch.cat([chain.x_init[:, None], X[:, :-1]], dim=1)
    # (observed whatever the pass did: the last outputs are read back)
    observer, chain.observer = chain.observer, run.gains
    for a in range(start, chain.N, window):
        b = min(chain.N, a + window)
        # (with history, the steps before the window are evaluated in the same call)
        hist = chain.full_inputs(X, a - min(chain.history, a), a) if chain.history else None
        chain.steps(xin[:, a:b], a, b, hist)
    chain.observer = observer
    return run.gains.last_outputs
