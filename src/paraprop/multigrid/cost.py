"""A cost model: predicted time of layer-parallel MGRIT and of model partitioning on W workers.

Instead of closed-form operation counts, :func:`simulate` replays the real solver
(:func:`paraprop.multigrid.mgrit.mgrit` with a fixed number of cycles, the same code that runs
across ranks) on ``W`` threads
whose steps and messages only advance per-rank clocks:

- a batched step over ``k`` intervals costs ``ceil(k / concurrency)`` layer times (a worker
  runs ``concurrency`` intervals at the price of one: 1 on a saturated CPU, more on a GPU with
  streams, Kirby et al. 2020 §3.2);
- a message sent at time ``t`` arrives at ``t + latency + bytes / bandwidth`` (Hockney's
  latency-bandwidth model); a receive waits for the arrival;
- the residual norm's all-reduce synchronises every clock and costs ``2 ceil(log2 W)``
  latencies.

The predicted time is the largest clock at the end: the critical path of the implementation,
including the serial coarse-level chain across ranks. Model partitioning (each worker holds its
layers and passes activations on, forward then backward) is a chain over the workers.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from paraprop import checks
from paraprop.multigrid.common import RELAX
from paraprop.multigrid.hierarchy import Hierarchy, split_layers
from paraprop.multigrid.mgrit import run_mgrit
from paraprop.multigrid.threads import run_threads

__all__ = ["CostModel", "simulate"]


@dataclass(frozen=True)
class CostModel:
    """Measured per-layer times and the communication model.

    Attributes:
        forward_s: one layer's forward step ``u + h F(u)`` (one batch).
        adjoint_s: one adjoint step ``lam + h J^T lam`` (a VJP with respect to the state).
        param_grad_s: one layer's parameter-gradient VJP.
        backprop_s: one layer's ordinary backward pass (state and parameter gradients, as
            model partitioning and serial training do it).
        latency_s: the latency of one message.
        bandwidth_Bps: bytes per second of one link.
        message_bytes: the size of one state (activation) message.
        concurrency: intervals a worker steps concurrently at the cost of one (a float
            ``> 0``: ``k > 1`` intervals cost ``ceil(k / concurrency)`` layer times).
        fused_s: one VJP with respect to state and parameters together: the step of the
            adjoint's final relaxation, which then accumulates the parameter gradients
            (``None``: a separate parameter-gradient sweep of ``param_grad_s`` per layer).

    Example:
        >>> m = CostModel(forward_s=1e-3, adjoint_s=2e-3, param_grad_s=2e-3, backprop_s=2e-3,
        ...               latency_s=5e-5)
        >>> report = simulate(256, 8, m, levels=2)      # 256 layers on 8 workers
        >>> sorted(report)
        ['messages', 'mgrit_s', 'partition_s', 'serial_s', 'speedup_vs_partition',
         'speedup_vs_serial']
        >>> CostModel(forward_s=-1, adjoint_s=0, param_grad_s=0, backprop_s=0)
        Traceback (most recent call last):
        ValueError: forward_s must be a number >= 0, got -1
    """

    forward_s: float
    adjoint_s: float
    param_grad_s: float
    backprop_s: float
    latency_s: float = 0.0
    bandwidth_Bps: float = math.inf
    message_bytes: int = 0
    concurrency: float = 1
    fused_s: float | None = None

    def __post_init__(self):
        for name in ("forward_s", "adjoint_s", "param_grad_s", "backprop_s", "latency_s",
                     "message_bytes"):
            checks.nonneg_number(name, getattr(self, name))
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"bandwidth_Bps must be > 0, got {self.bandwidth_Bps!r}")
        checks.nonneg_number("fused_s", self.fused_s, allow_none=True)
        if not self.concurrency > 0:
            raise ValueError(f"concurrency must be > 0, got {self.concurrency!r}")

    @property
    def message_s(self) -> float:
        return self.latency_s + self.message_bytes / self.bandwidth_Bps


class _Clock:
    def __init__(self):
        self.t = 0.0


class _ClockStepper:
    def __init__(self, clock: _Clock, per_step: float, concurrency: float, offset: int,
                 fused: float | None = None):
        self.clock, self.per_step, self.conc, self.offset = clock, per_step, concurrency, offset
        self.fused, self._normal = fused, per_step
        self.counts = type("C", (), {"evaluations": 0, "calls": 0})()
        if fused is not None:  # the adjoint: its final relaxation accumulates the gradients
            self.begin_collect = self._begin
            self.end_collect = self._end

    def _begin(self):
        self.per_step = self.fused

    def _end(self):
        self.per_step = self._normal
        return []

    def _advance(self, count: int, steps: int) -> None:
        batches = 1 if count == 1 else math.ceil(count / self.conc - 1e-9)
        self.clock.t += steps * self.per_step * batches
        self.counts.evaluations += count * steps
        self.counts.calls += steps

    def step(self, first, stride, count, u, scale):
        self._advance(count, 1)
        return u.clone()

    def step_one(self, k, u, scale):
        self._advance(1, 1)
        return u.clone()

    def sweep(self, first, stride, count, length, u0, scale, g, out_f, out_w):
        self._advance(count, length - 1 + (out_w is not None))
        out_f.zero_()  # defined (finite) values: the solver checks that the residual is finite
        if out_w is not None:
            out_w.zero_()


class _ClockLink:
    """Carries each sender's clock with the message; receives wait for the arrival time."""

    def __init__(self, inner, clock: _Clock, model: CostModel, times: list, world: int,
                 ranks: list[int]):
        self.inner, self.clock, self.model = inner, clock, model
        self.times, self.world, self.ranks = times, world, ranks
        self.messages = 0

    def send(self, tensor, dest, tag):
        self.messages += 1
        stamped = torch.cat([tensor.reshape(-1), tensor.new_tensor([self.clock.t])])
        self.inner.send(stamped, dest, tag)

    def recv(self, like, src, tag):
        got = self.inner.recv(like, src, tag)
        self.clock.t = max(self.clock.t, float(got[-1]) + self.model.message_s)
        return got[:-1].reshape(like.shape)

    def sum(self, value):
        me = self.inner.me
        self.times[me] = self.clock.t
        total = self.inner.sum(value)
        self.clock.t = max(self.times) + 2 * math.ceil(math.log2(self.world)) \
            * self.model.latency_s
        self.inner.sum(0.0)  # everyone has read the clocks before they change again
        return total

    def flush(self):
        pass


