"""The part shared by every flow library: one autoregressive transform inverted by
:func:`paraprop.solve`, with exact gradients, and the argument checks.

A masked autoregressive transform ``y = f(x)`` is inverted by the libraries with passes
``x <- h(x) := f_x^{-1}(y)`` from zeros. ``h`` is triangular (position ``i`` of ``h(x)`` reads
only the positions before ``i`` in the transform's order), so its fixed point is unique and
Jacobi reaches it after at most ``D`` passes (Song et al. 2021, §3, Proposition 1); stopping at
the bitwise fixed point (``tol=0``) returns exactly what the library's loop returns. The solve
never takes more passes than the library's loop (:class:`Passes` proves from the passes which
features are exact, stops the solver when the final pass will give the inverse, or when its
next pass could exceed the library's count, and then runs the library's loop from the
features proven exact).

Gradients: the libraries differentiate through all their passes. paraprop solves without a
graph and attaches the gradient of the fixed point by implicit differentiation instead
(``x* = h(x*; y, θ)`` gives ``dx* = (I - N)^{-1} ∂h``, ``N = ∂h/∂x`` strictly triangular): the
final pass ``h(x*)``, differentiable (the same value, bitwise), whose incoming gradient ``v`` a
hook replaces by ``u = (I - N)^{-T} v``, found by the iteration ``u <- v + N^T u`` (exact after
``groups - 1`` steps, or earlier at its bitwise fixed point). nflows / normflows return
log|det J| with the inverse: their final pass hooks the conditionals' parameters instead
(:func:`_made_pass`), one network evaluation for both.
First-order gradients only: the hook's products are not themselves differentiated, and under
``create_graph=True`` they carry a node that refuses a second differentiation
(:func:`paraprop.first_order.refuse_second_order`) rather than give a wrong second derivative.
That node hangs from the incoming gradient *and* from the differentiable pass itself, so every
second differentiation reaches it: with respect to the flow's parameters, the inverted points or
the context, whether or not the incoming gradient depends on them.

Every entry point refuses an autoregressive network in train mode with dropout or another
stochastic layer (:func:`require_deterministic_parts`): its passes would differ from call to
call, so there is no fixed point, and the library's own loop returns a different value each time.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn

from paraprop import checks
from paraprop.checks import check_max_iters, check_tol
from paraprop.determinism import refuse_random_draws, require_deterministic
from paraprop.driver import Outcome, build
from paraprop.errors import ConvergenceError, NonFiniteError, StochasticModelError
from paraprop.first_order import refuse_second_order
from paraprop.result import Result, Solution
from paraprop.solve import solve
from paraprop.solvers import METHODS, NEWTON_METHODS, make_solver

# the triangular (non-Markov) methods: Newton's family needs a Markov system
FLOW_METHODS = tuple(m for m in METHODS if m not in NEWTON_METHODS)


@dataclasses.dataclass
class Settings:
    """How each autoregressive transform is inverted (validated by :func:`settings`)."""

    solver: object
    tol: float
    max_iters: int | None
    throw: bool


def settings(method, tol, max_iters, throw) -> Settings:
    """Validate the shared arguments once, at an entry point."""
    solver = make_solver(method, names=FLOW_METHODS)
    check_tol(tol)
    check_max_iters(max_iters)
    checks.boolean("throw", throw)
    return Settings(solver, tol, max_iters, throw)


def invert_part(h: Callable[[torch.Tensor], torch.Tensor], y: torch.Tensor,
                order: torch.Tensor | None, cfg: Settings,
                record: Callable[[Solution], None], *, passes: int,
                where: str = "") -> torch.Tensor:
    """The fixed point of ``x = h(x)`` (``h`` triangular in ``order``), differentiable, in at
    most ``passes`` evaluations of ``h`` (the library's own loop: every pass counted, the
    differentiable one included).

    Arguments:
        h: one pass of the library's inverse loop, ``x -> f_x^{-1}(y)``.
        y: the point being inverted (its shape is the shape of ``x``; the last dim is the
            features).
        order: the rank of each feature in the transform's order (``None``: natural order);
            features of equal rank form one group (they do not read each other).
        cfg: the solver settings.
        record: called with the :class:`Solution` of the inverse (``evaluations``: every pass).
        passes: the passes of the library's own loop: the budget.
        where: the part, for messages.
    """
    grad = torch.is_grad_enabled()
    with refuse_random(where, y.device):
        with torch.no_grad():
            run = tracked_solve(h, y, order, cfg, passes=passes, where=where)
        extra = 1
        if grad:
            x = _implicit(h, run.x, run.groups)
        elif run.complete or run.sol is not None:   # exact already, or the solver's own value
            x, extra = run.x, 0
        else:                                       # exact but for the last group: one pass
            x = h(run.x)
    check_finite(x, where)
    record(run.solution(x.detach(), extra))
    return x


def refuse_random(where: str, device: torch.device):
    """Around an inverse: an autoregressive network that draws random numbers (a
    ``torch.randn_like`` in its ``forward``, which no list of stochastic layers knows) moves the
    device's global generator; that raises :class:`StochasticModelError` naming the part (its
    passes differ from call to call: there is no inverse to reproduce)."""
    part = f"the autoregressive part {where}" if where else "an autoregressive part"
    return refuse_random_draws(device, (
        f"paraprop.flows: the network of {part} drew random numbers during the inverse "
        f"(torch's global generator on {device} moved: torch.randn_like, dropout, ...): its "
        "passes differ from call to call, so neither the library's loop nor paraprop has an "
        "inverse to reproduce (expected a network that is a fixed function of its input). "
        "Call flow.eval() if it draws only in training mode, or remove the random "
        "operation; undo() on the paraprop.flows.accelerate handle runs the library's own "
        "loop"))


@dataclasses.dataclass
class Run:
    """What :func:`tracked_solve` found: ``x`` (feature order, no graph) is either the solver's
    own value (``sol`` set: it stopped by its own rule) or values proven exact on every group
    but possibly the last (``sol`` ``None``; ``complete``: on every group), so that one more
    pass gives the exact inverse."""

    x: torch.Tensor
    sol: Solution | None
    complete: bool
    exact: bool          # one more pass at x is the exact inverse (or x is)
    groups: int
    evaluations: int
    budget: int
    method: str
    D: int
    why: str             # how it ended, for stats["finished_by"]
    time_s: float
    cap: int | None = None
    fallback: int = 0    # passes of the library's loop after the budget stopped the solver

    def solution(self, value: torch.Tensor, extra: int) -> Solution:
        """The part's Solution, ``value`` its result, ``extra`` the passes run after the solve
        (the final or differentiable pass)."""
        total = self.evaluations + extra
        common = {"sequential_steps": total, "library_passes": self.budget,
                  "groups": self.groups, "finished_by": self.why,
                  "fallback_passes": self.fallback}
        if self.sol is not None:
            return dataclasses.replace(self.sol, value=value, evaluations=total,
                                       stats={**self.sol.stats, **common})
        common.pop("sequential_steps")
        out = Outcome(
            value, Result.successful if self.exact else Result.max_iters_reached,
            evaluations=total, positions=total * self.D, sequential_steps=total,
            bound=self.groups, error_estimate=0.0 if self.exact else float("inf"),
            stats={"T": self.D, "verification": "exact prefix" if self.exact else "none",
                   **common},
            reason=None if self.exact else (f"max_iters={self.cap} ended the passes before "
                                            "every feature was proven exact"))
        return build(self.method, out, iterations=self.evaluations, time_s=self.time_s)


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
    host_rows: tuple | None     # on the host, NumPy: gid as a (1, D) row of the narrowest
    #                             integer type that holds it, and gid + 1 (D,) int64


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
        seen = _BY_TENSOR.get(id(order))
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
    if order is not None:
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


def tracked_solve(h, y, order, cfg, *, passes: int, where: str = "") -> Run:
    """Solve ``x = h(x)`` from zeros, positions sorted by ``order``, in at most ``passes``
    evaluations of ``h`` together with the one pass that follows (see :class:`Passes`)."""
    start = time.perf_counter()
    D = y.shape[-1]
    plan = order_plan(order, D, y.device)
    perm, inv = plan.perm, plan.inv
    fn = h
    if perm is not None:
        def fn(xp):
            return h(xp.index_select(-1, inv)).index_select(-1, perm)

    tracker = Passes(fn, plan, budget=passes, where=where, method=cfg.solver.name)
    sol = None
    if y.numel():
        try:
            sol = solve(tracker, torch.zeros_like(y), method=cfg.solver, tol=cfg.tol,
                        max_iters=cfg.max_iters, throw=cfg.throw)
        except _Stop:
            pass
    if sol is None:
        exact = tracker.finish(cfg.max_iters)
        x, complete = tracker.value(y), tracker.p_min >= tracker.G
        why = ("max_iters" if not exact else
               f"budget: the {cfg.solver.name} passes could have exceeded the library's "
               f"{passes}; {tracker.fallback} passes of the library's own loop went on from the "
               "features proven exact" if tracker.stopped == "budget" else
               "exact prefix: every feature proven exact but for the last group, which the "
               "final pass computes")
        if not exact and cfg.throw:
            raise ConvergenceError(
                f"paraprop.flows: the inverse of {where or 'an autoregressive part'} did not "
                f"converge within max_iters={cfg.max_iters} passes (the library's loop takes "
                f"{passes}); pass max_iters=None, or throw=False for the unconverged value")
    else:
        x, exact, complete, why = sol.value, sol.converged, False, "solver"
    if inv is not None:
        x = x.index_select(-1, inv)
    return Run(x=x, sol=sol, complete=complete, exact=exact, groups=tracker.G,
               evaluations=tracker.evals, budget=passes, method=cfg.solver.name, D=D, why=why,
               time_s=time.perf_counter() - start, cap=cfg.max_iters,
               fallback=tracker.fallback)


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


class _Stop(Exception):
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
        self.E = self.P = self.chain = self.last = self.shape = None
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
        self.E_np = self.P_np = None
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
                self.chain = self.chain & (xf == self.last).all(1)
        if self.budgeted and self.evals + 1 + self._need(self.p_min) > self.budget:
            # the budget is tight: the pass must add a group for every sample; at x == y of
            # the last pass a proven p_min + 1 settles it without looking at x again
            worst = self.worst_same if known and self.worst_same > self.p_min else \
                self._worst(xf)
            if self.evals + 1 + self._need(worst) > self.budget:
                self.stopped = "budget"
                raise _Stop
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
            raise _Stop
        return y

    def _learn(self, xf: torch.Tensor, yf: torch.Tensor, same: bool) -> None:
        # the triangular argument needs a finite input: x - x is 0 where x is finite and NaN
        # at NaN/inf, so one sum per row tells whether the row is finite. On the host: x equal
        # to the last output, which was finite, or one sum of x read as a number, clears every
        # row at once (an overflow of that sum only sends it to the per-row test)
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
        if self.E is None:   # stopped before any pass (one group: the final pass is all)
            return True
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


SECOND_ORDER = (
    "paraprop.flows computes the gradients of an inverse by implicit differentiation, first "
    "order only: differentiating them again (double backward, create_graph=True followed by "
    "another backward or grad, gradient penalties, hessians) is not supported; for that, run "
    "the library's own inverse: call undo() on the paraprop.flows.accelerate handle (or use "
    "the flow outside its `with` block), or call the library instead of parallel_inverse")


def _implicit(h, x_star: torch.Tensor, groups: int) -> torch.Tensor:
    """``h(x_star)`` (bitwise the inverse when ``x_star`` is exact on every group but the
    last) carrying the gradient of the fixed point: the gradient arriving at it is replaced by
    ``(I - N)^{-T} v``, ``N = ∂h/∂x``."""
    out = h(x_star)
    if not out.requires_grad:   # nothing upstream needs a gradient
        return out

    def adjoint(v: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x0 = x_star.detach().requires_grad_(True)
            hx = h(x0)
            u = _neumann(v, lambda w: torch.autograd.grad(hx, x0, w, retain_graph=True)[0],
                         groups)
        if torch.is_grad_enabled():   # a graph is wanted (create_graph=True): u has none
            # u depends on v and, through N, on everything `out` depends on (parameters,
            # points, context): the refusing node hangs from both, so that a second
            # differentiation with respect to any of them reaches it (anchored on v alone, a
            # gradient penalty with a constant incoming gradient went silently wrong)
            (u,) = refuse_second_order(SECOND_ORDER, u, anchors=(v, out))
        return u

    out.register_hook(adjoint)
    return out


def _neumann(v: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor],
             groups: int) -> torch.Tensor:
    """``u = (I - N^T)^{-1} v`` for ``N`` strictly triangular over ``groups`` groups:
    ``u_k = v + N^T u_{k-1}`` is exact on its last ``k + 1`` groups, so ``u_{groups-1}`` is
    ``u`` (``product(w) = N^T w``); it stops earlier at a bitwise fixed point."""
    u = v
    for _ in range(max(groups - 1, 0)):
        nu = v + product(u)
        if torch.equal(nu, u):
            break
        u = nu
    return u


def combine(parts: list[Solution], method: str, value: torch.Tensor, time_s: float) -> Solution:
    """One Solution for solves run one after another (e.g. the transforms of a flow)."""
    residuals = torch.cat([p.residuals for p in parts]) if parts \
        else torch.empty(0, dtype=torch.float64)
    out = Outcome(
        value, next((p.result for p in parts if not p.converged), Result.successful),
        evaluations=sum(p.evaluations for p in parts),
        positions=sum(p.stats.get("positions") or 0 for p in parts),
        sequential_steps=sum(p.stats.get("sequential_steps") or 0 for p in parts),
        error_estimate=sum(p.stats.get("error_estimate") or 0.0 for p in parts),
        stats={"parts": parts},
        # why a part could not certify, where that is not max_iters (its solve's words)
        reason=next((f"part {k}: {p.stats['not_converged']}" for k, p in enumerate(parts)
                     if not p.converged and p.stats.get("not_converged")), None))
    return build(method, out, iterations=sum(p.iterations for p in parts),
                 residuals=residuals, time_s=time_s)


# -- argument checks ---------------------------------------------------------------------------
def require_deterministic_parts(parts: Iterable[tuple[str, nn.Module]], *, entry: str,
                                argument: str, hint: str = "") -> None:
    """Refuse an autoregressive network whose repeated evaluation differs (train mode with
    dropout, a random layer, a norm layer reading batch statistics): the solve evaluates it more
    often, on other iterates, than the library's loop, and neither has a fixed point to return.

    Arguments:
        parts: ``(name, module)`` of each autoregressive part (``name`` as in the flow, for the
            message; ``""`` for the flow itself).
        entry, argument: for the message (see :func:`paraprop.determinism.require_deterministic`).
        hint: appended to the message (e.g. how to get the library's own loop back).

    Raises:
        paraprop.StochasticModelError: naming the part, the layer and the fix.
    """
    for name, module in parts:
        where = f"{entry} (autoregressive part {name!r})" if name else entry
        try:
            require_deterministic(module, argument=argument, entry=where)
        except StochasticModelError as e:
            raise StochasticModelError(f"{e}{hint}") from None


def named_parts(root, parts: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``(name, part)``: each part's qualified name in ``root`` (a module), else its rank and
    class."""
    names = {id(m): n for n, m in root.named_modules()} if isinstance(root, nn.Module) else {}
    return [(names.get(id(m)) or f"#{i} ({type(m).__name__})", m) for i, m in enumerate(parts)]


def part_names(root) -> dict[int, str]:
    """``id(module) -> qualified name`` of the modules of ``root`` (empty: not a module)."""
    return {id(m): n for n, m in root.named_modules()} if isinstance(root, nn.Module) else {}


def part_name(names: dict[int, str], part) -> str:
    """How messages name ``part``: its name in the flow and its class."""
    name = names.get(id(part))
    return f"{name!r} ({type(part).__name__})" if name else type(part).__name__


def patch_name(part) -> str:
    """:func:`part_name` of an accelerated part (its name in the accelerated flow)."""
    where = patch_of(part).where
    return f"{where!r} ({type(part).__name__})" if where else type(part).__name__


def check_parts(root, parts: Iterable[nn.Module]) -> None:
    """:func:`require_deterministic_parts` for :func:`paraprop.flows.parallel_inverse`."""
    require_deterministic_parts(named_parts(root, parts), entry="paraprop.flows.parallel_inverse",
                                argument="transform")


def functorch_active() -> bool:
    """Whether a :mod:`torch.func` transform (grad, vjp, jacrev, vmap, ...) is running: the
    solve's data-dependent stop and the gradient hook cannot run under one."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def refuse_functorch() -> None:
    """:func:`paraprop.flows.parallel_inverse` under a :mod:`torch.func` transform."""
    if functorch_active():
        raise NotImplementedError(
            "paraprop.flows.parallel_inverse cannot run under torch.func transforms (grad, "
            "vjp, jacrev, vmap, ...): its early stop depends on the values and its gradient is "
            "a backward hook; call the library's own inverse there (an accelerated flow does "
            "so by itself under torch.func)")


ACCELERATE_HINT = ("; or call undo() on the paraprop.flows.accelerate handle to run the "
                   "library's own loop")


def check_accelerated(part: nn.Module) -> None:
    """At an accelerated call: the part's network must be deterministic now (the flow's mode
    may have changed since :func:`paraprop.flows.accelerate`)."""
    require_deterministic_parts([(patch_of(part).where, part)],
                                entry="paraprop.flows.accelerate", argument="flow",
                                hint=ACCELERATE_HINT)


def reference(module) -> torch.Tensor | None:
    """The first floating-point parameter of ``module`` (``None``: it has none)."""
    if not isinstance(module, nn.Module):
        return None
    return next((p for p in module.parameters() if p.is_floating_point()), None)


def check_like(name: str, t: torch.Tensor, ref: torch.Tensor | None, what: str) -> None:
    """``t`` must have the dtype and device of ``ref`` (the parameters of ``what``)."""
    if ref is None:
        return
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of the {what}'s parameters, {ref.dtype}, "
                        f"got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the device of the {what}'s parameters, "
                         f"{ref.device}, got {t.device}")


def check_features(y: torch.Tensor, features: int | None, what: str) -> None:
    if features is not None and y.shape[-1] != features:
        raise ValueError(f"y must have shape (N, {features}) ({features} features, as the "
                         f"{what}), got {tuple(y.shape)}")


def check_context_rows(y: torch.Tensor, context: torch.Tensor | None, n_ctx: int | None,
                       name: str) -> None:
    """An nflows / normflows MADE: ``context`` of shape ``(N, n_ctx)`` iff it was built with
    ``n_ctx`` context features."""
    if n_ctx is None:
        if context is not None:
            raise ValueError(f"context must be None: {name} was built without "
                             f"context_features, got context of shape {tuple(context.shape)}")
        return
    if context is None:
        raise ValueError(f"context is needed: {name} takes {n_ctx} context features; "
                         f"pass context of shape ({y.shape[0]}, {n_ctx})")
    if tuple(context.shape) != (y.shape[0], n_ctx):
        raise ValueError(f"context must have shape ({y.shape[0]}, {n_ctx}) (the rows of y, "
                         f"the context features of {name}), got {tuple(context.shape)}")


# -- the masked-MADE transforms of nflows and normflows -----------------------------------------
def made_step(part, y, context):
    """One pass of the nflows / normflows inverse loop: ``x -> f_x^{-1}(y)``."""
    return lambda x: part._elementwise_inverse(y, part.autoregressive_net(x, context))[0]


def made_inverse(part, y, context, order, cfg, record, *, where: str = ""):
    """``part.inverse(y, context)`` of an nflows ``AutoregressiveTransform`` or a normflows
    ``Autoregressive``: ``(outputs, logabsdet)`` of the last pass, at the fixed point, in at
    most the library's ``D`` passes (the last one gives both, with the gradient)."""
    passes = math.prod(y.shape[1:])   # the library's loop: one pass per input
    with refuse_random(where, y.device):
        with torch.no_grad():
            run = tracked_solve(made_step(part, y, context), y, order, cfg, passes=passes,
                                where=where)
        if torch.is_grad_enabled():
            outputs, ladj = _made_pass(part, y, context, run.x, run.groups)
        else:
            outputs, ladj = part._elementwise_inverse(y, part.autoregressive_net(run.x,
                                                                                context))
    check_finite(outputs, where)
    record(run.solution(outputs.detach(), 1))
    return outputs, ladj


