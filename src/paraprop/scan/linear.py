"""``linear_recurrence``: all states of ``h_t = A_t h_{t-1} + b_t`` by a scan.

A linear recurrence is a scan of the affine maps ``h -> A_t h + b_t`` under composition,
``(A_1, b_1) ⊕ (A_2, b_2) = (A_2 A_1, A_2 b_1 + b_2)`` (associative, not commutative;
Blelloch 1990). Back-propagation through a recurrent network is exactly such a recurrence, run
backwards with the transposed Jacobians: ``g_t = J_{t+1}^T g_{t+1} + e_t`` (BPPSA, Wang et al.
2020, Algorithm 1).
"""

from __future__ import annotations

import torch

from paraprop import checks
from paraprop.scan import (
    blelloch,
    chunked,
    hillis_steele,
    native,
    sequential,
    triton_kernels,
    triton_runtime,
)
from paraprop.scan.transitions import Op, canonicalise

# The methods of the scans, defined once: ``"auto"`` picks one of the others. ``"native"`` and
# ``"triton"`` are kernels for linear recurrences only (:data:`KERNELS`);
# :func:`paraprop.scan.associative_scan` takes the others.
METHODS = ("auto", "sequential", "native", "blelloch", "hillis_steele", "chunked", "triton")
KERNELS = ("native", "triton")
# Below this length the tree and chunked methods cannot beat T small steps.
_SHORT = 16


def choose(op: Op, b: torch.Tensor, h0: torch.Tensor | None) -> str:
    """The method ``"auto"`` runs on canonical inputs: ``"native"`` where the C kernel runs
    (CPU float32/float64), ``"triton"`` on CUDA tensors where those kernels apply (diagonal
    ``A``, or a state of at most :data:`~paraprop.scan.triton_kernels.MAX_DENSE`), else
    ``"sequential"`` for ``T <= 16``, ``"blelloch"`` for diagonal ``A`` and ``"chunked"``
    otherwise."""
    if native.supports(b, h0, *op.tensors()):
        return "native"
    if triton_kernels.applies(op, b):
        return "triton"
    if b.shape[1] <= _SHORT:
        return "sequential"
    return "blelloch" if op.kind == "diag" else "chunked"


def solve(op: Op, b: torch.Tensor, h0: torch.Tensor | None, *, reverse: bool, method: str,
          chunk_size: int | None = None, levels: int | None = None) -> torch.Tensor:
    """The states ``(N, T, H)`` on canonical inputs (no autograd of its own)."""
    if method == "auto":
        method = choose(op, b, h0)
        if method == "triton":
            try:
                return triton_kernels.recurrence(op, b, h0, reverse)
            except triton_runtime.LaunchError:      # recorded and warned: choose again
                method = choose(op, b, h0)
    if method == "native":
        return native.recurrence(op, b, h0, reverse)
    if method == "triton":
        return triton_kernels.recurrence(op, b, h0, reverse)
    if method == "sequential":
        return sequential.recurrence(op, b, h0, reverse)
    if reverse:  # run forward in time on flipped inputs
        flipped = op.map_steps(lambda x: x.flip(1))
        return solve(flipped, b.flip(1), h0, reverse=False, method=method,
                     chunk_size=chunk_size, levels=levels).flip(1)
    if method == "chunked":
        return chunked.recurrence(op, b, h0, chunk_size)
    # tree methods: scan the affine pairs (A_t, b_t), h0 folded into b_0
    if h0 is not None:
        b = b.clone()
        b[:, 0] += op.at(0).apply(h0)
    if op.kind == "diag":
        def combine(x, y):
            return [y[0] * x[0], y[0] * x[1] + y[1]]
        a = op.a
    else:
        def combine(x, y):
            return [y[0] @ x[0], (y[0] @ x[1].unsqueeze(-1)).squeeze(-1) + y[1]]
        a = op.dense()
    if method == "hillis_steele":
        return hillis_steele.scan([a, b], combine, 1)[1]
    # blelloch: exclusive prefix e_t = h_{t-1}, then h_t = A_t e_t + b_t in one batched call
    ex = blelloch.exclusive([a, b], combine, 1, levels)[1]
    out = torch.empty_like(b)
    out[:, 0] = b[:, 0]
    if b.shape[1] > 1:
        out[:, 1:] = op.map_steps(lambda x: x[:, 1:]).apply(ex[:, 1:]) + b[:, 1:]
    return out


