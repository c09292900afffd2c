"""``paraprop.nn.ParaGRU`` / ``ParaLSTM``: the diagonal-recurrence GRU and LSTM of ParaRNN, with a
Newton forward pass and a scan backward pass.

ParaRNN (Danieli et al., ICLR 2026) trains nonlinear RNNs in parallel over the sequence by
Newton's method, and adapts the GRU and the LSTM so that Newton is cheap: every hidden-to-hidden
matrix ``W_hh`` becomes a diagonal, so the state Jacobians are diagonal (GRU) or ``2 x 2`` blocks
per unit (LSTM). The cells are defined in :mod:`paraprop.jacobians.diagonal`; the layers (loop,
Newton, scan backward) in :mod:`paraprop.nn.para_gru` and :mod:`paraprop.nn.para_lstm`, what
they share in :mod:`paraprop.nn.para_solve`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from paraprop import checks
from paraprop.nn._base import ScanBackwardMixin, refuse_jit, time_major, transforms_active
from paraprop.nn.options import AutogradBackward, ParallelForward, describe
from paraprop.nn.para_gru import ParaGRUFunction
from paraprop.nn.para_lstm import ParaLSTMFunction
from paraprop.nn.runs import BackwardRun

__all__ = ["ParaGRU", "ParaLSTM"]


class _ParaRNN(ScanBackwardMixin, nn.Module):
    """What ParaGRU and ParaLSTM share: parameters, options, input and state checks."""

    _gates: int
    _parts: int            # tensors in the state: 1 (h) or 2 (h, c)
    _sequential_kernels = ("torch",)   # forward="sequential": the module's own loop
    _dense_backward = False            # diagonal transitions: the scan kernels take any width

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, device=None, dtype=None, *, forward="newton",
                 backward="scan"):
        name = type(self).__name__
        checks.positive_int(f"{name}: input_size", input_size)
        checks.positive_int(f"{name}: hidden_size", hidden_size)
        checks.positive_int(f"{name}: num_layers", num_layers)
        checks.boolean(f"{name}: bias", bias)
        checks.boolean(f"{name}: batch_first", batch_first)
        options = self._init_options(forward, backward)
        super().__init__()
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first = bias, batch_first
        G = self._gates * hidden_size
        kw = {"device": device, "dtype": dtype}
        for k in range(num_layers):
            n_in = input_size if k == 0 else hidden_size
            setattr(self, f"weight_ih_l{k}", nn.Parameter(torch.empty(G, n_in, **kw)))
            setattr(self, f"weight_hh_l{k}", nn.Parameter(torch.empty(G, **kw)))
            if bias:
                setattr(self, f"bias_ih_l{k}", nn.Parameter(torch.empty(G, **kw)))
                setattr(self, f"bias_hh_l{k}", nn.Parameter(torch.empty(G, **kw)))
        self.reset_parameters()
        self._set_options(*options)

    def reset_parameters(self) -> None:
        """Every parameter uniform in ``(-1/sqrt(H), 1/sqrt(H))``, as torch's recurrent layers."""
        k = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -k, k)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        return s + (f", forward={describe(self._forward_config)}, "
                    f"backward={describe(self._backward_config)}")

    def _initial(self, hx, x: torch.Tensor, batched: bool) -> tuple[torch.Tensor, ...]:
        """The initial states as ``(layers, B, H)`` tensors, zeros for ``hx=None``."""
        name = type(self).__name__
        B = x.shape[1]
        expect = (self.num_layers, B, self.hidden_size)
        if hx is None:
            return tuple(x.new_zeros(expect) for _ in range(self._parts))
        parts = (hx,) if self._parts == 1 else hx
        if self._parts > 1 and not (isinstance(hx, tuple | list) and len(hx) == self._parts):
            raise TypeError(f"{name}: hx must be a tuple (h0, c0) or None, got "
                            f"{type(hx).__name__}")
        out = []
        for p in parts:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{name}: hx must hold tensors, got {type(p).__name__}")
            q = p if batched else p.unsqueeze(1)
            if tuple(q.shape) != expect:
                want = expect if batched else (expect[0], expect[2])
                raise ValueError(f"{name}: expected hidden size {want}, got {tuple(p.shape)}")
            if q.dtype != x.dtype or q.device != x.device:
                raise TypeError(f"{name}: hx ({q.dtype}, {q.device}) must match the input "
                                f"({x.dtype}, {x.device})")
            out.append(q)
        return tuple(out)

    def forward(self, input, hx=None):  # noqa: A002 - torch's argument name
        name = type(self).__name__
        if torch.jit.is_tracing():
            refuse_jit(name)
        self._check_settings()   # an attribute assigned after construction (bias, sizes, ...)
        if isinstance(input, PackedSequence):
            raise NotImplementedError(f"paraprop.nn.{name} does not take a PackedSequence; pad "
                                      "the batch to one length")
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"{name}: input must be a torch.Tensor, got {type(input).__name__}")
        x, batched = time_major(name, input, self.input_size, self.batch_first)
        weights = self._weights()
        if input.dtype != weights[0].dtype or input.device != weights[0].device:
            raise TypeError(f"{name}: input ({input.dtype}, {input.device}) must match the "
                            f"parameters ({weights[0].dtype}, {weights[0].device})")
        T, B = x.shape[:2]
        states = self._initial(hx, x, batched)
        fwd, bwd = self._forward_config, self._backward_config
        parallel = isinstance(fwd, ParallelForward)
        if parallel and torch.is_autocast_enabled(input.device.type):
            raise NotImplementedError(
                f"paraprop.nn.{name}(forward={describe(fwd)}) does not run under torch.autocast "
                "(autocast picks the dtype of every operation inside the solver); convert the "
                "module and its inputs instead (module.to(torch.bfloat16)), or use "
                "forward='sequential' under autocast")
        if parallel and transforms_active():
            raise NotImplementedError(
                f"paraprop.nn.{name}(forward={describe(fwd)}) cannot run under torch.func "
                "transforms (grad, jacrev, vmap, ...): the solver's stopping depends on the "
                "values; use forward='sequential' there")
        runs = self._run_log()
        cfg = {"name": name, "layers": self.num_layers, "bias": self.bias,
               "forward": fwd if parallel and B > 0 else None,
               "forward_tol": fwd.tol_for(x.dtype) if parallel else None,
               "log": runs.begin(), "backward": bwd,
               "backward_name": describe(bwd), "runs": runs}
        fn = self._function
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(s.requires_grad for s in states)
            or any(w.requires_grad for w in weights))
        if not needs_grad:
            with torch.no_grad():
                res = fn.layers(cfg, x, *states, weights)[:1 + self._parts]
        elif isinstance(bwd, AutogradBackward) or transforms_active() or B == 0:
            runs.backward = BackwardRun("autograd")
            res = fn.layers(cfg, x, *states, weights)[:1 + self._parts]   # autograd, loop
        else:
            res = fn.apply(cfg, x, *states, *weights)
        out, finals = res[0], res[1:]
        if not batched:
            out, finals = out.squeeze(1), tuple(f.squeeze(1) for f in finals)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out.contiguous(), (finals[0] if self._parts == 1 else finals)


