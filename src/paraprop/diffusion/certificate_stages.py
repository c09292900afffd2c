"""The stages of :class:`~paraprop.diffusion.certificate.GainCertificate`'s solve: the estimate
stage (passes of the solver at a lower ``tol``, each followed by the final check of the
trajectory's defects carried through the steps' observed gains) and the exact stage (the loop's
bits, with the loop from the certified prefix where the budget asks): :func:`_passes`.
"""

from __future__ import annotations

import math

import torch

from paraprop.diffusion.certificate_run import rounding_floor, window_of
from paraprop.diffusion.gains import bounds, carried_gains, output_gains
from paraprop.solvers import Jacobi, Sequential, TriangularAnderson

# dtypes whose tol > 0 is certified by the loop's bits only (docs/diffusion.md)
NARROW = (torch.bfloat16, torch.float16)
# passes of the estimate stage at most (each followed by the final check)
PASSES = 3
# defects of one unit each at this many positions that would use half of tol make the
# estimate stage give way to the exact result at once (_estimate_stage)
HOPELESS = 8
# the factor on a batch variance carried through gains that could not all be probed in its
# direction (probe_batch_variance: the budget had no call left); the sweeps' estimates fell
# short by up to 3x unprobed (2.1-2.3x in a review's)
UNPROBED = 4
SCALE = 4.0   # the least trajectory scale the solver's estimate allows rounding for


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
    # (the final check certifies: Anderson stops on its residual, without its plain steps)
    tail = solver.residual_stop() if isinstance(solver, TriangularAnderson) else solver
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
        # (the gains in the batch variance's own direction first, leaving a call for the
        # last step's batch variance check)
        probed = probe_batch_variance(run, chain, tol, window, reserve=1)
        extra = variance_defects(chain, gap, probed)
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
    rec = run.gains.last_records if chain.history else None
    if chain.history:
        # the loop from q reads the records of the steps before it: those of their last
        # evaluations, at their inputs in X (the direct steps above), which the bound F
        # carries; a step never evaluated has none (NaN), and q cannot start after it
        have = torch.zeros(N + 1, dtype=torch.bool, device=F.device)
        if rec is not None:
            # have[k]: the h steps before k all have records (steps never seen, counted)
            unseen = (~torch.isfinite(rec[left]).all(2).all(0)).long().cumsum(0)   # (N,)
            unseen = torch.cat([unseen.new_zeros(1), unseen])                     # (N + 1,)
            lo = (q - chain.history).clamp(min=0)
            have = unseen[q] - unseen[lo] == 0
        fits = fits & have
    if not bool(fits.any()):
        return done, estimate, E
    start = int(torch.where(fits, q, -1).max())
    # (the samples left have the records: `have`)
    records = None if rec is None else \
        torch.nan_to_num(rec[:, start - min(chain.history, start): start])
    run.sequential(start, done, records)
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


def variance_defects(chain, gap, probed: bool) -> torch.Tensor:
    """``(N,)`` float64: the defect a batch variance ``gap`` (in model-output units) adds to
    each step, carried by the final check: twice the measured difference times the step's
    reaction to its model output, and :data:`UNPROBED` times that where the steps' gains could
    not all be probed in its direction (:func:`probe_batch_variance`)."""
    factor = 2.0 if probed else 2.0 * UNPROBED
    return factor * gap * output_gains(chain.table).to(chain.device)


def probe_batch_variance(run, chain, tol: float, window: int, reserve: int = 0) -> bool:
    """Where the batched calls round apart from the loop's (``chain.loop_gap > 0``) and ``tol``
    is resolvable: evaluate the steps once more from their inputs in ``run.X`` moved by ``tol``
    along the sign of the output difference found at step 0 (``chain.loop_diff``, per sample;
    all ones where it was not measured or has another shape), and record the steps' gains
    between these and their last evaluations at those inputs (:meth:`~paraprop.diffusion.
    gains.StepGains.compare`; a step never observed stays unbounded). One model call, counted,
    per ``window`` steps, from the last step down, as far as the budget goes while leaving
    ``reserve`` calls; a later call goes on where the last one stopped (``run.probed_from``).
    Returns whether every step has been probed (``True`` where there is nothing to probe: no
    batch variance, or a ``tol`` only the loop's bits certify).

    Why: the final check carries the batch variance as a defect of every step through the
    gains the iteration observed, and those are secants along the iteration's own changes.
    A batch variance has a direction of its own (a constant offset is one), which a step may
    expand where it shrinks the iteration's changes (a step whose Jacobian is not normal:
    measured, DDIM with ``prediction_type="sample"`` on the fault tests' MLP, its last steps
    expand a constant offset 1.8-1.9x where the iteration's changes shrank 0.35-0.46x, and
    the estimate was a third of the error). The probe observes the gain in one such direction
    (a sign vector, near the step's largest row sum where the offset is uniform), at the size
    of ``tol`` (the errors the bound speaks of). A run that cannot probe every step is not
    certified by an estimate unless the batch variance carried :data:`UNPROBED` times over
    fits (:func:`_check`, :func:`~paraprop.diffusion.certificate._solve_certified`)."""
    if chain.loop_gap is None or not float(chain.loop_gap) > 0 or not run.tol_resolvable:
        return True
    seen = run.gains.last_inputs
    if seen is None or chain.history and seen[1] is None:
        return run.probed_from == 0
    B, F = chain.B, chain.F
    X = run.X
    u = torch.ones(B, F, dtype=X.dtype, device=X.device)
    diff = chain.loop_diff
    if diff is not None and diff[0].numel() == F:
        u = torch.where(diff.reshape(B, F) < 0, -1.0, 1.0).to(X.dtype)
    while run.probed_from > 0 and run.left > reserve:   # the windows of steps, last first
        b = run.probed_from
        a = max(0, b - window)
        xin = chain.full_inputs(X, a, b)
        # (a step whose last evaluation was at another input has no base to compare with)
        fresh = (seen[0][:, a:b] == xin).all(2)
        hist = past = None
        if chain.history:
            hist = chain.full_inputs(X, a - min(chain.history, a), a)
            if a == 0:   # (no steps before the window: no records read)
                past = chain.exact_records[:, :0]
            fresh = fresh & (seen[1][:, a:b] == chain.joint_history(X)[:, a:b]).all(2)
        if not bool(fresh.all()):
            # (the caller's trajectory is not where the steps were last evaluated: _check
            # evaluates every step first; elsewhere the probe is not made)
            break
        moved = xin + tol * u[:, None, :]
        observer, chain.observer = chain.observer, None
        records = chain.records_out
        try:
            y = chain.steps(moved, a, b, hist, past)
        finally:
            chain.observer = observer
            chain.records_out = records
        run.gains.compare(xin, run.gains.last_outputs[:, a:b], moved, y, a, b)
        run.probed_from = a
    return run.probed_from == 0
