"""A stacked RNN's forward and backward propagation as a nested block bi-diagonal system.

For ``nn.RNN`` with ``K`` layers over ``tau`` steps, ``y_t^k = W^k h_t^{k-1} + U^k h_{t-1}^k + b^k``
and ``h_t^k = f(y_t^k)`` (``h_t^0 = x_t``). Backward propagation through layers and time,
``delta_t^k = E_t^k (W^{k+1 T} delta_t^{k+1} + U^{k T} delta_{t+1}^k + g_t^k)``, is an upper
system in which every unknown couples to the layer above and to the next step (Naumov 2017,
eq. 23-24). Ordered by time outside and layers inside it is block bi-diagonal twice over::

    outer (time):  [ A_1  B_1             ]     A_t: the upper K-block system of step t,
                   [      A_2  B_2        ]          -E_t^k W^{k+1 T} above its identity diagonal
                   [           ...  ...   ]     B_t: blockdiag_k(-E_t^k U^{k T}), step t -> t+1
                   [                A_tau ]

and the forward system, linearised at the points of a pass, is the lower analogue. Cyclic
reduction inverts all ``A_t`` at once (``ceil(log2 K) + 1`` levels) and then reduces the time
dimension (``ceil(log2 tau)`` levels): ``O(log K + log tau)`` levels against the ``K * tau`` of
the sequential BPTT and the paper's ``O(log K log tau)`` bound; the price is dense
``(K n) x (K n)`` fill-in blocks per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from paraprop import checks
from paraprop.determinism import require_deterministic
from paraprop.driver import Outcome, build
from paraprop.linalg.entry import check_solver_args, solve
from paraprop.linalg.operators import BlockDiagonalOperator, MatrixOperator
from paraprop.linalg.system import BlockBidiagonal
from paraprop.result import Result, Solution

__all__ = ["RNNSystems", "from_rnn", "rnn_backward"]


@dataclass(frozen=True)
class RNNSystems:
    """The systems of :func:`from_rnn`; unknowns ordered ``(t, k)``: ``x[:, (t*K + k)*n : ...]``.

    Attributes:
        forward, forward_rhs: the nested lower system in the hidden states ``h_t^k`` (exact at
            the points of this pass) and its right-hand side ``(B, tau*K*n)``.
        backward, backward_rhs: the nested upper system in ``delta_t^k = dL/dy_t^k`` and its
            right-hand side (``None`` without gradients).
        hidden: ``(tau, K, B, n)`` hidden states of the pass; ``pre``: the pre-activations.
        output, h_n: as returned by ``rnn(x, h0)``.

    Example:
        >>> rnn = nn.RNN(3, 4, num_layers=2).double()             # K = 2 layers, n = 4
        >>> S = from_rnn(rnn, torch.randn(6, 2, 3, dtype=torch.float64))  # tau = 6, B = 2
        >>> h = paraprop.linalg.solve(S.forward, S.forward_rhs).value     # (B, tau * K * n)
        >>> torch.allclose(h.view(2, 6, 2, 4), S.hidden.permute(2, 0, 1, 3))
        True
    """

    forward: BlockBidiagonal
    forward_rhs: torch.Tensor
    backward: BlockBidiagonal
    backward_rhs: torch.Tensor | None
    hidden: torch.Tensor
    pre: torch.Tensor
    output: torch.Tensor
    h_n: torch.Tensor


def _act(rnn: nn.RNN, y: torch.Tensor):
    if rnn.nonlinearity == "tanh":
        h = torch.tanh(y)
        return h, 1 - h * h
    return torch.relu(y), (y > 0).to(y.dtype)


def _weights(rnn: nn.RNN):
    K = rnn.num_layers
    W = [getattr(rnn, f"weight_ih_l{k}").detach() for k in range(K)]
    U = [getattr(rnn, f"weight_hh_l{k}").detach() for k in range(K)]
    if rnn.bias:
        b = [(getattr(rnn, f"bias_ih_l{k}") + getattr(rnn, f"bias_hh_l{k}")).detach()
             for k in range(K)]
    else:
        b = [None] * K
    return W, U, b


def _validate(rnn, x, h0, grad_output, grad_hn, entry: str):
    """Check every argument once; return ``x`` detached, time-major ``(tau, B, input_size)``,
    and ``h0``, ``grad_output``, ``grad_hn`` detached (``None`` stays ``None``)."""
    if not isinstance(rnn, nn.RNN):
        raise TypeError(f"rnn must be an nn.RNN, got {type(rnn).__name__}")
    if rnn.bidirectional:
        raise ValueError("bidirectional RNNs are not supported (two systems; solve each)")
    # dropout between layers in train mode: the shared check (paraprop.determinism)
    require_deterministic(rnn, argument="rnn", entry=entry)
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != rnn.input_size:
        raise ValueError(f"x must have shape (tau, B, {rnn.input_size}) "
                         f"({'(B, tau, ...)' if rnn.batch_first else 'batch_first=False'}), "
                         f"got {tuple(getattr(x, 'shape', ()))}")
    # (nn.Module.__getattr__ is typed Tensor | Module; a torch RNN's weight is a Parameter)
    w = cast(torch.Tensor, rnn.weight_ih_l0)
    checks.same_kind("x", x, w, "the rnn")
    xs = x.detach().transpose(0, 1) if rnn.batch_first else x.detach()
    tau, B, _ = xs.shape
    if tau == 0:
        raise ValueError(f"x must have at least one time step, got shape {tuple(x.shape)}")
    K, n = rnn.num_layers, rnn.hidden_size
    out_shape = (B, tau, n) if rnn.batch_first else (tau, B, n)
    checked: list[torch.Tensor | None] = [_check_tensor("x", x, tuple(x.shape), w)]
    for name, t, shape in (("h0", h0, (K, B, n)), ("grad_output", grad_output, out_shape),
                           ("grad_hn", grad_hn, (K, B, n))):
        checked.append(None if t is None else _check_tensor(name, t, shape, w))
    return xs, *checked[1:]


def _check_tensor(name: str, t, shape: tuple, w: torch.Tensor) -> torch.Tensor:
    """``t`` detached, after checking its type, shape, dtype and device (against the weight
    ``w``) and that it is finite."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    checks.same_kind(name, t, w, "the rnn")
    return checks.finite(name, t).detach()


