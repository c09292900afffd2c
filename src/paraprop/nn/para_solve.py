"""What the layers of :class:`paraprop.nn.ParaGRU` (:mod:`paraprop.nn.para_gru`) and
:class:`~paraprop.nn.ParaLSTM` (:mod:`paraprop.nn.para_lstm`) share: the base of their
:class:`paraprop.Recurrence` objects and the solve of one layer by :func:`paraprop.solve`, with
its Triton warm start on CUDA.

Forward, per layer: the input terms ``gi = W_ih x + b`` of all steps in one matrix product (for
Newton on the CPU with at most :data:`INPUTS_PER_BLOCK` inputs per step, block by block instead,
:func:`per_block`), then either the sequential loop (``forward="sequential"``) or Newton's method
(or any method of :func:`paraprop.solve`) on the layer's recurrence (:func:`solve_recurrence`).
The recurrences are :class:`DiagonalRecurrence` objects whose Jacobians come from
:mod:`paraprop.jacobians.diagonal`, in forms :func:`paraprop.scan.linear_recurrence` runs in
``O(T H)`` (its native kernels on the CPU). Exact Newton stops on the size of its step (the
linearised error), as for every recurrence. Each recurrence also gives
:mod:`paraprop.solvers.newton` a fused step (``newton_step``): per block of steps the cell, its
Jacobians and the step's linear recurrence (a carry from block to block) in cache-resident
scratch reused across blocks and iterations (:func:`scratch`), so that an iteration makes one
pass over the states and allocates nothing of size ``T`` after the first. On CUDA the first
iterations run the fused Triton step (:mod:`paraprop.nn.triton_cells`) as a warm start; the
torch cell's step then certifies (:func:`solve_recurrence`). The Newton forward's input terms
(and each layer's output, the next layer's input) are those of the loop, computed by the same
products, so that ``tol=0`` gives the loop's bits.

Backward (implicit at the computed states, whichever forward produced them): with ``lam_t =
dL/ds_t`` and ``e_t`` the gradient arriving from outside the layer, ``lam_t = e_t + J_{t+1}^T
lam_{t+1}`` is one reverse linear recurrence (diagonal for ParaGRU, ``2 x 2`` blocks transposed
for ParaLSTM), then every weight gradient is a sum over steps or one matrix product (the cell's
module says which).
"""

from __future__ import annotations

import dataclasses

import torch

from paraprop.nn.runs import record_solve
from paraprop.recurrence import Recurrence
from paraprop.scan import native, triton_runtime

# The Triton warm start of the layers' Newton forward (:func:`solve_recurrence`): ``None`` runs
# it on CUDA tensors where the kernels run (:mod:`paraprop.nn.triton_cells`), ``"triton"`` always
# (on a CPU only in Triton's interpreter, under ``TRITON_INTERPRET=1``: for tests; a kernel
# that cannot run raises), ``"blocks"`` never. The certifying solve after it always runs the
# torch cell (the blocked native/PyTorch step). The stats ``"newton_step"``,
# ``"triton_iterations"`` and ``"triton_skipped"`` of the layers' ``last_forward`` record what
# ran.
STEP_KERNEL: str | None = None
STEP_KERNELS = (None, "triton", "blocks")

# Up to this many inputs per step, the Newton forward on the CPU forms the input terms block by
# block in every iteration (an (n, I) x (I, 3H) or (4H, I) x (I, n) product into a cache-
# resident block) instead of storing all of them: a fresh (B, T, 3H) array costs more (a page
# fault per 4 KB, ~1.6 ns per value here) than a few products per value and iteration.
INPUTS_PER_BLOCK = 4


def scratch(owner, keep: str | None, need: int, like: torch.Tensor) -> torch.Tensor:
    """A flat array of at least ``need`` values like ``like``: the one kept as ``owner``'s
    attribute ``keep`` when it is large enough, else a new one (kept there when ``keep``)."""
    buf = getattr(owner, keep, None) if keep else None
    if buf is None or buf.numel() < need:
        buf = like.new_empty(need)
        if keep:
            setattr(owner, keep, buf)
    return buf


