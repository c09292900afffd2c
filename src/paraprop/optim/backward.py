"""Backward-fusion: each bucket is updated inside ``backward()`` once its gradients are complete.

Algorithm (Jiang et al. 2021, §3.1, "backward-fusion"):

1. A post-accumulate-grad hook on every optimized parameter counts the bucket's gradients. The
   autograd engine accumulates all contributions to a leaf (tied weights included) before it
   runs that leaf's hook, once per backward, and only after every node that reads the leaf has
   run; so when a bucket's count is complete its gradients are final and no later node of this
   backward reads its parameters. The bucket is then stepped through the wrapped optimizer's
   own implementation, with the hyperparameters as they are (an LR scheduler has already moved
   on exactly as for the unfused step).
2. A callback queued on the autograd engine runs at the end of the backward and steps buckets
   that were left incomplete (a parameter that got no gradient this time but kept one from an
   earlier micro-batch, a module only partly used).
3. Each consumed gradient is replaced by a storage-less placeholder of the same shape, so its
   memory is released while the backward goes on, and any later read (global-norm clipping,
   ``GradScaler.unscale_``, a second ``backward()`` before ``zero_grad()``) raises
   :class:`~paraprop.optim.FusionError` naming the parameter instead of silently using nothing.
   ``zero_grad()`` clears the placeholders.

With ``overlap=True`` a completed bucket is handed to a background thread
(:mod:`paraprop.optim.overlap`) and the end-of-backward callback waits for it, so the updates run
while the autograd engine computes the remaining gradients; ``backward()`` still returns with
every update applied.

With ``accumulation_steps=k`` the hooks do nothing in the first ``k - 1`` backward passes of each
window; gradients accumulate as usual and the ``k``-th backward performs the update.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.autograd import Variable

from paraprop.optim.buckets import Bucket, Stepper, zero_grads
from paraprop.optim.errors import FusionError
from paraprop.optim.overlap import Worker

_HINT = ("Global-norm gradient clipping, GradScaler, or reading gradients after backward cannot "
         "be exact in backward mode: use mode='forward'. For gradient accumulation, pass "
         "accumulation_steps=k and call step() and zero_grad() after every backward().")


class ConsumedGrad(torch.Tensor):
    """Placeholder ``.grad`` of a parameter whose gradient the fused update already consumed.

    It has the parameter's shape, dtype and device and no storage; every operation on it raises
    :class:`~paraprop.optim.FusionError`.
    """

    param_name: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str):
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype,
                                                device=param.device, requires_grad=False)
        t.param_name = name
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        names = [a.param_name for a in _flat(args, kwargs) if isinstance(a, ConsumedGrad)]
        name = names[0] if names else "?"
        raise FusionError(
            f"{func.__name__} read the gradient of parameter {name!r}, which the optimizer "
            f"update fused into backward (mode='backward') has already consumed. {_HINT}")

    # (printing must not dispatch; torch's __repr__ takes a keyword that mypy cannot match)
    def __repr__(self) -> str:  # type: ignore[override]
        return f"ConsumedGrad(param={self.param_name!r}, shape={tuple(self.shape)})"


def _flat(args, kwargs):
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, list | tuple):
            yield from a
        else:
            yield a


class BackwardEngine:
    """Steps buckets from inside ``backward()`` (see module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: list[Bucket],
                 stepper: Stepper, update_now, overlap: bool = False):
        self.optimizer = optimizer
        self.worker = Worker() if overlap else None
        self.buckets = buckets
        self.stepper = stepper
        self.update_now = update_now  # () -> bool: is this backward the last of its window?
        self.in_backward = False
        self.updated = False  # an update ran in a backward since the last step()
        self._consumed: dict[int, ConsumedGrad] = {}
        self._handles = []
        for b in buckets:
            b.expected = sum(1 for p in b.params if p.requires_grad)
            for p, name in zip(b.params, b.names, strict=True):
                if p.requires_grad:
                    self._consumed[id(p)] = ConsumedGrad(p, name)
                    self._handles.append(
                        p.register_post_accumulate_grad_hook(partial(self._on_grad, b)))

    def _on_grad(self, b: Bucket, param: torch.Tensor) -> None:
        if not self.update_now():
            return
        if not self.in_backward:
            if self.updated:
                raise FusionError(
                    "a second backward() ran before step(): its update was already fused into "
                    f"the previous backward (mode='backward'). {_HINT}")
            self.in_backward = True
            Variable._execution_engine.queue_callback(self._end)
        b.ready += 1
        if b.ready == b.expected:
            b.done = True
            if self.worker is None:
                self._step(b)
            else:
                self.worker.submit(self._step, b)

    def _step(self, b: Bucket) -> None:
        b.done = True
        self.stepper.step(b.groups, self.optimizer.param_groups)
        for p in b.params:
            g = p.grad
            if g is not None and not isinstance(g, ConsumedGrad):
                p.grad = None if g.is_sparse else self._consumed[id(p)]

    def _has_grad(self, b: Bucket) -> bool:
        return any(p.grad is not None and not isinstance(p.grad, ConsumedGrad)
                   for p in b.params)

    def _end(self) -> None:
        """End of backward: step the buckets left incomplete, reset the counts."""
        try:
            if self.worker is not None:
                self.worker.drain()
            for b in self.buckets:
                if not b.done and self._has_grad(b):
                    self._step(b)
        finally:
            for b in self.buckets:
                b.ready = 0
                b.done = False
            self.in_backward = False
            self.updated = True

    def step(self) -> None:
        """The logical step: nothing left to do unless no backward updated this window."""
        if not self.updated:  # e.g. gradients assigned by hand, no backward ran
            for b in self.buckets:
                if self._has_grad(b):
                    self._step(b)
            for b in self.buckets:
                b.done = False
        self.updated = False

    def zero_grad(self, set_to_none: bool) -> None:
        for b in self.buckets:
            for p in b.params:
                g = p.grad
                if g is None:
                    continue
                if set_to_none:
                    p.grad = None
                elif isinstance(g, ConsumedGrad):
                    p.grad = torch.zeros_like(p)
                else:
                    zero_grads([g])

    def flush(self) -> None:
        """Nothing is ever pending between backward passes."""

    def remove(self) -> None:
        if self.worker is not None:
            self.worker.close()
        for h in self._handles:
            h.remove()
        self._handles.clear()