def simulate(
    depth: int,
    workers: int,
    model: CostModel,
    *,
    coarsening: int | tuple[int, ...] = 4,
    levels: int = 2,
    cycles: int = 2,
    relax: str = "FCF",
    training: bool = True,
) -> dict:
    """Predict one forward (and backward) pass of MGRIT and of model partitioning.

    Arguments:
        depth: ``N``, residual layers.
        workers: ``W`` (each owns a contiguous range of layers, split evenly).
        model: the per-layer times and the communication model (:class:`CostModel`).
        coarsening, levels, relax: the MGRIT hierarchy and relaxation.
        cycles: V-cycles of the forward solve (and of the adjoint solve).
        training: forward and backward (the adjoint solve, whose final relaxation accumulates
            the parameter gradients when ``model.fused_s`` is set, else followed by a separate
            parameter-gradient sweep), or the forward pass only.

    Returns:
        ``{"serial_s", "partition_s", "mgrit_s", "speedup_vs_partition",
        "speedup_vs_serial", "messages"}``.

    Raises:
        ValueError: bad sizes (too few layers for the levels or the workers) or ``relax``.

    Example:
        >>> m = CostModel(forward_s=1e-3, adjoint_s=2e-3, param_grad_s=2e-3, backprop_s=2e-3)
        >>> simulate(1024, 16, m, levels=3)["speedup_vs_partition"] > 1
        True
    """
    hier = Hierarchy.build(depth, levels=levels, coarsening=coarsening)
    checks.one_of("relax", relax, RELAX)
    checks.positive_int("cycles", cycles)
    parts = split_layers(depth, workers)
    m = model
    # Model partitioning: activations pass through the workers one after another.
    part_fwd = depth * m.forward_s + (workers - 1) * m.message_s
    part_bwd = depth * m.backprop_s + (workers - 1) * m.message_s
    serial = depth * (m.forward_s + (m.backprop_s if training else 0.0))
    partition = part_fwd + (part_bwd if training else 0.0)

    times = [0.0] * workers
    lock = threading.Lock()
    messages = [0]

    def rank(r: int, qlink) -> float:
        clock = _Clock()
        x = torch.zeros(1, dtype=torch.float64)
        fwd = _ClockStepper(clock, m.forward_s, m.concurrency, parts[r][0])
        link = _ClockLink(qlink, clock, m, times, workers, list(range(workers)))
        # a fixed number of cycles (tol=None): the cost model times the work, not the answer
        run_mgrit(fwd, x, hier, 1.0, relax=relax, max_iters=cycles, tol=None, link=link,
                  parts=parts, me=r)
        if training:
            # The adjoint runs backwards in depth: ranks in reverse order, reversed ranges.
            rparts = [(depth - b, depth - a) for a, b in reversed(parts)]
            me = workers - 1 - r
            adj = _ClockStepper(clock, m.adjoint_s, m.concurrency, rparts[me][0], m.fused_s)
            rlink = _ReversedLink(link, workers)
            res = run_mgrit(adj, x, hier, 1.0, relax=relax, max_iters=cycles, tol=None,
                            link=rlink, parts=rparts, me=me, collect=m.fused_s is not None)
            if res.stats["parameter_grads"] is None:  # a separate, fully parallel sweep
                n_local = parts[r][1] - parts[r][0]
                clock.t += m.param_grad_s * math.ceil(n_local / m.concurrency)
        with lock:
            messages[0] += link.messages
        return clock.t

    ends = run_threads(workers, rank, timeout=60.0)
    mg = max(ends)
    return {"serial_s": serial, "partition_s": partition, "mgrit_s": mg,
            "speedup_vs_partition": partition / mg, "speedup_vs_serial": serial / mg,
            "messages": messages[0]}


class _ReversedLink:
    """Positions in the adjoint's solve order (ranks reversed) mapped back to thread ranks."""

    def __init__(self, link: _ClockLink, world: int):
        self.link, self.world = link, world

    def send(self, tensor, dest, tag):
        self.link.send(tensor, self.world - 1 - dest, tag)

    def recv(self, like, src, tag):
        return self.link.recv(like, self.world - 1 - src, tag)

    def sum(self, value):
        return self.link.sum(value)

    def flush(self):
        pass
