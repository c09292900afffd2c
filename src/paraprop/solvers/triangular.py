"""The triangular system ``x = fn(x)`` as the solvers see it: one checked door to ``fn``.

A feedforward computation ``s_t = f_t(s_<t)`` over ``T`` positions is the triangular system
``x = fn(x)`` (Song et al. 2021, eq. 2). :class:`System` is that system seen in a canonical layout
``(B, T, F)``: ``B`` independent samples (the flattened leading dims), ``T`` positions (the
flattened autoregressive dims, row-major), ``F`` values per position (the flattened trailing dims).
Solvers work on the canonical layout; ``fn`` always sees the caller's shape. Every call of ``fn``
or of one of its hooks goes through :class:`System`, which counts it and checks the cheap
promises of :mod:`paraprop.solvers.protocols` on the way (:func:`checksum` guards the iterate),
and deals with NaN and inf in what the call returned.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

from paraprop.errors import NonFiniteError, NotTriangularError, ProtocolError
from paraprop.solvers.protocols import HOOKS

__all__ = ["System", "checksum"]


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
        # (lo, checksum of the final positions < lo), see _call
        self._prefix: tuple[int, int | torch.Tensor | None] = (0, None)
        # the checksums' words (see _words) and whether the iterate is on the host
        size = dtype.itemsize
        self._word = torch.int64 if size < 8 and (self.F * size) % 8 == 0 else _INT[size]
        self._device = None if device is None else torch.device(device)
        self._host = None if self._device is None else self._device.type == "cpu"

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

    def keep_finite(self, new: torch.Tensor, old: torch.Tensor | Callable[..., torch.Tensor],
                    first, positions: torch.Tensor,
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
