"""Point-to-point exchange between ranks over ``torch.distributed``, with timeouts.

:class:`DistLink` implements the :class:`paraprop.multigrid.mgrit.Link` protocol: non-blocking
sends (``isend`` of a private copy, completed at :meth:`DistLink.flush`), receives that wait at
most ``timeout`` seconds, and the all-reduce of the residual norm (with the largest change of
the iterate, for the stopping rule). With the gloo backend, a peer
that died or hangs makes the waiting rank raise :class:`PeerError` naming the peer, the
operation and the time waited, instead of blocking forever (the tests check this).

With nccl the same calls run, but whether a wait gives up after ``timeout`` is up to NCCL and
its watchdog (``Work.wait(timeout)`` is not honoured the same way by every backend and
version); that guarantee is not made or tested for nccl.
"""

from __future__ import annotations

import datetime as _dt
import os
import time

import torch
import torch.distributed as dist

from paraprop import checks
from paraprop.errors import PeerError

__all__ = ["DEFAULT_TIMEOUT_S", "DistLink", "PeerError", "check_timeout", "init_from_env"]

DEFAULT_TIMEOUT_S = 60.0


def _td(seconds: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=seconds)


def check_timeout(timeout) -> None:
    """Raises ``ValueError`` unless ``timeout`` is a finite number of seconds ``> 0``."""
    checks.positive_number("timeout", timeout, finite=True)


class DistLink:
    """Exchange for one rank of a solve over a ``torch.distributed`` process group.

    Arguments:
        ranks: the global rank at each position of the solve order (e.g. ``[0, 1]`` forward,
            ``[1, 0]`` for the adjoint, which runs backwards in depth).
        timeout: seconds to wait for any single message or collective (a guarantee with gloo;
            with nccl, see the module notes).
        group: the process group (``None``: the default group).
        what: a label for error messages (e.g. ``"forward"``).

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}",
        ...                         rank=0, world_size=1)        # a world of one, in process
        >>> link = DistLink([0], timeout=10)
        >>> link.sum([1.0, 2.5])                               # an all-reduce over the ranks
        [1.0, 2.5]
        >>> link.gather(torch.ones(2))                          # one tensor per rank
        [tensor([1., 1.])]
        >>> dist.destroy_process_group()
    """

    def __init__(self, ranks: list[int], *, timeout: float = DEFAULT_TIMEOUT_S, group=None,
                 what: str = "solve"):
        check_timeout(timeout)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call "
                               "paraprop.distributed.init_from_env() or "
                               "torch.distributed.init_process_group() first")
        self.ranks = list(ranks)
        self.timeout = float(timeout)
        self.group = group
        self.what = what
        self.me = dist.get_rank()
        self.messages = 0
        self.bytes = 0
        self.wait_s = 0.0  # time spent blocked in receives and all-reduces
        self._pending: list = []
        # gloo sends and receives CPU tensors; nccl device tensors.
        backend = dist.get_backend(group)
        self._cpu = backend == "gloo"

    def _fail(self, op: str, peer: int | None, err: Exception) -> PeerError:
        who = f"rank {peer}" if peer is not None else "a peer rank"
        return PeerError(f"rank {self.me} ({self.what}): {op} with {who} failed after at most "
                         f"{self.timeout:g} s: a peer died or hangs, or left the common control "
                         f"flow ({type(err).__name__}: {str(err).splitlines()[0][:200]})")

    def send(self, tensor: torch.Tensor, dest: int, tag: int) -> None:
        peer = self.ranks[dest]
        buf = tensor.detach().to("cpu" if self._cpu else tensor.device).contiguous().clone()
        try:
            work = dist.isend(buf, peer, group=self.group, tag=tag)
        except RuntimeError as e:
            raise self._fail("send", peer, e) from None
        self._pending.append((work, buf, peer))
        self.messages += 1
        self.bytes += buf.numel() * buf.element_size()

    def recv(self, like: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        peer = self.ranks[src]
        buf = torch.empty(like.shape, dtype=like.dtype,
                          device="cpu" if self._cpu else like.device)
        self._timed(lambda: dist.irecv(buf, peer, group=self.group, tag=tag), "receive", peer)
        return buf.to(like.device)

    def sum(self, value: float | list[float]) -> float | list[float]:
        """The sum over the ranks of ``value``: a float, or elementwise a list of floats (one
        all-reduce either way)."""
        many = isinstance(value, list | tuple)
        values = list(value) if isinstance(value, list | tuple) else [value]
        if len(self.ranks) == 1:
            return values if many else value
        t = torch.tensor(values, dtype=torch.float64)
        if not self._cpu:
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        self._timed(lambda: dist.all_reduce(t, group=self.group, async_op=True), "all-reduce")
        return t.tolist() if many else float(t)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (the same shape and dtype on all of them), in rank order
        (one all-gather)."""
        buf = tensor.detach().to("cpu" if self._cpu else tensor.device).contiguous()
        parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(self.group))]
        self._timed(lambda: dist.all_gather(parts, buf, group=self.group, async_op=True),
                    "all-gather")
        return [p.to(tensor.device) for p in parts]

    def _timed(self, start, what: str, peer=None) -> None:
        """Start an asynchronous operation (``start()`` returns its work handle) and wait for it
        within the timeout, adding the wait to ``wait_s``; a failure or a timeout raises
        :class:`PeerError` naming ``what`` and ``peer``."""
        t0 = time.perf_counter()
        try:
            start().wait(_td(self.timeout))
        except RuntimeError as e:
            raise self._fail(what, peer, e) from None
        self.wait_s += time.perf_counter() - t0

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for work, _, peer in pending:
            try:
                work.wait(_td(self.timeout))
            except RuntimeError as e:
                raise self._fail("send", peer, e) from None


def init_from_env(backend: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> int:
    """Initialise ``torch.distributed`` from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``); returns this rank. When the process group is already
    initialised (e.g. by :func:`paraprop.distributed.spawn`), returns this rank and changes
    nothing.

    Arguments:
        backend: ``"gloo"`` or ``"nccl"``; ``None``: nccl when CUDA is available, else gloo.
        timeout: seconds before a collective or a rendezvous gives up (the process group's own
            timeout; with nccl, how it is enforced is NCCL's business).

    Raises:
        RuntimeError: the environment variables are missing (not launched by torchrun).

    Example:
        In a script started by ``torchrun --nproc_per_node=2 script.py``, ``rank =
        init_from_env(timeout=30)`` is all it takes; here the environment torchrun would set
        describes a world of one:

        >>> import os, socket, torch.distributed as dist
        >>> from unittest import mock
        >>> with socket.socket() as s:                          # a free port
        ...     s.bind(("127.0.0.1", 0))
        ...     port = s.getsockname()[1]
        >>> env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        ...        "MASTER_PORT": str(port)}
        >>> with mock.patch.dict(os.environ, env):
        ...     init_from_env("gloo", timeout=30), dist.get_world_size()
        (0, 1)
        >>> dist.destroy_process_group()
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(f"not launched by torchrun: {', '.join(missing)} unset; run "
                           "'torchrun --nproc_per_node=N -m paraprop.distributed ...'")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=_td(timeout))
    return dist.get_rank()
