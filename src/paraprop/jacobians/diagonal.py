"""The diagonal-recurrence cells of ParaRNN (ParaGRU, ParaLSTM) and their Jacobians.

ParaRNN (Danieli et al., "ParaRNN: Unlocking Parallel Training of Nonlinear RNNs for Large
Language Models", ICLR 2026) makes Newton's method on a recurrent network cheap by giving the
cell a structured state Jacobian: every hidden-to-hidden matrix product ``W_hh h`` of the GRU and
the LSTM becomes an elementwise product ``w_hh * h`` with a vector ``w_hh`` (the input
projections stay dense). Given the input terms, each hidden unit then evolves on its own, so
the Jacobian ``d s_t / d s_{t-1}`` is diagonal (ParaGRU) or block diagonal with one 2 x 2 block
per unit (ParaLSTM, state ``(h, c)``): Newton is exact per iteration, costs ``O(T H)`` and its
linear recurrence is elementwise (:func:`paraprop.scan.linear_recurrence` with a diagonal ``A``,
or a dense ``2 x 2`` one per unit).

The cells, in torch's gate order and bias convention (``sigma`` the logistic function; ``gi``
the input terms of a step, one matrix product for all steps up front):

ParaGRU, state ``h`` (``H``); ``gi = W_ih x_t + b_ih`` (``3H``, blocks r, z, n)::

    gh = w_hh * [h; h; h] + b_hh
    r = sigma(gi_r + gh_r),  z = sigma(gi_z + gh_z),  n = tanh(gi_n + r gh_n)
    h' = n + z (h - n)
    dh'/dh = diag(a),  a = z + (h - n) z(1-z) w_z + (1-z)(1-n^2) r (w_n + (1-r) gh_n w_r)

(torch.nn.GRU with ``W_hh = [diag(w_r); diag(w_z); diag(w_n)]``.)

ParaLSTM, state ``(h, c)`` (``H`` each); ``gi = W_ih x_t + b_ih + b_hh`` (``4H``, blocks i, f, g,
o)::

    p = gi + w_hh * [h; h; h; h]
    i = sigma(p_i),  f = sigma(p_f),  u = tanh(p_g),  o = sigma(p_o)
    c' = f c + i u,  h' = o tanh(c')
    per unit, with q = c f(1-f) w_f + u i(1-i) w_i + i (1-u^2) w_g and k = o (1 - tanh(c')^2):
        [dh'/dh  dh'/dc]   [tanh(c') o(1-o) w_o + k q   k f]
        [dc'/dh  dc'/dc] = [q                           f  ]

(torch.nn.LSTM with ``W_hh = [diag(w_i); diag(w_f); diag(w_g); diag(w_o)]``.)

The functions below evaluate many steps at once, block by block along time on the CPU (the
twenty-odd elementwise operations then run on cache-resident blocks), and return, besides the
new states, the Jacobians and the coefficients of the vector-Jacobian products that
:mod:`paraprop.nn.para`'s backward pass needs. ``gru_newton_block`` and ``lstm_newton_block``
are the forms the Newton forward uses in every iteration: values and Jacobians only, every
temporary in a scratch array the caller reuses, fewer passes.
"""

from __future__ import annotations

import torch

from paraprop.jacobians.cells import steps_per_block

__all__ = ["GRU_COEFFICIENTS", "GRU_SCRATCH", "LSTM_COEFFICIENTS", "LSTM_SCRATCH",
           "NEWTON_BLOCK_ELEMENTS", "blocks", "gru_linearize", "gru_newton_block", "gru_step",
           "lstm_linearize", "lstm_newton_block", "lstm_step"]

# Values per array in one block of the blocked passes on the CPU (256 KB in float32): measured
# best at hidden 64, batch 4 on a 2-core CPU among 2^14 .. 2^19.
BLOCK_ELEMENTS = 1 << 16
# The same for the fused Newton steps (about 20 to 30 operations per block, none allocating):
# 2^17 measured best for ParaGRU at T=20000, hidden 64, batch 4 on one core among 2^14 .. 2^20.
NEWTON_BLOCK_ELEMENTS = 1 << 17

# What the coefficient arrays hold, per step and unit (the vector-Jacobian products):
# ParaGRU, with lam = dL/dh': dgi = [cr, cz, cn] * lam, dgh = [cr, cz, cn * r] * lam
GRU_COEFFICIENTS = ("cr", "cz", "cn", "cnr")
# ParaLSTM, with (lh, lc) = dL/d(h', c') and dc = lc + k lh:
# dp = [dc ci, dc cf, dc cg, lh co] (the gradient of the pre-activations p, = dgi = dgh)
LSTM_COEFFICIENTS = ("ci", "cf", "cg", "co", "k")


