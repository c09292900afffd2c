"""Solvers of nonlinear triangular systems: one small class per method, carrying its settings.

Pass a name (defaults apply) or a configured object as ``method`` to :func:`paraprop.solve`::

    paraprop.solve(fn, x0, method="jacobi")
    paraprop.solve(fn, x0, method=JacobiGS(block_size=4))
    paraprop.solve(rec, x0, method=ELK(damping=1e-3), dim=-2)

Each class has ``bound(system)`` (iterations that guarantee the exact result), ``init`` and
``step``; the one driver in :mod:`paraprop.solve` owns the loop, and the stopping rules live in
:mod:`paraprop.stopping`.
"""

from paraprop.solvers.anderson import TriangularAnderson
from paraprop.solvers.freezing import FreezeRule
from paraprop.solvers.gs_jacobi import GSJacobi
from paraprop.solvers.jacobi import Jacobi
from paraprop.solvers.jacobi_gs import JacobiGS
from paraprop.solvers.newton import ELK, Newton, QuasiELK, QuasiNewton
from paraprop.solvers.sequential import Sequential
from paraprop.solvers.sliding import SlidingJacobi

SOLVERS = {cls.name: cls for cls in (Sequential, Jacobi, JacobiGS, GSJacobi, SlidingJacobi,
                                     TriangularAnderson, Newton, QuasiNewton, ELK, QuasiELK)}
METHODS = tuple(SOLVERS)
NEWTON_METHODS = ("newton", "quasi_newton", "elk", "quasi_elk")


def is_solver(obj) -> bool:
    """Whether ``obj`` follows the solver protocol (``name``, ``bound``, ``init``, ``step``).

    Example:
        >>> is_solver(Jacobi()), is_solver(Jacobi), is_solver("jacobi")
        (True, False, False)
    """
    return not isinstance(obj, type) and isinstance(getattr(obj, "name", None), str) and \
        all(callable(getattr(obj, a, None)) for a in ("bound", "init", "step"))


def make_solver(method, *, argument: str = "method", names=METHODS):
    """The solver object for ``method``: a name from ``names`` (defaults apply) or an object
    following the solver protocol (returned as is).

    Example:
        >>> make_solver("jacobi_gs")
        JacobiGS(block_size=None)
        >>> make_solver(ELK(damping=1e-3), names=NEWTON_METHODS)
        ELK(damping=0.001)
        >>> make_solver("newton", names=("jacobi",))
        Traceback (most recent call last):
        ValueError: unknown method='newton'; choose one of jacobi, or pass a solver object ...
    """
    if isinstance(method, str):
        if method not in names:
            raise ValueError(f"unknown {argument}={method!r}; choose one of {', '.join(names)}, "
                             "or pass a solver object from paraprop.solvers")
        return SOLVERS[method]()
    if isinstance(method, type):
        raise TypeError(f"{argument} must be a method name or a solver object, got the class "
                        f"{method.__name__}; pass an instance, e.g. {method.__name__}()")
    if is_solver(method):
        if method.name not in names:
            raise ValueError(f"{argument}={method!r} is not supported here; choose one of "
                             f"{', '.join(names)}")
        return method
    raise TypeError(f"{argument} must be a method name or a solver object from paraprop.solvers,"
                    f" got {type(method).__name__}")


__all__ = ["ELK", "METHODS", "NEWTON_METHODS", "SOLVERS", "FreezeRule", "GSJacobi", "Jacobi",
           "JacobiGS",
           "Newton", "QuasiELK", "QuasiNewton", "Sequential", "SlidingJacobi",
           "TriangularAnderson", "is_solver", "make_solver"]
