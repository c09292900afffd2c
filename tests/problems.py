"""Shared reference problems: random autoregressive maps and an independent sequential loop."""

from __future__ import annotations

import math

import torch

# Tolerances of the exactness tests, per dtype (tol passed to solve, allowed |x - x_seq|).
TOLERANCES = {
    torch.float64: {"solve_tol": 1e-14, "max_err": 1e-12},
    torch.float32: {"solve_tol": 1e-7, "max_err": 1e-5},
}


class RandomTriangular:
    """``fn(x) = tanh(scale_b * (W * M) x + c)`` on the flattened positions and features.

    ``M`` lets position ``t`` read every feature of positions ``< t`` (``strict=True``), or also
    position ``t`` itself (``strict=False``: not triangular). ``scale`` (per sample, optional)
    makes some samples converge faster than others. With ``fast=True`` the object also has
    ``update(x, index)`` computing only the requested positions.
    """

    def __init__(self, batch_shape, pos_shape, feat_shape, dtype=torch.float64, *, seed=0,
                 gain=1.5, strict=True, scale=None):
        self.batch_shape, self.pos_shape = tuple(batch_shape), tuple(pos_shape)
        self.feat_shape = tuple(feat_shape)
        self.T, self.F = math.prod(pos_shape), math.prod(feat_shape)
        self.B = math.prod(batch_shape)
        self.shape = (*self.batch_shape, *self.pos_shape, *self.feat_shape)
        n = self.T * self.F
        g = torch.Generator().manual_seed(seed)
        pos = torch.arange(n) // self.F
        mask = (pos[:, None] > pos[None, :]) if strict else (pos[:, None] >= pos[None, :])
        self.W = (torch.randn(n, n, generator=g, dtype=torch.float64) * gain / math.sqrt(n + 1)
                  * mask).to(dtype)
        self.c = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        s = torch.ones(self.B) if scale is None else torch.as_tensor(scale)
        self.scale = s.to(dtype).reshape(self.B, 1)

    def _flat(self, x):
        return x.reshape(self.B, self.T * self.F)

    def __call__(self, x):
        y = torch.tanh(self.scale * (self._flat(x) @ self.W.T) + self.c)
        return y.reshape(x.shape)

    def x0(self, seed=1):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.shape, generator=g, dtype=self.W.dtype)

    def reference(self, x0):
        """Position by position, written independently of paraprop."""
        x = self._flat(x0.clone()).reshape(self.B, self.T, self.F)
        for t in range(self.T):
            x[:, t] = self(x.reshape(self.shape)).reshape(self.B, self.T, self.F)[:, t]
        return x.reshape(self.shape)


class FastTriangular(RandomTriangular):
    """The same map with the ``update(x, index)`` fast path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def update(self, x, index):
        self.calls.append(index.numel())
        rows = (index[:, None] * self.F + torch.arange(self.F)).reshape(-1)
        y = torch.tanh(self.scale * (self._flat(x) @ self.W[rows].T) + self.c[rows])
        return y.reshape(*self.batch_shape, index.numel(), *self.feat_shape)


class Windowed:
    """``prob`` with a ``window`` hook (and, with ``update=True``, an ``update`` hook) that
    compute ``prob``'s values bitwise: the honest hooks a solver may use."""

    def __init__(self, prob, *, update: bool = False):
        self.prob = prob
        if update:
            self.update = lambda x, index: self.prob(x).index_select(1, index)

    def __call__(self, x):
        return self.prob(x)

    def window(self, x, start, stop, cache):
        return self.prob(x)[:, start:stop], None
