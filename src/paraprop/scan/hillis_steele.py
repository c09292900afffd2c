"""The Hillis-Steele scan (Hillis & Steele 1986, "Data parallel algorithms"; Kogge-Stone).

``ceil(log2 T)`` rounds; round ``k`` combines every element with the one ``2^k`` places before it,
all at once. Depth ``log2 T`` but ``O(T log T)`` combines: the fewest dependent steps of all
algorithms, the most work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Leaves = list[torch.Tensor]


def scan(leaves: Leaves, combine: Callable[[Leaves, Leaves], Leaves], dim: int) -> Leaves:
    """Inclusive scan along ``dim``, in ``ceil(log2 n)`` batched combines."""
    # Invariant after the round with offset `off`: y_i is the combination of x_{max(0,i-2off+1)}
    # .. x_i. The round combines y_{i-off} (earlier) with y_i for every i >= off in one call;
    # the first `off` entries are already complete and are kept.
    n = leaves[0].shape[dim]
    ys = leaves
    off = 1
    while off < n:
        earlier = [y.narrow(dim, 0, n - off) for y in ys]
        later = [y.narrow(dim, off, n - off) for y in ys]
        new = combine(earlier, later)
        ys = [torch.cat([y.narrow(dim, 0, off), c], dim) for y, c in zip(ys, new, strict=True)]
        off *= 2
    return ys