def blocks(steps: int, per_step: int, device: torch.device,
           elements: int | None = None) -> list[slice]:
    """Slices of ``range(steps)`` for the blocked passes over arrays of ``per_step`` values per
    step: one block on a GPU, cache-sized blocks of about ``elements`` values (default
    :data:`BLOCK_ELEMENTS`) on a CPU."""
    size = BLOCK_ELEMENTS if elements is None else elements
    step = steps_per_block(device, steps, size, per_step)
    return [slice(t0, min(steps, t0 + step)) for t0 in range(0, steps, step)]


# The cells' logistic function. torch.sigmoid on a CPU tensor rounds the last, partial vector
# of its elements differently from the rest (float32 and float64), so the same step computed on
# rows (the loop) and inside a block of steps (Newton) can differ by an ulp, and a bitwise
# fixed point of the block would not be the loop's bitwise; exp, add and reciprocal round each
# element alike whatever the tensor's size. Every ParaGRU/ParaLSTM cell here uses these two.
def sigmoid_(t: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-t))`` in place (returns ``t``); recorded by autograd where ``t``
    requires grad."""
    if t.requires_grad and torch.is_grad_enabled():
        return t.copy_(_sigmoid(t))
    return t.neg_().exp_().add_(1).reciprocal_()


def _sigmoid(t: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-t))`` into a new tensor (the same operations as :func:`sigmoid_`)."""
    if t.requires_grad and torch.is_grad_enabled():
        return torch.reciprocal(torch.exp(torch.neg(t)) + 1)
    return torch.neg(t).exp_().add_(1).reciprocal_()


