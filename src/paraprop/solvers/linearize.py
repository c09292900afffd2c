"""How a Newton-type solver reads ``fn``: its values and the Jacobians ``d fn_t / d x_{t-1}``.

:func:`choose_access` chooses between two ways:

- :class:`MarkovAccess`: ``fn`` is a :class:`paraprop.Recurrence` (or follows its
  ``linearize`` protocol, :class:`~paraprop.solvers.protocols.SupportsLinearize`): the values
  and Jacobians of the suffix ``[lo, T)`` only, analytic where the cell has them, and the fused
  step of ``fn.newton_step`` where it offers one; the hooks' results are checked (shape, dtype,
  not a view of ``x``) and a broken promise is a :class:`~paraprop.ProtocolError`.
- :class:`FullAccess`: any triangular ``fn``: full evaluations, and the sub-diagonal Jacobian
  blocks by one forward-mode product per feature (exact for a Markov ``fn``).
"""

from __future__ import annotations

import torch

from paraprop.errors import ConvergenceError, ProtocolError
from paraprop.solvers.base import check_final
from paraprop.solvers.protocols import HOOKS
from paraprop.solvers.triangular import System

__all__ = ["MAX_PLAIN_FEATURES", "FullAccess", "MarkovAccess", "choose_access"]


class MarkovAccess:
    """``fn`` is a :class:`paraprop.Recurrence` (or follows its ``linearize`` protocol):
    values and Jacobians of the suffix only."""

    markov = True

    def __init__(self, system: System):
        self.system = system

    def linearize(self, x, lo, form, state, tol):
        out = self.system.fn.linearize(x, lo, form)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ProtocolError(f"{HOOKS['linearize']} must return a tuple (values, "
                                f"jacobians), got {type(out).__name__}")
        y, J = out
        _check_values(self.system, y, x, lo, "linearize")
        self.system.evaluations += 1
        self.system.positions += x.shape[1] - lo
        return y, J

    def newton_step(self, x, lo, form):
        """``fn.newton_step(x, lo, form)`` where ``fn`` has it: the undamped step fused, ``(y,
        trial)`` with ``y = fn(x)`` at ``[lo, T)`` and ``trial = x + delta`` there, ``delta``
        the solution of ``delta_t = J_t delta_{t-1} + y_t - x_t`` (``delta_{lo-1} = 0``) for
        ``form``'s Jacobians, as the driver computes them from :meth:`linearize`; ``None``
        (and without it) for the unfused step."""
        fused = getattr(self.system.fn, "newton_step", None)
        out = None if fused is None else fused(x, lo, form)
        if out is not None:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ProtocolError(f"{HOOKS['newton_step']} must return None or a tuple "
                                    f"(values, trial), got {type(out).__name__}")
            for v in out:
                _check_values(self.system, v, x, lo, "newton_step")
            self.system.evaluations += 1
            self.system.positions += x.shape[1] - lo
        return out


def _check_values(system: System, v, x: torch.Tensor, lo: int, hook: str) -> None:
    """A hook's values at positions ``[lo, T)``: a tensor ``(B, T - lo, F)`` of ``x``'s dtype,
    and not a view of ``x`` (the driver writes into ``x`` while it reads them)."""
    want = (x.shape[0], x.shape[1] - lo, x.shape[2])
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != want or v.dtype != x.dtype:
        got = (f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor)
               else type(v).__name__)
        raise ProtocolError(f"{HOOKS[hook]} must return values of shape {want} and dtype "
                            f"{x.dtype} (positions lo..T-1), got {got}")
    if v.device == x.device and v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ProtocolError(f"{HOOKS[hook]} returned a view of its input x; return new values")


