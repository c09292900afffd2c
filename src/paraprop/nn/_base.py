"""What the drop-in recurrent modules share: option checks, input plumbing, the backward switch."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence

BACKWARDS = ("scan", "jacobi", "autograd")
FORWARDS = ("sequential", "newton", "quasi_newton", "elk", "quasi_elk", "jacobi")


def check_options(cls_name: str, *, dropout, bidirectional, proj_size, backward, jacobi_iters,
                  jacobi_tol, scan_algorithm, forward="sequential", forward_tol=1e-6,
                  forward_max_iters=None, damping=None) -> None:
    """Reject what the scan backward does not implement, and bad values of the extra options."""
    from paraprop.scan import ALGORITHMS

    if bidirectional:
        raise NotImplementedError(
            f"paraprop.nn.{cls_name} does not support bidirectional=True; use "
            f"torch.nn.{cls_name} (or two modules, one on the flipped sequence)")
    if isinstance(dropout, int | float) and not isinstance(dropout, bool) and dropout != 0:
        raise NotImplementedError(
            f"paraprop.nn.{cls_name} does not support dropout between layers (got "
            f"dropout={dropout}); use torch.nn.{cls_name} or apply dropout outside")
    if proj_size:
        raise NotImplementedError(
            f"paraprop.nn.{cls_name} does not support proj_size (torch supports it only for "
            f"LSTM); got proj_size={proj_size}")
    if backward not in BACKWARDS:
        raise ValueError(f"unknown backward={backward!r}; choose one of {', '.join(BACKWARDS)}")
    if jacobi_iters is not None and (isinstance(jacobi_iters, bool)
                                     or not isinstance(jacobi_iters, int) or jacobi_iters < 1):
        raise ValueError(f"jacobi_iters must be a positive int or None, got {jacobi_iters!r}")
    if isinstance(jacobi_tol, bool) or not isinstance(jacobi_tol, int | float) \
            or not jacobi_tol >= 0:
        raise ValueError(f"jacobi_tol must be a number >= 0, got {jacobi_tol!r}")
    if backward != "jacobi" and (jacobi_iters is not None or jacobi_tol != 0):
        raise ValueError(f"jacobi_iters and jacobi_tol are only used with backward='jacobi', "
                         f"not backward={backward!r}")
    if scan_algorithm not in ALGORITHMS:
        raise ValueError(f"unknown scan_algorithm={scan_algorithm!r}; choose one of "
                         f"{', '.join(ALGORITHMS)}")
    if forward not in FORWARDS:
        raise ValueError(f"unknown forward={forward!r}; choose one of {', '.join(FORWARDS)}")
    if forward != "sequential" and backward == "autograd":
        raise ValueError(f"forward={forward!r} differentiates implicitly at the solution, with "
                         "backward='scan' or 'jacobi'; backward='autograd' needs "
                         "forward='sequential'")
    if isinstance(forward_tol, bool) or not isinstance(forward_tol, int | float) \
            or not forward_tol >= 0:
        raise ValueError(f"forward_tol must be a number >= 0, got {forward_tol!r}")
    if forward_max_iters is not None and (isinstance(forward_max_iters, bool) or not isinstance(
            forward_max_iters, int) or forward_max_iters < 1):
        raise ValueError(f"forward_max_iters must be a positive int or None, got "
                         f"{forward_max_iters!r}")
    if damping is not None and forward not in ("elk", "quasi_elk"):
        raise ValueError(f"damping is only used with forward='elk' or 'quasi_elk', not "
                         f"forward={forward!r}")
    if damping is not None and (isinstance(damping, bool) or not isinstance(damping, int | float)
                                or not damping > 0):
        raise ValueError(f"damping must be a number > 0, got {damping!r}")


def solve_layer(cfg: dict, adapter, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """One layer's outputs ``(T, B, H)`` for time-major inputs ``x`` by ``cfg["forward"]``:
    :func:`paraprop.solve` on the layer's :class:`paraprop.Recurrence` (no graph)."""
    from paraprop.recurrence import Recurrence
    from paraprop.solve import solve
    from paraprop.solvers import SOLVERS

    rec = Recurrence(adapter, x.transpose(0, 1), h0)
    method = cfg["forward"]
    if cfg["damping"] is not None:
        method = SOLVERS[method](damping=cfg["damping"])
    sol = solve(rec, rec.zeros(), method=method, dim=-2, tol=cfg["forward_tol"],
                max_iters=cfg["forward_max_iters"])
    st = sol.stats
    cfg["forward_stats"].setdefault("iterations", []).append(sol.iterations)
    cfg["forward_stats"].setdefault("residual", []).append(
        float(sol.residuals[-1]) if len(sol.residuals) else 0.0)
    cfg["forward_stats"].setdefault("resets", []).append(st.get("resets", 0))
    return sol.value.transpose(0, 1)


