"""``BlockBidiagonal``: the block bi-diagonal triangular systems of forward and backward passes.

Naumov 2017 ("Parallel Complexity of Forward and Backward Propagation") writes forward
propagation through ``l`` layers as a block bi-diagonal *lower* system (eq. 13/18) and backward
propagation as a block bi-diagonal *upper* system (eq. 14/19)::

    lower                                   upper
    [ D_0                 ] [x_0]   [r_0]   [ D_0  L_0          ] [x_0]   [r_0]
    [ L_0  D_1            ] [x_1] = [r_1]   [      D_1  L_1     ] [x_1] = [r_1]
    [      L_1  D_2       ] [x_2]   [r_2]   [           D_2 ... ] [x_2]   [r_2]
    [           ...  ...  ] [...]   [...]   [               ... ] [...]   [...]

The diagonal blocks ``D_k`` are diagonal scalings (the activation-derivative matrices ``D^(k)``,
``E^(k)`` of eq. 20-21; the identity when those sit in the off-diagonal blocks) or, for the
nested RNN system of eq. 23-24, block bi-diagonal systems themselves. The off-diagonal blocks are
``L_j = diag(s_j) M_j``: a weight matrix or linear operator ``M_j`` with an optional row scaling
``s_j``. Scalings of shape ``(B, n)`` differ per sample: the systems of a mini-batch, which
differ only in their diagonal scalings, are shifted systems (eq. 15-16).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paraprop import checks
from paraprop.linalg.operators import (
    BlockDiagonalOperator,
    LinearOperator,
    MatrixOperator,
    as_operator,
)

__all__ = ["BlockBidiagonal"]


class BlockBidiagonal:
    """A lower or upper block bi-diagonal system ``A x = r`` with ``l`` block rows.

    Block row ``k`` of a lower system reads ``D_k x_k + diag(s_{k-1}) M_{k-1} x_{k-1} = r_k``;
    of an upper system ``D_k x_k + diag(s_k) M_k x_{k+1} = r_k``. Vectors are flat: a solution or
    right-hand side is ``(N,)`` or ``(B, N)`` with ``N = sum(sizes)``; :meth:`split` and
    :meth:`join` convert to and from the list of blocks.

    Arguments:
        off: the ``l - 1`` off-diagonal blocks ``M_j``, each a 2-D tensor or a
            :class:`~paraprop.linalg.operators.LinearOperator`. In a lower system ``off[j]`` is
            block ``(j + 1, j)`` (``sizes[j+1] x sizes[j]``); in an upper system block
            ``(j, j + 1)`` (``sizes[j] x sizes[j+1]``).
        lower: ``True`` for a lower (forward) system, ``False`` for an upper (backward) one.
        diag: ``None`` (every ``D_k`` is the identity) or ``l`` entries, each ``None``
            (identity), a tensor ``(n_k,)`` (shared) or ``(B, n_k)`` (per sample), or a nested
            :class:`BlockBidiagonal` of total size ``n_k``.
        off_scale: ``None`` or ``l - 1`` entries ``s_j``: ``None``, ``(rows_j,)`` or
            ``(B, rows_j)``.
        sizes: the block widths ``n_k``; needed only when they cannot be read off the blocks
            (``l = 1`` with an identity diagonal).

    Raises:
        TypeError: a block that is not a tensor/operator, non-floating dtypes, mixed dtypes or
            devices.
        ValueError: block shapes that do not chain, per-sample sizes that disagree, ``sizes``
            inconsistent with the blocks.

    Example:
        >>> W = [torch.randn(3, 2), torch.randn(4, 3)]          # widths 2 -> 3 -> 4
        >>> A = BlockBidiagonal(W, lower=True, sizes=[2, 3, 4])
        >>> A.l, A.N, A.dense().shape
        (3, 9, torch.Size([1, 9, 9]))
    """

    def __init__(
        self,
        off: Sequence,
        *,
        lower: bool,
        diag: Sequence | None = None,
        off_scale: Sequence | None = None,
        sizes: Sequence[int] | None = None,
    ):
        checks.boolean("lower", lower)
        if isinstance(off, torch.Tensor) or not isinstance(off, Sequence):
            raise TypeError("off must be a sequence (list/tuple) of l - 1 blocks, got "
                            f"{type(off).__name__}")
        ops = [as_operator(b, f"off[{j}]") for j, b in enumerate(off)]
        l = len(ops) + 1
        diag_l = _entries(diag, l, "diag")
        scale_l = _entries(off_scale, l - 1, "off_scale")
        sizes_l = _infer_sizes(ops, diag_l, scale_l, sizes, lower)
        for k, d in enumerate(diag_l):
            if isinstance(d, BlockBidiagonal) and d.lower != lower:
                raise ValueError(
                    f"diag[{k}] is a nested {'lower' if d.lower else 'upper'} system but the "
                    f"outer system is {'lower' if lower else 'upper'}; nested systems must have "
                    "the outer system's orientation (both lower or both upper)")
        dtype, device, batch = _check_tensors(ops, diag_l, scale_l)
        self._set(lower, ops, diag_l, scale_l, sizes_l, batch, dtype, device)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def _trusted(cls, lower, ops, diag, scale, sizes, batch, dtype, device, *,
                 stacked_scale: torch.Tensor | None = None,
                 transposed_weights: list | None = None,
                 nested: bool | None = None) -> BlockBidiagonal:
        """Build without validation (for builders whose blocks are consistent by design).

        Lazy forms for deep systems: ``ops=None`` with ``transposed_weights`` (matrices ``W_j``,
        block ``j`` being ``W_j^T``), ``scale=None`` with ``stacked_scale`` (``(l-1, batch, n)``
        per-sample row scalings); the per-block lists are made only when asked for.
        """
        obj = cls.__new__(cls)
        obj._set(lower, ops, diag, scale, sizes, batch, dtype, device, nested)
        obj._stacked_scale = stacked_scale
        obj._transposed_weights = transposed_weights
        return obj

    def _set(self, lower, ops, diag, scale, sizes, batch, dtype, device, nested=None) -> None:
        self.lower = lower
        self._off = None if ops is None else tuple(ops)
        self.diag = tuple(diag)
        self._off_scale = None if scale is None else tuple(scale)
        self.sizes = tuple(sizes)
        self.l = len(self.sizes)
        self.N = sum(self.sizes)
        self.batch: int | None = batch
        self.dtype = dtype
        self.device = device
        self.nested = any(isinstance(d, BlockBidiagonal) for d in self.diag) if nested is None \
            else nested
        self._stacked_scale: torch.Tensor | None = None
        self._transposed_weights: list | None = None

    @property
    def off(self) -> tuple[LinearOperator, ...]:
        """The off-diagonal blocks ``M_j`` as operators."""
        if self._off is None:
            assert self._transposed_weights is not None   # the lazy form keeps the weights
            self._off = tuple(MatrixOperator(w, transposed=True)
                              for w in self._transposed_weights)
        return self._off

    @property
    def off_scale(self) -> tuple:
        """The row scalings ``s_j`` of the off-diagonal blocks (``None`` entries: none)."""
        if self._off_scale is None:
            assert self._stacked_scale is not None   # the lazy form keeps the stacked scalings
            self._off_scale = tuple(self._stacked_scale.unbind(0))
        return self._off_scale

    # -- vectors ----------------------------------------------------------------------------
    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The blocks ``x_k`` (views) of a flat vector ``(..., N)``."""
        if x.shape[-1] != self.N:
            raise ValueError(f"x must have last dim N={self.N}, got shape {tuple(x.shape)}")
        return list(torch.split(x, list(self.sizes), dim=-1))

    def join(self, blocks: Sequence[torch.Tensor]) -> torch.Tensor:
        """The flat vector ``(..., N)`` of ``l`` blocks ``(..., n_k)``."""
        if len(blocks) != self.l:
            raise ValueError(f"expected {self.l} blocks, got {len(blocks)}")
        for k, (b, n) in enumerate(zip(blocks, self.sizes, strict=True)):
            if b.shape[-1] != n:
                raise ValueError(f"block {k} must have last dim {n}, got shape {tuple(b.shape)}")
        return torch.cat(list(blocks), dim=-1)

    # -- the matrix -----------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Longest chain of dependent unknowns: Jacobi is exact after this many sweeps.

        A chain crosses each block row at most once and, inside it, follows at most the depth of
        a nested diagonal block: at most the sum of those depths. When every coupling block is a
        :class:`~paraprop.linalg.operators.BlockDiagonalOperator` that maps inner block ``k`` to
        inner block ``k`` of flat nested systems (the RNN's ``blockdiag_k(U^k)``), a chain moves
        one step in time or one layer at a time: ``l - 1 + K``.
        """
        inner = [d.depth if isinstance(d, BlockBidiagonal) else 1 for d in self.diag]
        if not self.nested or self._aligned_coupling():
            return self.l - 1 + max(inner)
        return sum(inner)

    def _aligned_coupling(self) -> bool:
        """Whether every off-diagonal block couples inner block ``k`` only to inner block ``k``
        of flat nested systems with the same number of blocks."""
        if not all(isinstance(d, BlockBidiagonal) and not d.nested for d in self.diag):
            return False
        if len({d.l for d in self.diag}) != 1:
            return False
        for j, op in enumerate(self.off):
            r, c = (j + 1, j) if self.lower else (j, j + 1)
            if not isinstance(op, BlockDiagonalOperator) or \
                    list(op.rows) != list(self.diag[r].sizes) or \
                    list(op.cols) != list(self.diag[c].sizes):
                return False
        return True

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """``A x`` for ``x`` of shape ``(N,)`` or ``(B, N)``."""
        return self._matvec(x, with_diag=True)

    def _matvec(self, x: torch.Tensor, with_diag: bool) -> torch.Tensor:
        """``A x``, or ``(A - diag(A)) x`` with the scalar diagonal left out (Jacobi)."""
        xs = self.split(x)
        out = []
        for k in range(self.l):
            d = self.diag[k]
            if isinstance(d, BlockBidiagonal):
                y = d._matvec(xs[k], with_diag)
            elif with_diag:
                y = xs[k] if d is None else _rows(d, x) * xs[k]
            else:
                y = torch.zeros_like(xs[k])
            j, nb = (k - 1, k - 1) if self.lower else (k, k + 1)
            if 0 <= j < self.l - 1:
                v = self.off[j].matvec(xs[nb])
                s = self.off_scale[j]
                y = y + (v if s is None else _rows(s, x) * v)
            out.append(y)
        return torch.cat(out, dim=-1)

    def point_diagonal(self) -> torch.Tensor:
        """The scalar diagonal of ``A``: ``(G, N)``, ``G`` the batch (per-sample) or 1."""
        G = self.batch or 1
        parts = []
        for d, n in zip(self.diag, self.sizes, strict=True):
            if d is None:
                parts.append(torch.ones(G, n, **_kw(self)))
            elif isinstance(d, BlockBidiagonal):
                parts.append(d.point_diagonal().expand(G, n))
            else:
                parts.append(d.expand(G, n))
        return torch.cat(parts, dim=-1)

    def dense(self) -> torch.Tensor:
        """The dense matrix ``(G, N, N)`` (``G`` the batch for per-sample systems, else 1)."""
        G = self.batch or 1
        kw = _kw(self)
        A = torch.zeros(G, self.N, self.N, **kw)
        off = [0]
        for n in self.sizes:
            off.append(off[-1] + n)
        for k, d in enumerate(self.diag):
            sl = slice(off[k], off[k + 1])
            if d is None:
                A[:, sl, sl] = torch.eye(self.sizes[k], **kw)
            elif isinstance(d, BlockBidiagonal):
                A[:, sl, sl] = d.dense()
            else:
                A[:, sl, sl] = torch.diag_embed(d.expand(G, self.sizes[k]))
        for j, op in enumerate(self.off):
            r, c = (j + 1, j) if self.lower else (j, j + 1)
            M = op.dense()
            s = self.off_scale[j]
            blk = M.expand(G, *M.shape) if s is None else s.reshape(-1, M.shape[0], 1) * M
            A[:, off[r]:off[r + 1], off[c]:off[c + 1]] = blk
        return A

    def check_nonsingular(self) -> None:
        """Raise ``ValueError`` naming the first zero or non-finite diagonal entry.

        A triangular matrix is singular exactly when a diagonal entry is zero, so no method can
        solve such a system; every method divides by the diagonal scalings.
        """
        for k, d in enumerate(self.diag):
            if isinstance(d, BlockBidiagonal):
                try:
                    d.check_nonsingular()
                except ValueError as e:
                    raise ValueError(f"diag[{k}] (nested system): {e}") from None
            elif d is not None:
                bad = (d == 0) | ~torch.isfinite(d)
                if bool(bad.any()):
                    idx = [int(i) for i in bad.nonzero()[0]]
                    raise ValueError(
                        f"diag[{k}] is singular: entry {tuple(idx)} of shape {tuple(d.shape)} is "
                        f"{float(d[tuple(idx)])}; a block triangular system with a zero (or "
                        "non-finite) diagonal entry has no unique solution. Move the scaling into "
                        "the off-diagonal blocks (identity diagonal), as from_mlp does for ReLU")

    def shifted(self, shifts: torch.Tensor) -> BlockBidiagonal:
        """The shifted systems ``A + diag(shifts_b) I``, one per sample ``b`` (eq. 15-16).

        Arguments:
            shifts: ``(B,)`` shifts; a per-sample system must have ``batch == B``.

        Returns:
            A per-sample :class:`BlockBidiagonal` sharing the off-diagonal blocks.
        """
        if not isinstance(shifts, torch.Tensor) or shifts.dim() != 1:
            raise ValueError("shifts must be a 1-D tensor (B,), got "
                             f"{getattr(shifts, 'shape', type(shifts).__name__)}")
        if self.nested:
            raise ValueError("shifted() needs scalar diagonal blocks, not nested systems")
        B = shifts.shape[0]
        if self.batch is not None and self.batch != B:
            raise ValueError(f"shifts has {B} entries but the system has batch {self.batch}")
        sh = shifts.to(self.dtype or shifts.dtype).reshape(B, 1)
        diag = [(1.0 if d is None else d) + sh.expand(B, n)
                for d, n in zip(self.diag, self.sizes, strict=True)]
        return BlockBidiagonal._trusted(self.lower, self.off, diag, self.off_scale, self.sizes,
                                        B, sh.dtype, sh.device)

    def __repr__(self) -> str:
        kind = "lower" if self.lower else "upper"
        b = "" if self.batch is None else f", per-sample batch={self.batch}"
        nest = ", nested" if self.nested else ""
        return f"BlockBidiagonal({kind}, l={self.l}, sizes={_short(self.sizes)}{b}{nest})"


def _kw(system) -> dict:
    """dtype and device of a system (the defaults for one made of identities only)."""
    return {"dtype": system.dtype or torch.get_default_dtype(),
            "device": system.device or torch.device("cpu")}


def _short(sizes) -> str:
    s = list(sizes)
    return str(s) if len(s) <= 6 else f"[{s[0]}, {s[1]}, ..., {s[-1]}] ({len(s)} blocks)"


def _rows(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-sample ``(B, n)`` scaling aligned with ``x``: ``(B, n)`` or, for ``x`` laid out as
    ``(B, Q, N)`` (``Q`` right-hand sides per sample), ``(B, 1, n)``."""
    return t.unsqueeze(-2) if t.dim() == 2 and x.dim() == 3 else t


def _entries(seq, n: int, name: str) -> list:
    if seq is None:
        return [None] * n
    if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence):
        raise TypeError(f"{name} must be None or a sequence of {n} entries, got "
                        f"{type(seq).__name__}")
    if len(seq) != n:
        raise ValueError(f"{name} must have {n} entries (one per block), got {len(seq)}")
    return list(seq)


