"""``paraprop.nn.RNN``: torch.nn.RNN whose backward pass is one linear recurrence per layer.

For ``h_t = f(z_t)``, ``z_t = W_ih x_t + b_ih + W_hh h_{t-1} + b_hh`` the transposed Jacobian is
``J_t^T = W_hh^T diag(f'(z_t))`` with ``f' = 1 - h_t^2`` (tanh) or ``[h_t > 0]`` (ReLU) (BPPSA,
Wang et al. 2020). With ``delta_t = dL/dz_t`` and ``e_t`` the gradient arriving at ``h_t``
from outside the layer, back-propagation through time is

    delta_t = f'_t * (W_hh^T delta_{t+1} + e_t),      t = T-1 .. 0,  delta_T = 0,

a reverse linear recurrence with ``A_t = diag(f'_t) W_hh^T`` — a :class:`paraprop.scan.Factored`
(``scale = f'``, ``right = W_hh^T``): stored as ``T x B x H`` numbers, never as ``T`` matrices.
All weight gradients then follow in batched contractions over all steps:
``dW_hh = sum_t delta_t h_{t-1}^T``, ``dW_ih = sum_t delta_t x_t^T``, ``db = sum_t delta_t``,
``dx_t = W_ih^T delta_t`` (the ``e`` of the layer below) and ``dh_{-1} = W_hh^T delta_0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import _VF

from paraprop.jacobians.linearized import RNNCellJacobian
from paraprop.nn import stack
from paraprop.nn._base import ScanBackwardMixin, check_options
from paraprop.nn.options import JacobiBackward
from paraprop.nn.runs import jacobi_run, scan_record
from paraprop.scan import Factored, jacobi_recurrence, linear_recurrence, native
from paraprop.scan.linear import method_for


def solve_hidden(cfg: dict, A: Factored, b: torch.Tensor, h0: torch.Tensor | None):
    """The hidden-state gradient recurrence (reverse in time) by scan or by Jacobi sweeps.

    ``A``'s per-step tensors and ``b`` are batch-major views ``(B, T, .)``. Its Solution
    (:mod:`paraprop.nn.runs`) goes to ``cfg["backward_layers"]``, for ``last_backward``.
    """
    bwd = cfg["backward"]
    if isinstance(bwd, JacobiBackward):
        res = jacobi_recurrence(A, b, h0, reverse=True, max_iters=bwd.max_iters, tol=bwd.tol)
        cfg["backward_layers"].append(jacobi_run(res))
        return res.value
    kernel = scan_kernel(A, b, h0, bwd.method)
    lam = linear_recurrence(A, b, h0, reverse=True, method=bwd.method)
    cfg["backward_layers"].append(scan_record(kernel, lam, b.shape[-2]))
    return lam


def scan_kernel(A, b: torch.Tensor, h0: torch.Tensor | None, method: str) -> str:
    """Which kernel :func:`paraprop.scan.linear_recurrence` runs for these arguments, for
    ``last_backward``: the method ``"auto"`` resolves to (``"native"``: the C kernel, CPU
    float32/float64; ``"triton"`` on CUDA where it applies, ``"sequential"``, ``"chunked"``,
    ``"blelloch"``), or the one asked for (:func:`paraprop.scan.linear.method_for`)."""
    return method_for(A, b, h0, method=method)


def native_layer(cfg: dict, x: torch.Tensor, h0: torch.Tensor, w: list) -> torch.Tensor:
    """One layer's outputs ``(T, B, H)`` by the native loop: the input terms of all steps (both
    biases folded in) in one matrix product, then :func:`paraprop.scan.native.rnn_forward`."""
    bias = w[2] + w[3] if cfg["bias"] else None
    p = F.linear(x, w[0], bias)
    out = torch.empty_like(p)
    return native.rnn_forward(p, w[1].t().contiguous(), h0, out, cfg["mode"] == "RNN_RELU")


class RNNScanFunction(torch.autograd.Function):
    """Forward: torch's own fused loop per layer (no graph). Backward: see the module doc."""

    @staticmethod
    def layers(cfg, x, h0, weights, save: bool):
        """Every layer's outputs (torch's fused loop, or ``cfg["forward"]`` by
        :func:`paraprop.solve`), the last states and, with ``save``, what backward needs (in
        ``cfg["compute"]``)."""
        cdt = cfg["compute"]
        run = _VF.rnn_tanh if cfg["mode"] == "RNN_TANH" else _VF.rnn_relu
        inputs, outs, slopes, last = [], [], [], []
        layer_in = x
        for k in range(cfg["layers"]):
            w = stack.layer_weights(weights, k, cfg["bias"])
            if cfg["native"]:
                out = native_layer(cfg, layer_in, h0[k], w)
                hn = out[-1:]
            elif cfg["forward"] is None:
                out, hn = run(layer_in, h0[k:k + 1], w, cfg["bias"], 1, 0.0, False, False, False)
            else:
                wc = [t.to(cdt) for t in w]
                b_ih, b_hh = stack.biases(wc)
                cell = RNNCellJacobian(wc[0], wc[1], b_ih, b_hh,
                                       "tanh" if cfg["mode"] == "RNN_TANH" else "relu")
                out = stack.solve_layer(cfg, cell, layer_in, h0[k])
                hn = out[-1:]
            if save:
                # the analytic transposed Jacobian J_t^T = W_hh^T diag(slope_t), slope = f'(z_t)
                o = out.to(cdt)
                slope = 1 - o * o if cfg["mode"] == "RNN_TANH" else (o > 0).to(cdt)
                inputs.append(layer_in.to(cdt))
                outs.append(o)
                slopes.append(slope)
            last.append(hn)
            layer_in = out
        return layer_in, torch.cat(last, 0), (inputs, outs, slopes)

    @staticmethod
    def forward(ctx, cfg, x, h0, *weights):
        out, hn, (inputs, outs, slopes) = RNNScanFunction.layers(cfg, x, h0, weights, True)
        ctx.cfg = cfg
        ctx.save_for_backward(h0, *weights, *inputs, *outs, *slopes)
        return out, hn

    @staticmethod
    @stack.first_order_only
    def backward(ctx, g_out, g_hn):
        cfg, nl, (h0,), weights, rest = stack.unpack_saved(ctx, lead=1)
        inputs, outs, slopes = rest[:nl], rest[nl:2 * nl], rest[2 * nl:]
        T, B, H = g_out.shape
        grads_w: list = [None] * len(weights)
        g_h0 = torch.empty_like(h0)
        e = g_out
        g_x = None
        for k in range(nl - 1, -1, -1):
            w_ih, w_hh = stack.layer_weights(weights, k, cfg["bias"])[:2]
            slope = slopes[k]
            b = slope * e                                            # (T, B, H)
            b[-1] += slope[-1] * g_hn[k]                             # dL/dh_n enters at T-1
            A = Factored(scale=slope.transpose(0, 1), right=w_hh.t())
            delta = solve_hidden(cfg, A, b.transpose(0, 1), None).transpose(0, 1)
            d2 = delta.reshape(T * B, H)
            out, inp = outs[k], inputs[k]
            g_whh = d2[B:].t() @ out[:-1].reshape(-1, H) if T > 1 else 0
            g_whh = g_whh + delta[0].t() @ h0[k]
            g_b = None
            if cfg["bias"]:  # column sums as a matrix-vector product (faster than sum(0))
                g_b = torch.mv(d2.t(), d2.new_ones(T * B))
            stack.store_grads(grads_w, k, cfg["bias"], d2.t() @ inp.reshape(T * B, -1), g_whh, g_b,
                              None if g_b is None else g_b.clone())
            g_h0[k] = delta[0] @ w_hh
            if k > 0 or ctx.needs_input_grad[1]:
                e = (d2 @ w_ih).reshape(T, B, -1)
                if k == 0:
                    g_x = e
        return (None, g_x, g_h0 if ctx.needs_input_grad[2] else None, *grads_w)


