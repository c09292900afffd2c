"""``paraprop.nn.GRU``: torch.nn.GRU whose backward pass is one linear recurrence per layer.

torch's GRU step (gates in the order r, z, n of ``weight_ih``/``weight_hh``):

    r = sigmoid(gi_r + gh_r),  z = sigmoid(gi_z + gh_z),  n = tanh(gi_n + r * gh_n),
    h_t = (1 - z) * n + z * h_{t-1},   gi = W_ih x_t + b_ih,  gh = W_hh h_{t-1} + b_hh.

Its transposed Jacobian (BPPSA, Wang et al. 2020, Appendix E) is a diagonal plus the three
blocks of ``W_hh^T`` scaled column-wise:

    J_t^T = diag(z) + W_hh^T diag(s_t) [I; I; I],
    s_t = [(1-z)(1-n^2) gh_n r(1-r);  (h_{t-1} - n) z(1-z);  (1-z)(1-n^2) r],

a :class:`paraprop.scan.Factored` with ``K = 3H`` (``left = W_hh^T``, ``right = None``). With
``g_t = dL/dh_t`` and ``e_t`` the gradient arriving from outside the layer,
``g_t = J_{t+1}^T g_{t+1} + e_t`` is one reverse linear recurrence. Then, in batched
contractions over all steps: ``dgh_t = s_t * [g_t; g_t; g_t]`` (the gradient of ``gh``),
``dgi_t`` equal to it but with ``(1-z)(1-n^2) g_t`` in the n block, ``dW_hh = sum dgh h_{t-1}^T``,
``dW_ih = sum dgi x_t^T``, biases by sums, ``dx_t = W_ih^T dgi_t``,
``dh_{-1} = z_0 g_0 + W_hh^T dgh_0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import _VF

from paraprop.jacobians import cells
from paraprop.jacobians.cells import BLOCK_ROWS, gru_gates, gru_scale
from paraprop.jacobians.linearized import GRUCellJacobian
from paraprop.nn import stack
from paraprop.nn._base import ScanBackwardMixin, check_options
from paraprop.nn.rnn import solve_hidden
from paraprop.scan import Factored, native


def jacobian_factors(x, hprev, w_ih, w_hh, b_ih, b_hh):
    """``z``, ``s`` and ``dn = (1-z)(1-n^2)`` of every step, from the inputs and h_{t-1}.

    The gates of all steps are recomputed in a few batched operations (blocks of time steps on
    the CPU, one block elsewhere); ``J_t^T = diag(z_t) + W_hh^T diag(s_t) [I; I; I]`` with
    ``s = [dn gh_n r (1-r); (h_prev - n) z (1-z); dn r]`` (BPPSA Appendix E).
    """
    T, B, H = hprev.shape
    z = hprev.new_empty(T, B, H)
    dn = hprev.new_empty(T, B, H)
    s = hprev.new_empty(T, B, 3 * H)
    step = cells.steps_per_block(hprev.device, T, BLOCK_ROWS, B)
    for t0 in range(0, T, step):
        blk = slice(t0, min(T, t0 + step))
        hp = hprev[blk]
        r, zb, gh_n, n = gru_gates(F.linear(x[blk], w_ih, b_ih), hp, w_hh, b_hh, scratch=True)
        z[blk] = zb
        dn[blk] = gru_scale(r, zb, gh_n, n, hp, s[blk])
    return z, s, dn


def native_layer(x, h0, w_ih, w_hh, b_ih, b_hh, factors: bool):
    """One layer's outputs ``(T, B, H)`` by the native loop (the input terms of all steps in
    one matrix product, then :func:`paraprop.scan.native.gru_forward`) and, with ``factors``,
    ``(z, s, dn)`` as :func:`jacobian_factors` gives them, written by the same loop."""
    gi = F.linear(x, w_ih, b_ih)
    T, B, H = gi.shape[0], gi.shape[1], w_hh.shape[1]
    out = gi.new_empty(T, B, H)
    fac = ((gi.new_empty(T, B, H), gi.new_empty(T, B, 3 * H), gi.new_empty(T, B, H))
           if factors else None)
    native.gru_forward(gi, w_hh.t().contiguous(), b_hh, h0, out, fac)
    return out, fac


class GRUScanFunction(torch.autograd.Function):
    """Forward: torch's fused GRU per layer, then the gates of all steps in a few batched ops."""

    @staticmethod
    def layers(cfg, x, h0, weights, save: bool):
        """Every layer's outputs (torch's fused kernel, or ``cfg["forward"]`` by
        :func:`paraprop.solve`), the last states and, with ``save``, what backward needs."""
        cdt = cfg["compute"]
        saved, last = [], []
        layer_in = x
        for k in range(cfg["layers"]):
            w = stack.layer_weights(weights, k, cfg["bias"])
            b_ih, b_hh = stack.biases(w)
            if cfg["native"]:
                out, factors = native_layer(layer_in, h0[k], w[0], w[1], b_ih, b_hh, save)
                if save:
                    saved += [layer_in, stack.shifted(h0[k], out), *factors]
                last.append(out[-1:])
                layer_in = out
                continue
            if cfg["forward"] is None:
                out, hn = _VF.gru(layer_in, h0[k:k + 1], w, cfg["bias"], 1, 0.0, False, False,
                                  False)
            else:
                cell = GRUCellJacobian(*stack.cast((w[0], w[1], b_ih, b_hh), cdt))
                out = stack.solve_layer(cfg, cell, layer_in, h0[k])
                hn = out[-1:]
            if save:   # the factors in cfg["compute"] (float32 for bf16 / fp16 modules)
                inp = layer_in.to(cdt)
                hprev = stack.shifted(h0[k], out).to(cdt)
                factors = jacobian_factors(inp, hprev, *stack.cast((w[0], w[1], b_ih, b_hh), cdt))
                saved += [inp, hprev, *factors]
            last.append(hn)
            layer_in = out
        return layer_in, torch.cat(last, 0), saved

    @staticmethod
    def forward(ctx, cfg, x, h0, *weights):
        out, hn, saved = GRUScanFunction.layers(cfg, x, h0, weights, True)
        ctx.cfg = cfg
        ctx.save_for_backward(*weights, *saved)
        return out, hn

    @staticmethod
    @stack.first_order_only
    def backward(ctx, g_out, g_hn):
        cfg, nl, _, weights, per_layer = stack.unpack_saved(ctx)
        T, B, H = g_out.shape
        grads_w: list = [None] * len(weights)
        g_h0 = g_out.new_empty(nl, B, H)
        e = g_out
        g_x = None
        for k in range(nl - 1, -1, -1):
            w_ih, w_hh = stack.layer_weights(weights, k, cfg["bias"])[:2]
            inp, hprev, z, s, dn = per_layer[5 * k:5 * k + 5]
            # g_t = J_{t+1}^T g_{t+1} + e_t: steps 0..T-2 use the factors of step t+1,
            # and g_{T-1} = e_{T-1} (+ the gradient of h_n) starts the reverse recurrence
            g = torch.empty_like(e)
            g[-1] = e[-1] + g_hn[k]
            if T > 1:
                A = Factored(scale=s[1:].transpose(0, 1), left=w_hh.t(),
                             diag=z[1:].transpose(0, 1))
                g[:-1] = solve_hidden(cfg, A, e[:-1].transpose(0, 1), g[-1]).transpose(0, 1)
            # d gh = s * [g; g; g]; d gi equals it in the r, z blocks and is dn * g in the n block
            dgh = (s.unflatten(-1, (3, H)) * g.unsqueeze(-2)).reshape(T * B, 3 * H)
            dN = (dn * g).reshape(T * B, H)
            dgi_rz = dgh[:, :2 * H]                                  # a strided view, no copy
            x2 = inp.reshape(T * B, -1)
            g_wih = torch.empty_like(w_ih)
            torch.mm(dgi_rz.t(), x2, out=g_wih[:2 * H])
            torch.mm(dN.t(), x2, out=g_wih[2 * H:])
            g_bih = g_bhh = None
            if cfg["bias"]:  # column sums as matrix-vector products (faster than sum(0))
                ones = dgh.new_ones(T * B)
                g_bhh = torch.mv(dgh.t(), ones)
                g_bih = torch.cat([g_bhh[:2 * H], torch.mv(dN.t(), ones)])
            stack.store_grads(grads_w, k, cfg["bias"], g_wih, dgh.t() @ hprev.reshape(T * B, H),
                              g_bih, g_bhh)
            g_h0[k] = z[0] * g[0] + dgh[:B] @ w_hh
            if k > 0 or ctx.needs_input_grad[1]:
                e = torch.addmm(dN @ w_ih[2 * H:], dgi_rz, w_ih[:2 * H]).reshape(T, B, -1)
                if k == 0:
                    g_x = e
        return (None, g_x, g_h0 if ctx.needs_input_grad[2] else None, *grads_w)


