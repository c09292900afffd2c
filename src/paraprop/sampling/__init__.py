"""Autoregressive sampling on top of :func:`paraprop.solve` (the flow libraries' inverses are in
:mod:`paraprop.flows`)."""

from paraprop.sampling.autoregressive import SAMPLING_METHODS, sample

__all__ = ["SAMPLING_METHODS", "sample"]