class _LinearRecurrence(torch.autograd.Function):
    """Backward: the same recurrence, run the other way with the transposed matrices.

    With ``mu_t = A_t^T lambda_t`` and ``lambda_t = G_t + mu_next`` (``G`` the incoming gradient,
    ``next`` the following step in the recurrence's direction), ``mu_t = A_t^T mu_next +
    A_t^T G_t``: one ``linear_recurrence`` in the opposite direction. Then
    ``grad b = lambda``, ``grad A_t = lambda_t h_prev_t^T`` and ``grad h0 = mu_first``.
    """

    @staticmethod
    def forward(ctx, meta, b, h0, *tensors):
        kind, H, tr, reverse, method, chunk_size, levels = meta
        op = Op.build(kind, H, tensors, tr)
        h = solve(op, b, h0, reverse=reverse, method=method, chunk_size=chunk_size,
                  levels=levels)
        ctx.meta = meta
        ctx.save_for_backward(h, h0, *tensors)
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, G):
        kind, H, tr, reverse, method, chunk_size, levels = ctx.meta
        h, h0, *tensors = ctx.saved_tensors
        op = Op.build(kind, H, tensors, tr)
        opT = op.transpose()
        mu = solve(opT, opT.apply(G), None, reverse=not reverse, method=method,
                   chunk_size=chunk_size, levels=levels)
        zero = torch.zeros_like(G[:, :1])
        start = h0.unsqueeze(1) if h0 is not None else zero
        if reverse:
            lam = G + torch.cat([zero, mu[:, :-1]], 1)
            hprev = torch.cat([h[:, 1:], start], 1)
            g_h0 = mu[:, -1]
        else:
            lam = G + torch.cat([mu[:, 1:], zero], 1)
            hprev = torch.cat([start, h[:, :-1]], 1)
            g_h0 = mu[:, 0]
        need = ctx.needs_input_grad
        if kind == "lstm":
            g_op = _step_gradients(op, tensors, need[3:], hprev, lam)
            return (None, lam if need[1] else None, g_h0 if need[2] else None, *g_op)
        a = tensors[0] if kind != "factored" else None
        d, s, L, R = tensors if kind == "factored" else (None,) * 4
        if kind == "factored":      # needs of d, s, L, R at the positions of a, d, s, L, R
            need = (*need[:3], False, *need[3:])
        g_a = g_d = g_s = g_L = g_R = None

        def fit(g, like):  # sum over a broadcast batch
            return g.sum(0, keepdim=True) if like.shape[0] == 1 and g.shape[0] != 1 else g

        if kind == "dense" and need[3]:
            g_a = fit(lam.unsqueeze(-1) * hprev.unsqueeze(-2), a)
        elif kind == "diag" and need[3]:
            g_a = fit(lam * hprev, a)
        elif kind == "factored":
            if d is not None and need[4]:
                g_d = fit(lam * hprev, d)
            if need[5] or need[6] or need[7]:
                u = op._right(hprev, False)                     # R h_prev     (N, T, K)
                v = opT._right(lam, False)                      # L^T lambda   (N, T, K)
                if need[5]:
                    g_s = fit(u * v, s)
                if L is not None and need[6]:
                    g_L = torch.einsum("nth,ntk->hk", lam, s * u)
                if R is not None and need[7]:
                    g_R = torch.einsum("ntk,nth->kh", s * v, hprev)
        g_op = [g_a] if kind != "factored" else [g_d, g_s, g_L, g_R]
        return (None, lam if need[1] else None, g_h0 if need[2] else None, *g_op)


def _step_gradients(op: Op, tensors, need, hprev, lam) -> list:
    """``d/dtheta sum_t lam_t . A_t(theta) hprev_t`` for each tensor ``theta`` of ``op`` that
    ``need`` marks, by autograd through one batched application of every step (the steps are
    multilinear in their tensors; a broadcast batch is summed by autograd)."""
    leaves = [t.detach().requires_grad_(bool(n)) if t is not None else None
              for t, n in zip(tensors, need, strict=True)]
    wanted = [t for t, n in zip(leaves, need, strict=True) if n and t is not None]
    if not wanted:
        return [None] * len(tensors)
    with torch.enable_grad():
        y = Op.build(op.kind, op.H, leaves, op.tr).apply(hprev)
        grads = iter(torch.autograd.grad(y, wanted, lam))
    return [next(grads) if n and t is not None else None
            for t, n in zip(tensors, need, strict=True)]


