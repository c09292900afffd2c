"""Dense transposed Jacobians of recurrent cells w.r.t. the hidden state (BPPSA, Appendix E).

For ``h' = cell(x, h)`` (one sample, vectors) they return ``J^T = (dh'/dh)^T`` of shape
``(H, H)`` with ``J^T[i, j] = dh'_j / dh_i``.
"""

from __future__ import annotations

import torch
from torch import nn


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
    """PyTorch's GRU cell:

    ``r = s(W_ir x + b_ir + W_hr h + b_hr)``, ``z = s(W_iz x + b_iz + W_hz h + b_hz)``,
    ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``, ``h' = (1 - z) n + z h``, so

    ``dh'/dh = diag(1 - z) dn/dh + diag(h - n) dz/dh + diag(z)`` with
    ``dz/dh = diag(z (1 - z)) W_hz``, ``dr/dh = diag(r (1 - r)) W_hr`` and
    ``dn/dh = diag(1 - n^2) (diag(r) W_hn + diag(W_hn h + b_hn) dr/dh)``.
    """
    H = cell.hidden_size
    with torch.no_grad():
        gi = x @ cell.weight_ih.t() + (cell.bias_ih if cell.bias else 0)
        hh = h @ cell.weight_hh.t() + (cell.bias_hh if cell.bias else 0)
        i_r, i_z, i_n = gi.split(H)
        h_r, h_z, h_n = hh.split(H)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        W_r, W_z, W_n = cell.weight_hh.split(H)
        dz = (z * (1 - z))[:, None] * W_z
        dr = (r * (1 - r))[:, None] * W_r
        dn = (1 - n * n)[:, None] * (r[:, None] * W_n + h_n[:, None] * dr)
        J = (1 - z)[:, None] * dn + (h - n)[:, None] * dz + torch.diag(z)
        return J.t()
