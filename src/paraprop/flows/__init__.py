"""Flow libraries (zuko, nflows, normflows): their autoregressive inverses by early-stopping
parallel passes, bitwise their own result.

- :func:`parallel_inverse`: invert a transform or flow at given points, with a
  :class:`paraprop.Solution` (``inverse.py``; one adapter per library in ``zuko_parts.py``,
  ``nflows_parts.py``, ``normflows_parts.py``; the shared solve and its gradient in
  ``core.py``).
- :func:`accelerate`: make the library's own ``sample`` / ``rsample`` / ``inverse`` /
  ``log_prob`` use it, on one flow instance, until ``undo()`` (``accelerate.py``).
- The inverse of one block of paraprop's own :class:`paraprop.models.TarFlow` as a triangular
  system with the cached-prefix protocol (``tarflow_inverse.py``: ``BlockInverse``, what
  ``TarFlow.sampling_map`` returns).

The libraries are imported only when a flow of theirs is used.
"""

from paraprop.flows.accelerate import Accelerated, accelerate
from paraprop.flows.inverse import parallel_inverse

__all__ = ["Accelerated", "accelerate", "parallel_inverse"]