class ScanBackwardMixin:
    """Forward plumbing for the modules: shapes as torch.nn.RNN/GRU, then ``_function``.

    Subclasses set ``_function`` (an autograd Function taking ``cfg, x, h0, *weights`` with
    time-major ``x``) and inherit the parameters and ``forward`` of the torch module.
    """

    _function: type[torch.autograd.Function]

    def _weights(self) -> list[torch.Tensor]:
        names = []
        for k in range(self.num_layers):
            names += [f"weight_ih_l{k}", f"weight_hh_l{k}"]
            if self.bias:
                names += [f"bias_ih_l{k}", f"bias_hh_l{k}"]
        return [getattr(self, n) for n in names]

    def forward(self, input, hx=None):  # noqa: A002 - torch's argument name
        if isinstance(input, PackedSequence):
            raise NotImplementedError(
                f"paraprop.nn.{type(self).__name__} does not take a PackedSequence; pad the "
                "batch to one length or use the torch module")
        weights = self._weights()
        needs_grad = torch.is_grad_enabled() and (
            input.requires_grad or (hx is not None and hx.requires_grad)
            or any(w.requires_grad for w in weights))
        if self.forward_method == "sequential" and (self.backward == "autograd" or not needs_grad):
            return super().forward(input, hx)
        if input.dim() not in (2, 3):
            raise ValueError(f"{type(self).__name__}: expected input to be 2D or 3D, got "
                             f"{input.dim()}D tensor of shape {tuple(input.shape)}")
        if input.shape[-1] != self.input_size:
            raise ValueError(f"input.size(-1) must be equal to input_size={self.input_size}, got "
                             f"input of shape {tuple(input.shape)}")
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1)
        if batched and self.batch_first:
            x = x.transpose(0, 1)
        T, B = x.shape[:2]
        if T < 1:
            raise ValueError(f"{type(self).__name__}: the sequence is empty (input shape "
                             f"{tuple(input.shape)})")
        expect = (self.num_layers, B, self.hidden_size)
        if hx is None:
            h0 = torch.zeros(expect, dtype=x.dtype, device=x.device)
        else:
            h0 = hx if batched else (hx.unsqueeze(1) if hx.dim() == 2 else hx)
            if tuple(h0.shape) != expect:
                raise ValueError(f"expected hidden size {expect if batched else expect[::2]}, "
                                 f"got {tuple(hx.shape)}")
            if h0.dtype != x.dtype:
                raise TypeError(f"hx has dtype {h0.dtype} but input has {x.dtype}")
        if any(w.dtype != x.dtype for w in weights):
            raise TypeError(f"input has dtype {x.dtype} but the parameters have "
                            f"{weights[0].dtype}")
        cfg = {"mode": self.mode, "layers": self.num_layers, "bias": self.bias,
               "backward": self.backward, "iters": self.jacobi_iters, "tol": self.jacobi_tol,
               "algorithm": self.scan_algorithm, "stats": self.backward_stats,
               "forward": self.forward_method, "forward_tol": self.forward_tol,
               "forward_max_iters": self.forward_max_iters, "damping": self.damping,
               "forward_stats": self.forward_stats}
        self.forward_stats.clear()
        if needs_grad:
            out, hn = self._function.apply(cfg, x, h0, *weights)
        else:
            with torch.no_grad():
                out, hn, _ = self._function.layers(cfg, x, h0, weights, save=False)
        if not batched:
            return out.squeeze(1), hn.squeeze(1)
        return (out.transpose(0, 1) if self.batch_first else out), hn

    def _init_forward(self, forward, forward_tol, forward_max_iters, damping) -> None:
        self.forward_method = forward
        self.forward_tol = forward_tol
        self.forward_max_iters = forward_max_iters
        self.damping = damping
        self.forward_stats: dict = {}

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", backward={self.backward!r}"
        if self.forward_method != "sequential":
            s += f", forward={self.forward_method!r}, forward_tol={self.forward_tol}"
        if self.backward == "jacobi":
            s += f", jacobi_iters={self.jacobi_iters}, jacobi_tol={self.jacobi_tol}"
        if self.scan_algorithm != "auto":
            s += f", scan_algorithm={self.scan_algorithm!r}"
        return s
