"""``paraprop.diffusion.sample``: a diffusers scheduler's sampling loop, solved in parallel."""

from __future__ import annotations

import math
import time

import torch

from paraprop import checks
from paraprop.checks import check_max_iters, check_tol
from paraprop.determinism import require_deterministic
from paraprop.diffusion import readers
from paraprop.diffusion.certificate import GainCertificate, window_of
from paraprop.diffusion.chain import DiffusionChain, draw_noise
from paraprop.diffusion.history import (
    check_mu,
    loop_solution,
    refuse_ddim_options,
)
from paraprop.diffusion.programs import (
    HistoryProgram,
    MarkovProgram,
    markov,
    refuse_split,
)
from paraprop.diffusion.readers import READERS
from paraprop.diffusion.schedulers import StepTable, scheduler_kind, step_table
from paraprop.diffusion.wrapped import wrapped_modules
from paraprop.driver import Outcome, build
from paraprop.result import Result, Solution, ensure_converged
from paraprop.solvers import Jacobi, Sequential, SlidingJacobi, TriangularAnderson, is_solver

METHODS = ("sequential", "picard", "anderson")
# solver objects whose every iteration is one model call that certifies at least one position
SOLVERS = (Jacobi, SlidingJacobi, TriangularAnderson, Sequential)
DEFAULT_WINDOW = 128
WINDOWED = ("picard",)   # the named methods that take a window (checks.window_option)
SPLITS = ("identity", "eps")


