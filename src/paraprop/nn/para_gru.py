"""ParaGRU's layers (:class:`paraprop.nn.ParaGRU`): the recurrence :func:`paraprop.solve` runs,
the sequential loop, one layer's forward and the autograd Function of the stack.

The states are ``(B, T, H)`` with diagonal Jacobians ``(B, T, H)``
(:mod:`paraprop.jacobians.diagonal`); the forward and its Triton warm start are
:mod:`paraprop.nn.para_solve`'s. Backward: ``lam_t = e_t + a_{t+1} lam_{t+1}`` is one reverse
diagonal linear recurrence; then the gradients of the pre-activations are ``coef * lam`` (the
coefficients of :func:`~paraprop.jacobians.diagonal.gru_linearize`), and every weight gradient
is a sum over steps or one matrix product: ``dw_hh = sum dgh * h_prev``, ``dW_ih = dgi^T x``,
``dx = dgi W_ih``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraprop.jacobians import diagonal
from paraprop.jacobians.diagonal import (
    GRU_SCRATCH,
    blocks,
    gru_linearize,
    gru_newton_block,
    gru_step,
)
from paraprop.nn import stack, triton_cells
from paraprop.nn.para_solve import DiagonalRecurrence, per_block, scratch, solve_recurrence
from paraprop.nn.rnn import solve_hidden
from paraprop.scan import linear_recurrence, native

__all__ = ["GRURecurrence", "ParaGRUFunction", "gru_layer", "gru_loop"]


class GRURecurrence(DiagonalRecurrence):
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
        kernel: the fused step's, as :class:`DiagonalRecurrence` (``"triton"``: a warm
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
            assert self._u is not None      # the input terms gi, as given
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
        if form == "dense" and a is not None:
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
        buf = scratch(self, keep, need, xc)
        for p0, p1 in spans:
            m = B * (p1 - p0) * H
            parts = buf[:units * m].split([GRU_SCRATCH * m, m, m,
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
    if per_block(cfg, x):
        rec = GRURecurrence(None, h0, w, b, inputs=(x.transpose(0, 1), w_ih, b_ih))
    else:               # gi (B, T, 3H): the loop's input terms, bitwise (the same product)
        gi = F.linear(x, w_ih, b_ih).transpose(0, 1).contiguous()
        rec = GRURecurrence(gi, h0, w, b)
    # contiguous time-major, as the loop's: the next layer's input product then rounds alike
    return solve_recurrence(cfg, rec).transpose(0, 1).contiguous()


class ParaGRUFunction(torch.autograd.Function):
    """Forward: every layer by :func:`gru_layer`. Backward: see the module doc."""

    @staticmethod
    def layers(cfg, x, h0, weights):
        inputs, outs, layer_in = [], [], x
        for k in range(cfg["layers"]):
            w = stack.layer_weights(weights, k, cfg["bias"])
            out = gru_layer(cfg, layer_in, h0[k], w[0], w[1], *stack.biases(w))
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
    @stack.first_order_only
    def backward(ctx, g_out, g_hn):
        cfg, nl, (h0,), weights, rest = stack.unpack_saved(ctx, lead=1)
        inputs, outs = rest[:nl], rest[nl:]
        T, B, H = g_out.shape
        grads: list = [None] * len(weights)
        g_h0 = torch.empty_like(h0)
        e, g_x = g_out, None
        for k in range(nl - 1, -1, -1):
            lw = stack.layer_weights(weights, k, cfg["bias"])
            (w_ih, w_hh), (b_ih, b_hh) = lw[:2], stack.biases(lw)
            x = inputs[k]
            prev = stack.shifted(h0[k], outs[k])
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
            d2 = dgi.reshape(T * B, 3 * H)
            g_bi = g_bh = None
            if cfg["bias"]:
                g_bi = d2.sum(0)
                g_bh = torch.cat([g_bi[:2 * H], dghn.sum((0, 1))])
            stack.store_grads(grads, k, cfg["bias"], d2.t() @ x.reshape(T * B, -1),
                              g_w.reshape(3 * H), g_bi, g_bh)
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
