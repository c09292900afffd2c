"""``paraprop.diffusion.sample``: a diffusers scheduler's sampling loop, solved in parallel."""

from __future__ import annotations

import functools
import math
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
    nonfinite_error,
)
from paraprop.diffusion.schedulers import scheduler_kind, step_table
from paraprop.driver import Outcome, build
from paraprop.errors import NonFiniteError
from paraprop.result import Result, Solution, ensure_converged
from paraprop.solve import solve
from paraprop.solvers import Jacobi, Sequential, SlidingJacobi, TriangularAnderson, is_solver

METHODS = ("sequential", "picard", "anderson")
# solver objects whose every iteration is one model call that certifies at least one position
SOLVERS = (Jacobi, SlidingJacobi, TriangularAnderson, Sequential)
DEFAULT_WINDOW = 128
SPLITS = ("identity", "eps")
# units of the dtype's resolution (at the trajectory's scale) an estimate cannot resolve
FLOOR_ULPS = 4
# dtypes whose tol > 0 is certified by the loop's bits only (docs/diffusion.md)
NARROW = (torch.bfloat16, torch.float16)
# a step whose gain was never observed takes the largest of its neighbours' within this many
NEIGHBOURS = 4
# passes of the estimate stage at most (each followed by the final check)
PASSES = 3
# defects of one unit each at this many positions that would use half of tol make the
# estimate stage give way to the exact result at once (_estimate_stage)
HOPELESS = 8
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
        tol: a sample is accepted when the final check bounds the distance of its whole
            trajectory to the loop's by ``tol`` (largest absolute difference): its defects
            under the loop's step map, carried through the steps' observed gains, plus the
            rounding floor (see ``docs/diffusion.md``). Where ``tol`` is at or below the floor
            at the initial noise's scale, and at any ``tol`` in bfloat16 and float16
            (``stats["tol_resolvable"] == False``), the method runs to the loop's bits.
            ``0``: the loop's trajectory bit for bit, or ``converged=False`` (where the
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
            batch statistics (call ``model.eval()``), also behind a ``functools.partial``, a
            bound method or a closure (:func:`wrapped_modules`); or, at run time, a step
            computed again differs from its first evaluation beyond what batch variance
            explains, or the loop's first call evaluated again on the same rows differs.
        ValueError / TypeError: bad arguments, a ``noise`` of the wrong shape, a model output
            of the wrong shape or dtype (each message names the argument and both values).
        paraprop.NonFiniteError: a step computed from exact inputs is not finite (the loop
            gives it too; the message names the step).
        paraprop.ConvergenceError: not certified (``max_iters`` or the budget of ``N`` calls
            ended first, or ``tol=0`` and the model's batched calls round differently from the
            loop's) and ``throw=True``; the message says which.

    Warns:
        BatchVarianceWarning: ``tol > 0`` and the model's batched calls round differently from
            the loop's by an amount that may matter at ``tol`` (the estimate carries the
            measured difference at every step; it is measured at step 0 only).

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
    for name, entry, module in wrapped_modules(model):
        require_deterministic(module, argument=name, entry=entry)
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
        "model_calls": chain.model_calls,
        "model_evaluations": chain.model_rows // B, "max_rows": chain.max_rows,
        "steps": N, "T": N, "split": split, "passes": run.passes,
        "fallback_steps": run.fallback_steps,
        "sample_iterations": run.per_sample,
        "window": _window_of(solver, N),
        "certificate": certificate,
        "bitwise": bitwise.cpu(),
        "rounding_floor": run.floor, "tol_resolvable": run.tol_resolvable,
        "loop_bitwise": run.loop_bitwise,
    }
    if reason is not None:
        stats["reason"] = reason
    residuals = torch.cat(run.residuals) if run.residuals else torch.zeros(0, dtype=torch.float64)
    result = (Result.successful if converged else Result.not_certified if reason is not None
              else Result.max_iters_reached)
    out = Outcome(traj, result, evaluations=chain.model_calls, positions=run.positions,
                  sequential_steps=chain.model_calls, bound=N,
                  error_estimate=float(estimate.max()) if converged else float("inf"),
                  stats=stats)
    sol = build(name, out, iterations=chain.model_calls, residuals=residuals,
                time_s=time.perf_counter() - start)
    sol = ensure_converged(sol, throw, entry="diffusion.sample", max_iters=max_iters, tol=tol,
                           hint=reason or "")
    return traj[:, -1], sol


