"""``ParallelResidualStack``: a residual network whose forward and backward passes are MGRIT solves.

Kirby et al. (2020, "Layer-Parallel Training with GPU Concurrency of Deep Residual Neural Networks
via Nonlinear Multigrid"): the stack ``u_{n+1} = u_n + h F_n(u_n; theta_n)`` is an initial value
problem in depth. The forward pass solves it with FAS/MGRIT (Algorithm 1); the backward pass
solves the adjoint problem ``lam_n = lam_{n+1} + h J_n(u_n)^T lam_{n+1}``, ``lam_N = dL/du_N``
with the same MGRIT (or exactly, serially). Both solves stop on :func:`paraprop.multigrid.mgrit`'s
estimate of their error against the serial result (``tol``), or at the exactness bound. The
parameter gradients ``dL/dtheta_n = h (dF_n/dtheta_n)^T lam_{n+1}`` are accumulated during the
adjoint solve's final relaxation (each step there takes one VJP with respect to state and
parameters) when that relaxation is known to be the last: for a fixed number of cycles
(``tol=None``), or for the serial backward. With a ``tol`` the solve may stop after any cycle, so
they follow in a separate batched sweep over all layers at the converged adjoint.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
from torch import nn

from paraprop import checks
from paraprop.multigrid.common import (
    BACKWARD,
    DEFAULT_TOL,
    as_coarsening,
    check_block_modes,
    check_blocks,
    check_input,
    check_settings,
    refuse_random_blocks,
    resolve_batched,
    run_batched,
    solve_through,
    warn_unchecked,
)
from paraprop.multigrid.hierarchy import Hierarchy
from paraprop.multigrid.mgrit import run_mgrit
from paraprop.multigrid.params import BlockParams
from paraprop.multigrid.steps import AdjointStepper, ForwardStepper
from paraprop.result import Solution

__all__ = ["BACKWARD", "ParallelResidualStack"]


def kept(sol: Solution, t0: float, evaluations: int | None = None, **stats) -> Solution:
    """``sol`` as a stack keeps it (``last_forward`` / ``last_backward``): its last point as
    ``value`` (so that the states are not kept alive), its ``stats`` without
    ``parameter_grads``, with ``time_s`` since ``t0`` and ``stats``; ``evaluations`` replaced
    where given (a backward counts its parameter-gradient sweep)."""
    kept_stats = {k: v for k, v in sol.stats.items() if k != "parameter_grads"}
    kept_stats.update(time_s=time.perf_counter() - t0, **stats)
    return dataclasses.replace(sol, value=sol.value[-1].clone(), stats=kept_stats,
                               evaluations=sol.evaluations if evaluations is None
                               else evaluations)


class ParallelResidualStack(nn.Module):
    """``u_N`` of ``u_{n+1} = u_n + h F_n(u_n)``, ``u_0 = x``, computed by FAS/MGRIT.

    By default every forward and adjoint solve is within ``tol`` of the serial network's states
    (the estimate of :func:`paraprop.multigrid.mgrit`) or runs to the exactness bound; one that
    ``max_iters`` stops short raises :class:`paraprop.ConvergenceError`. The fixed small number
    of cycles of layer-parallel training (Kirby et al.; TorchBraid), inexact by design, is
    ``max_iters=2, tol=None``: not checked, and a warning at construction says so.

    Arguments:
        blocks: the residual branches ``F_0 .. F_{N-1}`` (modules mapping a state to a tensor of
            the same shape; deterministic: no dropout, no buffer updates, so BatchNorm only in
            eval mode, refused at forward otherwise). The same module may occur at several
            depths (shared weights); its gradient sums over its uses.
        step_size: ``h > 0``.
        coarsening: ``c``, the coarsening factor (``>= 2``), or one per coarsening.
        levels: grid levels; ``1`` is exact serial propagation.
        relax: ``"F"`` or ``"FCF"`` relaxation.
        max_iters: the most V-cycles per solve (forward and adjoint); ``None``: the exactness
            bound ``N // c``, enough for the serial result in exact arithmetic.
        tol: stop a solve once its estimated ``max |states - serial states|`` is ``<= tol``
            (``0``: only a bitwise fixed point or the bound); ``None``: always ``max_iters``
            cycles, not checked (``converged=False``, ``stats["checked"] = False``).
        throw: raise :class:`paraprop.ConvergenceError` when a solve with a ``tol`` ends at
            ``max_iters`` unconverged (``False``: go on with the unconverged states; see
            ``last_forward`` / ``last_backward``).
        backward: ``"adjoint"`` (MGRIT on the adjoint system) or ``"serial"`` (exact serial
            back-propagation through the forward states MGRIT produced).
        warm_start: start each solve from the previous solve's C-point values when the input
            has the same shape (the previous batch's solution).
        c_weight: weight of the C-relaxation (``1``: plain FCF).
        batched: relax all intervals in one ``vmap`` over stacked parameters (``None``: when the
            blocks share an architecture, and not for solves with ``tol=0`` nor in bf16 / fp16,
            where the batched kernels' rounding would break the result's promise: those run
            block by block, bitwise the serial loop's steps; ``True`` requires it, and is
            refused there).

    Attributes:
        last_forward, last_backward: the :class:`paraprop.Solution` of the latest forward
            and backward solve (``None`` before the first; as :func:`~paraprop.multigrid.mgrit`
            returns it, with ``value`` the solve's last point only, ``u_N`` forward and
            ``dL/dx`` backward, so that the states are not kept alive; ``stats["time_s"]``
            and, backward, ``evaluations`` include the parameter-gradient sweep; ``stats`` has
            no ``parameter_grads``; ``stats["batched"]``: whether the solve evaluated the
            blocks batched).

    Raises:
        ValueError / TypeError: bad arguments (named, with the value), too few layers for the
            levels; in forward: a setting assigned since construction that the constructor
            would refuse, an input whose dtype or device differs from the blocks', a block that
            changes the shape of the state, ``batched=True`` with ``tol=0`` or a bf16 / fp16
            input.
        paraprop.StochasticModelError: (a ``ValueError``, in forward) a block in training mode
            with BatchNorm (running statistics), dropout or another stochastic layer
            (:mod:`paraprop.determinism`), naming the block; call ``stack.eval()``.
        paraprop.ConvergenceError: (forward or backward) ``tol`` not reached in ``max_iters``
            cycles with ``throw=True``.

    Example:
        >>> blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(64)]
        >>> net = ParallelResidualStack(blocks, 1 / 64, coarsening=4, levels=2)
        >>> y = net(torch.randn(5, 8))
        >>> y.shape, net.last_forward.converged
        (torch.Size([5, 8]), True)
    """

    # kept in the instance's __dict__ by _sync (rebuilt when the blocks or the levels change)
    _hierarchy: Hierarchy
    _params: BlockParams

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        step_size: float,
        *,
        coarsening: int | Sequence[int] = 4,
        levels: int = 2,
        relax: str = "FCF",
        max_iters: int | None = None,
        tol: float | None = DEFAULT_TOL,
        throw: bool = True,
        backward: str = "adjoint",
        warm_start: bool = False,
        c_weight: float = 1.0,
        batched: bool | None = None,
    ):
        super().__init__()
        blocks = check_blocks(blocks)
        check_settings(step_size=step_size, relax=relax, max_iters=max_iters, tol=tol,
                       c_weight=c_weight, backward=backward)
        hierarchy = Hierarchy.build(len(blocks), levels=levels,
                                    coarsening=as_coarsening(coarsening))
        resolve_batched(blocks, batched)
        self.blocks = nn.ModuleList(blocks)
        self.step_size = float(step_size)
        self.relax = relax
        self.max_iters = max_iters
        self.tol = tol
        self.throw = bool(throw)
        self.backward_mode = backward
        self.warm_start = bool(warm_start)
        self.c_weight = float(c_weight)
        self.coarsening = as_coarsening(coarsening)
        self.levels = levels
        self.batched = batched
        self.last_forward: Solution | None = None
        self.last_backward: Solution | None = None
        self._warm: dict[str, torch.Tensor] = {}
        self._sync()
        bound = hierarchy.exact_cycles()
        if tol is None and levels > 1 and max_iters is not None and max_iters < bound:
            warn_unchecked("ParallelResidualStack", max_iters, bound)

    # -- what follows from the blocks, levels and coarsening, rebuilt when they change --------
    def _sync(self) -> None:
        """The hierarchy, the parameter lists and the batched choice, for the blocks, levels and
        coarsening as they are now: all three may be changed after construction
        (``net.blocks.append(b)``, ``net.blocks[3] = b``, ``net.levels = 2``,
        ``net.coarsening = 8``); checked with the constructor's messages. A few reads per call
        (the blocks' identities)."""
        d = self.__dict__
        if "_levels" not in d:   # a stack pickled before levels could be assigned
            old = d.pop("hierarchy", None)
            d["_levels"] = old.levels if old is not None else 1
            d.setdefault("coarsening", old.coarsening if old is not None else 2)
        key = (tuple(map(id, self.blocks)), d["_levels"], as_coarsening(self.coarsening))
        last = d.get("_key")
        if key == last:
            return
        check_blocks(self.blocks)
        hierarchy = Hierarchy.build(len(self.blocks), levels=key[1], coarsening=key[2])
        if last is None or key[0] != last[0]:   # other blocks: their lists and batching anew
            batched = resolve_batched(list(self.blocks), d.get("_batched_arg"))
            d["_batched"] = batched
            d["_params"] = BlockParams(self.blocks)
        d["_hierarchy"], d["_key"], d["_warm"] = hierarchy, key, {}

    @property
    def hierarchy(self) -> Hierarchy:
        """The MGRIT grid hierarchy (from ``len(blocks)``, ``levels`` and ``coarsening``)."""
        self._sync()
        return self._hierarchy

    @property
    def levels(self) -> int:
        """Grid levels (``1``: serial propagation); may be assigned (checked with
        ``coarsening`` and the depth at the next forward)."""
        return self.__dict__["_levels"] if "_levels" in self.__dict__ else self.hierarchy.levels

    @levels.setter
    def levels(self, value) -> None:
        checks.positive_int("levels", value)
        object.__setattr__(self, "_levels", value)

    def __setattr__(self, name: str, value) -> None:
        if name == "hierarchy":
            raise AttributeError(
                "ParallelResidualStack.hierarchy follows from the blocks, levels and "
                "coarsening: assign those instead (net.levels = 2, net.coarsening = 8, "
                "net.blocks.append(block)); each forward rebuilds the hierarchy from them")
        super().__setattr__(name, value)

    @property
    def batched(self) -> bool:
        """Whether the blocks are evaluated batched (``vmap`` over stacked parameters) where a
        solve allows it (not with ``tol=0`` nor in bf16 / fp16, see
        :func:`paraprop.multigrid.common.run_batched`). Assigning ``None``, ``True`` or
        ``False`` is checked as the constructor's ``batched``."""
        # (a stack pickled before the property existed keeps its plain attribute)
        return self.__dict__.get("_batched", self.__dict__.get("batched", False))

    @batched.setter
    def batched(self, value) -> None:
        checks.boolean("batched", value, allow_none=True)
        object.__setattr__(self, "_batched", resolve_batched(list(self.blocks), value))
        object.__setattr__(self, "_batched_arg", value)

    def extra_repr(self) -> str:
        h = self.hierarchy
        return (f"depth={h.n_steps}, step_size={self.step_size:g}, levels={h.levels}, "
                f"coarsening={h.coarsening}, relax={self.relax!r}, max_iters={self.max_iters}, "
                f"tol={self.tol}, backward={self.backward_mode!r}, batched={self.batched}")

    # -- parameter bookkeeping ----------------------------------------------------------------
    def _apply(self, fn, *args, **kwargs):
        self._params.reset()
        self._warm = {}
        return super()._apply(fn, *args, **kwargs)

    def _stack(self, batched: bool):
        return self._params.stack() if batched else None

    # -- solves -------------------------------------------------------------------------------
    def _mgrit(self, stepper, x, hierarchy, key: str, **kw) -> Solution:
        with refuse_random_blocks(f"ParallelResidualStack ({key})", x.device):
            return run_mgrit(stepper, x, hierarchy, self.step_size, relax=self.relax,
                             max_iters=self.max_iters, tol=self.tol, throw=self.throw,
                             c_weight=self.c_weight, entry=f"ParallelResidualStack ({key})",
                             **kw)

    def _init_for(self, key: str, like: torch.Tensor) -> torch.Tensor | None:
        prev = self._warm.get(key)
        if self.warm_start and prev is not None and prev.shape[1:] == like.shape \
                and prev.dtype == like.dtype and prev.device == like.device:
            return prev
        return None

    def _keep(self, key: str, states: torch.Tensor, hierarchy: Hierarchy) -> None:
        if self.warm_start and hierarchy.levels > 1:
            c = hierarchy.coarsening[0]
            self._warm[key] = states[c::c].detach().clone()

    def _solve_forward(self, x: torch.Tensor):
        t0 = time.perf_counter()
        batched = run_batched("ParallelResidualStack", self.batched,
                              self.__dict__.get("_batched_arg"), x.dtype, self.tol)
        stacked = self._stack(batched)
        stepper = ForwardStepper(self.blocks, batched=batched, stacked=stacked)
        versions = None if batched else self._params.buffer_versions()
        sol = self._mgrit(stepper, x.detach(), self.hierarchy, "forward",
                          init=self._init_for("forward", x))
        self._check_buffers(stacked, versions)
        self._keep("forward", sol.value, self.hierarchy)
        self.last_forward = kept(sol, t0, batched=batched)
        return sol.value, stacked

    def _check_buffers(self, stacked, versions) -> None:
        """A tripwire for blocks that update buffers in place in forward (beyond the types
        :func:`check_block_modes` knows): their version counters moved."""
        if stacked is not None:
            moved = [k for k, v in stacked[1].items() if v._version != 0]
        else:
            now = self._params.buffer_versions()
            moved = ["a block buffer"] if now != versions else []
        if moved:
            raise ValueError(f"a block updated its buffers ({', '.join(moved)}) during the "
                             "MGRIT forward solve; MGRIT evaluates every block several times "
                             "per solve, so buffer updates are not those of the serial network. "
                             "Put the stack in eval mode, or use a plain nn.Sequential")

    def _solve_backward(self, states, stacked, grad_out, params):
        t0 = time.perf_counter()
        n = len(self.blocks)
        batched = stacked is not None      # as the forward solve of these states
        stepper = AdjointStepper(self.blocks, 0, n, states, batched=batched, stacked=stacked)
        g = grad_out.detach().to(states.dtype).contiguous()
        if self.backward_mode == "serial":
            hier = Hierarchy.build(n, levels=1, coarsening=2)
            sol = self._mgrit(stepper, g, hier, "backward", collect=True)
        else:
            hier = self.hierarchy
            sol = self._mgrit(stepper, g, hier, "backward", init=self._init_for("backward", g),
                              collect=True)
            self._keep("backward", sol.value, hier)
        lam = sol.value  # lam[k] is the adjoint at depth N - k
        per_block = sol.stats["parameter_grads"]
        if per_block is None:
            per_block = stepper.parameter_grads(lam[:-1].flip(0), self.step_size)
        grads = self._params.order(per_block, params)
        self.last_backward = kept(sol, t0, stepper.counts.evaluations, batched=batched)
        return lam[-1], grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``u_N`` for the input ``u_0 = x`` (any shape the blocks accept)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must have a floating-point dtype, got {x.dtype}")
        # the settings again (attributes may be assigned after construction), a few reads
        self._sync()
        check_settings(step_size=self.step_size, relax=self.relax, max_iters=self.max_iters,
                       tol=self.tol, c_weight=self.c_weight, backward=self.backward_mode,
                       throw=self.throw)
        checks.boolean("warm_start", self.warm_start)
        check_input(x, self._params.floating())
        check_block_modes(self._params.stateful())
        run_batched("ParallelResidualStack", self.batched, self.__dict__.get("_batched_arg"),
                    x.dtype, self.tol)   # refuses batched=True where it cannot be exact
        params = self._params.trainable() if torch.is_grad_enabled() else []
        return solve_through(self, x, params)

    @torch.no_grad()
    def serial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: ``u_N`` by plain serial propagation (no autograd)."""
        u = x
        for b in self.blocks:
            u = u + self.step_size * b(u)
        return u
