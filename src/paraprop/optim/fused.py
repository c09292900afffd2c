"""``paraprop.optim.fuse``: optimizer fusion for any per-parameter ``torch.optim`` optimizer.

Jiang et al. 2021, "Optimizer Fusion: Efficient Training with Better Locality and Parallelism"
(arXiv:2104.00237): instead of one optimizer step over all parameters between two iterations,
update each parameter while it is hot, either as soon as its gradient is complete
(*backward-fusion*, :mod:`paraprop.optim.backward`) or just before its next use
(*forward-fusion*, :mod:`paraprop.optim.forward`). The updates are those of the wrapped
optimizer, parameter for parameter, so the trained model is bitwise the unfused one.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from itertools import chain
from types import FrameType
from typing import NoReturn, overload

import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from paraprop import checks
from paraprop.optim.backward import BackwardEngine
from paraprop.optim.buckets import Stepper, build_buckets
from paraprop.optim.errors import FusionError
from paraprop.optim.forward import ForwardEngine

MODES = ("forward", "backward")
DEFAULT_BUCKET_NUMEL = 1 << 14


def fuse(optimizer: torch.optim.Optimizer, model: nn.Module, *, mode: str = "forward",
         accumulation_steps: int = 1, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
         overlap: bool = False) -> FusedOptimizer:
    """Fuse ``optimizer``'s step into ``model``'s forward or backward pass.

    The training loop stays the usual one (``loss.backward(); opt.step(); opt.zero_grad()``)
    with the returned optimizer in place of ``optimizer``; ``opt.param_groups``, ``opt.state``
    and ``opt.state_dict()`` are the wrapped optimizer's, LR schedulers take either object.

    Arguments:
        optimizer: a ``torch.optim.Optimizer`` whose step updates every parameter from that
            parameter's own gradient and state (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta,
            Adamax, NAdam, RAdam, ...; the for-loop, ``foreach`` and ``fused`` implementations).
            Its parameters are stepped per module, through its own ``step``.
        model: the module whose forward/backward carries the updates. Buckets are the
            parameters registered directly on each of its modules; optimized tensors shared by
            several modules or outside ``model`` are applied at the start of its forward.
        mode: ``"forward"``: ``step()`` records the update and each module applies it right
            before its next use (exact with global-norm clipping, gradient accumulation,
            ``GradScaler``, LR schedulers, save/resume and DistributedDataParallel);
            ``"backward"``: each bucket is updated inside ``backward()`` as soon as its
            gradients are complete, and the gradients are released (lower peak memory).
        accumulation_steps: ``k >= 1``. With ``k > 1`` call ``step()`` and ``zero_grad()``
            after every ``backward()``; only every ``k``-th call updates (backward mode: the
            ``k``-th backward), the others let the gradients accumulate.
        bucket_numel: a module whose parameters hold fewer elements than this is merged with
            the modules registered after it into one bucket (fewer calls of the optimizer's
            step, each with its fixed cost); ``0``: exactly one bucket per module.
        overlap: apply the updates on a background thread while the pass goes on: backward
            mode steps each finished bucket there (``backward()`` returns once all are
            applied); forward mode starts applying the pending buckets at ``step()`` and each
            module waits for its own. Parameters are then being written between ``step()`` and
            the next forward; reads through the model wait for them
            (:mod:`paraprop.optim.reads`).

    Returns:
        A :class:`FusedOptimizer`.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` (or is already fused),
            ``model`` is not an ``nn.Module``, ``overlap`` is not a bool.
        ValueError: an unknown ``mode``; ``accumulation_steps`` not an int ``>= 1``,
            ``bucket_numel`` not an int ``>= 0``; an optimizer that is not
            per-parameter (LBFGS) or that has step hooks of its own; an optimizer already
            fused; ``mode="backward"`` with DistributedDataParallel.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = fuse(torch.optim.Adam(model.parameters(), lr=1e-3), model, mode="forward")
        >>> batches = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(3)]
        >>> for x, y in batches:
        ...     loss = F.mse_loss(model(x), y)   # pending updates applied module by module
        ...     loss.backward()
        ...     opt.step()                       # records the update
        ...     opt.zero_grad()
        >>> opt.flush()                          # or opt.state_dict(), model.state_dict()
    """
    return FusedOptimizer(optimizer, model, mode=mode, accumulation_steps=accumulation_steps,
                          bucket_numel=bucket_numel, overlap=overlap)


def _validate(optimizer, model, mode, accumulation_steps, bucket_numel, overlap) -> None:
    if isinstance(optimizer, FusedOptimizer):
        raise TypeError("optimizer is already a FusedOptimizer; fuse the plain optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    checks.one_of("mode", mode, MODES)
    checks.positive_int("accumulation_steps", accumulation_steps)
    checks.nonneg_int("bucket_numel", bucket_numel)
    checks.boolean("overlap", overlap)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "LBFGS cannot be fused: its step needs a closure that re-evaluates the loss and a "
            "line search over all parameters together, so its update is not per-parameter")
    if getattr(optimizer, "_paraprop_fused", False):
        raise ValueError("this optimizer is already fused; call unfuse() on the first "
                         "FusedOptimizer before fusing it again")
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        raise ValueError(
            "the optimizer has step pre/post hooks; a fused optimizer steps it bucket by bucket "
            "and would not run them once per step. Register them on the FusedOptimizer instead")
    if mode == "backward":
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError(
                "mode='backward' with DistributedDataParallel is not supported: the update "
                "would use the local gradient before the all-reduce. Use mode='forward', "
                "which works unchanged with DistributedDataParallel")
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"mode='backward' under torch.distributed (world size {dist.get_world_size()}) "
                "is not supported: the post-accumulate-grad hooks run before any all-reduce. "
                "Use mode='forward'")


def _fixed(name: str, doc: str) -> property:
    """A setting of :class:`FusedOptimizer` fixed when fused: read from its settings; an
    assignment is refused, naming the way to change it."""
    def get(self):
        return self._settings[name]

    def refuse(self, value):
        def show(v):
            return f"a {type(v).__name__}" if isinstance(v, nn.Module) else repr(v)

        again = ("paraprop.optim.fuse(optimizer, new_model, ...)" if name == "model" else
                 f"paraprop.optim.fuse(optimizer, model, {name}={value!r}, ...)")
        raise AttributeError(
            f"FusedOptimizer.{name} is fixed when the optimizer is fused (the hooks and "
            f"buckets are built for {name}={show(self._settings[name])}); assigning "
            f"{name}={show(value)} would be ignored. Call opt.unfuse() and fuse it again: "
            f"{again}")

    return property(get, refuse, doc=doc)


class FusedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim`` optimizer whose step is fused into the forward or backward pass.

    Create it with :func:`fuse`. It is a drop-in for the wrapped optimizer: ``param_groups``,
    ``state``, ``defaults``, ``state_dict()`` and ``load_state_dict()`` are the wrapped
    optimizer's (checkpoints move freely between fused and plain optimizers); step hooks
    registered on it run once per logical step.

    Attributes:
        optimizer: the wrapped optimizer.
        model: the fused module (read-only).
        mode: ``"forward"`` or ``"backward"`` (read-only).
        accumulation_steps: backward passes per update (assignable between updates, checked).
        bucket_numel: the smallest bucket before merging with the next module (read-only).
        overlap: whether the updates run on a background thread (read-only).
        buckets: the parameter buckets (root first), for inspection.

    The read-only settings fix the hooks and buckets built at :func:`fuse`: assigning one
    raises ``AttributeError`` naming the way to change it (``unfuse()``, then :func:`fuse`
    again) instead of being ignored.

    Example:
        >>> import copy
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> plain = copy.deepcopy(model)
        >>> opt = fuse(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
        ...            mode="backward")
        >>> plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        >>> for _ in range(3):
        ...     x, y = torch.randn(16, 4), torch.randn(16, 1)
        ...     for m, o in ((model, opt), (plain, plain_opt)):
        ...         F.mse_loss(m(x), y).backward()
        ...         o.step()
        ...         o.zero_grad()
        >>> opt.flush()
        >>> all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
        True
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, *,
                 mode: str = "forward", accumulation_steps: int = 1,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL, overlap: bool = False):
        _validate(optimizer, model, mode, accumulation_steps, bucket_numel, overlap)
        # Optimizer.__init__ is not called: the groups and state are the wrapped optimizer's
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._zero_grad_profile_name = "Optimizer.zero_grad#FusedOptimizer.zero_grad"
        self.optimizer = optimizer
        self._calls = 0  # step() calls in the current accumulation window
        self._settings = {"model": model, "mode": mode, "bucket_numel": bucket_numel,
                          "overlap": overlap}
        self.accumulation_steps = accumulation_steps
        self._build()
        optimizer._paraprop_fused = True  # type: ignore[attr-defined]  # our mark on theirs

    # -- the settings: fixed when fused, or checked when assigned --------------------------
    _accumulation_steps: int
    model = _fixed("model", "The fused module (fixed when fused).")
    mode = _fixed("mode", "``\"forward\"`` or ``\"backward\"`` (fixed when fused).")
    bucket_numel = _fixed("bucket_numel", "The smallest bucket before merging with the next "
                                          "module (fixed when fused).")
    overlap = _fixed("overlap", "Whether the updates run on a background thread (fixed when "
                                "fused).")

    @property
    def accumulation_steps(self) -> int:
        """Backward passes per update. May be assigned between updates (the next window then
        has the new length); an assignment inside a window, or of anything but an int
        ``>= 1``, is refused."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value) -> None:
        checks.positive_int("accumulation_steps", value)
        if self._calls:
            raise ValueError(
                f"accumulation_steps cannot change inside an accumulation window ({self._calls} "
                f"of {self._accumulation_steps} backward passes accumulated); assign it right "
                f"after the step() that updates (expected {self._accumulation_steps} until then, "
                f"got {value})")
        self._accumulation_steps = value

    def _build(self) -> None:
        opt = self.optimizer
        self.buckets = build_buckets(opt, self.model, self.bucket_numel)
        devices = {p.device.type for g in opt.param_groups for p in g["params"]}
        stepper = Stepper(opt, devices)
        self._engine: ForwardEngine | BackwardEngine
        if self.mode == "forward":
            self._engine = ForwardEngine(opt, self.model, self.buckets, stepper, self.overlap)
        else:
            self._engine = BackwardEngine(opt, self.buckets, stepper, self._update_now,
                                          self.overlap)

    def _update_now(self) -> bool:
        return self._calls == self.accumulation_steps - 1

    # -- the wrapped optimizer's attributes -------------------------------------------------
    # (read-only views of the wrapped optimizer's, where torch.optim declares attributes)
    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.optimizer.defaults

    # -- the training loop ------------------------------------------------------------------
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> NoReturn: ...

    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Perform (backward mode: complete) or record (forward mode) one optimizer step.

        Raises:
            ValueError: a ``closure`` (the loss cannot be re-evaluated inside a fused step).
            FusionError: ``GradScaler.step`` with ``accumulation_steps > 1`` or in backward
                mode; a stale parameter found while applying leftover updates.
        """
        if closure is not None:
            raise ValueError("closures are not supported: a fused step is applied later (forward "
                             "mode) or earlier (backward mode) than a closure would run")
        if self.accumulation_steps > 1 or self.mode == "backward":
            _refuse_grad_scaler(self.mode)
        for hook in chain(_global_optimizer_pre_hooks.values(),
                          self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        if self._update_now():
            self._calls = 0
            self._engine.step()
            self._opt_called = True  # what LR schedulers check
            self.optimizer._opt_called = True  # type: ignore[attr-defined]  # set as torch does
        else:
            self._calls += 1
        for hook in chain(self._optimizer_step_post_hooks.values(),
                          _global_optimizer_post_hooks.values()):
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as ``torch.optim.Optimizer.zero_grad`` (see the mode modules).

        Inside an accumulation window (after a ``step()`` that did not update) it does nothing.
        """
        if self._calls == 0:
            self._engine.zero_grad(set_to_none)

    def flush(self) -> None:
        """Apply every pending update now (forward mode; a no-op in backward mode).

        Reads through the model apply the updates they need by themselves (``model.parameters()``,
        ``model.head.weight``, ``state_dict()``, ``copy.deepcopy(model)``, so an EMA or
        ``AveragedModel``; see :mod:`paraprop.optim.reads`). Call it before reading parameters
        through references taken earlier (a list of the parameters, ``param_groups``).
        """
        self._engine.flush()

    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict()``, after :meth:`flush`."""
        self.flush()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """:meth:`flush`, then the wrapped optimizer's ``load_state_dict``."""
        self.flush()
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the wrapped optimizer and rebuild the buckets."""
        self.flush()
        self._engine.remove()
        self.optimizer.add_param_group(param_group)
        self._build()

    def unfuse(self) -> torch.optim.Optimizer:
        """Apply pending updates, remove every hook (and, forward mode, the read guards of
        :mod:`paraprop.optim.reads`), and return the wrapped optimizer."""
        self._engine.remove()
        self.optimizer._paraprop_fused = False  # type: ignore[attr-defined]  # (see __init__)
        return self.optimizer

    # state_dict hooks belong to the wrapped optimizer, whose state_dict() runs them
    def register_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __getstate__(self):
        raise TypeError("a FusedOptimizer holds hooks and cannot be pickled; save "
                        "state_dict() instead")

    def __repr__(self) -> str:
        return (f"FusedOptimizer(mode={self.mode!r}, accumulation_steps="
                f"{self.accumulation_steps}, buckets={len(self.buckets)}, overlap={self.overlap}, "
                f"optimizer={type(self.optimizer).__name__})")


def _refuse_grad_scaler(mode: str) -> None:
    """Raise if the caller is ``GradScaler.step`` in a setting it cannot be exact in."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(3):  # GradScaler.step -> _maybe_opt_step -> [scheduler wrapper] -> step
        if frame is None:
            return
        if frame.f_code.co_name == "_maybe_opt_step" and isinstance(
                frame.f_locals.get("self"), torch.amp.GradScaler):
            if mode == "backward":
                raise FusionError(
                    "GradScaler cannot be exact in mode='backward': the update fused into "
                    "backward runs before the scaler can unscale the gradients and check them "
                    "for inf/NaN. Use mode='forward'")
            raise FusionError(
                "GradScaler.step() with accumulation_steps > 1 would unscale partly accumulated "
                "gradients. With GradScaler, use accumulation_steps=1 and call scaler.step() "
                "once every k micro-batches, as without fusion")
        frame = frame.f_back