def linear_recurrence(A, b: torch.Tensor, h0: torch.Tensor | None = None, *,
                      reverse: bool = False, method: str = "auto",
                      chunk_size: int | None = None, levels: int | None = None) -> torch.Tensor:
    """All states of the linear recurrence ``h_t = A_t h_{t-1} + b_t``.

    Forward (``reverse=False``): ``h_t = A_t h_{t-1} + b_t`` for ``t = 0 .. T-1`` with
    ``h_{-1} = h0``. Reverse: ``h_t = A_t h_{t+1} + b_t`` for ``t = T-1 .. 0`` with ``h_T = h0``
    (the form of back-propagation through time). Differentiable in ``A``, ``b`` and ``h0``; the
    backward pass is this same function run in the other direction with ``A_t^T`` (by the same
    method).

    Arguments:
        A: the transitions: a dense tensor ``(..., T, H, H)``, a diagonal ``(..., T, H)``, a
            :class:`Factored` ``diag(d_t) + L diag(s_t) R`` or an :class:`LSTMFactored` (LSTM
            Jacobians on the state ``[h; c]``, ``H = 2 * hidden``). Its batch dims must be
            written out (size 1 to broadcast) so that dense and diagonal are never ambiguous.
        b: ``(..., T, H)``, any ``T >= 1`` (no padding to a power of two).
        h0: ``(..., H)`` initial state (batch dims broadcast), or ``None`` for zero.
        reverse: run from ``t = T-1`` down to 0.
        method: one of :data:`METHODS`: ``"sequential"`` (``T`` PyTorch steps),
            ``"native"`` (the same steps in one C call: CPU float32/float64 tensors, the
            kernels of :mod:`paraprop.scan.native`), ``"blelloch"`` (BPPSA's modified Blelloch
            scan, ``2 log2 T`` batched steps), ``"hillis_steele"`` (``log2 T`` steps,
            ``T log T`` work), ``"chunked"`` (sequential inside ``chunk_size`` chunks, batched
            across chunks, then the carries), ``"triton"`` (the Triton kernels of
            :mod:`paraprop.scan.triton_kernels`: CUDA tensors, or CPU tensors in Triton's
            interpreter under ``TRITON_INTERPRET=1``, which refuses CUDA tensors while it is
            set; diagonal ``A`` of any size, other forms with ``H <= 64``), or ``"auto"``:
            ``"native"`` where it runs, ``"triton"`` on CUDA tensors where it applies (not
            under ``TRITON_INTERPRET``), otherwise ``"sequential"`` for ``T <= 16``,
            ``"blelloch"`` for diagonal ``A`` and ``"chunked"`` for dense and factored ``A``.
            The tree methods (and ``"triton"`` for non-diagonal ``A``) materialise factored
            (and LSTM) ``A`` densely.
        chunk_size: chunk length for ``"chunked"`` (default ``ceil(sqrt(T / 2))``).
        levels: tree levels run in parallel by ``"blelloch"`` (BPPSA's level cap; the rest of
            the tree is scanned sequentially); ``None`` for all.

    Returns:
        ``(*batch, T, H)``, the broadcast batch of ``A``, ``b`` and ``h0``.

    Raises:
        TypeError: non-tensor arguments, integer dtypes, mixed dtypes.
        ValueError: shapes that do not fit (the message prints them), unknown ``method``,
            options given to a method that does not use them, ``method="triton"`` for
            non-diagonal ``A`` with ``H > 64``.
        RuntimeError: ``method="native"`` or ``method="triton"`` where those kernels cannot
            run (the message says why).

    Example:
        >>> A = 0.2 * torch.randn(4, 100, 8, 8); b = torch.randn(4, 100, 8)   # stable: |A| < 1
        >>> h = linear_recurrence(A, b, method="blelloch")
        >>> torch.allclose(h, linear_recurrence(A, b, method="sequential"), atol=1e-5)
        True
    """
    _check_options(method, chunk_size, levels)
    checks.boolean("reverse", reverse)
    c = canonicalise(A, b, h0)
    op = c.op
    meta = (op.kind, op.H, op.tr, reverse, method, chunk_size, levels)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (c.b, c.h0, *op.tensors())):
        h = _LinearRecurrence.apply(meta, c.b, c.h0, *op.tensors())
    else:
        h = solve(op, c.b, c.h0, reverse=reverse, method=method, chunk_size=chunk_size,
                  levels=levels)
    return c.user(h)


def method_for(A, b: torch.Tensor, h0: torch.Tensor | None = None, *,
               method: str = "auto") -> str:
    """The method :func:`linear_recurrence` runs for these arguments (``"auto"`` resolved to
    ``"native"``, ``"triton"``, ``"blelloch"``, ...), for stats.

    Example:
        >>> method_for(torch.rand(2, 10, 4), torch.randn(2, 10, 4)) in ("native", "sequential")
        True
    """
    _check_options(method, None, None)
    if method != "auto":
        return method
    c = canonicalise(A, b, h0)
    return choose(c.op, c.b, c.h0)


def _check_options(method, chunk_size, levels) -> None:
    checks.one_of("method", method, METHODS)
    if chunk_size is not None:
        if method != "chunked":
            raise ValueError(f"chunk_size is only used by method='chunked', "
                             f"not method={method!r}")
        checks.positive_int("chunk_size", chunk_size)
    if levels is not None:
        if method != "blelloch":
            raise ValueError(f"levels is only used by method='blelloch', "
                             f"not method={method!r}")
        checks.nonneg_int("levels", levels)
