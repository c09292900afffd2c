"""``paraprop.Recurrence``: a Markov recurrence ``s_t = cell(u_t, s_{t-1})`` as a triangular system.

Seen as the system ``x = fn(x)`` of :func:`paraprop.solve` (Song et al. 2021, eq. 2) with
``fn(x)_t = cell(u_t, x_{t-1})`` and ``x_{-1} = h0``, a recurrent network's forward pass is the
Markov special case: position ``t`` depends on position ``t - 1`` only. Every method of
:func:`paraprop.solve` applies to it; the Newton-type methods (``"newton"``, ``"quasi_newton"``,
``"elk"``, :mod:`paraprop.solvers.newton`) also use its Jacobians ``J_t = d s_t / d s_{t-1}``:

- analytic for :class:`torch.nn.RNNCell`, :class:`torch.nn.GRUCell` (the GRU's in the factored
  form ``diag(z_t) + [I I I] diag(c_t) W_hh`` of BPPSA, Wang et al. 2020, Appendix E, so no
  ``T x H x H`` array is formed for Newton) and :class:`torch.nn.LSTMCell` (on the concatenated
  state ``[h, c]``, a :class:`paraprop.scan.LSTMFactored`: four vectors per step and
  ``W_hh``), computed together with the cell in one blocked pass;
- from a ``jacobian(input, hidden)`` method of the cell when it has one (dense ``(N, H, H)``);
- otherwise by reverse-mode autograd on ``H`` stacked copies of the rows (any differentiable
  cell).

The solution is differentiable: gradients with respect to ``inputs``, ``h0`` and the cell's
parameters come from implicit differentiation at the solution, one reverse
:func:`paraprop.scan.linear_recurrence` with ``J_{t+1}^T`` and one batched vector-Jacobian
product of the cell over all steps, whichever method produced the solution.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from paraprop import checks
from paraprop.determinism import require_deterministic
from paraprop.jacobians.linearized import AnalyticCell, cell_adapter
from paraprop.scan import Factored, LSTMFactored, linear_recurrence

__all__ = ["Recurrence"]

FORMS = ("dense", "diag", "any")


class Recurrence:
    """The states ``s_t = cell(u_t, s_{t-1})``, ``t = 0 .. T-1``, ``s_{-1} = h0``, as ``fn``.

    Pass it as ``fn`` to :func:`paraprop.solve` with ``x0`` of shape :attr:`shape` (zeros, or a
    previous solution as a warm start) and ``dim=-2``.

    Arguments:
        cell: ``cell(input, hidden) -> hidden`` on rows (``(N, I)``, ``(N, H)`` -> ``(N, H)``),
            in the argument order of :class:`torch.nn.RNNCell`; a torch ``RNNCell``,
            ``GRUCell`` or ``LSTMCell`` (whose state is ``[h, c]`` concatenated, ``H = 2 *
            hidden_size``), or any callable. With ``inputs=None`` it is called as
            ``cell(None, hidden)`` (an autonomous recurrence). An optional
            ``cell.jacobian(input, hidden)`` returning ``(N, H, H)`` with ``J[n, i, j] =
            d out_i / d hidden_j`` replaces the autograd Jacobians.
        inputs: ``(*batch, T, I)``, or ``None`` with ``length`` given.
        h0: ``(*batch, H)`` initial state; ``None`` for zeros (then ``H`` comes from the cell's
            ``hidden_size`` or from ``hidden_size``).
        length: ``T`` when ``inputs`` is ``None``.
        hidden_size: ``H`` when neither ``h0`` nor the cell tells it.
        params: tensors the cell uses besides ``cell.parameters()`` (for gradients of a plain
            function closing over tensors); by default the parameters of an ``nn.Module`` cell.

    Attributes:
        shape: ``(*batch, T, H)``, the shape of the states (and of ``x0``).

    Raises:
        TypeError: a cell that is not callable; ``inputs`` / ``h0`` not tensors, not floating
            point, of different dtypes, or of another dtype than the parameters of an
            ``nn.Module`` (or torch) cell.
        ValueError: shapes that do not fit (``T``, the batch shape of ``h0``, the state size,
            a torch cell's ``input_size``); ``h0`` on another device than ``inputs``, or either
            on another device than the cell's parameters.

    Example:
        >>> cell = torch.nn.GRUCell(4, 8)
        >>> rec = paraprop.Recurrence(cell, torch.randn(4, 200, 4))     # (*batch, T, I)
        >>> sol = paraprop.solve(rec, torch.zeros(rec.shape), method="newton", dim=-2)
        >>> ref = paraprop.solve(rec, torch.zeros(rec.shape), method="sequential", dim=-2)
        >>> bool((sol.value - ref.value).abs().max() < 1e-5)
        True
    """

    markov = True

    def __init__(self, cell, inputs: torch.Tensor | None = None, h0: torch.Tensor | None = None,
                 *, length: int | None = None, hidden_size: int | None = None, params=None):
        checks.callable_arg("cell", cell)
        # every method evaluates the cell on other rows than the loop: a stochastic cell (train
        # mode with dropout, ...) has no sequential result to reproduce
        require_deterministic(cell, argument="cell", entry="paraprop.Recurrence")
        for name, t in (("inputs", inputs), ("h0", h0)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if inputs is not None:
            if inputs.dim() < 2 or inputs.shape[-2] < 1:
                raise ValueError(f"inputs must have shape (*batch, T, I) with T >= 1, got "
                                 f"{tuple(inputs.shape)}")
            if length is not None and length != inputs.shape[-2]:
                raise ValueError(f"length={length} does not match inputs of shape "
                                 f"{tuple(inputs.shape)} (T={inputs.shape[-2]})")
            batch, T = inputs.shape[:-2], inputs.shape[-2]
            ref = inputs
        else:
            if not checks.is_int(length) or length < 1:
                raise ValueError(f"without inputs, length must be a positive int, got {length!r}")
            if h0 is None:
                raise ValueError("without inputs, h0 is needed (it gives the batch shape)")
            batch, T, ref = h0.shape[:-1], length, h0
        if not ref.is_floating_point():
            raise TypeError(f"inputs and h0 must be floating point, got {ref.dtype}")
        self.cell = cell
        self._adapter = cell_adapter(cell)
        if inputs is None and isinstance(cell, nn.RNNCellBase | AnalyticCell):
            raise ValueError(f"a torch {type(cell).__name__} needs inputs")
        _check_cell(cell, inputs, "inputs" if inputs is not None else "h0", ref)
        H = self._adapter.state_size if self._adapter.state_size is not None else None
        if h0 is not None:
            if h0.dim() < 1 or h0.shape[:-1] != batch:
                raise ValueError(f"h0 must have shape (*batch, H) with batch {tuple(batch)}, "
                                 f"got {tuple(h0.shape)}")
            if H is not None and h0.shape[-1] != H:
                raise ValueError(f"h0 has {h0.shape[-1]} features but the cell's state has {H}")
            if h0.dtype != ref.dtype or h0.device != ref.device:
                err = TypeError if h0.dtype != ref.dtype else ValueError
                raise err(f"h0 ({h0.dtype}, {h0.device}) must match inputs "
                          f"({ref.dtype}, {ref.device})")
            H = h0.shape[-1]
        if H is None:
            H = hidden_size
        if not checks.is_int(H) or H < 1:
            raise ValueError("the state size is unknown: pass h0 or hidden_size "
                             f"(got hidden_size={hidden_size!r})")
        if hidden_size is not None and hidden_size != H:
            raise ValueError(f"hidden_size={hidden_size} does not match the state size {H}")
        self.batch_shape, self.T, self.H = torch.Size(batch), T, H
        self.shape = torch.Size((*batch, T, H))
        self.dtype, self.device = ref.dtype, ref.device
        self.B = self.batch_shape.numel()
        self.inputs = inputs
        self.h0 = h0
        self._u = None if inputs is None else inputs.detach().reshape(self.B, T, -1)
        self._h0 = (torch.zeros(self.B, H, dtype=ref.dtype, device=ref.device) if h0 is None
                    else h0.detach().reshape(self.B, H))
        if params is None:
            params = list(cell.parameters()) if isinstance(cell, nn.Module | AnalyticCell) else []
        self.params = [p for p in params if isinstance(p, torch.Tensor)]
        self._pre = None  # per-step input terms of the analytic cells, computed once

    # -- the triangular system ------------------------------------------------------------
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``fn(x)``: every position at once from the previous states ``x_{t-1}``."""
        xc = self._canon(x)
        return self.evaluate_from(xc, 0).reshape(x.shape)

    def update(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Positions ``index`` of ``fn(x)``, ``(*batch, len(index), H)`` (the sequential path)."""
        xc = self._canon(x)
        idx = index.to(xc.device)
        prev = xc.index_select(1, (idx - 1).clamp_(min=0))
        first = idx == 0
        if bool(first.any()):
            prev = torch.where(first[None, :, None], self._h0[:, None], prev)
        y = self._adapter.rows(self._inputs_at(idx), prev.reshape(-1, self.H), self)
        return y.reshape(*self.batch_shape, idx.numel(), self.H)

    def evaluate_from(self, xc: torch.Tensor, lo: int) -> torch.Tensor:
        """``fn(x)`` at positions ``[lo, T)`` from canonical ``xc`` ``(B, T, H)``."""
        return self.linearize(xc, lo, None)[0]

    def linearize(self, xc: torch.Tensor, lo: int, form: str | None):
        """``fn(x)`` at positions ``[lo, T)`` and, unless ``form`` is ``None``, the Jacobians
        ``J_t = d fn_t / d x_{t-1}`` there: ``"dense"`` ``(B, n, H, H)``, ``"diag"`` (their
        diagonals, ``(B, n, H)``) or ``"any"`` (the cheapest exact form: a
        :class:`paraprop.scan.Factored` (RNN, GRU) or :class:`paraprop.scan.LSTMFactored`
        for the analytic cells, dense otherwise)."""
        prev = self._previous(xc, lo)
        return self._adapter.linearize(self, prev, lo, form)

    def zeros(self) -> torch.Tensor:
        """An initial guess of zeros, shaped like the states."""
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    # -- helpers --------------------------------------------------------------------------
    def _canon(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape) != tuple(self.shape):
            raise ValueError(f"Recurrence: states must have shape {tuple(self.shape)} "
                             f"(*batch, T, H), got {tuple(x.shape)}")
        return x.reshape(self.B, self.T, self.H)

    def _previous(self, xc: torch.Tensor, lo: int) -> torch.Tensor:
        """``x_{t-1}`` for ``t`` in ``[lo, T)``, ``(B, T - lo, H)``."""
        if lo == 0:
            return torch.cat([self._h0[:, None], xc[:, :-1]], 1)
        return xc[:, lo - 1:-1]

    def _inputs_at(self, idx) -> torch.Tensor | None:
        if self._u is None:
            return None
        return self._u.index_select(1, idx).reshape(-1, self._u.shape[-1])

    def _inputs_from(self, lo: int) -> torch.Tensor | None:
        if self._u is None:
            return None
        return self._u[:, lo:].reshape(-1, self._u.shape[-1])

    def attach(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (the solution) made differentiable with respect to ``inputs``, ``h0`` and
        the parameters by implicit differentiation; ``value`` itself when nothing needs a
        gradient or grad mode is off."""
        leaves = [t for t in (self.inputs, self.h0, *self.params) if t is not None]
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in leaves):
            return value
        inputs = self.inputs if self.inputs is not None else value.new_empty(0)
        h0 = self.h0 if self.h0 is not None else value.new_empty(0)
        return _Implicit.apply(self, value.detach(), inputs, h0, *self.params)


def _check_cell(cell, inputs, name: str, ref: torch.Tensor) -> None:
    """``inputs`` / ``h0`` against the cell: the dtype and device of its parameters (an
    ``nn.Module`` cell or a torch cell), the input size of a torch cell."""
    if isinstance(cell, nn.Module | AnalyticCell):
        p = next((t for t in cell.parameters() if t.is_floating_point()), None)
        if p is not None and p.dtype != ref.dtype:
            raise TypeError(f"{name} must have the dtype of the cell's parameters, {p.dtype}, "
                            f"got {ref.dtype}")
        if p is not None and p.device != ref.device:
            raise ValueError(f"{name} must be on the device of the cell's parameters, "
                             f"{p.device}, got {ref.device}")
    if isinstance(cell, nn.RNNCellBase):
        size = cell.input_size
    elif isinstance(cell, AnalyticCell):
        size = cell.w_ih.shape[-1]
    else:
        return
    if inputs is not None and inputs.shape[-1] != size:
        raise ValueError(f"inputs must have {size} features (the cell's input_size), got shape "
                         f"{tuple(inputs.shape)}")


class _Implicit(torch.autograd.Function):
    """Gradients of the solution ``s`` of ``s_t = f(u_t, s_{t-1}; theta)`` at the solution.

    With ``G_t = dL/ds_t`` (direct), the total ``lambda_t = dL/ds_t`` obeys the reverse linear
    recurrence ``lambda_t = G_t + J_{t+1}^T lambda_{t+1}``; then ``dL/dtheta = sum_t lambda_t^T
    df_t/dtheta``, ``dL/du_t = lambda_t^T df_t/du_t`` and ``dL/dh0 = J_0^T lambda_0`` come from
    one batched vector-Jacobian product of the cell over all steps.
    """

    @staticmethod
    def forward(ctx, rec, value, inputs, h0, *params):
        ctx.rec = rec
        ctx.save_for_backward(value)
        return value.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, G):
        rec = ctx.rec
        (value,) = ctx.saved_tensors
        B, T, H = rec.B, rec.T, rec.H
        xc = value.reshape(B, T, H)
        g = G.reshape(B, T, H)
        lam = torch.empty_like(g)
        lam[:, -1] = g[:, -1]
        if T > 1:
            _, J = rec.linearize(xc, 1, "any")          # J_t for t = 1 .. T-1
            lam[:, :-1] = linear_recurrence(_transpose(J), g[:, :-1], g[:, -1], reverse=True)
        need = ctx.needs_input_grad
        prev = rec._previous(xc, 0).reshape(-1, H).detach().requires_grad_(True)
        u = rec._inputs_from(0)
        wrt = [prev]
        if u is not None and need[2]:
            u = u.detach().requires_grad_(True)
            wrt.append(u)
        params = [p for p, n in zip(rec.params, need[4:], strict=True) if n]
        with torch.enable_grad():
            y = rec._adapter.rows(u, prev, rec)
            if y.requires_grad:
                grads = torch.autograd.grad(y, [*wrt, *params], lam.reshape(-1, H),
                                            allow_unused=True)
            else:                                       # nothing reaches the output
                grads = [None] * (len(wrt) + len(params))
        g_prev = torch.zeros_like(prev) if grads[0] is None else grads[0]
        g_prev = g_prev.reshape(B, T, H)
        g_u = None
        if len(wrt) > 1:
            g_u = (torch.zeros_like(u) if grads[1] is None else grads[1]).reshape(
                rec.inputs.shape)
        pit = iter(grads[len(wrt):])
        g_params = [next(pit) if n else None for n in need[4:]]
        g_h0 = g_prev[:, 0].reshape(rec.h0.shape) if need[3] else None
        return (None, None, g_u, g_h0, *g_params)


def _transpose(J):
    """``J_t^T`` for every step, in the form of ``J``."""
    if isinstance(J, LSTMFactored):
        return dataclasses.replace(J, transposed=not J.transposed)
    if isinstance(J, Factored):   # (diag(d) + L diag(s) R)^T = diag(d) + R^T diag(s) L^T
        return Factored(scale=J.scale, diag=J.diag,
                        left=None if J.right is None else J.right.t(),
                        right=None if J.left is None else J.left.t())
    return J.transpose(-1, -2)
