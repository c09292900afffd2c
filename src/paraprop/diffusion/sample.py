"""``paraprop.diffusion.sample``: a diffusers scheduler's sampling loop, solved in parallel."""

from __future__ import annotations

import time
import warnings

import torch

from paraprop import checks
from paraprop.checks import check_max_iters, check_tol
from paraprop.determinism import require_deterministic
from paraprop.diffusion.chain import (
    DiffusionChain,
    check_steps_finite,
    draw_noise,
    growth_after,
    nonfinite_error,
)
from paraprop.diffusion.schedulers import scheduler_kind, step_table
from paraprop.errors import NonFiniteError
from paraprop.result import Solution, ensure_converged
from paraprop.solve import solve
from paraprop.solvers import Jacobi, Sequential, SlidingJacobi, TriangularAnderson, is_solver
from paraprop.solvers.stopping import RATES

METHODS = ("sequential", "picard", "anderson")
# solver objects whose every iteration is one model call that certifies at least one position
SOLVERS = (Jacobi, SlidingJacobi, TriangularAnderson, Sequential)
DEFAULT_WINDOW = 128
SPLITS = ("identity", "eps")
# units of the dtype's resolution (at the trajectory's scale) an estimate cannot resolve
FLOOR_ULPS = 4
SCALE = 4.0   # the least trajectory scale the solver's estimate allows rounding for


