"""Sparsity patterns of transposed Jacobians, computed once per layer configuration.

BPPSA (§3.3, Appendix D): the guaranteed zeros of a layer's Jacobian depend only on the
architecture (kernel, stride, padding, shapes), so the CSR structure (``crow``, ``col``) is built
once and cached; each step only fills ``values``. A :class:`Pattern` also says where every value
comes from: ``source[k]`` indexes the flattened weight (convolution, linear) or, for ReLU and
max-pooling, the pattern positions are filled from the activation.

Index convention: the transposed Jacobian ``J^T`` of ``y = f(x)`` (one sample) has shape
``(x.numel(), y.numel())`` and ``J^T[i, j] = dy_j / dx_i``, rows and columns in row-major order
of ``x`` and ``y``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Pattern:
    """A CSR pattern: ``crow`` (n_rows + 1), ``col`` (nnz) and, per entry, ``row`` and
    ``source`` (where its value comes from; meaning depends on the layer)."""

    shape: tuple[int, int]
    crow: torch.Tensor
    col: torch.Tensor
    row: torch.Tensor
    source: torch.Tensor
    # per-device copies of the index tensors, and sub-patterns without pruned weights
    _devices: dict = field(default_factory=dict, compare=False, repr=False)
    _pruned: dict = field(default_factory=dict, compare=False, repr=False)

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(crow, col, row, source)`` on ``device``, copied once per device."""
        key = str(device)
        if key not in self._devices:
            self._devices[key] = tuple(t.to(device) for t in (self.crow, self.col, self.row,
                                                              self.source))
        return self._devices[key]

    @property
    def nnz(self) -> int:
        return int(self.col.numel())

    @property
    def sparsity(self) -> float:
        """Fraction of guaranteed zeros."""
        return 1.0 - self.nnz / (self.shape[0] * self.shape[1])

    def csr(self, values: torch.Tensor) -> torch.Tensor:
        """The CSR tensor with this pattern and ``values`` (the pattern is valid by
        construction, so torch's invariant checks are skipped)."""
        crow, col, _, _ = self.on(values.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
            return torch.sparse_csr_tensor(crow, col, values, self.shape,
                                           check_invariants=False)


def _from_coo(rows: torch.Tensor, cols: torch.Tensor, source: torch.Tensor,
              shape: tuple[int, int]) -> Pattern:
    """Sort COO entries by (row, col) and compress the rows."""
    order = torch.argsort(rows * shape[1] + cols)
    rows, cols, source = rows[order], cols[order], source[order]
    crow = torch.zeros(shape[0] + 1, dtype=torch.long)
    crow[1:] = torch.bincount(rows, minlength=shape[0]).cumsum(0)
    return Pattern(shape, crow, cols, rows, source)


def _out_size(n: int, k: int, s: int, p: int, d: int, ceil_mode: bool = False) -> int:
    num = n + 2 * p - d * (k - 1) - 1
    if ceil_mode:
        out = -(-num // s) + 1
        if (out - 1) * s >= n + p:  # the last window must start inside the input or left pad
            out -= 1
        return out
    return num // s + 1


def _windows(C_in: int, H: int, W: int, C_out: int, kh: int, kw: int, stride, padding,
             dilation, per_channel: bool, ceil_mode: bool = False):
    """Every (input, output, kernel position) triple of a sliding window, valid ones only."""
    OH = _out_size(H, kh, stride[0], padding[0], dilation[0], ceil_mode)
    OW = _out_size(W, kw, stride[1], padding[1], dilation[1], ceil_mode)
    oh = torch.arange(OH).view(-1, 1, 1, 1)
    ow = torch.arange(OW).view(1, -1, 1, 1)
    ki = torch.arange(kh).view(1, 1, -1, 1)
    kj = torch.arange(kw).view(1, 1, 1, -1)
    ih = oh * stride[0] - padding[0] + ki * dilation[0]
    iw = ow * stride[1] - padding[1] + kj * dilation[1]
    valid = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    ih, iw = ih.expand_as(valid)[valid], iw.expand_as(valid)[valid]  # (P,)
    pos_out = (oh * OW + ow).expand_as(valid)[valid]
    kpos = (ki * kw + kj).expand_as(valid)[valid]
    pix_in = ih * W + iw
    if per_channel:  # pooling: channel c of the output reads channel c of the input
        c = torch.arange(C_in).view(-1, 1)
        rows = (c * H * W + pix_in).reshape(-1)
        cols = (c * OH * OW + pos_out).reshape(-1)
        src = (c * 0 + kpos).reshape(-1)
        return rows, cols, src, (C_in, OH, OW)
    oc = torch.arange(C_out).view(-1, 1, 1)
    ic = torch.arange(C_in).view(1, -1, 1)
    rows = (ic * H * W + pix_in).expand(C_out, C_in, -1).reshape(-1)
    cols = (oc * OH * OW + pos_out).expand(C_out, C_in, -1).reshape(-1)
    src = ((oc * C_in + ic) * kh * kw + kpos).reshape(-1)  # index into weight.flatten()
    return rows, cols, src, (C_out, OH, OW)


@lru_cache(maxsize=64)
def conv2d(in_shape: tuple[int, int, int], weight_shape: tuple[int, int, int, int],
           stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int]
           ) -> tuple[Pattern, tuple[int, int, int]]:
    """Pattern of a (groups=1) convolution; ``source`` indexes ``weight.flatten()``."""
    C, H, W = in_shape
    OC, _, kh, kw = weight_shape
    rows, cols, src, out_shape = _windows(C, H, W, OC, kh, kw, stride, padding, dilation, False)
    n_out = out_shape[0] * out_shape[1] * out_shape[2]
    return _from_coo(rows, cols, src, (C * H * W, n_out)), out_shape


@lru_cache(maxsize=64)
def max_pool2d(in_shape: tuple[int, int, int], kernel: tuple[int, int],
               stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
               ceil_mode: bool) -> tuple[Pattern, tuple[int, int, int]]:
    """Pattern of max-pooling: every input of every window (the architecture's pattern);
    values are 1 at the window's argmax and 0 elsewhere."""
    C, H, W = in_shape
    rows, cols, src, out_shape = _windows(C, H, W, C, kernel[0], kernel[1], stride, padding,
                                          dilation, True, ceil_mode)
    n_out = out_shape[0] * out_shape[1] * out_shape[2]
    return _from_coo(rows, cols, src, (C * H * W, n_out)), out_shape


@lru_cache(maxsize=64)
def diagonal(n: int) -> Pattern:
    """Pattern of an elementwise layer (ReLU) or a reshape (Flatten): the diagonal."""
    idx = torch.arange(n)
    return Pattern((n, n), torch.arange(n + 1), idx, idx, idx)


@lru_cache(maxsize=64)
def dense(n_rows: int, n_cols: int) -> Pattern:
    """A full pattern (``nn.Linear``: ``J^T = W^T``); ``source`` indexes ``W^T.flatten()``."""
    rows = torch.arange(n_rows).repeat_interleave(n_cols)
    cols = torch.arange(n_cols).repeat(n_rows)
    crow = torch.arange(0, n_rows * n_cols + 1, n_cols)
    return Pattern((n_rows, n_cols), crow, cols, rows, torch.arange(n_rows * n_cols))


def without_zero_weights(base: Pattern, weight: torch.Tensor) -> Pattern:
    """``base`` minus the entries whose weight is exactly zero (a pruned layer: the pruning
    mask is fixed during retraining, so this pattern too is built once per mask). The
    sub-patterns are cached on ``base``, keyed by the mask's bytes."""
    nz = (weight.detach().flatten() != 0).cpu()
    key = nz.numpy().tobytes()
    if key not in base._pruned:
        if len(base._pruned) >= 8:
            base._pruned.clear()
        keep = nz[base.source]
        rows, cols, src = base.row[keep], base.col[keep], base.source[keep]
        crow = torch.zeros(base.shape[0] + 1, dtype=torch.long)
        crow[1:] = torch.bincount(rows, minlength=base.shape[0]).cumsum(0)
        base._pruned[key] = Pattern(base.shape, crow, cols, rows, src)  # still row-sorted
    return base._pruned[key]
