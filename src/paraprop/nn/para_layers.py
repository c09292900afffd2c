"""The layers of :class:`paraprop.nn.ParaGRU` / :class:`~paraprop.nn.ParaLSTM`: forward by a loop or
by :func:`paraprop.solve` on a diagonal :class:`paraprop.Recurrence`, backward by a scan.

Forward, per layer: the input terms ``gi = W_ih x + b`` of all steps in one matrix product, then
either the sequential loop (``forward="sequential"``) or Newton's method (or any method of
:func:`paraprop.solve`) on the layer's recurrence. The recurrences below are
:class:`paraprop.Recurrence` objects whose Jacobians come from
:mod:`paraprop.jacobians.diagonal`: for ParaGRU the states are ``(B, T, H)`` with diagonal
Jacobians ``(B, T, H)``; for ParaLSTM every unit is a recurrence of its own (the units are
independent given ``gi``), so the states are laid out ``(B, H, T, 2)`` (``(h, c)`` of one unit
per position) and the Jacobians are dense ``2 x 2`` per unit and step, ``(B, H, T, 2, 2)``: both
forms :func:`paraprop.scan.linear_recurrence` runs in ``O(T H)`` (its native kernels on the CPU).
Exact Newton stops on the size of its step (the linearised error), as for every recurrence.

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

from paraprop.jacobians.diagonal import blocks, gru_linearize, gru_step, lstm_linearize, lstm_step
from paraprop.nn._base import first_order_only, unpack_saved
from paraprop.nn.rnn import solve_hidden
from paraprop.recurrence import Recurrence


# -- the recurrences solved by paraprop.solve -----------------------------------------------------
class _DiagonalRecurrence(Recurrence):
    """A :class:`paraprop.Recurrence` of input terms ``gi`` whose linearization is analytic
    (:mod:`paraprop.jacobians.diagonal`): the subclasses define ``_cell`` (rows, for the
    sequential and Jacobi-type methods) and ``linearize`` (blocks of steps, for Newton)."""

    def __init__(self, gi: torch.Tensor | None, h0: torch.Tensor, length: int | None = None):
        super().__init__(self._cell, gi, h0, length=length, params=[])
        self._adapter = self

    def rows(self, u, h, rec):
        return self._cell(u, h)

    def attach(self, value):
        """The solution as is: the modules differentiate it themselves (scan backward)."""
        return value


class GRURecurrence(_DiagonalRecurrence):
    """One ParaGRU layer as ``fn`` of :func:`paraprop.solve`: states ``(B, T, H)``, diagonal
    Jacobians (``"any"`` and ``"diag"`` are the same, exact form).

    Arguments:
        gi: the input terms ``W_ih x + b_ih`` ``(B, T, 3H)``.
        h0: ``(B, H)``.
        w, b: the diagonal weights and hidden bias, ``(3, H)`` (``b`` may be ``None``).
    """

    def __init__(self, gi: torch.Tensor, h0: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor | None):
        self._w, self._b = w.detach(), None if b is None else b.detach()
        super().__init__(gi, h0)
        self._gi = self._u.view(self.B, self.T, 3, self.H)

    def _cell(self, u, h):
        return gru_step(u.unflatten(-1, (3, -1)), h, self._w, self._b)

    def linearize(self, xc: torch.Tensor, lo: int, form: str | None):
        """``fn(x)`` at positions ``[lo, T)`` and the diagonals of its Jacobians there (also
        for ``form="any"``: they are exact); ``"dense"`` embeds them ``(B, n, H, H)``."""
        B, T, H = self.B, self.T, self.H
        y = xc.new_empty(B, T - lo, H)
        a = None if form is None else torch.empty_like(y)
        for blk in blocks(T - lo, B * H, xc.device):
            p0, p1 = lo + blk.start, lo + blk.stop
            gru_linearize(self._gi[:, p0:p1], self._prev(xc, p0, p1), self._w, self._b, y[:, blk],
                          None if a is None else a[:, blk])
        if form == "dense":
            a = torch.diag_embed(a)
        return y, a

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
    ``(B, H, steps)`` arrays, then interleaved into the ``(h, c)`` layout of the solver.

    Arguments:
        gi: the input terms ``W_ih x + b_ih + b_hh``, ``(4, B, H, T)`` (gates i, f, g, o).
        h0: ``(B, H, 2)``.
        w: the diagonal weights ``(4, H)``.
    """

    def __init__(self, gi: torch.Tensor, h0: torch.Tensor, w: torch.Tensor):
        self._gi4 = gi.detach()
        self._w = w.detach().reshape(4, 1, -1, 1)                # broadcasts on (4, B, H, steps)
        super().__init__(None, h0, length=gi.shape[-1])
        self._units = tuple(self.batch_shape)                   # (B, H)

    def _inputs_at(self, idx):
        return self._gi4.index_select(-1, idx)                   # (4, B, H, k), for _cell

    def _cell(self, u, s):
        B, H = self._units
        hc = s.reshape(B, H, -1, 2).permute(3, 0, 1, 2)
        out = hc.new_empty(hc.shape)
        lstm_linearize(u, hc[0], hc[1], self._w, out[0], out[1], dim=0)
        return out.permute(1, 2, 3, 0).reshape(-1, 2)

    def linearize(self, xc: torch.Tensor, lo: int, form: str | None):
        B, H = self._units
        T, n = self.T, self.T - lo
        x = xc.view(B, H, T, 2)
        y = xc.new_empty(B, H, n, 2)
        J = None if form is None else xc.new_empty(B, H, n, 2, 2)
        for blk in blocks(n, B * H, xc.device):
            p0, p1 = lo + blk.start, lo + blk.stop
            prev = x[:, :, p0 - 1:p1 - 1] if p0 > 0 else torch.cat(
                [self._h0.view(B, H, 1, 2), x[:, :, :p1 - 1]], 2)
            hc = prev.permute(3, 0, 1, 2).contiguous()          # (2, B, H, steps)
            out = torch.empty_like(hc)
            Jc = None if J is None else hc.new_empty(2, 2, *hc.shape[1:])
            lstm_linearize(self._gi4[..., p0:p1], hc[0], hc[1], self._w, out[0], out[1],
                           None if Jc is None else Jc.permute(2, 3, 4, 0, 1), dim=0)
            y[:, :, blk] = out.permute(1, 2, 3, 0)
            if J is not None:
                J[:, :, blk] = Jc.permute(2, 3, 4, 0, 1)
        y = y.view(B * H, n, 2)
        if J is None:
            return y, None
        J = J.view(B * H, n, 2, 2)
        return y, (J.diagonal(dim1=-2, dim2=-1) if form == "diag" else J)


