"""Readers of diffusers schedulers' update rules, beside :mod:`~paraprop.diffusion.schedulers`
(DDPM/DDIM): one interface for every scheduler whose step reads more than ``(x_t, model(x_t))``
(multistep history, Heun's second evaluation, ancestral noise, flow matching).

A reader is made from a scheduler and ``num_inference_steps`` (it calls ``set_timesteps``, as a
pipeline does) and reads the per-step coefficients from the scheduler's own state (``timesteps``,
``sigmas``, its step index, the order it would use at every step). It then applies the steps
with exactly ``scheduler.step``'s operations on the samples, so that the loop below
(:func:`loop`) equals the diffusers loop bit for bit, and a window of steps can be applied at
once from one batched model call (the same operations with per-step coefficient columns).

**What the chain needs (design note for the parallel sampler).**

* *Positions.* Position ``k = 0 .. K`` is the sample before the diffusers loop's ``k``-th
  iteration; ``K = reader.K = len(scheduler.timesteps)`` is the number of model calls of the
  loop. One position per model call: Heun's second evaluation is its own position (``K = 2N -
  1`` for ``N`` Heun steps), so every step is one model evaluation, as for DDPM/DDIM.
* *State.* A position's state is ``(P, *shape)`` with ``P = reader.parts``: ``1`` (the sample)
  for every scheduler but UniPC, whose corrector reads the corrected sample of the previous
  step (``P = 2``: ``[x_k, corrected x_{k-1}]``, a value computed by step ``k - 1``). The model
  reads part ``0`` only. Windows are ``(n, P, *shape)``: one leading row per position.
  :meth:`Reader.initial` makes position 0 from the latents (``init_noise_sigma`` applied as the
  pipelines apply it).
* *Model call.* Step ``k`` evaluates the model once, at ``reader.model_input(lo, hi, state)``
  (``scale_model_input``, part of the step) and ``reader.timesteps[k]``; the ``n`` rows of a
  window go in one batched call.
* *History.* Step ``k`` reads the *records* of the ``reader.history`` positions before it:
  values that step ``j`` computes from its own input and model output only (DPM-Solver's and
  UniPC's converted model output, Heun's derivative and sample). :meth:`Reader.step` returns the
  window's records; the chain keeps the last ``history`` records of the certified prefix and
  passes them as ``past`` to the next window. So the system stays triangular in the states: a
  position reads earlier positions only, through their records.
* *Noise.* ``reader.noisy[k]`` says whether step ``k`` draws noise, ``reader.noise_dtype(dtype)``
  in which dtype; :func:`draw_noise` draws the latents and every step's noise up front in the
  loop's order (as ``randn_tensor`` does with one generator). Noise enters inside step ``k``
  (``z`` of :meth:`Reader.step`), after the model call.
* *Dtypes.* float64, float32, bfloat16 and float16 samples (the model's dtype; the tests check
  all four on the CPU). Coefficients are the scheduler's float32 0-d tensors, and PyTorch reads
  them in a way that depends on the operation, the operand order, the dtype and where the
  coefficient lives (:mod:`~paraprop.diffusion.scalars`): on the CPU a bfloat16/float16
  ``c * t`` rounds ``c`` to the dtype first, ``t * c`` and ``t / c`` read it at full
  precision; on CUDA/XPU a CPU scalar is read at full precision and ``t / c`` is
  ``t * (1 / c)``, while a coefficient on the device (UniPC's, and flow matching's and LCM's
  after ``set_timesteps(device=...)``) is rounded to the dtype first. The readers write every
  product in diffusers' operand order. The CUDA rules are read from PyTorch's kernels (as in
  :mod:`~paraprop.diffusion.schedulers`); no GPU has run these readers' tests yet.
* *Reading once.* Reading a scheduler's coefficients is a loop of 0-d float32 operations
  (2-11 ms for 50 steps on one CPU core, more than a small model's whole diffusers loop), so a
  reader keeps what :meth:`Reader._read` computed for :data:`MEMO` recent schedulers, keyed by
  the reader, the scheduler's class and configuration, ``num_inference_steps``, ``mu``, the
  device, a fingerprint of every attribute the scheduler holds after ``set_timesteps`` (every
  tensor's bytes) and, by identity, the reader's and the scheduler's classes' attributes and the
  reader module's functions (a method or helper patched makes another key): a scheduler that
  differs in anything it holds is read again, and one holding an attribute of a type the
  fingerprint does not cover is never served from memory. What is kept is a copy (tensors
  cloned), and each reader served gets its own copy.
* *Cost.* A window's steps of one kind (order, Heun's first or second evaluation, UniPC's
  predictor/corrector orders) are applied together, a few elementwise operations each; only
  UniPC's history sum (an ``einsum`` of diffusers' shapes) runs once per step.

Supported: ``DPMSolverMultistepScheduler``, ``UniPCMultistepScheduler``
(:mod:`~paraprop.diffusion.multistep`), ``EulerDiscreteScheduler``,
``EulerAncestralDiscreteScheduler``, ``HeunDiscreteScheduler``
(:mod:`~paraprop.diffusion.karras`), ``FlowMatchEulerDiscreteScheduler`` and ``LCMScheduler``
(:mod:`~paraprop.diffusion.flowmatch`); :func:`reader` picks one. Every setting a reader does not
implement raises :class:`ValueError` naming it, its value and what is supported.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from paraprop.diffusion.scalars import tmul
from paraprop.diffusion.selection import Sel

SAMPLE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

Records = tuple[torch.Tensor, ...]


MEMO = 16
# what Reader._read computed, per key of _memo_key (most recent last), and its lock
_READ: OrderedDict[tuple, dict[str, Any]] = OrderedDict()
_READ_LOCK = threading.Lock()
# the attributes set before _read that it fills (the others it sets are new ones)
_READ_STATE = ("kinds", "noisy", "_cols")


class _Same:
    """A key part that is equal to another only for the very same object (which it holds, so
    that its id is not reused): a class attribute, whatever its type."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _fingerprint(value: Any) -> Any:
    """A hashable stand-in for a scheduler attribute's value (a tensor: its dtype, shape,
    device and a digest of its bytes), or ``NotImplemented`` for a type it does not cover (or
    a tensor whose bytes it cannot read: meta, sparse, ...)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        # (typed, and floats by repr: True and 1, 0.0 and -0.0 are other settings)
        return (type(value).__name__, repr(value))
    if isinstance(value, torch.Tensor):
        try:
            t = value.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
            raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        except Exception:   # noqa: BLE001 (no digest: no memo)
            return NotImplemented
        return (str(t.dtype), tuple(value.shape), str(value.device),
                hashlib.blake2b(raw, digest_size=16).hexdigest())
    if isinstance(value, (list, tuple)):
        parts = tuple(_fingerprint(v) for v in value)
        return NotImplemented if NotImplemented in parts else (type(value).__name__, parts)
    return NotImplemented


def _memo_key(reader: Reader, scheduler, steps: int, mu: float | None) -> tuple | None:
    """The key under which ``reader``'s read of ``scheduler`` (after its ``set_timesteps``) is
    kept, or ``None`` where the scheduler holds something the fingerprint does not cover."""
    held = []
    for name, value in sorted(vars(scheduler).items()):
        if name == "_internal_dict":   # the configuration: below
            continue
        fp = _fingerprint(value)
        if fp is NotImplemented:
            return None
        held.append((name, fp))
    config = _fingerprint(sorted(dict(scheduler.config).items()))
    if config is NotImplemented:
        return None
    # the code: every attribute of the reader's and the scheduler's classes, and the functions
    # of the reader's module, by identity (a method or helper replaced, as a patch would, by
    # anything at all makes another key)
    klasses = (*type(reader).__mro__, *type(scheduler).__mro__)
    code = tuple((k.__qualname__, tuple((n, _Same(v)) for n, v in vars(k).items()))
                 for k in klasses if k is not object)
    module = sys.modules.get(type(reader).__module__)
    helpers = () if module is None else \
        tuple((n, _Same(v)) for n, v in vars(module).items() if callable(v))
    return (type(reader), type(scheduler), config, steps, repr(mu), str(reader.device),
            tuple(held), code, helpers)


def _copied(value: Any) -> Any:
    """A copy of what a read set, for the memory and from it (tensors cloned: no reader shares
    one with another), or ``NotImplemented`` for a type it does not copy."""
    if value is None or isinstance(value, (bool, int, float, str, torch.device, torch.dtype)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        parts = [_copied(v) for v in value]
        if any(p is NotImplemented for p in parts):
            return NotImplemented
        return parts if isinstance(value, list) else tuple(parts)
    if isinstance(value, dict):
        items = {k: _copied(v) for k, v in value.items()}
        return NotImplemented if any(v is NotImplemented for v in items.values()) else items
    return NotImplemented


def refuse(scheduler: str, argument: str, value: Any, supported: str) -> ValueError:
    """The error of a setting a reader does not implement."""
    return ValueError(f"{scheduler}: {argument}={value!r} is not supported by "
                      f"paraprop.diffusion; supported: {supported}")


def check_dtype(dtype: torch.dtype, scheduler: str = "reader") -> None:
    """Refuse a sample dtype the readers do not compute in."""
    if dtype not in SAMPLE_DTYPES:
        raise refuse(scheduler, "dtype", dtype,
                     "torch.float32, torch.float64, torch.bfloat16, torch.float16")


class Reader:
    """A scheduler's update rule over the ``K`` iterations of its diffusers loop.

    Subclasses set ``classname``, ``history``, ``parts``, and fill ``kinds`` (the formula each
    step uses: steps of one kind in a window are applied together), the coefficient columns
    (:meth:`_columns`) and :meth:`_apply`.
    """

    classname: ClassVar[str] = ""
    history: int = 0
    parts: int = 1

    def __init__(self, scheduler, num_inference_steps: int, *, mu: float | None = None,
                 device: torch.device | str = "cpu"):
        # where the samples will be: UniPC does its coefficient arithmetic there
        self.device = torch.device(device)
        if type(scheduler).__name__ != self.classname or \
                not type(scheduler).__module__.startswith("diffusers."):
            raise ValueError(f"scheduler: expected diffusers' {self.classname}, got "
                             f"{type(scheduler).__module__}.{type(scheduler).__name__} (a "
                             "subclass may change step(); pass the diffusers class itself)")
        self.scheduler = scheduler
        self.config = scheduler.config
        self._check_config()
        kwargs = {} if mu is None else {"mu": mu}
        # as the pipelines call it: the scheduler keeps some of its state on the device
        scheduler.set_timesteps(num_inference_steps, device=self.device, **kwargs)
        self.timesteps: torch.Tensor = scheduler.timesteps
        self.K = int(self.timesteps.numel())
        self.sigmas = scheduler.sigmas.detach().cpu() if hasattr(scheduler, "sigmas") else None
        # the step index the scheduler starts from (its _init_step_index at the first step)
        begin = scheduler.begin_index
        if begin is None:
            begin = scheduler.index_for_timestep(self.timesteps[0])
        if begin != 0:
            raise refuse(self.classname, "first step index", begin,
                         "0 (diffusers starts at a repeated first timestep's second place)")
        self.init_noise_sigma = getattr(scheduler, "init_noise_sigma", None)
        self.kinds: list[Any] = []
        self.noisy: tuple[bool, ...] = (False,) * self.K
        self._cols: dict[str, torch.Tensor] = {}
        self._on: dict[tuple[torch.device, str], torch.Tensor] = {}
        self._groups: dict[tuple[int, int, Any], list[tuple[Any, Sel]]] = {}
        key = _memo_key(self, scheduler, num_inference_steps, mu)
        read = None
        if key is not None:
            with _READ_LOCK:
                read = _READ.get(key)
                if read is not None:
                    _READ.move_to_end(key)
        if read is None:
            before = set(vars(self))
            # (tensors made under torch.inference_mode would be inference tensors, unusable
            # with autograd by a later reader served from memory)
            with torch.inference_mode(False):
                self._read()
                if key is not None:
                    made = {k: _copied(v) for k, v in vars(self).items()
                            if k in _READ_STATE or k not in before}
                    if all(v is not NotImplemented for v in made.values()):
                        with _READ_LOCK:
                            _READ[key] = made
                            while len(_READ) > MEMO:
                                _READ.popitem(last=False)
        else:
            with torch.inference_mode(False):
                for k, v in read.items():
                    setattr(self, k, _copied(v))
        assert len(self.kinds) == self.K, "reader: one kind per step"

    # -- what subclasses define ----------------------------------------------------------------
    def _check_config(self) -> None:
        """Refuse the settings the reader does not implement (ValueError naming them)."""

    def _read(self) -> None:
        """Fill ``kinds``, ``noisy`` and the coefficient columns."""
        raise NotImplementedError

    def _record(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor) -> Records:
        """The records of the steps ``sel`` (what later steps read) from their states ``x``
        ``(m, P, *shape)`` and model outputs ``out`` ``(m, *shape)``."""
        return ()

    def _apply(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor, rec: Records,
               z: torch.Tensor | None) -> torch.Tensor:
        """The next states of the steps ``sel`` of one kind. ``rec``: the records of the
        window's positions preceded by ``history`` rows of the past: the record of the step
        ``i`` before a step is ``sel.take(r, shift=history - i)``, its own ``shift=history``.
        ``z``: the noise rows of the steps."""
        raise NotImplementedError

    def noise_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype in which the diffusers loop draws a step's noise for samples of ``dtype``."""
        return dtype

    def scale(self, sel: Sel, x: torch.Tensor) -> torch.Tensor:
        """``scale_model_input`` for the steps ``sel`` (``x``: ``(m, *shape)``)."""
        return x

    def output_gains(self) -> torch.Tensor | None:
        """``(K,)`` float64: ``|d step_k / d model output|`` per step (without clipping, which
        only lowers it), where the reader derives it (its Markov steps); ``None`` otherwise."""
        return None

    def records_like(self, out: torch.Tensor) -> Records:
        """Empty records for the positions of the model outputs ``out`` ``(n, *shape)``."""
        return ()

    # -- columns -------------------------------------------------------------------------------
    def _columns(self, rows: Sequence[dict[str, torch.Tensor]]) -> None:
        """Stack per-step 0-d coefficients (one dict per step) into ``(K,)`` float32 columns
        (NaN where a step has none)."""
        names = sorted({k for r in rows for k in r})
        nan = torch.tensor(float("nan"))
        for name in names:
            self._cols[name] = torch.stack(
                [torch.as_tensor(r[name]).detach().reshape(()).cpu().float() if name in r
                 else nan for r in rows])

    def col(self, name: str, sel: Sel, like: torch.Tensor) -> torch.Tensor:
        """The column ``name`` at the steps ``sel``, shaped to broadcast over ``like``
        ``(m, ...)``, on its device (float32)."""
        key = (like.device, name)
        full = self._on.get(key)
        if full is None:
            full = self._on[key] = self._cols[name].to(like.device)
        return sel.take(full, shift=sel.start).reshape((sel.n,) + (1,) * (like.dim() - 1))

    # -- the interface -------------------------------------------------------------------------
    def initial(self, latents: torch.Tensor) -> torch.Tensor:
        """Position 0's state ``(P, *shape)`` from the drawn latents, scaled by
        ``init_noise_sigma`` as the pipelines scale them."""
        check_dtype(latents.dtype, self.classname)
        init = self.init_noise_sigma
        if init is None:
            x = latents
        elif isinstance(init, torch.Tensor):   # latents * init_noise_sigma, a CPU scalar
            x = tmul(latents, init.detach().cpu().float().to(latents.device))
        else:
            x = latents * init
        return torch.stack([x] * self.parts)

    def model_input(self, lo: int, hi: int, state: torch.Tensor) -> torch.Tensor:
        """The model's input rows ``(n, *shape)`` of the steps ``[lo, hi)`` from their states
        ``(n, P, *shape)`` (``scale_model_input``)."""
        key = (lo, hi, None)   # every step has the scaling's column: one slice for all
        if key not in self._groups:
            self._groups[key] = [(None, Sel(list(range(hi - lo)), lo))]
        return self.scale(self._groups[key][0][1], state[:, 0])

    def step(self, lo: int, hi: int, state: torch.Tensor, out: torch.Tensor,
             past: Records = (), z: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, Records]:
        """The states after the steps ``[lo, hi)`` (``(n, P, *shape)``) and the steps' records.

        ``state``: their input states ``(n, P, *shape)``; ``out``: the model outputs at
        :meth:`model_input` ``(n, *shape)``; ``past``: the records of the positions
        ``[lo - h, lo)`` for ``h = min(history, lo)`` (rows an earlier call returned; ``()``
        at step 0); ``z``:
        the steps' noise ``(n, *shape)`` (rows of steps that draw none are not read).
        """
        n = hi - lo
        if not (0 <= lo < hi <= self.K) or state.shape[0] != n or out.shape[0] != n:
            raise ValueError(f"reader: steps [{lo}, {hi}) of {self.K} with {state.shape[0]} "
                             f"states and {out.shape[0]} model outputs")
        check_dtype(out.dtype, self.classname)
        if (z is None or z.shape[0] != n) and any(self.noisy[lo:hi]):
            raise ValueError(f"z: the steps [{lo}, {hi}) of {self.classname} draw noise; pass "
                             f"their {n} noise rows (draw_noise), got "
                             f"{None if z is None else tuple(z.shape)}")
        h = min(self.history, lo)
        own = self.records_like(out)
        if not past and h == 0:
            past = tuple(r[:0] for r in own)
        if len(past) != len(own) or any(p.shape[0] != h for p in past):
            raise ValueError(f"reader: past must hold the records of the {h} steps before step "
                             f"{lo}, got {[tuple(p.shape) for p in past]}")
        groups = self.groups(lo, hi)
        # every step's records first: they read the step's own input and output only
        self._fill_records(groups, state, out, own)
        pad = self.history - h
        rec = tuple(torch.cat([p.new_zeros((pad,) + p.shape[1:]), p, r]) if self.history
                    else r for p, r in zip(past, own, strict=True))
        if len(groups) == 1:
            sel = groups[0][1]
            return self._apply(groups[0][0], sel, state, out, rec, z), own
        new: torch.Tensor | None = None
        for kind, sel in groups:
            y = self._apply(kind, sel, sel.take(state), sel.take(out), rec,
                            None if z is None else sel.take(z))
            if new is None:
                new = y.new_empty((n,) + tuple(y.shape[1:]))
            sel.put(new, y)
        assert new is not None  # (a window has at least one group)
        return new, own

    def records(self, lo: int, hi: int, state: torch.Tensor, out: torch.Tensor) -> Records:
        """The records of the steps ``[lo, hi)`` from their input states ``(n, P, *shape)`` and
        model outputs ``(n, *shape)``: :meth:`step`'s second item."""
        own = self.records_like(out)
        self._fill_records(self.groups(lo, hi), state, out, own)
        return own

    def _fill_records(self, groups, state: torch.Tensor, out: torch.Tensor, own: Records):
        for kind, sel in groups:
            for r, v in zip(own, self._record(kind, sel, sel.take(state), sel.take(out)),
                            strict=True):
                sel.put(r, v)

    def groups(self, lo: int, hi: int) -> list[tuple[Any, Sel]]:
        """The window's steps grouped by kind (kept per window)."""
        key = (lo, hi, True)
        if key not in self._groups:
            by_kind: dict[Any, list[int]] = {}
            for k in range(lo, hi):
                by_kind.setdefault(self.kinds[k], []).append(k - lo)
            self._groups[key] = [(kind, Sel(rel, lo)) for kind, rel in by_kind.items()]
        return self._groups[key]