def sample(model, scheduler, shape, *, num_inference_steps: int, method="picard",
           window: int | None = None, memory: int | None = None, tol: float = 1e-3,
           max_iters: int | None = None, throw: bool = True, generator=None, noise=None,
           eta: float | None = None, use_clipped_model_output: bool = False,
           split: str = "identity", mu: float | None = None,
           dtype: torch.dtype | None = None, device=None, shard=None, callback=None,
           **model_kwargs) -> tuple[torch.Tensor, Solution]:
    """Sample a diffusion model with ``scheduler``'s update rule, as the diffusers loop would, but
    with a window of steps per batched model call.

    The loop ``x = scheduler.step(model(x, t), t, x).prev_sample`` over
    ``scheduler.timesteps``, with every step's noise drawn up front, is a triangular system over
    the steps (:mod:`paraprop.diffusion.chain`). Every method returns its unique solution: the
    sequential sample for the same noise, within ``tol`` (at ``tol=0`` bit for bit), in at most
    ``N`` model calls in sequence, the number the loop takes.

    Arguments:
        model: a diffusers ``UNet2DModel``, or any module or callable ``model(x, t, **kw)``
            returning the model output shaped like ``x`` (``t``: a 1-D tensor of the
            scheduler's timesteps, one per row of ``x``: long for DDPM/DDIM/LCM/DPM-Solver,
            float for the sigma schedulers; a window's rows are its steps one after another,
            each holding the whole batch). Where the scheduler has ``scale_model_input``, the
            model reads the scaled rows, as in the pipelines.
        scheduler: a diffusers ``DDPMScheduler`` or ``DDIMScheduler`` (or their parallel
            variants), or a scheduler with a reader (:mod:`paraprop.diffusion.readers`):
            ``EulerDiscreteScheduler``, ``EulerAncestralDiscreteScheduler``,
            ``FlowMatchEulerDiscreteScheduler``, ``LCMScheduler``,
            ``DPMSolverMultistepScheduler`` of order 1-3, ``UniPCMultistepScheduler`` and
            ``HeunDiscreteScheduler`` (every method; the steps that read earlier steps through
            :class:`~paraprop.diffusion.programs.HistoryProgram`).
            ``set_timesteps(num_inference_steps, device=...)`` is
            called on it, as a pipeline does. Other schedulers raise ``NotImplementedError``;
            a setting a reader does not implement raises ``ValueError`` naming it.
        shape: the batch shape ``(B, ...)``, e.g. ``(16, 2)`` or ``(4, 1, 28, 28)``.
        num_inference_steps: the number of denoising steps (``N`` model calls in the loop;
            Heun's loop makes ``2 N - 1``, and ``N`` below is that count).
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
        noise: instead, all the noise: ``(N + 1, *shape)``, row ``0`` the initial latents
            (before ``init_noise_sigma``, which is applied as the pipelines apply it) and
            row ``1 + s`` the noise of step ``s`` (ignored where the step adds none; cast to
            the dtype the loop draws it in: float32 for flow matching and DPM-Solver).
        eta: DDIM's ``eta`` (default ``0``); every other scheduler refuses it.
        use_clipped_model_output: DDIM's option of the same name (refused by the others).
        split: the linear part of the Picard split: ``"identity"`` (ParaDiGMS' drift form) or
            ``"eps"`` (the step's derivative with the model output held fixed; DDPM and
            DDIM only, the readers' schedulers refuse it).
        mu: ``set_timesteps``' ``mu`` for a scheduler with ``use_dynamic_shifting=True``
            (flow matching as in SD3/Flux; required there, refused elsewhere).
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
        the batched calls gave the loop's bits for the steps compared with the loop's own
        call of ``B`` rows, ``batch_checked_steps``: step 0 and the last step, where the
        budget has the call, and for every certified step they computed again; ``None``
        where not compared), ``batch_probed_steps`` (``[a, N]``: the steps whose gains were
        probed in the batch variance's direction, one model call per window of steps, where
        the batched calls round apart from the loop's at a resolvable ``tol``; ``None`` where
        none was, for want of a call among them), ``reason`` (why not converged),
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
            measured difference at every step; it is measured at step 0 and the last step
            only).

    Example:
        >>> from diffusers import DDIMScheduler
        >>> eps = lambda x, t: x
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
    checks.callable_arg("callback", callback, allow_none=True)
    reader = None
    if type(scheduler).__name__ in READERS:   # the schedulers beyond DDPM/DDIM: a reader
        refuse_ddim_options(scheduler, eta, use_clipped_model_output)
        if split != "identity":
            raise refuse_split(type(scheduler).__name__, split)
        mu = check_mu(scheduler, mu)
        dtype, device = _dtype_device(model, noise, dtype, device)
        reader = readers.reader(scheduler, N, mu=mu, device=device)
        table: StepTable | MarkovProgram | None = None
        solver = _solver(method, window, memory, reader.K)
        if markov(reader):
            table = MarkovProgram(reader)
        elif not isinstance(solver, Sequential):
            # (a reader with history, in parallel; sequential: the loop through the reader)
            table = HistoryProgram(reader)
        N = reader.K   # model calls of the loop (Heun: 2 per step but the last)
        latents, z = _reader_noise(reader, noise, generator, shape, dtype, device)
        x_init = reader.initial(latents)
        # a state of several parts (UniPC): (B, parts, ...), the sample part 0
        x_init = x_init[0] if table is None or reader.parts == 1 else x_init.transpose(0, 1)
    else:
        table = step_table(scheduler, N, eta=_eta(scheduler, eta, use_clipped_model_output),
                           use_clipped_model_output=use_clipped_model_output)
        check_mu(scheduler, mu)
        dtype, device = _dtype_device(model, noise, dtype, device)
        if noise is None:
            _check_generator(generator)
            noise = draw_noise(table, shape, generator=generator, dtype=dtype, device=device)
        else:
            if generator is not None:
                raise ValueError("pass either noise or generator, not both")
            noise = _check_noise(noise, N, shape)
        x_init, z = noise[0], noise[1:]
        solver = _solver(method, window, memory, N)
    evaluate = None
    if shard is not None and shard is not False:
        from paraprop.diffusion.distributed import sharded_evaluate
        evaluate = sharded_evaluate(None if shard is True else shard)
    B = shape[0]
    if table is None:   # a reader with history: the diffusers loop through it
        assert reader is not None
        sol = loop_solution(reader, model, x_init, z, model_kwargs, evaluate, max_iters,
                            num_inference_steps, split)
        sol = ensure_converged(sol, throw, entry="diffusion.sample", max_iters=max_iters,
                               tol=tol, hint=sol.stats.get("reason", ""))
        return sol.value[:, -1], sol
    chain = DiffusionChain(model, table, x_init, z, model_kwargs, split=split,
                           evaluate=evaluate)
    user_cb = None
    if callback is not None:
        def user_cb(k, v, r):
            callback(k, _samples(v, B, N, shape), r)
    start = time.perf_counter()
    with torch.no_grad():
        run, done, bitwise, estimate, reason = GainCertificate(tol, max_iters).solve(
            chain, solver, user_cb)
    converged = bool(done.all())
    traj = _samples(run.X, B, N, shape)
    # the method as the user named it ("picard" runs Jacobi or sliding Jacobi: the first GPU
    # run's refusal said method='jacobi' to a caller who had asked for 'picard')
    name = method if isinstance(method, str) else (
        solver.name if hasattr(solver, "name") else type(solver).__name__)
    certificate = None
    if converged:
        certificate = "bitwise" if bool(bitwise.all()) else "estimate"
    stats = {
        "model_calls": chain.model_calls,
        "model_evaluations": chain.model_rows // B, "max_rows": chain.max_rows,
        "steps": N, "T": N, "split": split, "passes": run.passes,
        "fallback_steps": run.fallback_steps,
        "sample_iterations": run.per_sample,
        "window": window_of(solver, N),
        "certificate": certificate,
        "bitwise": bitwise.cpu(),
        "rounding_floor": run.floor, "tol_resolvable": run.tol_resolvable,
        "loop_bitwise": run.loop_bitwise, "batch_checked_steps": run.checked_steps,
        "batch_probed_steps": None if run.probed_from == N else [run.probed_from, N],
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


def _samples(X: torch.Tensor, B: int, N: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The samples ``(B, N, ...)`` of the chain's states ``X`` ``(B, N, parts * F)`` (part 0)."""
    return X.reshape(B, N, -1, math.prod(shape[1:]))[:, :, 0].reshape(B, N, *shape[1:])


