"""Scans and linear recurrences: back-propagation as a parallel scan (BPPSA).

- :func:`linear_recurrence`: all states of ``h_t = A_t h_{t-1} + b_t`` (dense, diagonal,
  :class:`Factored` or :class:`LSTMFactored` ``A``), forward or reverse, differentiable; the
  methods of :data:`METHODS` (``auto``, ``sequential``, ``native``, ``blelloch``,
  ``hillis_steele``, ``chunked``, ``triton``).
- :func:`associative_scan`: prefix combinations under any associative operator, including the
  modified Blelloch scan of BPPSA (operands reversed in the down-sweep, level cap).
- :func:`jacobi_recurrence`: the same recurrence by Jacobi sweeps (Song et al. 2021, §5.1).
- :func:`ragged_scan`: Blelloch's scan over a list of elements that cannot be stacked (sparse
  and dense matrices of different shapes: BPPSA over a chain of layers), with a per-step record.
- :mod:`paraprop.scan.native`: the C kernels of ``method="native"`` (the CPU);
  :mod:`paraprop.scan.triton_kernels`: those of ``method="triton"`` (the GPU).
"""

from paraprop.scan.associative import associative_scan
from paraprop.scan.jacobi import jacobi_recurrence
from paraprop.scan.linear import METHODS, linear_recurrence
from paraprop.scan.ragged import ragged_scan
from paraprop.scan.transitions import Factored, LSTMFactored

__all__ = [
    "METHODS",
    "Factored",
    "LSTMFactored",
    "associative_scan",
    "jacobi_recurrence",
    "linear_recurrence",
    "ragged_scan",
]