class GRU(ScanBackwardMixin, torch.nn.GRU):
    """torch.nn.GRU with back-propagation through time as one linear recurrence per layer, and
    optionally a forward pass parallel over time (``forward="newton"`` and others).

    Same constructor arguments, parameters, state dict and outputs as :class:`torch.nn.GRU`.
    The defaults ``forward="auto", backward="auto"`` choose as :class:`paraprop.nn.RNN`'s: on
    the CPU the native loop, which writes the factors of the transposed Jacobians (BPPSA
    Appendix E) as it goes, and the scan backward. With ``forward="sequential"`` the forward
    pass is torch's own kernel (bitwise), followed by a batched recomputation of the gates to
    form those factors; only the backward pass differs.

    Arguments:
        input_size, hidden_size, num_layers, bias, batch_first, device, dtype: as
            :class:`torch.nn.GRU`.
        dropout, bidirectional, proj_size: only the defaults (0, False, 0) are supported.
        forward, backward: as :class:`paraprop.nn.RNN`; with ``forward="newton"`` each layer's
            states come from a few linear recurrences over the factored GRU Jacobians (DEER)
            instead of ``T`` dependent steps. With the default ``tol`` the outputs match
            torch's within ``5e-10 * max(1, max |out|)`` (float64) and
            ``5e-5 * max(1, max |out|)`` (float32), long-memory cells (update gate near 1)
            included (docs/recurrences.md, "Accuracy").

    Attributes:
        forward_config, backward_config, last_forward, last_backward: as
            :class:`paraprop.nn.RNN`.

    Raises:
        NotImplementedError, ValueError / TypeError, paraprop.ConvergenceError: as
            :class:`paraprop.nn.RNN` (with torch.nn.GRU's shape errors).

    Example:
        >>> ref = torch.nn.GRU(12, 20, batch_first=True)
        >>> gru = paraprop.nn.GRU(12, 20, batch_first=True)
        >>> gru.load_state_dict(ref.state_dict())
        <All keys matched successfully>
        >>> x = torch.randn(4, 200, 12)
        >>> out, h = gru(x)
        >>> h.sum().backward()
        >>> [s.stats["kernel"] for s in gru.last_forward], gru.last_backward.kind  # (CPU)
        (['native'], 'scan')
        >>> bool((out - ref(x)[0]).abs().max() < 1e-5)   # torch's outputs, within rounding
        True
    """

    _function = GRUScanFunction

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None, *, proj_size: int = 0, forward="auto",
                 backward="auto"):
        check_options("GRU", dropout=dropout, bidirectional=bidirectional, proj_size=proj_size)
        options = self._init_options(forward, backward)
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, device=device, dtype=dtype)
        self._set_options(*options)
