"""Layer-parallel MGRIT across processes, and the model-partitioned baseline.

Each rank owns a contiguous range ``[a, b)`` of the ``N`` residual layers (uneven splits allowed;
a rank may own no coarse point on some levels) and runs :func:`paraprop.multigrid.mgrit` on its
range. Ranks exchange only the values at the ends of their ranges (C-point and F-point ghosts,
coarse-level ghosts and the serial coarse chain) by point-to-point send/recv, plus one
all-reduce of the residual norm per cycle; every rank runs the single-process algorithm's
control flow, so the result equals the single-process run up to rounding (Kirby et al. 2020,
§3; Günther et al. 2020 for layer-parallel training with XBraid).

Every forward first compares the input's shape and dtype across the ranks (one small
all-gather): a mismatch raises :class:`~paraprop.distributed.PeerError` on every rank, naming
each rank's shape, instead of exchanging buffers of different sizes.

The backward pass is the adjoint MGRIT solve over the same ranks in reverse order; each rank
gets the parameter gradients of its own layers (accumulated in the final relaxation with
``tol=None``, else by a separate sweep); nothing but boundary values crosses ranks.

Model partitioning (the paper's baseline) also gives each rank its layers, but propagates the
activation through them serially: rank ``r`` waits for rank ``r - 1``.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from paraprop import checks
from paraprop.distributed.comm import DEFAULT_TIMEOUT_S, DistLink, PeerError, check_timeout
from paraprop.multigrid import common
from paraprop.multigrid.hierarchy import Hierarchy, split_layers
from paraprop.multigrid.mgrit import run_mgrit
from paraprop.multigrid.module import kept
from paraprop.multigrid.params import BlockParams
from paraprop.multigrid.steps import AdjointStepper, ForwardStepper
from paraprop.result import Solution

__all__ = ["LayerParallelStack", "layer_range", "partitioned_forward"]


def layer_range(depth: int, sizes: Sequence[int] | None = None, *, rank: int | None = None,
                world: int | None = None) -> tuple[int, int]:
    """This rank's layers ``[a, b)`` of a ``depth``-layer stack (even split unless ``sizes``).

    Arguments:
        depth: the number of layers.
        sizes: layers per rank (``None``: as even as possible).
        rank, world: this rank and the number of ranks (``None``: from the initialised
            process group).

    Raises:
        ValueError: ``rank`` outside ``0 .. world - 1``, or bad sizes.

    Example:
        >>> layer_range(10, [3, 7], rank=1, world=2)
        (3, 10)
    """
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size() if world is None else world
    parts = split_layers(depth, world, list(sizes) if sizes is not None else None)
    if not checks.is_int(rank) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in 0 .. {world - 1} (world={world}), "
                         f"got {rank!r}")
    return parts[rank]


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
        coarsening, levels, relax, max_iters, tol, throw, c_weight, batched: as for
            :class:`paraprop.multigrid.ParallelResidualStack` (``max_iters=None``: the
            exactness bound ``N // c``; ``tol`` bounds the estimated error, reduced over all
            ranks, so every rank stops after the same cycle; ``tol=None``: a fixed number of
            cycles, not checked).
        backward: ``"adjoint"`` (MGRIT on the adjoint across ranks) or ``"serial"`` (the
            adjoint propagated serially through the ranks).
        timeout: seconds any rank waits for a message before raising
            :class:`paraprop.distributed.PeerError` (guaranteed and tested with gloo; with
            nccl the wait is left to NCCL, see :class:`paraprop.distributed.DistLink`).
        group: the process group (``None``: the default group).

    Attributes:
        last_forward, last_backward: this rank's :class:`paraprop.Solution` of the latest
            forward and backward solve (``None`` before the first; ``value``: this rank's last
            point; ``iterations``, ``converged``, ``residuals`` are the same on every rank);
            ``stats`` adds ``messages`` and ``bytes`` sent by this rank, ``wait_s`` (time
            blocked waiting for peers) and ``time_s``.

    Raises:
        ValueError / TypeError: bad arguments (checked before the process group), or a block
            count that does not match this rank's share of ``depth``; in forward, a setting
            assigned since construction that the constructor would refuse, an input whose dtype
            or device differs from this rank's blocks', ``batched=True`` with ``tol=0`` or a
            bf16 / fp16 input, or a block in training mode with BatchNorm, dropout or another
            stochastic layer (``paraprop.StochasticModelError``).
        RuntimeError: ``torch.distributed`` is not initialised.
        PeerError: (in forward/backward) a peer rank died or hangs, or (in forward, on every
            rank) the ranks passed inputs of different shapes or dtypes.
        paraprop.ConvergenceError: ``tol`` not reached in ``max_iters`` cycles (``throw=True``;
            on every rank).

    Example:
        Under ``torchrun --nproc_per_node=2`` each rank runs these lines with its own blocks
        (``range(*layer_range(16))``); here a world of one holds them all.

        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}",
        ...                         rank=0, world_size=1)        # a world of one, in process
        >>> blocks = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)]
        >>> stack = LayerParallelStack(blocks, 1 / 16, depth=16)
        >>> x = torch.randn(3, 4)
        >>> y = stack(x)                                        # u_16, by MGRIT
        >>> u = x
        >>> with torch.no_grad():                               # the serial loop
        ...     for block in blocks:
        ...         u = u + block(u) / 16
        >>> stack.last_forward.converged, bool((y - u).abs().max() < 1e-5)
        (True, True)
        >>> y.sum().backward()                                  # collective, as forward
        >>> blocks[0][0].weight.grad.shape
        torch.Size([4, 4])
        >>> dist.destroy_process_group()
    """

    def __init__(self, blocks: Sequence[nn.Module], step_size: float, *, depth: int,
                 sizes: Sequence[int] | None = None, coarsening: int | Sequence[int] = 4,
                 levels: int = 2, relax: str = "FCF", max_iters: int | None = None,
                 tol: float | None = common.DEFAULT_TOL, throw: bool = True, c_weight: float = 1.0,
                 backward: str = "adjoint", timeout: float = DEFAULT_TIMEOUT_S, group=None,
                 batched: bool | None = None):
        super().__init__()
        blocks = common.check_blocks(blocks)
        common.check_settings(step_size=step_size, relax=relax, max_iters=max_iters, tol=tol,
                              c_weight=c_weight, backward=backward)
        check_timeout(timeout)
        batched_arg = batched
        common.resolve_batched(blocks, batched)
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
                                         coarsening=common.as_coarsening(coarsening))
        self.blocks = nn.ModuleList(blocks)
        self.batched = batched_arg
        self.depth, self.step_size = depth, float(step_size)
        self.relax, self.max_iters, self.tol, self.throw = relax, max_iters, tol, bool(throw)
        self.c_weight, self.backward_mode = float(c_weight), backward
        self.timeout = float(timeout)
        self.last_forward: Solution | None = None
        self.last_backward: Solution | None = None
        self._params = BlockParams(self.blocks)
        bound = self.hierarchy.exact_cycles()
        if tol is None and levels > 1 and max_iters is not None and max_iters < bound:
            common.warn_unchecked("LayerParallelStack", max_iters, bound)

    @property
    def layers(self) -> tuple[int, int]:
        return self.parts[self.rank]

    @property
    def batched(self) -> bool:
        """As :attr:`paraprop.multigrid.ParallelResidualStack.batched` (assignments checked)."""
        # (a stack pickled before the property existed keeps its plain attribute)
        return self.__dict__.get("_batched", self.__dict__.get("batched", False))

    @batched.setter
    def batched(self, value) -> None:
        checks.boolean("batched", value, allow_none=True)
        object.__setattr__(self, "_batched", common.resolve_batched(self.blocks, value))
        object.__setattr__(self, "_batched_arg", value)

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    def _apply(self, fn, *args, **kwargs):
        self._params.reset()
        return super()._apply(fn, *args, **kwargs)

    def _stacked(self, batched: bool):
        return self._params.stack() if batched else None

    def _mgrit(self, stepper, x, hier, link, parts, me, what, **kw):
        return run_mgrit(stepper, x, hier, self.step_size, relax=self.relax,
                         max_iters=self.max_iters, tol=self.tol, throw=self.throw,
                         c_weight=self.c_weight, link=link, parts=parts, me=me,
                         entry=f"LayerParallelStack ({what}, rank {self.rank})", **kw)

    def _check_peers(self, x: torch.Tensor, refused: bool) -> None:
        """Every rank's input shape and dtype, and whether it refused its input, by one
        all-gather of a fixed-size descriptor; :class:`PeerError` on every rank when the shapes
        or dtypes differ, or on the ranks whose peers refused (so no rank waits in vain)."""
        desc = _describe(x, refused)
        if dist.get_backend(self.group) != "gloo":
            desc = desc.to(torch.device("cuda", torch.cuda.current_device()))
        got = [torch.empty_like(desc) for _ in range(self.world)]
        self._collective(lambda: dist.all_gather(got, desc, group=self.group, async_op=True),
                         "forward", "the input check with the other ranks")
        got = [g.cpu() for g in got]
        if refused:
            return  # the caller raises its own error
        others = [r for r, g in enumerate(got) if int(g[0])]
        if others:
            raise PeerError(f"rank {self.rank} (forward): rank(s) {others} refused their input "
                            "or blocks (see their error); no solve was started")
        if any(not torch.equal(g[1:], got[0][1:]) for g in got[1:]):
            seen = "; ".join(f"rank {r}: {_show(g)}" for r, g in enumerate(got))
            raise PeerError(f"rank {self.rank} (forward): the ranks passed inputs of different "
                            f"shapes or dtypes ({seen}); every rank must pass x of the same "
                            "shape and dtype (rank 0's values are used)")

    def _broadcast(self, t: torch.Tensor, src: int, what: str) -> torch.Tensor:
        """``t`` from rank ``src`` on every rank (the initial condition, which every rank also
        uses as its initial guess at the C-points, as a single process does)."""
        t = t.detach().clone().contiguous()
        self._collective(lambda: dist.broadcast(t, src, group=self.group, async_op=True), what,
                         f"broadcast from rank {src}")
        return t

    def _collective(self, start, what: str, action: str) -> None:
        """Run the collective that ``start()`` launches and wait for it at most ``timeout``
        seconds: :class:`PeerError` naming ``action`` when a peer died or hangs."""
        try:
            start().wait(_dt.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise PeerError(f"rank {self.rank} ({what}): {action} failed after at most "
                            f"{self.timeout:g} s: a peer died or hangs "
                            f"({str(e).splitlines()[0][:200]})") from None

    def _solve_forward(self, x: torch.Tensor):
        t0 = time.perf_counter()
        x = self._broadcast(x, self.ranks[0], "forward")
        batched = common.run_batched("LayerParallelStack", self.batched,
                                   self.__dict__.get("_batched_arg"), x.dtype, self.tol)
        stacked = self._stacked(batched)
        a, _ = self.layers
        stepper = ForwardStepper(self.blocks, a, batched=batched, stacked=stacked)
        link = DistLink(self.ranks, timeout=self.timeout, group=self.group, what="forward")
        sol = self._mgrit(stepper, x, self.hierarchy, link, self.parts, self.rank, "forward")
        self.last_forward = kept(sol, t0, messages=link.messages, bytes=link.bytes,
                                 wait_s=link.wait_s)
        return sol.value, stacked

    def _solve_backward(self, states, stacked, grad_out, params):
        t0 = time.perf_counter()
        a, b = self.layers
        n = self.depth
        stepper = AdjointStepper(self.blocks, a, n, states, batched=stacked is not None,
                                 stacked=stacked)
        rparts = [(n - hi, n - lo) for lo, hi in reversed(self.parts)]
        rranks = list(reversed(self.ranks))
        me = self.world - 1 - self.rank
        link = DistLink(rranks, timeout=self.timeout, group=self.group, what="backward")
        hier = self.hierarchy if self.backward_mode == "adjoint" else \
            Hierarchy.build(n, levels=1, coarsening=2)
        g = self._broadcast(grad_out.to(states.dtype), self.ranks[-1], "backward")
        sol = self._mgrit(stepper, g, hier, link, rparts, me, "backward", collect=True)
        lam = sol.value
        per_block = sol.stats["parameter_grads"]
        if per_block is None:
            per_block = stepper.parameter_grads(lam[:-1].flip(0), self.step_size)
        grads = self._params.order(per_block, params)
        self.last_backward = kept(sol, t0, stepper.counts.evaluations, messages=link.messages,
                                  bytes=link.bytes, wait_s=link.wait_s)
        gx = lam[-1] if self.rank == 0 else torch.zeros_like(lam[-1])
        return gx, grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Collective: ``u_N`` on the last rank (same shape elsewhere, see the class notes).

        ``x`` must have the same shape and dtype on every rank (checked: a mismatch raises
        :class:`PeerError` on every rank); rank 0's value is used.
        """
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}")
        try:
            # the settings again (attributes may be assigned after construction)
            common.check_settings(step_size=self.step_size, relax=self.relax,
                                  max_iters=self.max_iters, tol=self.tol, c_weight=self.c_weight,
                                  backward=self.backward_mode, throw=self.throw)
            check_timeout(self.timeout)
            common.check_input(x, self._params.floating(), self.layers[0])
            common.check_block_modes(self._params.stateful(), self.layers[0])
            common.run_batched("LayerParallelStack", self.batched,
                               self.__dict__.get("_batched_arg"), x.dtype, self.tol)
        except (TypeError, ValueError):
            try:
                self._check_peers(x, refused=True)  # the others learn of it and raise too
            except PeerError:
                pass  # this rank's own error is the one to report
            raise
        self._check_peers(x, refused=False)
        params = self._params.trainable() if torch.is_grad_enabled() else []
        # a block that draws random numbers (randn_like, ...: no list of layers knows it)
        # moves this rank's generator; checked once the collective solve has ended, so that
        # the other ranks are not left waiting
        with common.refuse_random_blocks("LayerParallelStack", x.device):
            return common.solve_through(self, x, params)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_DIMS = 16


def _describe(x: torch.Tensor, refused: bool) -> torch.Tensor:
    """``[refused, dtype code, ndim, *shape, 0 ...]``: a fixed-size int64 summary of ``x``
    (``ndim`` is ``-1`` past ``_MAX_DIMS`` dimensions, which then compare by count only)."""
    d = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64)
    d[0] = int(refused)
    d[1] = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    if x.dim() <= _MAX_DIMS:
        d[2] = x.dim()
        d[3 : 3 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    else:
        d[2] = -1
        d[3] = x.dim()
    return d


def _show(d: torch.Tensor) -> str:
    code, nd = int(d[1]), int(d[2])
    dtype = str(_DTYPES[code]) if code < len(_DTYPES) else "another dtype"
    shape = f"a {int(d[3])}-d tensor" if nd < 0 else \
        f"shape {tuple(int(v) for v in d[3 : 3 + nd])}"
    return f"{shape}, {dtype}"


def partitioned_forward(blocks: Iterable[nn.Module], x: torch.Tensor, step_size: float, *,
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

    Example:
        Under ``torchrun --nproc_per_node=2`` rank ``r`` passes
        ``blocks[slice(*layer_range(16))]``; here a world of one holds them all.

        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}",
        ...                         rank=0, world_size=1)        # a world of one, in process
        >>> blocks = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)]
        >>> x = torch.randn(3, 4)
        >>> y = partitioned_forward(blocks, x, 1 / 16)
        >>> u = x
        >>> with torch.no_grad():
        ...     for block in blocks:
        ...         u = u + block(u) / 16
        >>> torch.equal(y, u)
        True
        >>> dist.destroy_process_group()
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
