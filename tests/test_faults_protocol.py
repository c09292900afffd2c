"""Fault tests of issue 27 item 6: maps that break a promise of the solver protocols.

Every solver must verify what it certifies: a map whose ``window``, ``update`` or ``propose``
breaks its promise (:mod:`paraprop.solvers.protocols`), or that is not triangular, ends in
:class:`paraprop.ProtocolError` (naming the hook), :class:`paraprop.NotTriangularError`, or
``converged=False``; never in ``converged=True`` with a value that is not the sequential one.
The maps are built from one good triangular map, each with one defect.
"""

from __future__ import annotations

import pytest
import torch

import paraprop
from paraprop.solvers import (
    GSJacobi,
    Jacobi,
    JacobiGS,
    Newton,
    QuasiNewton,
    SlidingJacobi,
    TriangularAnderson,
)
from paraprop.solvers.protocols import (
    SupportsPropose,
    SupportsUpdate,
    SupportsWindow,
    TriangularMap,
)

B, T, F = 3, 12, 2
D = torch.float64


class Good:
    """``fn(x)_t = tanh(W x_<t + c)_t`` (a masked matmul over the flattened positions), with
    correct ``window`` and ``update`` hooks."""

    def __init__(self, device="cpu", gain=0.8, seed=0):
        g = torch.Generator().manual_seed(seed)
        n = T * F
        pos = torch.arange(n) // F
        W = torch.randn(n, n, generator=g, dtype=D) * gain * (pos[:, None] > pos[None, :])
        self.W = W.to(device)
        self.c = torch.randn(n, generator=g, dtype=D).to(device)

    def base(self, x):
        return torch.tanh(x.reshape(x.shape[0], -1) @ self.W.T + self.c).reshape(x.shape)

    def __call__(self, x):
        return self.base(x)

    def window(self, x, start, stop, cache):
        return self.base(x)[:, start:stop], None

    def update(self, x, index):
        return self.base(x).index_select(1, index)


class WindowMutatesFinal(Good):
    def window(self, x, start, stop, cache):
        out = self.base(x)[:, start:stop]
        if start > 0:
            x[:, :start] += 1.0          # a "normalisation" of the cached prefix, in place
        return out, None


class WindowMutatesAhead(Good):
    """Writes its answer into x ahead of the solver: the positions then look unchanged."""

    def window(self, x, start, stop, cache):
        out = self.base(x)[:, start:stop]
        x[:, start:stop] = out
        return out.clone(), None


class WindowShifted(Good):
    def window(self, x, start, stop, cache):
        lo = max(start - 1, 0)        # an off-by-one in the window's position bookkeeping
        return self.base(x)[:, lo:lo + stop - start], None


class WindowStaleCache(Good):
    """Caches every value it computed, final or not, and serves it again."""

    def window(self, x, start, stop, cache):
        cache = {} if cache is None else cache
        out = self.base(x)
        vals = torch.stack([cache.get(t, out[:, t]) for t in range(start, stop)], 1)
        for t in range(start, stop):
            cache.setdefault(t, out[:, t])
        return vals, cache


class WindowIgnoresStart(Good):
    def window(self, x, start, stop, cache):
        return self.base(x)[:, : stop - start], None


class WindowReadsLater(Good):
    """fn is triangular, its window is not: it reads the next position."""

    def window(self, x, start, stop, cache):
        later = 0.3 * torch.tanh(x.roll(-1, 1))
        return (self.base(x) + later)[:, start:stop], None


class WindowReturnsX(Good):
    def window(self, x, start, stop, cache):
        return x[:, start:stop], None


class ProposeMutates(Good):
    def propose(self, x, final):
        x.add_(0.5)
        return None


class ProposeWrongShape(Good):
    def propose(self, x, final):
        return x[:, :1].clone()