class DiagonalRecurrence(Recurrence):
    """A :class:`paraprop.Recurrence` of input terms ``gi`` whose linearization is analytic
    (:mod:`paraprop.jacobians.diagonal`): the subclasses define ``_cell`` (rows, for the
    sequential and Jacobi-type methods) and ``linearize`` (blocks of steps, for Newton).

    ``kernel`` is the fused step's (``newton_step``): ``None`` or ``"blocks"``, the blocked
    step of the torch cell (native C scans where they run); ``"triton"``, the Triton kernel
    (:mod:`paraprop.nn.triton_cells`), whose cell differs from the torch cell by rounding. A
    Newton solve with ``kernel="triton"`` converges to (and certifies) the kernel cell's fixed
    point, not ``fn``'s: it is only a warm start, as :func:`solve_recurrence` uses it before the
    certifying solve with the torch cell."""

    # the solvers' Jacobian forms the fused step takes
    fused_forms: tuple[str, ...] = ()
    # the inputs, where the input terms are formed block by block (``None``: stored)
    _x: torch.Tensor | None

    def __init__(self, gi: torch.Tensor | None, h0: torch.Tensor, length: int | None = None,
                 kernel: str | None = None):
        if not any(kernel == k for k in STEP_KERNELS):
            raise ValueError(f"{type(self).__name__}: unknown kernel={kernel!r}; choose one of "
                             "None, 'triton', 'blocks'")
        super().__init__(self._cell, gi, h0, length=length, params=[])
        self._adapter = self
        self._kernel = kernel
        self.step_kernel: str | None = None    # the fused step's kernel that ran last

    def _cell(self, u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``fn``'s rows: the cell at input terms ``u`` and previous states ``h``."""
        raise NotImplementedError(f"{type(self).__name__} defines no cell")

    @property
    def formed(self) -> bool:
        """Whether the input terms are stored (as the Triton step needs)."""
        return self._x is None

    def _step_kernel(self, xc: torch.Tensor) -> str:
        """``"triton"`` (``kernel="triton"`` only), ``"native"`` or ``"torch"`` for the fused
        step on ``xc``."""
        if self._kernel == "triton":
            if not self.formed:
                raise ValueError(f"{type(self).__name__}(kernel='triton') needs the input terms "
                                 "gi, not inputs=(x, ...)")
            triton_runtime.require(f"{type(self).__name__}(kernel='triton')", x=xc)
            return "triton"
        return "native" if native.supports(xc) else "torch"

    def rows(self, u, h, rec):
        return self._cell(u, h)

    def attach(self, value):
        """The solution as is: the modules differentiate it themselves (scan backward)."""
        return value


def triton_warm_start(solver, rec: DiagonalRecurrence) -> tuple[bool, str | None]:
    """Whether :func:`solve_recurrence` runs the Triton warm start for ``rec`` with
    ``solver``, and, on a CUDA tensor where it does not, why (for
    ``stats["triton_skipped"]`` of the layer's record)."""
    cuda = rec.device.type == "cuda"
    if STEP_KERNEL == "blocks":
        return False, "STEP_KERNEL='blocks'" if cuda else None
    if getattr(solver, "damped", False) or getattr(solver, "form", None) not in rec.fused_forms:
        return False, (f"the method {getattr(solver, 'name', solver)!r} has no fused step"
                       if cuda else None)
    if STEP_KERNEL == "triton":
        return True, None           # (a kernel that cannot run raises, naming the reason)
    if not cuda:
        return False, None
    if not rec.formed:
        return False, "the input terms are formed block by block"
    reason = triton_runtime.why_not(x=rec._h0) or triton_runtime.failed()
    return reason is None, reason


def warm_tol(tol: float, dtype: torch.dtype) -> float:
    """The Triton warm start's tolerance: a quarter of ``tol`` (so that the torch cell's first
    step from it is usually within ``tol``), or ``16 eps`` for ``tol = 0`` (the torch steps
    then go on to the torch cell's bitwise fixed point)."""
    return tol / 4 if tol > 0 else 16 * torch.finfo(dtype).eps


def solve_recurrence(cfg: dict, rec: DiagonalRecurrence) -> torch.Tensor:
    """``rec``'s states by ``cfg["forward"]`` (a :class:`~paraprop.nn.ParallelForward`),
    recording the solve in ``cfg["log"]`` (:func:`paraprop.nn.runs.record_solve`, with the
    stats ``"newton_step"``: the fused steps that ran, e.g. ``"triton+native"``, or ``None``;
    ``"triton_iterations"``: the warm start's; ``"triton_skipped"``: on a CUDA tensor, why it
    did not run). With a warm start the record counts both solves (``iterations``,
    ``evaluations``, ``residuals``); its ``result`` is the certifying solve's.

    Where the Triton step runs (:func:`triton_warm_start`), a first solve with it (to
    :func:`warm_tol`, never raising on ``max_iters``) gives the start of the certifying solve,
    which runs the torch cell's step: the Triton cell differs from the torch cell by rounding,
    so only the torch cell's step may certify the sequential loop's result (``converged``,
    ``error_estimate``; at ``tol=0`` its bitwise fixed point). Its first iteration is the one
    extra evaluation; where the Triton iterate was not within ``tol`` it goes on with the
    torch step. ``max_iters`` bounds both together, plus that one evaluation."""
    from paraprop.solve import solve

    fwd, tol = cfg["forward"], cfg["forward_tol"]
    x0 = torch.zeros((), dtype=rec.dtype, device=rec.device).expand(rec.shape)  # (copied)
    run, skipped = triton_warm_start(fwd.solver, rec)
    warm, warm_iterations, steps = None, 0, []
    if run:
        rec._kernel = "triton"
        try:
            warm = solve(rec, x0, method=fwd.solver, dim=-2, tol=warm_tol(tol, rec.dtype),
                         max_iters=fwd.max_iters, throw=False)
        except triton_runtime.LaunchError as e:   # warned and recorded: the torch step only
            if STEP_KERNEL == "triton":
                raise
            skipped = str(e)
        else:
            warm_iterations = warm.iterations
            steps.append("triton")
            if bool(torch.isfinite(warm.value).all()):
                x0 = warm.value
        finally:
            rec._kernel = None
            rec.step_kernel = None
    max_iters = fwd.max_iters
    if max_iters is not None and warm_iterations:
        max_iters = max(1, max_iters - warm_iterations + 1)
    sol = solve(rec, x0, method=fwd.solver, dim=-2, tol=tol, max_iters=max_iters,
                throw=fwd.throw)
    if rec.step_kernel is not None:
        steps.append(rec.step_kernel)
    value = sol.value
    if warm is not None and warm_iterations:     # the record counts both solves
        sol = dataclasses.replace(sol, iterations=warm_iterations + sol.iterations,
                                  evaluations=warm.evaluations + sol.evaluations,
                                  residuals=torch.cat([warm.residuals, sol.residuals]))
    record_solve(cfg["log"], sol, tol=tol, compute_dtype=rec.dtype,
                 newton_step="+".join(steps) or None, triton_iterations=warm_iterations,
                 triton_skipped=skipped)
    return value


def per_block(cfg: dict, x: torch.Tensor) -> bool:
    """Whether the Newton forward forms the input terms block by block (CPU, at most
    :data:`INPUTS_PER_BLOCK` inputs, no Triton warm start forced): their products round
    differently from the loop's one product, so never at ``tol=0``, which promises the loop's
    bits."""
    return (x.shape[-1] <= INPUTS_PER_BLOCK and x.device.type == "cpu"
            and STEP_KERNEL != "triton" and cfg["forward_tol"] > 0)