def from_rnn(rnn: nn.RNN, x: torch.Tensor, *, h0: torch.Tensor | None = None,
             grad_output: torch.Tensor | None = None,
             grad_hn: torch.Tensor | None = None) -> RNNSystems:
    """The nested forward (lower) and backward (upper) systems of a stacked ``nn.RNN``.

    Arguments:
        rnn: ``nn.RNN`` (tanh or relu, any ``num_layers``, with or without bias,
            ``batch_first`` either way; unidirectional, no dropout in training mode).
        x: the input sequence, ``(tau, B, input_size)`` (``(B, tau, ...)`` if ``batch_first``).
        h0: initial hidden states ``(K, B, hidden_size)``; zeros when ``None``.
        grad_output: ``dL/d output`` (shaped like the output); builds ``backward_rhs``.
        grad_hn: ``dL/d h_n`` ``(K, B, hidden_size)``, optional.

    Returns:
        :class:`RNNSystems` (Naumov 2017, eq. 23-24).

    Raises:
        TypeError / ValueError: unsupported RNNs; shapes, dtypes or devices of ``x``, ``h0``,
            ``grad_output``, ``grad_hn``, or a NaN/inf in them (named).
        paraprop.StochasticModelError: (a ``ValueError``) ``rnn`` in train mode with
            ``dropout > 0`` (call ``rnn.eval()``).

    Example:
        >>> rnn = nn.RNN(3, 4, num_layers=2).double()
        >>> x = torch.randn(5, 2, 3, dtype=torch.float64)
        >>> S = from_rnn(rnn, x)
        >>> h = solve(S.forward, S.forward_rhs).value.reshape(2, 5, 2, 4)   # (B, tau, K, n)
        >>> torch.allclose(h[:, :, -1].transpose(0, 1), rnn(x)[0])
        True
    """
    xs, h0, grad_output, grad_hn = _validate(rnn, x, h0, grad_output, grad_hn,
                                             "linalg.from_rnn")
    with torch.no_grad():
        return _build(rnn, xs, h0, grad_output, grad_hn)


