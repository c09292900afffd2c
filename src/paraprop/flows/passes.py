"""The map a part's solve iterates (:class:`Passes`): one pass of the library's loop that proves,
from the passes themselves, which features are exact, keeps the solve within the library's count
of passes, and reports the NaN / inf the library's own loop computes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from paraprop.errors import NonFiniteError
from paraprop.flows.order import Order

_CONSTANTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
# the dtypes whose host bookkeeping runs on NumPy views (:meth:`Passes._learn_numpy`)
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)
_NUMPY_EQUAL = 4096   # values above which NumPy compares two host arrays faster than torch.equal


def _host(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a host tensor (the solve runs without a graph; detached if not)."""
    return (t.detach() if t.requires_grad else t).numpy()


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The 0-d ``0`` and ``-1`` (int64) on ``device``, made once (read only, never written)."""
    k = _CONSTANTS.get(device)
    if k is None:
        k = _CONSTANTS[device] = (torch.tensor(0, device=device), torch.tensor(-1, device=device))
    return k


class Stop(Exception):
    """Ends the solver's loop from inside a pass; :class:`Passes` keeps what it proved."""


class Passes:
    """The map the solve iterates: one pass of the library's loop in solve order, which proves
    from the passes themselves what is exact, and keeps the solve within the library's passes.

    The proof (triangular ``h``, finite ``x``): position ``k`` of ``h(x)`` reads only groups
    before its own. Let ``q`` be the first position where ``h(x)`` differs from ``x``: every
    group before ``q``'s is then exact in ``x`` (group 0 of ``h(x)`` reads nothing; a position
    of ``x`` equal to ``h(x)`` computed from exact groups is exact, and so on), so ``h(x)`` is
    exact on every group up to ``q``'s. Exact values are unique, so they are kept (``E``, the
    first ``P`` groups of each sample) whatever the solver does next.

    The budget: the solve may spend a pass only if, after it, the passes still needed in the
    worst case (one per group not yet exact, but for the last, which the final pass gives)
    keep the total within the library's ``budget``. A pass whose input agrees with the proven
    values on their whole prefix is sure to add a group, so Jacobi (whose passes are the
    library's) always runs; a solver whose passes may not add one is stopped where the budget
    would run out, and the library's own loop goes on from the proven values
    (:meth:`finish`): never more passes than the library's loop takes. As soon as every sample
    is exact but for its last group, the solve stops: the final pass gives the exact inverse,
    with no verifying pass (the proof above is the verification).

    Non-finite values: a NaN or inf that ``h`` computes from exact inputs is the sequential
    result's own (the library's loop computes it too); one computed, in the library's own pass
    (``x`` is bitwise the library's iterate: zeros, then each pass's output), from positions
    not final yet is met by the library's loop too, and spreads from there (``0 * inf`` and NaN
    reach every feature of a masked network). Both raise :class:`NonFiniteError` naming the
    part, the sample and the feature, for every method. Any other one comes from an iterate of
    another method that the library's loop never computes: the solver keeps its old value.
    """

    def __init__(self, h, plan: Order, *, budget: int, where: str, method: str):
        self.h, self.gid, self.G = h, plan.gid, plan.G
        self.budget, self.where, self.method, self.features = budget, where, method, plan.perm
        self.evals = 0
        self.budgeted = True
        self.stopped = "exact"   # why the solver was stopped: "exact" or "budget"
        self.fallback = 0        # passes of the library's loop after it (:meth:`finish`)
        self.p_min = 0           # host copy of P.min()
        # set by the first pass: the proven values, the groups proven per sample, whether each
        # sample's iterate has been the library's own so far, the last pass's output, x's shape
        self.E: torch.Tensor | None = None
        self.P: torch.Tensor | None = None
        self.chain: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.shape: torch.Size | None = None
        # built once per order, not per pass: the (1, D) rows of each position's group and of
        # the group after it, and the 0-d constants of the passes' operators (a Python number
        # there costs a tensor of its own at every operator)
        self.gid_row, self.next_row, self.k_G = plan.gid_row, plan.next_row, plan.k_G
        self.k_0, self.k_neg = _constants(plan.gid.device)
        # on the host a check is one reduction read as a Python number (no device to wait
        # for), and the bookkeeping of a dtype NumPy has runs on NumPy views of the same
        # arrays (:meth:`_learn_numpy`: an operator there costs a fraction of a torch one on
        # arrays this small); elsewhere the pass's facts travel in one transfer
        self.host = plan.gid.device.type == "cpu"
        self.rows_np = plan.host_rows
        self.E_np: np.ndarray | None = None   # NumPy views of E and P (host bookkeeping)
        self.P_np: np.ndarray | None = None
        # on the host, what the last pass proved about its own output y (see :meth:`_learn`):
        # y is finite, and the least proven prefix after a pass at x == y
        self.last_finite = False
        self.worst_same = 0

    def _need(self, p_min: int) -> int:
        """Passes still needed after this one (the final pass included), worst case."""
        return max(self.G - 1 - p_min, 0) + 1

    def _worst(self, xf: torch.Tensor) -> int:
        """The least proven prefix after a pass at ``xf``: a sample whose input agrees with its
        proven values on groups ``< P`` gets groups ``<= P`` exact (``min(P + 1, G)``); one
        whose input differs there gains nothing (a difference at group ``k < P`` proves groups
        ``<= k``, which it has)."""
        assert self.P is not None and self.E is not None   # set by the first pass
        known = self.gid_row < self.P[:, None]
        off = ((xf != self.E) & known).any(1)
        return min(int(torch.where(off, self.P, self.P + 1).amin()), self.G)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.reshape(-1, x.shape[-1])
        same = False   # x is bitwise the last pass's output (known on the host only)
        known = False  # the worst case after this pass is self.worst_same, x unseen
        if self.last is None:
            # no pass yet, nothing proven (P = 0): the pass proves group 0, whatever x holds
            known, self.worst_same = True, min(1, self.G)
            self.shape = x.shape
            self.E = torch.zeros_like(xf)
            self.P = torch.zeros(xf.shape[0], dtype=torch.long, device=xf.device)
            self.chain = (xf == 0).all(1)
            if self.host and self.rows_np is not None and xf.dtype in _NUMPY_DTYPES:
                self.E_np, self.P_np = self.E.numpy(), self.P.numpy()   # views: one state
        else:
            # on the host one comparison of the arrays (NumPy's, faster on large ones)
            if self.E_np is not None and xf.numel() > _NUMPY_EQUAL:
                same = bool((_host(xf) == self.last.numpy()).all())
            else:
                same = self.host and torch.equal(xf, self.last)
            known = same
            if not same:
                assert self.chain is not None   # set with last, by the first pass
                self.chain = self.chain & (xf == self.last).all(1)
        if self.budgeted and self.evals + 1 + self._need(self.p_min) > self.budget:
            # the budget is tight: the pass must add a group for every sample; at x == y of
            # the last pass a proven p_min + 1 settles it without looking at x again
            worst = self.worst_same if known and self.worst_same > self.p_min else \
                self._worst(xf)
            if self.evals + 1 + self._need(worst) > self.budget:
                self.stopped = "budget"
                raise Stop
        y = self.h(x)
        self.evals += 1
        if not self.budgeted:
            self.fallback += 1
        if self.E_np is not None:
            self._learn_numpy(xf, y.reshape(xf.shape), same)
        else:
            self._learn(xf, y.reshape(xf.shape), same)
        if self.budgeted and self.p_min >= self.G - 1:
            self.stopped = "exact"
            raise Stop
        return y

    def _learn(self, xf: torch.Tensor, yf: torch.Tensor, same: bool) -> None:
        # the triangular argument needs a finite input: x - x is 0 where x is finite and NaN
        # at NaN/inf, so one sum per row tells whether the row is finite. On the host: x equal
        # to the last output, which was finite, or one sum of x read as a number, clears every
        # row at once (an overflow of that sum only sends it to the per-row test)
        assert self.E is not None and self.P is not None   # set by the first pass
        if self.host and ((same and self.last_finite) or math.isfinite(float(xf.sum()))):
            fin = None
        else:
            fin = (xf - xf).sum(1) == self.k_0
        differ = xf != yf                      # NaN differs
        # h(x) is exact on the groups <= the first group where it differs from x (every group
        # if none): the groups below reach = min(that group + 1, G) (positions are sorted by
        # group, so the first differing position holds the least differing group)
        reach = torch.where(differ, self.next_row, self.k_G).amin(1)
        new = reach if fin is None else torch.where(fin, reach, self.k_0)
        self.E = torch.where(self.gid_row < new[:, None], yf, self.E)
        self.P = torch.maximum(self.P, new)
        self.last = yf.clone()
        if self.host:
            self.last_finite = math.isfinite(float(yf.sum()))
            if not self.last_finite:   # a NaN/inf in h(x), or a sum that overflowed
                self._non_finite(yf, fin, reach)
            # one reduction for p_min and the least proven prefix after a pass at x == y:
            # P_b + 1 where this pass proved at least all sample b had (new_b >= P_b: E equals
            # y on b's proven groups then), at least P_b elsewhere; key_b = 2 P_b + that bit
            v = int((self.P + self.P + (new >= self.P)).amin())
            self.p_min = v >> 1
            self.worst_same = min(self.p_min + (v & 1), self.G)
            return
        bad = (yf - yf).sum(1) != self.k_0    # rows with a NaN/inf
        if fin is not None:
            bad &= fin
        # the one synchronisation of the pass: P.min(), or -1 if a row has a non-finite value
        code = int(torch.where(bad, self.k_neg, self.P).amin())
        if code < 0:
            self._non_finite(yf, fin, reach)
            code = int(self.P.amin())
        self.p_min = code

    def _learn_numpy(self, xf: torch.Tensor, yf: torch.Tensor, same: bool) -> None:
        """:meth:`_learn` on the host, on NumPy views (``E`` and ``P`` updated in place): the
        same values. The first differing position of each row by one ``argmax`` of the
        comparison (NumPy stops at the first ``True``), the mask of the proven groups in the
        narrowest integer type; the finiteness sums by torch (vectorised)."""
        # set by the first pass (rows_np, with the order's plan, on the host)
        assert self.E_np is not None and self.P_np is not None and self.rows_np is not None
        xn, yn = _host(xf), _host(yf)
        gid_row, next_flat = self.rows_np
        if (same and self.last_finite) or math.isfinite(float(xf.sum())):
            fin = None
        else:
            fin = (xn - xn).sum(1) == 0
        differ = xn != yn
        first = differ.argmax(1)   # 0 where a row has no difference (and differ there is False)
        reach = np.where(differ[np.arange(differ.shape[0]), first], next_flat[first], self.G)
        new = reach if fin is None else np.where(fin, reach, 0)
        np.copyto(self.E_np, yn, where=gid_row < new.astype(gid_row.dtype)[:, None])
        P = self.P_np
        np.maximum(P, new, out=P)
        self.last = yf.clone()
        self.last_finite = math.isfinite(float(yf.sum()))
        if not self.last_finite:   # a NaN/inf in h(x), or a sum that overflowed
            self._non_finite(yf, None if fin is None else torch.from_numpy(fin),
                             torch.from_numpy(reach))
        v = int((P + P + (new >= P)).min())   # as in :meth:`_learn`
        self.p_min = v >> 1
        self.worst_same = min(self.p_min + (v & 1), self.G)

    def _non_finite(self, yf: torch.Tensor, fin: torch.Tensor | None,
                    reach: torch.Tensor) -> None:
        """A NaN/inf in ``h(x)`` from a finite ``x`` (``fin``: its finite rows, ``None``: all):
        :class:`NonFiniteError` where the library's loop computes it too; nothing where only
        another method's iterate led to it (the solver keeps its old values there)."""
        assert self.chain is not None and self.shape is not None   # set by the first pass
        bad = ~torch.isfinite(yf)
        if fin is not None:
            bad &= fin[:, None]
        exact = bad & (self.gid_row < reach[:, None])
        exactly = bool(exact.any())
        mask = exact if exactly else bad & self.chain[:, None]
        if not exactly and not bool(mask.any()):
            return   # only in other methods' iterates: the solver keeps the old values
        b, k = (int(i) for i in mask.nonzero()[0])
        feature = int(self.features[k]) if self.features is not None else k
        raise_non_finite(self.where, self.shape[:-1], b, feature, EXACT if exactly else (
            f"computed in pass {self.evals} of the library's own loop (method "
            f"{self.method!r} ran exactly its passes up to here) from features not final "
            "yet: the library's loop meets it too, and from there its result is not the "
            "exact inverse (0 * inf and NaN reach every feature of a masked network)"))

    def finish(self, cap: int | None) -> bool:
        """Passes of the library's loop from the proven values until every sample is exact but
        for its last group, within the budget and ``cap`` (total passes); ``False`` if ``cap``
        ended them first."""
        self.budgeted = False
        if self.E is None or self.shape is None:   # stopped before any pass (one group: the
            return True                            # final pass is all; both set by the first)
        while self.p_min < self.G - 1 and self.evals + 1 < self.budget:
            if cap is not None and self.evals >= cap:
                return False
            self(self.E.reshape(self.shape))
        return self.p_min >= self.G - 1

    def value(self, y: torch.Tensor) -> torch.Tensor:
        """The proven values, shaped like ``y`` (zeros where nothing was computed)."""
        return torch.zeros_like(y) if self.E is None else self.E.reshape(y.shape)


