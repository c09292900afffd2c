"""Forward-fusion: each bucket's update is applied right before its parameters' next use.

Algorithm (Jiang et al. 2021, §3.2, "forward-fusion"):

1. ``step()`` records a pending update per bucket: the gradients (references, with their
   version counters) and a snapshot of the hyperparameters. Nothing is computed.
2. In the next forward, a forward pre-hook on each module applies that module's bucket just
   before the module runs: the wrapped optimizer's own step on the bucket, with the recorded
   gradients and hyperparameters. The root bucket (tied weights, tensors outside the model) is
   applied in the model's own pre-hook, before anything else.
3. A read through a module (``other.weight``, ``model.parameters()``, ``copy.deepcopy``)
   applies the pending update of what it reads, at any time (:mod:`paraprop.optim.reads`): an
   EMA right after ``step()``, or ``F.linear(x, other.weight)`` inside the forward.
4. The first forward after the first step runs under a ``TorchFunctionMode`` that watches every
   operation for a parameter whose update is still pending, i.e. one read before its module's
   pre-hook ran through a reference held elsewhere (a list, a plain attribute). It applies such
   a bucket on the spot and moves the parameter to the root bucket.
5. Anything still pending at the next ``step()``, ``flush()`` or ``state_dict()`` (a module
   that did not run) is applied then, after checking that its gradient was not touched since
   the step: a pending parameter that received a new gradient was read stale, and
   :class:`~paraprop.optim.FusionError` says so instead of training on.

With ``overlap=True``, ``step()`` also hands the pending buckets, in module order, to a
background thread (:mod:`paraprop.optim.overlap`) that applies them while the next forward runs;
a module's pre-hook applies its bucket itself if the thread has not started it, or waits for it.
The first forward after the first step (the trace) is always synchronous.

Each update sees the same parameter, gradient, state and hyperparameters as the unfused step
(the updates of different parameters are independent), so the result is bitwise the same.
``zero_grad(set_to_none=True)`` drops ``.grad`` at once (the pending update holds its own
references; with ``overlap=True`` a gradient is dropped right after its update instead);
``set_to_none=False`` zeroes a pending gradient right after its update.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from paraprop.optim.buckets import (
    Bucket,
    PendingUpdate,
    Stepper,
    param_index,
    snapshot,
    zero_grads,
)
from paraprop.optim.errors import FusionError
from paraprop.optim.overlap import Worker
from paraprop.optim.reads import Hook, install, uninstall


class ForwardEngine:
    """Records updates at ``step()`` and applies them in the next forward (see module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                 buckets: list[Bucket], stepper: Stepper, overlap: bool = False):
        self.optimizer = optimizer
        self.model = model
        self.buckets = buckets
        self.stepper = stepper
        self.worker = Worker() if overlap else None
        self.lock = threading.Lock()  # bucket.pending / state / zero_request, n_pending
        self.n_pending = 0
        self.trace_next = True  # watch the first forward after the first step
        self.moved: list[str] = []  # parameters found used outside their module
        self._local = threading.local()  # .applying: the tracer must skip the step's own ops
        self._tracer: _UseTracer | None = None
        self._owner = {id(p): b for b in buckets for p in b.params}
        self._handles = []
        root = buckets[0]
        for b in buckets[1:]:
            for m in b.modules:
                self._handles.append(m.register_forward_pre_hook(Hook(self._pre, b),
                                                                 prepend=True))
        self._handles.append(model.register_forward_pre_hook(Hook(self._root_pre, root),
                                                             prepend=True))
        self._handles.append(model.register_forward_hook(Hook(self._root_post),
                                                         always_call=True))
        # model.state_dict() / load_state_dict() apply every update, also of tensors outside
        # the model; any other read through a module applies its own (paraprop.optim.reads)
        self._handles.append(model.register_state_dict_pre_hook(Hook(self._flush_hook)))
        self._handles.append(model.register_load_state_dict_pre_hook(Hook(self._flush_hook)))
        install(model, self)

    @property
    def applying(self) -> bool:
        return getattr(self._local, "applying", False)

    # -- recording ------------------------------------------------------------------------
    def step(self) -> None:
        """Record one update per bucket that has a gradient (leftovers are applied first)."""
        self.flush()
        hparams = snapshot(self.optimizer.param_groups)
        for b in self.buckets:
            grads = [p.grad for p in b.params]
            if all(g is None for g in grads):
                continue
            b.pending = PendingUpdate(hparams, grads)
            self.n_pending += 1
        if self.worker is not None and not self.trace_next:  # the trace runs synchronously
            for b in self.buckets:
                if b.pending is not None:
                    b.state = "queued"
                    b.event = threading.Event()
                    self.worker.submit(self._background, b)

    def zero_grad(self, set_to_none: bool) -> None:
        with self.lock:
            for b in self.buckets:
                if b.state is not None or (b.pending is not None and not set_to_none):
                    # not applied yet: its gradients are reset right after its update
                    b.zero_request = "none" if set_to_none else "zero"
                elif set_to_none:  # a pending update holds its own references
                    for p in b.params:
                        p.grad = None
                else:
                    zero_grads([p.grad for p in b.params if p.grad is not None])

    # -- applying -------------------------------------------------------------------------
    def is_pending(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s update is recorded and not applied yet (or being applied)."""
        b = self._owner.get(id(p))
        return b is not None and (b.pending is not None or b.state is not None)

    def ensure_fresh(self, p: torch.Tensor) -> None:
        """Return once ``p`` holds its updated value (a read of ``p`` through its module)."""
        b = self._owner.get(id(p))
        if b is not None and (b.pending is not None or b.state is not None):
            self.ensure_applied(b)

    def handle_ids(self) -> set[int]:
        """The ids of this engine's hooks in the modules' hook dicts."""
        return {h.id for h in self._handles}

    def ensure_applied(self, b: Bucket) -> None:
        """Return once ``b`` has no pending update: apply it here or wait for the thread."""
        if b.state is None:
            if b.pending is not None:
                self.apply(b)
            return
        with self.lock:
            state = b.state
            if state == "queued":
                b.state = "main"
        # (a bucket gets a state only with overlap=True: a worker, and an event per step)
        if state == "queued":
            assert b.event is not None
            try:
                self.apply(b)
            finally:
                b.event.set()
        elif state is not None:
            assert b.event is not None and self.worker is not None
            b.event.wait()
            self.worker.raise_error()

    def _background(self, b: Bucket) -> None:
        with self.lock:
            if b.state != "queued":
                return  # the forward got there first
            b.state = "running"
        assert b.event is not None      # (set with the state, by step)
        try:
            self.apply(b)
        finally:
            b.event.set()

    def apply(self, b: Bucket) -> None:
        """Apply ``b``'s pending update now, with the gradients recorded at ``step()``."""
        self._local.applying = True
        try:
            self._apply(b)
        finally:
            self._local.applying = False
            with self.lock:
                b.state = None

    def _apply(self, b: Bucket) -> None:
        pend = b.pending
        if pend is None:
            return
        swapped = []
        for p, name, g, v in zip(b.params, b.names, pend.grads, pend.versions, strict=True):
            if g is None:
                continue
            cur = p.grad
            if cur is not None and cur is not g:
                raise FusionError(
                    f"parameter {name!r} received a new gradient while its update from the "
                    "previous step() was still pending: it was read before its module's forward "
                    "pre-hook applied the update, so that forward used a stale value. Call "
                    "flush() before reading parameters outside the model's forward.")
            if g._version != v:
                raise FusionError(
                    f"the gradient of parameter {name!r} was modified in place after step() "
                    "recorded its update and before the update was applied (forward mode). "
                    "Modify gradients before step(); to reset them use the fused optimizer's "
                    "zero_grad() or set_to_none=True, not model.zero_grad(set_to_none=False).")
            if cur is None:
                swapped.append((p, g))
        with self.lock:
            b.pending = None
            self.n_pending -= 1
        for p, g in swapped:
            p.grad = g
        try:
            self.stepper.step(b.groups, pend.hparams)
            if self.worker is not None:
                for p, name, g in zip(b.params, b.names, pend.grads, strict=True):
                    if g is not None and p.grad is not g:
                        raise FusionError(
                            f"the gradient of parameter {name!r} was replaced while its update "
                            "ran on the background thread (overlap=True), so the update may "
                            "have skipped it. Reset gradients only with the fused optimizer's "
                            "zero_grad() and do not touch .grad between step() and the next "
                            "forward.")
        finally:
            for p, _ in swapped:
                p.grad = None
        with self.lock:  # a zero_grad() that came while this update was pending
            request, b.zero_request = b.zero_request, None
            attached = [(p, g) for p, g in zip(b.params, pend.grads, strict=True)
                        if g is not None and p.grad is g]
            if request == "none":
                for p, _ in attached:
                    p.grad = None
            elif request == "zero":
                zero_grads([g for _, g in attached])
            b.state = None

    def flush(self) -> None:
        """Apply every pending update (waiting for the background thread first)."""
        if self.worker is not None:
            self.worker.drain()
        if self.n_pending:
            for b in self.buckets:
                if b.pending is not None:
                    self.apply(b)

    # -- hooks ----------------------------------------------------------------------------
    def _pre(self, b: Bucket, module, args) -> None:
        if b.pending is not None or b.state is not None:
            self.ensure_applied(b)

    def _root_pre(self, root: Bucket, module, args) -> None:
        if root.pending is not None or root.state is not None:
            self.ensure_applied(root)
        if self.trace_next and self.n_pending and self._tracer is None:
            self._tracer = _UseTracer(self)
            self._tracer.__enter__()

    def _root_post(self, module, args, output) -> None:
        if self._tracer is None:
            return
        tracer, self._tracer = self._tracer, None
        tracer.__exit__(None, None, None)
        self.trace_next = False
        if tracer.found:
            self._move_to_root(tracer.found)

    def _flush_hook(self, *args, **kwargs) -> None:
        self.flush()

    def _move_to_root(self, found: list[Bucket]) -> None:
        """Merge the ``found`` buckets into the root bucket (applied first in each forward).

        A whole bucket moves: applying an update earlier than needed is still exact, and its
        other parameters may be read the same way (``F.linear(x, m.weight, m.bias)``).
        """
        self.flush()
        root = self.buckets[0]
        for b in found:
            if b is root or b not in self.buckets:
                continue
            root.params += b.params
            root.names += b.names
            self.moved += b.names
            self.buckets.remove(b)
        root.regroup(param_index(self.optimizer))
        self._owner = {id(p): b for b in self.buckets for p in b.params}

    def remove(self) -> None:
        self.flush()
        if self.worker is not None:
            self.worker.close()
        uninstall(self.model, self)
        for h in self._handles:
            h.remove()
        self._handles.clear()


# attribute reads that do not read a tensor's values
_METADATA = frozenset({
    "shape", "dtype", "device", "grad", "requires_grad", "is_leaf", "_version", "ndim",
    "layout", "grad_fn", "names", "is_cuda", "is_sparse", "is_quantized", "is_meta", "_base",
    "output_nr", "_backward_hooks", "_post_accumulate_grad_hooks", "is_nested", "itemsize",
    "nbytes", "name", "_cdata", "retains_grad",
})


class _UseTracer(TorchFunctionMode):
    """Applies the pending update of any parameter an operation reads, and remembers it."""

    def __init__(self, engine: ForwardEngine):
        super().__init__()
        self.engine = engine
        self.found: list[Bucket] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        eng = self.engine
        if eng.n_pending and not eng.applying and not (
                getattr(func, "__name__", None) == "__get__"
                and getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA):
            for t in _tensors(args, kwargs):
                b = eng._owner.get(id(t))
                if b is not None and (b.pending is not None or b.state is not None):
                    self.found.append(b)
                    eng.ensure_applied(b)
        return func(*args, **kwargs)


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, list | tuple):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x