def sample(model, scheduler, shape, *, num_inference_steps: int, method="picard",
           window: int | None = None, memory: int | None = None, tol: float = 1e-3,
           max_iters: int | None = None, throw: bool = True, generator=None, noise=None,
           eta: float | None = None, use_clipped_model_output: bool = False,
           split: str = "identity", dtype: torch.dtype | None = None, device=None,
           shard=None, callback=None, **model_kwargs) -> tuple[torch.Tensor, Solution]:
    """Sample a diffusion model with ``scheduler``'s update rule, as the diffusers loop would, but
    with a window of steps per batched model call.

    The loop ``x = scheduler.step(model(x, t), t, x).prev_sample`` over
    ``scheduler.timesteps``, with every step's noise drawn up front, is a triangular system over
    the steps (:mod:`paraprop.diffusion.chain`). Every method returns its unique solution: the
    sequential sample for the same noise, within ``tol`` (at ``tol=0`` bit for bit), in at most
    ``N`` model calls in sequence, the number the loop takes.

    Arguments:
        model: a diffusers ``UNet2DModel``, or any module or callable ``model(x, t, **kw)``
            returning the model output shaped like ``x`` (``t``: a 1-D long tensor, one
            timestep per row of ``x``; a window's rows are its steps one after another, each
            holding the whole batch).
        scheduler: a diffusers ``DDPMScheduler`` or ``DDIMScheduler`` (or their parallel
            variants); ``set_timesteps(num_inference_steps)`` is called on it, as a pipeline
            does. Other schedulers raise ``NotImplementedError``.
        shape: the batch shape ``(B, ...)``, e.g. ``(16, 2)`` or ``(4, 1, 28, 28)``.
        num_inference_steps: the number of denoising steps ``N``.
        method: ``"sequential"`` (the diffusers loop: ``N`` model calls), ``"picard"``
            (ParaDiGMS: Picard iteration on a sliding window of ``window`` steps, each
            iteration one batched model call plus one scan), ``"anderson"`` (ParaTAA:
            triangular Anderson acceleration of the Picard iteration, with ``memory``), or a
            solver object applied to the Picard map: ``Jacobi()``, ``SlidingJacobi(w)``,
            ``TriangularAnderson(memory=m)`` or ``Sequential()`` (others, whose iterations make
            several model calls in sequence, raise ``ValueError``).
        window: steps per iteration of ``"picard"`` (``None``: 128; a window of at least ``N``
            steps is Jacobi on the whole trajectory); ``"anderson"`` iterates on all ``N`` steps.
        memory: ``"anderson"``'s history (iterates kept; ``None``: its default).
        tol: a sample is accepted when the estimated distance of its whole trajectory to the
            sequential one, plus the dtype's rounding floor at its scale, is ``<= tol``
            (largest absolute difference; see ``docs/diffusion.md``); where ``tol`` is at or
            below that floor (``stats["tol_resolvable"]``), the method runs to the exact
            result. ``0``: the loop's trajectory bit for bit, or ``converged=False`` (where the
            model's batched calls round differently from the loop's). Not used by
            ``"sequential"``.
        max_iters: cap on model calls in sequence (default and at most: ``N``).
        throw: raise :class:`paraprop.ConvergenceError` if the result is not certified.
        generator: draws the noise, in the order of the diffusers loop with this generator
            (initial sample, then each step's noise), so the diffusers loop seeded alike gives
            the same sample.
        noise: instead, all the noise: ``(N + 1, *shape)``, row ``0`` the initial sample and
            row ``1 + s`` the noise of step ``s`` (ignored where the step adds none).
        eta: DDIM's ``eta`` (default ``0``); DDPM refuses it.
        use_clipped_model_output: DDIM's option of the same name.
        split: the linear part of the Picard split: ``"identity"`` (ParaDiGMS' drift form) or
            ``"eps"`` (the step's derivative with the model output held fixed).
        dtype, device: of the noise and the sample (default: the model's parameters', else
            float32 on the CPU; ``noise``'s when given).
        shard: ``None``, or a ``torch.distributed`` process group (or ``True`` for the default
            group): each rank evaluates its share of every window's rows, and all ranks return
            the same result (:mod:`paraprop.diffusion.distributed`).
        callback: ``callback(iteration, trajectory, residual)`` after each iteration.
        model_kwargs: passed to ``model``; tensors whose first dim is ``B`` are repeated for
            every step of a window.

    Returns:
        ``(x, solution)``: the sample ``(B, ...)`` and a :class:`paraprop.Solution` whose
        ``value`` is the trajectory ``(B, N, ...)`` (``x_1 .. x_N``). ``iterations`` (and
        ``evaluations``) is the number of model calls in sequence, every call counted (at most
        ``N``); ``residuals`` holds the parallel iterations' convergence measures. ``stats``:
        ``model_calls``, ``model_evaluations`` (steps evaluated per sample, all calls
        together), ``max_rows`` (the most rows one call held), ``passes`` (solver passes),
        ``fallback_steps`` (steps the loop computed from the certified prefix),
        ``certificate`` (``"bitwise"``, ``"estimate"`` or ``None``), ``bitwise`` (per sample),
        ``error_estimate``, ``rounding_floor``, ``tol_resolvable``, ``loop_bitwise`` (whether
        the batched calls gave the loop's bits for step 0 and for every certified step they
        computed again; ``None`` where not compared), ``reason`` (why not converged),
        ``window``, ``steps``, ``sample_iterations``, ``time_s``.

    Raises:
        NotImplementedError: an unsupported scheduler or scheduler configuration.
        paraprop.StochasticModelError: ``model`` is a module in train mode with dropout or
            batch statistics (call ``model.eval()``).
        ValueError / TypeError: bad arguments, a ``noise`` of the wrong shape, a model output
            of the wrong shape or dtype (each message names the argument and both values).
        paraprop.NonFiniteError: a step computed from exact inputs is not finite (the loop
            gives it too; the message names the step).
        paraprop.ConvergenceError: not certified (``max_iters`` or the budget of ``N`` calls
            ended first, or ``tol=0`` and the model's batched calls round differently from the
            loop's) and ``throw=True``; the message says which.

    Warns:
        BatchVarianceWarning: ``tol > 0`` and the model's batched calls round differently from
            the loop's by an amount that may matter at ``tol`` (the estimate then bounds the
            distance to the trajectory as the batched calls compute each step).

    Example:
        >>> from diffusers import DDIMScheduler
        >>> eps = lambda x, t: 0.1 * x
        >>> def run(method):
        ...     return paraprop.diffusion.sample(eps, DDIMScheduler(), (4, 2), method=method,
        ...         num_inference_steps=20, generator=torch.Generator().manual_seed(0))
        >>> (x, sol), (ref, _) = run("picard"), run("sequential")
        >>> bool((x - ref).abs().max() <= 1e-3), sol.iterations < 20
        (True, True)
    """
    checks.callable_arg("model", model)
    require_deterministic(model, argument="model", entry="diffusion.sample")
    shape = _shape(shape)
    N = checks.positive_int("num_inference_steps", num_inference_steps)
    check_tol(tol)
    check_max_iters(max_iters)
    checks.one_of("split", split, SPLITS)
    checks.boolean("use_clipped_model_output", use_clipped_model_output)
    window = checks.positive_int("window", window, allow_none=True)
    checks.callable_arg("callback", callback, allow_none=True)
    table = step_table(scheduler, N, eta=_eta(scheduler, eta),
                       use_clipped_model_output=use_clipped_model_output)
    dtype, device = _dtype_device(model, noise, dtype, device)
    if noise is None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got "
                            f"{type(generator).__name__}")
        noise = draw_noise(table, shape, generator=generator, dtype=dtype, device=device)
    else:
        if generator is not None:
            raise ValueError("pass either noise or generator, not both")
        noise = _check_noise(noise, N, shape)
    solver = _solver(method, window, memory, N)
    evaluate = None
    if shard is not None and shard is not False:
        from paraprop.diffusion.distributed import sharded_evaluate
        evaluate = sharded_evaluate(None if shard is True else shard)
    chain = DiffusionChain(model, table, noise[0], noise[1:], model_kwargs, split=split,
                           evaluate=evaluate)
    B = shape[0]
    user_cb = None
    if callback is not None:
        def user_cb(k, v, r):
            callback(k, v.reshape(B, N, *shape[1:]), r)
    start = time.perf_counter()
    with torch.no_grad():
        run, done, bitwise, estimate, reason = _solve_certified(chain, solver, tol, max_iters,
                                                                user_cb)
    converged = bool(done.all())
    traj = run.X.reshape(B, N, *shape[1:])
    name = solver.name if hasattr(solver, "name") else type(solver).__name__
    certificate = None
    if converged:
        certificate = "bitwise" if bool(bitwise.all()) else "estimate"
    stats = {
        "model_calls": chain.model_calls, "sequential_steps": chain.model_calls,
        "model_evaluations": chain.model_rows // B, "max_rows": chain.max_rows,
        "steps": N, "bound": N, "T": N, "split": split, "passes": run.passes,
        "fallback_steps": run.fallback_steps, "positions": run.positions,
        "sample_iterations": run.per_sample,
        "window": _window_of(solver, N),
        "certificate": certificate,
        "bitwise": bitwise.cpu(),
        "error_estimate": float(estimate.max()) if converged else float("inf"),
        "rounding_floor": run.floor, "tol_resolvable": run.tol_resolvable,
        "loop_bitwise": run.loop_bitwise,
        "time_s": time.perf_counter() - start,
    }
    if reason is not None:
        stats["reason"] = reason
    residuals = torch.cat(run.residuals) if run.residuals else torch.zeros(0, dtype=torch.float64)
    sol = Solution(value=traj, method=name, iterations=chain.model_calls,
                   evaluations=chain.model_calls, converged=converged, residuals=residuals,
                   stats=stats)
    sol = ensure_converged(sol, throw, entry="diffusion.sample", max_iters=max_iters, tol=tol,
                           hint=reason or "")
    return traj[:, -1], sol


