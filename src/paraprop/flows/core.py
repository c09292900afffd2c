"""The part shared by every flow library: one autoregressive transform inverted by
:func:`paraprop.solve`, with exact gradients, and the argument checks.

A masked autoregressive transform ``y = f(x)`` is inverted by the libraries with passes
``x <- h(x) := f_x^{-1}(y)`` from zeros. ``h`` is triangular (position ``i`` of ``h(x)`` reads
only the positions before ``i`` in the transform's order), so its fixed point is unique and
Jacobi reaches it after at most ``D`` passes (Song et al. 2021, §3, Proposition 1); stopping at
the bitwise fixed point (``tol=0``) returns exactly what the library's loop returns.

Gradients: the libraries differentiate through all their passes. paraprop solves without a
graph and attaches the gradient of the fixed point by implicit differentiation instead
(``x* = h(x*; y, θ)`` gives ``dx* = (I - N)^{-1} ∂h``, ``N = ∂h/∂x`` strictly triangular): one
differentiable pass ``h(x*)`` (the same value, bitwise, at a fixed point) whose incoming
gradient ``v`` a hook replaces by ``u = (I - N)^{-T} v``, found by the iteration
``u <- v + N^T u`` (exact after at most ``D`` steps, stopped at its bitwise fixed point).
First-order gradients only: the hook's products are not themselves differentiated, and under
``create_graph=True`` they carry a node that refuses a second differentiation
(:func:`paraprop.first_order.refuse_second_order`) rather than give a wrong second derivative.
That node hangs from the incoming gradient *and* from the differentiable pass itself, so every
second differentiation reaches it: with respect to the flow's parameters, the inverted points or
the context, whether or not the incoming gradient depends on them.

Every entry point refuses an autoregressive network in train mode with dropout or another
stochastic layer (:func:`require_deterministic_parts`): its passes would differ from call to
call, so there is no fixed point, and the library's own loop returns a different value each time.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn

from paraprop import checks
from paraprop.checks import check_max_iters, check_tol
from paraprop.determinism import require_deterministic
from paraprop.errors import StochasticModelError
from paraprop.first_order import refuse_second_order
from paraprop.result import Solution
from paraprop.solve import solve
from paraprop.solvers import METHODS, NEWTON_METHODS, make_solver

# the triangular (non-Markov) methods: Newton's family needs a Markov system
FLOW_METHODS = tuple(m for m in METHODS if m not in NEWTON_METHODS)


@dataclasses.dataclass
class Settings:
    """How each autoregressive transform is inverted (validated by :func:`settings`)."""

    solver: object
    tol: float
    max_iters: int | None
    throw: bool


def settings(method, tol, max_iters, throw) -> Settings:
    """Validate the shared arguments once, at an entry point."""
    solver = make_solver(method, names=FLOW_METHODS)
    check_tol(tol)
    check_max_iters(max_iters)
    checks.boolean("throw", throw)
    return Settings(solver, tol, max_iters, throw)


def invert_part(h: Callable[[torch.Tensor], torch.Tensor], y: torch.Tensor,
                order: torch.Tensor | None, cfg: Settings,
                record: Callable[[Solution], None]) -> torch.Tensor:
    """The fixed point of ``x = h(x)`` (``h`` triangular in ``order``), differentiable.

    Arguments:
        h: one pass of the library's inverse loop, ``x -> f_x^{-1}(y)``.
        y: the point being inverted (its shape is the shape of ``x``; the last dim is the
            features).
        order: the rank of each feature in the transform's order (``None``: natural order).
        cfg: the solver settings.
        record: called with the :class:`Solution` of the solve.
    """
    with torch.no_grad():
        x = _ordered_solve(h, y, order, cfg, record)
    if torch.is_grad_enabled():
        x = _implicit(h, x)
    return x


def _ordered_solve(h, y, order, cfg, record):
    """Solve ``x = h(x)`` from zeros along the last dim, positions sorted by ``order``; the
    recorded Solution's value is in feature order, like the result."""
    def run(fn, back=None):
        sol = solve(fn, torch.zeros_like(y), method=cfg.solver, tol=cfg.tol,
                    max_iters=cfg.max_iters, throw=cfg.throw)
        if back is not None:
            sol = dataclasses.replace(sol, value=sol.value.index_select(-1, back))
        record(sol)
        return sol.value

    if order is None or torch.equal(order, torch.arange(len(order), device=order.device)):
        return run(h)
    perm = torch.argsort(order, stable=True)  # position k of the solve is feature perm[k]
    inv = torch.argsort(perm)

    def permuted(xp):
        return h(xp.index_select(-1, inv)).index_select(-1, perm)

    return run(permuted, inv)