def _made_pass(part, y, context, x_in: torch.Tensor, groups: int):
    """The last pass, differentiable: ``(outputs, logabsdet)`` at ``x_in`` with the gradient of
    the fixed point, in one network evaluation.

    With ``p = net(x)`` the conditionals' parameters and ``x = g(y, p)`` the elementwise inverse,
    the fixed point is ``p* = net(g(y, p*))``, triangular like ``x*``. A hook on ``p`` replaces
    the gradient arriving there (from the outputs and from log|det|) by ``(I - M)^{-T} w``,
    ``M = ∂net/∂x ∂g/∂p`` (:func:`_neumann`); ``p``'s own backward then gives the parameters and
    the context their gradients, and the network's input, linked to ``y`` by
    :class:`_Attach`, the part of ``y``'s that runs through ``x*``."""
    net, inverse = part.autoregressive_net, part._elementwise_inverse
    holder: dict = {}
    xq = _Attach.apply(x_in, y, holder, inverse) if y.requires_grad else x_in
    p = net(xq, context)
    holder["p"] = p.detach()
    outputs, ladj = inverse(y, p)
    if not p.requires_grad:
        return outputs, ladj

    def adjoint(w: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x0 = x_in.detach().requires_grad_(True)
            p0 = net(x0, None if context is None else context.detach())
            pl = p0.detach().requires_grad_(True)
            o0 = inverse(y.detach(), pl)[0]

            def product(u):   # M^T u
                (gx,) = torch.autograd.grad(p0, x0, u, retain_graph=True)
                return torch.autograd.grad(o0, pl, gx, retain_graph=True)[0]

            u = _neumann(w, product, groups)
        if torch.is_grad_enabled():   # create_graph=True: refuse a second differentiation
            (u,) = refuse_second_order(SECOND_ORDER, u, anchors=(w, p))
        return u

    p.register_hook(adjoint)
    return outputs, ladj


class _Attach(torch.autograd.Function):
    """``x`` (its value) linked to the points ``y``: the gradient arriving at ``x`` goes on to
    ``y`` through ``x = g(y, p)`` at the pass's parameters (``holder["p"]``, set after the
    pass); ``x`` itself gets none (it is a value of the solve, not of the graph)."""

    @staticmethod
    def forward(ctx, x, y, holder, inverse):
        ctx.save_for_backward(y)
        ctx.holder, ctx.inverse = holder, inverse
        return x.detach().clone()

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        with torch.enable_grad():
            yl = y.detach().requires_grad_(True)
            out = ctx.inverse(yl, ctx.holder["p"])[0]
            (gy,) = torch.autograd.grad(out, yl, g)
        if torch.is_grad_enabled():
            (gy,) = refuse_second_order(SECOND_ORDER, gy, anchors=(g, y))
        return None, gy, None, None


# -- patches on instances (accelerate) ----------------------------------------------------------
PATCH = "_paraprop_accelerate"   # the instance attribute that holds a part's Patch


@dataclasses.dataclass
class Counters:
    """What the accelerated inverses did since the flow was accelerated."""

    inversions: int = 0        # autoregressive inverses solved
    passes: int = 0            # passes (evaluations of the transform's network) they took
    library_passes: int = 0    # passes the library's own loops would have taken


@dataclasses.dataclass
class Patch:
    """One patched method of one part: the settings, and what to restore.

    Neither pickling (``pickle``, ``torch.save``) nor ``copy.deepcopy`` carries a patch: the
    part comes back with the library's own method (see :class:`Bound`), and this record as
    ``None``; no handle would own a patched copy.
    """

    cfg: Settings
    counters: Counters
    attribute: str                  # the patched method's name
    saved: Callable | None = None   # the instance attribute it replaced (None: the class's)
    where: str = ""                 # the part's name in the accelerated flow (for messages)

    def __reduce__(self):
        return (_no_patch, ())

    def original(self, part) -> Callable:
        """The method as it was before the patch, bound to ``part``."""
        if self.saved is not None:
            return self.saved
        return getattr(type(part), self.attribute).__get__(part)

    def recorder(self, library_passes: int) -> Callable[[Solution], None]:
        def record(sol: Solution) -> None:
            self.counters.inversions += 1
            self.counters.passes += sol.evaluations
            self.counters.library_passes += library_passes
        return record


def _no_patch() -> None:
    """What a pickled :class:`Patch` loads as: no patch."""
    return None


def _same(obj):
    return obj


class Bound:
    """``method`` bound to ``part``, installed as the part's instance attribute in place of the
    library's method (like ``types.MethodType``, with ``__func__`` and ``__self__``).

    Pickled (``pickle``, ``torch.save``) or deep-copied (``copy.deepcopy``) it becomes the
    method it replaced, so a saved or copied flow is the library's plain flow: acceleration is a
    patch of live instances owned by a handle, not state (apply
    :func:`paraprop.flows.accelerate` to the copy for one of its own).
    """

    __slots__ = ("__func__", "__self__", "attribute")

    def __init__(self, method: Callable, part: nn.Module, attribute: str):
        self.__func__, self.__self__, self.attribute = method, part, attribute

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        patch = self.__self__.__dict__.get(PATCH)
        saved = patch.saved if isinstance(patch, Patch) else None
        if saved is None:   # the class's method, looked up when the part loads
            return (getattr, (self.__self__, self.attribute))
        return (_same, (saved,))

    def __repr__(self) -> str:
        return (f"<paraprop.flows accelerated {type(self.__self__).__name__}.{self.attribute} "
                f"of {object.__repr__(self.__self__)}>")


def patch_of(part) -> Patch:
    return part.__dict__[PATCH]


def is_patched(part) -> bool:
    """Whether ``part`` carries an active patch (a loaded pickle carries ``None``)."""
    return isinstance(getattr(part, "__dict__", {}).get(PATCH), Patch)


def install(part: nn.Module, attribute: str, method: Callable, patch: Patch) -> None:
    """Bind ``method`` to ``part`` as its ``attribute`` (the instance only)."""
    patch.saved = part.__dict__.get(attribute)
    part.__dict__[PATCH] = patch
    part.__dict__[attribute] = Bound(method, part, attribute)


def remove(part: nn.Module) -> None:
    """Undo :func:`install` (nothing if ``part`` is not patched)."""
    patch = part.__dict__.pop(PATCH, None)
    if not isinstance(patch, Patch):
        return
    if patch.saved is None:
        part.__dict__.pop(patch.attribute, None)
    else:
        part.__dict__[patch.attribute] = patch.saved
