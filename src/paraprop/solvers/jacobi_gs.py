"""Jacobi-GS: all blocks in parallel, positions inside a block one after another (Algorithm 2)."""

from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from paraprop import checks
from paraprop.solvers.base import Solver, State, accept, settle
from paraprop.solvers.triangular import System
from paraprop.solvers.verify import final_step


@dataclass(slots=True)
class _JacobiGSState:
    ranges: list[range]       # the blocks
    depth: int                # the longest block's positions (an iteration's calls)
    index: torch.Tensor       # arange(T), for the non-finite checks
    # the positions of each call of an iteration, in order: with block_size offset j of every
    # block; with blocks one position each, last block first
    offsets: list[torch.Tensor]
    # the calls one iteration makes in sequence (the longest share's with workers)
    share_steps: int
    k: int = 0                # iterations done
    used: int = 0             # the sequential steps of the parallel iterations
    steps: int = 0            # the sequential steps in all
    # with workers > 1: per thread its calls' positions, and the positions it owns
    shares: list[list[torch.Tensor]] | None = None
    owned: list[torch.Tensor] | None = None


class JacobiGS(Solver):
    """Positions split into contiguous blocks of ``block_size`` (Song et al. 2021, Algorithm 2).

    One iteration is a Gauss-Seidel sweep through the ``block_size`` offsets: step ``j`` updates
    offset ``j`` of every block at once (one call of ``fn``, or of ``fn.update`` with those
    positions), always from the newest values. After iteration ``k`` the first ``k`` blocks are
    exact (Proposition 2), so at most ``ceil(T / block_size)`` iterations. A sample stops early on
    the contraction estimate of its error.

    Never more calls in sequence than the sequential loop (``T``): the last block is finished
    by sequential steps from the final prefix, one call per position, the last one an
    evaluation of ``fn`` that checks the value (one iteration; ``stats["finished_sequentially"]``
    counts its positions). With explicit ``blocks`` an iteration counts as its longest block's
    calls (one worker per block), and the blocks from the first one whose iteration could take
    the total past ``T`` are finished that way.

    Arguments:
        block_size: positions per block; ``None``: ``ceil(sqrt(T))``, which balances the
            ``block_size`` calls per iteration against the ``T / block_size`` iterations.
        blocks: instead of ``block_size``, any partition of the positions into contiguous
            blocks of any lengths (e.g. a network's states grouped by cost,
            :func:`paraprop.networks.balanced_blocks`), as ranges or lists of flat positions. The
            iteration then visits the blocks last to first, each position in order, so that a
            block reads its own new values and the previous values of the blocks before it.
        workers: with ``blocks``, run the blocks of one iteration on this many threads (PyTorch
            operators release the GIL, so their kernels overlap). Each thread works on its own
            copy of the iterate and takes its blocks last to first, so the iterates are bitwise
            those of ``workers=1``; the iteration ends when every thread is done. ``fn`` (its
            ``update``) is then called from several threads at once, so it must not keep
            mutable state between calls (a bound network's ``LayerSystem`` does not). Default 1.
        costs: with ``workers``, the cost of each position (e.g. seconds per state from
            :func:`paraprop.networks.profile`): the blocks are dealt slowest first, each to the
            least loaded thread. Default: round-robin.
        intra_op_threads: PyTorch threads inside each worker thread (default 1: the workers are
            the parallelism).

    Example:
        >>> W = 0.5 * torch.randn(8, 8).tril(-1)
        >>> fn = lambda x: torch.tanh(x @ W.T + 1)
        >>> ref = paraprop.solve(fn, torch.zeros(8), method="sequential")
        >>> sol = paraprop.solve(fn, torch.zeros(8), method=paraprop.solvers.JacobiGS(2), tol=0)
        >>> sol.iterations <= 4, torch.equal(sol.value, ref.value)   # <= ceil(8 / 2) sweeps
        (True, True)
    """

    name = "jacobi_gs"
    # the optional hooks of fn it calls (solvers.protocols; the final check calls fn):
    # fn.update for the blocks' positions (else fn)
    hooks: tuple[str, ...] = ("update",)

    def __init__(self, block_size: int | None = None, *, blocks=None, workers: int = 1,
                 costs=None, intra_op_threads: int = 1):
        self.block_size = checks.positive_int("JacobiGS: block_size", block_size,
                                              allow_none=True)
        if blocks is not None and block_size is not None:
            raise ValueError("JacobiGS: pass block_size or blocks, not both")
        self.blocks = None if blocks is None else as_ranges(blocks, "JacobiGS: blocks")
        self.workers = checks.positive_int("JacobiGS: workers", workers)
        self.intra_op_threads = checks.positive_int("JacobiGS: intra_op_threads",
                                                    intra_op_threads)
        if self.workers > 1 and self.blocks is None:
            raise ValueError("JacobiGS: workers > 1 needs blocks (an explicit partition)")
        self.costs = None
        if costs is not None:
            if self.blocks is None:
                raise ValueError("JacobiGS: costs need blocks (an explicit partition)")
            self.costs = [float(c) for c in costs]
            if len(self.costs) != self.blocks[-1].stop:
                raise ValueError(f"JacobiGS: costs must have one entry per position "
                                 f"({self.blocks[-1].stop}), got {len(self.costs)}")

    def __repr__(self) -> str:
        if self.blocks is not None:
            extra = f", workers={self.workers}" if self.workers > 1 else ""
            return f"JacobiGS(blocks={[[b.start, b.stop] for b in self.blocks]!r}{extra})"
        return f"JacobiGS(block_size={self.block_size!r})"

    def size(self, system: System) -> int:
        bs = self.block_size or math.ceil(math.sqrt(system.T))
        return min(bs, system.T)

    def bound(self, system: System) -> int:
        if self.blocks is not None:
            return len(self.blocks)
        return math.ceil(system.T / self.size(system))

    def _ranges(self, system: System) -> list[range]:
        """The blocks as ranges (``block_size``: contiguous runs of that many positions)."""
        if self.blocks is not None:
            return self.blocks
        bs = self.size(system)
        return [range(lo, min(lo + bs, system.T)) for lo in range(0, system.T, bs)]

    def init(self, system: System, state: State) -> None:
        device = state.x.device
        ranges = self._ranges(system)
        # the budget (never more sequential steps than the sequential loop, T): an iteration
        # costs its longest block (block_size calls; with explicit blocks, run one per worker),
        # and certifies the next block at least
        depth = max(len(b) for b in ranges)
        state.own = own = _JacobiGSState(ranges, depth, torch.arange(system.T, device=device),
                                         [], depth)
        state.estimated_from = torch.full((system.B,), system.T, dtype=torch.long,
                                          device=device)
        if self.blocks is not None:
            if self.blocks[-1].stop != system.T:
                raise ValueError(f"JacobiGS: blocks cover positions 0..{self.blocks[-1].stop - 1}"
                                 f" but the system has T={system.T} positions")
            index = [torch.tensor([t], device=device) for t in range(system.T)]
            # last block first, positions in order: each block reads the earlier blocks' old
            # values (the parallel semantics of Algorithm 2)
            own.offsets = [index[t] for b in reversed(self.blocks) for t in b]
            state.stats = {"blocks": [[b.start, b.stop] for b in self.blocks]}
            if self.workers > 1:
                cost = [sum(self.costs[t] for t in b) if self.costs else len(b)
                        for b in self.blocks]
                shares = share_blocks(self.blocks, cost, self.workers,
                                      balanced=self.costs is not None)
                # per thread: its blocks last to first, as (flat index, position) pairs
                own.shares = [[index[t] for b in reversed(sh) for t in b] for sh in shares]
                # each thread's positions, to copy its results back in one call
                own.owned = [torch.tensor([t for b in sh for t in b], device=device)
                             for sh in shares]
                state.stats["workers"] = len(shares)
            # the calls one iteration makes in sequence: the longest share's (one thread: all)
            own.share_steps = max(len(sh) for sh in own.shares) \
                if own.shares is not None else system.T
            return
        bs = self.size(system)
        # offset j of every block: positions j, j + bs, j + 2 bs, ... below T
        own.offsets = [torch.arange(j, system.T, bs, device=device) for j in range(bs)]
        state.stats = {"block_size": bs}

    def _sweep(self, system: System, state: State, first: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One iteration on a copy of the iterate; ``first``: the first position that is not
        final (the positions up to the end of its block are computed from final inputs).
        Returns the new values and the samples that kept a non-finite value's old one."""
        if state.own.shares is not None:
            return self._threaded_sweep(system, state, first)
        work = state.x.clone()
        kept = None
        # a plain fn sees the copy whole (its promise not to modify it is checked); fn.update
        # gets the private copy, and the final evaluation of fn checks its values
        guard = not system.fast
        for index in state.own.offsets:
            vals = system.update(work, index, guard=guard)
            vals, k = system.keep_finite(vals, lambda index=index: work.index_select(1, index),
                                         first, index, state.active, x=work)
            kept = _merge(kept, k)
            work.index_copy_(1, index, vals)
        return work, kept

    def _threaded_sweep(self, system: System, state: State, first: int):
        """The sweep with each thread's blocks on its own copy of the iterate (see
        ``workers``): bitwise the sequential sweep, whose blocks read only their own new
        values and the previous values of the blocks before them."""

        def run(share):
            with torch.no_grad():
                mine = state.x.clone()
                kept = None
                for index in share:
                    vals = system.update(mine, index, guard=False)
                    vals, k = system.keep_finite(
                        vals, lambda index=index: mine.index_select(1, index), first, index,
                        state.active, x=mine)
                    kept = _merge(kept, k)
                    mine.index_copy_(1, index, vals)
            return mine, kept

        pool = _pool(self.workers, self.intra_op_threads)
        results = list(pool.map(run, state.own.shares))
        work = state.x.clone()
        kept = None
        for owned, (mine, k) in zip(state.own.owned, results, strict=True):
            work.index_copy_(1, owned, mine.index_select(1, owned))
            kept = _merge(kept, k)
        return work, kept

    def _exact(self, system: System, k: int) -> int:
        """Positions final before iteration ``k`` (the first ``k - 1`` blocks)."""
        if self.blocks is not None:
            return self.blocks[k - 2].stop if k >= 2 else 0
        return min((k - 1) * self.size(system), system.T)

    def _first_block_end(self, system: System, k: int) -> int:
        """The last position of block ``k - 1`` (0-based), which iteration ``k`` computes
        from final inputs only (Proposition 2)."""
        if self.blocks is not None:
            return self.blocks[min(k, len(self.blocks)) - 1].stop - 1
        return min(k * self.size(system), system.T) - 1

    def _parallel(self, state: State, k: int) -> bool:
        """Whether iteration ``k`` may run in parallel within the budget: the steps spent, plus
        its own, plus one sequential step per position after the block it certifies (the worst
        case), must not exceed ``T``. The last block is always finished sequentially (its
        sweep would cost the longest block's steps, and a verifying sweep more)."""
        e: _JacobiGSState = state.own
        ranges = e.ranges
        return k < len(ranges) and e.used + e.depth <= ranges[k - 1].stop

    def step(self, system: System, state: State, tol: float, norm: str) -> None:
        e: _JacobiGSState = state.own
        k = e.k + 1
        e.k = k
        if not self._parallel(state, k):
            self._finish(system, state, tol, norm, self._exact(system, k))
            return
        if k == 1:
            # a plain fn: a sweep that reproduced the iterate evaluated fn at it (the check);
            # fn.update's values are checked by one evaluation of fn at the end
            state.verified = not system.fast
        work, kept = self._sweep(system, state, self._first_block_end(system, k))
        e.used += e.depth
        self._count(state, e.share_steps)
        exact = self._exact(system, k)
        was = state.active
        accept(system, state, 0, system.T, work, tol, norm, exact=exact, kept=kept)
        if tol > 0 and state.active is not was:
            # samples stopped on the estimate: the blocks after the ones computed from final
            # inputs were not certified by reasoning (paraprop.solvers.verify tells them apart)
            stopped = was & ~state.active & (state.estimate > 0)
            frm = state.estimated_from
            assert frm is not None   # set by init
            certified = torch.full_like(frm, e.ranges[k - 1].stop)
            state.estimated_from = torch.where(stopped, torch.minimum(frm, certified), frm)
        settle(state, False)

    def _finish(self, system: System, state: State, tol: float, norm: str, p: int) -> None:
        """The rest of the budget: the positions ``p .. T - 1`` of the samples still iterating
        (all positions ``< p`` final), one sequential step each, as the sequential loop computes
        them (``x0``'s values at the positions not computed yet); the last step is one
        evaluation of ``fn`` that also checks every other position
        (:func:`~paraprop.solvers.verify.final_step`). One iteration. With ``block_size`` the
        steps are the sweep's first offsets (``fn.update`` sees the calls of an iteration, which
        a map may serve from one pass, as :class:`paraprop.sampling.pixelcnn.CachedPixels`
        does); only the last block's positions are taken from them."""
        e: _JacobiGSState = state.own
        T = system.T
        x, act = state.x, state.active
        self._count(state, T - p)
        if system.initial is not None:
            x[:, p:] = torch.where(act[:, None, None], system.initial[:, p:], x[:, p:])
        for t in range(p, T - 1):
            if self.blocks is None:   # offset t - p of every block: position t is its last
                index = e.offsets[t - p]
                vals = system.update(x, index)[:, -1:]
            else:
                index = e.index[t:t + 1]
                vals = system.update(x, index)
            # computed from final inputs: a NaN or inf is the sequential loop's own
            system.keep_finite(vals, lambda t=t: x[:, t:t + 1], t, e.index[t:t + 1], act, x=x)
            x[:, t:t + 1] = torch.where(act[:, None, None], vals, x[:, t:t + 1])
        final_step(system, state, tol, norm)
        state.stats["finished_sequentially"] = T - p

    def _count(self, state: State, steps: int) -> None:
        """Sequential steps: with explicit blocks an iteration's calls run on the workers, and
        ``stats["sequential_steps"]`` is the longest share's calls (one worker: all)."""
        e: _JacobiGSState = state.own
        e.steps += steps
        if self.blocks is not None:
            state.stats["sequential_steps"] = e.steps

def _merge(kept: torch.Tensor | None, k: torch.Tensor | None) -> torch.Tensor | None:
    """The samples that kept a non-finite value's old one, as ``(B, 1)`` (``None``: none)."""
    if k is None:
        return kept
    k = k.any(dim=1, keepdim=True)
    return k if kept is None else kept | k


@functools.cache
def _pool(workers: int, intra_op_threads: int) -> ThreadPoolExecutor:
    """One pool of worker threads per setting, kept for the life of the process."""
    return ThreadPoolExecutor(workers, thread_name_prefix="paraprop-jacobi-gs",
                              initializer=torch.set_num_threads, initargs=(intra_op_threads,))


def share_blocks(blocks: list[range], cost: list[float], workers: int, *, balanced: bool
                 ) -> list[list[range]]:
    """Split the blocks among at most ``workers`` threads, each share in position order:
    round-robin, or (``balanced``) slowest block first, each to the least loaded thread."""
    n = min(workers, len(blocks))
    if not balanced:
        shares = [blocks[i::n] for i in range(n)]
    else:
        load = [0.0] * n
        shares = [[] for _ in range(n)]
        for i in sorted(range(len(blocks)), key=lambda j: -cost[j]):
            w = min(range(n), key=load.__getitem__)
            shares[w].append(blocks[i])
            load[w] += cost[i]
        shares = [sorted(s, key=lambda b: b.start) for s in shares]
    return [s for s in shares if s]


def as_ranges(blocks, name: str = "blocks", T: int | None = None,
              unit: str = "positions") -> list[range]:
    """``blocks`` as ranges, after checking they are contiguous and cover ``0 .. T-1`` in order
    (``name`` starts the error messages; ``T=None``: any length)."""
    try:
        lists = [[int(i) for i in b] for b in blocks]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of sequences of positions, got "
                        f"{blocks!r}") from None
    flat = [i for b in lists for i in b]
    n = len(flat) if T is None else T
    if not lists or any(not b for b in lists) or flat != list(range(n)):
        span = "0..T-1" if T is None else f"0..{T - 1}"
        raise ValueError(f"{name} must split the {unit} {span} into non-empty contiguous "
                         f"blocks in order, got {lists}")
    return [range(b[0], b[-1] + 1) for b in lists]
