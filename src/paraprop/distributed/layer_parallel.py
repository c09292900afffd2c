"""Layer-parallel MGRIT across processes, and the model-partitioned baseline.

Each rank owns a contiguous range ``[a, b)`` of the ``N`` residual layers (uneven splits allowed;
a rank may own no coarse point on some levels) and runs :func:`paraprop.multigrid.mgrit` on its
range. Ranks exchange only the values at the ends of their ranges (C-point and F-point ghosts,
coarse-level ghosts and the serial coarse chain) by point-to-point send/recv, plus one
all-reduce of the residual norm per cycle; every rank runs the single-process algorithm's
control flow, so the result equals the single-process run up to rounding (Kirby et al. 2020,
§3; Günther et al. 2020 for layer-parallel training with XBraid).

The backward pass is the adjoint MGRIT solve over the same ranks in reverse order; each rank
gets the parameter gradients of its own layers (accumulated in the final relaxation with
``tol=None``, else by a separate sweep); nothing but boundary values crosses ranks.

Model partitioning (the paper's baseline) also gives each rank its layers, but propagates the
activation through them serially: rank ``r`` waits for rank ``r - 1``.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from paraprop.distributed.comm import DEFAULT_TIMEOUT_S, DistLink, PeerError, check_timeout
from paraprop.multigrid.common import (
    as_coarsening,
    check_blocks,
    check_settings,
    resolve_batched,
    solve_through,
)
from paraprop.multigrid.hierarchy import Hierarchy, split_layers
from paraprop.multigrid.mgrit import mgrit
from paraprop.multigrid.params import BlockParams
from paraprop.multigrid.steps import AdjointStepper, ForwardStepper

__all__ = ["LayerParallelStack", "layer_range", "partitioned_forward"]


def layer_range(depth: int, sizes: Sequence[int] | None = None, *, rank: int | None = None,
                world: int | None = None) -> tuple[int, int]:
    """This rank's layers ``[a, b)`` of a ``depth``-layer stack (even split unless ``sizes``).

    Example:
        >>> layer_range(10, [3, 7], rank=1, world=2)
        (3, 10)
    """
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size() if world is None else world
    return split_layers(depth, world, list(sizes) if sizes is not None else None)[rank]


class LayerParallelStack(nn.Module):
    """This rank's part of a residual stack solved by layer-parallel MGRIT.

    Every rank of the process group constructs it with its own blocks (``layer_range`` tells
    which) and calls ``forward`` together (it is collective). The output ``u_N`` is meaningful
    on the last rank; the others return a same-shaped tensor to keep autograd going. Backward is
    collective too: call ``backward`` on every rank (the last from its loss, the others e.g.
    with ``out.backward(torch.zeros_like(out))``); each rank then holds the gradients of its own
    blocks, and rank 0 the gradient of ``x``.

    Arguments:
        blocks: this rank's residual branches ``F_a .. F_{b-1}`` (a module used at several of
            this rank's depths gets the sum over its uses; weights shared across ranks are
            separate copies, whose gradients the caller must add up, e.g. by an all-reduce).
        step_size: ``h > 0``.
        depth: ``N``, the number of layers over all ranks.
        sizes: layers per rank (``None``: even split); the same on every rank.
        coarsening, levels, relax, max_cycles, tol, c_weight, batched: as for
            :class:`paraprop.multigrid.ParallelResidualStack` (``max_cycles=None``: ``N // c``).
        backward: ``"adjoint"`` (MGRIT on the adjoint across ranks) or ``"serial"`` (the
            adjoint propagated serially through the ranks).
        timeout: seconds any rank waits for a message before raising
            :class:`paraprop.distributed.PeerError` (guaranteed and tested with gloo; with
            nccl the wait is left to NCCL, see :class:`paraprop.distributed.DistLink`).
        group: the process group (``None``: the default group).

    Attributes:
        last_stats: ``{"forward": ..., "backward": ...}``: residual history, cycles,
            ``messages`` and ``bytes`` sent by this rank, ``wait_s`` (time blocked waiting for
            peers), ``time_s``.

    Raises:
        ValueError / TypeError: bad arguments (checked before the process group), or a block
            count that does not match this rank's share of ``depth``.
        RuntimeError: ``torch.distributed`` is not initialised.
        PeerError: (in forward/backward) a peer rank died or hangs.

    Example (under ``torchrun --nproc_per_node=2``)::

        init_from_env()
        a, b = layer_range(64)
        stack = LayerParallelStack([make_block() for _ in range(a, b)], 1 / 64, depth=64)
        y = stack(x)      # u_64 on rank 1
    """

    def __init__(self, blocks: Sequence[nn.Module], step_size: float, *, depth: int,
                 sizes: Sequence[int] | None = None, coarsening: int | Sequence[int] = 4,
                 levels: int = 2, relax: str = "FCF", max_cycles: int | None = 2,
                 tol: float | None = None, c_weight: float = 1.0, backward: str = "adjoint",
                 timeout: float = DEFAULT_TIMEOUT_S, group=None, batched: bool | None = None):
        super().__init__()
        blocks = check_blocks(blocks)
        check_settings(step_size=step_size, relax=relax, max_cycles=max_cycles, tol=tol,
                       c_weight=c_weight, backward=backward)
        check_timeout(timeout)
        batched = resolve_batched(blocks, batched)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call "
                               "paraprop.distributed.init_from_env() first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.ranks = list(range(self.world)) if group is None else \
            [dist.get_global_rank(group, r) for r in range(self.world)]
        self.parts = split_layers(depth, self.world, list(sizes) if sizes is not None else None)
        a, b = self.parts[self.rank]
        if len(blocks) != b - a:
            raise ValueError(f"rank {self.rank} owns layers [{a}, {b}) of depth={depth}, so it "
                             f"needs {b - a} blocks, got {len(blocks)}")
        self.hierarchy = Hierarchy.build(depth, levels=levels,
                                         coarsening=as_coarsening(coarsening))
        self.batched = batched
        self.blocks = nn.ModuleList(blocks)
        self.depth, self.step_size = depth, float(step_size)
        self.relax, self.max_cycles, self.tol = relax, max_cycles, tol
        self.c_weight, self.backward_mode = float(c_weight), backward
        self.timeout = float(timeout)
        self.last_stats: dict = {}
        self._params = BlockParams(self.blocks)

    @property
    def layers(self) -> tuple[int, int]:
        return self.parts[self.rank]

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    def _cycles(self) -> int:
        return self.max_cycles if self.max_cycles is not None else self.hierarchy.exact_cycles()

    def _apply(self, fn, *args, **kwargs):
        self._params.reset()
        return super()._apply(fn, *args, **kwargs)

    def _stacked(self):
        return self._params.stack() if self.batched else None

    def _record(self, key, res, link, t0):
        self.last_stats[key] = {"residuals": res.residuals, "cycles": res.cycles,
                                "converged": res.converged,
                                "convergence_factor": res.convergence_factor,
                                "messages": link.messages, "bytes": link.bytes,
                                "wait_s": link.wait_s,
                                "time_s": time.perf_counter() - t0}

    def _broadcast(self, t: torch.Tensor, src: int, what: str) -> torch.Tensor:
        """``t`` from rank ``src`` on every rank (the initial condition, which every rank also
        uses as its initial guess at the C-points, as a single process does)."""
        t = t.detach().clone().contiguous()
        try:
            dist.broadcast(t, src, group=self.group, async_op=True).wait(
                _dt.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise PeerError(f"rank {self.rank} ({what}): broadcast from rank {src} failed after "
                            f"at most {self.timeout:g} s: a peer died or hangs "
                            f"({str(e).splitlines()[0][:200]})") from None
        return t

    def _solve_forward(self, x: torch.Tensor):
        t0 = time.perf_counter()
        x = self._broadcast(x, self.ranks[0], "forward")
        stacked = self._stacked()
        a, _ = self.layers
        stepper = ForwardStepper(self.blocks, a, batched=self.batched, stacked=stacked)
        link = DistLink(self.ranks, timeout=self.timeout, group=self.group, what="forward")
        res = mgrit(stepper, x, self.hierarchy, self.step_size, relax=self.relax,
                    max_cycles=self._cycles(), tol=self.tol, c_weight=self.c_weight, link=link,
                    parts=self.parts, me=self.rank)
        self._record("forward", res, link, t0)
        return res.states, stacked

    def _solve_backward(self, states, stacked, grad_out, params):
        t0 = time.perf_counter()
        a, b = self.layers
        n = self.depth
        stepper = AdjointStepper(self.blocks, a, n, states, batched=self.batched,
                                 stacked=stacked)
        rparts = [(n - hi, n - lo) for lo, hi in reversed(self.parts)]
        rranks = list(reversed(self.ranks))
        me = self.world - 1 - self.rank
        link = DistLink(rranks, timeout=self.timeout, group=self.group, what="backward")
        hier = self.hierarchy if self.backward_mode == "adjoint" else \
            Hierarchy.build(n, levels=1, coarsening=2)
        g = self._broadcast(grad_out.to(states.dtype), self.ranks[-1], "backward")
        res = mgrit(stepper, g, hier, self.step_size, relax=self.relax,
                    max_cycles=self._cycles(), tol=self.tol, c_weight=self.c_weight, link=link,
                    parts=rparts, me=me, collect=True)
        lam = res.states
        per_block = res.parameter_grads if res.parameter_grads is not None else \
            stepper.parameter_grads(lam[:-1].flip(0), self.step_size)
        grads = self._params.order(per_block, params)
        self._record("backward", res, link, t0)
        gx = lam[-1] if self.rank == 0 else torch.zeros_like(lam[-1])
        return gx, grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Collective: ``u_N`` on the last rank (same shape elsewhere, see the class notes).

        ``x`` must have the same shape and dtype on every rank; rank 0's value is used.
        """
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}")
        params = self._params.trainable() if torch.is_grad_enabled() else []
        return solve_through(self, x, params)


