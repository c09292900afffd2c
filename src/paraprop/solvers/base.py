"""The pieces every solver of a nonlinear triangular system shares.

A feedforward computation ``s_t = f_t(s_<t)`` over ``T`` positions is the triangular system
``x = fn(x)`` (Song et al. 2021, eq. 2). :class:`System` is that system seen in a canonical layout
``(B, T, F)``: ``B`` independent samples (the flattened leading dims), ``T`` positions (the
flattened autoregressive dims, row-major), ``F`` values per position (the flattened trailing dims).
Solvers work on the canonical layout; ``fn`` always sees the caller's shape.

:class:`State` is what one solver iteration reads and writes; :func:`accept` is the shared rule
that turns freshly computed values into the next iterate with per-sample stopping.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paraprop.errors import NonFiniteError, NotTriangularError, ProtocolError
from paraprop.solvers.protocols import HOOKS
from paraprop.stopping import ContractionRule, Floor

# the other common cause of a position that moves although its inputs are final
NONDETERMINISTIC = ("or fn's repeated evaluation differs (a module in train mode with dropout or "
                    "batch statistics: call model.eval())")


class System:
    """A triangular system ``x = fn(x)`` in the canonical ``(B, T, F)`` layout.

    Counts the calls of ``fn`` (``evaluations``) and the positions computed (``positions``, the
    hardware-independent work). Every call of ``fn`` or of a hook goes through here, and the
    promises of :mod:`paraprop.solvers.protocols` that can be checked cheaply are checked on the
    way: the output's shape and dtype, that the call left ``x`` unchanged (a checksum of ``x``
    before and after it, see :meth:`_call`), and that the output is not ``x`` itself.
    """

    def __init__(self, fn, shape: torch.Size, dtype: torch.dtype, dims: tuple[int, int],
                 device: torch.device | None = None):
        self.fn = fn
        self._lock = threading.Lock()  # the counters, when a solver evaluates on threads
        self.shape = shape
        self.dtype = dtype
        start, end = dims  # inclusive range of autoregressive dims, already normalised
        self.batch_shape = shape[:start]
        self.pos_shape = shape[start : end + 1]
        self.feature_shape = shape[end + 1 :]
        self.B = math.prod(self.batch_shape)
        self.T = math.prod(self.pos_shape)
        self.F = math.prod(self.feature_shape)
        self.fast = callable(getattr(fn, "update", None))
        self.windowed = callable(getattr(fn, "window", None))
        self.cache = None  # fn.window's cache of the frozen prefix, kept between calls
        # x0 in the canonical layout (the caller's tensor, not copied): the sequential loop
        # computes position t with x0's values at the positions >= t, and so does a solver's
        # last step (paraprop.solvers.verify.final_step)
        self.initial: torch.Tensor | None = None
        self.evaluations = 0
        self.positions = 0
        self.iteration = 0  # set by the driver, used in error messages
        self.used: set[str] = set()  # the hooks whose values entered the iterate
        self.kept = 0  # non-finite values of non-final positions replaced by the old ones
        self._local = threading.local()  # per thread: whether its last call saw NaN or inf
        self._prefix = (0, None)  # (lo, checksum of the final positions < lo), see _call
        # the checksums' words (see _words) and whether the iterate is on the host
        size = dtype.itemsize
        self._word = torch.int64 if size < 8 and (self.F * size) % 8 == 0 else _INT[size]
        self._device = None if device is None else torch.device(device)
        self._host = None if device is None else self._device.type == "cpu"

    @property
    def nonfinite(self) -> bool:
        """Whether the last call (of this thread) returned values that may hold NaN or inf."""
        return getattr(self._local, "nonfinite", False)

    @nonfinite.setter
    def nonfinite(self, value: bool) -> None:
        self._local.nonfinite = value

    @property
    def source(self) -> str:
        """The hook (a key of :data:`~paraprop.solvers.protocols.HOOKS`) whose values the last
        call (of this thread) returned, for the messages."""
        return getattr(self._local, "source", "fn")

    # -- layout -------------------------------------------------------------------------------
    def canon(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.B, self.T, self.F)

    def user(self, xc: torch.Tensor) -> torch.Tensor:
        return xc.reshape(self.shape)

    def unravel_position(self, t: int) -> tuple[int, ...]:
        return _unravel(t, self.pos_shape)

    def unravel_sample(self, b: int) -> tuple[int, ...]:
        return _unravel(b, self.batch_shape)

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, xc: torch.Tensor, *, guard: bool = True,
                 check: bool = True) -> torch.Tensor:
        """All positions of ``fn(x)``, canonical layout (``guard``, ``check``: see
        :meth:`_call`)."""
        y = self._call("fn", xc, self.fn, self.shape, guard, check)
        self._count(self.T)
        return self.canon(y)

    def update(self, xc: torch.Tensor, index: torch.Tensor, *, guard: bool = True,
               check: bool = True, span: tuple[int, int] | None = None) -> torch.Tensor:
        """Positions ``index`` (flat, 1-D) of ``fn(x)``, shape ``(B, len(index), F)``.

        Uses ``fn.update(x, index)`` when ``fn`` provides it, otherwise evaluates ``fn`` fully.
        """
        if not self.fast:
            return self.evaluate(xc, guard=guard, check=check).index_select(1, index)
        expected = torch.Size((*self.batch_shape, index.numel(), *self.feature_shape))
        y = self._call("update", xc, lambda xu: self.fn.update(xu, index), expected, guard,
                       check, lo=lambda: int(index[0]), span=span)
        self.used.add("update")
        self._count(index.numel())
        return y.reshape(self.B, index.numel(), self.F)

    def window(self, xc: torch.Tensor, start: int, stop: int, *,
               guard: bool = True) -> torch.Tensor:
        """Positions ``[start, stop)`` (flat) of ``fn(x)``, shape ``(B, stop - start, F)``.

        The cached-prefix protocol (:class:`~paraprop.solvers.protocols.SupportsWindow`): with
        ``fn.window(x, start, stop, cache)`` the driver promises that the positions ``< start``
        of ``x`` are final, and passes back the cache ``fn`` returned last time (``None`` at
        first); ``fn`` returns ``(values, cache)``. Without it, ``fn.update`` (or a full
        evaluation) computes the window.
        """
        n = stop - start
        if not self.windowed:
            device = self._device if self._device is not None else xc.device
            return self.update(xc, torch.arange(start, stop, device=device), guard=guard,
                               span=(start, stop))

        def call(xu):
            out = self.fn.window(xu, start, stop, self.cache)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("fn.window(x, start, stop, cache) must return a tuple (values, "
                                f"cache), got {type(out).__name__}")
            y, self.cache = out
            return y

        expected = torch.Size((*self.batch_shape, n, *self.feature_shape))
        y = self._call("window", xc, call, expected, guard, True, lo=start, span=(start, stop))
        self.used.add("window")
        self._count(n)
        return y.reshape(self.B, n, self.F)

    def propose(self, xc: torch.Tensor, final: torch.Tensor, start: int) -> torch.Tensor | None:
        """``fn.propose(x, final)`` in the canonical layout (``None`` without the hook or
        when it has no guesses), its promise not to modify the final positions ``< start`` of
        ``x`` checked (a change of a position that is not final is a guess like any other)."""
        hook = getattr(self.fn, "propose", None)
        if not callable(hook):
            return None
        guess = self._call("propose", xc, lambda xu: hook(xu, final), None, True, False,
                           span=(start, start))
        if guess is None:
            return None
        if not isinstance(guess, torch.Tensor) or guess.shape != self.shape or \
                guess.dtype != self.dtype:
            got = (f"{tuple(guess.shape)} {guess.dtype}" if isinstance(guess, torch.Tensor)
                   else type(guess).__name__)
            raise ProtocolError(f"fn.propose(x, final) must return None or a tensor shaped like "
                                f"x {tuple(self.shape)} {self.dtype}, got {got}")
        return self.canon(guess)

    def _call(self, hook: str, xc: torch.Tensor, call, shape, guard: bool, check: bool,
              lo=0, span: tuple[int, int] | None = None):
        """``call(x)`` in the caller's layout, with the cheap checks of the hook's promises.

        ``guard``: the call must leave ``x`` unchanged, checked by a checksum of ``x``'s bits
        before and after it (:func:`checksum`). With ``span=(lo, hi)`` only the positions
        ``< hi`` are checked: those ``< lo`` are final (their checksum is kept from call to
        call, so a window costs one pass over the prefix, not two), and the positions from
        ``hi`` on are not final: the solver treats whatever they hold as a guess. ``guard`` is
        off where the caller passes a private copy, and for the reference loop. ``check``: the
        output is checked for NaN/inf, in ``self.nonfinite`` (off for the reference loop, which
        checks its result once at the end). ``lo``: the first position the call computes (or a
        callable giving it), read only when the output is a view of ``x``."""
        self._local.source = hook
        if not (guard or check):   # the reference loop: the user's own loop checks nothing
            y = call(self.user(xc))
            if shape is not None:
                self._check_output(y, shape, HOOKS[hook])
            return y
        hi = xc.shape[1] if span is None else span[1]
        host = self._host if self._host is not None else xc.device.type == "cpu"
        if guard:
            words = xc.view(self._word)
            before = self._sum_before(words, span, host)
        y = call(self.user(xc))
        if shape is not None:
            self._check_output(y, shape, HOOKS[hook])
        check = check and y is not None
        mutated = nonfinite = False
        if host:    # on the host each check is one operator, read as a Python number
            mutated = guard and (int(words[:, :hi].sum()) - before) % _WRAP != 0
            nonfinite = check and not math.isfinite(float(y.sum()))
        elif guard or check:           # on an accelerator: one transfer for both
            no = torch.zeros((), dtype=torch.bool, device=xc.device)
            flags = [words[:, :hi].sum() != before if guard else no,
                     ~torch.isfinite(y.sum()) if check else no]
            mutated, nonfinite = (bool(v) for v in torch.stack(flags).tolist())
        self.nonfinite = nonfinite
        if mutated:
            where = "x" if span is None else f"positions < {hi} of x"
            raise ProtocolError(
                f"{HOOKS[hook]} modified its input x in place at iteration {self.iteration} "
                f"({where} changed during the call); a hook must leave the solver's iterate "
                "unchanged: compute on a copy (x.clone()) and return new values")
        if y is not None and _shares_memory(y, xc):
            if _same_positions(y, xc, lo() if callable(lo) else lo):
                raise NotTriangularError(
                    f"{HOOKS[hook]} returned positions of its input x itself (a view of x, not "
                    "new values): every position then depends on itself, which is not "
                    "autoregressive; return fn's values computed from the earlier positions")
            y = y.clone()  # a view of other positions of x (a shift): the iterate will change
        return y

    def _sum_before(self, words: torch.Tensor, span, host: bool):
        """The checksum of the positions ``< hi`` before a call (a Python int modulo 2**64 on
        the host, a 0-d tensor elsewhere), the final prefix's part kept from call to call."""
        if span is None:
            total = words.sum()
            return int(total) if host else total
        lo, hi = span
        upto, value = self._prefix
        if upto > lo or value is None:
            upto, value = 0, 0 if host else words[:, :0].sum()
        if upto < lo:   # the positions final since the last call
            part = words[:, upto:lo].sum()
            value = (value + int(part)) % _WRAP if host else value + part
            self._prefix = (lo, value)
        part = words[:, lo:hi].sum()
        return value + int(part) if host else value + part

    def _count(self, positions: int) -> None:
        with self._lock:
            self.evaluations += 1
            self.positions += positions

    def _check_output(self, y, shape, what: str) -> None:
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"fn: {what} must return a torch.Tensor, got {type(y).__name__}")
        if y.shape != shape:
            raise ValueError(
                f"fn: {what} returned shape {tuple(y.shape)}, expected {tuple(shape)} "
                "(fn must map x to a tensor of the same shape)"
            )
        if y.dtype != self.dtype:
            raise TypeError(f"fn: {what} returned dtype {y.dtype}, expected {self.dtype}")

    def check_finite(self, values: torch.Tensor, index: torch.Tensor | None = None,
                     hook: str = "fn") -> None:
        """Raise :class:`NonFiniteError` naming the iteration, sample and position (``hook``:
        the hook whose values these are, a key of :data:`~paraprop.solvers.protocols.HOOKS`;
        ``fn.propose``'s guesses must be finite: a :class:`ProtocolError` names it)."""
        if bool(torch.isfinite(values.sum())):  # one reduction; inf/NaN anywhere poisons it
            return
        finite = torch.isfinite(values)
        if bool(finite.all()):  # the sum overflowed, the values are fine
            return
        b, t, _ = (int(i) for i in (~finite).nonzero()[0])
        if index is not None:
            t = int(index[t])
        if hook == "propose":
            raise ProtocolError(
                f"{HOOKS[hook]} returned NaN or inf at iteration {self.iteration}, sample "
                f"{self.unravel_sample(b)}, position {self.unravel_position(t)}: guesses must be "
                "finite (a NaN guess at a later position poisons the earlier ones of a map with "
                "masked weights, 0 * NaN is NaN); return None where there is no guess")
        self._non_finite(b, t, hook=hook)

    def _non_finite(self, b: int, t: int, extra: str = "", hook: str = "fn"):
        who = "fn produced" if hook == "fn" else f"{HOOKS[hook]} returned"
        note = extra or (" (NaN or inf; note that 0 * inf is NaN, so an overflow at a later "
                         "position can poison earlier ones in masked networks)")
        raise NonFiniteError(
            f"{who} a non-finite value at iteration {self.iteration}, sample "
            f"{self.unravel_sample(b)}, position {self.unravel_position(t)}{note}")

    def _fatal_non_finite(self, b: int, t: int, hook: str, x: torch.Tensor | None):
        """A non-finite value at position ``t`` of sample ``b``, the first position that is
        not final there (every input it may depend on is final): say what the solver knows of
        where it came from (``hook``) and of the iterate ``x`` it was computed from."""
        later = None
        if x is not None and t + 1 < x.shape[1]:
            bad = ~torch.isfinite(x[b, t + 1:]).all(dim=-1)
            if bool(bad.any()):
                later = t + 1 + int(bad.nonzero()[0])
        src = HOOKS[hook]
        if later is not None:
            writers = [HOOKS[h] for h in ("window", "update", "propose")
                       if h in self.used or (h == "propose" and callable(
                           getattr(self.fn, "propose", None)))] or ["a hook"]
            extra = (f", the first position that is not final, from an iterate that held NaN or "
                     f"inf at a later position, {self.unravel_position(later)}: that value is "
                     "not final and not the sequential loop's, and a map that reads later "
                     "positions through masked weights carries it to earlier ones (0 * NaN is "
                     "NaN). The solver writes only finite values into the iterate (x0 is "
                     f"checked, a non-finite result is not kept), so {' or '.join(writers)} "
                     "wrote it into x: a hook may not modify x, and is checked only on the "
                     "positions up to its own")
        elif hook == "fn":
            extra = (" (computed from final positions only, so the sequential loop produces it "
                     "too; note that 0 * inf is NaN, so an overflow at a later position can "
                     "poison earlier ones in masked networks)")
        else:
            extra = (f", the first position that is not final, from final and finite inputs: "
                     f"the sequential loop meets it too if {src} computes fn's values there "
                     "(NaN or inf; 0 * inf is NaN in masked networks)")
        self._non_finite(b, t, extra, hook=hook)

    def keep_finite(self, new: torch.Tensor, old: torch.Tensor, first, positions: torch.Tensor,
                    active: torch.Tensor | None = None, *, x: torch.Tensor | None = None,
                    hook: str | None = None):
        """Deal with NaN/inf in freshly computed values ``new`` ``(B, n, F)`` of the flat
        ``positions`` ``(n,)``, whose previous values are ``old`` (or a callable returning them,
        called only when needed).

        A value of a position ``<= first`` (``first``: int or ``(B,)``, the first position that
        is not final; it was computed from final inputs only) is the map's own: the sequential
        loop produces it too, so :class:`NonFiniteError` (its message says what the solver
        knows: which hook returned it, ``hook``, by default the last call's, and whether the
        iterate ``x`` it was computed from held NaN or inf at later positions, which a hook
        wrote there). A value of a later position was computed from inputs that are not final
        yet (an fp16 Jacobi iterate can overflow where the sequential loop stays finite): that
        entry keeps ``old``. Returns ``(values, kept)``; ``kept`` is ``None`` when nothing was
        replaced, else ``(B, n)`` bool: the positions that kept their old value (they must not
        count as unchanged in this iteration).
        """
        if not self.nonfinite:
            return new, None
        if callable(old):
            old = old()
        bad = ~torch.isfinite(new)
        badpos = bad.any(dim=2)
        if not bool(badpos.any()):  # the sum overflowed, the values are fine
            return new, None
        B = new.shape[0]
        first = torch.as_tensor(first, device=new.device).expand(B)
        fatal = badpos & (positions[None, :] <= first[:, None])
        if active is not None:
            fatal &= active[:, None]
        if bool(fatal.any()):
            b, j = (int(i) for i in fatal.nonzero()[0])
            self._fatal_non_finite(b, int(positions[j]), hook or self.source, x)
        self.kept += int(badpos.sum())
        return torch.where(bad, old, new), badpos


