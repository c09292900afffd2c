"""``paraprop.sampling.sample``: ancestral sampling as a triangular system (Song et al. 2021, §5.3).

With the noise drawn up front, the sample is the unique solution of ``x = g(x, noise)``: every
method of :func:`paraprop.solve` returns the ancestral sample for that noise, and Jacobi reaches it
in far fewer network evaluations than ``D``.
"""

from __future__ import annotations

import math
import time

import torch

from paraprop import checks
from paraprop.determinism import refuse_random_draws, require_deterministic
from paraprop.driver import Outcome, build
from paraprop.result import Result
from paraprop.solve import Solution, normalise_dims, solve
from paraprop.solvers import is_solver

SAMPLING_METHODS = ("sequential", "jacobi", "jacobi_gs", "gs_jacobi", "sliding_jacobi",
                    "fixed_passes")


def sample(model, n: int, *, method="jacobi", tol: float = 1e-5, noise=None,
           generator: torch.Generator | None = None,
           max_iters: int | None = None, throw: bool = True) -> tuple[torch.Tensor, Solution]:
    """Draw ``n`` samples from an autoregressive ``model``.

    Arguments:
        model: any object with ``noise_shape(n)``, ``draw_noise(n, generator)`` and
            ``sampling_map(noise)``; the last returns the system (a callable, optionally with
            ``update(x, index)``, and attributes ``x0``, ``dim`` and ``to_data(x)``), e.g.
            :class:`paraprop.models.MADE`.
        n: number of samples.
        method: ``"sequential"`` (ancestral sampling), ``"jacobi"``, ``"jacobi_gs"``,
            ``"gs_jacobi"``, ``"sliding_jacobi"``, a configured solver object of
            :mod:`paraprop.solvers` (e.g. ``JacobiGS(block_size=8)``), or ``"fixed_passes"``
            (``D`` Jacobi passes without a stop: what the flow libraries do today). A model may
            provide its own implementations (and extra methods) through ``model.samplers()``, a
            dict of ``name -> f(noise, *, block_size, tol, max_iters, throw)``;
            :class:`paraprop.models.PixelCNN` does, with cached samplers (a solver object's
            ``block_size`` is passed on as the rows per block or window).
        tol: the error bound of the iterative methods (see :func:`paraprop.solve`; ``0``:
            bitwise fixed point).
            Not used by ``"sequential"``, ``"sequential_cached"`` and ``"fixed_passes"`` (they
            are exact by construction). For the discrete PixelCNN any ``tol`` below the grid
            step ``2 / (levels - 1)`` means "stop when no pixel changes" (the exact image).
        noise: the noise to use (shape ``model.noise_shape(n)``); drawn with ``generator`` if
            ``None``. The same noise gives the same sample with every method.
        generator: random generator for the noise.
        max_iters: iteration cap (default: the method's exactness bound; for ``gs_jacobi`` the
            sweeps of all blocks together). ``"fixed_passes"`` and
            ``"sequential_cached"`` refuse it (``ValueError``).
        throw: raise :class:`paraprop.ConvergenceError` (its ``.solution`` holds the result)
            if ``max_iters`` stops the solve first; ``False`` returns the unconverged Solution.

    Returns:
        ``(x, solution)``: samples in data order and the :class:`paraprop.Solution`.

    Raises:
        ValueError: bad ``n``, ``method`` or a ``noise`` of the wrong shape; and everything
            :func:`paraprop.solve` raises (a model with broken masks gives
            :class:`paraprop.NotTriangularError`).
        paraprop.StochasticModelError: ``model`` (an ``nn.Module``) is in train mode with
            dropout, another random layer or a norm layer reading batch statistics: its
            repeated evaluation differs, so there is no ancestral sample to reproduce; call
            ``model.eval()``. Also a model whose network drew random numbers while sampling
            (``torch.randn_like`` in a ``forward``: the device's global generator moved).

    Example:
        >>> m = paraprop.models.MADE(64, (128, 128))
        >>> x, sol = paraprop.sampling.sample(m, 10, generator=torch.Generator().manual_seed(0))
    """
    checks.positive_int("n", n)
    require_deterministic(model, argument="model", entry="paraprop.sampling.sample")
    special = model.samplers() if callable(getattr(model, "samplers", None)) else {}
    solver, block_size = None, None
    if is_solver(method):
        solver, block_size = method, getattr(method, "block_size", None)
        method = method.name
    elif not isinstance(method, str):
        raise TypeError("method must be a method name or a solver object from "
                        f"paraprop.solvers, got {type(method).__name__}")
    checks.one_of("method", method, dict.fromkeys([*SAMPLING_METHODS, *special]))
    expected = tuple(model.noise_shape(n))
    if noise is None:
        noise = model.draw_noise(n, generator)
    elif not isinstance(noise, torch.Tensor) or tuple(noise.shape) != expected:
        got = tuple(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
        raise ValueError(f"noise must have shape {expected} for n={n}, got {got}")
    with refuse_random_draws(noise.device, (
            f"paraprop.sampling.sample: the model drew random numbers while sampling (torch's "
            f"global generator on {noise.device} moved: torch.randn_like, dropout, ... in its "
            "forward): its network gives another value at every evaluation, so there is no "
            "ancestral sample for the noise to reproduce (expected a network that is a fixed "
            "function of its input; all the randomness in the noise). Call model.eval() if it "
            "draws only in training mode, or remove the random operation")):
        x, sol = _run(model, noise, method, special, solver, block_size, tol, max_iters, throw)
    return x, sol


def _run(model, noise, method, special, solver, block_size, tol, max_iters, throw):
    with torch.no_grad():
        system = model.sampling_map(noise)
        if method in special:  # the model's own sampler (e.g. a cached one)
            sol = special[method](noise, block_size=block_size, tol=tol, max_iters=max_iters,
                                  throw=throw)
        elif method == "fixed_passes":
            if max_iters is not None:
                raise ValueError("max_iters is not used by method='fixed_passes' (always D "
                                 f"passes), got max_iters={max_iters!r}")
            sol = _fixed_passes(system)
        else:
            sol = solve(system, system.x0, method=solver or method, dim=system.dim, tol=tol,
                        max_iters=max_iters, throw=throw)
    return system.to_data(sol.value), sol


def _fixed_passes(system) -> Solution:
    """``T`` Jacobi passes from ``x0`` without a stopping rule (nflows/zuko-style inverse)."""
    x = system.x0
    first, last = normalise_dims(system.dim, x.dim())
    T = math.prod(x.shape[first : last + 1])
    start = time.perf_counter()
    for _ in range(T):
        x = system(x)
    out = Outcome(x, Result.successful, evaluations=T, positions=T * T, sequential_steps=T,
                  bound=T, error_estimate=0.0, stats={"T": T})
    return build("fixed_passes", out, iterations=T, time_s=time.perf_counter() - start)