def _window_of(solver, N: int) -> int:
    if isinstance(solver, Sequential):
        return 1
    if isinstance(solver, SlidingJacobi):
        return min(solver.window or SlidingJacobi.DEFAULT_WINDOW, N)
    return N


def _solver(method, window, memory, N):
    if is_solver(method):
        if window is not None or memory is not None:
            raise ValueError("window and memory configure the named methods; a solver object "
                             f"carries its own settings, got method={method!r}")
        if not isinstance(method, SOLVERS):
            raise ValueError(
                f"method={method!r} is not supported by diffusion.sample: its iterations make "
                "several model calls in sequence (one per step of a block), so it cannot keep "
                "within the loop's num_inference_steps calls; use one of "
                f"{', '.join(c.__name__ + '()' for c in SOLVERS)} or a named method")
        return method
    checks.method_name(method, METHODS)
    if method != "anderson" and memory is not None:
        raise ValueError(f"memory is an option of method='anderson', not of method={method!r}")
    if method == "sequential":
        if window is not None:
            raise ValueError("window is an option of 'picard' and 'anderson', not 'sequential'")
        return Sequential()
    if method == "picard":
        w = window or DEFAULT_WINDOW
        # a window that holds every step is Jacobi on the whole trajectory: its contraction
        # rule needs no freezes (and no growth check), and it stops sooner
        return Jacobi() if w >= N else SlidingJacobi(w)
    if window is not None:
        raise ValueError("window is an option of 'picard'; 'anderson' iterates on all "
                         f"num_inference_steps={N} steps at once, got window={window!r}")
    return TriangularAnderson(memory=memory)


