"""Forward and backward propagation as block bi-diagonal triangular systems (Naumov 2017).

- :class:`BlockBidiagonal`: a lower (forward) or upper (backward) block bi-diagonal system whose
  diagonal blocks are diagonal scalings (or nested systems, for RNNs) and whose off-diagonal
  blocks are weight matrices or linear operators; per-sample scalings are shifted systems.
- :func:`solve`: ``substitution`` | ``cyclic_reduction`` | ``jacobi`` | ``bicgstab``, returning a
  :class:`paraprop.Solution` with levels, flops and memory in ``stats``.
- :func:`from_mlp`, :func:`mlp_forward`, :func:`mlp_backward`: an ``nn.Sequential`` MLP's forward
  and backward propagation as those systems; :func:`from_rnn`, :func:`rnn_backward`: the nested
  system of a stacked ``nn.RNN``.
"""

from paraprop.linalg.entry import METHODS, solve
from paraprop.linalg.mlp import mlp_backward, mlp_forward
from paraprop.linalg.mlp_layers import ActivationPoints, activation_points
from paraprop.linalg.mlp_systems import MLPSystems, from_mlp
from paraprop.linalg.operators import BlockDiagonalOperator, LinearOperator, MatrixOperator
from paraprop.linalg.rnn import RNNSystems, from_rnn, rnn_backward
from paraprop.linalg.system import BlockBidiagonal

__all__ = [
    "METHODS",
    "ActivationPoints",
    "BlockBidiagonal",
    "BlockDiagonalOperator",
    "LinearOperator",
    "MLPSystems",
    "MatrixOperator",
    "RNNSystems",
    "activation_points",
    "from_mlp",
    "from_rnn",
    "mlp_backward",
    "mlp_forward",
    "rnn_backward",
    "solve",
]