def _solve(cfg: dict, rec: Recurrence) -> torch.Tensor:
    """``rec``'s states by ``cfg["forward"]`` (a :class:`~paraprop.nn.ParallelForward`),
    recording the solve in ``cfg["forward_stats"]`` (one entry per layer)."""
    from paraprop.solve import solve

    fwd = cfg["forward"]
    sol = solve(rec, rec.zeros(), method=fwd.solver, dim=-2, tol=cfg["forward_tol"],
                max_iters=fwd.max_iters, throw=fwd.throw)
    record = cfg["forward_stats"]
    for key, value in (("iterations", sol.iterations),
                       ("residual", float(sol.residuals[-1]) if len(sol.residuals) else 0.0),
                       ("resets", sol.stats.get("resets", 0)),
                       ("error_estimate", sol.stats["error_estimate"]),
                       ("converged", sol.converged),
                       ("tol", cfg["forward_tol"])):
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
    gi = F.linear(x.transpose(0, 1), w_ih, b_ih)                       # (B, T, 3H)
    return _solve(cfg, GRURecurrence(gi, h0, w, b)).transpose(0, 1)


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
    gi = torch.matmul(w_ih.view(4, 1, H, -1), x.permute(1, 2, 0))      # (4, B, H, T)
    if b is not None:
        gi += b.view(4, 1, H, 1)
    rec = LSTMRecurrence(gi, torch.stack([h0, c0], -1), w_hh.view(4, H))
    s = _solve(cfg, rec).permute(2, 0, 1, 3)                         # (T, B, H, 2)
    return s[..., 0], s[..., 1]


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
