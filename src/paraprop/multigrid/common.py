"""What the single-process and the layer-parallel stacks share: argument checks and the autograd
Function whose forward and backward are MGRIT solves.

Both :class:`paraprop.multigrid.ParallelResidualStack` and
:class:`paraprop.distributed.LayerParallelStack` validate their settings here (once, at
construction, with the same messages), check the input and the blocks' modes at every forward
(:func:`check_input`, :func:`check_block_modes`) and route ``forward`` through
:func:`solve_through`, which calls the module's ``_solve_forward(x)`` and
``_solve_backward(states, stacked, grad_out, params)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from paraprop import checks
from paraprop.multigrid.params import RANDOM_MODULES, stateful_modules
from paraprop.multigrid.steps import shares_architecture

__all__ = ["BACKWARD", "DEFAULT_TOL", "RELAX", "UncheckedResultWarning", "as_coarsening",
           "check_block_modes", "check_blocks", "check_c_weight", "check_input", "check_settings",
           "resolve_batched", "solve_through", "stateful_modules", "warn_unchecked"]

RELAX = ("F", "FCF")
BACKWARD = ("adjoint", "serial")

#: The default ``tol`` of every MGRIT entry point: the bound on the estimated
#: ``max |value - serial|``. The same default as :func:`paraprop.solve`; float32 states of
#: order one carry rounding errors near ``1e-7``, two orders below it, so float32 solves reach
#: it (float64 ones may ask for far less).
DEFAULT_TOL = 1e-5


class UncheckedResultWarning(UserWarning):
    """A solve with ``tol=None`` and fewer cycles than the exactness bound: its result is not
    checked against the serial one (``converged=False``, ``stats["checked"] = False``)."""


def warn_unchecked(entry: str, max_iters: int, bound: int, stacklevel: int = 3) -> None:
    """Warn that ``entry`` runs ``max_iters < bound`` cycles with ``tol=None`` (shown once per
    call site under Python's default warning filters)."""
    warnings.warn(
        f"{entry}: tol=None with max_iters={max_iters} runs a fixed number of V-cycles (fewer "
        f"than the {bound} that reproduce the serial result); the result is not checked and in "
        "general not the serial one (converged=False, stats['checked']=False). Pass a tol to "
        "converge to the serial result, or max_iters=None for the exactness bound",
        UncheckedResultWarning, stacklevel=stacklevel)


def check_c_weight(c_weight) -> None:
    if not checks.is_number(c_weight) or not 0 < c_weight <= 2:
        raise ValueError(f"c_weight must be a number in (0, 2], got {c_weight!r}")


def check_settings(*, step_size, relax, max_iters, tol, c_weight, backward) -> None:
    """The settings of a residual-stack module (``max_iters``: ``>= 1`` or ``None``).

    Raises:
        ValueError: the first bad setting, named, with its value.
    """
    checks.positive_number("step_size", step_size, finite=True)
    checks.one_of("relax", relax, RELAX)
    checks.positive_int("max_iters", max_iters, allow_none=True)  # None: the exactness bound
    checks.nonneg_number("tol", tol, allow_none=True)
    checks.one_of("backward", backward, BACKWARD)
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


# -- checks at every forward ---------------------------------------------------------------------
def check_block_modes(stateful: list[tuple[int, str, nn.Module]], offset: int = 0) -> None:
    """Refuse a block with a module that would update buffers, or draw random numbers, in this
    forward call (train mode can be switched after construction, so this runs every time).

    Raises:
        ValueError: naming the block index, the module and the remedies.
    """
    for i, name, m in stateful:
        if not m.training:
            continue
        if isinstance(m, RANDOM_MODULES):
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p == 0:
                continue
            does = ("draws new random numbers at every call, and MGRIT calls every block "
                    "several times per solve, so no serial network computes its result")
        else:
            if not m.track_running_stats:
                continue  # batch statistics only: a pure function of the state
            does = ("updates its running statistics (buffers) at every call; MGRIT evaluates "
                    "the block several times per solve on intermediate states (on stacked "
                    "copies of the buffers when batched), so the statistics would not be the "
                    "serial network's (or would never be updated)")
        where = f"blocks[{i + offset}]" + (f".{name}" if name else "")
        raise ValueError(
            f"{where} is a {type(m).__name__} in training mode, which {does}. Put it in "
            f"evaluation mode (stack.eval() or {where}.eval()) to use it as a fixed function, "
            "or train with a plain nn.Sequential of the residual blocks instead")


def floating_tensors(blocks: Sequence[nn.Module]):
    """``(block index, name, tensor)`` of every floating-point parameter and buffer."""
    for i, b in enumerate(blocks):
        for name, t in b.named_parameters():
            if t.is_floating_point():
                yield i, name, t
        for name, t in b.named_buffers():
            if t.is_floating_point():
                yield i, name, t


def check_input(x: torch.Tensor, tensors, offset: int = 0, name: str = "x") -> None:
    """``x`` must have the dtype and device of the blocks' floating parameters and buffers.

    Arguments:
        tensors: ``(block index, name, tensor)`` triples (:func:`floating_tensors`).
        offset: the global index of block 0 (named in the message).

    Raises:
        TypeError: another dtype; ValueError: another device (both name the argument, the
            expected and the actual value, and the first block tensor that differs).
    """
    for i, pname, t in tensors:
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have the dtype of the blocks' parameters, {t.dtype} "
                            f"(blocks[{i + offset}].{pname}), got {x.dtype}; convert {name} "
                            f"(.to({t.dtype})) or the blocks (.to({x.dtype}))")
        if t.device != x.device:
            raise ValueError(f"{name} must be on the device of the blocks' parameters, "
                             f"{t.device} (blocks[{i + offset}].{pname}), got {x.device}")