class ParaGRU(_ParaRNN):
    """ParaRNN's GRU: torch's GRU with diagonal hidden-to-hidden weights, whose forward pass is
    Newton's method over the sequence (exact per iteration, ``O(T H)``) and whose backward pass
    is one diagonal scan per layer.

    The cell (torch's gate order r, z, n and bias convention; ``w_hh`` a vector ``(3H,)``)::

        r = sigmoid(W_ir x + b_ir + w_hr * h + b_hr),   z = sigmoid(W_iz x + b_iz + w_hz * h + b_hz)
        n = tanh(W_in x + b_in + r * (w_hn * h + b_hn)),  h' = (1 - z) * n + z * h

    i.e. :class:`torch.nn.GRU` with ``W_hh = [diag(w_hr); diag(w_hz); diag(w_hn)]``. Given the
    input terms (one matrix product for all steps), every unit is a scalar recurrence, so
    ``d h_t / d h_{t-1}`` is diagonal (:mod:`paraprop.jacobians.diagonal`): each Newton
    iteration is one elementwise linearization and one diagonal
    :func:`paraprop.scan.linear_recurrence`.

    Arguments:
        input_size, hidden_size, num_layers, bias, batch_first, device, dtype: as
            :class:`torch.nn.GRU`. Parameters ``weight_ih_l{k}`` ``(3H, I)``,
            ``weight_hh_l{k}`` ``(3H,)`` (the diagonals), ``bias_ih_l{k}``, ``bias_hh_l{k}``
            ``(3H,)``, all initialised uniform in ``(-1/sqrt(H), 1/sqrt(H))``.
        forward: ``"newton"`` (the default: :class:`~paraprop.nn.ParallelForward` with
            Newton's method, stopping on the size of its step once the estimated distance to
            the sequential result is ``<= tol``, by default ``1e-5`` in float32 and ``1e-10``
            in float64), ``"sequential"`` (the reference: a Python loop over time, the input
            terms computed up front), any other method of :func:`paraprop.solve`, a solver
            object, or ``ParallelForward(method=..., tol=..., max_iters=..., throw=...)``.
            (``"quasi_newton"`` uses the same diagonal Jacobians, with the contraction
            stopping rule.) On CUDA, Newton's first iterations run a fused Triton step whose
            cell rounds differently; it is only a warm start: the torch cell's step
            certifies, so ``converged`` is about this module's loop (``tol=0``: its bits).
            ``last_forward`` says per layer which steps ran (``stats["newton_step"]``,
            ``["triton_iterations"]``, ``["triton_skipped"]``; docs/recurrences.md, "On the
            GPU").
        backward: ``"scan"`` (the default: the hidden-state gradients by one reverse diagonal
            :func:`paraprop.scan.linear_recurrence` per layer at the computed states, then the
            weight gradients in batched sums), ``"jacobi"`` (the same recurrence by Jacobi
            sweeps) or ``"autograd"`` (torch's autograd through the sequential loop; needs
            ``forward="sequential"``).

    Attributes:
        forward_config, backward_config, last_forward, last_backward: as
            :class:`paraprop.nn.GRU` (``last_forward`` is ``()`` after ``forward="sequential"``,
            the module's own loop).

    Raises:
        ValueError / TypeError: bad sizes or options (the message names the argument), inputs
            or states of the wrong shape, dtype or device.
        NotImplementedError: PackedSequence inputs; a parallel forward under :mod:`torch.func`
            transforms; double backward through the scan backward.
        paraprop.ConvergenceError: a parallel forward stopped by ``max_iters``
            (``throw=True``).

    Example:
        >>> gru = paraprop.nn.ParaGRU(3, 16, batch_first=True)        # forward="newton"
        >>> x = torch.randn(4, 500, 3)
        >>> out, h = gru(x)
        >>> gru.forward_config = "sequential"                           # the Python loop
        >>> ref, _ = gru(x)
        >>> bool((out - ref).abs().max() < 1e-5)
        True
    """

    _gates, _parts = 3, 1
    _function = ParaGRUFunction