def partitioned_forward(blocks: Sequence[nn.Module], x: torch.Tensor, step_size: float, *,
                        timeout: float = DEFAULT_TIMEOUT_S, group=None) -> torch.Tensor:
    """Model partitioning: receive the activation, apply this rank's blocks, pass it on.

    Arguments:
        blocks: this rank's blocks (rank ``r`` holds the ``r``-th contiguous range).
        x: the input (used on rank 0; other ranks pass a tensor of the same shape and dtype).
        step_size: ``h``.
        timeout, group: as for :class:`LayerParallelStack`.

    Returns:
        ``u_N`` on the last rank; on the others, this rank's output activation.

    Raises:
        PeerError: the previous or next rank died or hangs.

    Example (under ``torchrun --nproc_per_node=2``)::

        a, b = layer_range(64)
        y = partitioned_forward(blocks[a:b], x, 1 / 64)   # u_64 on rank 1
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    ranks = list(range(world)) if group is None else \
        [dist.get_global_rank(group, r) for r in range(world)]
    link = DistLink(ranks, timeout=timeout, group=group, what="partitioned forward")
    with torch.no_grad():
        u = x if me == 0 else link.recv(x, me - 1, 0)
        for blk in blocks:
            u = u + step_size * blk(u)
        if me < world - 1:
            link.send(u, me + 1, 0)
        link.flush()
    return u