def draw_noise(reader: Reader, shape: Sequence[int], *, generator: torch.Generator | None,
               dtype: torch.dtype, device: torch.device | str = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The latents ``shape`` and every step's noise ``(K, *shape)`` (zeros where a step draws
    none), drawn in the diffusers loop's order with ``generator`` as ``randn_tensor`` draws
    them: on a CPU generator's device, then moved to ``device``."""
    device = torch.device(device)
    gen_device = device
    if generator is not None and generator.device.type != device.type:
        if generator.device.type != "cpu":
            raise ValueError(f"generator: a {generator.device.type} generator cannot draw "
                             f"noise for {device} (as in diffusers)")
        gen_device = torch.device("cpu")

    def randn(dt: torch.dtype) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=generator, device=gen_device,
                           dtype=dt).to(device)

    latents = randn(dtype)
    zdt = reader.noise_dtype(dtype)
    z = torch.zeros((reader.K, *shape), dtype=zdt, device=device)
    for k, noisy in enumerate(reader.noisy):
        if noisy:
            z[k] = randn(zdt)
    return latents, z


def loop(reader: Reader, model: Callable[..., Any], latents: torch.Tensor,
         z: torch.Tensor | None = None, **model_kwargs) -> torch.Tensor:
    """The diffusers loop through ``reader``, one step at a time: the sequential reference.
    Returns the final sample ``(*shape)``.

    Example (8 flow-matching steps, against the diffusers loop itself):
        >>> from diffusers import FlowMatchEulerDiscreteScheduler
        >>> from paraprop.diffusion import readers
        >>> scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        >>> r = readers.reader(scheduler, 8)
        >>> model = lambda x, t: x - 0.5 * t / 1000
        >>> g = torch.Generator().manual_seed(0)
        >>> latents, z = readers.draw_noise(r, (4, 2), generator=g, dtype=torch.float32)
        >>> x = readers.loop(r, model, latents, z)
        >>> y = latents
        >>> for t in scheduler.timesteps:
        ...     y = scheduler.step(model(y, t), t, y).prev_sample
        >>> r.K, torch.equal(x, y)
        (8, True)
    """
    state = reader.initial(latents)[None]
    past: Records = tuple(r[:0] for r in reader.records_like(latents[None]))
    for k in range(reader.K):
        x_in = reader.model_input(k, k + 1, state)
        out = model_output(model(x_in[0], reader.timesteps[k], **model_kwargs))[None]
        zk = None if z is None else z[k: k + 1]
        state, rec = reader.step(k, k + 1, state, out, past, zk)
        if reader.history:
            past = tuple(torch.cat([p, r])[-reader.history:]
                         for p, r in zip(past, rec, strict=True))
    return state[0, 0]


