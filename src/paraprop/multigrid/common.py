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
from collections.abc import Iterable, Sequence
from itertools import chain

import torch
from torch import nn

from paraprop import checks
from paraprop.determinism import NORM_MODULES, refuse_random_draws, stochastic_parts
from paraprop.errors import StochasticModelError
from paraprop.multigrid.params import stateful_modules
from paraprop.multigrid.steps import shares_architecture

__all__ = ["BACKWARD", "DEFAULT_TOL", "LOW_PRECISION", "RELAX", "UncheckedResultWarning",
           "as_coarsening", "check_block_modes", "check_blocks", "check_c_weight", "check_input",
           "check_settings", "refuse_random_blocks", "resolve_batched", "run_batched",
           "solve_through", "stateful_modules", "warn_unchecked"]

RELAX = ("F", "FCF")
BACKWARD = ("adjoint", "serial")

#: The default ``tol`` of every MGRIT entry point: the bound on the estimated
#: ``max |value - serial|``. The same default as :func:`paraprop.solve`; float32 states of
#: order one carry rounding errors near ``1e-7``, two orders below it, so float32 solves reach
#: it (float64 ones may ask for far less).
DEFAULT_TOL = 1e-5


class UncheckedResultWarning(UserWarning):
    """A solve with ``tol=None`` and fewer cycles than the exactness bound: its result is not
    checked against the serial one (``converged=False``, ``stats["checked"] = False``).

    Example:
        >>> from paraprop.multigrid import ForwardStepper, Hierarchy, mgrit
        >>> stepper = ForwardStepper([nn.Linear(4, 4) for _ in range(16)])
        >>> hierarchy = Hierarchy.build(16, levels=2, coarsening=4)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     sol = mgrit(stepper, torch.randn(2, 4), hierarchy, 0.1, tol=None, max_iters=1)
        >>> caught[0].category.__name__, sol.result
        ('UncheckedResultWarning', <Result.unchecked: ...>)
    """


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


def check_settings(*, step_size, relax, max_iters, tol, c_weight, backward, throw=True
                   ) -> None:
    """The settings of a residual-stack module (``max_iters``: ``>= 1`` or ``None``), checked
    at construction and again at every forward (the attributes may be assigned later).

    Raises:
        ValueError: the first bad setting, named, with its value.
    """
    checks.positive_number("step_size", step_size, finite=True)
    checks.one_of("relax", relax, RELAX)
    checks.positive_int("max_iters", max_iters, allow_none=True)  # None: the exactness bound
    checks.nonneg_number("tol", tol, allow_none=True)
    checks.one_of("backward", backward, BACKWARD)
    check_c_weight(c_weight)
    checks.boolean("throw", throw)


#: dtypes in which the batched evaluation of the blocks is not used (see :func:`run_batched`)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def run_batched(entry: str, batched: bool, requested, dtype: torch.dtype, tol,
                remedy: str | None = None) -> bool:
    """Whether this solve evaluates the blocks batched (one ``vmap`` over stacked parameters).

    The batched evaluation rounds differently from the per-block serial loop (other kernels):
    by about one unit in the last place per layer, which float32 and float64 certificates far
    above rounding absorb, but which makes ``tol=0`` (bitwise the serial result) impossible and
    is several units of the certified error in bfloat16 / float16 (measured: 2 to 4 ulp at depth
    32). So those solves evaluate block by block, whose fixed point is bitwise the serial loop.

    Arguments:
        batched: the module's setting resolved at construction (blocks share an architecture).
        requested: what the user passed (``None``: the module's choice; ``True``: required).
        remedy: what to do instead, for the message (default: the modules' ``batched``).

    Raises:
        ValueError: ``batched=True`` was required with ``tol=0`` or a bf16 / fp16 input.
    """
    if not batched:
        return False
    why = (f"x has dtype {dtype}" if dtype in LOW_PRECISION else
           "tol=0 (bitwise the serial result)" if tol == 0 else None)
    if why is None:
        return True
    if requested:
        raise ValueError(
            f"{entry}: batched=True with {why}: the batched evaluation (vmap over stacked "
            "parameters) rounds differently from the per-block serial loop (about one unit in "
            "the last place per layer), so it can neither give the serial result bitwise nor "
            "certify a tol in bfloat16 / float16; " + (remedy or
            "pass batched=None (such solves then evaluate the blocks one by one, bitwise the "
            "serial loop's steps) or batched=False"))
    return False


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


