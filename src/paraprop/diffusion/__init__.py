"""Exact parallel sampling of diffusion models (Picard iteration / ParaDiGMS, triangular Anderson
acceleration / ParaTAA) for diffusers' schedulers: DDPM, DDIM, the Markov readers' (Euler,
Euler ancestral, flow matching, LCM, first-order DPM-Solver++) and those whose steps read earlier
steps (DPM-Solver++ of order 2-3, UniPC, Heun), bit for bit at ``tol=0``.

- :func:`sample`: the scheduler's sampling loop solved as a triangular system over the steps;
  every method returns the sequential sample for the same noise (within ``tol``).
- :class:`DiffusionChain`: that system (the Picard map), for :func:`paraprop.solve`.
- :class:`GainCertificate`: the stopping rule that certifies its trajectory (bitwise, or within
  ``tol`` through the steps' observed gains).
- :func:`accelerate`: a diffusers pipeline's own loop (``pipe(...)``) through :func:`sample`,
  its output the plain pipeline's.
- :class:`Guided`: classifier-free guidance as the diffusers pipelines compute it, as one model.
- :func:`step_table`, :func:`draw_noise`: the scheduler's update rule read into per-step
  coefficients, and the noise drawn as the diffusers loop draws it.
- :mod:`~paraprop.diffusion.readers`, :mod:`~paraprop.diffusion.programs`: the other
  schedulers' update rules, and the Markov ones as step programs of the chain.

``diffusers`` is an optional dependency (``pip install paraprop[diffusion]``); this package does
not import it, it reads the scheduler object it is given.
"""

from paraprop.diffusion.accelerate import Accelerated, FallThroughWarning, accelerate
from paraprop.diffusion.certificate import BatchVarianceWarning, GainCertificate
from paraprop.diffusion.chain import DiffusionChain, draw_noise
from paraprop.diffusion.dit_guidance import DiTGuided
from paraprop.diffusion.guidance import Guided
from paraprop.diffusion.sample import METHODS, sample
from paraprop.diffusion.schedulers import StepTable, step_table

__all__ = ["METHODS", "Accelerated", "BatchVarianceWarning", "DiTGuided", "DiffusionChain",
           "FallThroughWarning", "GainCertificate", "Guided", "StepTable", "accelerate",
           "draw_noise", "sample", "step_table"]