def model_output(out: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """The output tensor of a model's return value: a tensor, a tuple whose first item is one,
    or an object with ``.sample`` (diffusers' ``UNet2DOutput``, ``Transformer2DModelOutput``);
    with ``like`` (the model's input), refused unless of its shape and dtype."""
    if isinstance(out, torch.Tensor):
        pass
    elif hasattr(out, "sample"):
        out = out.sample
    elif isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        out = out[0]
    else:
        raise TypeError("model must return a tensor, a tuple whose first item is one, or an "
                        "object with .sample (such as diffusers' UNet2DOutput), got "
                        f"{type(out).__name__}")
    if like is None:
        return out
    if out.shape != like.shape:
        raise ValueError(f"model output has shape {tuple(out.shape)}, expected "
                         f"{tuple(like.shape)} (the shape of its input x; a learned variance, "
                         "with twice the channels, is not supported)")
    if out.dtype != like.dtype:
        raise TypeError(f"model output has dtype {out.dtype}, expected {like.dtype} (the dtype "
                        "of its input x: the diffusers loop would promote the sample to "
                        f"{out.dtype} after the first step; pass dtype={out.dtype} or make the "
                        "model return its input's dtype)")
    return out


READERS = {
    "DPMSolverMultistepScheduler": "paraprop.diffusion.multistep",
    "UniPCMultistepScheduler": "paraprop.diffusion.multistep",
    "EulerDiscreteScheduler": "paraprop.diffusion.karras",
    "EulerAncestralDiscreteScheduler": "paraprop.diffusion.karras",
    "HeunDiscreteScheduler": "paraprop.diffusion.karras",
    "FlowMatchEulerDiscreteScheduler": "paraprop.diffusion.flowmatch",
    "LCMScheduler": "paraprop.diffusion.flowmatch",
}


def reader(scheduler, num_inference_steps: int, *, mu: float | None = None,
           device: torch.device | str = "cpu", **options: Any) -> Reader:
    """The reader of ``scheduler`` (``set_timesteps(num_inference_steps, mu=mu)`` is called)
    for samples on ``device``; ``options``: the reader's own (EulerDiscrete: ``s_churn``).

    Raises:
        ValueError: a scheduler without a reader, or a setting its reader does not implement.
    """
    import importlib

    name = type(scheduler).__name__
    where = READERS.get(name)
    if where is None:
        raise ValueError(f"scheduler: {name} has no reader in paraprop.diffusion; supported: "
                         f"{', '.join(READERS)} (DDPMScheduler and DDIMScheduler: "
                         "paraprop.diffusion.schedulers)")
    cls = getattr(importlib.import_module(where), name.replace("Scheduler", "Reader"))
    return cls(scheduler, num_inference_steps, mu=mu, device=device, **options)
