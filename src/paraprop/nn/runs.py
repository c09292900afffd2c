"""What the last call of a recurrent module ran, as :class:`paraprop.Solution` objects.

Every module of :mod:`paraprop.nn` keeps two attributes, rewritten by each call:

- ``last_forward``: one :class:`~paraprop.Solution` per layer (bottom layer first) for the
  forwards paraprop computed: the layer's solve for a parallel forward (``method`` the solver's
  name; ``iterations``, ``residuals``, ``result`` / ``converged``, ``stats["error_estimate"]``
  and the solver's own counters such as Newton's ``stats["resets"]``), or, for
  ``forward="native"`` / ``"auto"``, a record of the sequential loop (``method="sequential"``,
  ``iterations = T``, always ``converged``). ``()`` after ``forward="sequential"`` (torch's
  kernel or the module's own loop: nothing of paraprop's ran).
- ``last_backward``: a :class:`BackwardRun` naming the backward that ran, with one
  :class:`~paraprop.Solution` per layer for its reverse recurrence; ``None`` before a backward
  (a call without a graph leaves ``None``).

Each ``value`` is the last point of the layer's solve only (the layer's final state forward, the
gradient of its first state backward), so that a record keeps no sequence alive. Besides the
common counters, ``stats`` holds what the module adds (:func:`record_solve`, :func:`loop_run`):
``"tol"`` (the tolerance used), ``"compute_dtype"`` (the dtype the layer computed in: float32
for a bfloat16 / float16 module's parallel forward), ``"kernel"`` (a sequential loop:
``"native"`` or ``"torch"``); ParaGRU / ParaLSTM also ``"newton_step"``,
``"triton_iterations"`` and ``"triton_skipped"`` (:mod:`paraprop.nn.para_solve`).
"""

from __future__ import annotations

import dataclasses

import torch

from paraprop.driver import Outcome, build
from paraprop.result import Result, Solution

__all__ = ["BackwardRun", "RunLog", "jacobi_run", "loop_run", "record_solve", "scan_record",
           "scan_run"]


class BackwardRun:
    """The backward pass of a module's last call (``module.last_backward``).

    Attributes:
        kind: the backward that ran: ``"scan"``, ``"jacobi"`` or ``"autograd"`` (torch's own;
            what ``backward="auto"`` chose is named here).
        layers: one :class:`~paraprop.Solution` per layer whose reverse recurrence ran (bottom
            layer first; none for ``"autograd"``, nor for a one-step sequence of ParaGRU /
            ParaLSTM, GRU and LSTM, which need no recurrence). For ``"scan"`` the ``method`` is
            the scan kernel that ran: ``"native"`` (the C kernel, CPU only), ``"triton"``
            (CUDA), ``"sequential"``, ``"chunked"``, ``"blelloch"``, ... (exact to rounding,
            ``converged``); for ``"jacobi"`` it is :func:`paraprop.scan.jacobi_recurrence`'s
            solution: its sweeps (``iterations``), ``stats["error_estimate"]`` and
            ``converged`` (``False`` when ``max_iters`` truncated it: then the gradients are
            truncated back-propagation, not the exact ones).
        compute_dtype: the dtype the gradients were computed in (float32 for a bfloat16 /
            float16 module), ``None`` for ``"autograd"``.

    Example:
        >>> rnn = paraprop.nn.RNN(2, 4, num_layers=2, backward="jacobi")
        >>> rnn(torch.randn(6, 3, 2))[0].sum().backward()
        >>> run = rnn.last_backward
        >>> run.kind, len(run.layers), run.converged, run.layers[0].method
        ('jacobi', 2, True, 'jacobi')
    """

    __slots__ = ("_layers", "compute_dtype", "kind")

    def __init__(self, kind: str, layers: tuple = (), compute_dtype: torch.dtype | None = None):
        self.kind = kind
        self.compute_dtype = compute_dtype
        # Solutions, or a scan's (method, value at the first step, steps), made one when read
        self._layers = tuple(layers)

    @property
    def layers(self) -> tuple[Solution, ...]:
        if any(not isinstance(s, Solution) for s in self._layers):
            self._layers = tuple(s if isinstance(s, Solution) else scan_run(*s)
                                 for s in self._layers)
        return self._layers

    def __repr__(self) -> str:
        return (f"BackwardRun(kind={self.kind!r}, layers={len(self._layers)}, "
                f"compute_dtype={self.compute_dtype})")

    @property
    def converged(self) -> bool:
        """Whether every layer's reverse recurrence converged (the exact gradients, to
        rounding)."""
        return all(s.converged for s in self.layers)


