"""``paraprop.diffusion.accelerate``: a diffusers pipeline's own denoising loop, through paraprop.

:func:`accelerate` patches, on the instances only (never the classes), the pipeline's denoiser
(``unet`` or ``transformer``: its ``forward``) and its scheduler (``set_timesteps``,
``scale_model_input``, ``step``), and the pipeline's ``prepare_extra_step_kwargs`` where it has
one. The pipeline's ``__call__`` then runs unchanged: at the denoiser's first call of a run the
whole trajectory is solved in parallel (:mod:`paraprop.diffusion.pipeline_run`), and each step
of the pipeline's own loop gets the output paraprop computed at exactly its input; its guidance
arithmetic, ``scheduler.step``, progress bar and callbacks run as usual. Where paraprop does not
solve a run (a setting it does not support or cannot certify), the run falls through to the
plain loop: a :class:`FallThroughWarning` says so once per reason, and the handle records it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from paraprop import checks
from paraprop.checks import check_max_iters, check_tol
from paraprop.diffusion.pipeline_calls import Call, FallThrough, bind, read_call, wrap
from paraprop.diffusion.pipeline_dit import DiTLoop
from paraprop.diffusion.pipeline_run import Run
from paraprop.diffusion.sample import _solver
from paraprop.errors import FallThroughWarning
from paraprop.result import Solution

PATCH = "_paraprop_diffusion_accelerate"   # the instance attribute naming the handle
DENOISERS = ("unet", "transformer")


@dataclasses.dataclass
class Counters:
    """What the accelerated pipeline did since :func:`accelerate`."""

    runs: int = 0            # pipeline runs (set_timesteps calls of its scheduler)
    solved: int = 0          # runs whose trajectory paraprop solved
    certified: int = 0       # of those, the ones paraprop certified (bitwise or within tol)
    steps: int = 0           # steps of the pipelines' loops (scheduler.step calls)
    served: int = 0          # steps whose denoiser output paraprop had computed
    denoiser_calls: int = 0  # real denoiser calls in the pipelines' loops (not served)
    model_calls: int = 0     # denoiser calls in sequence that paraprop's solves made


class Accelerated:
    """The handle :func:`accelerate` returns: ``undo()`` restores the pipeline; a context
    manager that undoes on exit.

    Attributes:
        pipe, denoiser, scheduler: the accelerated pipeline and the patched objects.
        settings: :func:`paraprop.diffusion.sample`'s ``method``, ``window``, ``memory``,
            ``tol``, ``max_iters`` (``tol`` also as ``handle.tol``), as given to :func:`accelerate`.
        counters: :class:`Counters`.
        reasons: ``(run, step, reason)`` of every fall through (``run``: the run's number from
            1, ``step``: the first step the plain loop computed).
        solution: the last solved run's :class:`paraprop.Solution` (``None`` before any).
        active: ``False`` once undone.

    Example:
        >>> import types
        >>> from diffusers import DDIMScheduler
        >>> pipe = types.SimpleNamespace(unet=torch.nn.Identity(), scheduler=DDIMScheduler())
        >>> handle = paraprop.diffusion.accelerate(pipe)
        >>> handle.active, "forward" in vars(pipe.unet), handle.counters.runs
        (True, True, 0)
        >>> handle.undo()
        >>> handle.active, "forward" in vars(pipe.unet), "step" in vars(pipe.scheduler)
        (False, False, False)
    """

    def __init__(self, pipe, denoiser, scheduler, settings: dict[str, Any]):
        self.pipe, self.denoiser, self.scheduler = pipe, denoiser, scheduler
        self.settings = settings   # sample's method, window, memory, tol, max_iters
        self.counters = Counters()
        self.reasons: list[tuple[int, int, str]] = []
        self.solution: Solution | None = None
        self.run: Run | None = None
        self.solving = False
        self._warned: set[str] = set()
        self._replaced = False
        self._saved: list[tuple[Any, str, Any]] = []
        self._install(denoiser, "forward", self._forward)
        self._install(scheduler, "set_timesteps", self._set_timesteps)
        self._install(scheduler, "scale_model_input", self._scale_model_input,
                      optional=True)
        self._install(scheduler, "step", self._step)
        self._install(pipe, "prepare_extra_step_kwargs", self._extra_step_kwargs,
                      optional=True)
        pipe.__dict__[PATCH] = self
        self.active = True

    @property
    def tol(self) -> float:
        return float(self.settings["tol"])

    # -- patches -----------------------------------------------------------------------------
    def _install(self, obj, name: str, method, optional: bool = False) -> None:
        if optional and not hasattr(obj, name):
            return
        original = getattr(obj, name)
        saved = obj.__dict__.get(name, _MISSING)
        self._saved.append((obj, name, saved))
        method = _Proxy(method, original)
        obj.__dict__[name] = method

    def undo(self) -> None:
        """Restore every patched method (again: nothing)."""
        self._end_run()
        for obj, name, saved in reversed(self._saved):
            if saved is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = saved
        self._saved = []
        self.pipe.__dict__.pop(PATCH, None)
        self.run = None
        self.active = False

    def __repr__(self) -> str:
        return (f"Accelerated({type(self.pipe).__name__}, {type(self.scheduler).__name__}, "
                f"tol={self.tol}, {'active' if self.active else 'undone'})")

    def __enter__(self) -> Accelerated:
        return self

    def __exit__(self, *exc) -> None:   # undone, also on an exception (which propagates)
        self.undo()

    # -- the scheduler's and the pipeline's methods ------------------------------------------
    def _set_timesteps(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        if self.solving:
            return out
        self._end_run()
        bound = bind(original, args, kwargs)
        N = bound.get("num_inference_steps")
        reason = None
        if bound.get("timesteps") is not None or bound.get("sigmas") is not None:
            N, reason = None, "the pipeline set custom timesteps or sigmas"
        self.counters.runs += 1
        self.run = Run(N if checks.is_int(N) else None, bound.get("mu"), self.scheduler,
                       reason, loop=DiTLoop.of(self.pipe))
        return out

    def _scale_model_input(self, original, sample, *args, **kwargs):
        if self.run is not None and not self.solving:
            self.run.scaled_input = sample
        return original(sample, *args, **kwargs)

    def _extra_step_kwargs(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        if self.run is not None and not self.solving:
            self.run.extra_step_kwargs = dict(out)
        return out

    def _step(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        run = self.run
        if run is None or self.solving:
            return out
        s = run.step
        run.step += 1
        self.counters.steps += 1
        if run.estimate and s in run.served_steps and run.trajectory is not None \
                and s + 1 < len(run.trajectory):
            # certified within tol: the pipeline follows paraprop's trajectory
            out = _replace_sample(out, run.trajectory[s + 1], run.B)
        if run.loop_steps is not None and run.step >= run.loop_steps:
            self._end_run()
        return out

    # -- the denoiser ------------------------------------------------------------------------
    def _forward(self, original, *args, **kwargs):
        run = self.run
        if not self.solving and getattr(self.pipe, "scheduler", None) is not self.scheduler:
            if not self._replaced:
                self._replaced = True
                self._fall(0, "pipe.scheduler was replaced after "
                           "accelerate (accelerate the pipeline again for the new one)")
            self.counters.denoiser_calls += 1
            return original(*args, **kwargs)
        if self.solving or run is None:
            return original(*args, **kwargs)
        call = read_call(original, args, kwargs)
        s = run.step
        if call is None:
            if run.reason is None:
                run.reason = ("the denoiser was called without its input and timestep (by name "
                              "or position) or extra positional arguments, or it has no "
                              "return_dict argument")
                self._fall(s, run.reason)
            self.counters.denoiser_calls += 1
            return original(*args, **kwargs)
        if not run.solved:
            self._solve(run, call)
        served = run.serve(call)
        if served is None:
            if run.reason is None and run.trajectory is not None:
                run.first_unserved = s if run.first_unserved is None else run.first_unserved
            self.counters.denoiser_calls += 1
            return original(*args, **kwargs)
        if served[0] == s:   # (the loop's own step: at tol > 0 its sample is then replaced by
            # the trajectory's; a record matched at another step's input bits is served only)
            run.served_steps.add(s)
        self.counters.served += 1
        return wrap(call, served[1], run.output_type)

    def _solve(self, run: Run, call: Call) -> None:
        self.solving = True
        try:
            run.solve(self.pipe, self.denoiser, call, self.settings)
        except FallThrough as e:
            run.reason = str(e)
            self._fall(0, run.reason)
            return
        finally:
            self.solving = False
        sol = run.solution
        assert sol is not None
        self.solution = sol
        self.counters.solved += 1
        self.counters.certified += int(run.certified)
        self.counters.model_calls += int(sol.iterations)
        if not run.certified:
            why = sol.stats.get("reason") or "not certified within max_iters"
            self._fall(_first_uncertified(run),
                       f"paraprop did not certify the trajectory ({why}): the steps it did not "
                       "compute with the loop's own rows run the plain loop")

    def _end_run(self) -> None:
        run = self.run
        if run is None or run.ended:
            return
        run.ended = True
        if run.first_unserved is not None and run.certified:
            self._fall(run.first_unserved, "the pipeline's input at this step was not "
                       "one paraprop evaluated (a callback changed the latents, or the "
                       "pipeline computes its step otherwise)")
        run.release()

    def _fall(self, step: int, reason: str) -> None:
        self.reasons.append((self.counters.runs, step, reason))
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"paraprop.diffusion.accelerate: {type(self.pipe).__name__} runs its "
                          f"plain loop from step {step}: {reason}", FallThroughWarning,
                          stacklevel=4)


class _Proxy:
    """A patched method: ``method(original, *args, **kwargs)``, with the original bound; its
    signature is the original's (the pipelines inspect ``scheduler.step``'s to pass ``eta``
    and ``generator``)."""

    __slots__ = ("__wrapped__", "method", "original")

    def __init__(self, method, original):
        self.method, self.original, self.__wrapped__ = method, original, original

    def __call__(self, *args, **kwargs):
        return self.method(self.original, *args, **kwargs)

    def __reduce__(self):
        raise TypeError("a pipeline accelerated by paraprop.diffusion.accelerate cannot be "
                        "pickled or copied: call undo() on its handle first")


_MISSING = object()


def _replace_sample(out, value: torch.Tensor, B: int):
    """``out`` with its first ``B`` rows of the sample ``value`` (the trajectory's rows: DiT
    steps both guidance halves and keeps the first, the others step ``B`` rows)."""
    def new(prev: torch.Tensor) -> torch.Tensor:
        v = value.to(prev.dtype)
        return v if prev.shape[0] == B else torch.cat([v, prev[B:]])
    if isinstance(out, tuple):
        return (new(out[0]), *out[1:])
    if hasattr(out, "prev_sample"):
        out.prev_sample = new(out.prev_sample)
    return out


def _first_uncertified(run: Run) -> int:
    step = 0
    while any(r.loop_shaped for r in run.records.get(step, [])):
        step += 1
    return step


def accelerate(pipe, *, method="picard", window: int | None = None, tol: float = 0.0,
               memory: int | None = None, max_iters: int | None = None) -> Accelerated:
    """Run a diffusers pipeline's denoising loop through :func:`paraprop.diffusion.sample`.

    Inside it (applied once until ``undo()``, or as a context manager), ``pipe(...)`` returns
    what the plain pipeline returns with the same generator: bit for bit at ``tol=0``, within
    ``tol`` in latent space above (the pipeline follows paraprop's certified trajectory).
    Where paraprop does not support or cannot certify a run's setting, that run (from the first
    step paraprop did not certify) is the plain pipeline's loop: a :class:`FallThroughWarning`
    says so once per reason, and ``handle.reasons`` records it.

    Supported: pipelines that call their ``unet`` or ``transformer`` with the input and
    ``timestep`` (and ``return_dict``: a ``True`` gets the served tensor in the denoiser's own
    output dataclass) once per step from the scheduler's first timestep, with
    classifier-free guidance as ``StableDiffusionPipeline`` computes it (``guidance_scale``,
    ``guidance_rescale``) or none (tested: ``StableDiffusionPipeline``,
    ``StableDiffusion3Pipeline``, ``StableDiffusionXLPipeline``); and ``DiTPipeline``'s own
    loop (its guidance over the latent channels, the conditional half first, and its
    learned-sigma split: :mod:`~paraprop.diffusion.pipeline_dit`); the schedulers
    :func:`paraprop.diffusion.sample` runs in parallel: ``DDIMScheduler`` (any ``eta``),
    ``DDPMScheduler``, ``EulerDiscreteScheduler``, ``EulerAncestralDiscreteScheduler``,
    ``FlowMatchEulerDiscreteScheduler``, ``LCMScheduler``, ``DPMSolverMultistepScheduler`` of
    order 1-3, ``UniPCMultistepScheduler`` and ``HeunDiscreteScheduler`` (the pipeline's
    scheduler keeps its history from the served outputs; Heun's two denoiser calls at one
    timestep are told apart by their inputs). A step's noise is drawn beforehand from a copy of
    the generator the pipeline passes to ``scheduler.step`` (one ``torch.Generator``). Falling
    through, named: any other scheduler, step
    noise from the global RNG or from several generators, custom timesteps or sigmas, a loop
    that does not start at the first timestep; under ``DiTPipeline`` also the schedulers whose
    ``scale_model_input`` scales (Euler, Euler ancestral: DiT steps from the scaled sample)
    and every noisy one (DiT passes ``scheduler.step`` no generator).

    Arguments:
        pipe: a diffusers pipeline with a ``unet`` or a ``transformer`` and a ``scheduler``.
        method, window, memory, tol, max_iters: :func:`paraprop.diffusion.sample`'s.

    Returns:
        An :class:`Accelerated` handle (``undo()``, context manager, ``counters``,
        ``reasons``, ``solution``).

    Raises:
        TypeError: ``pipe`` has no ``unet``/``transformer`` module or no ``scheduler``.
        ValueError: ``pipe`` is already accelerated; a bad ``method``, ``window``, ``memory``,
            ``tol`` or ``max_iters``.

    Example:
        A pipeline-shaped object running the diffusers loop (any pipeline's ``__call__`` is):

        >>> from diffusers import DDIMScheduler
        >>> class Net(torch.nn.Module):
        ...     def forward(self, sample, timestep, return_dict=True):
        ...         return (sample,)
        >>> class Pipe:
        ...     def __init__(self):
        ...         self.unet, self.scheduler = Net().eval(), DDIMScheduler()
        ...     def __call__(self, steps, generator):
        ...         self.scheduler.set_timesteps(steps)
        ...         x = torch.randn(2, 3, generator=generator)
        ...         for t in self.scheduler.timesteps:
        ...             out = self.unet(x, t, return_dict=False)[0]
        ...             x = self.scheduler.step(out, t, x).prev_sample
        ...         return x
        >>> pipe = Pipe()
        >>> ref = pipe(20, torch.Generator().manual_seed(0))
        >>> with paraprop.diffusion.accelerate(pipe) as handle:
        ...     x = pipe(20, torch.Generator().manual_seed(0))
        >>> torch.equal(x, ref), handle.counters.served, handle.counters.model_calls < 20
        (True, 20, True)
    """
    check_tol(tol)
    check_max_iters(max_iters)
    _solver(method, window, memory, 1000)   # the method's settings, checked as sample does
    denoiser = next((getattr(pipe, n, None) for n in DENOISERS
                     if isinstance(getattr(pipe, n, None), torch.nn.Module)), None)
    scheduler = getattr(pipe, "scheduler", None)
    if denoiser is None or scheduler is None or not hasattr(scheduler, "set_timesteps"):
        raise TypeError(f"pipe must be a diffusers pipeline with a unet or transformer module "
                        f"and a scheduler, got {type(pipe).__name__}")
    if isinstance(pipe.__dict__.get(PATCH), Accelerated):
        raise ValueError("pipe is already accelerated: call undo() on the earlier handle first")
    settings = {"method": method, "window": window, "tol": tol, "memory": memory,
                "max_iters": max_iters}
    return Accelerated(pipe, denoiser, scheduler, settings)


__all__ = ["Accelerated", "Counters", "FallThroughWarning", "accelerate"]
