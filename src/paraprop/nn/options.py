"""How :class:`paraprop.nn.RNN` / :class:`paraprop.nn.GRU` run: the ``forward=`` and
``backward=`` options.

Each option is a name (the defaults of its class apply) or a configuration object:

=====================  ======================================================================
``forward=``           meaning
=====================  ======================================================================
``"sequential"``       :class:`SequentialForward`: torch's fused kernel, ``T`` dependent steps
``"native"``           ``SequentialForward(kernel="native")``: paraprop's native (C) loop
``"auto"``             ``SequentialForward(kernel="auto")``: the fastest measured forward here
``"newton"``, ...      ``ParallelForward(method=name)``: any method of :func:`paraprop.solve`
a solver object        ``ParallelForward(method=obj)``, e.g. ``ELK(damping=1e-3)``
``ParallelForward``    the method with its ``tol``, ``max_iters`` and ``throw``
=====================  ======================================================================

=====================  ======================================================================
``backward=``          meaning
=====================  ======================================================================
``"scan"``             :class:`ScanBackward`: one :func:`paraprop.scan.linear_recurrence` per
                       layer (BPPSA)
``"jacobi"``           :class:`JacobiBackward`: the same recurrence by Jacobi sweeps
``"autograd"``         :class:`AutogradBackward`: torch's own backward (the torch module)
``"auto"``             :class:`AutoBackward` (the default): the fastest measured exact pair,
                       :func:`resolve` (torch's kernel with ``"autograd"``, or ``"scan"``)
=====================  ======================================================================

:func:`forward_option` and :func:`backward_option` turn what the user passed into one of these
objects, raising ``ValueError`` / ``TypeError`` that name the argument, what it accepts and what
it got.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paraprop.solvers import METHODS, is_solver, make_solver

__all__ = ["FORWARD_TOL", "FORWARDS", "BACKWARDS", "KERNELS", "TORCH_FASTEST", "AutoBackward",
           "AutogradBackward", "JacobiBackward", "ParallelForward", "ScanBackward",
           "SequentialForward", "backward_option", "check_pair", "default_forward_tol",
           "describe", "forward_option", "resolve"]

# The default stopping tolerance of a parallel forward, per dtype: the solver stops a sample once
# its estimated distance to the sequential result is below this (max norm over the sample).
# Chosen from measurements against torch.nn.RNN / GRU (docs/recurrences.md, "Accuracy"):
# float32 Newton steps stop shrinking at about 1e-6 .. 2e-6 (their rounding floor) on long
# sequences of long-memory cells, so a float32 default near it would run such solves to their
# exactness bound (``T`` iterations); 1e-5 keeps a factor 5 above it, and torch's own float32
# kernel is 1e-6 .. 6e-6 from the float64 result on those cells. float64 has room for a
# tolerance far below anything float32 can resolve.
FORWARD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def default_forward_tol(dtype: torch.dtype) -> float:
    """The default ``tol`` of :class:`ParallelForward` for states of ``dtype``."""
    if dtype not in FORWARD_TOL:
        raise ValueError(f"ParallelForward has no default tol for {dtype} states (measured: "
                         f"{', '.join(map(str, FORWARD_TOL))}); pass ParallelForward(tol=...)")
    return FORWARD_TOL[dtype]


KERNELS = ("torch", "native", "auto")


def check_choice(owner: str, field: str, value, choices, hint: str = "") -> None:
    """Refuse ``owner``'s ``field`` unless ``value`` is one of the names ``choices``: a
    ``ValueError`` naming the owner, the field, the value and the choices (then ``hint``)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}: unknown {field}={value!r}; choose one of "
                         f"{', '.join(choices)}{hint}")


