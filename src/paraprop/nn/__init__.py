"""Drop-in recurrent modules whose backward pass is a scan (BPPSA) or Jacobi sweeps, and whose
forward pass may run in parallel over time (Newton / DEER and the other solvers).

:class:`RNN`, :class:`GRU` and :class:`LSTM` take the constructor arguments and state dicts
of :class:`torch.nn.RNN`, :class:`torch.nn.GRU` and :class:`torch.nn.LSTM` and return the same
outputs. Two extra keyword arguments, each a name or a configuration object of
:mod:`paraprop.nn.options`:

- ``forward``: ``"auto"`` (the default: the fastest measured loop, paraprop's native one on
  the CPU), ``"sequential"`` (torch's kernel, bitwise), ``"native"``, a method of
  :func:`paraprop.solve` such as ``"newton"``, a solver object, or
  :class:`ParallelForward` ``(method=..., tol=..., max_iters=..., throw=...)``;
- ``backward``: ``"auto"`` (:class:`paraprop.nn.options.AutoBackward`, the default: the
  fastest measured exact training step, :func:`paraprop.nn.options.resolve`: torch's own LSTM
  and autograd on the CPU, the scan otherwise), ``"scan"`` (:class:`ScanBackward`: the
  gradients of all hidden states from one :func:`paraprop.scan.linear_recurrence` per layer,
  all weight gradients from batched contractions), ``"jacobi"`` (:class:`JacobiBackward`) or
  ``"autograd"`` (:class:`AutogradBackward`).

:class:`ParaGRU` and :class:`ParaLSTM` are ParaRNN's diagonal-recurrence cells (Danieli et al.
2026): Newton forward by default (exact per iteration, ``O(T H)``), scan backward.

After each call a module says what ran: ``last_forward``, one :class:`paraprop.Solution` per
layer, and ``last_backward``, a :class:`BackwardRun` (:mod:`paraprop.nn.runs`).
"""

from paraprop.nn.gru import GRU
from paraprop.nn.lstm import LSTM
from paraprop.nn.options import (
    BACKWARDS,
    FORWARD_TOL,
    FORWARDS,
    AutogradBackward,
    JacobiBackward,
    ParallelForward,
    ScanBackward,
    SequentialForward,
)
from paraprop.nn.para import ParaGRU, ParaLSTM
from paraprop.nn.rnn import RNN
from paraprop.nn.runs import BackwardRun

__all__ = ["BACKWARDS", "FORWARDS", "FORWARD_TOL", "GRU", "LSTM", "RNN", "AutogradBackward",
           "BackwardRun", "JacobiBackward", "ParaGRU", "ParaLSTM", "ParallelForward",
           "ScanBackward", "SequentialForward"]
