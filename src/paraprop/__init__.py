"""paraprop: the sequential parts of neural-network computation, solved in parallel, with the
sequential result.

The two cores are :func:`paraprop.solve` (nonlinear triangular systems, with the solver objects
of :mod:`paraprop.solvers`) and :mod:`paraprop.scan` / :mod:`paraprop.linalg` (linear ones).
Every documented subpackage is reachable as an attribute after ``import paraprop`` (imported on
first use, so that ``import paraprop`` stays light).
"""

from __future__ import annotations

import importlib
import importlib.metadata

from paraprop import solvers
from paraprop.errors import (
    ConvergenceError,
    FallThroughWarning,
    NonFiniteError,
    NotTriangularError,
    PeerError,
    ProtocolError,
    StochasticModelError,
)
from paraprop.recurrence import Recurrence
from paraprop.result import Result, Solution
from paraprop.solve import solve

try:  # one source: pyproject.toml's [project] version, as installed
    __version__ = importlib.metadata.version("paraprop")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# documented subpackages and modules, imported on first attribute access
# (the lab, ``paraprop_lab``: bench, demos, experiments, training and the CLI, is a package of
# its own that the library never imports)
SUBPACKAGES = ("data", "decoding", "diffusion", "distributed", "flows", "jacobians", "linalg",
               "models", "multigrid", "networks", "nn", "optim", "result", "sampling", "scan",
               "solvers")


def __getattr__(name: str):
    if name in SUBPACKAGES:
        module = importlib.import_module(f"paraprop.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'paraprop' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *SUBPACKAGES})


__all__ = [
    "ConvergenceError",
    "FallThroughWarning",
    "NonFiniteError",
    "NotTriangularError",
    "PeerError",
    "ProtocolError",
    "Recurrence",
    "Result",
    "Solution",
    "StochasticModelError",
    "__version__",
    "solve",
    "solvers",
]
