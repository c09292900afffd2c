"""Autoregressive sampling on top of :func:`paraprop.solve`; flow-library inverses."""

from paraprop.sampling.autoregressive import SAMPLING_METHODS, sample
from paraprop.sampling.flows import parallel_inverse

__all__ = ["SAMPLING_METHODS", "parallel_inverse", "sample"]
