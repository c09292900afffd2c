"""Exceptions raised by paraprop's solvers (re-exported by :mod:`paraprop`)."""


class NotTriangularError(ValueError):
    """``fn`` is not autoregressive: some position depends on itself or on a later one.

    Example:
        >>> W = torch.randn(6, 6)                     # full, not lower triangular
        >>> paraprop.solve(lambda x: torch.tanh(x @ W.T + 1), torch.zeros(6), method="jacobi")
        Traceback (most recent call last):
        paraprop.errors.NotTriangularError: fn is not autoregressive along dim: ...
    """


class ConvergenceError(RuntimeError):
    """An iterative solver did not converge within ``max_iters``; ``solution`` holds the
    unconverged :class:`~paraprop.Solution` (``throw=False`` returns it instead).

    Example:
        >>> W = torch.randn(6, 6).tril(-1)
        >>> fn = lambda x: torch.tanh(x @ W.T + 1)
        >>> try:
        ...     paraprop.solve(fn, torch.zeros(6), method="jacobi", max_iters=2)
        ... except paraprop.ConvergenceError as e:
        ...     print(e.solution.result)
        Result.max_iters_reached
    """

    def __init__(self, message: str, solution=None):
        super().__init__(message)
        self.solution = solution  # the unconverged Solution, for inspection


class NonFiniteError(FloatingPointError):
    """``fn`` produced NaN or inf; the message names the iteration, sample and position.

    Example:
        >>> fn = lambda x: torch.cat([x[:1] * 0 + 1, x[:-1].log()])   # 1, log 1 = 0, log 0
        >>> paraprop.solve(fn, torch.zeros(3), method="jacobi")
        Traceback (most recent call last):
        paraprop.errors.NonFiniteError: fn produced a non-finite value at iteration 3, ... (2,) ...
    """


class StochasticModelError(ValueError):
    """A user's module is not a fixed function of its input (train mode with dropout, or a
    norm layer reading batch statistics): there is no sequential result to reproduce. The
    message names the layer and the fix (``model.eval()``).

    Example:
        >>> from paraprop.determinism import require_deterministic
        >>> model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))   # train mode
        >>> require_deterministic(model)
        Traceback (most recent call last):
        paraprop.errors.StochasticModelError: paraprop: model is in train mode, ...
        >>> require_deterministic(model.eval())                         # fine
    """


class PeerError(RuntimeError):
    """Another rank of a multi-rank solve failed, did not answer in time, or its connection
    broke (it died or hangs): the one exception for a peer's failure, with threads
    (:func:`paraprop.multigrid.threads.run_threads`, where the failing rank's own error is the
    one re-raised) and with ``torch.distributed`` (:mod:`paraprop.distributed`).

    Example:
        >>> from paraprop.multigrid.threads import run_threads
        >>> seen = []
        >>> def work(rank, link):          # rank 0 waits for a tensor that rank 1 never sends
        ...     if rank == 1:
        ...         raise ValueError("rank 1 broke")
        ...     try:
        ...         link.recv(torch.zeros(2), src=1, tag=0)
        ...     except paraprop.PeerError:
        ...         seen.append("rank 0: PeerError")
        ...         raise
        >>> run_threads(2, work)            # re-raises the failing rank's own error
        Traceback (most recent call last):
        ValueError: rank 1 broke
        >>> seen
        ['rank 0: PeerError']
    """


class ProtocolError(ValueError):
    """A map broke a promise of an optional hook it implements (``window``, ``update``,
    ``propose``, ...): the message names the hook and what it did.

    Example:
        >>> class InPlace:
        ...     def __call__(self, x):
        ...         return torch.cat([x[:1] * 0 + 1, x[:-1] / 2])
        ...     def update(self, x, index):     # the optional hook of JacobiGS
        ...         x.add_(1)                   # breaks its promise: writes into the iterate
        ...         return self(x)[index]
        >>> paraprop.solve(InPlace(), torch.zeros(4), method="jacobi_gs")
        Traceback (most recent call last):
        paraprop.errors.ProtocolError: fn.update(x, index) modified its input x in place ...
    """


class FallThroughWarning(UserWarning):
    """An accelerated library call (:func:`paraprop.decoding.accelerate`,
    :func:`paraprop.diffusion.accelerate`) ran the library's own code: paraprop does not
    implement, or could not certify, a setting of that call. The result is the library's.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():   # to insist on paraprop's path: make it an error
        ...     warnings.simplefilter("error", paraprop.FallThroughWarning)
    """
