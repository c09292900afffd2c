"""The layers of :class:`paraprop.nn.ParaGRU` / :class:`~paraprop.nn.ParaLSTM`: forward by a loop or
by :func:`paraprop.solve` on a diagonal :class:`paraprop.Recurrence`, backward by a scan.

Forward, per layer: the input terms ``gi = W_ih x + b`` of all steps in one matrix product (for
Newton on the CPU with at most :data:`INPUTS_PER_BLOCK` inputs per step, block by block instead),
then either the sequential loop (``forward="sequential"``) or Newton's method (or any method of
:func:`paraprop.solve`) on the layer's recurrence. The recurrences below are
:class:`paraprop.Recurrence` objects whose Jacobians come from
:mod:`paraprop.jacobians.diagonal`: for ParaGRU the states are ``(B, T, H)`` with diagonal
Jacobians ``(B, T, H)``; for ParaLSTM every unit is a recurrence of its own (the units are
independent given ``gi``), so the states are laid out ``(B, H, T, 2)`` (``(h, c)`` of one unit
per position) and the Jacobians are dense ``2 x 2`` per unit and step, ``(B, H, T, 2, 2)``: both
forms :func:`paraprop.scan.linear_recurrence` runs in ``O(T H)`` (its native kernels on the CPU).
Exact Newton stops on the size of its step (the linearised error), as for every recurrence.
Each recurrence also gives :mod:`paraprop.solvers.newton` a fused step (``newton_step``): per
block of steps the cell, its Jacobians and the step's linear recurrence (a carry from block to
block) in cache-resident scratch reused across blocks and iterations, so that an iteration
makes one pass over the states and allocates nothing of size ``T`` after the first. On CUDA the
first iterations run the fused Triton step (:mod:`paraprop.nn.triton_cells`) as a warm start;
the torch cell's step then certifies (:func:`_solve`). The Newton forward's input terms (and
each layer's output, the next layer's input) are those of the loop, computed by the same
products, so that ``tol=0`` gives the loop's bits.

Backward (implicit at the computed states, whichever forward produced them): with ``lam_t =
dL/ds_t`` and ``e_t`` the gradient arriving from outside the layer, ``lam_t = e_t + J_{t+1}^T
lam_{t+1}`` is one reverse linear recurrence (diagonal, or ``2 x 2`` blocks transposed); then the
gradients of the pre-activations are ``coef * lam`` (the coefficients of
:mod:`paraprop.jacobians.diagonal`), and every weight gradient is a sum over steps or one matrix
product: ``dw_hh = sum dgh * h_prev``, ``dW_ih = dgi^T x``, ``dx = dgi W_ih``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraprop.jacobians import diagonal
from paraprop.jacobians.diagonal import (
    GRU_SCRATCH,
    LSTM_SCRATCH,
    blocks,
    gru_linearize,
    gru_newton_block,
    gru_step,
    lstm_linearize,
    lstm_newton_block,
    lstm_step,
)
from paraprop.nn import triton_cells
from paraprop.nn._base import first_order_only, unpack_saved
from paraprop.nn.rnn import solve_hidden
from paraprop.recurrence import Recurrence
from paraprop.scan import linear_recurrence, native, triton_kernels

# The Triton warm start of the layers' Newton forward (:func:`_solve`): ``None`` runs it on
# CUDA tensors where the kernels run (:mod:`paraprop.nn.triton_cells`), ``"triton"`` always
# (on a CPU only in Triton's interpreter, under ``TRITON_INTERPRET=1``: for tests; a kernel
# that cannot run raises), ``"blocks"`` never. The certifying solve after it always runs the
# torch cell (the blocked native/PyTorch step). ``forward_stats["newton_step"]``,
# ``["triton_iterations"]`` and ``["triton_skipped"]`` record what ran.
STEP_KERNEL: str | None = None
STEP_KERNELS = (None, "triton", "blocks")

# Up to this many inputs per step, the Newton forward on the CPU forms the input terms block by
# block in every iteration (an (n, I) x (I, 3H) or (4H, I) x (I, n) product into a cache-
# resident block) instead of storing all of them: a fresh (B, T, 3H) array costs more (a page
# fault per 4 KB, ~1.6 ns per value here) than a few products per value and iteration.
INPUTS_PER_BLOCK = 4


# -- the recurrences solved by paraprop.solve -----------------------------------------------------
def _scratch(owner, keep: str | None, need: int, like: torch.Tensor) -> torch.Tensor:
    """A flat array of at least ``need`` values like ``like``: the one kept as ``owner``'s
    attribute ``keep`` when it is large enough, else a new one (kept there when ``keep``)."""
    scratch = getattr(owner, keep, None) if keep else None
    if scratch is None or scratch.numel() < need:
        scratch = like.new_empty(need)
        if keep:
            setattr(owner, keep, scratch)
    return scratch


class _DiagonalRecurrence(Recurrence):
    """A :class:`paraprop.Recurrence` of input terms ``gi`` whose linearization is analytic
    (:mod:`paraprop.jacobians.diagonal`): the subclasses define ``_cell`` (rows, for the
    sequential and Jacobi-type methods) and ``linearize`` (blocks of steps, for Newton).

    ``kernel`` is the fused step's (``newton_step``): ``None`` or ``"blocks"``, the blocked
    step of the torch cell (native C scans where they run); ``"triton"``, the Triton kernel
    (:mod:`paraprop.nn.triton_cells`), whose cell differs from the torch cell by rounding. A
    Newton solve with ``kernel="triton"`` converges to (and certifies) the kernel cell's fixed
    point, not ``fn``'s: it is only a warm start, as :func:`_solve` uses it before the
    certifying solve with the torch cell."""

    # the solvers' Jacobian forms the fused step takes
    fused_forms: tuple[str, ...] = ()

    def __init__(self, gi: torch.Tensor | None, h0: torch.Tensor, length: int | None = None,
                 kernel: str | None = None):
        if not any(kernel == k for k in STEP_KERNELS):
            raise ValueError(f"{type(self).__name__}: unknown kernel={kernel!r}; choose one of "
                             "None, 'triton', 'blocks'")
        super().__init__(self._cell, gi, h0, length=length, params=[])
        self._adapter = self
        self._kernel = kernel
        self.step_kernel: str | None = None    # the fused step's kernel that ran last

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
            triton_kernels.require(f"{type(self).__name__}(kernel='triton')", x=xc)
            return "triton"
        return "native" if native.supports(xc) else "torch"

    def rows(self, u, h, rec):
        return self._cell(u, h)

    def attach(self, value):
        """The solution as is: the modules differentiate it themselves (scan backward)."""
        return value


class GRURecurrence(_DiagonalRecurrence):
    """One ParaGRU layer as ``fn`` of :func:`paraprop.solve`: states ``(B, T, H)``, diagonal
    Jacobians (``"any"`` and ``"diag"`` are the same, exact form).

    Besides ``linearize`` it has the fused step ``newton_step`` of
    :mod:`paraprop.solvers.newton`: block by block along time, the cell's values, the
    Jacobians' diagonals and the step's diagonal recurrence (its carry passed from block to
    block), in scratch arrays of one block, so that an iteration reads the states (and the
    input terms) once and allocates nothing of size ``T`` after the first.

    Arguments:
        gi: the input terms ``W_ih x + b_ih`` ``(B, T, 3H)``, or ``None`` with ``inputs``.
        h0: ``(B, H)``.
        w, b: the diagonal weights and hidden bias, ``(3, H)`` (``b`` may be ``None``).
        inputs: ``(x, w_ih, b_ih)`` (``x`` ``(B, T, I)``, ``b_ih`` may be ``None``) instead of
            ``gi``: the input terms are then formed block by block, each time they are needed
            (for a few inputs per step that is cheaper than storing ``3 H`` values per step).
        kernel: the fused step's, as :class:`_DiagonalRecurrence` (``"triton"``: a warm
            start only).
    """

    fused_forms = ("any", "diag")

    def __init__(self, gi: torch.Tensor | None, h0: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor | None, *, inputs: tuple | None = None,
                 kernel: str | None = None):
        self._w, self._b = w.detach(), None if b is None else b.detach()
        if (gi is None) == (inputs is None):
            raise ValueError("GRURecurrence: pass either gi or inputs=(x, w_ih, b_ih)")
        self._x = None
        if inputs is not None:
            x, w_ih, b_ih = inputs
            self._x, self._w_ih = x.detach(), w_ih.detach()
            self._b_ih = None if b_ih is None else b_ih.detach()
            super().__init__(None, h0, length=x.shape[1], kernel=kernel)
        else:
            super().__init__(gi, h0, kernel=kernel)
            self._gi = self._u.view(self.B, self.T, 3, self.H)
        self._scratch: torch.Tensor | None = None      # one block's temporaries
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None   # newton_step's y, trial

    def _cell(self, u, h):
        return gru_step(u.unflatten(-1, (3, -1)), h, self._w, self._b)

    def _inputs_at(self, idx):
        if self._x is None:
            return super()._inputs_at(idx)
        u = self._x.index_select(1, idx)
        return F.linear(u.reshape(-1, u.shape[-1]), self._w_ih, self._b_ih)

    def linearize(self, xc: torch.Tensor, lo: int, form: str | None):
        """``fn(x)`` at positions ``[lo, T)`` and the diagonals of its Jacobians there (also
        for ``form="any"``: they are exact); ``"dense"`` embeds them ``(B, n, H, H)``."""
        y = xc.new_empty(self.B, self.T - lo, self.H)
        a = None if form is None else torch.empty_like(y)
        for p0, p1, (gi, sc, _, _) in self._blocks(xc, lo, None):
            gru_newton_block(gi, self._prev(xc, p0, p1), self._w, self._b,
                             y[:, p0 - lo:p1 - lo], None if a is None else a[:, p0 - lo:p1 - lo],
                             sc)
        if form == "dense":
            a = torch.diag_embed(a)
        return y, a

    def newton_step(self, xc: torch.Tensor, lo: int, form: str):
        """The step of :mod:`paraprop.solvers.newton` at ``x`` from position ``lo``, fused:
        ``(y, trial)`` with ``y = fn(x)`` and ``trial = x + delta``, ``delta_t = a_t
        delta_{t-1} + y_t - x_t`` (``delta_{lo-1} = 0``), both ``(B, T - lo, H)`` views of
        arrays that the next call overwrites (one solve at a time per object). ``None`` for a
        ``form`` other than the exact diagonal ones (the driver then calls
        :meth:`linearize`)."""
        if form not in ("any", "diag"):
            return None
        if self._out is None:
            self._out = (torch.empty_like(xc), torch.empty_like(xc))
        kernel = self.step_kernel = self._step_kernel(xc)
        if kernel == "triton":
            triton_cells.gru_newton_step(self._gi, xc, self._h0, self._w, self._b, lo,
                                         *self._out)
            return tuple(t[:, lo:] for t in self._out)
        y, trial = (t[:, lo:] for t in self._out)
        carry, last = None, xc.new_empty(self.B, self.H)   # delta at the previous block's end
        use_native = kernel == "native"
        for p0, p1, (gi, sc, a, r) in self._blocks(xc, lo, "_scratch"):
            yb, tb, xb = y[:, p0 - lo:p1 - lo], trial[:, p0 - lo:p1 - lo], xc[:, p0:p1]
            gru_newton_block(gi, self._prev(xc, p0, p1), self._w, self._b, yb, a, sc)
            torch.sub(yb, xb, out=r)
            if use_native:                        # the kernel linear_recurrence runs here
                native.diag(a, r, carry, tb, False)
            else:
                tb.copy_(linear_recurrence(a, r, carry))
            carry = last.copy_(tb[:, -1])
            tb.add_(xb)
        return y, trial

    def _blocks(self, xc: torch.Tensor, lo: int, keep: str | None):
        """``(p0, p1, (gi, scratch, a, r))`` for the blocks of positions ``[lo, T)``: the input
        terms ``(B, n, 3, H)``, :func:`gru_newton_block`'s scratch and two ``(B, n, H)``
        arrays, all in one array reused from block to block (and, kept as attribute ``keep``,
        from call to call)."""
        B, H = self.B, self.H
        spans = [(lo + b.start, lo + b.stop) for b in blocks(
            self.T - lo, B * H, xc.device, diagonal.NEWTON_BLOCK_ELEMENTS)]
        units = GRU_SCRATCH + 2 + (3 if self._x is not None else 0)
        need = units * B * H * max(p1 - p0 for p0, p1 in spans)
        scratch = _scratch(self, keep, need, xc)
        for p0, p1 in spans:
            m = B * (p1 - p0) * H
            parts = scratch[:units * m].split([GRU_SCRATCH * m, m, m,
                                               (units - GRU_SCRATCH - 2) * m])
            a, r = (t.view(B, p1 - p0, H) for t in parts[1:3])
            if self._x is None:
                gi = self._gi[:, p0:p1]
            else:                                 # the input terms of the block, (B, n, 3, H)
                u = self._x[:, p0:p1]
                gi = parts[3].view(B, p1 - p0, 3, H)
                u2, rows = u.reshape(-1, u.shape[-1]), gi.view(-1, 3 * H)
                if self._b_ih is None:
                    torch.mm(u2, self._w_ih.t(), out=rows)
                else:
                    torch.addmm(self._b_ih, u2, self._w_ih.t(), out=rows)
            yield p0, p1, (gi, parts[0], a, r)

    def _prev(self, xc, p0, p1):
        """``x_{t-1}`` for ``t`` in ``[p0, p1)`` (``h0`` before position 0)."""
        if p0 > 0:
            return xc[:, p0 - 1:p1 - 1]
        return torch.cat([self._h0[:, None], xc[:, :p1 - 1]], 1)


class LSTMRecurrence(_DiagonalRecurrence):
    """One ParaLSTM layer as ``fn`` of :func:`paraprop.solve`, one recurrence per unit: states
    ``(B, H, T, 2)`` (``(h, c)``), Jacobians ``(B, H, T, 2, 2)`` (``"any"`` and ``"dense"``,
    exact) or their diagonals ``(B, H, T, 2)`` (``"diag"``, quasi-Newton).

    The input terms are kept gate-major and the blocks of steps are computed on contiguous
    ``(B, H, steps)`` arrays (:func:`~paraprop.jacobians.diagonal.lstm_newton_block`), then
    interleaved into the ``(h, c)`` layout of the solver. The fused step ``newton_step`` of
    :mod:`paraprop.solvers.newton` works as :class:`GRURecurrence`'s, with the ``2 x 2``
    blocks' recurrence.

    Arguments:
        gi: the input terms ``W_ih x + b_ih + b_hh``, ``(4, B, H, T)`` (gates i, f, g, o), or
            ``None`` with ``inputs``.
        h0: ``(B, H, 2)``.
        w: the diagonal weights ``(4, H)``.
        inputs: ``(x, w_ih, b)`` (``x`` ``(B, T, I)``, ``b = b_ih + b_hh`` or ``None``)
            instead of ``gi``: the input terms formed block by block, as for
            :class:`GRURecurrence`.
        kernel: as :class:`GRURecurrence`.
    """

    fused_forms = ("any",)

    def __init__(self, gi: torch.Tensor | None, h0: torch.Tensor, w: torch.Tensor, *,
                 inputs: tuple | None = None, kernel: str | None = None):
        if (gi is None) == (inputs is None):
            raise ValueError("LSTMRecurrence: pass either gi or inputs=(x, w_ih, b)")
        self._gi4 = self._x = None
        if inputs is not None:
            x, w_ih, b = inputs
            self._x, self._w_ih = x.detach(), w_ih.detach()
            self._b_ih = None if b is None else b.detach().view(-1, 1)
            T = x.shape[1]
        else:
            self._gi4, T = gi.detach(), gi.shape[-1]
        self._w = w.detach().reshape(4, 1, -1, 1)                # broadcasts on (4, B, H, steps)
        super().__init__(None, h0, length=T, kernel=kernel)
        self._units = tuple(self.batch_shape)                   # (B, H)
        self._scratch: torch.Tensor | None = None               # one block's temporaries
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None   # newton_step's y, trial

    def _inputs_at(self, idx):                                  # (4, B, H, k), for _cell
        if self._x is None:
            return self._gi4.index_select(-1, idx)
        return self._input_terms(self._x.index_select(1, idx), None)

    def _input_terms(self, u: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``W_ih u + b`` of ``u`` ``(B, k, I)`` as ``(4, B, H, k)`` (a view of ``out``
        ``(B, 4H, k)`` when given)."""
        gi = torch.matmul(self._w_ih, u.transpose(1, 2), out=out)    # (B, 4H, k)
        if self._b_ih is not None:
            gi += self._b_ih
        return gi.view(u.shape[0], 4, self._units[1], -1).transpose(0, 1)

    def _cell(self, u, s):
        B, H = self._units
        hc = s.reshape(B, H, -1, 2).permute(3, 0, 1, 2)
        out = hc.new_empty(hc.shape)
        lstm_linearize(u, hc[0], hc[1], self._w, out[0], out[1], dim=0)
        return out.permute(1, 2, 3, 0).reshape(-1, 2)

    def linearize(self, xc: torch.Tensor, lo: int, form: str | None):
        B, H = self._units
        y = xc.new_empty(B, H, self.T - lo, 2)
        J = None if form is None else xc.new_empty(B, H, self.T - lo, 2, 2)
        for p0, p1, gi, sc in self._blocks(xc, lo, None):
            prev = self._prev(xc, p0, p1)
            yb = y[:, :, p0 - lo:p1 - lo]
            lstm_newton_block(gi, prev[..., 0], prev[..., 1], self._w,
                              yb[..., 0], yb[..., 1],
                              None if J is None else J[:, :, p0 - lo:p1 - lo], sc)
        y = y.view(B * H, self.T - lo, 2)
        if J is None:
            return y, None
        J = J.view(B * H, self.T - lo, 2, 2)
        return y, (J.diagonal(dim1=-2, dim2=-1) if form == "diag" else J)

    def newton_step(self, xc: torch.Tensor, lo: int, form: str):
        """The step of :mod:`paraprop.solvers.newton` fused, as
        :meth:`GRURecurrence.newton_step`, for the exact ``2 x 2`` blocks (``form="any"``;
        ``None`` otherwise): ``(y, trial)``, ``(B * H, T - lo, 2)`` views of arrays that the
        next call overwrites."""
        if form != "any":
            return None
        B, H = self._units
        N, T = B * H, self.T
        if self._out is None:
            self._out = (torch.empty_like(xc), torch.empty_like(xc))
        kernel = self.step_kernel = self._step_kernel(xc)
        if kernel == "triton":
            triton_cells.lstm_newton_step(self._gi4, xc, self._h0, self._w.view(4, H), lo,
                                          *self._out)
            return tuple(t[:, lo:] for t in self._out)
        x = xc.view(B, H, T, 2)
        y, trial = (t.view(B, H, T, 2) for t in self._out)
        carry, last = None, xc.new_empty(N, 2)      # delta at the previous block's end
        use_native = kernel == "native"
        for p0, p1, gi, sc in self._blocks(xc, lo, "_scratch"):
            s, prev = p1 - p0, self._prev(xc, p0, p1)
            m = N * s
            J = sc[LSTM_SCRATCH * m:(LSTM_SCRATCH + 4) * m].view(N, s, 2, 2)
            r = sc[(LSTM_SCRATCH + 4) * m:(LSTM_SCRATCH + 6) * m].view(N, s, 2)
            yb, tb, xb = y[:, :, p0:p1], trial[:, :, p0:p1].view(N, s, 2), x[:, :, p0:p1]
            lstm_newton_block(gi, prev[..., 0], prev[..., 1], self._w, yb[..., 0], yb[..., 1],
                              J.view(B, H, s, 2, 2), sc)
            torch.sub(yb, xb, out=r.view(B, H, s, 2))
            if use_native:                          # the kernel linear_recurrence runs here
                native.dense(J, r, carry, tb, False)
            else:
                tb.copy_(linear_recurrence(J, r, carry))
            carry = last.copy_(tb[:, -1])
            tb.add_(xb.reshape(N, s, 2))
        return tuple(t[:, lo:] for t in self._out)

    def _blocks(self, xc: torch.Tensor, lo: int, keep: str | None):
        """``(p0, p1, gi, scratch)`` for the blocks of positions ``[lo, T)``: the input terms
        ``(4, B, H, n)`` and the scratch (:func:`lstm_newton_block`'s, then a block's ``J`` and
        ``r``), one array reused from block to block (and, kept as attribute ``keep``, from
        call to call)."""
        N = self.B
        spans = [(lo + b.start, lo + b.stop) for b in blocks(
            self.T - lo, 2 * N, xc.device, diagonal.NEWTON_BLOCK_ELEMENTS)]
        units = LSTM_SCRATCH + 6 + (4 if self._x is not None else 0)
        need = units * N * max(p1 - p0 for p0, p1 in spans)
        scratch = _scratch(self, keep, need, xc)
        for p0, p1 in spans:
            if self._x is None:
                gi = self._gi4[..., p0:p1]
            else:
                m = N * (p1 - p0)
                out = scratch[(LSTM_SCRATCH + 6) * m:units * m].view(self._units[0], -1, p1 - p0)
                gi = self._input_terms(self._x[:, p0:p1], out)
            yield p0, p1, gi, scratch

    def _prev(self, xc: torch.Tensor, p0: int, p1: int) -> torch.Tensor:
        """``(h, c)`` at ``t - 1`` for ``t`` in ``[p0, p1)``, ``(B, H, p1 - p0, 2)``."""
        B, H = self._units
        x = xc.view(B, H, self.T, 2)
        if p0 > 0:
            return x[:, :, p0 - 1:p1 - 1]
        return torch.cat([self._h0.view(B, H, 1, 2), x[:, :, :p1 - 1]], 2)


