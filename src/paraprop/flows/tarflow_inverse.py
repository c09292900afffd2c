"""TarFlow's block inverse: one flow block of :class:`paraprop.models.TarFlow` inverted as a
triangular system along its patches, for :func:`paraprop.solve` (the model's
:meth:`~paraprop.models.TarFlow.sampling_map` returns one).

The inverse of one block is ``x_t = z_t exp(alpha_t(x_<t)) + mu_t(x_<t)``. :class:`BlockInverse`
is its map ``fn`` with the cached-prefix protocol (``window``): it runs the block's transformer
one chunk of about :data:`CHUNK` positions after the other from cached keys and values, with the
same operations on tensors of the same shapes for a chunk whether the call is a full pass or a
window; so a window is bitwise the full pass's values, and ``tol=0`` gives the same bits with
every method. :func:`sequential_cached` is the usual loop instead, one patch per transformer
call with keys and values cached. The flow libraries' autoregressive inverses (zuko, nflows,
normflows) are in :mod:`paraprop.flows.inverse`; these are the ones of the library's own TarFlow
(the stack of blocks: :mod:`paraprop.flows.tarflow_sampling`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.nn import functional as F

from paraprop import checks

__all__ = ["CHUNK", "BlockInverse", "default_chunk", "sequential_cached"]

CHUNK = 8  # about this many positions per batched product of the sampling maps


class TarFlowLayer(Protocol):
    """What the inverses read of one transformer layer of a TarFlow block (pre-norm causal
    self-attention, then an MLP)."""

    ln1: nn.LayerNorm
    qkv: nn.Linear
    proj: nn.Linear

    def mlp(self, h: torch.Tensor) -> torch.Tensor: ...


class TarFlowBlock(Protocol):
    """What the inverses read of one flow block of :class:`paraprop.models.TarFlow`: ``T``
    patches of ``P`` values, the input projection and positions, the layers, the final norm and
    the output projection to ``(mu, alpha)``. (Typed here, not imported: :mod:`paraprop.flows`
    does not import the models; a block arrives as the ``nn.Module`` that
    ``TarFlow.blocks[k]`` is, and is read through this protocol.)"""

    T: int
    P: int
    heads: int
    inp: nn.Linear
    pos: torch.Tensor
    layers: Sequence[TarFlowLayer]
    norm: nn.LayerNorm
    out: nn.Linear


def default_chunk(T: int) -> int:
    """About :data:`CHUNK` positions per chunk, with as little padding as possible: ``T``
    split into ``ceil(T / CHUNK)`` chunks of equal size (``T=49``: 7 chunks of 7)."""
    return -(-T // -(-T // CHUNK))


class BlockInverse:
    """The inverse of one flow block as the triangular system ``x = fn(x)`` along the patches:
    ``fn(x)_t = z_t exp(alpha_t(x_<t)) + mu_t(x_<t)``, for :func:`paraprop.solve` with
    ``dim=-2`` on ``x`` ``(N, T, P)``.

    ``fn(x)`` is one causal pass over all patches. ``window(x, start, stop, cache)`` computes the
    patches ``[start, stop)`` from the keys and values of the earlier positions held in
    ``cache`` (the cached-prefix protocol of
    :meth:`paraprop.solvers.triangular.System.window`: the driver promises the patches
    ``< start`` are final). The cache remembers how many chunks it
    holds; whatever it lacks (a fresh cache, a start that moved back, another batch shape) is
    recomputed, never trusted.

    The transformer runs on the positions ``u = 0 .. T-1``, where position ``u`` reads patch
    ``u - 1`` and gives the parameters of patch ``u`` (position 0 is a placeholder no other
    position attends to: patch 0 has ``mu = alpha = 0``), one chunk of ``chunk`` positions
    after the other (default :func:`default_chunk`), each from the cached keys and values of the
    chunks before it. A full pass and a window run the same operations on tensors of the same
    shapes and layouts for every chunk, so a window is bitwise the full pass's values (no
    reliance on a kernel rounding a row the same way in products of different sizes); a window
    of whole chunks (``GSJacobi(block_size=chunk)``) computes nothing else. ``calls`` counts
    the transformer passes (full or windowed), ``chunks`` the chunks they computed.

    Arguments:
        block: one flow block of a :class:`paraprop.models.TarFlow` (``model.blocks[k]``).
        z: the block's output ``(N, T, P)``, patches in the block's own order.
        chunk: positions per chunk (``None``: :func:`default_chunk`).
    """

    def __init__(self, block: nn.Module, z: torch.Tensor, chunk: int | None = None):
        blk = cast(TarFlowBlock, block)   # nn.Module's attributes are untyped: see the protocol
        self.T, self.P = blk.T, blk.P
        chunk = default_chunk(self.T) if chunk is None else checks.positive_int("chunk", chunk)
        self.block, self.z, self.c = blk, z, chunk
        self.L = -(-self.T // chunk) * chunk      # positions padded to whole chunks
        self.x0 = torch.zeros_like(z)
        self.dim = -2
        self.calls = self.chunks = 0
        with torch.no_grad():
            self.pos = F.pad(blk.pos.detach(), (0, 0, 1, self.L - self.T))
        # within a chunk, key r' > query r is masked
        self.future = torch.ones(chunk, chunk, dtype=torch.bool, device=z.device).triu(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.window(x, 0, self.T, None)[0]

    def _fresh(self, x: torch.Tensor) -> dict[str, Any]:
        B, d, H = x.shape[0], self.block.inp.out_features, self.block.heads
        n = len(self.block.layers)
        return {"chunks": 0, "shape": tuple(x.shape), "dtype": x.dtype, "device": x.device,
                "k": [x.new_zeros(B * H, d // H, self.L) for _ in range(n)],   # keys, transposed
                "v": [x.new_zeros(B * H, self.L, d // H) for _ in range(n)]}

    def window(self, x: torch.Tensor, start: int, stop: int, cache: dict[str, Any] | None
               ) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(values, cache)``: ``fn(x)`` at the patches ``[start, stop)`` ``(N, stop - start,
        P)``, given that the patches ``< start`` are final."""
        if not (isinstance(cache, dict) and cache.get("shape") == tuple(x.shape)
                and cache.get("dtype") == x.dtype and cache.get("device") == x.device):
            cache = self._fresh(x)
        c = self.c
        final = (start + 1) // c  # chunks whose positions read final patches only
        have = min(cache["chunks"], final)
        first, last = start // c, -(-stop // c)
        vals = [self._chunk(x, j, cache) for j in range(min(have, first), last)]
        cache["chunks"] = max(have, min(last, final))
        self.calls += 1
        out = torch.cat(vals[first - min(have, first):], dim=1)
        return out[:, start - first * c : stop - first * c], cache

    def _chunk(self, x: torch.Tensor, j: int, cache: dict[str, Any]) -> torch.Tensor:
        """``fn(x)`` at the patches of chunk ``j`` (those below ``T``), from the keys and values
        of the chunks ``< j`` in ``cache``; its own keys and values go to ``cache``."""
        blk, c, P, T = self.block, self.c, self.P, self.T
        B, d, H = x.shape[0], blk.inp.out_features, blk.heads
        self.chunks += 1
        dh = d // H
        u0, u1 = j * c, (j + 1) * c
        inp = x.new_zeros(B, c, P)  # position u reads patch u - 1 (position 0: zeros)
        lo, hi = max(u0, 1), min(u1, T)
        inp[:, lo - u0 : hi - u0] = x[:, lo - 1 : hi - 1]
        h = blk.inp(inp) + self.pos[u0:u1]
        for layer, K, V in zip(blk.layers, cache["k"], cache["v"], strict=True):
            qkv = layer.qkv(layer.ln1(h)).view(B, c, 3, H, dh)
            q = (qkv[:, :, 0].transpose(1, 2) * (1.0 / math.sqrt(dh))).reshape(B * H, c, dh)
            K.view(B, H, dh, self.L)[..., u0:u1] = qkv[:, :, 1].permute(0, 2, 3, 1)
            V.view(B, H, self.L, dh)[:, :, u0:u1] = qkv[:, :, 2].transpose(1, 2)
            s = torch.bmm(q, K[:, :, :u1])
            s[:, :, u0:].masked_fill_(self.future, -math.inf)
            s[:, 1 if j == 0 else 0 :, 0] = -math.inf  # nobody but itself reads position 0
            o = torch.bmm(torch.softmax(s, dim=-1), V[:, :u1])
            h = h + layer.proj(o.view(B, H, c, dh).transpose(1, 2).reshape(B, c, d))
            h = h + layer.mlp(h)
        raw = blk.out(blk.norm(h))[:, : hi - u0]
        if j == 0:
            raw[:, 0] = 0  # patch 0: mu = alpha = 0
        return self.z[:, u0:hi] * torch.exp(raw[..., P:]) + raw[..., :P]


