"""ParaLSTM's layers (:class:`paraprop.nn.ParaLSTM`): the recurrence :func:`paraprop.solve`
runs, the sequential loop, one layer's forward and the autograd Function of the stack.

Every unit is a recurrence of its own (the units are independent given ``gi``), so the states
are laid out ``(B, H, T, 2)`` (``(h, c)`` of one unit per position) and the Jacobians are dense
``2 x 2`` per unit and step, ``(B, H, T, 2, 2)`` (:mod:`paraprop.jacobians.diagonal`); the
forward and its Triton warm start are :mod:`paraprop.nn.para_solve`'s. Backward: ``lam_t =
(e_t, 0) + J_{t+1}^T lam_{t+1}`` is one reverse linear recurrence with ``2 x 2`` blocks
transposed; then the gradients of the pre-activations follow from the coefficients of
:func:`~paraprop.jacobians.diagonal.lstm_linearize`, and every weight gradient is a sum over
steps or one matrix product, as ParaGRU's (:mod:`paraprop.nn.para_gru`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraprop.jacobians import diagonal
from paraprop.jacobians.diagonal import (
    LSTM_SCRATCH,
    blocks,
    lstm_linearize,
    lstm_newton_block,
    lstm_step,
)
from paraprop.nn import stack, triton_cells
from paraprop.nn.para_solve import DiagonalRecurrence, per_block, scratch, solve_recurrence
from paraprop.nn.rnn import solve_hidden
from paraprop.scan import linear_recurrence, native

__all__ = ["LSTMRecurrence", "ParaLSTMFunction", "lstm_layer", "lstm_loop"]


class LSTMRecurrence(DiagonalRecurrence):
    """One ParaLSTM layer as ``fn`` of :func:`paraprop.solve`, one recurrence per unit: states
    ``(B, H, T, 2)`` (``(h, c)``), Jacobians ``(B, H, T, 2, 2)`` (``"any"`` and ``"dense"``,
    exact) or their diagonals ``(B, H, T, 2)`` (``"diag"``, quasi-Newton).

    The input terms are kept gate-major and the blocks of steps are computed on contiguous
    ``(B, H, steps)`` arrays (:func:`~paraprop.jacobians.diagonal.lstm_newton_block`), then
    interleaved into the ``(h, c)`` layout of the solver. The fused step ``newton_step`` of
    :mod:`paraprop.solvers.newton` works as
    :class:`~paraprop.nn.para_gru.GRURecurrence`'s, with the ``2 x 2`` blocks' recurrence.

    Arguments:
        gi: the input terms ``W_ih x + b_ih + b_hh``, ``(4, B, H, T)`` (gates i, f, g, o), or
            ``None`` with ``inputs``.
        h0: ``(B, H, 2)``.
        w: the diagonal weights ``(4, H)``.
        inputs: ``(x, w_ih, b)`` (``x`` ``(B, T, I)``, ``b = b_ih + b_hh`` or ``None``)
            instead of ``gi``: the input terms formed block by block, as for
            :class:`~paraprop.nn.para_gru.GRURecurrence`.
        kernel: as :class:`~paraprop.nn.para_gru.GRURecurrence`.
    """

    fused_forms = ("any",)

    def __init__(self, gi: torch.Tensor | None, h0: torch.Tensor, w: torch.Tensor, *,
                 inputs: tuple | None = None, kernel: str | None = None):
        if (gi is None) == (inputs is None):
            raise ValueError("LSTMRecurrence: pass either gi or inputs=(x, w_ih, b)")
        self._gi4: torch.Tensor | None = None
        self._x = None
        if inputs is not None:
            x, w_ih, b = inputs
            self._x, self._w_ih = x.detach(), w_ih.detach()
            self._b_ih = None if b is None else b.detach().view(-1, 1)
            T = x.shape[1]
        else:
            assert gi is not None           # exactly one of gi, inputs (checked above)
            self._gi4, T = gi.detach(), gi.shape[-1]
        self._w = w.detach().reshape(4, 1, -1, 1)                # broadcasts on (4, B, H, steps)
        super().__init__(None, h0, length=T, kernel=kernel)
        self._units = tuple(self.batch_shape)                   # (B, H)
        self._scratch: torch.Tensor | None = None               # one block's temporaries
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None   # newton_step's y, trial

    def _inputs_at(self, idx):                                  # (4, B, H, k), for _cell
        if self._gi4 is not None:
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
        :meth:`paraprop.nn.para_gru.GRURecurrence.newton_step`, for the exact ``2 x 2``
        blocks (``form="any"``; ``None`` otherwise): ``(y, trial)``, ``(B * H, T - lo, 2)``
        views of arrays that the next call overwrites."""
        if form != "any":
            return None
        B, H = self._units
        N, T = B * H, self.T
        if self._out is None:
            self._out = (torch.empty_like(xc), torch.empty_like(xc))
        kernel = self.step_kernel = self._step_kernel(xc)
        if kernel == "triton":
            assert self._gi4 is not None    # the Triton step needs them stored (_step_kernel)
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
        buf = scratch(self, keep, need, xc)
        x, gi4 = self._x, self._gi4
        for p0, p1 in spans:
            if gi4 is not None:
                gi = gi4[..., p0:p1]
            else:                                   # the inputs: exactly one of the two is kept
                assert x is not None
                m = N * (p1 - p0)
                out = buf[(LSTM_SCRATCH + 6) * m:units * m].view(self._units[0], -1, p1 - p0)
                gi = self._input_terms(x[:, p0:p1], out)
            yield p0, p1, gi, buf

    def _prev(self, xc: torch.Tensor, p0: int, p1: int) -> torch.Tensor:
        """``(h, c)`` at ``t - 1`` for ``t`` in ``[p0, p1)``, ``(B, H, p1 - p0, 2)``."""
        B, H = self._units
        x = xc.view(B, H, self.T, 2)
        if p0 > 0:
            return x[:, :, p0 - 1:p1 - 1]
        return torch.cat([self._h0.view(B, H, 1, 2), x[:, :, :p1 - 1]], 2)


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
    if per_block(cfg, x):
        rec = LSTMRecurrence(None, hc0, w, inputs=(x.transpose(0, 1), w_ih, b))
    else:               # gi (4, B, H, T): the loop's input terms, bitwise (the same product)
        T, B = x.shape[:2]
        gi = F.linear(x, w_ih, b).view(T, B, 4, H).permute(2, 1, 3, 0).contiguous()
        rec = LSTMRecurrence(gi, hc0, w)
    s = solve_recurrence(cfg, rec).permute(3, 2, 0, 1).contiguous()            # (2, T, B, H)
    return s[0], s[1]         # contiguous time-major, as the loop's (see gru_layer)


