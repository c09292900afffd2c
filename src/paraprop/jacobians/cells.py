"""The Jacobians of recurrent cells w.r.t. the hidden state, each written once (BPPSA,
Appendix E).

* :func:`rnn_cell`, :func:`gru_cell`: for ``h' = cell(x, h)`` (one sample, vectors) the dense
  ``J^T = (dh'/dh)^T`` of shape ``(H, H)`` with ``J^T[i, j] = dh'_j / dh_i`` (BPPSA's
  per-layer Jacobians);
* :func:`gru_gates`, :func:`gru_scale`: the GRU gates and gate sensitivities of many steps at
  once, the factors of ``dh'/dh = diag(z) + diag(s) [W_hr; W_hz; W_hn]`` that
  :mod:`paraprop.nn`'s scan backward uses;
* :func:`lstm_gates`, :func:`lstm_scale`: the same for the LSTM, the factors of its Jacobian on
  the state ``[h; c]`` (a :class:`paraprop.scan.LSTMFactored`; derivation in
  :mod:`paraprop.nn.lstm`);
* :func:`gru_linearize`, :func:`lstm_linearize`, :func:`dense_jacobian`: the values and
  Jacobians of many GRU / LSTM steps at once, in the ``"dense"``, ``"diag"`` or factored form,
  in cache-sized blocks on the CPU (:func:`steps_per_block`).

:mod:`paraprop.jacobians.linearized` turns a cell into its linearization over a whole sequence
with these (analytic for RNN, GRU and LSTM cells, autograd for any other), for
:class:`paraprop.Recurrence` and the Newton solvers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paraprop.scan import Factored, LSTMFactored


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


def fast_tanh(x: torch.Tensor) -> torch.Tensor:
    """``tanh(x)`` as ``2 sigmoid(2 x) - 1``: torch's CPU ``tanh`` is about ten times slower
    than its ``sigmoid``; the two agree within a few units in the last place of 1 (absolute:
    ``2e-7`` in float32, ``4e-16`` in float64)."""
    return torch.mul(x, 2).sigmoid_().mul_(2).sub_(1)


def lstm_gates(gi: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor, b_hh, *,
               scratch: bool = False, forget: torch.Tensor | None = None):
    """The gates of LSTM steps (torch's order ``i, f, g, o``), the one place they are computed
    for a Jacobian (``g`` as :func:`fast_tanh`).

    Arguments:
        gi: the input terms ``W_ih u + b_ih`` ``(..., 4H)``; read only, unless ``scratch``
            (the caller's own contiguous temporary: the gates are then computed in it, the
            hidden product accumulated into it by one matrix product, saving a copy).
        h: the previous hidden states ``(..., H)``.
        w_hh, b_hh: the hidden weights ``(4H, H)`` and bias ``(4H,)`` (or ``None``, e.g. when
            ``gi`` holds both biases).
        forget: where to write the forget gate ``(..., H)`` (a buffer the caller keeps), or
            ``None``.

    Returns:
        ``(i, f, g, o)``: the input, forget and output gates (sigmoids) and the candidate ``g``
        (tanh), each ``(..., H)``: views of one ``(..., 4H)`` tensor (``gi`` with ``scratch``),
        ``f`` the ``forget`` buffer when given.
    """
    H = h.shape[-1]
    if scratch:
        gates = gi
        gates.view(-1, 4 * H).addmm_(h.reshape(-1, H), w_hh.t())
        if b_hh is not None:
            gates.add_(b_hh)
    else:
        gates = F.linear(h, w_hh, b_hh).add_(gi)
    g = gates[..., 2 * H : 3 * H].mul_(2)     # tanh(a) = 2 sigmoid(2a) - 1 (fast_tanh)
    if forget is None:
        gates.sigmoid_()
        f = gates[..., H : 2 * H]
    else:
        f = torch.sigmoid(gates[..., H : 2 * H], out=forget)
        gates[..., :H].sigmoid_()
        gates[..., 2 * H :].sigmoid_()
    g.mul_(2).sub_(1)
    return gates[..., :H], f, g, gates[..., 3 * H :]


def lstm_scale(i, f, g, o, c_prev, tc, out: torch.Tensor, ig=None, k=None) -> torch.Tensor:
    """The gate sensitivities of LSTM steps with ``c = f c_prev + i g``, ``h = o tanh(c)`` and
    ``tc = tanh(c)``: writes ``s = [g i (1 - i); c_prev f (1 - f); i (1 - g^2); tc o (1 - o)]``
    (``dc`` by the pre-activations of ``i, f, g``, then ``dh`` by that of ``o``) into ``out``
    ``(..., 4H)`` and returns ``k = o (1 - tc^2)`` (``dh / dc``): with ``f`` these are the
    factors of the Jacobian on ``[h; c]`` (:class:`paraprop.scan.LSTMFactored`),
    ``dc'/dh = sum_{b=i,f,g} diag(s_b) W_b``, ``dc'/dc = diag(f)``, ``dh'/dh = diag(k) dc'/dh
    + diag(s_o) W_o``, ``dh'/dc = diag(k f)``. ``ig``: ``i * g`` when the caller has it;
    ``k``: a buffer for ``k``."""
    H = i.shape[-1]
    torch.addcmul(i, i, i, value=-1, out=out[..., :H]).mul_(g)
    torch.addcmul(f, f, f, value=-1, out=out[..., H : 2 * H]).mul_(c_prev)
    torch.addcmul(i, i * g if ig is None else ig, g, value=-1, out=out[..., 2 * H : 3 * H])
    torch.addcmul(o, o, o, value=-1, out=out[..., 3 * H :]).mul_(tc)
    return torch.addcmul(o, o * tc, tc, value=-1, out=k)


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
# The same for the LSTM's gates (4H wide: 2048 rows of H = 64 fill 2 MiB; paraprop.nn.LSTM's
# factors measured 1.2-1.5x faster than with 8192 rows at T = 1000, B = 32).
LSTM_BLOCK_ROWS = 2048
# Whether the CPU runs the blocked passes in cache-sized blocks (True) or, as every other device
# does, in one block over all steps. The tests set it to False to run the one-block path of the
# GPU with CPU tensors.
CPU_BLOCKS = True


def steps_per_block(device: torch.device, steps: int, rows: int, per_step: int) -> int:
    """How many of ``steps`` time steps one block of a blocked pass covers: all of them off the
    CPU (a GPU wants the largest batched operations; launches, not caches, bound it), about
    ``rows`` rows (``per_step`` rows per step) on the CPU, at least one step. The one place the
    CPU and GPU branches of the blocked passes (:mod:`paraprop.nn`, this module,
    :mod:`paraprop.jacobians.diagonal`) differ."""
    if device.type != "cpu" or not CPU_BLOCKS:
        return max(1, steps)
    return max(1, rows // max(1, per_step))


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
    step = steps_per_block(prev.device, n, BLOCK_ROWS, B)
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


def lstm_linearize(gi, prev, w_hh, b_hh, form):
    """LSTM states ``y = [h'; c']`` from the previous states ``prev = [h; c]`` ``(B, n, 2H)`` and
    the input terms ``gi = W_ih u + b_ih`` ``(B, n, 4H)``, and their Jacobians in ``form``,
    block by block along time as :func:`gru_linearize`."""
    B, n, H2 = prev.shape
    H = H2 // 2
    y = prev.new_empty(B, n, H2)
    if form == "diag":
        a = prev.new_empty(B, n, H2)
        wd = w_hh.reshape(4, H, H).diagonal(dim1=-2, dim2=-1)      # (4, H) diag of blocks
    elif form is not None:
        s, f, k = prev.new_empty(B, n, 4 * H), prev.new_empty(B, n, H), prev.new_empty(B, n, H)
    step = steps_per_block(prev.device, n, LSTM_BLOCK_ROWS, B)
    for t0 in range(0, n, step):
        blk = slice(t0, min(n, t0 + step))
        h, c = prev[:, blk, :H], prev[:, blk, H:]
        i, fb, g, o = lstm_gates(gi[:, blk], h, w_hh, b_hh,
                                 forget=f[:, blk] if form not in (None, "diag") else None)
        cy = torch.mul(fb, c, out=y[:, blk, H:]).add_(i * g)   # torch's: c' = f c + i g,
        tc = fast_tanh(cy)                                      # h' = o tanh(c')
        torch.mul(o, tc, out=y[:, blk, :H])
        if form is None:
            continue
        if form == "diag":   # [k (sum_{ifg} s_b diag(W_b)) + s_o diag(W_o); f]
            sb = prev.new_empty(*cy.shape[:-1], 4 * H)
            kb = lstm_scale(i, fb, g, o, c, tc, sb)
            s4 = sb.unflatten(-1, (4, H))
            dc = (s4[..., :3, :] * wd[:3]).sum(-2)
            torch.addcmul(s4[..., 3, :] * wd[3], kb, dc, out=a[:, blk, :H])
            a[:, blk, H:] = fb
            continue
        lstm_scale(i, fb, g, o, c, tc, s[:, blk], k=k[:, blk])
    if form is None:
        return y, None
    if form == "diag":
        return y, a
    J = LSTMFactored(scale=s, forget=f, output=k, weight=w_hh)
    return y, (J if form == "any" else dense_jacobian(J))


def dense_jacobian(J: Factored | LSTMFactored) -> torch.Tensor:
    """``diag(d) + L diag(s) R`` as ``(B, n, H, H)`` (L = None: identity blocks side by side),
    or an :class:`~paraprop.scan.LSTMFactored` as ``(B, n, 2H, 2H)``."""
    if isinstance(J, LSTMFactored):
        return _dense_lstm(J)
    s, R = J.scale, J.right
    assert R is not None   # the cells' Jacobians have a right matrix (W_hh)
    K, H = R.shape
    if J.left is None:
        out = (s.unflatten(-1, (K // H, H)).unsqueeze(-1) * R.reshape(K // H, H, H)).sum(-3)
    else:
        out = torch.einsum("hk,bnk,kj->bnhj", J.left, s, R)
    if J.diag is not None:
        out = out + torch.diag_embed(J.diag)
    return out


def _dense_lstm(J: LSTMFactored) -> torch.Tensor:
    """``[[diag(k) P + diag(s_o) W_o, diag(k f)], [P, diag(f)]]`` with ``P = sum_{b=i,f,g}
    diag(s_b) W_b`` (transposed if ``J`` is)."""
    f, k = J.forget, J.output
    H = f.shape[-1]
    Wb = J.weight.reshape(4, H, H)
    s4 = J.scale.unflatten(-1, (4, H))
    P = (s4[..., :3, :, None] * Wb[:3]).sum(-3)                       # (..., H, H)
    out = f.new_zeros(*f.shape[:-1], 2 * H, 2 * H)
    out[..., H:, :H] = P
    torch.addcmul(s4[..., 3, :, None] * Wb[3], k[..., None], P, out=out[..., :H, :H])
    out[..., :H, H:].diagonal(dim1=-2, dim2=-1).copy_(k * f)
    out[..., H:, H:].diagonal(dim1=-2, dim2=-1).copy_(f)
    return out.transpose(-1, -2) if J.transposed else out
