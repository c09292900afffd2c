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


class PeerError(RuntimeError):
    """Another rank of a multi-rank solve failed, did not answer in time, or its connection
    broke (it died or hangs): the one exception for a peer's failure, with threads
    (:func:`paraprop.multigrid.threads.run_threads`, where the failing rank's own error is the
    one re-raised) and with ``torch.distributed`` (:mod:`paraprop.distributed`)."""


class ProtocolError(ValueError):
    """A map broke a promise of an optional hook it implements (``window``, ``update``,
    ``propose``, ...): the message names the hook and what it did."""
