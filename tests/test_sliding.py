"""SlidingJacobi and the cached-prefix protocol (``fn.window(x, start, stop, cache)``)."""

from __future__ import annotations

import pytest
import torch

import paraprop
from paraprop.solvers import Jacobi, SlidingJacobi
from paraprop_lab.experiments.core import made_problem
from problems import TOLERANCES, FastTriangular, RandomTriangular


class RunningMean:
    """``x_t = tanh(a * mean(x_<t) + c_t)`` per feature: position ``t`` reads every earlier one.

    ``window`` keeps the running sum of the final prefix as its cache, so a window costs only its
    own positions plus the positions that became final since the last call. It records what it
    computed and checks the driver's promise that the positions below ``start`` are final (they
    never change once cached).
    """

    def __init__(self, B=3, T=40, F=2, seed=0, dtype=torch.float64, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.a = 2.5
        self.c = torch.randn(T, F, generator=g, dtype=dtype).to(device)
        self.shape = (B, T, F)
        self.computed = 0      # window positions evaluated
        self.extended = 0      # prefix positions folded into the cache
        self.calls = []

    def __call__(self, x):
        T = x.shape[-2]
        csum = torch.cat([torch.zeros_like(x[..., :1, :]),      # sum over s < t, exactly
                          torch.cumsum(x[..., :-1, :], dim=-2)], dim=-2)
        n = torch.arange(T, dtype=x.dtype, device=x.device).clamp(min=1)[:, None]
        return torch.tanh(self.a * csum / n + self.c)

    def window(self, x, start, stop, cache):
        if cache is None:
            cache = {"upto": 0, "sum": torch.zeros_like(x[:, 0]), "prefix": x[:, :0].clone()}
        upto = cache["upto"]
        assert upto <= start, "the driver moved start backwards"
        # the promise: what was cached as final is still there, unchanged
        assert torch.equal(x[:, :upto], cache["prefix"]), "a final position changed"
        s = cache["sum"] + x[:, upto:start].sum(dim=1)
        self.extended += start - upto
        self.computed += stop - start
        self.calls.append((start, stop))
        seg = x[:, start:stop]
        csum = s[:, None] + torch.cumsum(seg, dim=1) - seg
        n = torch.arange(start, stop, dtype=x.dtype, device=x.device).clamp(min=1)[:, None]
        vals = torch.tanh(self.a * csum / n + self.c[start:stop])
        return vals, {"upto": start, "sum": s, "prefix": x[:, :start].clone()}

    def sequential(self):
        x = torch.zeros(self.shape, dtype=self.c.dtype, device=self.c.device)
        for t in range(self.shape[1]):
            x[:, t] = self(x)[:, t]
        return x


class NoWindow:
    """The same map without the protocol (a plain callable)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, x):
        return self.inner(x)


def _bitwise_or_rounding(sol, ref):
    """tol=0: converged means fn's sequential result bitwise; a window or update path that
    rounds differently from fn is found by the evaluation of fn at the end (not converged,
    the reason given)."""
    if sol.converged:
        assert torch.equal(sol.value, ref)
    else:
        assert sol.stats["verification"] == "failed"
        assert "by rounding only" in sol.stats["not_converged"]
    assert float((sol.value - ref).abs().max()) <= TOLERANCES[torch.float64]["max_err"]


@pytest.mark.parametrize("window", [1, 2, 7, 40])
@pytest.mark.parametrize("protocol", [True, False])
def test_sliding_equals_sequential(window, protocol, device):
    m = RunningMean(device=device)
    fn = m if protocol else NoWindow(m)
    x0 = torch.zeros(m.shape, dtype=torch.float64, device=device)
    ref = paraprop.solve(fn, x0, method="sequential", dim=-2).value
    sol = paraprop.solve(fn, x0, method=SlidingJacobi(window), dim=-2, tol=0, throw=False)
    assert sol.iterations <= m.shape[1]
    if protocol:  # the running sum of the window rounds differently from the full pass
        _bitwise_or_rounding(sol, ref)
    else:         # the same evaluations: bitwise
        assert sol.converged and torch.equal(sol.value, ref)
    assert float((sol.value - m.sequential()).abs().max()) <= 1e-12
    if window == 1:   # one position per sweep: sequential evaluation
        assert sol.iterations == m.shape[1]
    # tol at the rounding level certifies it
    ok = paraprop.solve(fn, x0, method=SlidingJacobi(window), dim=-2, tol=1e-12)
    assert float((ok.value - ref).abs().max()) <= 1e-12


@pytest.mark.parametrize("window", [1, 2, 7, 40])
def test_protocol_computes_only_the_window_and_extends_the_cache_once(window):
    m = RunningMean()
    x0 = torch.zeros(m.shape, dtype=torch.float64)
    sol = paraprop.solve(m, x0, method=SlidingJacobi(window), dim=-2, tol=0, throw=False)
    T = m.shape[1]
    # the windows, plus one evaluation of fn (all T positions) that checks the value: after
    # the windows, or as the last call where the windows took T - 1 (never more than T calls)
    assert m.computed + T == sol.stats["positions"]
    assert all(stop - start <= window for start, stop in m.calls)
    last = sol.stats.get("finished_sequentially", 0)
    assert sol.evaluations == len(m.calls) + 1 == sol.iterations + 1 - last <= T
    assert m.extended <= T          # each final position is folded in at most once
    starts = [s for s, _ in m.calls]
    assert starts == sorted(starts)
    if window < T:   # fewer positions than plain Jacobi to the same point
        jac = paraprop.solve(NoWindow(m), x0, method=Jacobi(), dim=-2, tol=0)
        assert sol.stats["positions"] < jac.stats["positions"]
    # with tol > 0 too: the value is checked against the certificate by one evaluation
    m2 = RunningMean()
    sol = paraprop.solve(m2, x0, method=SlidingJacobi(window), dim=-2, tol=1e-12)
    assert m2.computed + T == sol.stats["positions"] and sol.evaluations == len(m2.calls) + 1
    assert sol.evaluations <= T and sol.stats["verification"] == "evaluation"


@pytest.mark.parametrize("window", [1, 2, 7, 13])
@pytest.mark.parametrize("fast", [True, False])
def test_random_triangular_maps(window, fast):
    cls = FastTriangular if fast else RandomTriangular
    prob = cls((2, 3), (13,), (2,), seed=window)
    x0 = prob.x0()
    ref = prob.reference(x0)
    sol = paraprop.solve(prob, x0, method=SlidingJacobi(window), dim=2, tol=0, throw=False)
    if fast:
        _bitwise_or_rounding(sol, ref)
    else:
        assert sol.converged and torch.equal(sol.value, ref)
    for tol in (1e-3, 1e-6):
        approx = paraprop.solve(prob, x0, method=SlidingJacobi(window), dim=2, tol=tol)
        assert float((approx.value - ref).abs().max()) <= 10 * tol


def test_per_sample_progress_and_counters():
    prob = FastTriangular((4,), (30,), (), seed=2, scale=[0.1, 0.5, 1.0, 3.0])
    x0 = prob.x0()
    sol = paraprop.solve(prob, x0, method=SlidingJacobi(8), dim=1, tol=0, throw=False)
    it = sol.stats["sample_iterations"]
    assert it.shape == (4,) and int(it.max()) == sol.iterations
    assert sol.stats["window"] == 8
    assert sol.stats["error_estimate"] == (0.0 if sol.converged else float("inf"))
    _bitwise_or_rounding(sol, prob.reference(x0))


def test_made_shaped_map_fewer_positions_than_jacobi():
    """The issue's target problem at a small size: fewer positions than Jacobi, the same result
    to rounding (its fast path may round row subsets differently from the full pass)."""
    m, x0, _ = made_problem(64, (64, 64), 8)
    m = m.double().bind(m.z.double())
    x0 = x0.double()
    ref = paraprop.solve(m, x0, method="sequential")
    sl = paraprop.solve(m, x0, method=SlidingJacobi(16), tol=0, throw=False)
    jac = paraprop.solve(m, x0, method="jacobi", tol=0)
    assert float((sl.value - ref.value).abs().max()) <= TOLERANCES[torch.float64]["max_err"]
    assert sl.converged or "by rounding only" in sl.stats["not_converged"]
    assert sl.stats["positions"] < jac.stats["positions"]


def test_window_protocol_errors():
    class Bad:
        def __call__(self, x):
            return x

        def window(self, x, start, stop, cache):
            return x[:, start:stop]        # not a (values, cache) tuple

    with pytest.raises(TypeError, match=r"fn.window\(x, start, stop, cache\) must return a "
                                        r"tuple \(values, cache\), got Tensor"):
        paraprop.solve(Bad(), torch.zeros(2, 5, 1), method=SlidingJacobi(2), dim=-2)

    class Short(Bad):
        def window(self, x, start, stop, cache):
            return x[:, start:start + 1], None

    with pytest.raises(ValueError, match=r"fn.window\(x, start, stop, cache\) returned shape"):
        paraprop.solve(Short(), torch.zeros(2, 5, 1), method=SlidingJacobi(3), dim=-2)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_window_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"SlidingJacobi: window must be a positive int or None"):
        SlidingJacobi(bad)


class _Guessing:
    """``x_t = (3 * sum_{s<t} x_s + t) mod 11``: exact in float64 (small integers), so a right
    guess is bitwise right. ``propose`` returns ``guess(x)``; it checks the driver's arguments."""

    def __init__(self, guess, B=3, T=40):
        self.guess, self.shape, self.proposals = guess, (B, T, 1), 0

    def __call__(self, x):
        csum = torch.cumsum(x, dim=-2) - x
        t = torch.arange(x.shape[-2], dtype=x.dtype, device=x.device)[:, None]
        return torch.remainder(3 * csum + t, 11)

    def window(self, x, start, stop, cache):
        return self(x)[:, start:stop], None

    def propose(self, x, final):
        self.proposals += 1
        assert final.shape == (x.shape[0],) and bool((final < x.shape[1]).all())
        return self.guess(x)


@pytest.mark.parametrize("window", [4, 40])
def test_guesses_never_change_the_result(window, device):
    def zeros(fn):
        return torch.zeros(fn.shape, dtype=torch.float64, device=device)

    ref = _Guessing(lambda x: None)
    exact = paraprop.solve(ref, zeros(ref), method="sequential", dim=-2).value
    junk = _Guessing(lambda x: torch.full_like(x, 7.0))
    sol = paraprop.solve(junk, zeros(junk), method=SlidingJacobi(window), dim=-2, tol=0)
    assert junk.proposals > 0 and sol.converged
    assert torch.equal(sol.value, exact)
    # the right answer as the guess: every window is accepted in one sweep
    oracle = _Guessing(lambda x: exact.clone())
    good = paraprop.solve(oracle, zeros(oracle), method=SlidingJacobi(window), dim=-2, tol=0)
    assert torch.equal(good.value, exact)
    assert good.iterations <= -(-40 // window) + 1 < sol.iterations


def test_bad_guess_is_refused():
    bad = _Guessing(lambda x: torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"fn.propose\(x, final\) must return None or a tensor"):
        paraprop.solve(bad, torch.zeros(bad.shape, dtype=torch.float64),
                       method=SlidingJacobi(8), dim=-2, tol=0)
    nan = _Guessing(lambda x: torch.full_like(x, float("nan")))
    with pytest.raises(paraprop.ProtocolError,
                       match=r"^fn.propose\(x, final\) returned NaN or inf at iteration 1, "
                             r"sample \(0,\), position \(\d+,\): guesses must be finite"):
        paraprop.solve(nan, torch.zeros(nan.shape, dtype=torch.float64),
                       method=SlidingJacobi(8), dim=-2, tol=0)


# -- the freeze rule: the error growth stated to the solver or by the map -------------------------
class _Grows:
    """``x_t = 0.5 tanh(x_{t-1}) + c_t``, with ``growth`` (when stated) an upper bound of how much
    an error at each position grows by the end, deliberately loose: ``2 ** (T - 1 - t)``."""

    def __init__(self, T, B, stated):
        self.T = T
        self.c = torch.randn(T, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        if stated:
            self.growth = self.stated(B)

    def stated(self, B):
        return (2.0 ** torch.arange(self.T - 1, -1, -1, dtype=torch.float64)).repeat(B)

    def __call__(self, x):
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        return 0.5 * torch.tanh(prev) + self.c

    def window(self, x, start, stop, cache):
        return self(x)[:, start:stop], None


@pytest.mark.parametrize("window", [3, 8])
@pytest.mark.parametrize("tol", [1e-3, 1e-6])
def test_a_growth_stated_to_the_rule_is_the_growth_stated_by_the_map(window, tol):
    """``SlidingJacobi(w, freeze=FreezeRule(growth=g))`` on a map without hooks solves exactly
    as the same map stating ``fn.growth = g``: the same iterate, counters and estimate, within
    tol of the sequential result; and a stated growth does change the freezes (the same map
    stating none computes no more positions, and freezes otherwise)."""
    B, T = 2, 24
    x0 = torch.zeros(B, T, 1, dtype=torch.float64)
    hooked = _Grows(T, B, stated=True)
    plain = _Grows(T, B, stated=False)
    ref = paraprop.solve(plain, x0, method="sequential", dim=1).value
    a = paraprop.solve(hooked, x0, method=SlidingJacobi(window), dim=1, tol=tol)
    rule = paraprop.solvers.FreezeRule(growth=plain.stated(B))
    b = paraprop.solve(plain, x0, method=SlidingJacobi(window, freeze=rule), dim=1, tol=tol)
    assert a.converged and b.converged
    assert torch.equal(a.value, b.value)
    assert (a.iterations, a.evaluations, a.stats["error_estimate"]) == \
        (b.iterations, b.evaluations, b.stats["error_estimate"])
    assert float((b.value - ref).abs().max()) <= tol
    free = paraprop.solve(plain, x0, method=SlidingJacobi(window), dim=1, tol=tol)
    assert free.stats["positions"] <= b.stats["positions"]
    assert (free.stats["positions"], free.stats["error_estimate"]) != \
        (b.stats["positions"], b.stats["error_estimate"])


def test_the_freeze_rule_refuses_what_is_no_growth():
    """A growth that is not a float tensor is refused at once, one of the wrong size or a
    negative one when the solve reads it, each naming ``FreezeRule(growth=...)``."""
    with pytest.raises(TypeError, match="growth must be None or a floating-point tensor"):
        paraprop.solvers.FreezeRule(growth=[1.0, 2.0])
    with pytest.raises(TypeError, match="freeze must be a paraprop.solvers.FreezeRule"):
        SlidingJacobi(4, freeze="growth")
    B, T = 2, 10
    fn = _Grows(T, B, stated=False)
    x0 = torch.zeros(B, T, 1, dtype=torch.float64)
    short = paraprop.solvers.FreezeRule(growth=torch.ones(T))
    with pytest.raises(ValueError, match=r"FreezeRule\(growth=\.\.\.\) must be None or .* "
                                         r"2 x 10 values, got .* shape \(10,\)"):
        paraprop.solve(fn, x0, method=SlidingJacobi(4, freeze=short), dim=1, tol=1e-3)
    negative = paraprop.solvers.FreezeRule(growth=-torch.ones(B * T, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"FreezeRule\(growth=\.\.\.\) must state upper bounds"):
        paraprop.solve(fn, x0, method=SlidingJacobi(4, freeze=negative), dim=1, tol=1e-3)
    assert "freeze=FreezeRule(growth=...)" in repr(SlidingJacobi(4, freeze=short))


def _accumulating(T=200, d=8, seed=1, shift=0.0):
    """``h_t = h_{t-1} + tanh(W h_{t-1} + b) / T``: small steps that accumulate, and expand
    differences by up to ``1 + |W|_inf / T`` a step (``e`` ~ 57 over the chain here)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d, d, generator=g, dtype=torch.float64) / d ** 0.5
    b = torch.randn(d, generator=g, dtype=torch.float64)
    b = b + shift * torch.randn(d, generator=torch.Generator().manual_seed(99), dtype=b.dtype)
    h0 = torch.randn(d, generator=g, dtype=torch.float64)

    def fn(x):
        prev = torch.cat([h0.expand(x.shape[0], 1, d), x[:, :-1]], dim=1)
        return prev + torch.tanh(prev @ W.T + b) / T

    return fn, float(W.abs().sum(1).max())


def _warm_started_accumulating(T=200, B=2):
    fn, lip = _accumulating(T)
    near, _ = _accumulating(T, shift=0.01)    # a nearby problem's result as the initial guess
    zeros = torch.zeros(B, T, 8, dtype=torch.float64)
    x0 = paraprop.solve(near, zeros, method="sequential", dim=-2).value
    ref = paraprop.solve(fn, zeros, method="sequential", dim=-2).value
    return fn, lip, x0, ref


def test_an_accumulating_map_with_its_growth_stated_stays_within_tol():
    # (review s35) with the growth stated the freezes fit their shares after it
    fn, lip, x0, ref = _warm_started_accumulating()
    T, tol = x0.shape[1], 1e-2
    growth = (1 + lip / T) ** torch.arange(T - 1, -1, -1, dtype=torch.float64)
    rule = paraprop.solvers.FreezeRule(growth=growth.expand(x0.shape[0], T).contiguous())
    sol = paraprop.solve(fn, x0, method=SlidingJacobi(64, freeze=rule), dim=-2, tol=tol)
    assert sol.converged
    assert float((sol.value - ref).abs().max()) <= tol


def test_an_accumulating_map_without_a_stated_growth_stays_within_tol():
    """(review s35: converged=True at 1.39 tol) the default rule now measures the gains between
    sweeps: no freeze on an estimate before one is observed, and the freezes' estimates and
    the growth after them take the observed gains above 1."""
    fn, _, x0, ref = _warm_started_accumulating()
    tol = 1e-2
    sol = paraprop.solve(fn, x0, method=SlidingJacobi(64), dim=-2, tol=tol, throw=False)
    assert sol.converged and float((sol.value - ref).abs().max()) <= tol


def _scaled_accumulating(scale, seed, T=200, d=8, B=2, pert=0.0, dtype=torch.float64):
    """The accumulating map with ``|W|`` scaled (``h_t = h_{t-1} + tanh(W h_{t-1} + b) / T``),
    and ``b`` perturbed by ``pert`` for a nearby problem's result, the warm start."""
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(d, d, generator=g, dtype=torch.float64) * scale / d ** 0.5).to(dtype)
    b = torch.randn(d, generator=g, dtype=torch.float64)
    b = (b + pert * torch.randn(d, generator=torch.Generator().manual_seed(99),
                                dtype=torch.float64)).to(dtype)
    h0 = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)

    def fn(x):
        prev = torch.cat([h0.expand(x.shape[0], 1, d), x[:, :-1]], dim=1)
        return prev + torch.tanh(prev @ W.T + b) / T

    return fn


def _warm(scale, seed, pert, dtype=torch.float64):
    z = torch.zeros(2, 200, 8, dtype=dtype)
    ref = paraprop.solve(_scaled_accumulating(scale, seed, dtype=dtype), z,
                         method="sequential", dim=-2).value
    x0 = paraprop.solve(_scaled_accumulating(scale, seed, pert=pert, dtype=dtype), z,
                        method="sequential", dim=-2).value
    return _scaled_accumulating(scale, seed, dtype=dtype), x0, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("pert", "tol"), [(0.01, 1e-3), (0.1, 1e-2)])
def test_jacobi_from_a_warm_start_on_an_accumulating_map_stays_within_tol(dtype, pert, tol):
    """(review s35) the contraction estimate alone stopped these at 12.8x and 9.7x tol (the
    error is a ramp along the positions; the whole-sample ratios fall below 1 while it stays);
    the accumulation check holds the stops back."""
    fn, x0, ref = _warm(6.0, 0, pert, dtype)
    sol = paraprop.solve(fn, x0, method="jacobi", dim=-2, tol=tol, throw=False)
    assert sol.converged and sol.stats.get("held", 0) > 0
    assert float((sol.value - ref).abs().max()) <= tol


def test_jacobi_on_a_contracting_map_still_stops_early():
    """The check carries the changes through gains below 1: a contracting map stops early."""
    W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    W = 0.3 * W / W.abs().sum(1, keepdim=True)

    def fn(x):
        prev = torch.cat([torch.ones_like(x[:, :1]), x[:, :-1]], dim=1)
        return torch.tanh(prev @ W.T + 0.5)

    x0 = torch.zeros(2, 300, 8, dtype=torch.float64)
    ref = paraprop.solve(fn, x0, method="sequential", dim=-2).value
    sol = paraprop.solve(fn, x0, method="jacobi", dim=-2, tol=1e-6)
    assert sol.iterations < 30 and float((sol.value - ref).abs().max()) <= 1e-6


@pytest.mark.xfail(strict=True, reason="known gap: the gains observed along the sweeps' changes "
                   "(0.996 a step here) are below those along the error's direction (1.008), "
                   "which 200 steps compound: converged=True at 1.28x tol")
def test_jacobi_accumulation_check_with_gains_seen_too_low():
    fn, x0, ref = _warm(6.0, 0, 0.01)
    sol = paraprop.solve(fn, x0, method="jacobi", dim=-2, tol=1e-2, throw=False)
    assert not sol.converged or float((sol.value - ref).abs().max()) <= 1e-2


def test_jacobi_without_the_accumulation_check_is_the_contraction_rule_alone():
    """Jacobi(accumulation=False) is for a caller whose own final check certifies (the
    diffusion certificate): on the warm-started accumulating map it stops early, off by more
    than tol, as the contraction estimate alone did; a bad flag is refused by name."""
    fn, x0, ref = _warm(6.0, 0, 0.01)
    sol = paraprop.solve(fn, x0, method=paraprop.solvers.Jacobi(accumulation=False), dim=-2,
                         tol=1e-3, throw=False)
    assert sol.iterations < 200 and float((sol.value - ref).abs().max()) > 1e-3
    assert repr(paraprop.solvers.Jacobi(accumulation=False)) == "Jacobi(accumulation=False)"
    with pytest.raises(TypeError, match="Jacobi: accumulation"):
        paraprop.solvers.Jacobi(accumulation="yes")
