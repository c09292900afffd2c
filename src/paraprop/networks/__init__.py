"""Network inference as a recurrence over layers (Song et al. 2021, §5.2).

- :func:`as_recurrence`: a network (``nn.Sequential``, torchvision DenseNet or ResNet) as a
  triangular system whose states are layer outputs.
- :func:`evaluate`: the network's output by any :func:`paraprop.solve` method, with the error
  against sequential evaluation after every iteration.
- :func:`jacobi_gs_blocks` / :func:`balanced_blocks`: Jacobi-GS over any partition of the
  states, e.g. blocks of equal time.
- :mod:`~paraprop.networks.timing`: per-state times and the parallel-time estimate (the paper's
  simulation); the real thing is ``JacobiGS(blocks=..., workers=...)``, which runs each
  iteration's blocks on threads.
"""

from paraprop.networks.convert import UnsupportedModuleError, as_recurrence, register_converter
from paraprop.networks.evaluate import METRICS, evaluate, max_abs, top5_changes
from paraprop.networks.layer_system import LayerRecurrence, LayerSystem, Step
from paraprop.networks.partition import balanced_blocks, jacobi_gs_blocks
from paraprop.networks.timing import estimate_time, partition_time, profile

__all__ = [
    "METRICS",
    "LayerSystem",
    "LayerRecurrence",
    "Step",
    "UnsupportedModuleError",
    "as_recurrence",
    "balanced_blocks",
    "estimate_time",
    "evaluate",
    "jacobi_gs_blocks",
    "max_abs",
    "partition_time",
    "profile",
    "register_converter",
    "top5_changes",
]
