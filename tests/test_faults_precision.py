"""Fault tests of issue 27 item 3 for ``paraprop.solve``: low precision (bf16, fp16).

The rules: ``tol=0`` is bitwise the sequential result, or ``converged=False``; a ``tol > 0``
certificate accounts for the dtype's rounding (never ``converged=True`` when the estimate cannot
be certified below ``tol`` in that precision); a NaN or inf computed from iterates that are not
final is not the map's (fp16 Jacobi iterates overflow where the sequential loop stays finite),
only one computed from final positions is a :class:`paraprop.NonFiniteError`.

Each map is built to break something: an accumulating residual stack, a chain whose Jacobi
iterates overflow fp16, hooks that round differently from ``fn`` in low precision.
"""

from __future__ import annotations

import math

import pytest
import torch

import paraprop
from paraprop.solvers import (
    ELK,
    GSJacobi,
    Jacobi,
    JacobiGS,
    Newton,
    QuasiELK,
    QuasiNewton,
    SlidingJacobi,
    TriangularAnderson,
)

LOW = [torch.bfloat16, torch.float16]
JACOBI_FAMILY = [Jacobi(), JacobiGS(4), JacobiGS(1), GSJacobi(4), GSJacobi(1), SlidingJacobi(4),
                 SlidingJacobi(None), TriangularAnderson(), TriangularAnderson(memory=1)]
NEWTON_FAMILY = [Newton(), QuasiNewton(), ELK(), QuasiELK()]


def _ids(v):
    return repr(v) if not isinstance(v, torch.dtype) else str(v).replace("torch.", "")


class Masked:
    """``fn(x)_t = tanh(W x_<t + c)_t`` computed in ``dtype`` (a masked matmul), built on
    ``device``; ``gain`` sets the coupling."""

    def __init__(self, dtype, device="cpu", T=16, F=2, gain=1.5, seed=0):
        g = torch.Generator().manual_seed(seed)
        n = T * F
        pos = torch.arange(n) // F
        W = torch.randn(n, n, generator=g) * gain / math.sqrt(n) * (pos[:, None] > pos[None, :])
        self.W = W.to(device, dtype)
        self.c = torch.randn(n, generator=g).to(device, dtype)
        self.shape = (3, T, F)

    def __call__(self, x):
        return torch.tanh(x.reshape(x.shape[0], -1) @ self.W.T + self.c).reshape(x.shape)


