"""Off-diagonal blocks of a block bi-diagonal system: matrices and matrix-free linear operators.

An off-diagonal block of Naumov's systems is a weight matrix (``W^(k)`` in the forward system,
``W^(k+1)^T`` in the backward one) or, for the nested RNN system, a block-diagonal operator that
applies one matrix per layer (eq. 23-24). Every block is wrapped in a :class:`LinearOperator`
with a row-vector convention: ``matvec(x)`` maps ``(..., cols)`` to ``(..., rows)``, i.e.
``x @ M.T`` for a matrix ``M``.
"""

from __future__ import annotations

import torch

__all__ = ["BlockDiagonalOperator", "LinearOperator", "MatrixOperator", "as_operator"]


class LinearOperator:
    """A linear map ``R^cols -> R^rows`` given by its action on (batched) vectors.

    Subclasses set ``shape = (rows, cols)``, ``dtype`` and ``device`` and implement
    :meth:`matvec`; :meth:`dense` (the matrix, needed by cyclic reduction) defaults to applying
    ``matvec`` to the identity, and :meth:`flops` to ``2 * rows * cols`` per vector.

    Example:
        >>> class Scale(LinearOperator):
        ...     def __init__(self, n, a):
        ...         self.shape, self.dtype, self.device, self.a = (n, n), torch.float64, "cpu", a
        ...     def matvec(self, x):
        ...         return self.a * x
        >>> Scale(3, 2.0).dense()[0]
        tensor([2., 0., 0.], dtype=torch.float64)
    """

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    def matvec(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """The ``(rows, cols)`` matrix of the operator."""
        rows, cols = self.shape
        eye = torch.eye(cols, dtype=self.dtype, device=self.device)
        return self.matvec(eye).T

    def dense_t(self) -> torch.Tensor:
        """The transposed matrix ``(cols, rows)`` (what the row-vector kernels multiply by)."""
        return self.dense().T

    def flops(self, vectors: int) -> int:
        """Floating-point operations of applying the operator to ``vectors`` vectors."""
        return 2 * self.shape[0] * self.shape[1] * vectors


class MatrixOperator(LinearOperator):
    """A dense matrix ``M`` (``rows x cols``); ``matvec(x) = x @ M.T``.

    Arguments:
        matrix: ``M``, or ``M^T`` when ``transposed=True`` (the backward system's blocks are
            transposed weights; keeping the weight itself avoids a view per block).

    Example:
        >>> MatrixOperator(torch.ones(2, 3)).matvec(torch.ones(4, 3)).shape
        torch.Size([4, 2])
    """

    __slots__ = ("matrix", "shape", "transposed")

    def __init__(self, matrix: torch.Tensor, transposed: bool = False):
        self.matrix = matrix
        self.transposed = transposed
        r, c = matrix.shape
        self.shape = (c, r) if transposed else (r, c)

    # read-only, the matrix's own (the base declares plain attributes, which operators of
    # users set)
    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.matrix.dtype

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.matrix.device

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.matrix if self.transposed else x @ self.matrix.T

    def dense(self) -> torch.Tensor:
        return self.matrix.T if self.transposed else self.matrix

    def dense_t(self) -> torch.Tensor:
        return self.matrix if self.transposed else self.matrix.T


class BlockDiagonalOperator(LinearOperator):
    """``blockdiag(M_1, ..., M_m)``: one matrix per consecutive slice of the vector.

    The outer off-diagonal blocks of the nested RNN system (Naumov 2017, eq. 23-24) have this
    form: between time steps ``t`` and ``t +- 1`` each layer ``k`` couples only to itself, through
    its recurrent weight ``U^(k)`` (transposed in the backward system).

    Arguments:
        blocks: the matrices ``M_i`` (``rows_i x cols_i``), same dtype and device.

    Example:
        >>> op = BlockDiagonalOperator([torch.eye(2), 2 * torch.eye(3)])
        >>> op.shape, op.matvec(torch.ones(5)).tolist()
        ((5, 5), [1.0, 1.0, 2.0, 2.0, 2.0])
    """

    def __init__(self, blocks: list[torch.Tensor]):
        if not blocks:
            raise ValueError("blocks must hold at least one matrix, got an empty list")
        for i, b in enumerate(blocks):
            if not isinstance(b, torch.Tensor) or b.dim() != 2:
                raise TypeError(f"blocks[{i}] must be a 2-D tensor, got "
                                f"{getattr(b, 'shape', type(b).__name__)}")
        self.blocks = list(blocks)
        self.rows = [b.shape[0] for b in blocks]
        self.cols = [b.shape[1] for b in blocks]
        self.shape = (sum(self.rows), sum(self.cols))
        self.dtype = blocks[0].dtype
        self.device = blocks[0].device
        self._uniform = len(set(self.rows)) == 1 and len(set(self.cols)) == 1
        self._stacked = torch.stack(self.blocks) if self._uniform else None

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        if self._stacked is not None:   # (uniform blocks)
            m, r, c = len(self.blocks), self.rows[0], self.cols[0]
            xs = x.reshape(*x.shape[:-1], m, c).unsqueeze(-2)  # (..., m, 1, c)
            y = (xs @ self._stacked.transpose(-1, -2)).squeeze(-2)  # (..., m, r)
            return y.reshape(*x.shape[:-1], m * r)
        parts = torch.split(x, self.cols, dim=-1)
        return torch.cat([p @ b.T for p, b in zip(parts, self.blocks, strict=True)], dim=-1)

    def dense(self) -> torch.Tensor:
        return torch.block_diag(*self.blocks)

    def flops(self, vectors: int) -> int:
        return 2 * vectors * sum(r * c for r, c in zip(self.rows, self.cols, strict=True))


def as_operator(block, name: str) -> LinearOperator:
    """Wrap a 2-D tensor in :class:`MatrixOperator`; pass a :class:`LinearOperator` through.

    Raises:
        TypeError: anything else (the message names ``name``).
    """
    if isinstance(block, LinearOperator):
        return block
    if isinstance(block, torch.Tensor):
        if block.dim() != 2:
            raise ValueError(f"{name} must be a 2-D matrix, got shape {tuple(block.shape)}")
        return MatrixOperator(block)
    raise TypeError(f"{name} must be a 2-D tensor or a LinearOperator, got {type(block).__name__}")