def _triton_warm_start(solver, rec: _DiagonalRecurrence) -> tuple[bool, str | None]:
    """Whether :func:`_solve` runs the Triton warm start for ``rec`` with ``solver``, and, on
    a CUDA tensor where it does not, why (for ``forward_stats["triton_skipped"]``)."""
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
    reason = triton_kernels.why_not(x=rec._h0) or triton_kernels.failed()
    return reason is None, reason


def warm_tol(tol: float, dtype: torch.dtype) -> float:
    """The Triton warm start's tolerance: a quarter of ``tol`` (so that the torch cell's first
    step from it is usually within ``tol``), or ``16 eps`` for ``tol = 0`` (the torch steps
    then go on to the torch cell's bitwise fixed point)."""
    return tol / 4 if tol > 0 else 16 * torch.finfo(dtype).eps


def _solve(cfg: dict, rec: _DiagonalRecurrence) -> torch.Tensor:
    """``rec``'s states by ``cfg["forward"]`` (a :class:`~paraprop.nn.ParallelForward`),
    recording the solve in ``cfg["forward_stats"]`` (one entry per layer).

    Where the Triton step runs (:func:`_triton_warm_start`), a first solve with it (to
    :func:`warm_tol`, never raising on ``max_iters``) gives the start of the certifying solve,
    which runs the torch cell's step: the Triton cell differs from the torch cell by rounding,
    so only the torch cell's step may certify the sequential loop's result (``converged``,
    ``error_estimate``; at ``tol=0`` its bitwise fixed point). Its first iteration is the one
    extra evaluation; where the Triton iterate was not within ``tol`` it goes on with the
    torch step. ``max_iters`` bounds both together, plus that one evaluation."""
    from paraprop.solve import solve

    fwd, tol = cfg["forward"], cfg["forward_tol"]
    x0 = torch.zeros((), dtype=rec.dtype, device=rec.device).expand(rec.shape)  # (copied)
    run, skipped = _triton_warm_start(fwd.solver, rec)
    warm_iterations, steps = 0, []
    if run:
        rec._kernel = "triton"
        try:
            warm = solve(rec, x0, method=fwd.solver, dim=-2, tol=warm_tol(tol, rec.dtype),
                         max_iters=fwd.max_iters, throw=False)
        except triton_kernels.LaunchError as e:   # warned and recorded: the torch step only
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
    record = cfg["forward_stats"]
    for key, value in (("iterations", warm_iterations + sol.iterations),
                       ("residual", float(sol.residuals[-1]) if len(sol.residuals) else 0.0),
                       ("resets", sol.stats.get("resets", 0)),
                       ("error_estimate", sol.stats["error_estimate"]),
                       ("converged", sol.converged),
                       ("tol", tol),
                       ("newton_step", "+".join(steps) or None),
                       ("triton_iterations", warm_iterations),
                       ("triton_skipped", skipped)):
        record.setdefault(key, []).append(value)
    return sol.value


