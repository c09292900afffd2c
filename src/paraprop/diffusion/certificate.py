"""The certificate of :func:`paraprop.diffusion.sample`: the stopping rule of a chain of steps
whose trajectory must be the loop's, within ``tol`` or bit for bit.

:class:`GainCertificate` runs a solver on a :class:`~paraprop.diffusion.chain.DiffusionChain`
and decides, per sample, what is certified; the solver's own estimate only stops iterating:

* ``tol`` at or below the rounding floor, and any ``tol`` in bfloat16/float16: the loop's bits
  only (the chain's exact prefixes: a position computed from exact inputs, equal to its direct
  step, is exact), with the loop itself from the certified prefix where the budget asks;
* above it, passes of the solver at a lower ``tol`` (at most
  :data:`~paraprop.diffusion.certificate_stages.PASSES`), each followed by
  the final check: the trajectory's defects under the loop's step map, carried through the
  steps' gains observed on every evaluation (:mod:`paraprop.diffusion.gains`), plus the rounding
  floor; a sample whose bound exceeds ``tol`` goes on from its certified prefix.

Every pass, check and fallback together takes at most ``N`` model calls in sequence (the
loop's). The chain reports its evaluations to the certificate's gains record
(``chain.observer``); nothing else passes between them. The stages are in
:mod:`~paraprop.diffusion.certificate_stages`, the run's bookkeeping in
:mod:`~paraprop.diffusion.certificate_run`.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from paraprop.diffusion.certificate_run import _Run, rounding_floor, window_of
from paraprop.diffusion.certificate_stages import (
    NARROW,
    SCALE,
    _passes,
    probe_batch_variance,
    variance_defects,
)
from paraprop.diffusion.gains import bounds, carried_gains, output_gain, output_gains


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
    # the gains in the batch variance's direction, where it has one (every step the budget
    # reaches; the difference is carried UNPROBED times where it did not reach them all)
    probed = probe_batch_variance(run, chain, tol, window_of(solver, N)) \
        if bool(done.any()) else True
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
        elif run.late_unchecked is not None:
            # the difference at step 0 need not be the later steps' (a model that rounds apart
            # more at other timesteps: certified up to 10x beyond tol in a review's sweep)
            done = torch.zeros_like(done)
            reason = (f"{what}; the budget had no model call left to compare step "
                      f"{run.late_unchecked} with the loop's call, so the difference at the "
                      "later steps is unknown: use method='sequential' for the loop's sample "
                      "(a run that needs every call of its budget is no faster than it)")
        else:
            # a sample certified against the batched calls' map is within the batch variance
            # carried along the chain of the loop's (the final check's bound, no defects); one
            # certified on an estimate has the gap its check carried already, and the rest of
            # a larger one found at a later step on top (the bound is linear in the defects)
            exact = done & (estimate == 0)
            more = run.loop_gap - checked_gap
            gains = carried_gains(run.gains.gain, chain.B, chain.N, chain.device,
                                  chain.history)
            full = torch.full_like(chain.exact, chain.N)
            # the batch variance alone, carried along the chain of the loop's
            E, _, _ = bounds(run.X, run.X, full, gains, chain.dtype,
                             variance_defects(chain, run.loop_gap, probed), loop=False)
            if bool(exact.any()) or (more > 0 and bool(done.any())):
                if more > 0:
                    added, _, _ = bounds(run.X, run.X, full, gains, chain.dtype,
                                         variance_defects(chain, more, probed), loop=False)
                    estimate = torch.where(done & ~exact, estimate + added, estimate)
                estimate = torch.where(exact, E, estimate)
                done = done & ~(estimate > tol)
            # (also where the budget ran out first: the final checks carried it, and failed)
            if not bool(done.all()) and float(E.max()) > tol:
                reason = (f"{what}; carried along the chain, that difference may exceed "
                          f"tol={tol:g} (bound {float(E.max()):.3g}): use "
                          "method='sequential' for the loop's sample")
            elif not bool(done.all()) and reason is None:
                # (the difference found at a later step, on top of the bound the final check
                # accepted, exceeds tol)
                worst = float(torch.where(done, 0.0, estimate).max())
                reason = (f"{what}; carried along the chain on top of the final check's "
                          f"bound, the estimate exceeds tol={tol:g} ({worst:.3g}): use "
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
    """The batch-variance spot check of a later step: the last step ``s`` whose value came from
    a batched call (``N - 1``, or the step before the loop's fallback where the loop computed
    the tail), computed once more by the loop's own call of ``B`` rows from its input, and
    compared with the batched calls' step from the same input: for a sample whose certified
    prefix covers ``s``, from its certified input to its certified value (its trajectory may
    hold an estimate's values there); else from its input in the final trajectory to the last
    observed evaluation, where it was at this input; where the budget has a call left (a run
    that needs every call of the budget is checked at step 0 only: documented). A difference is
    batch variance at a later step (step 0's comparison cannot see a model that rounds apart
    only there): it raises ``chain.loop_gap`` (in model-output units, through the step's
    reaction to its model output) and marks the calls irreproducible. Returns ``s`` where it
    found a difference larger than step 0's, else ``None``."""
    N, B = chain.N, chain.B
    s = N - 1 if run.fallback_from is None else run.fallback_from - 1
    if s < 1 or chain.max_rows <= B:
        return None
    if run.left < 1:
        # (a batch variance found at step 0 is then not certified at tol > 0: its size at the
        # later steps is unknown; _solve_certified)
        run.late_unchecked = s
        return None
    # a sample certified past s: its certified values (a sample certified by an estimate may
    # hold other values in the trajectory, and the next certified value may not be written yet)
    has = chain.certified() >= s + 1
    u = torch.where(has[:, None], chain.exact_values[:, s - 1], run.X[:, s - 1])
    ref = torch.where(has[:, None], chain.exact_values[:, s], run.X[:, s])
    seen = run.gains.last_inputs
    hist = past = None
    if chain.history:
        # the step reads the records of the steps before it: the certified ones for the
        # samples certified past it, else those its last evaluation read (where that was
        # at this input and these inputs of the steps before)
        h = min(chain.history, s)
        hist = chain.full_inputs(run.X, s - h, s)
        past = chain.exact_records[:, s - h: s]
        read = run.gains.last_read
        if seen is not None and seen[1] is not None and read is not None:
            now = chain.joint_history(run.X)[:, s]
            fresh = (seen[0][:, s] == u).all(1) & (seen[1][:, s] == now).all(1) & ~has
            used = read[:, s].reshape(chain.B, chain.history, chain.RW)[:, chain.history - h:]
            past = torch.where(fresh[:, None, None], used, past)
            ref = torch.where(fresh[:, None], run.gains.last_outputs[:, s], ref)
            has = has | fresh
    elif seen is not None:
        fresh = (seen[0][:, s] == u).all(1) & ~has
        ref = torch.where(fresh[:, None], run.gains.last_outputs[:, s], ref)
        has = has | fresh
    if not bool(has.any()):
        return None
    observer, chain.observer = chain.observer, None
    y = chain.steps(u[:, None], s, s + 1, hist, past)[:, 0]
    chain.observer = observer
    run.checked_steps.append(s)
    d = (y.to(torch.float64) - ref.to(torch.float64)).abs().amax(1)
    d = torch.where(has, d.nan_to_num(nan=math.inf), 0.0).max()
    if float(d) == 0:
        return None
    # (a step with history: its own model output's reaction; the records are the same)
    own = getattr(chain.table, "own_output_gains", None)
    k = float((own() if own is not None else output_gains(chain.table))[s])
    gap = d / k if k > 0 else torch.full_like(d, math.inf)
    old = chain.loop_gap
    chain.loop_gap = gap if old is None else torch.maximum(old, gap.to(old))
    chain.irreproducible = torch.ones_like(chain.irreproducible)
    return s if old is None or float(gap) > float(old) else None


class BatchVarianceWarning(RuntimeWarning):
    """The model's output for a row depends on the other rows of its batch: a parallel sample
    is the sequential one as the batched calls compute each step, which differs from the
    loop's by that rounding (carried in the estimate)."""



__all__ = ["BatchVarianceWarning", "Certified", "GainCertificate", "rounding_floor", "window_of"]