class Residual:
    """``h_t = h_{t-1} + tanh(W h_{t-1} + b) / T`` in ``dtype``: every Jacobi sweep moves the
    iterate by about ``1 / T``, a few units in the last place of bf16 (an accumulating map)."""

    def __init__(self, dtype, device="cpu", T=64, F=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.W = (torch.randn(F, F, generator=g) / math.sqrt(F)).to(device, dtype)
        self.b = torch.randn(F, generator=g).to(device, dtype)
        self.h0 = (torch.randn(2, F, generator=g) * 2).to(device, dtype)
        self.T = T
        self.shape = (2, T, F)

    def __call__(self, x):
        prev = torch.cat([self.h0[:, None], x[:, :-1]], 1)
        return prev + torch.tanh(prev @ self.W.T + self.b) / self.T


class Overflowing:
    """``fn(x)_t = 1000 (x_{t-1} - s_{t-1}) + s_t`` in ``dtype``, ``s`` fixed values of size 1:
    the sequential loop computes every ``x_{t-1} = s_{t-1}`` exactly, so it gives ``s``; a
    Jacobi iterate that is off by ``e`` at ``t - 1`` is off by ``1000 e`` at ``t``, which
    overflows fp16 (65504) after two positions."""

    def __init__(self, dtype, device="cpu", T=12, F=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.s = torch.randn(T, F, generator=g).to(device, dtype)
        self.shape = (2, T, F)

    def __call__(self, x):
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        sprev = torch.cat([torch.zeros_like(self.s[:1]), self.s[:-1]])
        return (prev - sprev) * 1000 + self.s


def _x0(fn, dtype, device="cpu"):
    return torch.zeros(fn.shape, dtype=dtype, device=device)


def _sequential(fn, x0):
    return paraprop.solve(fn, x0, method="sequential", dim=1).value


def _bitwise_or_not_converged(sol, ref, what):
    if sol.converged:
        assert torch.equal(sol.value, ref), (what, float((sol.value - ref).abs().max()))
    else:
        assert sol.stats.get("not_converged"), what


# -- tol = 0: bitwise, or converged=False -------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW, ids=_ids)
@pytest.mark.parametrize("method", JACOBI_FAMILY, ids=repr)
@pytest.mark.parametrize("gain", [0.5, 3.0])
def test_tol_zero_is_bitwise_sequential(method, dtype, gain, device):
    fn = Masked(dtype, device, gain=gain)
    x0 = _x0(fn, dtype, device)
    sol = paraprop.solve(fn, x0, method=method, dim=1, tol=0, throw=False)
    # a plain fn: the same evaluations as the sequential loop, so always bitwise
    assert sol.converged and torch.equal(sol.value, _sequential(fn, x0))
    assert sol.value.dtype == dtype


@pytest.mark.parametrize("dtype", LOW, ids=_ids)
@pytest.mark.parametrize("method", JACOBI_FAMILY + NEWTON_FAMILY, ids=repr)
def test_tol_zero_on_an_accumulating_map(method, dtype, device):
    fn = Residual(dtype, device)
    x0 = _x0(fn, dtype, device)
    sol = paraprop.solve(fn, x0, method=method, dim=1, tol=0, throw=False)
    _bitwise_or_not_converged(sol, _sequential(fn, x0), repr(method))


@pytest.mark.parametrize("dtype", LOW, ids=_ids)
@pytest.mark.parametrize("method", JACOBI_FAMILY + NEWTON_FAMILY, ids=repr)
def test_overflowing_iterates_are_not_errors(method, dtype, device):
    fn = Overflowing(dtype, device)
    x0 = _x0(fn, dtype, device)
    ref = _sequential(fn, x0)
    assert bool(torch.isfinite(ref).all()) and torch.equal(ref[0], fn.s)
    sol = paraprop.solve(fn, x0, method=method, dim=1, tol=0, throw=False)
    _bitwise_or_not_converged(sol, ref, repr(method))
    assert bool(torch.isfinite(sol.value).all())
    if dtype == torch.float16 and isinstance(method, Jacobi):
        assert sol.converged and sol.stats["kept_non_finite"] > 0   # they did overflow


@pytest.mark.parametrize("method", JACOBI_FAMILY + NEWTON_FAMILY + ["sequential"], ids=repr)
def test_a_non_finite_value_from_final_positions_is_the_maps(method):
    """The same chain, but the map itself overflows at position 7 (s_7 = inf): the sequential
    loop produces it too, so NonFiniteError naming that position."""
    fn = Overflowing(torch.float16)
    fn.s[7] = 7e4   # beyond fp16's largest value: inf
    with pytest.raises(paraprop.NonFiniteError,
                       match=r"non-finite value at iteration \d+, sample \(\d,\), position "
                             r"\(7,\)"):
        paraprop.solve(fn, _x0(fn, torch.float16), method=method, dim=1, tol=0)


class WindowInFloat32(Masked):
    """``window`` computes in float32 and rounds the result to the dtype, ``fn`` computes in
    the dtype: the window's values differ from fn's by rounding."""

    def window(self, x, start, stop, cache):
        wide = torch.tanh(x.reshape(x.shape[0], -1).float() @ self.W.float().T + self.c.float())
        return wide.reshape(x.shape)[:, start:stop].to(x.dtype), None


class UpdateInFloat32(Masked):
    def update(self, x, index):
        wide = torch.tanh(x.reshape(x.shape[0], -1).float() @ self.W.float().T + self.c.float())
        return wide.reshape(x.shape).index_select(1, index).to(x.dtype)


@pytest.mark.parametrize("dtype", LOW, ids=_ids)
@pytest.mark.parametrize("method", JACOBI_FAMILY, ids=repr)
def test_hooks_that_round_differently_from_fn(method, dtype, device):
    """The sequential result is fn's. A method that computes with a hook that rounds
    differently cannot give it bitwise: the evaluation of fn at the end says so
    (converged=False naming the hook); the others give fn's result bitwise."""
    for cls in (WindowInFloat32, UpdateInFloat32):
        fn = cls(dtype, device)
        x0 = _x0(fn, dtype, device)
        ref = _sequential(Masked(dtype, device), x0)   # fn alone, position by position
        sol = paraprop.solve(fn, x0, method=method, dim=1, tol=0, throw=False)
        _bitwise_or_not_converged(sol, ref, (cls.__name__, repr(method)))
        hook = "window" if cls is WindowInFloat32 else "update"
        if not sol.converged:
            assert f"fn.{hook}" in sol.stats["not_converged"]
    # that rounding is real: the window's values are not fn's
    fn = WindowInFloat32(dtype, device)
    x = torch.randn(fn.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    assert not torch.equal(fn.window(x, 0, 16, None)[0], fn(x))


# -- tol > 0: the certificate accounts for the rounding ------------------------------------------
@pytest.mark.parametrize("dtype", LOW, ids=_ids)
@pytest.mark.parametrize("method", JACOBI_FAMILY + NEWTON_FAMILY, ids=repr)
@pytest.mark.parametrize("tol", [1e-1, 1e-2, 1e-4])
def test_converged_means_within_tol(method, dtype, tol, device):
    for fn in (Residual(dtype, device), Masked(dtype, device, gain=3.0)):
        x0 = _x0(fn, dtype, device)
        ref = _sequential(fn, x0).double()
        sol = paraprop.solve(fn, x0, method=method, dim=1, tol=tol, throw=False)
        assert sol.converged   # every method reaches its exactness bound
        err = float((sol.value.double() - ref).abs().max())
        assert err <= 10 * tol, (type(fn).__name__, err)


@pytest.mark.parametrize("dtype", LOW, ids=_ids)
@pytest.mark.parametrize("method", JACOBI_FAMILY + NEWTON_FAMILY, ids=repr)
def test_tol_below_the_rounding_floor_is_certified_only_bitwise(method, dtype):
    """Values of size about 1: one unit in the last place is 0.008 in bf16 and 0.001 in fp16,
    so tol=1e-4 is below the rounding floor. No estimate can certify it: whatever max_iters
    allows, a converged solve stopped on a bitwise fixed point or at the bound, and its value
    is the sequential one, bitwise."""
    fn = Masked(dtype, gain=0.3)
    x0 = _x0(fn, dtype)
    ref = _sequential(fn, x0)
    for max_iters in (1, 2, 3, 5, 8, 16):
        sol = paraprop.solve(fn, x0, method=method, dim=1, tol=1e-4, max_iters=max_iters,
                             throw=False)
        if sol.converged:
            assert torch.equal(sol.value, ref), max_iters
            assert sol.stats["error_estimate"] == 0.0


def test_a_solve_held_by_the_rounding_floor_says_so():
    """fp16 quasi-Newton from a warm start within rounding of the solution: its steps are at the
    rounding level, where their ratios say nothing; stopped by max_iters, the message names the
    floor instead of only max_iters."""
    fn = Residual(torch.float16)
    exact = Residual(torch.float64)
    warm = _sequential(exact, _x0(exact, torch.float64)).to(torch.float16)
    sol = paraprop.solve(fn, warm, method=QuasiNewton(), dim=1, tol=1e-4, max_iters=5,
                         throw=False)
    assert not sol.converged and sol.stats["rounding_floor"] > 0
    assert "rounding floor" in sol.stats["not_converged"]
    with pytest.raises(paraprop.ConvergenceError,
                       match=r"did not converge: max_iters=5 ended it before a certificate, and "
                             r"the error estimate could not certify tol=0.0001 earlier in "
                             r"torch.float16: the steps or the estimate were at the rounding "
                             r"floor of the values \(0.00\d+ at their scale\)"):
        paraprop.solve(fn, warm, method=QuasiNewton(), dim=1, tol=1e-4, max_iters=5)
    full = paraprop.solve(fn, warm, method=QuasiNewton(), dim=1, tol=1e-4)
    assert full.converged and torch.equal(full.value, _sequential(fn, _x0(fn, torch.float16)))


def test_the_floor_is_part_of_the_estimate():
    """A stopped sample's estimate is at least the rounding floor of its values (the error of
    one more rounding), unless it stopped on a bitwise fixed point (estimate 0)."""
    fn = Masked(torch.bfloat16, gain=0.3)
    x0 = _x0(fn, torch.bfloat16)
    sol = paraprop.solve(fn, x0, method="jacobi", dim=1, tol=0.05)
    assert sol.converged
    est = sol.stats["error_estimate"]
    floor = float(sol.value.abs().max()) * torch.finfo(torch.bfloat16).eps
    assert est == 0.0 or est >= floor * 0.5


def test_ratios_over_rounding_noise_give_no_estimate():
    """ContractionRule: steps at the rounding level whose ratios fall by 2x each time are noise,
    not contraction: no stop; the same steps above the noise stop."""
    from paraprop.stopping import NOISE, ContractionRule

    active = torch.ones(1, dtype=torch.bool)
    for scale, stops in ((1.0, False), (1e6, True)):
        rule = ContractionRule(1, "cpu")
        floor = torch.tensor([1.0])
        stopped = False
        for k in range(5):
            d = torch.tensor([scale * NOISE / 2 ** k], dtype=torch.float64)
            stop, _ = rule.update(d, tol=1e12, active=active, floor=floor)
            stopped = stopped or bool(stop[0])
        assert stopped == stops
        assert float(rule.blocked) == (0.0 if stops else 1.0)


# -- the rounding floor: what it protects against, and where it applies ---------------------------
class Midpoint:
    """Two features per position in float32: a small ``s_t = s_{t-1} / 2 + c_t`` (about 3e-3,
    converging by half a sweep) and a large ``L_t`` near 1000 (one unit in the last place:
    6.1e-5). The last four ``L_t = fl32(A_t + s_{t-1})`` (the sum in float64, rounded once) sit
    1e-9 above the midpoint between two float32 numbers at the sequential ``s``: an iterate whose
    ``s_{t-1}`` is low by more than 1e-9 rounds ``L_t`` one unit down, and stays there, while
    the sweeps' changes of ``s`` fall below any tol. A rule that certifies ``tol`` below that
    unit from the changes alone (the contraction estimate without the floor, as before the
    floor) reports ``converged=True`` with an error of one unit, 6x ``tol=1e-5``."""

    def __init__(self, T=40, B=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.c = torch.rand(B, T, generator=g) * 1e-3 + 1e-3
        s, prev = torch.zeros(B, T), torch.zeros(B)
        for t in range(T):
            prev = 0.5 * prev + self.c[:, t]
            s[:, t] = prev
        prev_s = torch.cat([torch.zeros(B, 1), s[:, :-1]], 1).double()
        big = torch.tensor(1000.0)
        half = float(torch.nextafter(big, torch.tensor(2000.0)) - big) / 2
        self.A = 1000.0 + half - prev_s + 1e-9
        self.A[:, : T - 4] = 1000.0
        self.shape = (B, T, 2)

    def __call__(self, x):
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        return torch.stack([0.5 * prev[..., 0] + self.c,
                            (self.A + prev[..., 0].double()).float()], -1)


@pytest.mark.parametrize("method", [Jacobi(), JacobiGS(4), GSJacobi(20), SlidingJacobi(8),
                                    SlidingJacobi(None)], ids=repr)
def test_a_rounding_flip_below_tol_of_the_changes_is_not_certified(method):
    fn = Midpoint()
    x0 = torch.zeros(fn.shape)
    ref = _sequential(fn, x0)
    tol = 1e-5
    # the situation the floor is for: after 12 Jacobi sweeps the changes are far below tol,
    # and the large values are one unit (6.1e-5) off
    early = paraprop.solve(fn, x0, method=Jacobi(), dim=1, tol=tol, max_iters=12, throw=False)
    assert float(early.residuals[-1]) < tol / 2 and not early.converged
    assert float((early.value - ref).abs().max()) == pytest.approx(6.1035e-5, rel=1e-3)
    sol = paraprop.solve(fn, x0, method=method, dim=1, tol=tol)
    assert sol.converged
    assert float((sol.value - ref).abs().max()) <= tol


def test_the_floor_is_one_unit_in_the_last_place():
    """half_ulp_bound(m) = (ulp(m) + max(eps m, s)) / 2: one to one and a half units at m (not
    eps m, up to two), the subnormal spacing s below the normal numbers, in every dtype."""
    from paraprop.solvers.rounding import half_ulp_bound

    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        fi = torch.finfo(dtype)
        m = torch.tensor([0.0, fi.smallest_normal / 8, fi.smallest_normal, 1e-3, 0.5, 0.85, 1.0,
                          1.9, 6.3, 1000.0, fi.max / 3, fi.max], dtype=dtype)
        up = torch.nextafter(m, torch.tensor(float("inf"), dtype=dtype)) - m   # spacing above
        up = up.double()
        up[-1] = m[-1].double() - torch.nextafter(m[-1:], m[:1])[0].double()  # at max: below
        sub = fi.smallest_normal * fi.eps
        m64 = m.double()
        got = half_ulp_bound(m64, dtype)
        assert torch.equal(got, (up + (m64 * fi.eps).clamp(min=sub)) / 2), dtype
        assert bool((got >= up).all()) and bool((got <= 1.5 * up + sub).all())
        # and the same on the host's NumPy arrays
        assert torch.equal(torch.from_numpy(half_ulp_bound(m64.numpy(), dtype)), got)


@pytest.mark.parametrize("method", [Jacobi(), GSJacobi(8), SlidingJacobi(8)], ids=repr)
def test_final_positions_add_no_rounding(method):
    """A constant 1e6 at position 0 (one unit there: 0.0625 in float32), small contracting
    values after it: the floor is taken over the positions that are not final (position 0 is
    final after the first sweep, bitwise the sequential value), so tol=1e-4 is certified by the
    estimate before the exactness bound, and holds. Over every position it could not be."""
    T = 32
    g = torch.Generator().manual_seed(0)
    c = torch.rand(2, T, 1, generator=g) * 0.1

    def fn(x):
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        out = 0.3 * torch.tanh(prev) + c
        out[:, 0] = 1e6
        out[:, 1] = c[:, 1]   # position 1 does not read the large value
        return out

    x0 = torch.zeros(2, T, 1)
    ref = _sequential(fn, x0)
    sol = paraprop.solve(fn, x0, method=method, dim=1, tol=1e-4)
    assert sol.converged and float((sol.value - ref).abs().max()) <= 1e-4
    assert sol.iterations < method.bound(_system(fn, x0))
    assert 0 < sol.stats["error_estimate"] <= 1e-4


def _system(fn, x0):
    from paraprop.solvers.triangular import System

    return System(fn, x0.shape, x0.dtype, (1, 1))