# -- ParaGRU ---------------------------------------------------------------------------------
def gru_step(gi: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """One ParaGRU step on rows: ``gi`` ``(..., 3, H)``, ``h`` ``(..., H)``, the diagonal weights
    ``w`` and bias ``b`` ``(3, H)`` (``b`` may be ``None``); returns ``h'`` (into ``out``)."""
    gh = torch.addcmul(b, w, h.unsqueeze(-2)) if b is not None else w * h.unsqueeze(-2)
    rz = sigmoid_(torch.add(gi[..., :2, :], gh[..., :2, :]))
    n = torch.addcmul(gi[..., 2, :], rz[..., 0, :], gh[..., 2, :]).tanh_()
    return torch.lerp(n, h, rz[..., 1, :], out=out)


def gru_linearize(gi: torch.Tensor, prev: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  y: torch.Tensor, a: torch.Tensor | None = None,
                  coef: torch.Tensor | None = None) -> None:
    """ParaGRU steps from the previous states, with the diagonal Jacobian and the coefficients.

    Arguments:
        gi: input terms ``(..., 3, H)`` of the steps.
        prev: the previous states ``(..., H)``.
        w, b: the diagonal weights and the hidden bias, ``(3, H)`` (``b`` may be ``None``).
        y: out, the new states ``(..., H)`` (may be a strided view).
        a: out (optional), the Jacobians' diagonals ``(..., H)``.
        coef: out (optional), ``(..., 4, H)``: :data:`GRU_COEFFICIENTS`.
    """
    gh = torch.addcmul(b, w, prev.unsqueeze(-2)) if b is not None else w * prev.unsqueeze(-2)
    rz = sigmoid_(torch.add(gi[..., :2, :], gh[..., :2, :]))
    r, z = rz[..., 0, :], rz[..., 1, :]
    ghn = gh[..., 2, :]
    n = torch.addcmul(gi[..., 2, :], r, ghn).tanh_()
    torch.lerp(n, prev, z, out=y)
    if a is None and coef is None:
        return
    omz = torch.rsub(z, 1)
    cn = torch.addcmul(omz, omz, torch.mul(n, n), value=-1)       # (1 - z)(1 - n^2)
    d = torch.sub(prev, n).mul_(torch.addcmul(z, z, z, value=-1))  # (h - n) z (1 - z)
    sr = torch.addcmul(r, r, r, value=-1).mul_(ghn)               # r (1 - r) gh_n
    if coef is not None:
        torch.mul(cn, sr, out=coef[..., 0, :])
        coef[..., 1, :] = d
        coef[..., 2, :] = cn
        torch.mul(cn, r, out=coef[..., 3, :])
    if a is not None:   # a = z + d w_z + cn (r w_n + r (1 - r) gh_n w_r)
        inner = torch.mul(r, w[2]).addcmul_(sr, w[0])
        torch.addcmul(z, d, w[1], out=a).addcmul_(cn, inner)


# Arrays shaped like the states that :func:`gru_newton_block` needs as scratch.
GRU_SCRATCH = 6


def gru_newton_block(gi: torch.Tensor, prev: torch.Tensor, w: torch.Tensor,
                     b: torch.Tensor | None, y: torch.Tensor, a: torch.Tensor | None,
                     scratch: torch.Tensor) -> None:
    """:func:`gru_linearize` without the coefficients and without allocating: ParaGRU steps
    from the previous states into ``y`` and the Jacobians' diagonals into ``a``.

    The new states come from the operations of :func:`gru_step`, in its order (they are the
    sequential loop's values); the diagonals from fewer passes over memory, with ``(h - n) z =
    h' - n``::

        a = z + (1 - z) [(h' - n) w_z + (1 - n^2) r (w_n + (1 - r) gh_n w_r)]

    Arguments:
        gi: input terms ``(..., 3, H)`` (any strides).
        prev: the previous states ``(..., H)`` (any strides).
        w, b: the diagonal weights and the hidden bias, ``(3, H)`` (``b`` may be ``None``).
        y: out, the new states, shaped like ``prev`` (any strides; not overlapping ``prev``).
        a: out (optional), the diagonals, shaped like ``prev``.
        scratch: at least :data:`GRU_SCRATCH` ``* prev.numel()`` contiguous values (their
            contents are overwritten).
    """
    shape, m = prev.shape, prev.numel()
    rz = scratch[:2 * m].view(2, *shape)                     # gate-major: r, z contiguous
    ghn, n, q, v = (scratch[k * m:(k + 1) * m].view(shape) for k in range(2, 6))
    wg = w.view(3, *(1,) * (prev.dim() - 1), -1)            # broadcasts against rz
    if b is not None:
        torch.addcmul(b.view_as(wg)[:2], wg[:2], prev, out=rz)
        torch.addcmul(b[2], w[2], prev, out=ghn)
    else:
        torch.mul(wg[:2], prev, out=rz)
        torch.mul(w[2], prev, out=ghn)
    sigmoid_(rz.add_(gi[..., :2, :].movedim(-2, 0)))       # gh + gi: the same sum as gi + gh
    r, z = rz[0], rz[1]
    torch.addcmul(gi[..., 2, :], r, ghn, out=n).tanh_()
    torch.lerp(n, prev, z, out=y)
    if a is None:
        return
    torch.addcmul(w[2], ghn, w[0], out=q)                   # w_n + gh_n w_r
    torch.lerp(q, w[2], r, out=q).mul_(r)                   # r (w_n + (1 - r) gh_n w_r)
    q.addcmul_(torch.mul(q, n, out=v), n, value=-1)         # (1 - n^2) ...
    q.addcmul_(torch.sub(y, n, out=v), w[1])                # + (h' - n) w_z
    torch.lerp(q, q.new_ones(()), z, out=a)                 # z + (1 - z) [...]


# -- ParaLSTM --------------------------------------------------------------------------------
def lstm_step(gi: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w: torch.Tensor):
    """One ParaLSTM step on rows: ``gi`` ``(..., 4, H)`` (both biases included), ``h``, ``c``
    ``(..., H)``, the diagonal weights ``w`` ``(4, H)``; returns ``(h', c')``."""
    p = torch.addcmul(gi, w, h.unsqueeze(-2))
    s = _sigmoid(p)
    u = p[..., 2, :].tanh()
    c2 = torch.addcmul(s[..., 1, :] * c, s[..., 0, :], u)
    return s[..., 3, :] * c2.tanh(), c2


def lstm_linearize(gi: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w: torch.Tensor,
                   hy: torch.Tensor, cy: torch.Tensor, J: torch.Tensor | None = None,
                   coef: torch.Tensor | None = None, *, dim: int = -2) -> None:
    """ParaLSTM steps from the previous states, with the 2 x 2 Jacobian blocks and the
    coefficients.

    Arguments:
        gi: input terms with the gates (i, f, g, o; both biases included) along ``dim``:
            ``(..., 4, H)`` (``dim=-2``) or ``(..., 4)`` (``dim=-1``, one unit per row).
        h, c: the previous states, ``gi``'s shape without ``dim``.
        w: the diagonal weights, broadcasting against ``gi`` (``(4, H)`` for ``dim=-2``).
        hy, cy: out, the new states (may be strided views).
        J: out (optional), ``(*h.shape, 2, 2)``: per unit
            ``[[dh'/dh, dh'/dc], [dc'/dh, dc'/dc]]``.
        coef: out (optional), shaped like ``gi`` with 5 entries along ``dim``:
            :data:`LSTM_COEFFICIENTS`.
    """
    p = torch.addcmul(gi, w, h.unsqueeze(dim))
    s = _sigmoid(p)
    i, f, o = s.select(dim, 0), s.select(dim, 1), s.select(dim, 3)
    u = p.select(dim, 2).tanh_()
    torch.addcmul(torch.mul(f, c), i, u, out=cy)
    tc = torch.tanh(cy)
    torch.mul(o, tc, out=hy)
    if J is None and coef is None:
        return
    wi, wf, wg, wo = (w.select(dim, j) for j in range(4))
    sd = torch.rsub(s, 1).mul_(s)                                 # sigma' of every gate
    ci = sd.select(dim, 0).mul_(u)                                # u i (1 - i)
    cf = sd.select(dim, 1).mul_(c)                                # c f (1 - f)
    cg = torch.mul(u, u).neg_().add_(1).mul_(i)                   # i (1 - u^2)
    co = sd.select(dim, 3).mul_(tc)                               # tanh(c') o (1 - o)
    k = tc.mul_(tc).neg_().add_(1).mul_(o)                        # o (1 - tanh(c')^2)
    if coef is not None:
        for j, v in enumerate((ci, cf, cg, co, k)):
            coef.select(dim, j).copy_(v)
    if J is None:
        return
    q = torch.mul(ci, wi).addcmul_(cf, wf).addcmul_(cg, wg)      # dc'/dh
    torch.addcmul(torch.mul(co, wo), k, q, out=J[..., 0, 0])
    torch.mul(k, f, out=J[..., 0, 1])
    J[..., 1, 0] = q
    J[..., 1, 1] = f


# Arrays shaped like one state component that :func:`lstm_newton_block` needs as scratch.
LSTM_SCRATCH = 13


def lstm_newton_block(gi: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w: torch.Tensor,
                      hy: torch.Tensor, cy: torch.Tensor, J: torch.Tensor | None,
                      scratch: torch.Tensor) -> None:
    """:func:`lstm_linearize` (gates along dim 0) without the coefficients and without
    allocating: ParaLSTM steps from the previous states into ``hy``, ``cy`` and the Jacobians'
    ``2 x 2`` blocks into ``J``.

    The new states come from the operations of :func:`lstm_step`, in its order (they are the
    sequential loop's values); the blocks are those of the module doc. Every operation runs on
    contiguous scratch arrays (strided operands cost several times more): ``h``, ``c`` are
    copied in, the results copied out.

    Arguments:
        gi: input terms ``(4, ...)`` (gates i, f, g, o; both biases included; any strides).
        h, c: the previous states ``(...)`` (any strides, e.g. the two halves of interleaved
            ``(..., 2)`` states).
        w: the diagonal weights, broadcasting against ``gi`` (``(4, 1, H, 1)`` for ``gi``
            ``(4, B, H, steps)``).
        hy, cy: out, the new states ``(...)`` (any strides).
        J: out (optional), ``(..., 2, 2)`` (any strides): per unit and step
            ``[[dh'/dh, dh'/dc], [dc'/dh, dc'/dc]]``.
        scratch: at least :data:`LSTM_SCRATCH` ``* h.numel()`` contiguous values (their
            contents are overwritten).
    """
    shape, m = h.shape, h.numel()
    p = scratch[:4 * m].view(4, *shape)
    hs, cs, t, tc, hv, k, q, j0, j1 = (scratch[j * m:(j + 1) * m].view(shape)
                                       for j in range(4, LSTM_SCRATCH))
    hs.copy_(h)
    cs.copy_(c)
    torch.addcmul(gi, w, hs, out=p)
    sigmoid_(p[:2])
    sigmoid_(p[3])
    i, f, u, o = p
    u.tanh_()
    torch.mul(f, cs, out=t).addcmul_(i, u)                    # c'
    torch.tanh(t, out=tc)
    hy.copy_(torch.mul(o, tc, out=hv))
    cy.copy_(t)
    if J is None:
        return
    wi, wf, wg, wo = w
    torch.addcmul(f, f, f, value=-1, out=q).mul_(cs).mul_(wf)  # c f (1 - f) w_f
    torch.addcmul(i, i, i, value=-1, out=t).mul_(u)            # u i (1 - i)
    q.addcmul_(t, wi)
    torch.addcmul(i, i, torch.mul(u, u, out=t), value=-1, out=t)   # i (1 - u^2)
    q.addcmul_(t, wg)                                          # q = dc'/dh
    torch.addcmul(o, o, torch.mul(tc, tc, out=k), value=-1, out=k)  # k = o (1 - tanh(c')^2)
    torch.addcmul(o, o, o, value=-1, out=t).mul_(tc)           # tanh(c') o (1 - o)
    torch.mul(t, wo, out=j0).addcmul_(k, q)
    J[..., 0, 0].copy_(j0)
    J[..., 0, 1].copy_(torch.mul(k, f, out=j1))
    J[..., 1, 0].copy_(q)
    J[..., 1, 1].copy_(f)
