"""``paraprop.flows``: the flow-library adapters under their own name (see
:mod:`paraprop.sampling.flows`).

:func:`parallel_inverse` takes a zuko or nflows transform, or the flow itself (a zuko ``Flow`` is
inverted as ``flow(context).transform``), and validates ``y`` and ``context`` (dtype, device,
shape) against the transform before the first pass.
"""

from paraprop.sampling.flows import parallel_inverse

__all__ = ["parallel_inverse"]
