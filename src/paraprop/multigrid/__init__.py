"""Layer-parallel residual networks by nonlinear multigrid (FAS/MGRIT; Kirby et al. 2020).

- :func:`mgrit`: the FAS/MGRIT V-cycle solver over a residual stack's depth (any number of
  levels, F or FCF relaxation, warm start); it stops on an estimate of the error against the
  serial states (``tol``) or at its exactness bound and returns a :class:`paraprop.Solution`.
- :class:`ParallelResidualStack`: an ``nn.Module`` whose forward pass is an MGRIT solve and
  whose backward pass is MGRIT on the adjoint system (or exact serial back-propagation).
- :class:`ForwardStepper` / :class:`AdjointStepper`: batched evaluation of many layers at once
  (``torch.func.vmap`` over stacked parameters).
- :func:`simulate`: a cost model of MGRIT and model partitioning on ``W`` workers.

Layer-parallel execution across processes lives in :mod:`paraprop.distributed`.
"""

from paraprop.multigrid.common import DEFAULT_TOL, UncheckedResultWarning
from paraprop.multigrid.cost import CostModel, simulate
from paraprop.multigrid.hierarchy import Hierarchy, split_layers
from paraprop.multigrid.mgrit import RELAX, mgrit, residual_norm
from paraprop.multigrid.module import ParallelResidualStack
from paraprop.multigrid.steps import AdjointStepper, ForwardStepper, shares_architecture

__all__ = [
    "DEFAULT_TOL",
    "RELAX",
    "AdjointStepper",
    "CostModel",
    "ForwardStepper",
    "Hierarchy",
    "ParallelResidualStack",
    "UncheckedResultWarning",
    "mgrit",
    "residual_norm",
    "shares_architecture",
    "simulate",
    "split_layers",
]