def sequential_cached(block: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """The usual sequential inverse of one block, what ``method="sequential_cached"`` runs: patch
    ``t`` from one transformer call on patch ``t - 1`` with the keys and values of the earlier
    patches cached (``T - 1`` calls). Exact up to rounding, not bitwise :class:`BlockInverse`'s
    fixed point: its one-patch products round differently from a chunk's.

    Arguments:
        block: one flow block of a :class:`paraprop.models.TarFlow` (``model.blocks[k]``).
        z: its output ``(N, T, P)`` in the block's order.

    Returns:
        ``x`` ``(N, T, P)`` with ``block(x)[0] == z`` up to rounding.
    """
    blk = cast(TarFlowBlock, block)   # nn.Module's attributes are untyped: see the protocol
    B, T, P = z.shape
    d, H = blk.inp.out_features, blk.heads
    dh = d // H
    x = torch.empty_like(z)
    x[:, 0] = z[:, 0]
    keys = [z.new_empty(B, H, T - 1, dh) for _ in blk.layers]
    values = [z.new_empty(B, H, T - 1, dh) for _ in blk.layers]
    for t in range(T - 1):
        h = blk.inp(x[:, t]) + blk.pos[t]                         # (B, d)
        for layer, K, V in zip(blk.layers, keys, values, strict=True):
            q, k, v = layer.qkv(layer.ln1(h)).view(B, 3, H, dh).unbind(1)
            K[:, :, t], V[:, :, t] = k, v
            a = F.scaled_dot_product_attention(q[:, :, None], K[:, :, : t + 1],
                                               V[:, :, : t + 1])
            h = h + layer.proj(a.reshape(B, d))
            h = h + layer.mlp(h)
        mu, alpha = blk.out(blk.norm(h)).chunk(2, dim=-1)
        x[:, t + 1] = z[:, t + 1] * torch.exp(alpha) + mu
    return x