class UpdateOnly:
    """The base map with an ``update`` hook only (no ``window``): the hybrids and the sliding
    window then compute with ``update``."""

    def __init__(self, device="cpu"):
        self.good = Good(device)

    def __call__(self, x):
        return self.good.base(x)

    def update(self, x, index):
        return self.good.base(x).index_select(1, index)


class UpdateWrongOrder(UpdateOnly):
    def update(self, x, index):
        return self.good.base(x).index_select(1, index.flip(0))


class UpdateIgnoresIndex(UpdateOnly):
    def update(self, x, index):
        return self.good.base(x)[:, : index.numel()]


class NotTriangular:
    """Position t also reads position t + 1 (no hooks)."""

    def __init__(self, device="cpu"):
        self.good = Good(device)

    def __call__(self, x):
        return self.good.base(x) + 0.3 * torch.tanh(x.roll(-1, 1))


class ReturnsInput:
    def __call__(self, x):
        return x


class MutatesAndReturnsInput:
    def __init__(self, device="cpu"):
        self.good = Good(device)

    def __call__(self, x):
        x.copy_(self.good.base(x))
        return x


class MutatesAndReturnsCopy(MutatesAndReturnsInput):
    def __call__(self, x):
        y = self.good.base(x)
        x.copy_(y)
        return y.clone()


class Noisy:
    """A map whose repeated evaluation differs (what dropout in train mode does)."""

    def __init__(self, device="cpu"):
        self.good = Good(device)
        self.g = torch.Generator(device=device).manual_seed(0)

    def __call__(self, x):
        y = self.good.base(x)
        return y + 1e-3 * torch.rand(y.shape, generator=self.g, dtype=y.dtype, device=y.device)


WINDOWED = [GSJacobi(4), SlidingJacobi(4), SlidingJacobi(None)]
ALL = [Jacobi(), JacobiGS(4), GSJacobi(4), SlidingJacobi(4), SlidingJacobi(None),
       TriangularAnderson()]
FAILURES = (paraprop.ProtocolError, paraprop.NotTriangularError)


def _x0(device="cpu"):
    return torch.zeros(B, T, F, dtype=D, device=device)


def _reference(device="cpu"):
    return paraprop.solve(Good(device), _x0(device), method="sequential", dim=1).value


def _never_silent(fn, method, device="cpu", tol=0.0):
    """Run ``method``; whatever happens, it is an error of the listed kinds, converged=False, or
    the sequential result (tol=0: bitwise; else within 10 tol)."""
    ref = _reference(device)
    try:
        sol = paraprop.solve(fn, _x0(device), method=method, dim=1, tol=tol, throw=False)
    except FAILURES as e:
        return e
    if sol.converged:
        err = float((sol.value - ref).abs().max())
        assert err <= 10 * tol, (type(fn).__name__, repr(method), err)
    return sol


# -- window -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", WINDOWED, ids=repr)
@pytest.mark.parametrize("tol", [0.0, 1e-6])
def test_window_that_mutates_final_positions(method, tol):
    with pytest.raises(paraprop.ProtocolError,
                       match=r"fn.window\(x, start, stop, cache\) modified its input x in place "
                             r"at iteration \d+ \(positions < \d+ of x changed during the "
                             r"call\); a hook must leave the solver's iterate unchanged: compute "
                             r"on a copy"):
        paraprop.solve(WindowMutatesFinal(), _x0(), method=method, dim=1, tol=tol)


@pytest.mark.parametrize("method", WINDOWED, ids=repr)
def test_window_that_writes_its_answer_into_x(method):
    with pytest.raises(paraprop.ProtocolError, match=r"fn.window.* modified its input x"):
        paraprop.solve(WindowMutatesAhead(), _x0(), method=method, dim=1, tol=0)


@pytest.mark.parametrize("method", WINDOWED, ids=repr)
def test_window_that_returns_shifted_positions(method):
    with pytest.raises(paraprop.ProtocolError,
                       match=r"fn.window\(x, start, stop, cache\) and fn\(x\) disagree at "
                             r"position \(\d+,\) of sample \(\d,\) .*not shifted"):
        paraprop.solve(WindowShifted(), _x0(), method=method, dim=1, tol=0)