def wrapped_modules(model, name: str = "model", entry: str = "diffusion.sample",
                    depth: int = 3, seen=None):
    """``(name, entry, module)`` for ``model`` and the ``torch.nn.Module`` s it wraps, as far
    as they can be seen: a ``functools.partial`` 's ``func``, ``args`` and ``keywords``, a bound
    method's ``__self__``, ``__wrapped__`` and the variables a function closes over (a lambda
    that reads a global module cannot be seen through: the runtime check,
    :meth:`~paraprop.diffusion.chain.DiffusionChain.diagnose`, catches it)."""
    seen = set() if seen is None else seen
    if id(model) in seen or depth < 0:
        return []
    seen.add(id(model))
    if isinstance(model, torch.nn.Module) or \
            isinstance(getattr(model, "__self__", None), torch.nn.Module):
        return [(name, entry, model)]   # (a bound method such as unet.forward counts as unet)
    found = []

    def visit(obj, sub, sub_entry=entry):
        found.extend(wrapped_modules(obj, sub, sub_entry, depth - 1, seen))

    if isinstance(model, functools.partial):
        visit(model.func, f"{name}.func")
        for i, a in enumerate(model.args):
            visit(a, f"{name}.args[{i}]")
        for k, v in model.keywords.items():
            visit(v, f"{name}.keywords[{k!r}]")
    owner = getattr(model, "__self__", None)
    if owner is not None and not isinstance(model, functools.partial):
        visit(owner, f"{name}.__self__")
    inner = getattr(model, "__wrapped__", None)
    if inner is not None:
        visit(inner, f"{name}.__wrapped__")
    code, cells = getattr(model, "__code__", None), getattr(model, "__closure__", None)
    if code is not None and cells:
        for var, cell in zip(code.co_freevars, cells, strict=False):
            try:
                value = cell.cell_contents
            except ValueError:   # an empty cell
                continue
            visit(value, var, f"{entry} ({name} closes over {var})")
    return found


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
        self.loop_bitwise = None
        self.loop_gap = 0.0

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
                    chain.track_gains = False
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


def _solve_certified(chain, solver, tol, max_iters, callback):
    """Solve the chain within ``N`` sequential model calls (``max_iters`` if fewer) and
    certify every sample (:func:`_passes`).

    The first call of a parallel solve is the loop's own first step (``B`` rows), and the first
    batched call evaluates the model on step 0 again, among ``n * B`` rows. A model whose
    kernels round a row differently in such a batch (batch variance), or nondeterministic
    kernels, show a difference there or at a certified step computed again
    (``stats["loop_bitwise"] = False``; a difference beyond batch variance is a stochastic
    model: :meth:`~paraprop.diffusion.chain.DiffusionChain.diagnose`): the parallel fixed
    point is then the sequential trajectory as the *batched* calls compute each step, not the
    loop's bit for bit. Where only the loop's bits certify ``tol`` (``tol=0``, below the
    rounding floor, bfloat16/float16) the solve stops with ``converged=False``; above it the
    final check carries the measured difference at every step, and a
    ``BatchVarianceWarning`` says so where it may matter.

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
            # carried along the chain of the loop's (the final check's bound, no defects)
            exact = done & (estimate == 0)
            if bool(exact.any()):
                extra = 2 * run.loop_gap * _output_gains(chain.table).to(chain.device)
                gains = _gains(chain.gain, chain.B, chain.N, chain.device)
                full = torch.full_like(chain.exact, chain.N)
                E, _, _ = _bounds(run.X, run.X, full, gains, chain.dtype, extra, loop=False)
                estimate = torch.where(exact, E, estimate)
                done = done & ~(exact & (E > tol))
                if not bool(done.all()):
                    reason = (f"{what}; carried along the chain, that difference may exceed "
                              f"tol={tol:g} (bound {float(E.max()):.3g}): use "
                              "method='sequential' for the loop's sample")
            if bool(done.all()) and \
                    chain.N * _output_gain(chain.table) * run.loop_gap > tol / 100:
                warnings.warn(f"diffusion.sample: {what}; the error estimate includes that "
                              "difference at every step, carried along the chain (measured at "
                              "step 0 only: compare with method='sequential' once)",
                              BatchVarianceWarning, stacklevel=3)
        bitwise = torch.zeros_like(bitwise)
    return run, done, bitwise, estimate, reason


def _output_gain(table) -> float:
    """The largest ``|d step_s / d model_output|`` over the steps (no clipping): how much a
    rounding difference of the model's output moves one step."""
    return float(_output_gains(table).max())


