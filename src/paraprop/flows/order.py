"""A transform's feature order as the solve of a part uses it: the permutation to solve order,
the groups of features that do not read each other, planned once per distinct order and device.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import torch


def _groups(keys: torch.Tensor) -> torch.Tensor:
    """The group of each position from its nondecreasing ``keys`` (equal keys: one group)."""
    if keys.numel() == 0:
        return keys.to(torch.long)
    step = (keys[1:] != keys[:-1]).to(torch.long)
    return torch.cat([torch.zeros(1, dtype=torch.long, device=keys.device), step.cumsum(0)])


@dataclasses.dataclass(frozen=True)
class Order:
    """A transform's feature order as the solve uses it (:func:`order_plan`; read only)."""

    perm: torch.Tensor | None   # position k of the solve is feature perm[k] (None: natural)
    inv: torch.Tensor | None    # its inverse permutation
    gid: torch.Tensor           # the group of each position of the solve
    G: int                      # the number of groups
    gid_row: torch.Tensor       # (1, D): gid, and gid + 1, as rows against (N, D) passes
    next_row: torch.Tensor
    k_G: torch.Tensor           # 0-d G
    # on the host, NumPy: gid as a (1, D) row of the narrowest integer type that holds it, and
    # gid + 1 (D,) int64
    host_rows: tuple[np.ndarray, np.ndarray] | None


_ORDERS: dict[tuple, Order] = {}
_BY_TENSOR: dict[int, tuple] = {}   # id -> (weak reference, version, device, D, plan)
_ORDERS_MAX = 256


def order_plan(order: torch.Tensor | None, D: int, device: torch.device) -> Order:
    """The permutation and groups of ``order`` (the rank of each of the ``D`` features;
    ``None``: natural order) on ``device``: computed once per distinct order and device, not
    at every inverse (a transform's order is fixed; the key is its values, not its identity,
    so a modified or rebuilt order gets its own)."""
    device = torch.device(device)
    if order is None:
        key: tuple = (device, D)
    else:
        # the same tensor as last time, not modified in place since (its version counter):
        # the plan of its values then, without reading them again
        # (an inference tensor has no version counter: its values are read every time)
        seen = None if order.is_inference() else _BY_TENSOR.get(id(order))
        if seen is not None and seen[0]() is order and seen[1] == order._version and \
                seen[2] == device and seen[3] == D:
            return seen[4]
        o = order.detach()
        key = (device, D, o.dtype, tuple(o.shape),
               o.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    plan = _ORDERS.get(key)
    if plan is None:
        plan = _make_order(order, D, device)
        if len(_ORDERS) >= _ORDERS_MAX:
            _ORDERS.clear()
        _ORDERS[key] = plan
    if order is not None and not order.is_inference():
        if len(_BY_TENSOR) >= _ORDERS_MAX:
            _BY_TENSOR.clear()
        _BY_TENSOR[id(order)] = (weakref.ref(order), order._version, device, D, plan)
    return plan


def _make_order(order, D: int, device: torch.device) -> Order:
    if order is None:
        keys, perm = torch.arange(D, device=device), None
    else:
        order = order.to(device)
        perm = torch.argsort(order, stable=True)   # position k of the solve is feature perm[k]
        keys = order.index_select(0, perm)
        if torch.equal(perm, torch.arange(D, device=device)):   # already in order
            perm = None
    gid = _groups(keys)
    G = int(gid[-1]) + 1 if gid.numel() else 0
    gid_row = gid[None, :]
    next_row = gid_row + 1
    host = None
    if device.type == "cpu":
        narrow = np.int16 if G < np.iinfo(np.int16).max else np.int32
        host = (gid_row.numpy().astype(narrow), next_row.numpy()[0])
    return Order(perm=perm, inv=None if perm is None else torch.argsort(perm), gid=gid, G=G,
                 gid_row=gid_row, next_row=next_row, k_G=torch.tensor(G, device=device),
                 host_rows=host)