def _build(rnn, xs, h0, grad_output, grad_hn) -> RNNSystems:
    tau, B, _ = xs.shape
    K, n = rnn.num_layers, rnn.hidden_size
    dt, dev = xs.dtype, xs.device
    W, U, b = _weights(rnn)
    h_prev = [torch.zeros(B, n, dtype=dt, device=dev) if h0 is None else h0[k].detach()
              for k in range(K)]
    init = list(h_prev)
    H = torch.empty(tau, K, B, n, dtype=dt, device=dev)
    Y = torch.empty(tau, K, B, n, dtype=dt, device=dev)
    D = torch.empty(tau, K, B, n, dtype=dt, device=dev)
    for t in range(tau):  # the pass that gives the activation points
        inp = xs[t]
        for k in range(K):
            y = inp @ W[k].T + h_prev[k] @ U[k].T
            if b[k] is not None:
                y = y + b[k]
            h, d = _act(rnn, y)
            H[t, k], Y[t, k], D[t, k] = h, y, d
            h_prev[k] = h
            inp = h
    sizes_in = [n] * K
    # forward (lower, lower): tangent linearisation h = D y + e, exact at the points
    E = H - D * Y
    rhs = D * (torch.stack([bk if bk is not None else torch.zeros(n, dtype=dt, device=dev)
                            for bk in b]).unsqueeze(1)) + E  # (tau, K, B, n)
    rhs[:, 0] += D[:, 0] * (xs @ W[0].T)
    rhs[0] += D[0] * torch.stack([init[k] @ U[k].T for k in range(K)])
    f_inner = [BlockBidiagonal._trusted(True, [MatrixOperator(W[k]) for k in range(1, K)],
                                        [None] * K, [-D[t, k] for k in range(1, K)], sizes_in,
                                        B, dt, dev) for t in range(tau)]
    f_outer_op = BlockDiagonalOperator(list(U))
    f_scale = [-D[t].transpose(0, 1).reshape(B, K * n) for t in range(1, tau)]
    fwd = BlockBidiagonal._trusted(True, [f_outer_op] * (tau - 1), f_inner, f_scale,
                                   [K * n] * tau, B, dt, dev)
    f_rhs = rhs.permute(2, 0, 1, 3).reshape(B, tau * K * n)
    # backward (upper, upper)
    b_inner = [BlockBidiagonal._trusted(False, [MatrixOperator(W[k].T) for k in range(1, K)],
                                        [None] * K, [-D[t, k] for k in range(K - 1)], sizes_in,
                                        B, dt, dev) for t in range(tau)]
    b_outer_op = BlockDiagonalOperator([u.T for u in U])
    b_scale = [-D[t].transpose(0, 1).reshape(B, K * n) for t in range(tau - 1)]
    bwd = BlockBidiagonal._trusted(False, [b_outer_op] * (tau - 1), b_inner, b_scale,
                                   [K * n] * tau, B, dt, dev)
    b_rhs = None
    if grad_output is not None or grad_hn is not None:
        G = torch.zeros(tau, K, B, n, dtype=dt, device=dev)
        if grad_output is not None:
            go = grad_output.detach()
            G[:, -1] = go.transpose(0, 1) if rnn.batch_first else go
        if grad_hn is not None:
            G[-1] += grad_hn.detach()
        b_rhs = (D * G).permute(2, 0, 1, 3).reshape(B, tau * K * n)
    out = H[:, -1]
    output = out.transpose(0, 1) if rnn.batch_first else out
    return RNNSystems(fwd, f_rhs, bwd, b_rhs, H, Y, output, H[-1].clone())


