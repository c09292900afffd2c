"""Optimizer fusion (Jiang et al. 2021): the optimizer step fused into the forward or backward
pass, bucket by bucket, with bitwise the unfused result.

>>> model = torch.nn.Linear(4, 2)
>>> opt = paraprop.optim.fuse(torch.optim.AdamW(model.parameters()), model, mode="forward")

See :func:`fuse`, :class:`FusedOptimizer` and ``docs/optim.md``.
"""

from paraprop.optim.errors import FusionError
from paraprop.optim.fused import MODES, FusedOptimizer, fuse

__all__ = ["MODES", "FusedOptimizer", "FusionError", "fuse"]
