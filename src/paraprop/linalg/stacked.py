"""A flat block bi-diagonal system as stacked, padded tensors: one batched op per sweep or level.

Solvers work on ``l`` blocks at once: the off-diagonal matrices become one ``(l-1, p, p)`` tensor
(transposed, for the row-vector convention ``y = x @ M^T``), scalings ``(l-1, G, p)`` and
diagonals ``(l, G, p)``, where ``p`` is the widest block (narrower blocks are zero-padded, which
leaves the solution unchanged) and ``G`` is the per-sample batch or 1. Right-hand sides are laid
out as ``(l, G, Q, p)``: ``Q`` row vectors per group (all samples for a shared system).
"""

from __future__ import annotations

from typing import Any

import torch

from paraprop.linalg.system import BlockBidiagonal

__all__ = ["StackedSystem"]


def _runs(keys: list) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of equal consecutive keys."""
    out, a = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[a]:
            out.append((a, i))
            a = i
    return out


class StackedSystem:
    """Stacked, padded tensors of a flat (non-nested) :class:`BlockBidiagonal`.

    Arguments:
        system: the system (its diagonal blocks must be scalings, not nested systems).
        G: groups of the right-hand side layout: the system's per-sample batch, or 1.
        like: a tensor whose dtype and device a system of identities only takes.

    Attributes:
        Mt: ``(l-1, p, p)``, ``Mt[j] = M_j^T`` zero-padded; a fresh buffer the caller may consume.
        scale: ``(l-1, G, p)`` row scalings ``s_j`` (``None`` when all are absent).
        diag: ``(l, G, p)`` diagonals, padded with ones (``None`` when all are the identity).
    """

    def __init__(self, system: BlockBidiagonal, G: int, like: torch.Tensor | None = None):
        if system.nested:
            raise ValueError("StackedSystem needs scalar diagonal blocks, got a nested system")
        self.lower, self.l, self.sizes = system.lower, system.l, system.sizes
        self.G = G
        self.p = max(self.sizes)
        self.uniform = len(set(self.sizes)) == 1
        self.dtype = system.dtype or (like.dtype if like is not None else torch.get_default_dtype())
        self.device = system.device or (like.device if like is not None else torch.device("cpu"))
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        p, l = self.p, self.l
        # flat position of every unknown in the padded (l * p) layout
        self.idx = None
        if not self.uniform:
            self.idx = torch.cat([torch.arange(n, device=self.device) + k * p
                                  for k, n in enumerate(self.sizes)])
        mats = system._transposed_weights  # M_j^T, (cols, rows), when the builder kept them
        if mats is None:
            mats = [op.dense_t() for op in system.off]
        shapes = [(m.shape[1], m.shape[0]) for m in mats]
        if not mats:
            self.Mt = torch.zeros(0, p, p, **kw)
        elif len(set(shapes)) == 1 and shapes[0] == (p, p):
            self.Mt = torch.stack(mats)
        else:
            self.Mt = torch.zeros(l - 1, p, p, **kw)
            for a, b in _runs(shapes):
                r, c = shapes[a]
                self.Mt[a:b, :c, :r] = torch.stack(mats[a:b])
        hint = getattr(system, "_stacked_scale", None)
        if hint is not None and hint.shape == (l - 1, G, p):
            self.scale = hint
        else:
            self.scale = self._vectors(system.off_scale, [s[0] for s in shapes], 0.0)
        self.diag = self._vectors(system.diag, list(self.sizes), 1.0)

    def _vectors(self, entries, widths, pad: float):
        """Stack ``(n,)``/``(B, n)``/``None`` entries into ``(len, G, p)``, or ``None``."""
        if all(e is None for e in entries):
            return None
        G, p = self.G, self.p
        out = torch.full((len(entries), G, p), pad, dtype=self.dtype, device=self.device)
        keys = [(w, None if e is None else tuple(e.shape)) for e, w in zip(entries, widths,
                                                                              strict=True)]
        for a, b in _runs(keys):
            w, shape = keys[a]
            if shape is None:
                out[a:b, :, :w] = 1.0
            else:
                out[a:b, :, :w] = torch.stack(list(entries[a:b])).reshape(b - a, -1, w)
        return out

    # -- layout ---------------------------------------------------------------------------
    def to_blocks(self, R: torch.Tensor) -> torch.Tensor:
        """``(G, Q, N)`` -> ``(l, G, Q, p)`` (a fresh, zero-padded buffer)."""
        G, Q, _ = R.shape
        if not self.uniform:
            padded = R.new_zeros(G, Q, self.l * self.p)
            padded[..., self.idx] = R
            R = padded
        out = R.new_empty(self.l, G, Q, self.p)  # always a copy: solvers update it in place
        out.copy_(R.reshape(G, Q, self.l, self.p).permute(2, 0, 1, 3))
        return out

    def from_blocks(self, X: torch.Tensor) -> torch.Tensor:
        """``(l, G, Q, p)`` -> ``(G, Q, N)``."""
        l, G, Q, p = X.shape
        flat = X.permute(1, 2, 0, 3).reshape(G, Q, l * p)
        return flat if self.uniform else flat[..., self.idx]

    # -- products -------------------------------------------------------------------------
    def matvec_off(self, X: torch.Tensor) -> torch.Tensor:
        """The off-diagonal part of ``A x`` in block layout: ``(l, G, Q, p)``."""
        l, G, Q, p = X.shape
        Y = torch.zeros_like(X)
        if l == 1:
            return Y
        src, dst = (slice(0, l - 1), slice(1, l)) if self.lower else (slice(1, l), slice(0, l - 1))
        prod = torch.bmm(X[src].reshape(l - 1, G * Q, p), self.Mt).reshape(l - 1, G, Q, p)
        if self.scale is not None:
            prod = prod * self.scale.unsqueeze(2)
        Y[dst] = prod
        return Y

    def diag_rows(self) -> torch.Tensor | None:
        """The diagonal as ``(l, G, 1, p)`` (broadcasts against the block layout)."""
        return None if self.diag is None else self.diag.unsqueeze(2)

    def matvec_flops(self, Q: int) -> int:
        """Flops of one ``A x`` (``Q`` vectors per group), as executed on padded blocks."""
        return (self.l - 1) * self.G * Q * (2 * self.p * self.p + self.p) + \
            self.l * self.G * Q * self.p