@pytest.mark.parametrize("method", WINDOWED, ids=repr)
def test_window_that_serves_a_stale_cache(method):
    with pytest.raises(paraprop.NotTriangularError,
                       match=r"the value certified as final at position .* stale cache.*"
                             r"model.eval\(\)"):
        paraprop.solve(WindowStaleCache(), _x0(), method=method, dim=1, tol=0)


@pytest.mark.parametrize("cls", [WindowIgnoresStart, WindowReadsLater])
@pytest.mark.parametrize("method", WINDOWED, ids=repr)
def test_window_that_ignores_start_or_reads_later(cls, method):
    out = _never_silent(cls(), method)
    assert isinstance(out, FAILURES)
    assert "fn.window" in str(out) or "not autoregressive" in str(out)


@pytest.mark.parametrize("method", WINDOWED, ids=repr)
def test_window_that_returns_x_itself(method):
    with pytest.raises(paraprop.NotTriangularError,
                       match=r"fn.window\(x, start, stop, cache\) returned positions of its "
                             r"input x itself"):
        paraprop.solve(WindowReturnsX(), _x0(), method=method, dim=1, tol=0)


@pytest.mark.parametrize("cls", [WindowMutatesFinal, WindowShifted, WindowStaleCache,
                                 WindowIgnoresStart, WindowReadsLater])
@pytest.mark.parametrize("method", [Jacobi(), JacobiGS(4), TriangularAnderson()], ids=repr)
def test_methods_that_do_not_call_window_are_unaffected(cls, method):
    sol = paraprop.solve(cls(), _x0(), method=method, dim=1, tol=0)
    assert torch.equal(sol.value, _reference())


# -- propose ------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [4, None])
def test_propose_that_mutates_x(window):
    with pytest.raises(paraprop.ProtocolError,
                       match=r"fn.propose\(x, final\) modified its input x in place"):
        paraprop.solve(ProposeMutates(), _x0(), method=SlidingJacobi(window), dim=1, tol=0)


class ProposeWritesAhead(Good):
    """Writes guesses into the positions that are not final, in place: like returning them."""

    def propose(self, x, final):
        for b, f in enumerate(final.tolist()):
            x[b, f:] = 0.25
        return None


def test_propose_writing_into_positions_that_are_not_final_is_only_a_guess():
    sol = paraprop.solve(ProposeWritesAhead(), _x0(), method=SlidingJacobi(4), dim=1, tol=0)
    assert sol.converged and torch.equal(sol.value, _reference())


def test_propose_of_the_wrong_shape():
    with pytest.raises(paraprop.ProtocolError,
                       match=r"fn.propose\(x, final\) must return None or a tensor shaped like "
                             r"x \(3, 12, 2\) torch.float64, got \(3, 1, 2\) torch.float64"):
        paraprop.solve(ProposeWrongShape(), _x0(), method=SlidingJacobi(4), dim=1, tol=0)


# -- update -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [UpdateWrongOrder, UpdateIgnoresIndex])
@pytest.mark.parametrize("method", [JacobiGS(4), JacobiGS(5), GSJacobi(4), SlidingJacobi(4)],
                         ids=repr)
def test_update_in_the_wrong_order_or_ignoring_index(cls, method):
    out = _never_silent(cls(), method)
    assert isinstance(out, FAILURES), out


def test_update_disagreeing_with_fn_names_the_hook():
    with pytest.raises(paraprop.ProtocolError,
                       match=r"fn.update\(x, index\) and fn\(x\) disagree at position \(1,\)"):
        paraprop.solve(UpdateIgnoresIndex(), _x0(), method=JacobiGS(4), dim=1, tol=0)