class ParaLSTM(_ParaRNN):
    """ParaRNN's LSTM: torch's LSTM with diagonal hidden-to-hidden weights, whose forward pass
    is Newton's method over the sequence (exact per iteration, ``O(T H)``) and whose backward
    pass is one scan with ``2 x 2`` blocks per layer.

    The cell (torch's gate order i, f, g, o; ``w_hh`` a vector ``(4H,)``)::

        i = sigmoid(W_ii x + b_ii + b_hi + w_hi * h),   f = sigmoid(W_if x + b_if + b_hf + w_hf * h)
        g = tanh(W_ig x + b_ig + b_hg + w_hg * h),      o = sigmoid(W_io x + b_io + b_ho + w_ho * h)
        c' = f * c + i * g,   h' = o * tanh(c')

    i.e. :class:`torch.nn.LSTM` with ``W_hh = [diag(w_hi); diag(w_hf); diag(w_hg); diag(w_ho)]``.
    Given the input terms, unit ``j``'s ``(h_j, c_j)`` depends only on its own previous
    ``(h_j, c_j)``: the Jacobian of ``[h_t, c_t]`` is block diagonal with one ``2 x 2`` block
    per unit (:mod:`paraprop.jacobians.diagonal`), handled exactly by treating every unit as a
    recurrence of its own with a 2-value state: each Newton iteration is one elementwise
    linearization and one :func:`paraprop.scan.linear_recurrence` with dense ``2 x 2`` matrices
    over a batch of ``B x H`` units (``O(T H)``).

    Arguments:
        input_size, hidden_size, num_layers, bias, batch_first, device, dtype: as
            :class:`torch.nn.LSTM` (parameters ``weight_ih_l{k}`` ``(4H, I)``,
            ``weight_hh_l{k}`` ``(4H,)``, ``bias_ih_l{k}``, ``bias_hh_l{k}`` ``(4H,)``).
        forward, backward: as :class:`ParaGRU`.

    Attributes:
        forward_config, backward_config, last_forward, last_backward: as :class:`ParaGRU`
            (with ``forward="newton"`` every unit of a sample stops on its own).

    Raises:
        As :class:`ParaGRU`; ``hx`` must be a tuple ``(h0, c0)``.

    Example:
        >>> lstm = paraprop.nn.ParaLSTM(3, 16)                         # forward="newton"
        >>> x = torch.randn(500, 4, 3)
        >>> out, (h, c) = lstm(x)
        >>> lstm.forward_config = "sequential"                          # the Python loop
        >>> ref, (_, c_ref) = lstm(x)
        >>> bool((out - ref).abs().max() < 1e-5) and bool((c - c_ref).abs().max() < 1e-5)
        True
    """

    _gates, _parts = 4, 2
    _function = ParaLSTMFunction
