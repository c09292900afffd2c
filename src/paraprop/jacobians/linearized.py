"""Recurrent cells linearized over a whole sequence: values and Jacobians on the hidden state.

:func:`cell_adapter` gives :class:`paraprop.Recurrence` (and through it the Newton solvers,
:mod:`paraprop.solvers.linearize`) the linearization of its cell at every step at once, in the
``"dense"``, ``"diag"`` or factored (``"any"``) form: analytic for torch's RNN, GRU and LSTM
cells (:class:`RNNCellJacobian`, :class:`GRUCellJacobian`, :class:`LSTMCellJacobian`, from the
formulas of :mod:`paraprop.jacobians.cells`), from ``cell.jacobian`` or autograd for any other
(:class:`GenericCell`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import _VF, nn

from paraprop.jacobians.cells import dense_jacobian, gru_linearize, lstm_linearize
from paraprop.scan import Factored


def cell_adapter(cell):
    """The linearization of ``cell`` for :class:`paraprop.Recurrence`: analytic for torch's RNN,
    GRU and LSTM cells (LSTM on the state ``[h, c]``) and the weights :mod:`paraprop.nn` hands
    over, autograd (or ``cell.jacobian``) for any other cell."""
    if isinstance(cell, AnalyticCell):   # weights handed over by paraprop.nn
        return cell
    if isinstance(cell, nn.GRUCell):
        return GRUCellJacobian(cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    if isinstance(cell, nn.RNNCell):
        return RNNCellJacobian(cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh,
                        cell.nonlinearity)
    if isinstance(cell, nn.LSTMCell):
        return LSTMCellJacobian(cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    return GenericCell(cell, getattr(cell, "hidden_size", None)
                    if not isinstance(getattr(cell, "hidden_size", None), bool) else None)


class GenericCell:
    """Any cell: values by calling it, Jacobians from ``cell.jacobian`` or autograd."""

    def __init__(self, cell, state_size):
        self.cell, self.state_size = cell, state_size

    def rows(self, u, h, rec):
        y = self.cell(u, h)
        if not isinstance(y, torch.Tensor) or y.shape != h.shape:
            raise ValueError(f"cell(input, hidden) must return a tensor shaped like hidden "
                             f"{tuple(h.shape)}, got "
                             f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y)}")
        return y

    def linearize(self, rec, prev, lo, form):
        B, n, H = prev.shape
        u = rec._inputs_from(lo)
        h = prev.reshape(-1, H)
        y = self.rows(u, h, rec).reshape(B, n, H)
        if form is None:
            return y, None
        jac = getattr(self.cell, "jacobian", None)
        if callable(jac):
            J = jac(u, h)
            if not isinstance(J, torch.Tensor) or tuple(J.shape) != (h.shape[0], H, H):
                raise ValueError(f"cell.jacobian(input, hidden) must return ({h.shape[0]}, {H}, "
                                 f"{H}), got {getattr(J, 'shape', type(J))}")
        else:
            J = autograd_jacobian(lambda hh, uu: self.cell(uu, hh), h, u)
        J = J.reshape(B, n, H, H)
        return y, (J.diagonal(dim1=-2, dim2=-1) if form == "diag" else J)


def autograd_jacobian(f, h, u):
    """``J[n] = d f(h_n, u_n) / d h_n`` by one batched backward over ``H`` copies of the rows."""
    N, H = h.shape
    hr = h.detach().repeat(H, 1).requires_grad_(True)
    ur = None if u is None else u.detach().repeat(H, 1)
    eye = torch.eye(H, dtype=h.dtype, device=h.device)
    with torch.enable_grad():
        y = f(hr, ur)
        if not y.requires_grad:                         # the output ignores the state
            return h.new_zeros(N, H, H)
        (g,) = torch.autograd.grad(y, hr, eye[:, None, :].expand(H, N, H).reshape(H * N, H),
                                   allow_unused=True)
    if g is None:
        return h.new_zeros(N, H, H)
    return g.reshape(H, N, H).transpose(0, 1)          # [n, i, j] = d y_i / d h_j


class AnalyticCell:
    """Cells with analytic Jacobians; callable like a torch cell."""

    # the torch cell's weights and biases (set by each subclass)
    w_ih: torch.Tensor
    w_hh: torch.Tensor
    b_ih: torch.Tensor | None
    b_hh: torch.Tensor | None

    def __call__(self, u, h):
        return self.rows(u, h, None)

    def parameters(self):
        return [t for t in (self.w_ih, self.w_hh, self.b_ih, self.b_hh) if t is not None]


class RNNCellJacobian(AnalyticCell):
    """``h' = act(W_ih u + b_ih + W_hh h + b_hh)``: ``J = diag(act') W_hh``."""

    def __init__(self, w_ih, w_hh, b_ih, b_hh, nonlinearity):
        self.w_ih, self.w_hh, self.b_ih, self.b_hh = w_ih, w_hh, b_ih, b_hh
        self.tanh = nonlinearity == "tanh"
        self.state_size = w_hh.shape[0]

    def rows(self, u, h, rec):
        run = _VF.rnn_tanh_cell if self.tanh else _VF.rnn_relu_cell
        return run(u, h, self.w_ih, self.w_hh, self.b_ih, self.b_hh)

    def linearize(self, rec, prev, lo, form):
        with torch.no_grad():
            pre = input_terms(rec, lambda u: F.linear(u, self.w_ih, self.b_ih))
            z = F.linear(prev, self.w_hh, self.b_hh).add_(pre[:, lo:])
            y = torch.tanh(z) if self.tanh else torch.relu(z)
            if form is None:
                return y, None
            slope = (1 - y * y) if self.tanh else (z > 0).to(y.dtype)
            if form == "diag":
                return y, slope * self.w_hh.diagonal()
            J = Factored(scale=slope, right=self.w_hh)   # diag(slope) W_hh, K = H
            return y, (J if form == "any" else dense_jacobian(J))


class GRUCellJacobian(AnalyticCell):
    """torch's GRU cell; ``J = diag(z) + [I I I] diag(c) W_hh`` (BPPSA Appendix E, transposed):
    ``c = [dn * gh_n * r(1-r); (h - n) z(1-z); dn * r]`` with ``dn = (1-z)(1-n^2)``."""

    def __init__(self, w_ih, w_hh, b_ih, b_hh):
        self.w_ih, self.w_hh, self.b_ih, self.b_hh = w_ih, w_hh, b_ih, b_hh
        self.state_size = w_hh.shape[1]

    def rows(self, u, h, rec):
        return _VF.gru_cell(u, h, self.w_ih, self.w_hh, self.b_ih, self.b_hh)

    def linearize(self, rec, prev, lo, form):
        with torch.no_grad():
            pre = input_terms(rec, lambda u: F.linear(u, self.w_ih, self.b_ih))
            return gru_linearize(pre[:, lo:], prev, self.w_hh, self.b_hh, form)


class LSTMCellJacobian(AnalyticCell):
    """torch's LSTM cell on the state ``[h, c]`` (``2H``); its Jacobian is the
    :class:`paraprop.scan.LSTMFactored` of :func:`lstm_scale`'s factors."""

    def __init__(self, w_ih, w_hh, b_ih, b_hh):
        self.w_ih, self.w_hh, self.b_ih, self.b_hh = w_ih, w_hh, b_ih, b_hh
        self.state_size = 2 * w_hh.shape[1]

    def rows(self, u, s, rec):
        H = self.w_hh.shape[1]
        h, c = _VF.lstm_cell(u, (s[:, :H], s[:, H:]), self.w_ih, self.w_hh, self.b_ih,
                             self.b_hh)
        return torch.cat([h, c], -1)

    def linearize(self, rec, prev, lo, form):
        with torch.no_grad():
            pre = input_terms(rec, lambda u: F.linear(u, self.w_ih, self.b_ih))
            return lstm_linearize(pre[:, lo:], prev, self.w_hh, self.b_hh, form)


def input_terms(rec, fn):
    """The per-step input terms ``fn(u)`` ``(B, T, .)``, computed once per Recurrence."""
    if rec._pre is None:
        rec._pre = fn(rec._u)
    return rec._pre
