"""One run of an accelerated diffusers pipeline (:func:`paraprop.diffusion.accelerate`): the
trajectory solved at the denoiser's first call, and the denoiser outputs served from it.

A run starts where the pipeline calls its scheduler's ``set_timesteps``. At the denoiser's first
call (step 0: the timesteps are set, the latents drawn and scaled, the prompt embeddings built)
:meth:`Run.solve` reads what the pipeline passes (the latents, the classifier-free guidance
halves of the embeddings, ``pipe.guidance_scale`` / ``guidance_rescale``) and solves the whole
trajectory with :func:`paraprop.diffusion.sample` on a fresh copy of the scheduler, recording
every denoiser output paraprop computes with its input. Then the pipeline's loop runs on: at
step ``s`` :meth:`Run.serve` returns a recorded output whose input and arguments equal the
pipeline's bit for bit, where paraprop certified it (a certified solve; or, where it did not, a
call with the loop's own rows); otherwise the real denoiser runs, which keeps the result the
plain pipeline's. A pipeline whose loop differs from the text pipelines' around the denoiser
(``DiTPipeline``) brings its own reading of it (``loop``: :mod:`~paraprop.diffusion.pipeline_dit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from paraprop.determinism import stochastic_parts
from paraprop.diffusion import readers
from paraprop.diffusion.guidance import Guided
from paraprop.diffusion.pipeline_calls import (
    Call,
    FallThrough,
    half,
    has_rows,
    output_type_of,
    same_kwargs,
    tile,
)
from paraprop.diffusion.readers import READERS
from paraprop.diffusion.sample import sample
from paraprop.diffusion.schedulers import scheduler_kind, step_table
from paraprop.result import Solution

_RECORDS_KEPT = 2   # per step: the latest evaluation and the loop-shaped one


@dataclasses.dataclass
class Record:
    """One denoiser evaluation paraprop made for step ``s``: its input rows as the pipeline
    passes them (both guidance halves), its output, and whether the call held the loop's rows
    only (one step: what the plain pipeline's call computes, whatever the batch variance)."""

    inp: torch.Tensor
    out: torch.Tensor
    loop_shaped: bool
    # the call's rows could be several steps (a timestep of two steps, Heun's, in a call whose
    # timesteps do not say the order): kept for each, apart from the others
    ambiguous: bool = False


class Run:
    """The state of one pipeline run (see the module doc)."""

    def __init__(self, N: int | None, mu: float | None, scheduler, reason: str | None = None,
                 loop=None):
        self.N, self.mu, self.scheduler = N, mu, scheduler
        # a pipeline's own loop where it is not the text pipelines' (DiT's:
        # :class:`~paraprop.diffusion.pipeline_dit.DiTLoop`), None for theirs
        self.loop = loop
        self.output_type: type | None = None   # the denoiser's output object (return_dict)
        self.step = 0                      # scheduler.step calls so far
        self.scaled_input: torch.Tensor | None = None   # last sample given to scale_model_input
        self.extra_step_kwargs: dict[str, Any] | None = None
        self.records: dict[int, list[Record]] = {}
        self.solution: Solution | None = None
        self.trajectory: torch.Tensor | None = None     # (N + 1, B, ...): X_0 .. X_N
        self.certified = False
        self.estimate = False              # certified within tol (not bitwise): steps replaced
        self.reason = reason               # why the run falls through (None: it does not)
        self.first_unserved: int | None = None
        self.kwargs0: dict[str, Any] | None = None
        self.served_steps: set[int] = set()
        self.solved = False
        self.ended = False
        self.eta: float | None = None      # DDIM's, as the pipeline passes it to step
        self.cfg, self.B = False, 0
        # the loop's steps at each timestep (Heun's loop visits each but the first twice)
        self._times: dict[float, list[int]] = {}
        self._seq: list[float] = []        # the scheduler's timesteps, in the loop's order
        # scheduler.step calls of the loop (Heun: 2 N - 1)
        timesteps = getattr(scheduler, "timesteps", None)
        self.loop_steps = len(timesteps) if isinstance(timesteps, torch.Tensor) and \
            N is not None else N

    # -- step 0 -----------------------------------------------------------------------------
    def solve(self, pipe, denoiser, call: Call, settings: dict[str, Any]) -> None:
        """Solve the run's trajectory from the pipeline's step-0 call (raises
        :class:`FallThrough` with the reason where paraprop does not)."""
        self.solved = True
        if self.reason is not None:
            raise FallThrough(self.reason)
        if self.N is None:
            raise FallThrough("the pipeline set custom timesteps or sigmas (no "
                              "num_inference_steps): paraprop reads the scheduler's own schedule")
        if stochastic_parts(denoiser):
            raise FallThrough(f"the denoiser {type(denoiser).__name__} is in train mode with "
                              "stochastic layers (call .eval())")
        x = call.x
        first = self.scheduler.timesteps[:1].to(call.t.device)
        if call.t.numel() == 0 or not bool((call.t.reshape(-1) == first).all()):
            raise FallThrough("the pipeline's loop does not start at the scheduler's first "
                              "timestep (an image-to-image strength, or a loop of its own)")
        if self.loop is not None:
            cfg = self.loop.start(denoiser, call)
        else:
            cfg = bool(getattr(pipe, "do_classifier_free_guidance", False))
        rows = x.shape[0]
        if cfg and rows % 2:
            raise FallThrough(f"classifier-free guidance with an odd number of rows ({rows})")
        B = rows // 2 if cfg else rows
        latents = self.scaled_input if self.scaled_input is not None else x
        if latents.shape != x.shape:
            raise FallThrough("the sample given to scale_model_input is not the denoiser's input")
        if cfg and not torch.equal(latents[:B], latents[B:]):
            raise FallThrough("the two guidance halves of the denoiser's input differ")
        latents = latents[:B]
        sched = type(self.scheduler).from_config(self.scheduler.config)
        noise = self._noise(sched, latents)
        self.cfg, self.B = cfg, B
        model = self._model(pipe, denoiser, call, cfg, B)
        self.kwargs0 = call.kwargs
        self._index_timesteps()
        try:
            _, sol = sample(model, sched, tuple(latents.shape), num_inference_steps=self.N,
                            noise=noise, mu=self.mu, eta=self.eta, throw=False, **settings)
        except (NotImplementedError, ValueError) as e:
            raise FallThrough(f"{type(e).__name__}: {e}") from None
        self.solution = sol
        self.certified = bool(sol.converged)
        self.estimate = self.certified and sol.stats.get("certificate") == "estimate"
        traj = sol.value.transpose(0, 1)   # (N, B, ...)
        self.trajectory = torch.cat([latents[None].to(traj.dtype), traj])

    def _noise(self, sched, latents: torch.Tensor) -> torch.Tensor:
        """``noise=`` of :func:`sample`: row 0 the latents before ``init_noise_sigma`` (found
        exactly, or a fall through), row ``1 + s`` the noise step ``s`` will draw inside
        ``scheduler.step`` from the pipeline's generator (:meth:`_step_noise`)."""
        N = self.N
        assert N is not None
        extra = self.extra_step_kwargs or {}
        name = type(sched).__name__
        if name in READERS:
            reader = readers.reader(sched, N, mu=self.mu, device=latents.device)
            # (DPM-Solver++ of order 2-3 read earlier model outputs: the pipeline's own
            # scheduler keeps that history from the served outputs, as in its plain loop)
            if self.loop is not None:
                K = reader.K
                self.loop.check_scaling(name, lambda dt: reader.model_input(
                    0, K, torch.ones((K, 1, 1), dtype=dt, device=latents.device)),
                    latents.dtype)
            row0 = _preimage(latents, lambda r: reader.initial(r)[0])
            if row0 is None:
                raise FallThrough(f"the latents scaled by {name}.init_noise_sigma have no exact "
                                  "preimage in their dtype")
            noisy, dtype, what = list(reader.noisy), reader.noise_dtype(latents.dtype), name
        else:
            try:
                kind = scheduler_kind(sched)
            except (NotImplementedError, ValueError) as e:
                raise FallThrough(f"{type(e).__name__}: {e}") from None
            eta = float(extra.get("eta", 0.0) or 0.0)
            self.eta = eta if kind == "ddim" else None
            table = step_table(sched, N, eta=self.eta or 0.0)
            if float(getattr(sched, "init_noise_sigma", 1.0)) != 1.0:
                raise FallThrough(f"{name}.init_noise_sigma is not 1")
            row0, noisy, dtype = latents, table.noisy.tolist(), latents.dtype
            what = "DDPMScheduler" if kind == "ddpm" else f"DDIMScheduler with eta={eta}"
        for name_ in ("timesteps", "sigmas"):
            mine, theirs = getattr(sched, name_, None), getattr(self.scheduler, name_, None)
            if isinstance(theirs, torch.Tensor) and not (
                    isinstance(mine, torch.Tensor) and mine.shape == theirs.shape
                    and torch.equal(mine.to(theirs.device), theirs)):
                raise FallThrough(f"paraprop's copy of the scheduler set other {name_} than "
                                  "the pipeline's")
        # (one row per step of the loop: Heun's 2 N - 1)
        noise = torch.zeros((len(noisy) + 1, *latents.shape), dtype=latents.dtype,
                            device=latents.device)
        noise[0] = row0
        if any(noisy):
            noise[1:] = self._step_noise(noisy, latents, dtype, what, extra.get("generator"))
        return noise

    @staticmethod
    def _step_noise(noisy: list[bool], latents: torch.Tensor, dtype: torch.dtype, what: str,
                    generator) -> torch.Tensor:
        """The noise the noisy steps will draw inside ``scheduler.step``, drawn beforehand from
        a copy of the pipeline's generator in its state at step 0 (nothing else draws from it
        in the loop; where something does, the latents stop matching and the plain loop runs):
        ``randn_tensor``'s draw, on a CPU generator's device, then moved."""
        if isinstance(generator, list) and len(generator) == 1:   # randn_tensor reads it so
            generator = generator[0]
        if not isinstance(generator, torch.Generator):
            got = "no generator (the global RNG)" if generator is None else \
                f"a {type(generator).__name__} of {len(generator)} generators"
            raise FallThrough(f"{what} draws noise inside scheduler.step, and the pipeline "
                              f"passes it {got}: paraprop cannot draw that noise beforehand")
        if dtype != latents.dtype:
            raise FallThrough(f"{what} draws its step noise in {dtype}, not in the latents' "
                              f"{latents.dtype}")
        device = latents.device
        if generator.device.type != device.type and generator.device.type != "cpu":
            raise FallThrough(f"a {generator.device.type} generator cannot draw the step noise "
                              f"of {device} latents")
        copy = torch.Generator(device=generator.device)
        copy.set_state(generator.get_state())
        gen_device = generator.device if generator.device.type != device.type else device
        zero = torch.zeros(latents.shape, dtype=latents.dtype, device=device)
        rows = [torch.randn(latents.shape, generator=copy, device=gen_device, dtype=dtype)
                .to(device) if z else zero for z in noisy]
        return torch.stack(rows)

    def _model(self, pipe, denoiser, call: Call, cfg: bool, B: int):
        """The model :func:`sample` evaluates: the real denoiser under the pipeline's guidance,
        recording every step's evaluation (:meth:`_record`)."""
        names = (call.x_name, call.t_name)
        rows = 2 * B if cfg else B
        zero_d = call.t.dim() == 0
        timesteps = self.scheduler.timesteps

        def inner(x: torch.Tensor, t: torch.Tensor, **kw) -> torch.Tensor:
            t_in = t
            if x.shape[0] == rows:   # one step's rows: its timestep as the pipeline passes it
                steps = self._times.get(float(t[0]))
                if steps:   # (the steps at one timestep share it: Heun's)
                    t_in = timesteps[steps[0]] if zero_d else timesteps[steps[0]].expand(rows)
            got = denoiser(**{names[0]: x, names[1]: t_in}, **kw, return_dict=call.return_dict)
            if call.return_dict:   # served as the same object around the recorded tensor
                self.output_type = output_type_of(type(got))
                out = getattr(got, dataclasses.fields(self.output_type)[0].name)
            else:
                out = got[0]
            if not isinstance(out, torch.Tensor):
                raise FallThrough(f"the denoiser returned a {type(out).__name__} where its "
                                  "output tensor was expected")
            self._record(x, t, out, rows)
            return out

        if self.loop is not None:
            return self.loop.model(inner, call, cfg, B)
        if not cfg:
            shared = call.kwargs

            def plain(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                n = x.shape[0] // B
                return inner(x, t, **{k: tile(v, B, n) for k, v in shared.items()})
            return plain
        halves: dict[str, Any] = {}
        shared = {}
        for k, v in call.kwargs.items():
            if has_rows(v, 2 * B):
                halves[k] = v
            elif isinstance(v, dict) and any(isinstance(u, torch.Tensor) for u in v.values()):
                raise FallThrough(f"the denoiser's argument {k!r} mixes per-sample tensors and "
                                  "others")
            else:
                shared[k] = v
        if not halves:
            raise FallThrough("classifier-free guidance without per-sample conditioning")
        scale = float(getattr(pipe, "guidance_scale", 1.0))
        rescale = float(getattr(pipe, "guidance_rescale", 0.0) or 0.0)
        return Guided(inner, scale, cond=half(halves, B, 1), uncond=half(halves, B, 0),
                      guidance_rescale=rescale, shared=shared)

    def _record(self, x: torch.Tensor, t: torch.Tensor, out: torch.Tensor, step_rows: int):
        """Keep each step's evaluation in the pipeline's layout (under guidance the rows are
        the unconditional half of all steps, then the conditional half)."""
        n = x.shape[0] // step_rows
        rows = []
        for j in range(n):
            if self.cfg:
                b = step_rows // 2
                idx = [slice(j * b, (j + 1) * b), slice(n * b + j * b, n * b + (j + 1) * b)]
                inp = torch.cat([x[i] for i in idx])
                o = torch.cat([out[i] for i in idx])
                tj = t[j * b]
            else:
                sl = slice(j * step_rows, (j + 1) * step_rows)
                inp, o, tj = x[sl], out[sl], t[j * step_rows]
            rows.append((inp, o, float(tj)))
        for (inp, o, _), steps in zip(rows, self._steps_of([r[2] for r in rows]), strict=True):
            rec = Record(inp.clone(), o, loop_shaped=(n == 1), ambiguous=len(steps) > 1)
            for s in steps:
                old = self.records.get(s, [])
                rest = [r for r in old if r.ambiguous != rec.ambiguous]
                kept = [r for r in old if r.ambiguous == rec.ambiguous and r.loop_shaped
                        and not rec.loop_shaped]
                self.records[s] = rest + (kept + [rec])[-_RECORDS_KEPT:]

    def _index_timesteps(self) -> None:
        """The scheduler's timesteps, and the steps at each (for :meth:`_steps_of`)."""
        self._times = {}
        self._seq = [float(v) for v in self.scheduler.timesteps.tolist()]
        for i, v in enumerate(self._seq):
            self._times.setdefault(v, []).append(i)

    def _steps_of(self, ts: list[float]) -> list[list[int]]:
        """The steps the rows of one call with the timesteps ``ts`` (one per step's rows) can
        be. Where a timestep belongs to two steps (Heun's), the call's timesteps are a run of
        the scheduler's, in order or reversed (the chain flips every other call): placed
        where they fit; rows that fit several places get each (the records are served by
        their input's bits, and the output is the denoiser's at that input, timestep and
        arguments, whichever step it was computed for)."""
        steps = [self._times.get(v, []) for v in ts]
        if all(len(c) <= 1 for c in steps):
            return steps
        seq, n = self._seq, len(ts)
        back = ts[::-1]
        places = set()
        # (a run in order starts at a step of ts[0]; a reversed one at a step of ts[-1])
        for e0 in {*steps[0], *steps[-1]}:
            run = seq[e0: e0 + n]
            if run == ts:
                places.add(tuple(range(e0, e0 + n)))
            if run == back:
                places.add(tuple(range(e0 + n - 1, e0 - 1, -1)))
        if not places:
            return steps
        return [sorted({p[j] for p in places}) for j in range(n)]

    # -- every step ---------------------------------------------------------------------------
    def serve(self, call: Call) -> tuple[int, torch.Tensor] | None:
        """The step this call is (of the steps at its timestep, the loop's current one first)
        and its recorded output, where one was evaluated at the call's input and arguments bit
        for bit (and certified); else ``None`` (the real denoiser)."""
        if self.trajectory is None or call.t.numel() == 0 or \
                not same_kwargs(self.kwargs0, call.kwargs):
            return None
        steps = self._times.get(float(call.t.reshape(-1)[0]))
        if not steps:
            return None
        if call.return_dict and self.output_type is None:
            return None
        for s in sorted(steps, key=lambda k: k != self.step):
            for rec in reversed(self.records.get(s, [])):
                if (self.certified or rec.loop_shaped) and rec.inp.dtype == call.x.dtype and \
                        torch.equal(rec.inp, call.x):
                    return s, rec.out
        return None

    def release(self) -> None:
        """Drop the recorded evaluations (the run has ended)."""
        self.records = {}


def _preimage(x: torch.Tensor, scale) -> torch.Tensor | None:
    """``r`` with ``scale(r) == x`` bit for bit (``scale``: the pipelines' ``latents *
    init_noise_sigma``, monotone), searched among the few floats next to ``x / sigma``; ``None``
    where some element has none there."""
    one = torch.ones_like(x)
    sigma = scale(one)
    guess = x / sigma
    found = torch.zeros_like(x, dtype=torch.bool)
    r = guess.clone()
    inf = torch.full_like(x, float("inf"))
    up, down = guess, guess
    for k in range(5):
        cands = [guess] if k == 0 else [up, down]
        for c in cands:
            hit = ~found & (scale(c) == x)
            r = torch.where(hit, c, r)
            found |= hit
        if bool(found.all()):
            return r
        up, down = torch.nextafter(up, inf), torch.nextafter(down, -inf)
    return None


__all__ = ["Call", "FallThrough", "Record", "Run"]
