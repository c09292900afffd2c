"""``ParallelResidualStack``: a residual network whose forward and backward passes are MGRIT solves.

Kirby et al. (2020, "Layer-Parallel Training with GPU Concurrency of Deep Residual Neural Networks
via Nonlinear Multigrid"): the stack ``u_{n+1} = u_n + h F_n(u_n; theta_n)`` is an initial value
problem in depth. The forward pass solves it with FAS/MGRIT (Algorithm 1); the backward pass
solves the adjoint problem ``lam_n = lam_{n+1} + h J_n(u_n)^T lam_{n+1}``, ``lam_N = dL/du_N``
with the same MGRIT (or exactly, serially). The parameter gradients
``dL/dtheta_n = h (dF_n/dtheta_n)^T lam_{n+1}`` are accumulated during the adjoint solve's final
relaxation (each step there takes one VJP with respect to state and parameters) when that
relaxation is known to be the last: with ``tol=None``, or for the serial backward. With a
``tol`` the solve may stop after any cycle, so they follow in a separate batched sweep over all
layers at the converged adjoint.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from paraprop.multigrid.common import (
    BACKWARD,
    as_coarsening,
    check_blocks,
    check_settings,
    resolve_batched,
    solve_through,
)
from paraprop.multigrid.hierarchy import Hierarchy
from paraprop.multigrid.mgrit import MGRITResult, mgrit
from paraprop.multigrid.params import BlockParams
from paraprop.multigrid.steps import AdjointStepper, ForwardStepper

__all__ = ["BACKWARD", "ParallelResidualStack"]


class ParallelResidualStack(nn.Module):
    """``u_N`` of ``u_{n+1} = u_n + h F_n(u_n)``, ``u_0 = x``, computed by FAS/MGRIT.

    Arguments:
        blocks: the residual branches ``F_0 .. F_{N-1}`` (modules mapping a state to a tensor of
            the same shape; deterministic: no dropout, no buffer updates). The same module may
            occur at several depths (shared weights); its gradient sums over its uses.
        step_size: ``h > 0``.
        coarsening: ``c``, the coarsening factor (``>= 2``), or one per coarsening.
        levels: grid levels; ``1`` is exact serial propagation.
        relax: ``"F"`` or ``"FCF"`` relaxation.
        max_cycles: V-cycles per solve (forward and adjoint); ``None``: enough for the serial
            result in exact arithmetic (``N // c``).
        tol: stop a solve once its residual norm is ``<= tol`` (``0``: only an exact zero);
            ``None``: always ``max_cycles`` cycles.
        backward: ``"adjoint"`` (MGRIT on the adjoint system) or ``"serial"`` (exact serial
            back-propagation through the forward states MGRIT produced).
        warm_start: start each solve from the previous solve's C-point values when the input
            has the same shape (the previous batch's solution).
        c_weight: weight of the C-relaxation (``1``: plain FCF).
        batched: relax all intervals in one ``vmap`` over stacked parameters (``None``: when the
            blocks share an architecture; ``True`` requires that).

    Attributes:
        last_stats: ``{"forward": ..., "backward": ...}`` of the latest solves: ``residuals``
            (per cycle, starting with the initial guess), ``cycles``, ``converged`` (``None``
            when not checked: ``tol=None``),
            ``convergence_factor``, ``evaluations``, ``calls``, ``time_s``.

    Raises:
        ValueError / TypeError: bad arguments (named, with the value), too few layers for the
            levels, or (in forward) a block that changes the shape of the state.

    Example:
        >>> blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(64)]
        >>> net = ParallelResidualStack(blocks, 1 / 64, coarsening=4, levels=2, max_cycles=2)
        >>> y = net(torch.randn(5, 8))
        >>> y.shape, len(net.last_stats["forward"]["residuals"])
        (torch.Size([5, 8]), 3)
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        step_size: float,
        *,
        coarsening: int | Sequence[int] = 4,
        levels: int = 2,
        relax: str = "FCF",
        max_cycles: int | None = 2,
        tol: float | None = None,
        backward: str = "adjoint",
        warm_start: bool = False,
        c_weight: float = 1.0,
        batched: bool | None = None,
    ):
        super().__init__()
        blocks = check_blocks(blocks)
        check_settings(step_size=step_size, relax=relax, max_cycles=max_cycles, tol=tol,
                       c_weight=c_weight, backward=backward)
        self.hierarchy = Hierarchy.build(len(blocks), levels=levels,
                                         coarsening=as_coarsening(coarsening))
        batched = resolve_batched(blocks, batched)
        self.blocks = nn.ModuleList(blocks)
        self.step_size = float(step_size)
        self.relax = relax
        self.max_cycles = max_cycles
        self.tol = tol
        self.backward_mode = backward
        self.warm_start = bool(warm_start)
        self.c_weight = float(c_weight)
        self.batched = bool(batched)
        self.last_stats: dict = {}
        self._warm: dict[str, torch.Tensor] = {}
        self._params = BlockParams(self.blocks)

    @property
    def levels(self) -> int:
        return self.hierarchy.levels

    @property
    def cycles(self) -> int:
        return self.max_cycles if self.max_cycles is not None else self.hierarchy.exact_cycles()

    def extra_repr(self) -> str:
        h = self.hierarchy
        return (f"depth={h.n_steps}, step_size={self.step_size:g}, levels={h.levels}, "
                f"coarsening={h.coarsening}, relax={self.relax!r}, max_cycles={self.max_cycles}, "
                f"tol={self.tol}, backward={self.backward_mode!r}, batched={self.batched}")

    # -- parameter bookkeeping ----------------------------------------------------------------
    def _apply(self, fn, *args, **kwargs):
        self._params.reset()
        self._warm = {}
        return super()._apply(fn, *args, **kwargs)

    def _stack(self):
        return self._params.stack() if self.batched else None

    # -- solves -------------------------------------------------------------------------------
    def _record(self, key: str, res: MGRITResult, t0: float) -> None:
        self.last_stats[key] = {
            "residuals": res.residuals, "cycles": res.cycles, "converged": res.converged,
            "convergence_factor": res.convergence_factor,
            "evaluations": res.stats["evaluations"], "calls": res.stats["calls"],
            "time_s": time.perf_counter() - t0,
        }

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
        stacked = self._stack()
        stepper = ForwardStepper(self.blocks, batched=self.batched, stacked=stacked)
        res = mgrit(stepper, x.detach(), self.hierarchy, self.step_size, relax=self.relax,
                    max_cycles=self.cycles, tol=self.tol, c_weight=self.c_weight,
                    init=self._init_for("forward", x))
        self._keep("forward", res.states, self.hierarchy)
        self._record("forward", res, t0)
        return res.states, stacked

    def _solve_backward(self, states, stacked, grad_out, params):
        t0 = time.perf_counter()
        n = len(self.blocks)
        stepper = AdjointStepper(self.blocks, 0, n, states, batched=self.batched,
                                 stacked=stacked)
        g = grad_out.detach().to(states.dtype).contiguous()
        if self.backward_mode == "serial":
            hier = Hierarchy.build(n, levels=1, coarsening=2)
            res = mgrit(stepper, g, hier, self.step_size, collect=True)
        else:
            hier = self.hierarchy
            res = mgrit(stepper, g, hier, self.step_size, relax=self.relax,
                        max_cycles=self.cycles, tol=self.tol, c_weight=self.c_weight,
                        init=self._init_for("backward", g), collect=True)
            self._keep("backward", res.states, hier)
        lam = res.states  # lam[k] is the adjoint at depth N - k
        per_block = res.parameter_grads if res.parameter_grads is not None else \
            stepper.parameter_grads(lam[:-1].flip(0), self.step_size)
        grads = self._params.order(per_block, params)
        self._record("backward", res, t0)
        self.last_stats["backward"]["evaluations"] = stepper.counts.evaluations
        return lam[-1], grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``u_N`` for the input ``u_0 = x`` (any shape the blocks accept)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must have a floating-point dtype, got {x.dtype}")
        params = self._params.trainable() if torch.is_grad_enabled() else []
        return solve_through(self, x, params)

    @torch.no_grad()
    def serial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: ``u_N`` by plain serial propagation (no autograd)."""
        u = x
        for b in self.blocks:
            u = u + self.step_size * b(u)
        return u
