"""Layer-parallel residual networks across processes with ``torch.distributed``.

- :class:`LayerParallelStack`: each rank owns a contiguous range of layers; forward and backward
  are MGRIT solves whose ranks exchange only boundary values (gloo on CPU, nccl on GPU).
- :func:`partitioned_forward`: the model-partitioned baseline (activations passed on serially).
- :class:`DistLink`, :class:`PeerError`: point-to-point exchange with timeouts: with gloo, a
  dead or hung rank makes the others raise, never hang (not guaranteed or tested with nccl).
- :func:`init_from_env` (under ``torchrun``) and :func:`spawn` (local processes, for tests and
  benchmarks).

Run the benchmark worker with ``torchrun --nproc_per_node=2 -m paraprop.distributed --help``.
"""

from paraprop.distributed.comm import DEFAULT_TIMEOUT_S, DistLink, PeerError, init_from_env
from paraprop.distributed.launch import SpawnError, spawn
from paraprop.distributed.layer_parallel import (
    LayerParallelStack,
    layer_range,
    partitioned_forward,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistLink",
    "LayerParallelStack",
    "PeerError",
    "SpawnError",
    "init_from_env",
    "layer_range",
    "partitioned_forward",
    "spawn",
]