@dataclass(frozen=True)
class SequentialForward:
    """The ``T`` dependent steps one after another.

    Arguments:
        kernel: which loop runs them:

            - ``"torch"`` (``forward="sequential"``, the default): torch's own fused kernel,
              bitwise the outputs of :class:`torch.nn.RNN` / ``GRU`` / ``LSTM``.
            - ``"native"`` (``forward="native"``): paraprop's native C loop
              (:mod:`paraprop.scan.native`): the input projections of all steps in one matrix
              product, then the recurrence in one call per layer, batch rows split across
              threads, writing what the scan backward needs as it goes. Equal to torch's
              outputs within rounding (float32: a few units in the last place per step; its
              ``tanh``/``sigmoid`` are within 3 ulp). Where it cannot run (not on the CPU, not
              float32/float64, no C compiler, ``PARAPROP_NATIVE=0``, under :mod:`torch.func`)
              torch's kernel runs instead; ``last_forward`` says which ran (``"kernel"``).
            - ``"auto"`` (``forward="auto"``, the modules' default): the forward measured
              fastest for the device: the native loop on the CPU (it beat torch's kernel and
              every parallel solver at every size measured on a 2-core CPU,
              docs/recurrences.md), torch's fused kernel elsewhere (no measurement on other
              devices decides otherwise yet), and torch's kernel wherever the backward is
              torch's autograd (``backward="auto"`` may choose it, :func:`resolve`).
    """

    kernel: str = "torch"

    def __post_init__(self):
        check_choice("SequentialForward", "kernel", self.kernel, KERNELS)


@dataclass(frozen=True)
class ParallelForward:
    """Each layer's states by :func:`paraprop.solve` on its :class:`paraprop.Recurrence`,
    parallel over time.

    Arguments:
        method: a method name of :func:`paraprop.solve` other than ``"sequential"``
            (``"newton"`` (DEER), ``"quasi_newton"``, ``"elk"``, ``"quasi_elk"``, ``"jacobi"``,
            ``"jacobi_gs"``, ``"gs_jacobi"``, ``"sliding_jacobi"``) or a solver object from
            :mod:`paraprop.solvers` (e.g. ``ELK(damping=1e-3)``). Default ``"newton"``.
        tol: the solver stops a sample when its estimated distance to the sequential result is
            ``<= tol`` (max norm over the sample; see :func:`paraprop.solve`). ``None`` (the
            default): :data:`FORWARD_TOL` of the input's dtype (``1e-10`` for float64,
            ``1e-5`` for float32), chosen so that the outputs match torch's within the bound
            stated in docs/recurrences.md; other dtypes need an explicit ``tol``.
        max_iters: at most this many iterations per layer; ``None``: the method's exactness
            bound (``T``), where every method returns the sequential result.
        throw: with ``max_iters`` reached before convergence, raise
            :class:`paraprop.ConvergenceError` (``True``, the default) or return the unconverged
            states (``False``; the layers' ``last_forward`` Solutions then say so).

    Attributes:
        solver: the solver object ``method`` names.
    """

    method: object = "newton"
    tol: float | None = None
    max_iters: int | None = None
    throw: bool = True
    solver: object = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        from paraprop.solve import check_max_iters, check_tol
        if self.method in SEQUENTIAL_NAMES or getattr(self.method, "name", None) == "sequential":
            raise ValueError(f"ParallelForward: method={self.method!r} is a sequential loop; "
                             f"pass forward={self.method!r} to the module instead")
        if isinstance(self.method, str):
            check_choice("ParallelForward", "method", self.method, PARALLEL_FORWARDS,
                         ", or a solver object from paraprop.solvers")
        solver = make_solver(self.method, argument="ParallelForward: method",
                             names=PARALLEL_FORWARDS)
        object.__setattr__(self, "solver", solver)
        if self.tol is not None:
            check_tol(self.tol, "ParallelForward: tol")
        check_max_iters(self.max_iters, "ParallelForward: max_iters")
        if not isinstance(self.throw, bool):
            raise TypeError(f"ParallelForward: throw must be a bool, got {self.throw!r}")

    def tol_for(self, dtype: torch.dtype) -> float:
        """The stopping tolerance for states of ``dtype`` (``tol`` or the dtype's default)."""
        return default_forward_tol(dtype) if self.tol is None else float(self.tol)


@dataclass(frozen=True)
class ScanBackward:
    """The hidden-state gradients of all steps by one :func:`paraprop.scan.linear_recurrence`
    per layer over the analytic transposed Jacobians (BPPSA), then every weight gradient in
    batched contractions. Exact (to rounding).

    Arguments:
        method: the ``method`` of :func:`paraprop.scan.linear_recurrence`, one of
            :data:`paraprop.scan.METHODS` (``"auto"``, ``"sequential"``, ``"native"``,
            ``"blelloch"``, ``"hillis_steele"``, ``"chunked"``, ``"triton"``).
    """

    method: str = "auto"

    def __post_init__(self):
        from paraprop.scan import METHODS

        check_choice("ScanBackward", "method", self.method, METHODS)