def rnn_backward(rnn: nn.RNN, x: torch.Tensor, grad_output: torch.Tensor | None, *,
                 h0: torch.Tensor | None = None, grad_hn: torch.Tensor | None = None,
                 method: str = "cyclic_reduction", tol: float | None = None,
                 max_iters: int | None = None, throw: bool = True
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]], Solution]:
    """Gradients of a stacked ``nn.RNN`` by solving its nested backward system (eq. 23-24).

    Arguments:
        rnn, x, h0, grad_output, grad_hn: as for :func:`from_rnn` (at least one gradient).
        method: any of :data:`paraprop.linalg.METHODS`; ``"cyclic_reduction"`` takes
            ``ceil(log2 K) + 1 + ceil(log2 tau)`` levels.
        tol, max_iters: for the iterative methods.
        throw: raise :class:`~paraprop.ConvergenceError` when an iterative method stops
            unconverged; ``False`` returns the gradients of the last iterate with
            ``solution.converged`` ``False``.

    Returns:
        ``((grad_input, grad_h0, grad_params), solution)``: the gradients (``grad_params`` in
        ``rnn.parameters()`` order), equal to autograd's, and the :class:`~paraprop.Solution`
        of the backward system.

    Raises:
        TypeError / ValueError: unsupported RNNs; shapes, dtypes, devices or NaN/inf of the
            tensors (named); no gradient given; bad solver options (as
            :func:`paraprop.linalg.solve`); ``paraprop.StochasticModelError`` for an ``rnn`` in
            train mode with ``dropout > 0``. An empty batch gives zero gradients;
        ConvergenceError: an iterative method did not converge and ``throw=True``.

    Example:
        >>> rnn = nn.RNN(3, 4, num_layers=2).double()
        >>> x = torch.randn(6, 2, 3, dtype=torch.float64)
        >>> g = torch.randn(6, 2, 4, dtype=torch.float64)
        >>> (gx, gh0, gp), sol = rnn_backward(rnn, x, g)
        >>> ref = torch.autograd.grad(rnn(x.requires_grad_())[0], [x, *rnn.parameters()], g)
        >>> torch.allclose(gx, ref[0]) and all(torch.allclose(a, b) for a, b in zip(gp, ref[1:]))
        True
    """
    if grad_output is None and grad_hn is None:
        raise ValueError("give grad_output and/or grad_hn")
    checks.boolean("throw", throw)
    xs, h0, grad_output, grad_hn = _validate(rnn, x, h0, grad_output, grad_hn,
                                             "linalg.rnn_backward")
    if xs.shape[1] == 0:  # an empty batch: zero gradients, as autograd gives
        check_solver_args(method, tol, max_iters)
        K, n = rnn.num_layers, rnn.hidden_size
        out = (torch.zeros_like(x), xs.new_zeros(K, 0, n),
               [torch.zeros_like(p.detach()) for p in rnn.parameters()])
        st = {"levels": 0, "flops": 0, "memory_bytes": 0, "l": xs.shape[0],
              "N": xs.shape[0] * K * n}
        empty = Outcome(xs.new_zeros(0, xs.shape[0] * K * n), Result.successful, evaluations=0,
                        sequential_steps=0, error_estimate=0.0, stats=st)
        return out, build(method, empty, iterations=0, time_s=0.0)
    with torch.no_grad():
        S = _build(rnn, xs, h0, grad_output, grad_hn)
    sol = solve(S.backward, S.backward_rhs, method=method, tol=tol, max_iters=max_iters,
                throw=throw)
    tau, K, B, n = S.hidden.shape
    with torch.no_grad():
        delta = sol.value.reshape(B, tau, K, n).permute(1, 2, 0, 3)  # (tau, K, B, n)
        W, U, _ = _weights(rnn)
        init = torch.zeros(K, B, n, dtype=xs.dtype, device=xs.device) if h0 is None else \
            h0.detach()
        h_before = torch.cat([init.unsqueeze(0), S.hidden[:-1]])  # h_{t-1}^k
        grads = {}
        for k in range(K):
            below = xs if k == 0 else S.hidden[:, k - 1]
            grads[f"weight_ih_l{k}"] = torch.einsum("tbi,tbj->ij", delta[:, k], below)
            grads[f"weight_hh_l{k}"] = torch.einsum("tbi,tbj->ij", delta[:, k], h_before[:, k])
            if rnn.bias:
                gb = delta[:, k].sum((0, 1))
                grads[f"bias_ih_l{k}"] = gb
                grads[f"bias_hh_l{k}"] = gb.clone()
        gx = delta[:, 0] @ W[0]
        grad_input = gx.transpose(0, 1) if rnn.batch_first else gx
        grad_h0 = torch.stack([delta[0, k] @ U[k] for k in range(K)])
        params = [grads[name] for name, _ in rnn.named_parameters()]
    return (grad_input, grad_h0, params), sol