class UpdateDuplicates(UpdateOnly):
    """Returns the second-last position of ``index`` twice (an off-by-one in a gather)."""

    def update(self, x, index):
        idx = index.clone()
        if idx.numel() > 1:
            idx[-1] = idx[-2]
        return self.good.base(x).index_select(1, idx)


# -- at tol > 0 (solve's default is 1e-5): the same maps, the same outcomes -----------------------
HOOK_FAULTS = [WindowShifted, WindowStaleCache, WindowIgnoresStart, WindowReadsLater,
               UpdateWrongOrder, UpdateIgnoresIndex, UpdateDuplicates]


@pytest.mark.parametrize("tol", [1e-5, 1e-3])
@pytest.mark.parametrize("cls", HOOK_FAULTS)
@pytest.mark.parametrize("method", [JacobiGS(4), GSJacobi(4), SlidingJacobi(4),
                                    SlidingJacobi(None)], ids=repr)
def test_broken_hooks_at_tol_above_zero(method, cls, tol):
    """The probe: at tol=1e-5 a shifted window, a stale cache, an update in reversed order or
    with a duplicated index gave converged=True with errors of 1.5 to 2 (the check ran at tol=0
    only). Now: an error, converged=False, or the sequential result within tol."""
    out = _never_silent(cls(), method, tol=tol)
    if isinstance(out, paraprop.Solution) and not out.converged:
        assert out.stats["verification"] == "failed"
        assert "more than a value within tol" in out.stats["not_converged"]


def test_the_probes_shifted_window_at_the_default_tol():
    with pytest.raises(paraprop.ProtocolError,
                       match=r"^fn.window\(x, start, stop, cache\) and fn\(x\) disagree at "
                             r"position \(1,\) of sample \(0,\) \(asked again for positions "
                             r"\(1,\), \(2,\) alone.*not shifted"):
        paraprop.solve(WindowShifted(), _x0(), method="sliding_jacobi", dim=1)


@pytest.mark.parametrize("method", [GSJacobi(4), SlidingJacobi(4)], ids=repr)
def test_a_stale_cache_at_the_default_tol(method):
    with pytest.raises(paraprop.NotTriangularError,
                       match=r"the value certified as final at position \(1,\) .*stale cache"):
        paraprop.solve(WindowStaleCache(), _x0(), method=method, dim=1)


@pytest.mark.parametrize("cls", [UpdateWrongOrder, UpdateDuplicates])
def test_an_update_reordered_or_duplicated_at_the_default_tol(cls):
    with pytest.raises(paraprop.ProtocolError,
                       match=r"^fn.update\(x, index\) and fn\(x\) disagree at position .*not "
                             r"reordered, not duplicated"):
        paraprop.solve(cls(), _x0(), method=SlidingJacobi(4), dim=1)


class FalseSensitivity(Good):
    """States that no position moves another (sensitivity 0): a false bound."""

    def __init__(self):
        super().__init__(gain=1.5)
        self.sensitivity = torch.zeros(B * T, dtype=D)

    def window(self, x, start, stop, cache):
        return self.base(x)[:, start:stop], None


@pytest.mark.parametrize("window", [4, None])
@pytest.mark.parametrize("tol", [1e-5, 1e-3])
def test_a_false_sensitivity_is_not_certified(window, tol):
    """The probe: sensitivity = 0 froze every window after one sweep, converged=True with an
    error of 2. The residual at the final value contradicts the bound: not converged."""
    fn = FalseSensitivity()
    sol = paraprop.solve(fn, _x0(), method=SlidingJacobi(window), dim=1, tol=tol, throw=False)
    assert not sol.converged and sol.stats["verification"] == "failed"
    assert "the bounds that fn.sensitivity states" in sol.stats["not_converged"]
    with pytest.raises(paraprop.ConvergenceError,
                       match=r"did not converge: fn\(x\) at the final value differs from it at "
                             r"position \(1,\) of sample \(0,\) .* more than a value within "
                             r"tol=.* of the sequential result can .*fn.sensitivity states"):
        paraprop.solve(fn, _x0(), method=SlidingJacobi(window), dim=1, tol=tol)
    # a true statement (no sensitivity stated: the plain estimate) is certified
    del fn.sensitivity
    ref = paraprop.solve(fn, _x0(), method="sequential", dim=1).value
    sol = paraprop.solve(fn, _x0(), method=SlidingJacobi(window), dim=1, tol=tol)
    assert sol.converged and float((sol.value - ref).abs().max()) <= 10 * tol