@dataclass(frozen=True)
class JacobiBackward:
    """The same reverse recurrence as :class:`ScanBackward` by Jacobi sweeps
    (:func:`paraprop.scan.jacobi_recurrence`; Song et al. 2021, section 5.1).

    Exact after ``T`` sweeps. Stopped earlier by ``max_iters`` it is truncated back-propagation
    through time (the gradients reach ``max_iters`` steps back), a deliberate approximation;
    ``last_backward`` records the sweeps, the error estimate and whether it converged.

    Arguments:
        tol: stop once the estimated error of the hidden-state gradients is ``<= tol``
            (``0``: an exact fixed point).
        max_iters: at most this many sweeps (``None``: up to ``T``, exact).
    """

    tol: float = 0.0
    max_iters: int | None = None

    def __post_init__(self):
        from paraprop.solve import check_max_iters, check_tol

        check_tol(self.tol, "JacobiBackward: tol")
        check_max_iters(self.max_iters, "JacobiBackward: max_iters")


@dataclass(frozen=True)
class AutogradBackward:
    """Torch's own backward: the module is then :class:`torch.nn.RNN` / :class:`torch.nn.GRU`
    (with ``forward="sequential"``), double backward and :mod:`torch.func` included."""


@dataclass(frozen=True)
class AutoBackward:
    """The default ``backward=``: per call, the fastest measured exact choice for the cell, the
    device and the forward (:func:`resolve`): torch's own kernel and autograd (the module is then
    exactly the torch module) where :data:`TORCH_FASTEST` says that training step is the
    fastest, :class:`ScanBackward` otherwise. ``last_backward.kind`` names the one that ran
    (``last_forward``'s ``stats["kernel"]`` the forward kernel).

    Example:
        >>> lstm = paraprop.nn.LSTM(3, 8)                 # backward="auto"
        >>> lstm(torch.randn(50, 2, 3))[0].sum().backward()
        >>> lstm.last_backward.kind                       # on the CPU: torch's own LSTM
        'autograd'
    """


# The (cell, device type) pairs whose training step (forward + backward) is fastest as torch's
# own fused kernel with autograd. Measured on a 2-core CPU, float32, T=1000, batch 16, input 8,
# hidden 32 and 64, one thread (docs/recurrences.md, "Which path the defaults run"): torch's
# LSTM step 10-13 ms (hidden 32) and 39 ms (64), paraprop's native loop + scan 13-18 ms and
# 35-47 ms, torch's kernel + scan 18-22 ms and 44-48 ms; for RNN and GRU the native loop + scan
# ran 3-9x faster than torch's step at both sizes. Elsewhere the scan backward stays the
# default (no measurement decides otherwise yet).
TORCH_FASTEST = frozenset({("LSTM", "cpu")})


def resolve(mode: str, device: torch.device, forward, backward):
    """The pair that runs for a module of cell ``mode`` (``"LSTM"``, ``"GRU"``, ``"RNN_TANH"``,
    ...) on ``device``: ``(forward, backward)`` with :class:`AutoBackward` replaced by
    :class:`AutogradBackward` (only with a :class:`SequentialForward` whose kernel is ``"torch"``
    or ``"auto"``, then run as torch's kernel) or :class:`ScanBackward`; ``forward="auto"`` with
    ``backward="autograd"`` runs torch's kernel (the graph autograd needs). Other explicit
    settings are returned as they are."""
    if isinstance(backward, AutogradBackward) and forward == SequentialForward("auto"):
        return SequentialForward("torch"), backward     # autograd needs torch's graph
    if not isinstance(backward, AutoBackward):
        return forward, backward
    if (isinstance(forward, SequentialForward) and forward.kernel != "native"
            and (mode, torch.device(device).type) in TORCH_FASTEST):
        return SequentialForward("torch"), AutogradBackward()
    return forward, ScanBackward()


