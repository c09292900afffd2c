"""Dense transposed Jacobians of recurrent cells w.r.t. the hidden state (BPPSA, Appendix E).

For ``h' = cell(x, h)`` (one sample, vectors) they return ``J^T = (dh'/dh)^T`` of shape
``(H, H)`` with ``J^T[i, j] = dh'_j / dh_i``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
    """PyTorch's GRU cell, from the one factored GRU Jacobian of the library
    (:func:`paraprop.recurrence.gru_linearize`): ``dh'/dh = diag(z) + diag(s) [W_hr; W_hz; W_hn]``
    summed over the three gate blocks, with ``s`` the gate sensitivities (BPPSA Appendix E)."""
    from paraprop.recurrence import gru_linearize

    with torch.no_grad():
        gi = F.linear(x, cell.weight_ih, cell.bias_ih if cell.bias else None)
        _, J = gru_linearize(gi[None, None], h[None, None], cell.weight_hh,
                             cell.bias_hh if cell.bias else None, "dense")
        return J[0, 0].t()
