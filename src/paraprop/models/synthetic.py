"""Feedforward computations written as triangular systems, for demos, benchmarks and tests.

- :class:`LayerChain`: a deep MLP's forward pass as a recurrence over its layers (the states are
  the layer outputs; a Markov chain, the hardest case for Jacobi).
- :class:`MaskedAffineMap`: a MADE-shaped masked network (Germain et al. 2015 masks) used as the
  sampling map ``x_t = mu_t(x_<t) + exp(a_t(x_<t)) z_t`` with the noise ``z`` fixed up front
  (Song et al. 2021, §5.3.1), the structure of autoregressive sampling.

Both are callables ``fn(x)`` with an ``update(x, index)`` fast path that computes only the
positions ``index``, so the sequential solver costs what a forward pass or an ancestral sampler
costs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paraprop.models.masked import MaskedLinear, chunk_positions, made_masks


class LayerChain(nn.Module):
    """``s_l = tanh(W_l s_{l-1} + b_l)`` for ``l = 0 .. depth-1``, ``s_{-1} = u`` (the input).

    As a triangular system the state is ``x`` of shape ``(batch, depth, width)`` (``dim=-2``) and
    ``fn(x)[:, l] = tanh(W_l x[:, l-1] + b_l)``. Weights are drawn with standard deviation
    ``gain / sqrt(width)``; ``gain < 1`` makes every layer a contraction, so Jacobi's forward
    difference falls geometrically, as in a trained residual-free network with small weights.

    Arguments:
        depth: number of layers (positions ``T``).
        width: features per layer.
        gain: weight scale (see above).
        seed: seed of the weight generator.

    Example:
        >>> chain = LayerChain(depth=8, width=4).bind(torch.randn(2, 4))
        >>> x0 = torch.zeros(2, 8, 4)
        >>> ref = paraprop.solve(chain, x0, method="sequential", dim=-2)
        >>> sol = paraprop.solve(chain, x0, method="jacobi", dim=-2, tol=0)
        >>> torch.equal(sol.value, ref.value), sol.iterations <= 8
        (True, True)
    """

    def __init__(self, depth: int, width: int, *, gain: float = 0.5, seed: int = 0):
        super().__init__()
        if depth < 1 or width < 1:
            raise ValueError(f"depth and width must be >= 1, got depth={depth}, width={width}")
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(depth, width, width, generator=g) * gain
                                   / math.sqrt(width))
        self.bias = nn.Parameter(torch.randn(depth, width, generator=g) * 0.1)
        self.register_buffer("u", torch.zeros(1, width))

    def bind(self, u: torch.Tensor) -> LayerChain:
        """Set the network input ``u`` (batch, width); returns ``self``."""
        self.u = u
        return self

    @torch.no_grad()
    def forward_sequential(self, u: torch.Tensor) -> torch.Tensor:
        """The ordinary forward pass, layer by layer; returns all states (batch, depth, width)."""
        out, s = [], u
        for w, b in zip(self.weight, self.bias, strict=True):
            s = torch.tanh(s @ w.T + b)
            out.append(s)
        return torch.stack(out, dim=1)

    def _prev(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.u.expand(x.shape[0], -1)[:, None], x[:, :-1]], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # all layers from the previous iterate
        return _layers(self._prev(x), self.weight, self.bias)

    def update(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # the same batched product as forward, on the layers asked for: a plain matmul for one
        # layer rounds differently (float64 here), and update must be bitwise forward's values.
        # One layer is computed as a batch of two (the layer twice): torch may send a batch of
        # one to another kernel (it does on this CPU for some shapes).
        if index.numel() == 1:              # the sequential solver: one host read per step
            layer = int(index)
            prev = self.u.expand(x.shape[0], -1) if layer == 0 else x[:, layer - 1]
            pair = index.expand(2)
            out = _layers(prev[:, None].expand(-1, 2, -1), self.weight.index_select(0, pair),
                          self.bias.index_select(0, pair))
            return out[:, :1]
        below = x.index_select(1, (index - 1).clamp(min=0))       # only the rows asked for
        prev = torch.where((index == 0)[:, None], self.u[:, None], below)
        return _layers(prev, self.weight.index_select(0, index), self.bias.index_select(0, index))


def _layers(prev: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``tanh(W_l prev_l + b_l)`` for all layers at once: one batched matmul over the layers."""
    out = torch.baddbmm(b[:, None], prev.transpose(0, 1), w.transpose(1, 2))
    return torch.tanh_(out).transpose(0, 1).contiguous()


