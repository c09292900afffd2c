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


class StochasticModelError(ValueError):
    """A user's module is not a fixed function of its input (train mode with dropout, or a
    norm layer reading batch statistics): there is no sequential result to reproduce. The
    message names the layer and the fix (``model.eval()``)."""


class ProtocolError(ValueError):
    """A map broke a promise of an optional hook it implements (``window``, ``update``,
    ``propose``, ...): the message names the hook and what it did."""
