"""Exceptions raised by paraprop's solvers (re-exported by :mod:`paraprop`)."""


class NotTriangularError(ValueError):
    """``fn`` is not autoregressive: some position depends on itself or on a later one."""


class ConvergenceError(RuntimeError):
    """An iterative solver did not converge within ``max_iters``."""

    def __init__(self, message: str, solution=None):
        super().__init__(message)
        self.solution = solution  # the unconverged Solution, for inspection


class NonFiniteError(FloatingPointError):
    """``fn`` produced NaN or inf; the message names the iteration, sample and position."""