class FullAccess:
    """Any triangular ``fn``: full evaluations, and the sub-diagonal Jacobian blocks by one
    forward-mode product per feature with the tangent ``e_j`` at every position (exact for a
    Markov ``fn``; for other triangular maps a row-sum approximation that keeps the exactness
    bound, since the residual is always the true one)."""

    markov = False

    def __init__(self, system: System, name: str = "newton"):
        self.system = system
        self.name = name   # the method, for the messages
        self.jvps = 0   # forward-mode products for the Jacobians, each about one evaluation

    def newton_step(self, x, lo, form):
        return None

    def linearize(self, x, lo, form, state, tol):
        system = self.system
        y = system.evaluate(x)
        if lo > 0:   # the exact prefix must not move: otherwise fn is not triangular
            check_final(system, (y[:, :lo] - x[:, :lo]).abs().amax(dim=2), tol, state.active)
        return y[:, lo:], self._jacobian(x, lo, form)

    def _jacobian(self, x, lo, form):
        system = self.system
        Fn = system.F

        def f(z):
            return system.canon(system.fn(system.user(z)))

        cols = []
        for j in range(Fn):
            v = torch.zeros_like(x)
            v[..., j] = 1
            try:
                with torch.enable_grad():
                    _, out = torch.func.jvp(f, (x,), (v,))
            except (RuntimeError, NotImplementedError) as e:
                if isinstance(e, ConvergenceError):   # a solve inside fn: not the AD's
                    raise
                # fn(x) itself was evaluated just before: what fails is forward-mode AD
                raise ValueError(
                    f"method={self.name!r} on a plain fn forms the Jacobians d fn_t / d x_(t-1) "
                    "by forward-mode automatic differentiation (torch.func.jvp), and fn is not "
                    f"differentiable that way: {type(e).__name__}: {e}. Make fn differentiable "
                    "by torch.func.jvp (no out= arguments, no writes into preallocated "
                    "tensors, no round trips through NumPy or Python numbers), or wrap the cell "
                    "in paraprop.Recurrence (analytic Jacobians, or a linearize hook), or use a "
                    "method that needs only fn(x): 'jacobi', 'jacobi_gs', 'gs_jacobi', "
                    "'sliding_jacobi' or 'anderson'") from e
            cols.append(out[:, lo:])
        self.jvps += Fn
        if form == "diag":
            return torch.stack([c[..., j] for j, c in enumerate(cols)], -1)
        return torch.stack(cols, -1)   # [b, t, i, j] = d fn_{t,i} / d x_{t-1,j}


# A plain fn costs one forward-mode product per feature and iteration, and a (B, T, F, F)
# Jacobian: beyond this many features that is never the better deal (use a Recurrence or Jacobi).
MAX_PLAIN_FEATURES = 256


def choose_access(system: System, name: str = "newton"):
    fn = system.fn
    if getattr(fn, "markov", False) and callable(getattr(fn, "linearize", None)):
        shape = tuple(getattr(fn, "shape", ()))
        layout = (tuple(system.batch_shape), tuple(system.pos_shape), tuple(system.feature_shape))
        if tuple(system.shape) != shape or layout != (shape[:-2], shape[-2:-1], shape[-1:]):
            raise ValueError(
                f"the Recurrence's states have shape {shape} (*batch, T, H) but x0 has shape "
                f"{tuple(system.shape)} with positions along dims of size "
                f"{tuple(system.pos_shape)}; pass x0 of shape rec.shape and dim=-2")
        dtype = getattr(fn, "dtype", system.dtype)
        if dtype != system.dtype:
            raise TypeError(f"x0 has dtype {system.dtype} but the Recurrence computes in {dtype}; "
                            "use one dtype")
        return MarkovAccess(system)
    if system.F > MAX_PLAIN_FEATURES:
        raise ValueError(
            f"the Newton-type methods on a plain fn form the Jacobian blocks from one "
            f"forward-mode product per feature and a (batch, T, F, F) array; F={system.F} "
            f"features per position is more than {MAX_PLAIN_FEATURES}: wrap a recurrent cell in "
            "paraprop.Recurrence (analytic or per-row Jacobians), or use method='jacobi'")
    return FullAccess(system, name)