def _shape(shape) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, tuple | list) or not shape or \
            not all(checks.is_int(s) and s >= 1 for s in shape):
        raise ValueError(f"shape must be a non-empty tuple of positive ints (B, ...), got "
                         f"{shape!r}")
    return tuple(int(s) for s in shape)


def _eta(scheduler, eta):
    if scheduler_kind(scheduler) == "ddpm":
        if eta is not None:
            raise ValueError(f"eta is an option of DDIMScheduler; {type(scheduler).__name__} "
                             f"has no eta, got eta={eta!r}")
        return 0.0
    if eta is None:
        return 0.0
    return float(checks.nonneg_number("eta", eta, finite=True))


def _dtype_device(model, noise, dtype, device):
    if noise is not None and isinstance(noise, torch.Tensor):
        return noise.dtype, noise.device
    param = None
    if isinstance(model, torch.nn.Module):
        param = next(iter(model.parameters()), None)
    if dtype is None:
        dtype = param.dtype if param is not None else torch.float32
    if device is None:
        device = param.device if param is not None else torch.device("cpu")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    return dtype, torch.device(device)


def _check_noise(noise, N: int, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(noise, torch.Tensor):
        raise TypeError(f"noise must be a torch.Tensor, got {type(noise).__name__}")
    expected = (N + 1, *shape)
    if tuple(noise.shape) != expected:
        raise ValueError(f"noise must have shape (num_inference_steps + 1, *shape) = "
                         f"{expected}, got {tuple(noise.shape)}")
    if not noise.is_floating_point():
        raise TypeError(f"noise must have a floating-point dtype, got {noise.dtype}")
    if not bool(torch.isfinite(noise).all()):
        raise ValueError("noise must be finite")
    return noise


def rounding_floor(dtype: torch.dtype, scale) -> float:
    """The error an estimate-based certificate cannot resolve in ``dtype`` at values of size
    ``scale``: :data:`FLOOR_ULPS` units of ``dtype``'s resolution at ``max(1, scale)``."""
    return FLOOR_ULPS * torch.finfo(dtype).eps * max(1.0, float(scale))


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
        self.loop_bitwise = None
        self.loop_gap = 0.0

    @property
    def left(self) -> int:
        return self.cap - self.chain.model_calls

    def solve(self, solver, lo: int, tol: float, max_iters: int, keep: torch.Tensor):
        """One pass of ``solver`` on the steps ``[lo, N)`` from the current trajectory; the
        samples ``keep`` (certified already) keep their values."""
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

        def watch(k, v, r):
            self.iterations = offset + k
            if cb is not None:
                cb(k, v, r)
            if self.strict and chain.irreproducible_seen:   # (no extra sync: read in window)
                last["value"] = v.clone()
                raise _Stop

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
            X[:, lo:] = last["value"]
            X[keep] = saved
            self._compare()
            return None
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
        y = chain.steps(chain.x_init[:, None], 0, 1)[:, 0]
        check_steps_finite(y[:, None])
        self.X[:, 0] = y
        chain.exact_values[:, 0] = y
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


def _solve_certified(chain, solver, tol, max_iters, callback):
    """Solve the chain within ``N`` sequential model calls (``max_iters`` if fewer) and
    certify every sample (:func:`_passes`).

    The first call of a parallel solve is the loop's own first step (``B`` rows), and the first
    batched call evaluates the model on step 0 again, among ``n * B`` rows. A model whose
    kernels round a row differently in such a batch (batch variance), or nondeterministic
    kernels, show a difference there or at a certified step computed again
    (``stats["loop_bitwise"] = False``): the parallel fixed point is then the sequential
    trajectory as the *batched* calls compute each step, not the loop's bit for bit. At
    ``tol=0`` (and at a ``tol`` below the rounding floor, which only the loop's bits can
    certify) the solve stops with ``converged=False`` at once; above it the estimate bounds the
    distance to that batched trajectory, and a ``BatchVarianceWarning`` says so where the
    difference may matter.

    Returns ``(run, done, bitwise, estimate, reason)``.
    """
    N = chain.N
    cap = N if max_iters is None else min(max_iters, N)
    run = _Run(chain, cap, callback)
    done, bitwise, estimate, reason = _passes(run, chain, solver, tol, max_iters, cap)
    run.finish()
    if run.loop_bitwise is False:
        what = (f"the model rounds differently on the batched calls ({chain.max_rows} rows) "
                f"than on the loop's ({chain.B} rows): its output for step 0 differs by "
                f"{run.loop_gap:.3g} (batch-variant or nondeterministic kernels)")
        if not run.tol_resolvable:   # tol=0, or below the rounding floor: bits or nothing
            done = torch.zeros_like(done)
            reason = (f"{what}, so no parallel method gives the loop's bits; use "
                      "method='sequential' for them, or a tol above the dtype's rounding "
                      f"floor ({rounding_floor(chain.dtype, SCALE):.3g} at values of size "
                      f"{SCALE:g})")
        elif bool(done.any()) and chain.N * _output_gain(chain.table) * run.loop_gap > tol / 100:
            warnings.warn(f"diffusion.sample: {what}; the error estimate bounds the distance "
                          "to the sequential trajectory as the batched calls compute each "
                          "step, and the loop's own sample differs from it by these rounding "
                          "differences carried along the chain (compare with "
                          "method='sequential' once)", BatchVarianceWarning, stacklevel=3)
        bitwise = torch.zeros_like(bitwise)
    return run, done, bitwise, estimate, reason


def _output_gain(table) -> float:
    """The largest ``|d step_s / d model_output|`` over the steps (no clipping): how much a
    rounding difference of the model's output moves one step."""
    sa, sb, c0 = (v.to(torch.float64) for v in (table.sqrt_alpha, table.sqrt_beta,
                                                table.coef_x0))
    if table.kind == "ddpm":
        k = {"epsilon": c0 * sb / sa, "sample": c0, "v_prediction": c0 * sb}[table.prediction]
    else:
        ce = table.coef_eps.to(torch.float64)
        k = {"epsilon": ce - c0 * sb / sa, "sample": c0 - ce * sa / sb,
             "v_prediction": ce * sa - c0 * sb}[table.prediction]
    return float(k.abs().max())


class BatchVarianceWarning(RuntimeWarning):
    """The model's output for a row depends on the other rows of its batch (or its kernels are
    nondeterministic): a parallel sample is the sequential one as the batched calls compute each
    step, which differs from the loop's by that rounding."""


def _passes(run, chain, solver, tol, max_iters, cap):
    """The passes of :func:`_solve_certified`:

    * Estimate stage (``tol`` above the rounding floor of the initial noise's scale): the
      solver runs at ``tol`` less that floor (:func:`_estimate_stage`).
    * Exact stage, for the samples left (:func:`_exact_stage`).

    Returns ``(done, bitwise, estimate, reason)``: per sample, certified at all, certified
    bitwise, and the accepted estimate (``0`` where bitwise).
    """
    N, B = chain.N, chain.B
    done = torch.zeros(B, dtype=torch.bool, device=chain.device)
    estimate = torch.zeros(B, dtype=torch.float64, device=chain.device)
    # the floor at a scale the trajectory may grow to and keep the estimates the solver
    # stopped on: twice the initial noise's, and at least 4 (unit-variance noise, data in
    # [-1, 1]), or 1/64 of tol where that is more; a sample whose floor exceeds that reserve
    # is finished exactly
    floor0 = rounding_floor(chain.dtype, max(SCALE, 2 * float(chain.x_init.abs().max())))
    run.tol_resolvable = tol > floor0   # an estimate can resolve tol in this dtype
    run.strict = not run.tol_resolvable   # only the loop's bits can certify such a tol
    if isinstance(solver, Sequential) or N == 1:
        if cap < N:
            return done, done, estimate, (f"the loop needs num_inference_steps={N} model "
                                          f"calls, more than max_iters={max_iters}")
        run.sequential(0, done)
        return ~done, ~done, estimate, None
    if _window_of(solver, N) > 1:   # (a window of one step: every call is the loop's)
        run.first_step()
    if run.tol_resolvable:
        # the solver runs at tol less a reserve for the floor at the final trajectory's scale
        floor0 = max(floor0, tol / 64)
        stage = _sliding_stage if isinstance(solver, SlidingJacobi) else _estimate_stage
        done, estimate = stage(run, chain, solver, tol, floor0)
    chain.track_gains = False
    by_estimate = done & (estimate > 0)   # (an accepted estimate includes a floor > 0)
    done = _exact_stage(run, chain, solver, done)
    reason = None
    if not bool(done.all()):
        reason = (f"the budget of {cap} sequential model calls (num_inference_steps={N}"
                  f"{'' if max_iters is None else f', max_iters={max_iters}'}) ran out before "
                  "the result was certified; a parallel method never takes more model calls in "
                  "sequence than the loop")
    return done, done & ~by_estimate, estimate, reason


def _accept(run, chain, done, estimate, stopped, bound, tol, since=None):
    """Accept the samples ``stopped`` whose estimate ``bound`` (``(B,)``), with the rounding
    floor at the scale of their trajectory, is ``<= tol``, and whose estimate does not rest on a
    repaired non-finite value (none since the model call ``since``; default: in the last
    iterations the contraction estimate reads); a sample the chain certified exact is accepted
    as such. Returns the new ``(done, estimate)``."""
    floor = _floors(run.X, chain.dtype)
    since = chain.model_calls - RATES - 1 if since is None else since
    fresh = chain.last_repair < since
    exact = chain.certified() >= chain.N
    chain.commit(run.X, exact & ~done)
    ok = stopped & ~done & (exact | ((bound + floor <= tol) & fresh))
    by_estimate = ok & ~exact
    run.floor = max(run.floor, float(torch.where(by_estimate, floor, 0).max()))
    return done | ok, torch.where(by_estimate, bound + floor, estimate)


def _estimate_stage(run, chain, solver, tol, floor0):
    """Jacobi, Anderson and other full-window solvers: one pass from step 0, one iteration less
    than the loop would need from the certified prefix (they certify at least one position
    each, and may verify their last iterate with one more call), each
    sample stopped on the solver's estimate (``<=`` its tol, or the pass's largest)."""
    N, B = chain.N, chain.B
    done = torch.zeros(B, dtype=torch.bool, device=chain.device)
    estimate = torch.zeros(B, dtype=torch.float64, device=chain.device)
    # one call less than the loop would need from the certified prefix: a solver may verify
    # its last iterate with one more call
    budget = min(run.left, N - int(chain.certified().min())) - 1
    if budget < 1:
        return done, estimate
    sol = run.solve(solver, 0, tol - floor0, budget, done)
    its = sol.stats["sample_iterations"].reshape(-1).to(chain.device)
    stopped = torch.ones_like(done) if sol.converged else its < sol.iterations
    top = float(sol.stats.get("error_estimate", tol)) if sol.converged else tol
    bound = torch.full((B,), min(top, tol - floor0), dtype=torch.float64, device=chain.device)
    return _accept(run, chain, done, estimate, stopped, bound, tol)


def _sliding_stage(run, chain, solver, tol, floor0):
    """The sliding window, whose freezes assume that errors do not grow along the chain.

    Pass 1 from step 0 observes every step's gain and budgets each freeze after the growth seen
    so far; each freeze's estimate is then carried to the end through the growth after it
    (:func:`~paraprop.diffusion.chain.growth_after`). Where that exceeds ``tol``: a second pass
    from the certified prefix, each freeze budgeted after that growth, within the budget less what
    the loop needs from the longest prefix whose freezes carry within ``tol``
    (:func:`_certified_prefix`); if it fails, the loop from that prefix."""
    N, B = chain.N, chain.B
    done = torch.zeros(B, dtype=torch.bool, device=chain.device)
    estimate = torch.zeros(B, dtype=torch.float64, device=chain.device)
    if run.left < 1:
        return done, estimate
    chain.track_gains = chain.live_growth = True
    # a repaired value the window froze would stay: no repair at all in the pass
    since = chain.model_calls
    sol = run.solve(solver, 0, tol - floor0, run.left, done)
    growth = None if chain.gain is None else growth_after(chain.gain)
    freezes = sol.stats.get("freeze_estimates")
    bound = _carried_error(freezes, growth).to(chain.device, torch.float64).expand(B)
    stopped = torch.ones_like(done) if sol.converged else torch.zeros_like(done)
    done, estimate = _accept(run, chain, done, estimate, stopped, bound, tol, since)
    fresh = bool((chain.last_repair < since).all())
    if bool(done.all()) or not sol.converged or growth is None or not fresh:
        return done, estimate
    floor = _floors(run.X, chain.dtype)
    q, _ = _certified_prefix(freezes, growth, tol - floor)
    start = int(q[~done].min())
    reserve = N - start if 0 < N - start <= run.left else None
    lo = int(chain.certified()[~done].min())
    cap = run.left - (reserve or 0)
    # the loop from `start` costs `reserve` calls for sure; a second pass, about what the first
    # cost: take the cheaper
    if cap >= 1 and (reserve is None or reserve > sol.iterations):
        saved = run.X.clone()
        chain.growth = growth
        since = chain.model_calls
        sol2 = run.solve(solver, lo, tol - floor0, cap, done)
        if sol2.converged and bool((chain.last_repair < since).all()):
            bound2 = _carried_error(sol2.stats.get("freeze_estimates"),
                                    growth_after(chain.gain)[:, lo:])
            done, estimate = _accept(run, chain, done, estimate, torch.ones_like(done),
                                     bound2.to(chain.device, torch.float64).expand(B), tol,
                                     since)
            if bool(done.all()):
                return done, estimate
        if reserve is not None:   # back to pass 1's trajectory, for the loop from `start`
            run.X[~done] = saved[~done]
            back = ~done & (chain.exact > lo)   # its certificates beyond lo are pass 2's
            chain.exact = torch.where(back, lo, chain.exact)
            chain.has_next = chain.has_next & ~back
    if reserve is None or bool(done.all()):
        return done, estimate
    run.sequential(start, done)
    carried = _contributions(freezes, growth)[:, :start].sum(1)
    return _accept(run, chain, done, estimate, torch.ones_like(done), carried, tol,
                   chain.model_calls + 1)


def _exact_stage(run, chain, solver, done):
    """The samples not ``done``, exactly: one pass that certifies at least one position per
    call (capped to leave the loop the rest), then the loop from the certified prefix; the
    first batched call starts at step 0 (the batch-variance check, :func:`_solve_certified`).
    Returns ``done`` with the samples certified."""
    N = chain.N
    passed = False
    while True:
        certified = chain.certified()
        chain.commit(run.X, ~done)
        left = ~done & (certified < N)
        if not bool(left.any()):
            return torch.ones_like(done) | done
        first = int(certified[left].min())   # the loop would go on from here
        keep = ~left
        affordable = run.left >= N - first
        if passed or N - first <= 1:
            if not affordable:
                break
            run.sequential(first, keep)
            continue
        # each call certifies a position; one call is left for a solver's last verification
        steps = min(run.left, N - first) - 1 if affordable else run.left - 1
        if steps < 1:
            break
        # the first batched call computes step 0 again: the batch-variance check
        lo = 0 if chain.loop_gap is None else first
        if run.solve(solver, lo, 0.0, steps, keep) is None:   # not the loop's bits
            return done
        passed = True
    exact = chain.certified() >= N
    chain.commit(run.X, exact & ~done)
    return done | exact


def _floors(X: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(B,)``: :func:`rounding_floor` at the scale of each sample's trajectory."""
    scale = X.abs().flatten(1).amax(1).to(torch.float64).clamp(min=1.0)
    return FLOOR_ULPS * torch.finfo(dtype).eps * scale


def _contributions(freezes, growth) -> torch.Tensor | None:
    """``(B, T)``: each freeze's estimate times the growth after it (:func:`growth_after`),
    ``inf`` for a freeze with no observed gain (``growth=None``); ``None`` without freezes."""
    if freezes is None:
        return None
    if growth is None:
        return torch.where(freezes > 0, torch.inf, 0.0)
    return torch.where(freezes > 0, freezes * growth, 0.0)


def _carried_error(freezes, growth) -> torch.Tensor:
    """Per sample: the sum over freezes of their estimate times the growth after them."""
    c = _contributions(freezes, growth)
    return torch.zeros(1, dtype=torch.float64) if c is None else c.sum(1)


def _certified_prefix(freezes, growth, limit: torch.Tensor):
    """Per sample, the longest prefix ``[0, q)`` whose freezes, carried to the end, stay within
    ``limit`` ``(B,)``, and what they carry: ``(q, carried)``, ``(B,)`` each. The loop from
    ``q`` then finishes the sample within ``limit`` of the sequential one."""
    c = _contributions(freezes, growth)
    if c is None:
        return None, None
    total = c.cumsum(1)                                        # carried by the freezes < q + 1
    q = (total <= limit.to(total)[:, None]).long().sum(1)      # monotone: a count is the q
    before = torch.cat([torch.zeros_like(total[:, :1]), total], dim=1)
    return q, before.gather(1, q[:, None])[:, 0]

