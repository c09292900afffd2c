"""Drop-in recurrent modules whose backward pass is a scan (BPPSA) or Jacobi sweeps.

:class:`RNN` and :class:`GRU` take the constructor arguments and state dicts of
:class:`torch.nn.RNN` and :class:`torch.nn.GRU` and return the same outputs; with
``backward="scan"`` the gradients of all hidden states come from one
:func:`paraprop.scan.linear_recurrence` per layer over the analytic transposed Jacobians, and
all weight gradients from batched contractions.
"""

from paraprop.nn._base import BACKWARDS
from paraprop.nn.gru import GRU
from paraprop.nn.rnn import RNN

__all__ = ["BACKWARDS", "GRU", "RNN"]
