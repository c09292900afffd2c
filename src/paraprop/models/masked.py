"""MADE masks (Germain et al. 2015, "MADE: Masked Autoencoder for Distribution Estimation") and the
masked linear layer they multiply."""

from __future__ import annotations

import torch
from torch import nn

# A MADE-shaped sampling map multiplies its output layer in fixed chunks of positions, the full
# map and its `update` alike, so that `update` is bitwise the full map (a product over a subset of
# the output rows is another BLAS call, which may round differently from the full product).
OUT_CHUNKS = 16  # at most this many chunks
MIN_CHUNK = 32   # of at least this many positions (one chunk below that)


def chunk_positions(features: int) -> int:
    """Positions per chunk of a sampling map's output layer: ``features`` in at most
    :data:`OUT_CHUNKS` chunks of at least :data:`MIN_CHUNK` positions (one product per chunk:
    small chunks would cost a kernel call each for little work)."""
    return max(-(-features // OUT_CHUNKS), min(features, MIN_CHUNK))


def made_degrees(features: int, hidden: tuple[int, ...],
                 order: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Degrees of the MADE units (Germain et al. 2015): inputs get their order ``1..D``, hidden
    units a degree in ``[1, D-1]`` (cycled, deterministic), so output ``d`` sees inputs ``< d``.

    Example:
        >>> [d.tolist() for d in made_degrees(3, (4,))]
        [[1, 2, 3], [1, 2, 1, 2]]
    """
    if order is None:
        order = torch.arange(1, features + 1)
    degrees = [order]
    for h in hidden:
        degrees.append(torch.arange(h) % max(features - 1, 1) + 1)
    return degrees


def made_masks(features: int, hidden: tuple[int, ...],
               order: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Masks (out, in) of every layer of a MADE; the last one is strictly autoregressive.

    Example:
        >>> hidden_mask, out_mask = made_masks(3, (4,))
        >>> out_mask          # output d sees the hidden units of degree < d
        tensor([[0., 0., 0., 0.],
                [1., 0., 1., 0.],
                [1., 1., 1., 1.]])
    """
    deg = made_degrees(features, hidden, order=order)
    masks = [(d_out[:, None] >= d_in[None, :]).float() for d_in, d_out in zip(deg, deg[1:],
                                                                              strict=False)]
    masks.append((deg[0][:, None] > deg[-1][None, :]).float())
    return masks


class MaskedLinear(nn.Linear):
    """``nn.Linear`` whose weight is multiplied by a fixed 0/1 mask (out, in).

    Outside autograd (sampling, evaluation) the masked weight is computed once and reused until
    the weight or the mask changes (tracked by their version counters and storage), so an
    iterative sampler does not redo ``weight * mask`` at every network evaluation.

    Example:
        >>> layer = MaskedLinear(3, 2, torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
        >>> x = torch.randn(4, 3)
        >>> torch.equal(layer(x), F.linear(x, layer.weight * layer.mask, layer.bias))
        True
    """

    mask: torch.Tensor  # a registered buffer

    def __init__(self, in_features: int, out_features: int, mask: torch.Tensor):
        super().__init__(in_features, out_features)
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (out_features, in_features):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask must have shape (out_features, in_features) = "
                             f"({out_features}, {in_features}), got {got}")
        self.register_buffer("mask", mask)
        self._cache: tuple | None = None

    def masked_weight(self) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return self.weight * self.mask
        key = (self.weight._version, self.weight.data_ptr(), self.mask._version,
               self.mask.data_ptr(), self.weight.dtype, self.weight.device)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self._cache = (key, self.weight * self.mask)
        return self._cache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.masked_weight(), self.bias)
