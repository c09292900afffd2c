"""The modified Blelloch scan of BPPSA (Wang, Bai & Pekhimenko 2020, Algorithm 1).

Blelloch's work-efficient exclusive scan (Blelloch 1990, "Prefix sums and their applications")
in its in-place tree form: an up-sweep that leaves partial reductions at the right node of every
pair, the root set to the identity, and a down-sweep that hands every left child its parent's
prefix and every right child ``parent ⊕ left``. For a non-commutative operator (matrix products)
the down-sweep must keep that order, ``a[r] <- a[r] ⊕ a[l]``, the reverse of the textbook
``a[l] + a[r]`` (BPPSA). ``2 log2 T`` batched combines and ``2 (T - 1)`` combines in all.

Two practical changes:

- **Any length, no identity element.** The tree is laid out over ``2^ceil(log2 T)`` slots; slots
  past ``T`` and prefixes that start at position 0 are *empty*. Which slots are empty is known
  from the indices alone, so combines with an empty operand become copies or are skipped and the
  caller never has to supply an identity.
- **Level cap** (as in BPPSA): only ``levels`` tree levels run in parallel; the
  ``ceil(T / 2^levels)`` block reductions left at the top are scanned sequentially. Deep levels
  have fewer pairs than there are workers, so capping trades a few sequential steps for less
  latency; ``levels=0`` is the sequential scan, ``None`` the full tree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Leaves = list[torch.Tensor]


def _slots(x: torch.Tensor, dim: int, start: int, step: int, count: int) -> torch.Tensor:
    index = [slice(None)] * dim + [slice(start, start + step * (count - 1) + 1, step)]
    return x[tuple(index)]


def _assign(buf: Leaves, dim: int, start: int, step: int, count: int, vals: Leaves) -> None:
    index = tuple([slice(None)] * dim + [slice(start, start + step * (count - 1) + 1, step)])
    for b, v in zip(buf, vals, strict=True):
        b[index] = v


def exclusive(leaves: Leaves, combine: Callable[[Leaves, Leaves], Leaves], dim: int,
              levels: int | None = None) -> Leaves:
    """Exclusive scan along ``dim``: slot ``i >= 1`` holds ``x_0 ⊕ ... ⊕ x_{i-1}``.

    Slot 0 (the empty prefix) holds unspecified values; the caller fills it. Returns tensors of
    the input's shape.
    """
    n = leaves[0].shape[dim]
    depth = max(0, (n - 1).bit_length())  # ceil(log2 n)
    cap = depth if levels is None else min(levels, depth)
    size = 1 << depth
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in leaves)
    buf = []
    for x in leaves:
        shape = list(x.shape)
        shape[dim] = size
        b = x.new_zeros(shape)
        b.narrow(dim, 0, n).copy_(x)
        buf.append(b)

    def get(start: int, step: int, count: int) -> Leaves:
        vals = [_slots(b, dim, start, step, count) for b in buf]
        # under autograd, hand combine snapshots: the slots are overwritten later
        return [v.clone() for v in vals] if grad else vals

    def fresh(vals: Leaves) -> Leaves:
        # a combine that returns (a view of) an operand must not alias the buffer
        return [v.clone() if v.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                else v for v, b in zip(vals, buf, strict=True)]

    # Up-sweep. Pair k of level d is (l, r) = (k s + h - 1, k s + s - 1), s = 2^(d+1), h = 2^d;
    # r ends up holding the reduction of [k s, r]. Both halves are non-empty for k < kf; the
    # pair k = kf (if k s < n) has only a left half: r copies l.
    for d in range(cap):
        s, h = 2 << d, 1 << d
        kf = (n - h + s - 1) // s if n > h else 0
        if kf:
            _assign(buf, dim, s - 1, s, kf,
                    fresh(combine(get(h - 1, s, kf), get(s - 1, s, kf))))
        if kf * s < n:
            _assign(buf, dim, kf * s + s - 1, 1, 1, get(kf * s + h - 1, 1, 1))

    # Top of the tree: exclusive scan of the m block reductions, sequentially. Block 0's
    # prefix is empty (its slot is never read).
    S = 1 << cap
    m = (n + S - 1) // S
    if m > 1:
        running = get(S - 1, 1, 1)
        for k in range(1, m):
            slot = k * S + S - 1
            nxt = fresh(combine(running, get(slot, 1, 1))) if k + 1 < m else running
            _assign(buf, dim, slot, 1, 1, running)
            running = nxt

    # Down-sweep (operands reversed, BPPSA): left <- parent prefix, right <- parent ⊕ left.
    # For k = 0 the parent prefix is empty: right <- left, left stays empty.
    for d in range(cap - 1, -1, -1):
        s, h = 2 << d, 1 << d
        kf = (n - h + s - 1) // s if n > h else 0
        if kf >= 1:
            _assign(buf, dim, s - 1, 1, 1, get(h - 1, 1, 1))
        if kf >= 2:
            new_r = fresh(combine(get(2 * s - 1, s, kf - 1), get(s + h - 1, s, kf - 1)))
            _assign(buf, dim, s + h - 1, s, kf - 1, get(2 * s - 1, s, kf - 1))
            _assign(buf, dim, 2 * s - 1, s, kf - 1, new_r)
        if kf >= 1 and kf * s < n:
            _assign(buf, dim, kf * s + h - 1, 1, 1, get(kf * s + s - 1, 1, 1))
    return [b.narrow(dim, 0, n) for b in buf]


def scan(leaves: Leaves, combine: Callable[[Leaves, Leaves], Leaves], dim: int,
         levels: int | None = None) -> Leaves:
    """Inclusive scan along ``dim``: the exclusive scan combined with each element."""
    n = leaves[0].shape[dim]
    if n == 1:
        return list(leaves)
    ex = exclusive(leaves, combine, dim, levels)
    tail = combine([e.narrow(dim, 1, n - 1) for e in ex], [x.narrow(dim, 1, n - 1)
                                                          for x in leaves])
    return [torch.cat([x.narrow(dim, 0, 1), t], dim) for x, t in zip(leaves, tail, strict=True)]
