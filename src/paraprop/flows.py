"""``paraprop.flows``: the flow-library adapters under their own name (see
:mod:`paraprop.sampling.flows`)."""

from paraprop.sampling.flows import parallel_inverse

__all__ = ["parallel_inverse"]