# -- non-finite values: the message says what the solver knows -----------------------------------
class WindowWritesNaNAhead(Good):
    """Scribbles NaN on the positions after its window (a buffer overrun); the map's masked
    product then carries it to every earlier position."""

    def window(self, x, start, stop, cache):
        out = self.base(x)[:, start:stop].clone()
        x[:, stop:] = float("nan")
        return out, None


class UpdateReturnsNaN(UpdateOnly):
    def update(self, x, index):
        y = self.good.base(x).index_select(1, index).clone()
        y[1, 0] = float("nan")
        return y


@pytest.mark.parametrize("method", [GSJacobi(4), SlidingJacobi(4)], ids=repr)
def test_nan_written_ahead_by_a_window_is_not_blamed_on_the_map(method):
    """The probe: gs_jacobi said "computed from final positions only, so the sequential loop
    produces it too", which was false (the window wrote NaN into x after itself)."""
    with pytest.raises(paraprop.NonFiniteError,
                       match=r"^fn.window\(x, start, stop, cache\) returned a non-finite value at "
                             r"iteration \d+, sample \(0,\), position \(\d+,\), the first "
                             r"position that is not final, from an iterate that held NaN or inf at "
                             r"a later position, \(\d+,\).*fn.window\(x, start, stop, cache\) "
                             r"wrote it into x") as e:
        paraprop.solve(WindowWritesNaNAhead(), _x0(), method=method, dim=1, tol=0)
    assert "produces it too" not in str(e.value)


@pytest.mark.parametrize("method", [GSJacobi(4), SlidingJacobi(4), JacobiGS(4)], ids=repr)
def test_nan_returned_by_a_hook_names_the_hook(method):
    with pytest.raises(paraprop.NonFiniteError,
                       match=r"^fn.update\(x, index\) returned a non-finite value at iteration "
                             r"1, sample \(1,\), position \(0,\), the first position that is not "
                             r"final, from final and finite inputs: the sequential loop meets it "
                             r"too if fn.update\(x, index\) computes fn's values there") as e:
        paraprop.solve(UpdateReturnsNaN(), _x0(), method=method, dim=1, tol=0)
    assert "produces it too" not in str(e.value)


# -- fn itself ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ALL + [Newton(), QuasiNewton()], ids=repr)
def test_a_map_that_is_not_triangular(method):
    with pytest.raises(paraprop.NotTriangularError,
                       match=r"depends on itself or on a later one.*model.eval\(\)"):
        paraprop.solve(NotTriangular(), _x0(), method=method, dim=1, tol=0)


@pytest.mark.parametrize("method", ALL, ids=repr)
def test_a_map_that_returns_its_input(method):
    with pytest.raises(paraprop.NotTriangularError,
                       match=r"fn\(x\) returned positions of its input x itself"):
        paraprop.solve(ReturnsInput(), _x0(), method=method, dim=1, tol=0)


@pytest.mark.parametrize("cls", [MutatesAndReturnsInput, MutatesAndReturnsCopy])
@pytest.mark.parametrize("method", ALL, ids=repr)
def test_a_map_that_writes_into_its_input(cls, method):
    with pytest.raises(paraprop.ProtocolError,
                       match=r"^fn\(x\) modified its input x in place at iteration 1 \(x "
                             r"changed during the call\)"):
        paraprop.solve(cls(), _x0(), method=method, dim=1, tol=0)