# the names forward= and backward= accept
SEQUENTIAL_NAMES = ("sequential", "native", "auto")
PARALLEL_FORWARDS = tuple(m for m in METHODS if m not in ("sequential", "anderson"))
FORWARDS = (*SEQUENTIAL_NAMES, *PARALLEL_FORWARDS)
BACKWARDS = {"scan": ScanBackward, "jacobi": JacobiBackward, "autograd": AutogradBackward,
             "auto": AutoBackward}


def forward_option(value) -> SequentialForward | ParallelForward:
    """``forward=`` as an object: ``"sequential"`` or :class:`SequentialForward`; a method name
    or a solver object (wrapped in :class:`ParallelForward`); or a :class:`ParallelForward`."""
    if isinstance(value, SequentialForward | ParallelForward):
        return value
    if isinstance(value, str):
        if value not in FORWARDS:
            raise ValueError(f"unknown forward={value!r}; choose one of {', '.join(FORWARDS)}, "
                             "a solver object from paraprop.solvers, or "
                             "paraprop.nn.ParallelForward(method=..., tol=..., max_iters=...)")
        if value in SEQUENTIAL_NAMES:
            return SequentialForward("torch" if value == "sequential" else value)
        return ParallelForward(method=value)
    if isinstance(value, type):
        raise TypeError(f"forward must be a name or an object, got the class {value.__name__}; "
                        f"pass an instance, e.g. {value.__name__}()")
    if is_solver(value):
        if value.name == "sequential":
            raise ValueError("forward=Sequential() would step torch's cell from Python; pass "
                             "forward='sequential' (torch's fused kernel)")
        return ParallelForward(method=value)
    raise TypeError(f"forward must be a method name, a solver object from paraprop.solvers, "
                    f"paraprop.nn.SequentialForward() or paraprop.nn.ParallelForward(...), got "
                    f"{type(value).__name__}: {value!r}")


def backward_option(value) -> ScanBackward | JacobiBackward | AutogradBackward | AutoBackward:
    """``backward=`` as an object: a name of :data:`BACKWARDS` (its defaults apply) or one of
    :class:`ScanBackward`, :class:`JacobiBackward`, :class:`AutogradBackward`,
    :class:`AutoBackward`."""
    if isinstance(value, ScanBackward | JacobiBackward | AutogradBackward | AutoBackward):
        return value
    if isinstance(value, str):
        if value not in BACKWARDS:
            raise ValueError(f"unknown backward={value!r}; choose one of "
                             f"{', '.join(BACKWARDS)}, or paraprop.nn.ScanBackward(method=...)"
                             f" / JacobiBackward(tol=..., max_iters=...)")
        return BACKWARDS[value]()
    if isinstance(value, type):
        raise TypeError(f"backward must be a name or an object, got the class "
                        f"{value.__name__}; pass an instance, e.g. {value.__name__}()")
    raise TypeError(f"backward must be one of {', '.join(map(repr, BACKWARDS))} or "
                    f"paraprop.nn.ScanBackward(...) / JacobiBackward(...) / AutogradBackward() / "
                    f"AutoBackward(), "
                    f"got {type(value).__name__}: {value!r}")


def describe(option) -> str:
    """``option`` as the user would most simply write it: the name where it is a name's
    defaults (``'scan'``, ``'newton'``), otherwise the object's repr."""
    if isinstance(option, ParallelForward):
        if isinstance(option.method, str) and option == ParallelForward(method=option.method):
            return repr(option.method)
        return repr(option)
    if isinstance(option, SequentialForward):
        return repr("sequential" if option.kernel == "torch" else option.kernel)
    for name, cls in BACKWARDS.items():
        if option == cls():
            return repr(name)
    return repr(option)


def check_pair(forward, backward) -> None:
    """The combinations the modules do not run."""
    if isinstance(forward, ParallelForward) and isinstance(backward, AutogradBackward):
        raise ValueError(f"forward={describe(forward)} differentiates implicitly at the "
                         "solution, with backward='scan' or 'jacobi'; backward='autograd' needs "
                         "forward='sequential'")
    if (isinstance(forward, SequentialForward) and forward.kernel == "native"
            and isinstance(backward, AutogradBackward)):
        raise ValueError(f"forward={describe(forward)} runs paraprop's native loop, which "
                         "records no autograd graph; backward='autograd' needs "
                         "forward='sequential' (torch's kernel)")