def _width(entry, name: str) -> int | None:
    if entry is None:
        return None
    if isinstance(entry, BlockBidiagonal):
        return entry.N
    if not isinstance(entry, torch.Tensor):
        raise TypeError(f"{name} must be None, a tensor or a BlockBidiagonal, got "
                        f"{type(entry).__name__}")
    if entry.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape (n,) or (B, n), got {tuple(entry.shape)}")
    return entry.shape[-1]


def _infer_sizes(ops, diag, scale, sizes, lower) -> list[int]:
    l = len(diag)
    known: list[int | None] = [None] * l
    where: list[str] = [""] * l

    def put(k: int, n: int, src: str) -> None:
        if known[k] is None:
            known[k], where[k] = n, src
        elif known[k] != n:
            raise ValueError(f"mismatched block shapes: block {k} has width {known[k]} from "
                             f"{where[k]} but width {n} from {src}")

    if sizes is not None:
        if isinstance(sizes, torch.Tensor) or not isinstance(sizes, Sequence) or \
                len(sizes) != l or not all(isinstance(n, int) and n > 0 for n in sizes):
            raise ValueError(f"sizes must be {l} positive ints, got {sizes!r}")
        for k, n in enumerate(sizes):
            put(k, n, "sizes")
    for k, d in enumerate(diag):
        n = _width(d, f"diag[{k}]")
        if n is not None:
            put(k, n, f"diag[{k}] {_shape(d)}")
    for j, op in enumerate(ops):
        rows, cols = op.shape
        r, c = (j + 1, j) if lower else (j, j + 1)
        put(r, rows, f"off[{j}] {tuple(op.shape)} (rows)")
        put(c, cols, f"off[{j}] {tuple(op.shape)} (columns)")
        n = _width(scale[j], f"off_scale[{j}]")
        if isinstance(scale[j], BlockBidiagonal):
            raise TypeError(f"off_scale[{j}] must be a tensor or None, not a BlockBidiagonal")
        if n is not None and n != rows:
            raise ValueError(f"mismatched block shapes: off_scale[{j}] has shape "
                             f"{tuple(scale[j].shape)} but off[{j}] has {rows} rows")
    out: list[int] = []
    for k, n in enumerate(known):
        if n is None:
            raise ValueError(f"cannot infer the width of block {k}; pass sizes=[...]")
        out.append(int(n))
    return out