@pytest.mark.parametrize("method", ALL, ids=repr)
def test_a_map_whose_repeated_evaluation_differs(method):
    out = _never_silent(Noisy(), method)
    if isinstance(out, paraprop.NotTriangularError):
        assert "model.eval()" in str(out)
    else:
        assert isinstance(out, paraprop.Solution) and not out.converged


def test_a_module_in_train_mode_is_refused():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.good = Good()
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(self.good.base(x))

    net = Net()
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"^solve: fn is in train mode.*Dropout.*call fn.eval\(\) first"):
        paraprop.solve(net, _x0(), method="jacobi", dim=1)
    net.eval()
    assert torch.equal(paraprop.solve(net, _x0(), method="jacobi", dim=1, tol=0).value,
                       _reference())


# -- sensitivity, growth, linearize, newton_step -----------------------------------------------
@pytest.mark.parametrize(("name", "value", "got"), [
    ("sensitivity", torch.ones(B, T - 1), r"a torch.float32 tensor of shape \(3, 11\)"),
    ("sensitivity", [1.0] * (B * T), "list"),
    ("growth", torch.ones(B * T, dtype=torch.long), r"a torch.int64 tensor of shape \(36,\)"),
])
def test_sensitivity_and_growth_of_the_wrong_kind(name, value, got):
    fn = Good()
    setattr(fn, name, value)
    with pytest.raises(paraprop.ProtocolError,
                       match=rf"fn.{name} must be None or a floating-point tensor of batch x "
                             rf"positions = 3 x 12 values, got {got}"):
        paraprop.solve(fn, _x0(), method=SlidingJacobi(4), dim=1, tol=1e-6)


class _Markov:
    """A Markov map for the Newton family, whose hooks return what ``bad`` says."""

    markov = True

    def __init__(self, bad):
        self.bad, self.W = bad, torch.eye(F, dtype=D) * 0.5
        self.shape = (B, T, F)
        self.dtype = D

    def __call__(self, x):
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        return torch.tanh(prev @ self.W.T + 1)

    def linearize(self, x, lo, form):
        y = self(x)[:, lo:]
        J = torch.zeros(*y.shape, F, dtype=D)
        if self.bad == "shape":
            return y[:, 1:], J
        if self.bad == "view":
            return x[:, lo:], J
        return y

    def newton_step(self, x, lo, form):
        return "junk" if self.bad == "newton_step" else None


@pytest.mark.parametrize(("bad", "match"), [
    ("shape", r"fn.linearize\(x, lo, form\) must return values of shape \(3, 12, 2\) and dtype "
              r"torch.float64 \(positions lo..T-1\), got \(3, 11, 2\) torch.float64"),
    ("view", r"fn.linearize\(x, lo, form\) returned a view of its input x"),
    ("tuple", r"fn.linearize\(x, lo, form\) must return a tuple \(values, jacobians\), got "
              r"Tensor"),
    ("newton_step", r"fn.newton_step\(x, lo, form\) must return None or a tuple \(values, "
                    r"trial\), got str"),
])
def test_newton_hooks_that_break_their_promise(bad, match):
    with pytest.raises(paraprop.ProtocolError, match=match):
        paraprop.solve(_Markov(bad), _x0(), method="newton", dim=1)


# -- what a good map costs and gets -------------------------------------------------------------
@pytest.mark.parametrize("tol", [0.0, 1e-6, 1e-300])
@pytest.mark.parametrize("method", ALL + [Newton()], ids=repr)
def test_a_good_map_is_certified_within_the_sequential_loops_calls(method, tol, device):
    fn = Good(device)
    ref = _reference(device)
    sol = paraprop.solve(fn, _x0(device), method=method, dim=1, tol=tol)
    assert sol.converged and (torch.equal(sol.value, ref) if tol == 0 else
                              float((sol.value - ref).abs().max()) <= tol)
    # the methods that certify by reasoning, with the hooks' values, pay one evaluation of fn,
    # at every tol; the others check themselves (their certificate comes from fn's values)
    extra = isinstance(method, GSJacobi | SlidingJacobi | JacobiGS)
    assert sol.stats["verification"] == ("evaluation" if extra else "iterations")
    if tol == 0:    # the verification costs at most one evaluation over the same solve unchecked
        free = paraprop.solve(fn, _x0(device), method=method, dim=1, tol=1e-300,
                              max_iters=sol.iterations, throw=False)
        assert sol.evaluations <= free.evaluations + extra
    # and never more calls in sequence than the sequential loop
    assert sol.evaluations <= T and sol.stats["sequential_steps"] <= T