def resolve_batched(blocks: Sequence[nn.Module] | nn.ModuleList, batched: bool | None) -> bool:
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


# -- random operations in a block ---------------------------------------------------------------
RANDOM = ("MGRIT evaluates every block several times per solve, on intermediate states, so a "
          "block that draws random numbers gives another value at every evaluation and no serial "
          "network computes the result. Call stack.eval() if the block draws only in training "
          "mode (dropout-like noise), or remove the random operation (expected: each block a "
          "fixed function of its input)")


def refuse_random_blocks(entry: str, device: torch.device):
    """Around a solve: a block that draws random numbers (``torch.randn_like`` and the like,
    which :func:`check_block_modes` cannot see) raises :class:`StochasticModelError`, naming
    the cause: in the batched evaluation ``vmap`` refuses the random operation (its error is
    translated), block by block the global generator of the device moved (one comparison of its
    state per solve; :func:`paraprop.determinism.refuse_random_draws`)."""
    return refuse_random_draws(device, (
        f"{entry}: a block drew random numbers during the solve (torch's global generator on "
        f"{device} moved, or vmap refused a random operation: torch.randn_like, dropout, ...). "
        f"{RANDOM}"))


# -- checks at every forward ---------------------------------------------------------------------
def check_block_modes(stateful: list[tuple[int, str, nn.Module]], offset: int = 0) -> None:
    """Refuse a block whose output in this forward call would not be a fixed function of its
    input (train mode can be switched after construction, so this runs every time): a layer
    that draws random numbers (:func:`paraprop.determinism.stochastic_parts`: dropout, RReLU,
    functional dropout attributes), or a norm layer that updates running statistics. A norm layer
    without running statistics reads only the statistics of the state it is given (the whole
    batch at one depth, as in the serial network), so it is accepted.

    Arguments:
        stateful: the candidates (:func:`stateful_modules`; listed once per module).
        offset: the global index of block 0 (named in the message).

    Raises:
        paraprop.StochasticModelError: a ``ValueError`` naming the block index, the layer, what
            it does and the remedy (``stack.eval()``).
    """
    for i, name, m in stateful:
        if not m.training:
            continue
        where = f"blocks[{i + offset}]" + (f".{name}" if name else "")
        if isinstance(m, NORM_MODULES):
            if not m.track_running_stats:
                continue  # batch statistics only: a pure function of the state
            does = ("updates its running statistics (buffers) at every call; MGRIT evaluates "
                    "the block several times per solve on intermediate states (on stacked "
                    "copies of the buffers when batched), so the statistics would not be the "
                    "serial network's (or would never be updated)")
            kind = type(m).__name__
        else:
            parts = stochastic_parts(m, norms=False)
            own = [p for p in parts if p[0] == "(the model)"]   # m itself, not its children
            if not own:
                continue   # p = 0, or the attribute is not an active dropout rate
            _, kind, what = own[0]
            does = (f"{what}, and MGRIT calls every block several times per solve, so no "
                    "serial network computes its result")
        raise StochasticModelError(
            f"{where} is a {kind} in training mode, which {does}. Call stack.eval() (or "
            f"{where}.eval()) first to use it as a fixed function of its input (expected a "
            "block in eval mode or without stochastic layers; found train mode), or train "
            "with a plain nn.Sequential of the residual blocks instead")


def floating_tensors(blocks: Iterable[nn.Module]):
    """``(block index, name, tensor)`` of every floating-point parameter and buffer."""
    for i, b in enumerate(blocks):
        for name, t in chain(b.named_parameters(), b.named_buffers()):
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