class MaskedAffineMap(nn.Module):
    """A MADE-shaped sampling map ``x = mu(x) + exp(a(x)) * z`` with fixed noise ``z``.

    ``mu`` and ``a`` come from one masked MLP (``features -> hidden... -> 2 features``, ReLU);
    ``a`` is squashed to ``[-scale_clip, scale_clip]`` so that random weights cannot overflow.
    ``bind(z)`` fixes the noise; the fixed point is the ancestral sample for that noise.

    Arguments:
        features: dimension ``D`` (positions ``T``).
        hidden: hidden layer widths.
        gain: scale of the output layer's weights (smaller = weaker dependence, faster Jacobi).
        scale_clip: bound on ``|a|``.
        seed: seed of the weight generator.

    Example:
        >>> fn = MaskedAffineMap(6, hidden=(16,)).bind(torch.randn(2, 6))   # the noise z
        >>> ref = paraprop.solve(fn, torch.zeros(2, 6), method="sequential")  # ancestral
        >>> sol = paraprop.solve(fn, torch.zeros(2, 6), method="jacobi", tol=0)
        >>> torch.equal(sol.value, ref.value)
        True
    """

    def __init__(self, features: int, hidden: tuple[int, ...] = (512, 512), *, gain: float = 1.0,
                 scale_clip: float = 1.0, seed: int = 0):
        super().__init__()
        masks = made_masks(features, hidden)
        sizes = [features, *hidden]
        g = torch.Generator().manual_seed(seed)
        self.hidden = nn.ModuleList(
            MaskedLinear(i, o, m) for i, o, m in zip(sizes, sizes[1:], masks, strict=False)
        )
        self.out = MaskedLinear(sizes[-1], 2 * features, torch.cat([masks[-1], masks[-1]]))
        with torch.no_grad():
            for layer in [*self.hidden, self.out]:
                fan_in = layer.mask.sum(1, keepdim=True).clamp(min=1)
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g)
                                   * (2.0 / fan_in).sqrt())
                layer.bias.zero_()
            self.out.weight.mul_(gain / math.sqrt(2.0))
        self.features = features
        self.scale_clip = scale_clip
        self.register_buffer("z", torch.zeros(1, features))

    def bind(self, z: torch.Tensor) -> MaskedAffineMap:
        """Fix the noise ``z`` (batch, features); returns ``self``."""
        self.z = z
        return self

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return h

    def _affine(self, mu, a, z):
        return mu + torch.exp(self.scale_clip * torch.tanh(a)) * z

    # The output layer is multiplied in fixed chunks of positions (paraprop.models.masked's
    # chunk_positions: at most 16, of at least 32 positions), by forward and by
    # update alike: a product over a subset of the output rows is another BLAS call, which may
    # round differently from the full product (it does here in float32 and float64), and update
    # must compute bitwise what forward computes (the solvers' protocol; paraprop.models.made
    # does the same).
    def _chunks(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The output weights and biases with each chunk's ``mu`` and ``a`` rows side by side
        (chunk ``c`` is rows ``[2 c s, 2 (c + 1) s)``), and the chunk size ``s``."""
        D = self.features
        s = chunk_positions(D)
        w_full, b_full = self.out.masked_weight(), self.out.bias
        if s == D:                  # one chunk: the rows are in that order already
            return w_full, b_full, s
        grad = torch.is_grad_enabled() and (w_full.requires_grad or b_full.requires_grad)
        key = (w_full, w_full._version, b_full._version, b_full.data_ptr())
        cached = getattr(self, "_chunk_cache", None)
        if not grad and cached is not None and cached[0][0] is key[0] \
                and cached[0][1:] == key[1:]:
            return cached[1]
        pos = torch.arange(D, device=self.out.bias.device)
        chunk, within = pos // s, pos % s
        lo = chunk * s
        n = torch.clamp(D - lo, max=s)                      # positions in each one's chunk
        mu_row = 2 * lo + within
        order = torch.empty(2 * D, dtype=torch.long, device=pos.device)
        order[mu_row] = pos
        order[mu_row + n] = pos + D
        out = (w_full.index_select(0, order), b_full.index_select(0, order), s)
        if not grad:                # reused until the weights change (the solvers call it
            self._chunk_cache = (key, out)  # once per evaluation)
        return out

    def _raw(self, h, w, b, s, c) -> tuple[torch.Tensor, torch.Tensor]:
        lo = c * s
        n = min(s, self.features - lo)
        out = nn.functional.linear(h, w[2 * lo : 2 * lo + 2 * n], b[2 * lo : 2 * lo + 2 * n])
        return out[..., :n], out[..., n:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._hidden(x)
        w, b, s = self._chunks()
        parts = [self._raw(h, w, b, s, c) for c in range(-(-self.features // s))]
        mu = torch.cat([p[0] for p in parts], dim=-1)
        a = torch.cat([p[1] for p in parts], dim=-1)
        return self._affine(mu, a, self.z)

    def update(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        h = self._hidden(x)
        w, b, s = self._chunks()
        positions = index.tolist()      # one host read per call: which chunks to compute
        chunks = sorted({p // s for p in positions})
        parts = {c: self._raw(h, w, b, s, c) for c in chunks}
        mu = torch.stack([parts[p // s][0][..., p % s] for p in positions], dim=-1)
        a = torch.stack([parts[p // s][1][..., p % s] for p in positions], dim=-1)
        return self._affine(mu, a, self.z.index_select(-1, index))
