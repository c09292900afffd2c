"""``paraprop.nn.LSTM``: torch.nn.LSTM whose backward pass is one linear recurrence per layer.

torch's LSTM step (gates in the order i, f, g, o of ``weight_ih``/``weight_hh``):

    a = W_ih x_t + b_ih + W_hh h_{t-1} + b_hh,   i, f, o = sigmoid(a_i, a_f, a_o),  g = tanh(a_g),
    c_t = f * c_{t-1} + i * g,   h_t = o * tanh(c_t).

The state is ``[h; c]``. With the gate sensitivities ``s_t = [g i(1-i); c_{t-1} f(1-f);
i(1-g^2); tanh(c_t) o(1-o)]`` (``dc_t`` by ``a_i, a_f, a_g``, then ``dh_t`` by ``a_o``),
``k_t = o (1 - tanh^2 c_t)`` (``dh_t / dc_t``) and ``P_t = sum_{b=i,f,g} diag(s_b) W_b`` (the
gate blocks ``W_b`` of ``W_hh``), the chain rule through ``c_t`` gives the Jacobian

    J_t = d[h_t; c_t] / d[h_{t-1}; c_{t-1}] = [[diag(k) P_t + diag(s_o) W_o,  diag(k f)],
                                               [P_t,                          diag(f)  ]].

Back-propagation through time runs on the state gradient ``x_t = [lam_t; mu_t]``
(``dL/dh_t`` and ``dL/dc_t``, the latter through ``c_{t+1}`` and ``c_n`` only: the path through
``h_t`` is inside ``J_t``). With ``e_t`` the gradient arriving at ``h_t`` from outside the layer,

    x_t = J_{t+1}^T x_{t+1} + [e_t; 0],     x_{T-1} = [e_{T-1} + dL/dh_n; dL/dc_n],

is one reverse linear recurrence of size ``2H``, and ``J_t^T`` applied to ``[lam; mu]`` is

    v = mu + k * lam,    lam' = W_hh^T (s * [v; v; v; lam]),    mu' = f * v

(``v`` is the total gradient of ``c_t``): a :class:`paraprop.scan.LSTMFactored`, one product
with ``W_hh^T`` per step (``4 H^2``) and a few elementwise ones, never a ``2H x 2H`` matrix.
No exact recurrence in one ``H``-vector exists (``J_t`` has rank ``2H`` in general, and ``mu``
feeds ``lam`` through ``W_hh`` while ``lam`` feeds ``mu`` through ``k``); written as a
:class:`paraprop.scan.Factored` on the ``2H`` state the per-step scaling of ``lam`` by ``k``
inside ``v`` would need shared matrices of ``2H x 8H``, four times the work, hence the form of
its own.

Then, in batched contractions over all steps: ``v_t = mu_t + k_t lam_t``, ``da_t = s_t * [v_t;
v_t; v_t; lam_t]`` (the gradient of the gate pre-activations, the same for the input and the
hidden terms), ``dW_hh = sum da_t h_{t-1}^T``, ``dW_ih = sum da_t x_t^T``, ``db_ih = db_hh =
sum da_t``, ``dx_t = W_ih^T da_t``, ``dh_{-1} = W_hh^T da_0`` and ``dc_{-1} = f_0 v_0``.

torch's kernel returns the ``h_t`` of every step but only the last ``c``: the forward pass
recomputes the gates of all steps in batched products, and the cells from the diagonal linear
recurrence ``c_t = f_t c_{t-1} + i_t g_t`` (one :func:`paraprop.scan.linear_recurrence`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import _VF

from paraprop.jacobians import cells
from paraprop.jacobians.cells import (
    LSTM_BLOCK_ROWS,
    fast_tanh,
    lstm_gates,
    lstm_scale,
)
from paraprop.jacobians.linearized import LSTMCellJacobian
from paraprop.nn import stack
from paraprop.nn._base import ScanBackwardMixin, check_options
from paraprop.nn.rnn import solve_hidden
from paraprop.scan import LSTMFactored, linear_recurrence, native


def jacobian_factors(x, hprev, c0, w_ih, w_hh, b_ih, b_hh, c=None):
    """``s`` ``(T, B, 4H)``, ``f`` and ``k`` ``(T, B, H)`` of every step (the factors of
    :class:`paraprop.scan.LSTMFactored`, :func:`paraprop.jacobians.cells.lstm_scale`), from the
    inputs ``x``, the previous hidden states ``hprev`` and the first cell ``c0`` ``(B, H)``.

    The gates are recomputed in a few batched operations (blocks of about
    :data:`~paraprop.jacobians.cells.LSTM_BLOCK_ROWS` (time step, sample) rows on the CPU, one
    block elsewhere): the two products accumulate into one buffer that holds both biases. The
    cells ``c_t`` come from the diagonal recurrence ``c_t = f_t c_{t-1} + i_t g_t`` block by
    block, unless given (``c``, ``(T, B, H)``).
    """
    T, B, H = hprev.shape
    s = hprev.new_empty(T, B, 4 * H)
    f = hprev.new_empty(T, B, H)
    k = hprev.new_empty(T, B, H)
    bias = None if b_ih is None else b_ih + b_hh
    x2, h2 = x.reshape(T * B, -1), hprev.reshape(T * B, H)
    s2, f2, k2 = s.view(-1, 4 * H), f.view(-1, H), k.view(-1, H)
    step = cells.steps_per_block(hprev.device, T, LSTM_BLOCK_ROWS, B)
    c_last = c0
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        rows = slice(t0 * B, t1 * B)
        gi = (torch.addmm(bias, x2[rows], w_ih.t()) if bias is not None
              else torch.mm(x2[rows], w_ih.t()))
        i, fb, g, o = lstm_gates(gi, h2[rows], w_hh, None, scratch=True, forget=f2[rows])
        ig = i * g
        if c is None:
            cb = linear_recurrence(f[t0:t1].transpose(0, 1), ig.view(t1 - t0, B, H).transpose(
                0, 1), c_last).transpose(0, 1).reshape(-1, H)
        else:
            cb = c[t0:t1].reshape(-1, H)
        c_prev = torch.cat([c_last, cb[:-B]], 0)
        lstm_scale(i, fb, g, o, c_prev, fast_tanh(cb), s2[rows], ig, k=k2[rows])
        c_last = cb[-B:]
    return s, f, k


def native_layer(x, h0, c0, w_ih, w_hh, b_ih, b_hh, factors: bool):
    """One layer's hidden states and cells ``(T, B, H)`` by the native loop (the input terms of
    all steps, both biases folded in, in one matrix product, then
    :func:`paraprop.scan.native.lstm_forward`) and, with ``factors``, ``(s, f, k)`` as
    :func:`jacobian_factors` gives them, written by the same loop."""
    gi = F.linear(x, w_ih, None if b_ih is None else b_ih + b_hh)
    T, B, H = gi.shape[0], gi.shape[1], w_hh.shape[1]
    out, cell = gi.new_empty(T, B, H), gi.new_empty(T, B, H)
    fac = ((gi.new_empty(T, B, 4 * H), gi.new_empty(T, B, H), gi.new_empty(T, B, H))
           if factors else None)
    native.lstm_forward(gi, w_hh.t().contiguous(), h0, c0, out, cell, fac)
    return out, cell, fac


class LSTMScanFunction(torch.autograd.Function):
    """Forward: torch's fused LSTM per layer, then the factors of all steps in a few batched
    ops. Backward: see the module doc."""

    @staticmethod
    def layers(cfg, x, h0, c0, weights, save: bool):
        """Every layer's outputs (torch's kernel, or ``cfg["forward"]`` by
        :func:`paraprop.solve` on the state ``[h, c]``), the last hidden states and cells and,
        with ``save``, what backward needs."""
        cdt = cfg["compute"]
        saved, last_h, last_c = [], [], []
        layer_in = x
        for k in range(cfg["layers"]):
            w = stack.layer_weights(weights, k, cfg["bias"])
            b_ih, b_hh = stack.biases(w)
            c = None
            if cfg["native"]:
                out, cell, factors = native_layer(layer_in, h0[k], c0[k], w[0], w[1], b_ih, b_hh,
                                                  save)
                if save:
                    saved += [layer_in, stack.shifted(h0[k], out), *factors]
                last_h.append(out[-1:])
                last_c.append(cell[-1:])
                layer_in = out
                continue
            if cfg["forward"] is None:
                out, hn, cn = _VF.lstm(layer_in, (h0[k:k + 1], c0[k:k + 1]), w, cfg["bias"], 1,
                                       0.0, False, False, False)
            else:
                H = h0.shape[-1]
                cell = LSTMCellJacobian(*stack.cast((w[0], w[1], b_ih, b_hh), cdt))
                states = stack.solve_layer(cfg, cell, layer_in, torch.cat([h0[k], c0[k]], -1))
                out, c = states[..., :H].contiguous(), states[..., H:]
                hn, cn = out[-1:], c[-1:].contiguous()
            if save:   # the factors in cfg["compute"] (float32 for bf16 / fp16 modules)
                inp = layer_in.to(cdt)
                hprev = stack.shifted(h0[k], out).to(cdt)
                factors = jacobian_factors(inp, hprev, c0[k].to(cdt),
                                           *stack.cast((w[0], w[1], b_ih, b_hh, c), cdt))
                saved += [inp, hprev, *factors]
            last_h.append(hn)
            last_c.append(cn)
            layer_in = out
        return layer_in, torch.cat(last_h, 0), torch.cat(last_c, 0), saved

    @staticmethod
    def forward(ctx, cfg, x, h0, c0, *weights):
        out, hn, cn, saved = LSTMScanFunction.layers(cfg, x, h0, c0, weights, True)
        ctx.cfg = cfg
        ctx.save_for_backward(*weights, *saved)
        return out, hn, cn

    @staticmethod
    @stack.first_order_only
    def backward(ctx, g_out, g_hn, g_cn):
        cfg, nl, _, weights, per_layer = stack.unpack_saved(ctx)
        T, B, H = g_out.shape
        grads_w: list = [None] * len(weights)
        g_h0 = g_out.new_empty(nl, B, H)
        g_c0 = g_out.new_empty(nl, B, H)
        e = g_out
        g_x = None
        for layer in range(nl - 1, -1, -1):
            w_ih, w_hh = stack.layer_weights(weights, layer, cfg["bias"])[:2]
            inp, hprev, s, f, k = per_layer[5 * layer:5 * layer + 5]
            # x_t = [dL/dh_t; dL/dc_t] = J_{t+1}^T x_{t+1} + [e_t; 0]: steps 0..T-2 use the
            # factors of step t+1, x_{T-1} (with the gradients of h_n, c_n) starts it
            X = g_out.new_empty(T, B, 2 * H)
            torch.add(e[-1], g_hn[layer], out=X[-1, :, :H])
            X[-1, :, H:] = g_cn[layer]
            if T > 1:
                A = LSTMFactored(scale=s[1:].transpose(0, 1), forget=f[1:].transpose(0, 1),
                                 output=k[1:].transpose(0, 1), weight=w_hh, transposed=True)
                rhs = g_out.new_zeros(T - 1, B, 2 * H)
                rhs[..., :H] = e[:-1]
                X[:-1] = solve_hidden(cfg, A, rhs.transpose(0, 1), X[-1]).transpose(0, 1)
            # then, block by block of (step, sample) rows: v = dL/dc_t (all paths), the
            # gradient of the gate pre-activations da = s * [v; v; v; lam] and its contractions
            x2, h2 = inp.reshape(T * B, -1), hprev.reshape(T * B, H)
            X2, s2, k2 = X.view(T * B, 2 * H), s.view(T * B, 4 * H), k.view(T * B, H)
            g_wih, g_whh = torch.zeros_like(w_ih), torch.zeros_like(w_hh)
            g_b = w_hh.new_zeros(4 * H) if cfg["bias"] else None
            want_e = layer > 0 or ctx.needs_input_grad[1]
            e = g_out.new_empty(T, B, x2.shape[1]) if want_e else None
            step = cells.steps_per_block(X.device, T, LSTM_BLOCK_ROWS, B) * B
            for r0 in range(0, T * B, step):
                rows = slice(r0, min(T * B, r0 + step))
                lam = X2[rows, :H]
                v = torch.addcmul(X2[rows, H:], k2[rows], lam)
                da = torch.cat([v, v, v, lam], 1).mul_(s2[rows])
                if r0 == 0:
                    torch.mm(da[:B], w_hh, out=g_h0[layer])
                    torch.mul(f[0], v[:B], out=g_c0[layer])
                g_wih.addmm_(da.t(), x2[rows])
                g_whh.addmm_(da.t(), h2[rows])
                if g_b is not None:
                    g_b += da.sum(0)
                if want_e:
                    torch.mm(da, w_ih, out=e.view(T * B, -1)[rows])
            stack.store_grads(grads_w, layer, cfg["bias"], g_wih, g_whh, g_b,
                              None if g_b is None else g_b.clone())
            if layer == 0:
                g_x = e
        need = ctx.needs_input_grad
        return (None, g_x, g_h0 if need[2] else None, g_c0 if need[3] else None, *grads_w)


class LSTM(ScanBackwardMixin, torch.nn.LSTM):
    """torch.nn.LSTM with back-propagation through time as one linear recurrence per layer, and
    optionally a forward pass parallel over time (``forward="newton"`` and others).

    Same constructor arguments, parameters (``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``,
    ``bias_hh_l0``, ...), state dict and outputs ``output, (h_n, c_n)`` as
    :class:`torch.nn.LSTM`. The defaults ``forward="auto", backward="auto"`` run, on the CPU,
    torch's own kernel and autograd: the module is then torch.nn.LSTM, bitwise (that training
    step was measured faster than the native loop with the scan backward,
    :data:`~paraprop.nn.options.TORCH_FASTEST`); elsewhere as ``forward="sequential"``
    with the scan backward. With ``forward="sequential"`` the forward pass is
    torch's own kernel, one layer at a time (bitwise the outputs of torch.nn.LSTM without a
    graph; with a graph torch runs a float32 LSTM of several layers through another oneDNN path
    that rounds differently), followed by a batched recomputation of the gates and cells that
    gives the factors of the transposed Jacobians (module doc); only the backward pass
    differs.

    Arguments:
        input_size, hidden_size, num_layers, bias, batch_first, device, dtype: as
            :class:`torch.nn.LSTM`.
        dropout, bidirectional, proj_size: only the defaults (0, False, 0) are supported.
        forward, backward: as :class:`paraprop.nn.RNN`; a parallel forward solves each layer's
            :class:`paraprop.Recurrence` of the LSTM cell on the state ``[h, c]`` (``2 *
            hidden_size``; Newton with its :class:`paraprop.scan.LSTMFactored` Jacobians).

    Attributes:
        forward_config, backward_config, last_forward, last_backward: as
            :class:`paraprop.nn.RNN`.

    Raises:
        NotImplementedError, ValueError / TypeError, paraprop.ConvergenceError: as
            :class:`paraprop.nn.RNN` (``hx`` is the pair ``(h_0, c_0)``, each shaped as
            torch.nn.LSTM's).

    Example:
        >>> ref = torch.nn.LSTM(12, 20, batch_first=True)
        >>> lstm = paraprop.nn.LSTM(12, 20, batch_first=True)
        >>> lstm.load_state_dict(ref.state_dict())
        <All keys matched successfully>
        >>> x = torch.randn(4, 200, 12)
        >>> out, (h, c) = lstm(x)
        >>> (h.sum() + c.sum()).backward()
        >>> [s.stats["kernel"] for s in lstm.last_forward], lstm.last_backward.kind  # CPU
        (['torch'], 'autograd')
        >>> torch.equal(out, ref(x)[0])
        True
        >>> lstm.backward_config = "scan"        # one linear_recurrence per layer
        >>> out, (h, c) = lstm(x)
        >>> (h.sum() + c.sum()).backward()
        >>> [s.stats["kernel"] for s in lstm.last_forward], lstm.last_backward.kind
        (['native'], 'scan')
    """

    _function = LSTMScanFunction
    _state_parts = 2

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, device=None, dtype=None, *, forward="auto",
                 backward="auto"):
        check_options("LSTM", dropout=dropout, bidirectional=bidirectional, proj_size=proj_size)
        options = self._init_options(forward, backward)
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, proj_size, device=device, dtype=dtype)
        self._set_options(*options)

    def _state_tensors(self, hx) -> tuple:
        if hx is None:
            return ()
        if not (isinstance(hx, tuple | list) and len(hx) == 2
                and all(isinstance(h, torch.Tensor) for h in hx)):
            raise TypeError(f"paraprop.nn.LSTM: hx must be a pair of tensors (h_0, c_0), got "
                            f"{type(hx).__name__}")
        return tuple(hx)

    def _hidden(self, finals: list):
        return finals[0], finals[1]