@dataclass
class State:
    """The iterate and the per-sample bookkeeping of one solve: the fields that the driver,
    :func:`accept`, :func:`settle` and the final check (:mod:`paraprop.solvers.verify`) share,
    and in ``own`` the solver's private state, a dataclass its ``init`` makes."""

    x: torch.Tensor  # (B, T, F), owned by the solver
    active: torch.Tensor  # (B,) bool: samples still iterating
    sample_iterations: torch.Tensor  # (B,) long: sweeps each sample took part in
    residual: float | torch.Tensor | None = math.inf  # convergence measure of the last iteration
    finished: bool = False
    # whether every sample is still iterating, and how many are (None: not counted yet, all);
    # kept by accept and settle
    all_active: bool = True
    n_active: int | None = None
    # the solver's own counters and settings, reported in Solution.stats
    stats: dict[str, object] = field(default_factory=dict)
    # (B,) long: the first position each sample froze on an error estimate (T: none; None: the
    # solver freezes nothing on an estimate), read by the final check
    # (paraprop.solvers.verify) to tell a broken map from a failed estimate
    estimated_from: torch.Tensor | None = None
    # for the final check at tol > 0 (paraprop.solvers.verify): a callable giving the (B, T)
    # gain of a position per unit change of the earlier ones (None: 1), and what the freeze
    # estimates rely on, a string or a callable giving one (None: the observed contraction)
    gain: Callable[[], torch.Tensor | None] | None = None
    premise: str | Callable[[], str] | None = None
    # the solver's private state (a dataclass of its own, made by its init)
    own: Any = None
    rule: ContractionRule | None = None  # the per-sample contraction estimate
    estimate: torch.Tensor | None = None  # (B,) float64: error estimate where a sample stopped
    # the final value was already checked against fn by the solver's own evaluations (its
    # certificate comes from fn's values); otherwise the driver spends one evaluation on it
    # (paraprop.solvers.verify)
    verified: bool = False
    # set by paraprop.solvers.verify.final_step, which checks the value in the budget's last
    # call: "evaluation" or "failed", and why it failed (converged=False)
    check: str | None = None
    reason: str | None = None

    def __post_init__(self):
        B, device = self.active.shape[0], self.active.device
        if self.rule is None:
            self.rule = ContractionRule(B, device)
        if self.estimate is None:
            self.estimate = torch.zeros(B, dtype=torch.float64, device=device)


