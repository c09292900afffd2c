"""The ``torch.nn.Module`` s a model callable wraps, as far as they can be seen, for the
up-front determinism check of :func:`paraprop.diffusion.sample` (a module in train mode with
dropout or batch statistics is refused by name, also behind a wrapper)."""

from __future__ import annotations

import functools

import torch


def wrapped_modules(model, name: str = "model", entry: str = "diffusion.sample",
                    depth: int = 3, seen=None):
    """``(name, entry, module)`` for ``model`` and the ``torch.nn.Module`` s it wraps, as far
    as they can be seen: a ``functools.partial`` 's ``func``, ``args`` and ``keywords``, a bound
    method's ``__self__``, ``__wrapped__`` and the variables a function closes over (a lambda
    that reads a global module cannot be seen through: the runtime check,
    :meth:`~paraprop.diffusion.chain.DiffusionChain.diagnose`, catches it)."""
    seen = set() if seen is None else seen
    if id(model) in seen or depth < 0:
        return []
    seen.add(id(model))
    if isinstance(model, torch.nn.Module) or \
            isinstance(getattr(model, "__self__", None), torch.nn.Module):
        return [(name, entry, model)]   # (a bound method such as unet.forward counts as unet)
    found = []

    def visit(obj, sub, sub_entry=entry):
        found.extend(wrapped_modules(obj, sub, sub_entry, depth - 1, seen))

    if isinstance(model, functools.partial):
        visit(model.func, f"{name}.func")
        for i, a in enumerate(model.args):
            visit(a, f"{name}.args[{i}]")
        for k, v in model.keywords.items():
            visit(v, f"{name}.keywords[{k!r}]")
    owner = getattr(model, "__self__", None)
    if owner is not None and not isinstance(model, functools.partial):
        visit(owner, f"{name}.__self__")
    inner = getattr(model, "__wrapped__", None)
    if inner is not None:
        visit(inner, f"{name}.__wrapped__")
    code, cells = getattr(model, "__code__", None), getattr(model, "__closure__", None)
    if code is not None and cells:
        for var, cell in zip(code.co_freevars, cells, strict=False):
            try:
                value = cell.cell_contents
            except ValueError:   # an empty cell
                continue
            visit(value, var, f"{entry} ({name} closes over {var})")
    return found


__all__ = ["wrapped_modules"]