# -- ParaGRU ---------------------------------------------------------------------------------------
def gru_loop(gi: torch.Tensor, h0: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """The sequential reference: ``T`` ParaGRU steps, ``gi`` ``(T, B, 3, H)``; returns the
    states ``(T, B, H)`` (differentiable by autograd when grad mode is on)."""
    if torch.is_grad_enabled():
        h, outs = h0, []
        for t in range(gi.shape[0]):
            h = gru_step(gi[t], h, w, b)
            outs.append(h)
        return torch.stack(outs)
    out = h0.new_empty(gi.shape[0], *h0.shape)
    h = h0
    for t in range(gi.shape[0]):
        h = gru_step(gi[t], h, w, b, out=out[t])
    return out


def gru_layer(cfg: dict, x: torch.Tensor, h0: torch.Tensor, w_ih, w_hh, b_ih, b_hh):
    """One ParaGRU layer's states ``(T, B, H)`` for time-major ``x``."""
    H = h0.shape[-1]
    w, b = w_hh.view(3, H), None if b_hh is None else b_hh.view(3, H)
    if cfg["forward"] is None:
        return gru_loop(F.linear(x, w_ih, b_ih).unflatten(-1, (3, H)), h0, w, b)
    if _per_block(cfg, x):
        rec = GRURecurrence(None, h0, w, b, inputs=(x.transpose(0, 1), w_ih, b_ih))
    else:               # gi (B, T, 3H): the loop's input terms, bitwise (the same product)
        gi = F.linear(x, w_ih, b_ih).transpose(0, 1).contiguous()
        rec = GRURecurrence(gi, h0, w, b)
    # contiguous time-major, as the loop's: the next layer's input product then rounds alike
    return _solve(cfg, rec).transpose(0, 1).contiguous()


def _per_block(cfg: dict, x: torch.Tensor) -> bool:
    """Whether the Newton forward forms the input terms block by block (CPU, at most
    :data:`INPUTS_PER_BLOCK` inputs, no Triton warm start forced): their products round
    differently from the loop's one product, so never at ``tol=0``, which promises the loop's
    bits."""
    return (x.shape[-1] <= INPUTS_PER_BLOCK and x.device.type == "cpu"
            and STEP_KERNEL != "triton" and cfg["forward_tol"] > 0)


class ParaGRUFunction(torch.autograd.Function):
    """Forward: every layer by :func:`gru_layer`. Backward: see the module doc."""

    @staticmethod
    def layers(cfg, x, h0, weights):
        per = 4 if cfg["bias"] else 2
        inputs, outs, layer_in = [], [], x
        for k in range(cfg["layers"]):
            w = weights[k * per:(k + 1) * per]
            b_ih, b_hh = (w[2], w[3]) if cfg["bias"] else (None, None)
            out = gru_layer(cfg, layer_in, h0[k], w[0], w[1], b_ih, b_hh)
            inputs.append(layer_in)
            outs.append(out)
            layer_in = out
        return layer_in, torch.stack([o[-1] for o in outs]), inputs, outs

    @staticmethod
    def forward(ctx, cfg, x, h0, *weights):
        out, hn, inputs, outs = ParaGRUFunction.layers(cfg, x, h0, weights)
        ctx.cfg = cfg
        ctx.save_for_backward(h0, *weights, *inputs, *outs)
        return out, hn

    @staticmethod
    @first_order_only
    def backward(ctx, g_out, g_hn):
        cfg, nl, per, (h0,), weights, rest = unpack_saved(ctx, lead=1)
        inputs, outs = rest[:nl], rest[nl:]
        T, B, H = g_out.shape
        grads: list = [None] * len(weights)
        g_h0 = torch.empty_like(h0)
        e, g_x = g_out, None
        for k in range(nl - 1, -1, -1):
            w_ih, w_hh = weights[k * per], weights[k * per + 1]
            b_ih, b_hh = (weights[k * per + 2], weights[k * per + 3]) if cfg["bias"] else (None,
                                                                                       None)
            x = inputs[k]
            prev = torch.cat([h0[k][None], outs[k][:-1]])
            w, b = w_hh.view(3, H), None if b_hh is None else b_hh.view(3, H)
            gi = F.linear(x, w_ih, b_ih).view(T, B, 3, H)
            a, coef = prev.new_empty(T, B, H), prev.new_empty(T, B, 4, H)
            for blk in blocks(T, B * H, prev.device):
                gru_linearize(gi[blk], prev[blk], w, b, torch.empty_like(prev[blk]), a[blk],
                              coef[blk])
            lam = _reverse(cfg, a, e, g_hn[k])                          # (T, B, H)
            dgi = coef[:, :, :3].mul_(lam.unsqueeze(2))                 # (T, B, 3, H)
            dghn = coef[:, :, 3].mul_(lam)
            g_w = torch.cat([(dgi[:, :, :2] * prev.unsqueeze(2)).sum((0, 1)),
                             (dghn * prev).sum((0, 1))[None]])
            grads[k * per + 1] = g_w.reshape(3 * H)
            d2 = dgi.reshape(T * B, 3 * H)
            grads[k * per] = d2.t() @ x.reshape(T * B, -1)
            if cfg["bias"]:
                g_bi = d2.sum(0)
                grads[k * per + 2] = g_bi
                grads[k * per + 3] = torch.cat([g_bi[:2 * H], dghn.sum((0, 1))])
            g_h0[k] = a[0] * lam[0]
            if k > 0 or ctx.needs_input_grad[1]:
                e = (d2 @ w_ih).reshape(T, B, -1)
                g_x = e if k == 0 else None
        return (None, g_x, g_h0 if ctx.needs_input_grad[2] else None, *grads)


def _reverse(cfg, a, e, g_last):
    """``lam_t = e_t + a_{t+1} lam_{t+1}``, ``lam_{T-1} = e_{T-1} + g_last`` (time-major,
    diagonal ``a``), by the backward option's linear recurrence."""
    lam = torch.empty_like(e)
    lam[-1] = e[-1] + g_last
    if e.shape[0] > 1:
        lam[:-1] = solve_hidden(cfg, a[1:].transpose(0, 1), e[:-1].transpose(0, 1),
                                lam[-1]).transpose(0, 1)
    return lam


# -- ParaLSTM --------------------------------------------------------------------------------------
def lstm_loop(gi: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w: torch.Tensor):
    """The sequential reference: ``T`` ParaLSTM steps, ``gi`` ``(T, B, 4, H)`` (both biases
    included); returns the states ``h``, ``c`` ``(T, B, H)`` each (differentiable by autograd
    when grad mode is on)."""
    h, c, hs, cs = h0, c0, [], []
    for t in range(gi.shape[0]):
        h, c = lstm_step(gi[t], h, c, w)
        hs.append(h)
        cs.append(c)
    return torch.stack(hs), torch.stack(cs)


def lstm_layer(cfg: dict, x, h0, c0, w_ih, w_hh, b):
    """One ParaLSTM layer's states ``h``, ``c`` ``(T, B, H)`` for time-major ``x``."""
    H = h0.shape[-1]
    if cfg["forward"] is None:
        return lstm_loop(F.linear(x, w_ih, b).unflatten(-1, (4, H)), h0, c0, w_hh.view(4, H))
    hc0, w = torch.stack([h0, c0], -1), w_hh.view(4, H)
    if _per_block(cfg, x):
        rec = LSTMRecurrence(None, hc0, w, inputs=(x.transpose(0, 1), w_ih, b))
    else:               # gi (4, B, H, T): the loop's input terms, bitwise (the same product)
        T, B = x.shape[:2]
        gi = F.linear(x, w_ih, b).view(T, B, 4, H).permute(2, 1, 3, 0).contiguous()
        rec = LSTMRecurrence(gi, hc0, w)
    s = _solve(cfg, rec).permute(3, 2, 0, 1).contiguous()            # (2, T, B, H)
    return s[0], s[1]         # contiguous time-major, as the loop's (see gru_layer)


class ParaLSTMFunction(torch.autograd.Function):
    """Forward: every layer by :func:`lstm_layer`. Backward: see the module doc."""

    @staticmethod
    def layers(cfg, x, h0, c0, weights):
        per = 4 if cfg["bias"] else 2
        inputs, hs, cs, layer_in = [], [], [], x
        for k in range(cfg["layers"]):
            w = weights[k * per:(k + 1) * per]
            h, c = lstm_layer(cfg, layer_in, h0[k], c0[k], w[0], w[1],
                              w[2] + w[3] if cfg["bias"] else None)
            inputs.append(layer_in)
            hs.append(h)
            cs.append(c)
            layer_in = h
        return layer_in, torch.stack([h[-1] for h in hs]), torch.stack([c[-1] for c in cs]), \
            inputs, hs, cs

    @staticmethod
    def forward(ctx, cfg, x, h0, c0, *weights):
        out, hn, cn, inputs, hs, cs = ParaLSTMFunction.layers(cfg, x, h0, c0, weights)
        ctx.cfg = cfg
        ctx.save_for_backward(h0, c0, *weights, *inputs, *hs, *cs)
        return out, hn, cn

    @staticmethod
    @first_order_only
    def backward(ctx, g_out, g_hn, g_cn):
        cfg, nl, per, (h0, c0), weights, rest = unpack_saved(ctx, lead=2)
        inputs, hs, cs = rest[:nl], rest[nl:2 * nl], rest[2 * nl:]
        T, B, H = g_out.shape
        grads: list = [None] * len(weights)
        g_h0, g_c0 = torch.empty_like(h0), torch.empty_like(c0)
        e, g_x = g_out, None
        for k in range(nl - 1, -1, -1):
            w_ih, w_hh = weights[k * per], weights[k * per + 1]
            b = weights[k * per + 2] + weights[k * per + 3] if cfg["bias"] else None
            x, w = inputs[k], w_hh.view(4, H)
            hp = torch.cat([h0[k][None], hs[k][:-1]])
            cp = torch.cat([c0[k][None], cs[k][:-1]])
            gi = F.linear(x, w_ih, b).view(T, B, 4, H)
            J, coef = hp.new_empty(T, B, H, 2, 2), hp.new_empty(T, B, 5, H)
            for blk in blocks(T, B * H, hp.device):
                scratch = torch.empty_like(hp[blk])
                lstm_linearize(gi[blk], hp[blk], cp[blk], w, scratch, torch.empty_like(scratch),
                               J[blk], coef[blk])
            lh, lc = _reverse_blocks(cfg, J, e, g_hn[k], g_cn[k])      # (T, B, H) each
            dc = torch.addcmul(lc, coef[:, :, 4], lh)
            dp = coef[:, :, :4]
            dp[:, :, :3].mul_(dc.unsqueeze(2))
            dp[:, :, 3].mul_(lh)                                        # (T, B, 4, H)
            grads[k * per + 1] = (dp * hp.unsqueeze(2)).sum((0, 1)).reshape(4 * H)
            d2 = dp.reshape(T * B, 4 * H)
            grads[k * per] = d2.t() @ x.reshape(T * B, -1)
            if cfg["bias"]:
                g_b = d2.sum(0)
                grads[k * per + 2], grads[k * per + 3] = g_b, g_b.clone()
            J0 = J[0]                                  # (dL/dh0, dL/dc0) = J_0^T (lh_0, lc_0)
            g_h0[k] = J0[..., 0, 0] * lh[0] + J0[..., 1, 0] * lc[0]
            g_c0[k] = J0[..., 0, 1] * lh[0] + J0[..., 1, 1] * lc[0]
            if k > 0 or ctx.needs_input_grad[1]:
                e = (d2 @ w_ih).reshape(T, B, -1)
                g_x = e if k == 0 else None
        return (None, g_x, g_h0 if ctx.needs_input_grad[2] else None,
                g_c0 if ctx.needs_input_grad[3] else None, *grads)


def _reverse_blocks(cfg, J, e, g_h, g_c):
    """``lam_t = (e_t, 0) + J_{t+1}^T lam_{t+1}``, ``lam_{T-1} = (e_{T-1} + g_h, g_c)``, per unit
    (``J`` ``(T, B, H, 2, 2)``): one reverse linear recurrence with ``2 x 2`` blocks, batch
    ``(B, H)``. Returns ``(lam_h, lam_c)``, time-major."""
    T = e.shape[0]
    last = torch.stack([e[-1] + g_h, g_c], -1)                         # (B, H, 2)
    if T == 1:
        return last[..., 0][None], last[..., 1][None]
    A = J[1:].permute(1, 2, 0, 4, 3)                                   # (B, H, T-1, 2, 2)^T
    b = torch.stack([e[:-1], torch.zeros_like(e[:-1])], -1).permute(1, 2, 0, 3)
    lam = solve_hidden(cfg, A, b, last)                                # (B, H, T-1, 2)
    lam = torch.cat([lam, last.unsqueeze(2)], 2).permute(2, 0, 1, 3)    # (T, B, H, 2)
    return lam[..., 0], lam[..., 1]