class ParaLSTMFunction(torch.autograd.Function):
    """Forward: every layer by :func:`lstm_layer`. Backward: see the module doc."""

    @staticmethod
    def layers(cfg, x, h0, c0, weights):
        inputs, hs, cs, layer_in = [], [], [], x
        for k in range(cfg["layers"]):
            w = stack.layer_weights(weights, k, cfg["bias"])
            h, c = lstm_layer(cfg, layer_in, h0[k], c0[k], w[0], w[1], _bias(w))
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
    @stack.first_order_only
    def backward(ctx, g_out, g_hn, g_cn):
        cfg, nl, (h0, c0), weights, rest = stack.unpack_saved(ctx, lead=2)
        inputs, hs, cs = rest[:nl], rest[nl:2 * nl], rest[2 * nl:]
        T, B, H = g_out.shape
        grads: list = [None] * len(weights)
        g_h0, g_c0 = torch.empty_like(h0), torch.empty_like(c0)
        e, g_x = g_out, None
        for k in range(nl - 1, -1, -1):
            lw = stack.layer_weights(weights, k, cfg["bias"])
            w_ih, w_hh, b = lw[0], lw[1], _bias(lw)
            x, w = inputs[k], w_hh.view(4, H)
            hp, cp = stack.shifted(h0[k], hs[k]), stack.shifted(c0[k], cs[k])
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
            d2 = dp.reshape(T * B, 4 * H)
            g_b = d2.sum(0) if cfg["bias"] else None
            stack.store_grads(grads, k, cfg["bias"], d2.t() @ x.reshape(T * B, -1),
                              (dp * hp.unsqueeze(2)).sum((0, 1)).reshape(4 * H), g_b,
                              None if g_b is None else g_b.clone())
            J0 = J[0]                                  # (dL/dh0, dL/dc0) = J_0^T (lh_0, lc_0)
            g_h0[k] = J0[..., 0, 0] * lh[0] + J0[..., 1, 0] * lc[0]
            g_c0[k] = J0[..., 0, 1] * lh[0] + J0[..., 1, 1] * lc[0]
            if k > 0 or ctx.needs_input_grad[1]:
                e = (d2 @ w_ih).reshape(T, B, -1)
                g_x = e if k == 0 else None
        return (None, g_x, g_h0 if ctx.needs_input_grad[2] else None,
                g_c0 if ctx.needs_input_grad[3] else None, *grads)


def _bias(w: list[torch.Tensor]) -> torch.Tensor | None:
    """The one bias of a ParaLSTM layer's cell, ``b_ih + b_hh`` (``None`` without bias)."""
    b_ih, b_hh = stack.biases(w)
    return None if b_ih is None or b_hh is None else b_ih + b_hh


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