SECOND_ORDER = (
    "paraprop.flows computes the gradients of an inverse by implicit differentiation, first "
    "order only: differentiating them again (double backward, create_graph=True followed by "
    "another backward or grad, gradient penalties, hessians) is not supported; for that, run "
    "the library's own inverse: call undo() on the paraprop.flows.accelerate handle (or use "
    "the flow outside its `with` block), or call the library instead of parallel_inverse")


def _implicit(h, x_star: torch.Tensor) -> torch.Tensor:
    """``h(x_star)`` (bitwise ``x_star`` at a fixed point) carrying the gradient of the fixed
    point: the gradient arriving at it is replaced by ``(I - N)^{-T} v``, ``N = ∂h/∂x``."""
    out = h(x_star)
    if not out.requires_grad:   # nothing upstream needs a gradient
        return out
    bound = x_star.shape[-1] + 1

    def adjoint(v: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x0 = x_star.detach().requires_grad_(True)
            hx = h(x0)
            u = v
            for _ in range(bound):   # u_k exact in its last k positions: at most D + 1 steps
                (nu,) = torch.autograd.grad(hx, x0, u, retain_graph=True)
                nu = v + nu
                if torch.equal(nu, u):
                    break
                u = nu
        if torch.is_grad_enabled():   # a graph is wanted (create_graph=True): u has none
            # u depends on v and, through N, on everything `out` depends on (parameters,
            # points, context): the refusing node hangs from both, so that a second
            # differentiation with respect to any of them reaches it (anchored on v alone, a
            # gradient penalty with a constant incoming gradient went silently wrong)
            (u,) = refuse_second_order(SECOND_ORDER, u, anchors=(v, out))
        return u

    out.register_hook(adjoint)
    return out


def combine(parts: list[Solution], method: str, value: torch.Tensor, time_s: float) -> Solution:
    """One Solution for solves run one after another (e.g. the transforms of a flow)."""
    return Solution(
        value=value, method=method,
        iterations=sum(p.iterations for p in parts),
        evaluations=sum(p.evaluations for p in parts),
        converged=all(p.converged for p in parts),
        residuals=torch.cat([p.residuals for p in parts]) if parts
        else torch.empty(0, dtype=torch.float64),
        stats={"parts": parts, "positions": sum(p.stats.get("positions", 0) for p in parts),
               "error_estimate": sum(p.stats.get("error_estimate", 0.0) for p in parts),
               "time_s": time_s,
               # why a part could not certify, where that is not max_iters (its solve's words)
               **next(({"not_converged": f"part {k}: {p.stats['not_converged']}"}
                       for k, p in enumerate(parts)
                       if not p.converged and p.stats.get("not_converged")), {})})


# -- argument checks ---------------------------------------------------------------------------
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


ACCELERATE_HINT = ("; or call undo() on the paraprop.flows.accelerate handle to run the "
                   "library's own loop")


def check_accelerated(part: nn.Module) -> None:
    """At an accelerated call: the part's network must be deterministic now (the flow's mode
    may have changed since :func:`paraprop.flows.accelerate`)."""
    require_deterministic_parts([(patch_of(part).where, part)],
                                entry="paraprop.flows.accelerate", argument="flow",
                                hint=ACCELERATE_HINT)


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


# -- the masked-MADE transforms of nflows and normflows -----------------------------------------
def made_step(part, y, context):
    """One pass of the nflows / normflows inverse loop: ``x -> f_x^{-1}(y)``."""
    return lambda x: part._elementwise_inverse(y, part.autoregressive_net(x, context))[0]


def made_inverse(part, y, context, order, cfg, record):
    """``part.inverse(y, context)`` of an nflows ``AutoregressiveTransform`` or a normflows
    ``Autoregressive``: ``(outputs, logabsdet)`` of the last pass, at the fixed point."""
    if y.numel() == 0:   # nothing to solve: one pass gives the (empty) result
        x = torch.zeros_like(y)
    else:
        x = invert_part(made_step(part, y, context), y, order, cfg, record)
    return part._elementwise_inverse(y, part.autoregressive_net(x, context))


# -- patches on instances (accelerate) ----------------------------------------------------------
PATCH = "_paraprop_accelerate"   # the instance attribute that holds a part's Patch


@dataclasses.dataclass
class Counters:
    """What the accelerated inverses did since the flow was accelerated."""

    inversions: int = 0        # autoregressive inverses solved
    passes: int = 0            # passes (evaluations of the transform's network) they took
    library_passes: int = 0    # passes the library's own loops would have taken


@dataclasses.dataclass
class Patch:
    """One patched method of one part: the settings, and what to restore.

    Pickling (``pickle``, ``torch.save``) does not carry a patch: the part comes back with the
    library's own method (see :class:`Bound`), and this record as ``None``. ``copy.deepcopy``
    carries it (the copy is accelerated too, bound to its own modules).
    """

    cfg: Settings
    counters: Counters
    attribute: str                  # the patched method's name
    saved: Callable | None = None   # the instance attribute it replaced (None: the class's)
    where: str = ""                 # the part's name in the accelerated flow (for messages)

    def __reduce__(self):
        return (_no_patch, ())

    def __deepcopy__(self, memo) -> Patch:
        return Patch(copy.deepcopy(self.cfg, memo), copy.deepcopy(self.counters, memo),
                     self.attribute, copy.deepcopy(self.saved, memo), self.where)

    def original(self, part) -> Callable:
        """The method as it was before the patch, bound to ``part``."""
        if self.saved is not None:
            return self.saved
        return getattr(type(part), self.attribute).__get__(part)

    def recorder(self, library_passes: int) -> Callable[[Solution], None]:
        def record(sol: Solution) -> None:
            self.counters.inversions += 1
            self.counters.passes += sol.evaluations
            self.counters.library_passes += library_passes
        return record


def _no_patch() -> None:
    """What a pickled :class:`Patch` loads as: no patch."""
    return None


def _same(obj):
    return obj


class Bound:
    """``method`` bound to ``part``, installed as the part's instance attribute in place of the
    library's method (like ``types.MethodType``, with ``__func__`` and ``__self__``).

    Pickled (``pickle``, ``torch.save``) it becomes the method it replaced, so a saved flow
    loads as the library's plain flow: acceleration is a patch of live instances, not state.
    ``copy.deepcopy`` binds the method to the copy.
    """

    __slots__ = ("__func__", "__self__", "attribute")

    def __init__(self, method: Callable, part: nn.Module, attribute: str):
        self.__func__, self.__self__, self.attribute = method, part, attribute

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        patch = self.__self__.__dict__.get(PATCH)
        saved = patch.saved if isinstance(patch, Patch) else None
        if saved is None:   # the class's method, looked up when the part loads
            return (getattr, (self.__self__, self.attribute))
        return (_same, (saved,))

    def __deepcopy__(self, memo) -> Bound:
        return Bound(self.__func__, copy.deepcopy(self.__self__, memo), self.attribute)

    def __repr__(self) -> str:
        return (f"<paraprop.flows accelerated {type(self.__self__).__name__}.{self.attribute} "
                f"of {object.__repr__(self.__self__)}>")


def patch_of(part) -> Patch:
    return part.__dict__[PATCH]


def is_patched(part) -> bool:
    """Whether ``part`` carries an active patch (a loaded pickle carries ``None``)."""
    return isinstance(getattr(part, "__dict__", {}).get(PATCH), Patch)


def install(part: nn.Module, attribute: str, method: Callable, patch: Patch) -> None:
    """Bind ``method`` to ``part`` as its ``attribute`` (the instance only)."""
    patch.saved = part.__dict__.get(attribute)
    part.__dict__[PATCH] = patch
    part.__dict__[attribute] = Bound(method, part, attribute)


def remove(part: nn.Module) -> None:
    """Undo :func:`install` (nothing if ``part`` is not patched)."""
    patch = part.__dict__.pop(PATCH, None)
    if not isinstance(patch, Patch):
        return
    if patch.saved is None:
        part.__dict__.pop(patch.attribute, None)
    else:
        part.__dict__[patch.attribute] = patch.saved
