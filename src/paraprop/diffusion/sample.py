"""``paraprop.diffusion.sample``: a diffusers scheduler's sampling loop, solved in parallel."""

from __future__ import annotations

import dataclasses

import torch

from paraprop import checks
from paraprop.checks import check_max_iters, check_tol
from paraprop.diffusion.chain import DiffusionChain, draw_noise, fill_unobserved
from paraprop.diffusion.schedulers import scheduler_kind, step_table
from paraprop.result import Solution, ensure_converged
from paraprop.solve import solve
from paraprop.solvers import Jacobi, Sequential, SlidingJacobi, TriangularAnderson, is_solver

METHODS = ("sequential", "picard", "anderson")
DEFAULT_WINDOW = 128
SPLITS = ("identity", "eps")


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
    sequential sample for the same noise, within ``tol``.

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
            solver object of :mod:`paraprop.solvers` (e.g. ``SlidingJacobi(128)``,
            ``TriangularAnderson(memory=4)``, ``Jacobi()``) applied to the Picard map.
        window: steps per iteration of ``"picard"`` (``None``: 128; a window of at least ``N``
            steps is Jacobi on the whole trajectory); ``"anderson"`` iterates on all ``N`` steps.
        memory: ``"anderson"``'s history (iterates kept; ``None``: its default).
        tol: a sample stops when the estimated distance of its whole trajectory to the
            sequential one is ``<= tol`` (largest absolute difference; see
            ``docs/diffusion.md``). ``0`` runs to a bitwise fixed point or to the exactness
            bound (``N`` iterations), where the result is the sequential one up to float
            rounding. Not used by ``"sequential"``.
        max_iters: cap on iterations (default: the exactness bound).
        throw: raise :class:`paraprop.ConvergenceError` if ``max_iters`` ends the run first.
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
        ``value`` is the trajectory ``(B, N, ...)`` (``x_1 .. x_N``). ``iterations`` is the
        number of sequential model calls; ``stats`` adds ``model_calls``,
        ``model_evaluations`` (steps evaluated per sample, all calls together) and ``steps``.

    Raises:
        NotImplementedError: an unsupported scheduler or scheduler configuration.
        ValueError / TypeError: bad arguments, a ``noise`` of the wrong shape, a model output
            of the wrong shape (each message names the argument and both values).
        paraprop.ConvergenceError: not converged within ``max_iters`` and ``throw=True``.

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
    B, F = shape[0], chain.F
    X0 = chain.x_init[:, None, :].expand(B, N, F).clone()
    user_cb = None
    if callback is not None:
        def user_cb(k, v, r):
            callback(k, v.reshape(B, N, *shape[1:]), r)
    sliding = isinstance(solver, SlidingJacobi) and tol > 0
    chain.track_gains = sliding
    with torch.no_grad():
        sol, passes = _solve_certified(chain, X0, solver, tol, max_iters, user_cb, sliding)
    traj = sol.value.reshape(B, N, *shape[1:])
    stats = {**sol.stats, "model_calls": chain.model_calls,
             "model_evaluations": chain.model_rows // B, "steps": N, "split": split,
             "passes": passes,
             "window": sol.stats.get("window", 1 if isinstance(solver, Sequential) else N)}
    sol = dataclasses.replace(sol, value=traj, stats=stats)
    sol = ensure_converged(sol, throw, entry="diffusion.sample", max_iters=max_iters, tol=tol)
    return traj[:, -1], sol


def _solver(method, window, memory, N):
    if is_solver(method):
        if window is not None or memory is not None:
            raise ValueError("window and memory configure the named methods; a solver object "
                             f"carries its own settings, got method={method!r}")
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


def _solve_certified(chain, X0, solver, tol, max_iters, callback, sliding):
    """``solve`` on the chain; for the sliding window with ``tol > 0`` also the check that its
    freezes stay within ``tol`` at the end of the chain.

    The window freezes steps whose error it estimates as a share of ``tol``, assuming that
    errors do not grow along the chain. A diffusion chain may expand them (an eps model with a
    large negative gain, or the sharpening late steps of a trained model), so each freeze's
    estimate is carried to the last step through the gains observed for the steps after it
    (``DiffusionChain.gain``, the largest ``|d step(x)| / |d x|`` seen). If the total exceeds
    ``tol``, the solve is repeated from the current trajectory with each freeze's share divided
    by the growth observed after it (``DiffusionChain.growth``); a third pass is exact
    (``tol=0``: the bound of ``N`` sweeps).
    Returns the last Solution, with the iterations and evaluations of all passes, and the
    number of passes.
    """
    iterations = evaluations = positions = 0
    per_sample = None
    residuals = []
    cur, passes, x0 = tol, 0, X0
    while True:
        passes += 1
        left = None if max_iters is None else max_iters - iterations
        sol = solve(chain, x0, method=solver, dim=1, tol=cur, max_iters=left, throw=False,
                    callback=callback)
        iterations += sol.iterations
        evaluations += sol.evaluations
        positions += sol.stats.get("positions", 0)
        its = sol.stats["sample_iterations"]
        per_sample = its if per_sample is None else per_sample + its
        residuals.append(sol.residuals)
        estimate = sol.stats.get("error_estimate", 0.0)
        if sliding and sol.converged and cur > 0:
            growth = None if chain.gain is None else _growth(chain.gain)
            carried = _carried_error(sol.stats.get("freeze_estimates"), growth)
            estimate = float(carried.max())
            if estimate > tol and (left is None or sol.iterations < left):
                # again from the current trajectory, each freeze now budgeted after the growth
                # observed downstream of it; a third pass is exact
                chain.growth = growth
                cur = 0.0 if passes >= 2 else cur
                x0 = sol.value.clone()
                continue
            if estimate > tol:
                sol = dataclasses.replace(sol, converged=False)
        break
    stats = {**sol.stats, "error_estimate": estimate if sol.converged else float("inf"),
             "positions": positions, "sequential_steps": evaluations,
             "sample_iterations": per_sample}
    return dataclasses.replace(sol, iterations=iterations, evaluations=evaluations,
                               residuals=torch.cat(residuals), stats=stats), passes


def _growth(gain) -> torch.Tensor:
    """``(B, N)``: the product of the observed step gains (at least 1) after each step; a step
    never observed takes the sample's largest gain (``inf`` if it has none)."""
    g = fill_unobserved(gain, none=float("inf")).clamp(min=1.0)
    logs = g.log()
    return (logs.flip(1).cumsum(1).flip(1) - logs).exp()


def _carried_error(freezes, growth) -> torch.Tensor:
    """Per sample: the sum over freezes of their estimate times the growth after them
    (:func:`_growth`); with freezes but no observed gain (``growth=None``) not certified
    (``inf``)."""
    if freezes is None:
        return torch.zeros(1, dtype=torch.float64)
    if growth is None:
        return torch.where(freezes.sum(1) > 0, torch.inf, 0.0)
    carried = freezes * growth
    return torch.where(freezes > 0, carried, 0.0).sum(1)
