"""The Jacobians of recurrent cells w.r.t. the hidden state, each written once (BPPSA,
Appendix E).

* :func:`rnn_cell`, :func:`gru_cell`: for ``h' = cell(x, h)`` (one sample, vectors) the dense
  ``J^T = (dh'/dh)^T`` of shape ``(H, H)`` with ``J^T[i, j] = dh'_j / dh_i`` (BPPSA's
  per-layer Jacobians);
* :func:`gru_gates`, :func:`gru_scale`: the GRU gates and gate sensitivities of many steps at
  once, the factors of ``dh'/dh = diag(z) + diag(s) [W_hr; W_hz; W_hn]`` that
  :mod:`paraprop.nn`'s scan backward uses;
* :func:`cell_adapter` and the classes after it: the batched linearization of a cell over a
  whole sequence (values and Jacobians in the ``"dense"``, ``"diag"`` or factored form) that
  :class:`paraprop.Recurrence` and the Newton solvers use: analytic for RNN and GRU cells,
  autograd for any other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import _VF, nn

from paraprop.scan import Factored


def gru_gates(gi: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor, b_hh, *,
              scratch: bool = False):
    """The gates of GRU steps, the one place they are computed for a Jacobian.

    Arguments:
        gi: the input terms ``W_ih u + b_ih`` ``(..., 3H)``; read only, unless ``scratch``
            (the caller's own temporary: the gates are then computed in it, saving a copy).
        h: the previous states ``(..., H)``.
        w_hh, b_hh: the hidden weights ``(3H, H)`` and bias ``(3H,)`` (or ``None``).

    Returns:
        ``(r, z, ghn, n)``: the reset and update gates, ``W_hn h + b_hn`` and the candidate
        ``n = tanh(gi_n + r ghn)``, each ``(..., H)`` (views of fresh tensors).
    """
    H = h.shape[-1]
    gh = F.linear(h, w_hh, b_hh)
    rz = gi[..., : 2 * H]
    rz = (rz.add_ if scratch else rz.add)(gh[..., : 2 * H]).sigmoid_()
    ghn = gh[..., 2 * H :]
    n = torch.addcmul(gi[..., 2 * H :], rz[..., :H], ghn).tanh_()
    return rz[..., :H], rz[..., H:], ghn, n


def gru_scale(r, z, ghn, n, h, out: torch.Tensor) -> torch.Tensor:
    """The gate sensitivities of GRU steps (BPPSA Appendix E): writes
    ``s = [dn ghn r (1 - r); (h - n) z (1 - z); dn r]`` into ``out`` ``(..., 3H)``, so that
    ``dh'/dh = diag(z) + diag(s) [W_hr; W_hz; W_hn]`` summed over the three gate blocks, and
    returns ``dn = (1 - z)(1 - n^2)`` (``dh'`` by the candidate's pre-activation)."""
    H = h.shape[-1]
    omz = torch.rsub(z, 1)
    dn = torch.mul(n, n).neg_().add_(1).mul_(omz)
    torch.mul(dn, r, out=out[..., 2 * H :])
    torch.mul(out[..., 2 * H :], ghn, out=out[..., :H]).mul_(torch.rsub(r, 1))
    torch.sub(h, n, out=out[..., H : 2 * H]).mul_(z).mul_(omz)
    return dn


def rnn_cell(cell: nn.RNNCell, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``h' = act(W_ih x + b_ih + W_hh h + b_hh)``: ``J^T = W_hh^T diag(act'(.))``."""
    with torch.no_grad():
        h_new = cell(x[None], h[None])[0]
        if cell.nonlinearity == "tanh":
            d = 1 - h_new * h_new
        else:
            d = (h_new > 0).to(h.dtype)
        return cell.weight_hh.t() * d[None, :]


def gru_cell(cell: nn.GRUCell, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """PyTorch's GRU cell, from the one factored GRU Jacobian of the library
    (:func:`gru_linearize`): ``dh'/dh = diag(z) + diag(s) [W_hr; W_hz; W_hn]``
    summed over the three gate blocks, with ``s`` the gate sensitivities (BPPSA Appendix E)."""
    with torch.no_grad():
        gi = F.linear(x, cell.weight_ih, cell.bias_ih if cell.bias else None)
        _, J = gru_linearize(gi[None, None], h[None, None], cell.weight_hh,
                             cell.bias_hh if cell.bias else None, "dense")
        return J[0, 0].t()


# -- batched linearizations of recurrent cells (paraprop.Recurrence, paraprop.nn) ------------
# Rows (samples x steps) per block of the fused cell + Jacobian pass on the CPU: the ~20
# elementwise operations then run on cache-resident blocks instead of streaming the whole array.
BLOCK_ROWS = 8192


def cell_adapter(cell):
    """The linearization of ``cell`` for :class:`paraprop.Recurrence`: analytic for torch's RNN
    and GRU cells (and the weights :mod:`paraprop.nn` hands over), autograd (or
    ``cell.jacobian``) for any other cell, LSTM cells on the state ``[h, c]``."""
    if isinstance(cell, RNNCellJacobian | GRUCellJacobian):   # weights handed over by paraprop.nn
        return cell
    if isinstance(cell, nn.GRUCell):
        return GRUCellJacobian(cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    if isinstance(cell, nn.RNNCell):
        return RNNCellJacobian(cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh,
                        cell.nonlinearity)
    if isinstance(cell, nn.LSTMCell):
        return GenericCell(LSTMRows(cell), 2 * cell.hidden_size)
    return GenericCell(cell, getattr(cell, "hidden_size", None)
                    if not isinstance(getattr(cell, "hidden_size", None), bool) else None)


class LSTMRows:
    """An ``nn.LSTMCell`` on the concatenated state ``[h, c]``."""

    def __init__(self, cell: nn.LSTMCell):
        self.cell = cell
        self.jacobian = None

    def __call__(self, u, s):
        h, c = s.chunk(2, dim=-1)
        h2, c2 = self.cell(u, (h.contiguous(), c.contiguous()))
        return torch.cat([h2, c2], -1)


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


def gru_linearize(gi, prev, w_hh, b_hh, form):
    """GRU states ``y = cell(prev)`` and their Jacobians in ``form`` from the input terms
    ``gi = W_ih u + b_ih`` ``(B, n, 3H)`` and the previous states ``prev`` ``(B, n, H)`` (both
    may be strided views; they are read block by block along time, never copied whole)."""
    B, n, H = prev.shape
    y = prev.new_empty(B, n, H)
    z = s = a = None
    if form is not None:
        if form == "diag":
            a = prev.new_empty(B, n, H)
            wd = w_hh.reshape(3, H, H).diagonal(dim1=-2, dim2=-1)      # (3, H) diag of blocks
        else:
            z, s = prev.new_empty(B, n, H), prev.new_empty(B, n, 3 * H)
    step = n if prev.device.type != "cpu" else max(1, BLOCK_ROWS // B)
    for t0 in range(0, n, step):
        blk = slice(t0, min(n, t0 + step))
        h = prev[:, blk]
        r, zb, ghn, nn_ = gru_gates(gi[:, blk], h, w_hh, b_hh)
        d = torch.sub(h, nn_)
        torch.addcmul(nn_, zb, d, out=y[:, blk])
        if form is None:
            continue
        if form == "diag":   # z + sum over the three blocks of c_k * diag(W_hh block k)
            omz = torch.rsub(zb, 1)
            cn = torch.mul(nn_, nn_).neg_().add_(1).mul_(omz).mul_(r)
            cr = torch.mul(cn, ghn).mul_(torch.rsub(r, 1))
            cz = d.mul_(zb).mul_(omz)
            torch.addcmul(zb, cr, wd[0], out=a[:, blk]).addcmul_(cz, wd[1]).addcmul_(cn, wd[2])
            continue
        z[:, blk] = zb
        gru_scale(r, zb, ghn, nn_, h, s[:, blk])
    if form is None:
        return y, None
    if form == "diag":
        return y, a
    J = Factored(scale=s, right=w_hh, diag=z)
    return y, (J if form == "any" else dense_jacobian(J))


def dense_jacobian(J: Factored) -> torch.Tensor:
    """``diag(d) + L diag(s) R`` as ``(B, n, H, H)`` (L = None: identity blocks side by side)."""
    s, R = J.scale, J.right
    K, H = R.shape
    if J.left is None:
        out = (s.unflatten(-1, (K // H, H)).unsqueeze(-1) * R.reshape(K // H, H, H)).sum(-3)
    else:
        out = torch.einsum("hk,bnk,kj->bnhj", J.left, s, R)
    if J.diag is not None:
        out = out + torch.diag_embed(J.diag)
    return out


def input_terms(rec, fn):
    """The per-step input terms ``fn(u)`` ``(B, T, .)``, computed once per Recurrence."""
    if rec._pre is None:
        rec._pre = fn(rec._u)
    return rec._pre
