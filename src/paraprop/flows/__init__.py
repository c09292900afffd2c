"""Flow libraries (zuko, nflows, normflows): their autoregressive inverses by early-stopping
parallel passes, bitwise their own result.

- :func:`parallel_inverse`: invert a transform or flow at given points, with a
  :class:`paraprop.Solution`; one adapter per library (:mod:`paraprop.flows.zuko_parts`,
  :mod:`paraprop.flows.nflows_parts`, :mod:`paraprop.flows.normflows_parts`). Shared by the
  three: the solve of one autoregressive part (:mod:`paraprop.flows.part_solve`), the feature
  order it solves in (:mod:`paraprop.flows.order`), the passes that prove which features are
  exact (:mod:`paraprop.flows.passes`), the implicit gradient (:mod:`paraprop.flows.gradient`),
  nflows' and normflows' masked-MADE transforms (:mod:`paraprop.flows.made`), the argument
  checks (:mod:`paraprop.flows.arguments`).
- :func:`accelerate`: make the library's own ``sample`` / ``rsample`` / ``inverse`` /
  ``log_prob`` use it, on one flow instance, until ``undo()`` (the patches on instances:
  :mod:`paraprop.flows.patches`).
- paraprop's own :class:`paraprop.models.TarFlow`: the inverse of one block as a triangular
  system with the cached-prefix protocol, or by the KV-cached loop
  (:mod:`paraprop.flows.tarflow_inverse`: ``BlockInverse``, what ``TarFlow.sampling_map``
  returns), and the inverse of the stack of blocks with its per-block plan
  (:mod:`paraprop.flows.tarflow_sampling`).

The libraries are imported only when a flow of theirs is used.
"""

from paraprop.flows.accelerate import Accelerated, accelerate
from paraprop.flows.inverse import parallel_inverse

__all__ = ["Accelerated", "accelerate", "parallel_inverse"]