def _solver(method, window, memory, N):
    if is_solver(method):
        if memory is not None:
            raise ValueError("memory configures the named method 'anderson'; a solver object "
                             f"carries its own settings, got method={method!r}")
        checks.window_option(window, None, WINDOWED)
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
    window = checks.window_option(window, method, WINDOWED)
    if method == "sequential":
        return Sequential()
    if method == "picard":
        w = window or DEFAULT_WINDOW
        # a window that holds every step is Jacobi on the whole trajectory: its contraction
        # rule needs no freezes (and no growth check), and it stops sooner
        # (the certificate's final check decides; the solver's stop only ends a pass)
        return Jacobi(accumulation=False) if w >= N else SlidingJacobi(w)
    return TriangularAnderson(memory=memory)


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got "
                        f"{type(generator).__name__}")


def _reader_noise(reader, noise, generator, shape, dtype, device):
    """The latents and every step's noise ``(K, *shape)`` of a reader's loop: drawn in the
    loop's order with ``generator``, or rows of ``noise`` (row ``1 + k``: step ``k``'s, in the
    dtype the loop draws it in)."""
    if noise is None:
        _check_generator(generator)
        return readers.draw_noise(reader, shape, generator=generator, dtype=dtype,
                                  device=device)
    if generator is not None:
        raise ValueError("pass either noise or generator, not both")
    noise = _check_noise(noise, reader.K, shape)
    return noise[0], noise[1:].to(reader.noise_dtype(noise.dtype))


def _shape(shape) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, tuple | list) or not shape or \
            not all(checks.is_int(s) and s >= 1 for s in shape):
        raise ValueError(f"shape must be a non-empty tuple of positive ints (B, ...), got "
                         f"{shape!r}")
    return tuple(int(s) for s in shape)


def _eta(scheduler, eta, use_clipped_model_output):
    """DDIM's ``eta`` (default ``0``); DDPM refuses DDIM's step options by name."""
    if scheduler_kind(scheduler) == "ddpm":
        refuse_ddim_options(scheduler, eta, use_clipped_model_output)
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
