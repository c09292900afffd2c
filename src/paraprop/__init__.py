"""paraprop: the sequential parts of neural-network computation, solved in parallel, with the
sequential result."""

from paraprop.errors import ConvergenceError, NonFiniteError, NotTriangularError
from paraprop.recurrence import Recurrence
from paraprop.solve import Solution, solve

__version__ = "0.1.0"

__all__ = [
    "ConvergenceError",
    "NonFiniteError",
    "NotTriangularError",
    "Recurrence",
    "Solution",
    "__version__",
    "solve",
]