def rounding_floor(values: torch.Tensor, norm: str) -> Floor:
    """The rounding floor (:class:`~paraprop.stopping.Floor`, ``(B,)`` float64) of
    ``values`` ``(B, n, F)`` (the positions that are not final: a final one is bitwise the
    sequential value), in ``norm``.

    Where ``v = fl(f(x))`` is a value of the iterate and ``v* = fl(f(x*))`` the sequential one,
    ``|v - v*| <= |f(x) - f(x*)| + ulp(v) / 2 + ulp(v*) / 2`` (round to nearest; ``ulp(v)`` the
    spacing of the dtype's numbers above ``|v|``), and ``ulp(v*) <= max(eps |v*|, s) <=
    max(eps |v|, s) + eps |v - v*|`` (``s``: the spacing of the subnormal numbers). So an error
    estimate adds ``bound = (ulp(m) + max(eps m, s)) / 2`` at the values' largest magnitude ``m``
    and divides by ``1 - q - eps / 2`` (``slack``): that is one unit in the last place at
    ``m`` where ``m`` is a power of two, less than one and a half units otherwise, the least an
    estimate in this dtype can certify (:mod:`paraprop.stopping`). The unit of rounding
    noise is ``eps * m``. With ``norm="l2"`` both are ``eps * ||v||_2`` (a bound of the same sum
    per entry).
    """
    f = _floor_arrays(values, norm)
    if isinstance(f.bound, np.ndarray):
        return Floor(torch.from_numpy(f.bound), torch.from_numpy(f.unit), f.slack)
    return f


