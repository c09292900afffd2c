"""The argument checks of the flow entry points: points and contexts against the transform's
parameters and networks, the names of the autoregressive parts for messages, the refusal of
stochastic networks and of :mod:`torch.func` transforms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from paraprop.determinism import require_deterministic
from paraprop.errors import StochasticModelError


def require_deterministic_parts(parts: Iterable[tuple[str, nn.Module]], *, entry: str,
                                argument: str, hint: str = "") -> None:
    """Refuse an autoregressive network whose repeated evaluation differs (train mode with
    dropout, a random layer, a norm layer reading batch statistics): the solve evaluates it more
    often, on other iterates, than the library's loop, and neither has a fixed point to return.

    Arguments:
        parts: ``(name, module)`` of each autoregressive part (``name`` as in the flow, for the
            message; ``""`` for the flow itself).
        entry, argument: for the message (see :func:`paraprop.determinism.require_deterministic`).
        hint: appended to the message (e.g. how to get the library's own loop back).

    Raises:
        paraprop.StochasticModelError: naming the part, the layer and the fix.
    """
    for name, module in parts:
        where = f"{entry} (autoregressive part {name!r})" if name else entry
        try:
            require_deterministic(module, argument=argument, entry=where)
        except StochasticModelError as e:
            raise StochasticModelError(f"{e}{hint}") from None


def named_parts(root, parts: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``(name, part)``: each part's qualified name in ``root`` (a module), else its rank and
    class."""
    names = {id(m): n for n, m in root.named_modules()} if isinstance(root, nn.Module) else {}
    return [(names.get(id(m)) or f"#{i} ({type(m).__name__})", m) for i, m in enumerate(parts)]


def part_names(root) -> dict[int, str]:
    """``id(module) -> qualified name`` of the modules of ``root`` (empty: not a module)."""
    return {id(m): n for n, m in root.named_modules()} if isinstance(root, nn.Module) else {}


def part_name(names: dict[int, str], part) -> str:
    """How messages name ``part``: its name in the flow and its class."""
    name = names.get(id(part))
    return f"{name!r} ({type(part).__name__})" if name else type(part).__name__


def check_parts(root, parts: Iterable[nn.Module]) -> None:
    """:func:`require_deterministic_parts` for :func:`paraprop.flows.parallel_inverse`."""
    require_deterministic_parts(named_parts(root, parts), entry="paraprop.flows.parallel_inverse",
                                argument="transform")


def functorch_active() -> bool:
    """Whether a :mod:`torch.func` transform (grad, vjp, jacrev, vmap, ...) is running: the
    solve's data-dependent stop and the gradient hook cannot run under one."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def refuse_functorch() -> None:
    """:func:`paraprop.flows.parallel_inverse` under a :mod:`torch.func` transform."""
    if functorch_active():
        raise NotImplementedError(
            "paraprop.flows.parallel_inverse cannot run under torch.func transforms (grad, "
            "vjp, jacrev, vmap, ...): its early stop depends on the values and its gradient is "
            "a backward hook; call the library's own inverse there (an accelerated flow does "
            "so by itself under torch.func)")


def reference(module) -> torch.Tensor | None:
    """The first floating-point parameter of ``module`` (``None``: it has none)."""
    if not isinstance(module, nn.Module):
        return None
    return next((p for p in module.parameters() if p.is_floating_point()), None)


def check_like(name: str, t: torch.Tensor, ref: torch.Tensor | None, what: str) -> None:
    """``t`` must have the dtype and device of ``ref`` (the parameters of ``what``)."""
    if ref is None:
        return
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of the {what}'s parameters, {ref.dtype}, "
                        f"got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the device of the {what}'s parameters, "
                         f"{ref.device}, got {t.device}")


def check_features(y: torch.Tensor, features: int | None, what: str) -> None:
    if features is not None and y.shape[-1] != features:
        raise ValueError(f"y must have shape (N, {features}) ({features} features, as the "
                         f"{what}), got {tuple(y.shape)}")


def check_context_rows(y: torch.Tensor, context: torch.Tensor | None, n_ctx: int | None,
                       name: str) -> None:
    """An nflows / normflows MADE: ``context`` of shape ``(N, n_ctx)`` iff it was built with
    ``n_ctx`` context features."""
    if n_ctx is None:
        if context is not None:
            raise ValueError(f"context must be None: {name} was built without "
                             f"context_features, got context of shape {tuple(context.shape)}")
        return
    if context is None:
        raise ValueError(f"context is needed: {name} takes {n_ctx} context features; "
                         f"pass context of shape ({y.shape[0]}, {n_ctx})")
    if tuple(context.shape) != (y.shape[0], n_ctx):
        raise ValueError(f"context must have shape ({y.shape[0]}, {n_ctx}) (the rows of y, "
                         f"the context features of {name}), got {tuple(context.shape)}")


def composed_parts(t, children: Callable[[Any], Iterable | None],
                   is_part: Callable[[Any], bool]) -> Iterator:
    """The autoregressive parts of ``t`` in the composition's order (depth first): ``children``
    gives the members of a composition (``None``: ``t`` is not one), ``is_part`` tells an
    autoregressive part; other members have none."""
    members = children(t)
    if members is not None:
        for member in members:
            yield from composed_parts(member, children, is_part)
    elif is_part(t):
        yield t