EXACT = ("computed from features that are final (the sequential result's own value): the "
         "library's own loop computes it too")


def raise_non_finite(where: str, batch, b: int, feature: int, how: str) -> None:
    """:class:`NonFiniteError` for sample ``b`` (flat over ``batch``) at ``feature``."""
    sample = tuple(int(i) for i in torch.unravel_index(torch.tensor(b), tuple(batch))) \
        if len(batch) != 1 else b
    part = f"the autoregressive part {where}" if where else "an autoregressive part"
    raise NonFiniteError(
        f"paraprop.flows: the inverse of {part} has a non-finite value (NaN or inf) at sample "
        f"{sample}, feature {feature}, {how}. paraprop does not return it: check the inputs and "
        "the weights (in bf16 / fp16 a larger dtype may not overflow), or run the library's "
        "own loop (undo() on the paraprop.flows.accelerate handle) for its value")


def check_finite(x: torch.Tensor, where: str) -> None:
    """The result of an inverse must be finite (:func:`raise_non_finite` otherwise): its last
    pass computes every feature from final ones."""
    v = x.detach()
    if math.isfinite(float(v.sum())):   # one reduction; an overflowing sum checks every value
        return
    bad = ~torch.isfinite(v)
    if not bool(bad.any()):
        return
    b, k = (int(i) for i in bad.reshape(-1, x.shape[-1]).nonzero()[0])
    raise_non_finite(where, x.shape[:-1], b, k, EXACT)
