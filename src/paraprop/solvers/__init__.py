"""Solvers of nonlinear triangular systems, one small class per method.

Each class has ``bound(system)`` (iterations that guarantee the exact result), ``init`` and
``step``; the shared driver in :mod:`paraprop.solve` owns the loop.
"""

from paraprop.solvers.gs_jacobi import GSJacobi
from paraprop.solvers.jacobi import Jacobi
from paraprop.solvers.jacobi_gs import JacobiGS
from paraprop.solvers.sequential import Sequential

METHODS = ("sequential", "jacobi", "jacobi_gs", "gs_jacobi")


def make_solver(method: str, block_size: int | None = None):
    """The solver object for ``method`` (arguments already validated by ``solve``)."""
    if method == "sequential":
        return Sequential()
    if method == "jacobi":
        return Jacobi()
    if method == "jacobi_gs":
        return JacobiGS(block_size)
    return GSJacobi(block_size)


__all__ = ["METHODS", "GSJacobi", "Jacobi", "JacobiGS", "Sequential", "make_solver"]
