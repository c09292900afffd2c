"""Dense transposed Jacobians of recurrent cells w.r.t. the hidden state (BPPSA, Appendix E).

For ``h' = cell(x, h)`` (one sample, vectors) they return ``J^T = (dh'/dh)^T`` of shape
``(H, H)`` with ``J^T[i, j] = dh'_j / dh_i``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
    (:func:`paraprop.recurrence.gru_linearize`): ``dh'/dh = diag(z) + diag(s) [W_hr; W_hz; W_hn]``
    summed over the three gate blocks, with ``s`` the gate sensitivities (BPPSA Appendix E)."""
    from paraprop.recurrence import gru_linearize

    with torch.no_grad():
        gi = F.linear(x, cell.weight_ih, cell.bias_ih if cell.bias else None)
        _, J = gru_linearize(gi[None, None], h[None, None], cell.weight_hh,
                             cell.bias_hh if cell.bias else None, "dense")
        return J[0, 0].t()