class RNN(ScanBackwardMixin, torch.nn.RNN):
    """torch.nn.RNN with back-propagation through time as one linear recurrence per layer, and
    optionally a forward pass parallel over time.

    Same constructor arguments, parameters (``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``,
    ``bias_hh_l0``, ...), state dict and outputs as :class:`torch.nn.RNN`, so ``load_state_dict``
    from a torch module just works. The defaults ``forward="auto", backward="auto"`` run the pair
    measured fastest for the cell and device (:func:`paraprop.nn.options.resolve`): on the CPU
    (float32 / float64) paraprop's native loop and the scan backward, equal to torch's outputs
    within rounding (a few units in the last place per step); elsewhere torch's own kernel
    (bitwise torch's outputs) and the scan. ``forward="sequential"`` is always torch's kernel;
    with it, in ``torch.no_grad()`` or with nothing requiring grad, the module *is*
    torch.nn.RNN.

    Arguments:
        input_size, hidden_size, num_layers, nonlinearity, bias, batch_first, device, dtype: as
            :class:`torch.nn.RNN`.
        dropout, bidirectional, proj_size: only the defaults (0, False, 0) are supported.
        forward: how the states are computed, a name or an object
            (:mod:`paraprop.nn.options`): ``"auto"`` (the default: the native loop where it
            runs and the backward is not torch's), ``"sequential"`` (torch's kernel),
            ``"native"`` (paraprop's C loop), a method of :func:`paraprop.solve`
            (``"newton"`` (DEER), ``"quasi_newton"``, ``"elk"``, ``"quasi_elk"``, ``"jacobi"``,
            ``"jacobi_gs"``, ``"gs_jacobi"``,
            ``"sliding_jacobi"``), a solver object (``ELK(damping=1e-3)``), or
            ``ParallelForward(method=..., tol=..., max_iters=..., throw=...)``. A parallel
            forward solves each layer's :class:`paraprop.Recurrence` (also under
            ``torch.no_grad()``); the gradients then come from the same backward at the computed
            states (implicit differentiation). With the default ``tol`` (:data:`FORWARD_TOL`:
            ``1e-10`` for float64, ``1e-5`` for float32) the outputs and final states match
            torch's within ``5 * tol * max(1, max |out|)``: ``5e-10`` in float64 and ``5e-5``
            in float32 times ``max(1, max |out|)`` (measured for every method on ordinary and
            long-memory cells up to ``T = 5000``; docs/recurrences.md, "Accuracy").
        backward: how gradients are computed, a name or an object: ``"auto"`` (the default:
            torch's kernel and ``"autograd"`` where that training step was measured fastest,
            :data:`~paraprop.nn.options.TORCH_FASTEST` (the LSTM on the CPU), ``"scan"``
            otherwise), ``"scan"``
            (:class:`~paraprop.nn.ScanBackward`: the hidden-state gradients of every
            step by :func:`paraprop.scan.linear_recurrence`, BPPSA), ``"jacobi"``
            (:class:`~paraprop.nn.JacobiBackward`: the same recurrence by Jacobi sweeps, Song et
            al. 2021 section 5.1: exact after ``T`` sweeps, truncated back-propagation when
            stopped earlier) or ``"autograd"`` (torch's own backward; needs
            ``forward="sequential"``).

    Attributes:
        forward_config, backward_config: the two options as objects; assigning a name or an
            object validates it as the constructor does.
        last_forward: the last forward's :class:`paraprop.Solution` per layer (bottom layer
            first). After a parallel forward, the layer's solve: ``iterations``,
            ``residuals`` (the solver's convergence measure per iteration), ``converged`` /
            ``result``, ``stats["error_estimate"]`` (the largest estimated distance of a
            sample to the sequential result; ``0`` at the exactness bound),
            ``stats["resets"]`` (Newton: diverging steps replaced), ``stats["tol"]`` (the
            tolerance used) and ``stats["compute_dtype"]`` (float32 for a bf16 / fp16
            module). With ``forward="auto"`` or ``"native"``, the loop that ran
            (``method="sequential"``, ``stats["kernel"]``: ``"native"`` or ``"torch"``).
            ``()`` after ``forward="sequential"``. Each ``value`` is the layer's last state
            only (:mod:`paraprop.nn.runs`).
        last_backward: the last call's backward, a :class:`paraprop.nn.BackwardRun`:
            ``kind`` (``"scan"``, ``"jacobi"``, ``"autograd"``; for ``"autograd"`` set by the
            forward, for the others by the backward; ``None`` until then), ``compute_dtype``
            and one Solution per layer (bottom layer first): for ``"scan"`` its ``method`` is
            the scan kernel that ran (``"native"``: the C kernel, CPU only; ``"triton"``
            (CUDA), ``"chunked"``, ``"blelloch"``, ...: :func:`scan_kernel`), for
            ``"jacobi"`` the sweeps' Solution (``iterations``, ``stats["error_estimate"]``,
            ``converged``).

    Raises:
        NotImplementedError: ``bidirectional=True``, ``dropout > 0``, ``proj_size > 0``,
            PackedSequence inputs; a parallel forward under :mod:`torch.func` transforms;
            differentiating the gradients of the scan / Jacobi backward again (double
            backward: use ``backward="autograd"``).
        ValueError / TypeError: unknown or badly configured ``forward`` / ``backward`` (the
            message names the argument, what it accepts and what it got),
            ``backward="autograd"`` with a parallel ``forward``, and the shape errors of
            torch.nn.RNN.
        paraprop.ConvergenceError: a parallel forward stopped by ``max_iters`` (``throw=True``).

    Example:
        >>> ref = torch.nn.RNN(1, 20, num_layers=2)
        >>> rnn = paraprop.nn.RNN(1, 20, num_layers=2)
        >>> rnn.load_state_dict(ref.state_dict())
        <All keys matched successfully>
        >>> x = torch.randn(1000, 16, 1)
        >>> out, h = rnn(x)
        >>> out[-1].sum().backward()      # one linear_recurrence per layer
        >>> [s.stats["kernel"] for s in rnn.last_forward], rnn.last_backward.kind  # (CPU)
        (['native', 'native'], 'scan')
        >>> bool((out - ref(x)[0]).abs().max() < 1e-5)   # torch's outputs, within rounding
        True
        >>> rnn.forward_config = "sequential"            # torch's own kernel: bitwise
        >>> torch.equal(rnn(x)[0], ref(x)[0])
        True
    """

    _function = RNNScanFunction

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 nonlinearity: str = "tanh", bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, bidirectional: bool = False, device=None, dtype=None, *,
                 proj_size: int = 0, forward="auto", backward="auto"):
        check_options("RNN", dropout=dropout, bidirectional=bidirectional, proj_size=proj_size)
        options = self._init_options(forward, backward)
        super().__init__(input_size, hidden_size, num_layers, nonlinearity, bias, batch_first,
                         dropout, bidirectional, device=device, dtype=dtype)
        self._set_options(*options)