def _shape(d) -> str:
    return f"(size {d.N})" if isinstance(d, BlockBidiagonal) else str(tuple(d.shape))


def _check_tensors(ops: list[LinearOperator], diag: list, scale: list
                   ) -> tuple[torch.dtype | None, torch.device | None, int | None]:
    """The common dtype, device and per-sample batch of the blocks, checked (``None``s: the
    identity system, made of no tensor)."""
    tensors: list[tuple[str, torch.Tensor | LinearOperator | BlockBidiagonal]] = []
    batch: int | None = None
    batch_src = ""
    for j, op in enumerate(ops):
        tensors.append((f"off[{j}]", op))
    for k, d in enumerate(diag):
        if isinstance(d, BlockBidiagonal):
            tensors.append((f"diag[{k}]", d))
            if d.batch is not None:
                if batch is not None and d.batch != batch:
                    raise ValueError(f"diag[{k}] has per-sample batch {d.batch} but {batch_src} "
                                     f"has {batch}")
                batch, batch_src = d.batch, f"diag[{k}]"
        elif d is not None:
            tensors.append((f"diag[{k}]", d))
    for j, s in enumerate(scale):
        if s is not None:
            tensors.append((f"off_scale[{j}]", s))
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not name.startswith("off["):
            if batch is not None and t.shape[0] != batch:
                raise ValueError(f"{name} has per-sample batch {t.shape[0]} (shape "
                                 f"{tuple(t.shape)}) but {batch_src} has {batch}")
            batch, batch_src = t.shape[0], name
    if not tensors:  # the identity: it takes the right-hand side's dtype and device
        return None, None, None
    name0, t0 = tensors[0]
    dtype, device = t0.dtype, torch.device(t0.device)
    if not dtype.is_floating_point:
        raise TypeError(f"{name0} must have a floating-point dtype, got {dtype}")
    for name, t in tensors[1:]:
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {name0} has {dtype}")
        if torch.device(t.device) != device:
            raise TypeError(f"{name} is on {t.device} but {name0} is on {device}")
    return dtype, device, batch