def _floor_arrays(values: torch.Tensor, norm: str) -> Floor:
    """:func:`rounding_floor`, its ``(B,)`` numbers as NumPy arrays on the host (the stopping
    rule's arithmetic runs there, :class:`~paraprop.stopping.ContractionRule`)."""
    finfo = torch.finfo(values.dtype)
    B = values.shape[0]
    if values.numel() == 0:   # every position final
        z = torch.zeros(B, dtype=torch.float64, device=values.device)
        return Floor(z, z, finfo.eps / 2)
    if norm == "max":
        m = values.abs().amax(dim=tuple(range(1, values.dim())))
        # (B,) numbers: on the host NumPy's calls cost less than tensor operators, same
        # arithmetic (bfloat16, which NumPy lacks, stays a tensor)
        m = m.numpy().astype(np.float64) if m.device.type == "cpu" and \
            m.dtype != torch.bfloat16 else m.to(torch.float64)
        unit = m * finfo.eps
        return Floor(half_ulp_bound(m, values.dtype, unit), unit, finfo.eps / 2)
    flat = values.reshape(B, -1)
    unit = torch.linalg.vector_norm(flat.to(torch.float64), dim=1) * finfo.eps
    return Floor(unit, unit, finfo.eps / 2)


def half_ulp_bound(m: torch.Tensor, dtype: torch.dtype, unit: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``(ulp(m) + max(eps m, s)) / 2`` for magnitudes ``m`` (float64, values of ``dtype``):
    the most that rounding a value of size ``m`` and the sequential value near it can add to
    their difference (:func:`rounding_floor`). ``unit``: ``eps * m`` when the caller has it."""
    finfo = torch.finfo(dtype)
    sub = finfo.smallest_normal * finfo.eps           # the spacing of the subnormal numbers
    unit = m * finfo.eps if unit is None else unit
    # ulp(m) = 2^e eps for 2^e <= m < 2^(e+1): m's exponent bits alone are 2^e (float64 holds
    # every value of dtype exactly); below the normal numbers the spacing is s, and the clamp
    # makes the bound s there (where eps m < s and 2^e eps < s)
    if isinstance(m, np.ndarray):   # the same on a NumPy array
        ulp = (m.view(np.int64) & _EXPONENT).view(np.float64) * finfo.eps
        return np.maximum((ulp + unit) * 0.5, sub)
    ulp = (m.view(torch.int64) & _EXPONENT).view(torch.float64) * finfo.eps
    return ((ulp + unit) * 0.5).clamp_(min=sub)


_EXPONENT = 0x7FF0000000000000   # the exponent bits of a float64


def sync(*values) -> list:
    """Several integer or boolean device scalars (0-d tensors; Python values pass through) on
    the host in one transfer: the one synchronisation of an iteration."""
    idx = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    out = list(values)
    if idx:
        host = torch.stack([values[i].to(torch.int64).reshape(()) for i in idx]).tolist()
        for i, h in zip(idx, host, strict=True):
            out[i] = h
    return out


def accept(system: System, state: State, lo: int, hi: int, new: torch.Tensor, tol: float,
           norm: str, exact: int = 0, budget: float | None = None,
           kept: torch.Tensor | None = None) -> None:
    """Write ``new`` into positions ``[lo, hi)`` of the active samples, with per-sample stopping.

    Arguments:
        system, state: the system and the solver state (``state.x`` is updated in place).
        lo, hi: the positions ``new`` holds (canonical layout ``(B, hi - lo, F)``).
        tol, norm: a sample stops when the contraction estimate of its error
            (:class:`~paraprop.stopping.ContractionRule`, with the rounding floor of the
            dtype) and its forward difference are ``<= tol``, or when it did not move at all;
            its values are then frozen.
        exact: the first ``exact`` positions of ``[lo, hi)`` are final already. For an
            autoregressive ``fn`` they cannot move (Song et al. 2021, Prop. 1-2), so a change
            larger than ``tol`` there proves that ``fn`` is not triangular.
        budget: the bound the error estimate must meet (default ``tol``; windowed methods pass
            their share of it).
        kept: ``(B, n)`` bool, the positions where a non-finite value was replaced by the old
            one (:meth:`System.keep_finite`): their samples count as moved.

    Whether a sample stopped is known on the host without a synchronisation of its own
    (``state.rule.stopped``); :func:`settle` reads it.
    """
    old = state.x[:, lo:hi]
    active = state.active
    all_active = state.all_active
    rule = state.rule
    # on the host the (B,) bookkeeping runs on NumPy views (the rule's arithmetic does too)
    host = rule.host_arrays and new.device.type == "cpu"
    a = (new - old).abs_()  # (B, n, F): one pass over the difference serves both checks
    if exact > 0:
        head = a[:, :exact]
        # on the host one reduction answers whether a final position of an active sample
        # moved (NaN moves); the full check names the position
        if not host or not (float(head.amax()) if all_active else _masked_max(
                head.amax(dim=(1, 2)), active)) <= tol:
            check_final(system, head.amax(dim=2), tol, active, lo)
    if norm == "max":
        res = a.amax(dim=(1, 2))
    else:
        res = torch.linalg.vector_norm(a.reshape(a.shape[0], -1), dim=1)
    if kept is not None:
        res = torch.where(kept.any(dim=1), torch.full_like(res, math.inf), res)
    if all_active:
        old.copy_(new)
    else:
        torch.where(active[:, None, None], new, old, out=old)
    # the rounding floor of the positions that are not final (those before lo + exact are the
    # sequential values bitwise, and do not move)
    floor = lambda: _floor_arrays(state.x[:, lo + exact:hi], norm)   # noqa: E731
    if host:
        r = _host_array(res)
        if all_active:
            state.sample_iterations += 1
            state.residual = float(r.max())
        else:
            act = active.numpy()
            it = state.sample_iterations.numpy()
            it += act
            state.residual = float(np.where(act, r, 0.0).max())
            # a sample that is not active can neither stop nor be held: an infinite difference
            r = np.where(act, r, np.inf)
        out = rule._update(r, tol, active, budget, None, floor, True, arrays=True)
        if out is None or not rule.stopped:   # no sample stopped
            return
        stop, est = out
        np.copyto(state.estimate.numpy(), est, where=stop)
        state.active = torch.from_numpy(active.numpy() & ~stop)
        state.n_active = _n_active(state, active) - rule.n_stopped
        return
    if all_active:
        state.sample_iterations += 1
        state.residual = res.max()
    else:
        state.sample_iterations += active
        state.residual = torch.where(active, res, 0.0).max()
        res = torch.where(active, res, math.inf)
    out = rule._update(res, tol, active, budget, None, floor, True)
    if out is None or rule.stopped is False:   # no sample stopped (known on the host)
        return
    stop, est = out
    state.estimate = torch.where(stop, est, state.estimate)
    state.active = active & ~stop
    if rule.n_stopped is not None:
        state.n_active = _n_active(state, active) - rule.n_stopped


def _n_active(state: State, active: torch.Tensor) -> int:
    """The samples iterating before this iteration's stops (all where not counted yet)."""
    return active.numel() if state.n_active is None else state.n_active


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A host tensor's values as a NumPy array (a view; bfloat16, which NumPy lacks, widened)."""
    return (t.to(torch.float64) if t.dtype == torch.bfloat16 else t).numpy()


def _masked_max(v: torch.Tensor, active: torch.Tensor) -> float:
    """``max(v[active])`` of host ``(B,)`` tensors (0 where none), NaN propagating."""
    return float(np.where(active.numpy(), _host_array(v), 0.0).max())


def settle(state: State, at_bound: bool) -> bool:
    """End an iteration with its one synchronisation: the number of samples still iterating.
    Sets ``state.finished`` (none left, or ``at_bound``) and ``state.all_active``; returns
    whether any sample is still iterating. On the host :func:`accept` counts the samples that
    stopped (``state.n_active``), and nothing is read here."""
    B = state.active.numel()
    if state.rule.n_stopped is not None:
        n = B if state.n_active is None else state.n_active
    else:
        n = int(state.active.sum())
    state.n_active = n
    state.all_active = n == B
    state.finished = at_bound or n == 0
    return n > 0


def last_from_x0(system: System, state: State, samples: torch.Tensor | None = None) -> None:
    """Before a call that computes the last position from final inputs (the budget's last:
    ``T`` calls, as the sequential loop): give the last position of ``samples`` (``(B,)``
    bool; default the active ones) ``x0``'s value, which the sequential loop's last step reads
    there. The call's value of that position is then that loop's, even for a map whose last
    position reads itself, which no check within ``T`` calls could see."""
    if system.initial is None:
        return
    T = system.T
    samples = state.active if samples is None else samples
    x = state.x
    x[:, T - 1] = torch.where(samples[:, None], system.initial[:, T - 1], x[:, T - 1])


def check_final(system: System, moved_by: torch.Tensor, tol: float, active: torch.Tensor,
                lo: int = 0) -> None:
    """Raise :class:`NotTriangularError` if a final position moved: ``moved_by`` ``(B, n)`` is
    the change of the final positions ``[lo, lo + n)``; by the triangular structure (Song et al.
    2021, Prop. 1-2) none may move by more than ``tol``."""
    moved = ~(moved_by <= tol) & active[:, None]   # NaN moves
    if bool(moved.any()):
        b, t = (int(i) for i in moved.nonzero()[0])
        raise NotTriangularError(
            f"fn is not autoregressive along dim: position {system.unravel_position(lo + t)} of "
            f"sample {system.unravel_sample(b)} changed at iteration {system.iteration} although "
            "every position it may depend on was already final; some position depends on itself "
            f"or on a later one, {NONDETERMINISTIC}")


_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_WRAP = 1 << 64   # the checksums add int64 words, which wrap around modulo 2**64


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(B, n, F)`` (a slice of a contiguous iterate along the positions) viewed as
    integers: 64-bit words where a position fills whole ones, the values' own width otherwise,
    so that no word straddles two positions (the sums are additive over slices)."""
    size = t.element_size()
    if size < 8 and (t.shape[2] * size) % 8 == 0:
        return t.view(torch.int64)
    return t.view(_INT[size])


def checksum(t: torch.Tensor) -> torch.Tensor:
    """The sum of the bit patterns of ``t`` ``(B, n, F)`` (a slice of a contiguous iterate
    along the positions) read as integers, a 0-d tensor: a change of any value changes it,
    except changes that cancel exactly (two values exchanged). One pass over ``t``, without a
    copy. Additive over slices of the same iterate (modulo 2**64): the words never straddle two
    positions (:func:`_words`)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    return _words(t).sum()


def _shares_memory(y: torch.Tensor, x: torch.Tensor) -> bool:
    return y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and \
        y.device == x.device and y.numel() > 0


def _same_positions(y: torch.Tensor, xc: torch.Tensor, lo: int) -> bool:
    """Whether ``y`` (a view of ``xc``'s storage) starts at position ``lo`` of ``xc``: the
    positions it claims to compute are the input's own."""
    return lo < xc.shape[1] and y.data_ptr() == xc[:, lo].data_ptr()


def _unravel(i: int, shape: torch.Size) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return tuple(reversed(out))
