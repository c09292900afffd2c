"""Solvers of nonlinear triangular systems, one small class per method.

Each class has ``bound(system)`` (iterations that guarantee the exact result), ``init`` and
``step``; the shared driver in :mod:`paraprop.solve` owns the loop.
"""

from paraprop.solvers.gs_jacobi import GSJacobi
from paraprop.solvers.jacobi import Jacobi
from paraprop.solvers.jacobi_gs import JacobiGS
from paraprop.solvers.newton import Newton
from paraprop.solvers.sequential import Sequential

NEWTON_METHODS = ("newton", "quasi_newton", "elk", "quasi_elk")
METHODS = ("sequential", "jacobi", "jacobi_gs", "gs_jacobi", *NEWTON_METHODS)


def make_solver(method: str, block_size: int | None = None, damping: float | None = None):
    """The solver object for ``method`` (arguments already validated by ``solve``)."""
    if method in NEWTON_METHODS:
        return Newton(method, damping)
    if method == "sequential":
        return Sequential()
    if method == "jacobi":
        return Jacobi()
    if method == "jacobi_gs":
        return JacobiGS(block_size)
    return GSJacobi(block_size)


__all__ = ["METHODS", "NEWTON_METHODS", "GSJacobi", "Jacobi", "JacobiGS", "Newton", "Sequential",
           "make_solver"]