class RunLog:
    """Where a module's calls record what ran (read as ``last_forward`` / ``last_backward``):
    ``forward``, the list the layers of the latest forward append their Solutions to, and
    ``backward``, the latest :class:`BackwardRun`. A forward by a sequential loop records its
    final states only (:meth:`loops`); its Solutions are built when read (:meth:`solutions`),
    so that a small call pays no bookkeeping."""

    __slots__ = ("backward", "forward", "pending")

    def __init__(self) -> None:
        self.forward: list[Solution] = []
        self.backward: BackwardRun | None = None
        # (kernel, final states (layers, ..., n) per part, steps) of a loop forward
        self.pending: tuple[str, tuple[torch.Tensor, ...], int] | None = None

    def begin(self) -> list[Solution]:
        """A new call: a fresh forward list (returned, for the layers to fill) and no backward
        yet."""
        self.forward = []
        self.backward = None
        self.pending = None
        return self.forward

    def loops(self, kernel: str, finals: tuple[torch.Tensor, ...], steps: int) -> None:
        """The forward ran the sequential loop ``kernel`` over ``steps`` steps; ``finals`` the
        final states (one tensor per part, layers first), kept as a copy."""
        self.pending = (kernel, tuple(f.detach().clone() for f in finals), steps)

    def solutions(self) -> tuple[Solution, ...]:
        """The latest forward's Solutions, one per layer (a loop's built now: :func:`loop_run`
        of each layer's final state, its parts concatenated)."""
        if self.pending is not None:
            kernel, finals, steps = self.pending
            self.pending = None
            self.forward.extend(loop_run(kernel, torch.cat([p[k] for p in finals], -1), steps)
                                for k in range(finals[0].shape[0]))
        return tuple(self.forward)


def _last_point(value: torch.Tensor) -> torch.Tensor:
    """The solve's last position along its time dimension (``-2``), as a small copy."""
    return value.select(-2, -1).clone()


def record_solve(log: list[Solution], sol: Solution, *, tol: float, compute_dtype: torch.dtype,
                 **extras) -> None:
    """Append a layer's parallel solve to ``log``: ``sol`` with its last point as ``value``
    and the module's entries (``tol``, ``compute_dtype``, ``extras``) in its ``stats``."""
    stats = {**sol.stats, "tol": tol, "compute_dtype": compute_dtype, **extras}
    log.append(dataclasses.replace(sol, value=_last_point(sol.value), stats=stats))


def loop_run(kernel: str, final: torch.Tensor, steps: int) -> Solution:
    """The record of a layer computed by a sequential loop of ``steps`` steps (``kernel``:
    ``"native"`` or ``"torch"``), ``final`` its last state: the sequential result itself."""
    out = Outcome(final.detach().clone(), Result.successful, evaluations=steps,
                  positions=steps, sequential_steps=steps, bound=steps, error_estimate=0.0,
                  stats={"kernel": kernel, "compute_dtype": final.dtype})
    return build("sequential", out, iterations=steps)


def scan_record(method: str, value: torch.Tensor, steps: int) -> tuple[str, torch.Tensor, int]:
    """What a reverse recurrence of ``steps`` steps solved by one scan (``method``: the kernel
    that ran; ``value`` its solution ``(..., T, n)`` in time order) leaves for its record: a copy
    of its first step; :class:`BackwardRun` makes the :func:`scan_run` Solution when read."""
    return (method, value.select(-2, 0).clone(), steps)


def scan_run(method: str, first: torch.Tensor, steps: int) -> Solution:
    """The record of a reverse recurrence of ``steps`` steps solved by one scan (``method``:
    the kernel that ran), ``first`` its solution at the first step."""
    out = Outcome(first, Result.successful, evaluations=steps, positions=steps,
                  error_estimate=0.0)
    return build(method, out, iterations=1)


def jacobi_run(sol: Solution) -> Solution:
    """The record of a reverse recurrence solved by :func:`paraprop.scan.jacobi_recurrence`
    (``value`` its gradient at the first step)."""
    return dataclasses.replace(sol, value=sol.value.select(-2, 0).clone())