def test_the_protocols_describe_the_hooks():
    assert isinstance(Good(), TriangularMap)
    assert isinstance(Good(), SupportsWindow) and isinstance(Good(), SupportsUpdate)
    assert isinstance(ProposeMutates(), SupportsPropose)
    assert not isinstance(NotTriangular(), SupportsWindow)


def test_the_verification_at_tol_zero_is_not_fooled_by_huge_errors():
    """The issue's SlidingJacobi reported converged=True with errors of 1 to 968: a window
    that scales the values it serves from its cache."""

    class Scaled(Good):
        def window(self, x, start, stop, cache):
            vals = self.base(x)[:, start:stop]
            return vals * (1 if cache is None else 968.0), True

    out = _never_silent(Scaled(), SlidingJacobi(4))
    assert isinstance(out, FAILURES)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=str)
@pytest.mark.parametrize("F", [1, 2, 3, 4, 8])
def test_the_checksum_adds_up_over_slices_and_sees_a_change(dtype, F):
    """The guard of the windows keeps the checksum of the final prefix from call to call and
    adds the positions that became final since: the checksum of slices must add up."""
    from paraprop.solvers.triangular import checksum

    x = torch.randn(3, 10, F).to(dtype)
    for a, b in ((0, 10), (3, 7), (1, 2), (4, 4)):
        assert int(checksum(x[:, :a]) + checksum(x[:, a:b])) == int(checksum(x[:, :b]))
    y = x.clone()
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()]
    y.view(bits)[2, 9, F - 1] += 1   # one unit in the last place of one value
    assert int(checksum(y)) != int(checksum(x))


class ShiftByView(Good):
    """``fn(x)_t = x_{t-1}`` (0 at t = 0), hooks returning views of x where they can: a
    triangular map whose window and update alias x legitimately."""

    def __call__(self, x):
        return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)

    def window(self, x, start, stop, cache):
        if start == 0:
            return self(x)[:, :stop], None
        return x[:, start - 1:stop - 1], None

    def update(self, x, index):
        if int(index[0]) > 0 and bool((index[1:] - index[:-1] == 1).all()):
            return x[:, int(index[0]) - 1:int(index[-1])]
        return self(x).index_select(1, index)


@pytest.mark.parametrize("method", ALL + ["sequential"], ids=repr)
def test_hooks_may_return_views_of_other_positions(method):
    x0 = torch.randn(B, T, F, dtype=D, generator=torch.Generator().manual_seed(0))
    sol = paraprop.solve(ShiftByView(), x0, method=method, dim=1, tol=0)
    assert sol.converged and torch.equal(sol.value, torch.zeros_like(x0))


@pytest.mark.parametrize(("name", "value", "low"), [("sensitivity", -0.5, "< 0"),
                                                   ("growth", 0.0, "<= 0")])
def test_a_negative_sensitivity_or_zero_growth_is_refused(name, value, low):
    fn = Good()
    bound = torch.ones(B, T, dtype=D)
    bound[1, 3] = value
    setattr(fn, name, bound)
    with pytest.raises(paraprop.ProtocolError,
                       match=rf"^fn.{name} must state upper bounds of sizes \(NaN where unknown\), "
                             rf"got {value:g} {low} at position \(3,\) of sample \(1,\)"):
        paraprop.solve(fn, _x0(), method=SlidingJacobi(4), dim=1, tol=1e-6)
