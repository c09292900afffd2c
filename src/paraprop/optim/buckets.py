"""Buckets: the units in which a fused optimizer steps its parameters.

A bucket is the set of parameters registered directly on one module (``recurse=False``), so a
bucket is complete when that module's forward may start (forward mode) or when all of its
gradients are accumulated (backward mode). Parameters registered on several modules (tied
weights) and optimized tensors outside the model form the *root* bucket, applied at the start of
the model's forward.

A bucket is stepped by the wrapped optimizer's own ``step`` implementation, called on a shallow
proxy of the optimizer whose ``param_groups`` hold only the bucket's parameters (with their
groups' hyperparameters) and whose ``state`` is the optimizer's own. Every ``torch.optim``
optimizer except LBFGS updates each parameter from that parameter's gradient and state alone, so
stepping the parameters bucket by bucket gives bitwise the same parameters and state as one step
over all of them, for the for-loop, ``foreach`` and ``fused`` implementations alike (Jiang et al.
2021, "Optimizer Fusion: Efficient Training with Better Locality and Parallelism", §3).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import nn

ROOT = "<root>"


class PendingUpdate:
    """A recorded update (forward mode): hyperparameters, gradients and their versions at
    ``step()``."""

    __slots__ = ("hparams", "grads", "versions")

    def __init__(self, hparams: list[dict], grads: list[torch.Tensor | None]):
        self.hparams = hparams
        self.grads = grads
        self.versions = [-1 if g is None else g._version for g in grads]


@dataclass(eq=False)
class Bucket:
    """The parameters stepped together, and the run-time state the fusion engines keep on them.

    Attributes:
        name: the owning module's qualified name, or ``"<root>"``.
        params: the parameters, in optimizer order.
        names: their qualified names in the model (or ``param_groups[g][i]``), for messages.
        groups: ``(group index, params of that group in this bucket)``, in optimizer order.
        modules: the modules whose forward pre-hook applies this bucket (forward mode).
    """

    name: str
    params: list[torch.Tensor]
    names: list[str]
    groups: list[tuple[int, list[torch.Tensor]]] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    # forward mode: the recorded update, or None; who applies it ("queued": the background
    # thread will, "running": it is, "main": the forward is); zero_grad() asked meanwhile
    pending: PendingUpdate | None = None
    state: str | None = None
    event: threading.Event | None = None
    zero_request: str | None = None
    # backward mode: gradients accumulated in this backward, expected count, stepped already
    ready: int = 0
    expected: int = 0
    done: bool = False

    def regroup(self, where: dict[int, tuple[int, int]]) -> None:
        """Sort ``params`` into optimizer order and recompute ``groups`` from ``where``."""
        order = sorted(range(len(self.params)), key=lambda i: where[id(self.params[i])])
        self.params = [self.params[i] for i in order]
        self.names = [self.names[i] for i in order]
        self.groups = []
        for p in self.params:
            gi = where[id(p)][0]
            if not self.groups or self.groups[-1][0] != gi:
                self.groups.append((gi, []))
            self.groups[-1][1].append(p)


def param_index(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, int]]:
    """``id(param) -> (group index, position in the group)`` for every optimized tensor."""
    return {id(p): (gi, i) for gi, g in enumerate(optimizer.param_groups)
            for i, p in enumerate(g["params"])}


def param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[int, str]:
    """``id(param) -> name``: the first qualified name in ``model``, else its optimizer slot."""
    names = {id(p): f"param_groups[{gi}][{i}]" for gi, g in enumerate(optimizer.param_groups)
             for i, p in enumerate(g["params"])}
    seen: set[int] = set()
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in names and id(p) not in seen:
            names[id(p)] = n
            seen.add(id(p))
    return names


def build_buckets(optimizer: torch.optim.Optimizer, model: nn.Module,
                  bucket_numel: int = 0) -> list[Bucket]:
    """One bucket per module owning optimized parameters, plus the root bucket (first).

    Arguments:
        optimizer: the wrapped optimizer.
        model: the module trained with it.
        bucket_numel: consecutive modules (registration order) are merged into one bucket
            until it holds at least this many elements; ``0``: one bucket per module.

    Returns:
        The buckets; the root bucket is first and may be empty. Every optimized tensor is in
        exactly one bucket.
    """
    where = param_index(optimizer)
    names = param_names(optimizer, model)
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for mname, mod in model.named_modules():
        for p in mod._parameters.values():
            if p is not None and id(p) in where:
                owners.setdefault(id(p), []).append((mname, mod))
    by_id = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    root = Bucket(ROOT, [], [], modules=[model])
    buckets: dict[int, Bucket] = {}
    for pid, p in by_id.items():
        own = owners.get(pid, [])
        if len(own) != 1:  # tied across modules, or not in the model at all
            root.params.append(p)
            root.names.append(names[pid])
            continue
        mname, mod = own[0]
        b = buckets.get(id(mod))
        if b is None:
            b = buckets[id(mod)] = Bucket(mname or type(mod).__name__, [], [], modules=[mod])
        b.params.append(p)
        b.names.append(names[pid])
    # module registration order, which is usually the order of first use
    order = {id(m): i for i, m in enumerate(model.modules())}
    out = [root]
    for b in sorted(buckets.values(), key=lambda b: order[id(b.modules[0])]):
        last = out[-1]
        if last is not root and sum(p.numel() for p in last.params) < bucket_numel:
            last.name = f"{last.name.split('..')[0]}..{b.name}"
            last.params += b.params
            last.names += b.names
            last.modules += b.modules
        else:
            out.append(b)
    for b in out:
        b.regroup(where)
    return out


def snapshot(param_groups: list[dict]) -> list[dict]:
    """The hyperparameters of every group as they are now (tensors cloned), without params.

    Forward mode applies an update after ``step()`` returned, when an LR scheduler may already
    have changed ``group["lr"]`` (in place, for a tensor learning rate); the snapshot keeps the
    values the unfused step would have used.
    """
    out = []
    for g in param_groups:
        out.append({k: (v.clone() if isinstance(v, torch.Tensor) else
                        list(v) if isinstance(v, list) else v)
                    for k, v in g.items() if k != "params"})
    return out


def zero_grads(grads: list[torch.Tensor]) -> None:
    """``zero_grad(set_to_none=False)`` on these gradients, as ``torch.optim`` does it."""
    for g in grads:
        if g.grad_fn is not None:
            g.detach_()
        else:
            g.requires_grad_(False)
        g.zero_()


class Stepper:
    """Calls the wrapped optimizer's own ``step`` on a subset of its parameters.

    The subset is stepped through a shallow proxy (same class, same ``state`` dict, same
    ``defaults``) whose ``param_groups`` hold just the subset, so the wrapped optimizer is never
    mutated and two threads may step disjoint subsets. The class's own step hooks and profiler
    wrapper are bypassed (the fused optimizer runs its hooks once per logical step); the
    ``torch.no_grad`` handling of ``torch.optim`` is kept.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device_types: set[str]):
        self.optimizer = optimizer
        f = type(optimizer).step
        # (torch's step hook wrapper marks itself hooked and keeps the step in __wrapped__)
        self._impl = f.__wrapped__ if getattr(f, "hooked", False) else f  # type: ignore[attr-defined]
        self._device_types = sorted(device_types)

    def step(self, groups: list[tuple[int, list[torch.Tensor]]], hparams: list[dict]) -> None:
        """Step ``groups`` (``(group index, params)``) with the hyperparameters ``hparams``."""
        opt = self.optimizer
        proxy = object.__new__(type(opt))
        proxy.__dict__.update(opt.__dict__)
        proxy.param_groups = [{**hparams[gi], "params": ps} for gi, ps in groups]
        autocast = [d for d in self._device_types if torch.is_autocast_enabled(d)]
        if not autocast:
            self._impl(proxy)
            return
        # the optimizer's arithmetic must not be cast by an autocast region around the forward
        with _no_autocast(autocast):
            self._impl(proxy)


class _no_autocast:
    def __init__(self, device_types: list[str]):
        self._ctx = [torch.autocast(d, enabled=False) for d in device_types]

    def __enter__(self):
        for c in self._ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self._ctx):
            c.__exit__(*exc)
        return False
