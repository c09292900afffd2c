"""The transition matrices ``A_t`` of a linear recurrence, in four storage forms.

- dense: a tensor ``(..., T, H, H)``;
- diagonal: a tensor ``(..., T, H)`` (``A_t = diag(a_t)``);
- :class:`Factored`: ``A_t = diag(d_t) + L diag(s_t) R`` with ``L`` and ``R`` shared by all steps.
  This is the form of the analytic transposed Jacobians of recurrent cells (BPPSA, Wang et al.
  2020, Appendix E): for a tanh RNN ``J_t^T = W_hh^T diag(1 - h_t^2)``, for a GRU a diagonal
  plus three scaled copies of ``W_hh^T`` blocks. Applying it costs ``O(H K)`` and needs
  no ``(T, H, H)`` array in memory.
- :class:`LSTMFactored`: the Jacobians of LSTM steps on the two-part state ``[h; c]`` (or their
  transposes), ``W_hh`` shared and four per-step vectors; one ``W_hh`` product per step.

:class:`Op` is the internal, canonical view the algorithms work on: every per-step tensor has the
layout ``(N | 1, T, ...)`` (``N`` flattened batch rows; a leading 1 is a batch broadcast) and the
shared matrices are 2-D. ``Op`` can apply a slice of steps to vectors or matrices, be transposed,
be sliced or flipped in time and be materialised densely. :func:`canonicalise` checks a user's
``A``, ``b`` and ``h0`` and makes the ``Op`` and the flattened ``b`` and ``h0`` from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paraprop import checks

__all__ = ["Canonical", "Factored", "LSTMFactored", "Op", "canonicalise"]


@dataclass(frozen=True)
class Factored:
    """Transition matrices ``A_t = diag(diag_t) + left @ diag(scale_t) @ right``.

    Arguments:
        scale: ``(..., T, K)``, the per-step scales ``s_t``.
        left: ``(H, K)`` shared matrix, or ``None`` for ``[I, I, ..., I]`` (``K / H`` identity
            blocks side by side: the sum of the ``K / H`` blocks of ``diag(s_t) R h``).
        right: ``(K, H)`` shared matrix, or ``None`` for ``[I; I; ...; I]`` (the state repeated
            ``K / H`` times). With both ``None``, ``K`` must be a multiple of ``H``.
        diag: ``(..., T, H)`` per-step diagonal ``d_t``, or ``None`` (zero).

    Example:
        >>> W, h = 0.3 * torch.randn(8, 8), torch.tanh(torch.randn(2, 10, 8))
        >>> A = Factored(scale=1 - h**2, left=W.T)    # a tanh RNN's J_t^T = W^T diag(1 - h_t^2)
        >>> b = torch.randn(2, 10, 8)
        >>> dense = W.T * (1 - h**2)[..., None, :]    # the same matrices, (2, 10, 8, 8)
        >>> g = paraprop.scan.linear_recurrence(A, b)
        >>> torch.allclose(g, paraprop.scan.linear_recurrence(dense, b), atol=1e-5)
        True
    """

    scale: torch.Tensor
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None
    diag: torch.Tensor | None = None


@dataclass(frozen=True)
class LSTMFactored:
    """The Jacobians ``A_t = d [h_t; c_t] / d [h_{t-1}; c_{t-1}]`` of LSTM steps (or, with
    ``transposed``, their transposes), on the state ``[h; c]`` of size ``2H``.

    With ``u = scale_t * (W x_h)`` (``4H``, the gate blocks ``i, f, g, o`` of ``W = W_hh``), the
    step ``y = A_t x`` is

        y_c = u_i + u_f + u_g + forget_t * x_c,     y_h = u_o + output_t * y_c,

    and the transposed step ``y = A_t^T x`` is, with ``v = x_c + output_t * x_h``,

        y_h = W^T (scale_t * [v; v; v; x_h]),       y_c = forget_t * v.

    One product with ``W`` (``4 H^2``) per step and no ``(2H, 2H)`` matrix; the form
    :func:`paraprop.jacobians.cells.lstm_scale` computes, derived in :mod:`paraprop.nn.lstm`.

    Arguments:
        scale: ``(..., T, 4H)``, the gate sensitivities ``s_t = [dc/da_i; dc/da_f; dc/da_g;
            dh/da_o]`` (``a`` the gate pre-activations).
        forget: ``(..., T, H)``, ``dc_t / dc_{t-1}`` (the forget gate).
        output: ``(..., T, H)``, ``dh_t / dc_t`` (``o_t (1 - tanh^2 c_t)``).
        weight: ``(4H, H)``, ``W_hh`` (shared by all steps).
        transposed: the transposes ``A_t^T`` (back-propagation) instead of ``A_t`` (Newton).

    Example:
        >>> W, T = 0.3 * torch.randn(32, 8), 10     # an LSTM with hidden size 8: states [h; c]
        >>> A = LSTMFactored(scale=torch.rand(2, T, 32), forget=torch.rand(2, T, 8),
        ...                  output=torch.rand(2, T, 8), weight=W, transposed=True)
        >>> x = torch.randn(2, T, 16)
        >>> g = paraprop.scan.linear_recurrence(A, x, reverse=True)    # back-propagation
        >>> g.shape
        torch.Size([2, 10, 16])
        >>> torch.allclose(g, paraprop.scan.linear_recurrence(A, x, reverse=True,
        ...                                                   method="blelloch"), atol=1e-5)
        True
    """

    scale: torch.Tensor
    forget: torch.Tensor
    output: torch.Tensor
    weight: torch.Tensor
    transposed: bool = False


class Op:
    """Canonical transitions: ``kind`` in ``{"dense", "diag", "factored", "lstm"}``.

    ``a`` is the dense ``(N|1, T, H, H)`` or diagonal ``(N|1, T, H)`` tensor; for ``factored``,
    ``d`` ``(N|1, T, H)`` or ``None``, ``s`` ``(N|1, T, K)``, ``L`` ``(H, K)`` or ``None``,
    ``R`` ``(K, H)`` or ``None``; for ``lstm`` (:class:`LSTMFactored`, ``H`` the state size
    ``2 Hc``), ``s`` ``(N|1, T, 4 Hc)``, ``f`` and ``k`` ``(N|1, T, Hc)`` (forget, output),
    ``W`` ``(4 Hc, Hc)`` and ``tr`` (transposed). Slicing keeps the time dim at position 1 until
    :meth:`at` drops it.
    """

    FIELDS = {"dense": ("a",), "diag": ("a",), "factored": ("d", "s", "L", "R"),
              "lstm": ("s", "f", "k", "W")}

    def __init__(self, kind: str, H: int, *, a=None, d=None, s=None, L=None, R=None, f=None,
                 k=None, W=None, tr: bool = False):
        self.kind, self.H = kind, H
        self.a, self.d, self.s, self.L, self.R = a, d, s, L, R
        self.f, self.k, self.W, self.tr = f, k, W, tr

    @classmethod
    def build(cls, kind: str, H: int, tensors, tr: bool = False) -> Op:
        """The inverse of :meth:`tensors`."""
        return cls(kind, H, tr=tr, **dict(zip(cls.FIELDS[kind], tensors, strict=True)))

    # -- shape ----------------------------------------------------------------------------------
    @property
    def K(self) -> int:
        return self.s.shape[-1]

    @property
    def per_step(self) -> list[str]:
        return {"factored": ["d", "s"], "lstm": ["s", "f", "k"]}.get(self.kind, ["a"])

    def map_steps(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Op:
        """A new Op with ``fn`` applied to every per-step tensor (shared matrices kept)."""
        new = Op(self.kind, self.H, a=self.a, d=self.d, s=self.s, L=self.L, R=self.R, f=self.f,
                 k=self.k, W=self.W, tr=self.tr)
        for name in self.per_step:
            t = getattr(self, name)
            if t is not None:
                setattr(new, name, fn(t))
        return new

    def at(self, t: int) -> Op:
        """Step ``t`` only: per-step tensors lose their time dim (``(N|1, ...)``)."""
        return self.map_steps(lambda x: x[:, t])

    def batch_rows(self) -> int:
        """1 when the transitions are shared by all batch rows, else ``N``."""
        t = self.a if self.kind != "factored" else self.s
        return t.shape[0]

    # -- algebra ----------------------------------------------------------------------------------
    def transpose(self) -> Op:
        """``A_t^T`` for every step (dense: a transposed view; factored: swap and transpose
        ``L`` and ``R``; lstm: the other direction of the same tensors)."""
        if self.kind == "dense":
            return Op("dense", self.H, a=self.a.transpose(-1, -2))
        if self.kind == "diag":
            return self
        if self.kind == "lstm":
            new = self.map_steps(lambda x: x)
            new.tr = not self.tr
            return new
        return Op("factored", self.H, d=self.d, s=self.s,
                  L=None if self.R is None else self.R.t(),
                  R=None if self.L is None else self.L.t())

    def _right(self, x: torch.Tensor, mat: bool) -> torch.Tensor:
        """``R x`` (x: ``(..., H)`` vectors or ``(..., H, M)`` matrices)."""
        reps = self.K // self.H
        if self.R is None and reps == 1:
            return x
        if mat:
            return self.R @ x if self.R is not None else x.repeat(*([1] * (x.dim() - 2)), reps, 1)
        return x @ self.R.t() if self.R is not None else x.repeat(*([1] * (x.dim() - 1)), reps)

    def _left(self, u: torch.Tensor, mat: bool) -> torch.Tensor:
        """``L u`` (u: ``(..., K)`` vectors or ``(..., K, M)`` matrices)."""
        if self.L is not None:
            return self.L @ u if mat else u @ self.L.t()
        H = self.H
        if self.K == H:
            return u
        if mat:
            return u.unflatten(-2, (-1, H)).sum(-3)
        return u.unflatten(-1, (-1, H)).sum(-2)

    def apply(self, x: torch.Tensor, mat: bool = False) -> torch.Tensor:
        """``A x`` with the per-step tensors of this Op broadcast against ``x``.

        ``x`` is ``(..., H)`` (``mat=False``) or ``(..., H, M)`` (``mat=True``); the leading dims
        of ``x`` line up with the leading (batch[, time]) dims of the per-step tensors.
        """
        if self.kind == "dense":
            return self.a @ x if mat else (self.a @ x.unsqueeze(-1)).squeeze(-1)
        if self.kind == "diag":
            return self.a.unsqueeze(-1) * x if mat else self.a * x
        if self.kind == "lstm":
            return self._lstm(x.unsqueeze(-1)).squeeze(-1) if not mat else self._lstm(x)
        u = self._right(x, mat)
        u = u * (self.s.unsqueeze(-1) if mat else self.s)
        out = self._left(u, mat)
        if self.d is not None:
            out = out + (self.d.unsqueeze(-1) * x if mat else self.d * x)
        return out

    def _lstm(self, x: torch.Tensor) -> torch.Tensor:
        """:class:`LSTMFactored` times ``x`` ``(..., 2Hc, M)`` (see its docstring)."""
        Hc = self.H // 2
        s, f, k = self.s.unsqueeze(-1), self.f.unsqueeze(-1), self.k.unsqueeze(-1)
        xh, xc = x[..., :Hc, :], x[..., Hc:, :]
        if self.tr:
            v = torch.addcmul(xc, k, xh)
            u = s * torch.cat([v, v, v, xh], -2)
            return torch.cat([self.W.t() @ u, f * v], -2)
        u = s * (self.W @ xh)
        yc = (u[..., :Hc, :] + u[..., Hc:2 * Hc, :] + u[..., 2 * Hc:3 * Hc, :]).addcmul_(f, xc)
        return torch.cat([torch.addcmul(u[..., 3 * Hc:, :], k, yc), yc], -2)

    def dense(self) -> torch.Tensor:
        """The matrices themselves: ``(N|1, T, H, H)`` (diagonal ones are embedded)."""
        if self.kind == "dense":
            return self.a
        if self.kind == "diag":
            return torch.diag_embed(self.a)
        eye = torch.eye(self.H, dtype=self.s.dtype, device=self.s.device)
        return self.apply(eye.expand(*self.s.shape[:-1], self.H, self.H), mat=True)

    def tensors(self) -> list[torch.Tensor | None]:
        return [getattr(self, name) for name in self.FIELDS[self.kind]]


class Canonical:
    """Validated inputs in the layout ``(N, T, H)``; ``batch`` is the broadcast batch shape."""

    def __init__(self, op: Op, b: torch.Tensor, h0: torch.Tensor | None, batch: torch.Size):
        self.op, self.b, self.h0, self.batch = op, b, h0, batch

    def user(self, h: torch.Tensor) -> torch.Tensor:
        return h.reshape(*self.batch, *h.shape[1:])


def canonicalise(A, b, h0) -> Canonical:
    """Check ``A``, ``b``, ``h0`` (types, dtypes, devices, shapes) and flatten the batch dims."""
    if not isinstance(b, torch.Tensor):
        raise TypeError(f"b must be a torch.Tensor, got {type(b).__name__}")
    if not b.is_floating_point():
        raise TypeError(f"b must have a floating-point dtype, got {b.dtype}")
    if b.dim() < 2 or b.shape[-2] < 1 or b.shape[-1] < 1:
        raise ValueError(f"b must have shape (..., T, H) with T, H >= 1, got {tuple(b.shape)}")
    T, H = b.shape[-2:]
    nb = b.dim()
    if isinstance(A, Factored):
        tensors = {"A.scale": A.scale, "A.left": A.left, "A.right": A.right, "A.diag": A.diag}
    elif isinstance(A, LSTMFactored):
        tensors = {"A.scale": A.scale, "A.forget": A.forget, "A.output": A.output,
                   "A.weight": A.weight}
        if any(t is None for t in tensors.values()):
            raise TypeError("LSTMFactored needs scale, forget, output and weight (none is "
                            "optional)")
        checks.boolean("A.transposed", A.transposed)
    elif isinstance(A, torch.Tensor):
        tensors = {"A": A}
    else:
        raise TypeError(f"A must be a torch.Tensor, a paraprop.scan.Factored or a "
                        f"paraprop.scan.LSTMFactored, got {type(A).__name__}")
    tensors["h0"] = h0
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype != b.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but b has {b.dtype}; use one dtype")
        if t.device != b.device:
            raise ValueError(f"{name} is on {t.device} but b is on {b.device}")

    batches = [b.shape[:-2]]
    if isinstance(A, torch.Tensor):
        if A.dim() == nb + 1 and A.shape[-3:] == (T, H, H):
            kind = "dense"
        elif A.dim() == nb and A.shape[-2:] == (T, H):
            kind = "diag"
        else:
            raise ValueError(
                f"A must be dense (..., T, H, H) or diagonal (..., T, H) with the batch dims of b "
                f"written out; got A {tuple(A.shape)} for b {tuple(b.shape)} (T={T}, H={H})")
        batches.append(A.shape[:-3] if kind == "dense" else A.shape[:-2])
    elif isinstance(A, LSTMFactored):
        kind = "lstm"
        if H % 2:
            raise ValueError(f"LSTMFactored acts on the state [h; c]: b must have an even "
                             f"size H = 2 * hidden, got {tuple(b.shape)}")
        Hc = H // 2
        if tuple(A.weight.shape) != (4 * Hc, Hc):
            raise ValueError(f"A.weight must have shape (4 * hidden, hidden) = ({4 * Hc}, "
                             f"{Hc}) for b {tuple(b.shape)}, got {tuple(A.weight.shape)}")
        for name, t, size in (("scale", A.scale, 4 * Hc), ("forget", A.forget, Hc),
                              ("output", A.output, Hc)):
            if t.dim() != nb or t.shape[-2:] != (T, size):
                raise ValueError(f"A.{name} must have shape (..., T, {size}) with T={T} and as "
                                 f"many dims as b {tuple(b.shape)}; got {tuple(t.shape)}")
            batches.append(t.shape[:-2])
    else:
        kind = "factored"
        s = A.scale
        if s is None or s.dim() != nb or s.shape[-2] != T or s.shape[-1] < 1:
            raise ValueError(f"A.scale must have shape (..., T, K) with T={T}, as many dims as b "
                             f"{tuple(b.shape)}; got {None if s is None else tuple(s.shape)}")
        K = s.shape[-1]
        if A.left is not None and tuple(A.left.shape) != (H, K):
            raise ValueError(f"A.left must have shape (H, K) = ({H}, {K}), "
                             f"got {tuple(A.left.shape)}")
        if A.right is not None and tuple(A.right.shape) != (K, H):
            raise ValueError(f"A.right must have shape (K, H) = ({K}, {H}), "
                             f"got {tuple(A.right.shape)}")
        if (A.left is None or A.right is None) and K % H:
            raise ValueError(f"A.left/A.right = None (identity blocks) need K a multiple of "
                             f"H; got K={K}, H={H}")
        batches.append(s.shape[:-2])
        if A.diag is not None:
            if A.diag.dim() != nb or A.diag.shape[-2:] != (T, H):
                raise ValueError(f"A.diag must have shape (..., T, H) = (..., {T}, {H}) with as "
                                 f"many dims as b; got {tuple(A.diag.shape)}")
            batches.append(A.diag.shape[:-2])
    if h0 is not None:
        if not 1 <= h0.dim() <= nb - 1 or h0.shape[-1] != H:
            raise ValueError(f"h0 must have shape (..., H) = (..., {H}) with at most one dim less "
                             f"than b {tuple(b.shape)}; got {tuple(h0.shape)}")
        batches.append(h0.shape[:-1])
    batch = _broadcast(batches)
    if batch is None:
        raise ValueError("the batch dims of A, b and h0 do not broadcast: "
                         + ", ".join(str(tuple(x)) for x in batches))
    N = math.prod(batch)

    def rows(t: torch.Tensor | None, trailing: int, always_full: bool = False):
        if t is None:
            return None
        tb = t.shape[: t.dim() - trailing]
        if tb.numel() == 1 and not always_full:
            return t.reshape(1, *t.shape[t.dim() - trailing:])
        return t.expand(*batch, *t.shape[t.dim() - trailing:]).reshape(
            N, *t.shape[t.dim() - trailing:])

    if kind == "dense":
        op = Op("dense", H, a=rows(A, 3))
    elif kind == "diag":
        op = Op("diag", H, a=rows(A, 2))
    elif kind == "lstm":
        op = Op("lstm", H, s=rows(A.scale, 2), f=rows(A.forget, 2), k=rows(A.output, 2),
                W=A.weight, tr=bool(A.transposed))
    else:
        op = Op("factored", H, d=rows(A.diag, 2), s=rows(A.scale, 2), L=A.left, R=A.right)
    return Canonical(op, rows(b, 2, True), rows(h0, 1, True), batch)


def _broadcast(shapes) -> torch.Size | None:
    """The broadcast of ``shapes`` (torch rules), or None if they do not broadcast.

    (``torch.broadcast_shapes`` would do, but its first call imports ``torch._refs``: ~0.5 s.)
    """
    n = max(len(s) for s in shapes)
    out = []
    for i in range(1, n + 1):
        sizes = {s[-i] for s in shapes if len(s) >= i} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return torch.Size(reversed(out))
