"""What the single-process and the layer-parallel stacks share: argument checks and the autograd
Function whose forward and backward are MGRIT solves.

Both :class:`paraprop.multigrid.ParallelResidualStack` and
:class:`paraprop.distributed.LayerParallelStack` validate their settings here (once, at
construction, with the same messages) and route ``forward`` through :func:`solve_through`,
which calls the module's ``_solve_forward(x)`` and ``_solve_backward(states, stacked,
grad_out, params)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from paraprop.multigrid.steps import shares_architecture

__all__ = ["BACKWARD", "RELAX", "as_coarsening", "check_blocks", "check_c_weight",
           "check_max_cycles", "check_relax", "check_settings", "check_step_size", "check_tol",
           "resolve_batched", "solve_through"]

RELAX = ("F", "FCF")
BACKWARD = ("adjoint", "serial")


def _is_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float)


def check_step_size(step_size) -> None:
    if not _is_number(step_size) or not math.isfinite(step_size) or step_size <= 0:
        raise ValueError(f"step_size must be a finite number > 0, got {step_size!r}")


def check_relax(relax) -> None:
    if relax not in RELAX:
        raise ValueError(f"relax must be one of {RELAX}, got {relax!r}")


def check_max_cycles(max_cycles, *, minimum: int, allow_none: bool) -> None:
    if max_cycles is None and allow_none:
        return
    if isinstance(max_cycles, bool) or not isinstance(max_cycles, int) or max_cycles < minimum:
        raise ValueError(f"max_cycles must be an int >= {minimum}"
                         f"{' or None' if allow_none else ''}, got {max_cycles!r}")


def check_tol(tol) -> None:
    if tol is not None and (not _is_number(tol) or not tol >= 0):
        raise ValueError(f"tol must be None or a number >= 0, got {tol!r}")


def check_c_weight(c_weight) -> None:
    if not _is_number(c_weight) or not 0 < c_weight <= 2:
        raise ValueError(f"c_weight must be a number in (0, 2], got {c_weight!r}")


def check_settings(*, step_size, relax, max_cycles, tol, c_weight, backward) -> None:
    """The settings of a residual-stack module (``max_cycles``: ``>= 1`` or ``None``).

    Raises:
        ValueError: the first bad setting, named, with its value.
    """
    check_step_size(step_size)
    check_relax(relax)
    check_max_cycles(max_cycles, minimum=1, allow_none=True)
    check_tol(tol)
    if backward not in BACKWARD:
        raise ValueError(f"backward must be one of {BACKWARD}, got {backward!r}")
    check_c_weight(c_weight)


def check_blocks(blocks) -> list[nn.Module]:
    """``blocks`` as a non-empty list of modules.

    Raises:
        TypeError: a single module that is not a container, or an entry that is not a module.
        ValueError: no blocks.
    """
    if isinstance(blocks, nn.Module) and not isinstance(blocks, nn.ModuleList | nn.Sequential):
        raise TypeError("blocks must be a sequence of nn.Module (e.g. a list or "
                        f"nn.ModuleList), got a single {type(blocks).__name__}")
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks must not be empty")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"blocks[{i}] must be an nn.Module, got {type(b).__name__}")
    return blocks


def resolve_batched(blocks: Sequence[nn.Module], batched: bool | None) -> bool:
    """``batched=None``: batch when the blocks share an architecture; ``True`` requires it."""
    shared = shares_architecture(blocks)
    if batched is None:
        return shared
    if batched and not shared:
        raise ValueError("batched=True needs blocks that share an architecture (same class, "
                         "structure, parameter and buffer shapes); pass batched=None")
    return bool(batched)


def as_coarsening(coarsening):
    return tuple(coarsening) if isinstance(coarsening, list | tuple) else coarsening


class _SolveFunction(torch.autograd.Function):
    """Forward: the module's MGRIT states; backward: its adjoint solve and parameter
    gradients (one per distinct trainable parameter, in the order passed)."""

    @staticmethod
    def forward(ctx, module, x, *params):
        states, stacked = module._solve_forward(x)
        ctx.module, ctx.states, ctx.stacked, ctx.params = module, states, stacked, params
        return states[-1].clone()

    @staticmethod
    def backward(ctx, grad_out):
        gx, grads = ctx.module._solve_backward(ctx.states, ctx.stacked, grad_out, ctx.params)
        return (None, gx, *grads)


def solve_through(module, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``u_N`` of ``module`` for ``x``, through autograd when anything needs a gradient
    (``params``: the distinct trainable parameters, empty when grad mode is off)."""
    if params or (torch.is_grad_enabled() and x.requires_grad):
        return _SolveFunction.apply(module, x, *params)
    states, _ = module._solve_forward(x)
    return states[-1].clone()