def _output_gains(table) -> torch.Tensor:
    """``(N,)`` float64: ``|d step_s / d model_output|`` per step (no clipping, which only
    lowers it; with thresholding, divided by its least scale, 1)."""
    sa, sb, c0 = (v.to(torch.float64) for v in (table.sqrt_alpha, table.sqrt_beta,
                                                table.coef_x0))
    if table.kind == "ddpm":
        k = {"epsilon": c0 * sb / sa, "sample": c0, "v_prediction": c0 * sb}[table.prediction]
    else:
        ce = table.coef_eps.to(torch.float64)
        k = {"epsilon": ce - c0 * sb / sa, "sample": c0 - ce * sa / sb,
             "v_prediction": ce * sa - c0 * sb}[table.prediction]
    return k.abs()


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
    chain.track_gains = run.tol_resolvable
    if _window_of(solver, N) > 1:   # (a window of one step: every call is the loop's)
        run.first_step()
    if run.tol_resolvable:
        done, estimate = _estimate_stage(run, chain, solver, tol, max(floor0, tol / 64))
    by_estimate = done & (estimate > 0)   # (an accepted estimate includes a floor > 0)
    done, estimate = _exact_stage(run, chain, solver, done, estimate, tol)
    by_estimate = by_estimate | (done & (estimate > 0))
    chain.track_gains = False
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
    window = _window_of(solver, N)
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
        tail = Jacobi()
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
    step, :meth:`~paraprop.diffusion.chain.DiffusionChain.direct`: one call per ``window``
    steps whose last evaluation is not at their current input, none where the solver's last
    iterate was evaluated already) and ``r_s = |y_s - X_s|``, the error ``e_s`` of position
    ``s`` against the loop's trajectory obeys ``|e_s| <= g_s |e_{s-1}| + r_s + rho_s``: ``g_s``
    the gain of step ``s`` (the largest ``|d step_s(x)| / |d x|`` observed, in this dtype, for
    input changes above the rounding level; a step never observed counts as unbounded) and
    ``rho_s`` what rounding may add to a difference between two inputs (:data:`RHO_ULPS` units
    of the dtype at the values' scale). Positions before the first defect are exact (their
    values are the direct steps from exact inputs). The bound of a sample is the largest
    ``|e_s|`` the recurrence allows (:func:`_bounds`); it is accepted where ``<= tol``. Where it
    is not, and the loop from some position ``q`` would finish the sample within ``tol`` (the
    error at ``q - 1`` carried on, plus the rounding of the steps after it) within the budget
    (and ``loop_limit`` calls), the loop does so. Returns the new ``(done, estimate)`` and
    the bounds found ``(B,)`` (``None`` where the check was not affordable, or cost as much as
    the loop)."""
    N = chain.N
    undone = ~done
    chain.commit(run.X, undone)
    start = chain.stale_from(run.X, undone)
    calls = -(-(N - start) // window)
    # the loop from the certified prefix is exact: where it costs no more than the check,
    # the exact stage takes it
    if calls > run.left or calls >= N - int(chain.certified()[undone].min()):
        return done, estimate, None
    y = chain.direct(run.X, start, window)
    p = chain.learn_exact(run.X, y, undone)
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
        extra = 2 * gap * _output_gains(chain.table).to(chain.device)
    gains = _gains(chain.gain, chain.B, N, chain.device)
    E, _, rho = _bounds(run.X, y, p, gains, chain.dtype, extra, loop=False)
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
    _, F, _ = _bounds(run.X, y, p, gains, chain.dtype, extra)
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


def _bounds(X: torch.Tensor, y: torch.Tensor, p: torch.Tensor, gain, dtype: torch.dtype,
            extra: torch.Tensor | None = None, loop: bool = True):
    """The bounds of :func:`_check` from the trajectory ``X`` and the direct steps ``y``
    ``(B, N, F)``, the first defect ``p`` ``(B,)`` and the observed gains ``(B, N)`` (NaN: not
    observed, :func:`_gains`).

    Per position ``s > p``: ``E_s = g_s E_{s-1} + r_s`` carries the defects (every one at its
    worst), and ``R_s = max(g_s R_{s-1}, rho_s)`` the rounding floor: ``rho_s`` is
    :data:`FLOOR_ULPS` units of the dtype at the position's scale (``max(1, |X_s|)``), what the
    rounding of two computations from nearby inputs leaves between them, carried through the
    growth after it (an expanding chain expands rounding differences too). The bound of a
    position is ``E_s + R_s``.

    Returns ``(E, F, rho)``: ``E`` ``(B,)`` the largest bound over the trajectory; ``F``
    ``(B, N + 1)`` the same where the loop recomputes the positions ``>= q`` from position
    ``q - 1`` (``F[:, N] = E``; ``0`` for ``q <= p``: the loop from an exact input); ``rho``
    ``(B,)`` the largest ``R_s``; ``F`` is ``None`` where ``loop`` is false. In log space:
    ``E_s = exp(L_s) sum_{k <= s} r_k exp(-L_k)`` (a stable cumulative log-sum-exp) and
    ``R_s = exp(L_s) max_{k <= s} rho_k exp(-L_k)``, ``L`` the cumulative log gains.
    """
    B, N = X.shape[:2]
    f64 = torch.float64
    pos = torch.arange(N, device=X.device)[None, :]
    r = (y.to(f64) - X.to(f64)).abs().amax(2).nan_to_num(nan=math.inf, posinf=math.inf)
    r = torch.where(pos < p[:, None], 0.0, r)
    if extra is not None:   # a defect of every step but the loop's own first one
        r = r + torch.where(pos > 0, extra.to(f64)[None, :], 0.0)
        p = torch.zeros_like(p)
    scale = X.to(f64).abs().amax(2).nan_to_num(nan=math.inf, posinf=math.inf).clamp(min=1.0)
    after = pos > p[:, None]
    rho = torch.where(after, FLOOR_ULPS * torch.finfo(dtype).eps * scale, 0.0)
    lg = torch.where(gain.isnan(), math.inf, gain.clamp(min=1e-30).log())
    L = torch.where(after, lg, 0.0).cumsum(1)
    Es = _nan_inf((L + torch.logcumsumexp(r.log() - L, dim=1)).exp())
    Rs = _nan_inf((L + (rho.log() - L).cummax(1).values).exp())
    total = Es + Rs
    E = total.amax(1)
    if not loop:
        return E, None, Rs.amax(1)
    # the loop from q: positions < q keep their bounds; at s >= q the defect part of position
    # q - 1 grows through the gains after it, and the rounding floor is at most R_s
    before = total.cummax(1).values                                  # max_{s <= i}
    top_L = L.flip(1).cummax(1).values.flip(1)                       # max_{s >= i} L_s
    top_R = Rs.flip(1).cummax(1).values.flip(1)                      # max_{s >= i} R_s
    grown = _nan_inf(Es[:, :-1] * (top_L[:, 1:] - L[:, :-1]).exp())
    F = torch.cat([torch.zeros_like(E[:, None]),
                   torch.maximum(before[:, :-1], grown + top_R[:, 1:]), E[:, None]], dim=1)
    q = torch.arange(N + 1, device=X.device)[None, :]
    F = torch.where(q <= p[:, None], 0.0, F)
    return E, F, Rs.amax(1)


def _nan_inf(v: torch.Tensor) -> torch.Tensor:
    """``v`` with NaN (from ``inf - inf`` or ``0 * inf``: an unbounded quantity) as ``inf``."""
    return torch.where(v.isnan(), math.inf, v)


def _gains(gain, B: int, N: int, device) -> torch.Tensor:
    """``(B, N)``: the observed gain of each step, a step never observed taking the largest
    gain observed among its :data:`NEIGHBOURS` neighbours on each side (the coefficients and
    the model vary smoothly with the timestep); NaN (unbounded) where none of them was."""
    if gain is None:
        return torch.full((B, N), math.nan, dtype=torch.float64, device=device)
    k = NEIGHBOURS
    padded = torch.nn.functional.pad(torch.where(gain.isnan(), -math.inf, gain), (k, k),
                                     value=-math.inf)
    near = padded.unfold(1, 2 * k + 1, 1).amax(2)
    return torch.where(gain.isnan(), torch.where(near == -math.inf, math.nan, near), gain)


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
        done, estimate, _ = _check(run, chain, done, estimate, tol, _window_of(solver, N))
    return done, estimate
