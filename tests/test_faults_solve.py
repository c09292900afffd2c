"""The fault suite of the nonlinear core: maps built to fool a stopping rule.

Whenever a solve reports ``converged=True``, its value must be within the stated bound of the
sequential result. The maps here accumulate small steps (a residual stack, a rotation integrator,
a slowly expanding linear chain) or vary their coupling along the sequence: a rule that stops on
the size of the last step (or on the residual) returns a wrong answer on each of them.
"""

from __future__ import annotations

import itertools
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
)

# Whenever converged=True: max |value - sequential| <= BOUND_FACTOR * tol (float64).
BOUND_FACTOR = 10
TOLS = (1e-2, 1e-4, 1e-7)


class Chain:
    """A Markov chain ``x_t = step(x_{t-1})`` with ``x_{-1} = h0``, in the ``(*batch, T, F)``
    layout of :func:`paraprop.solve` with ``dim=-2``; ``kind`` picks the map."""

    def __init__(self, kind: str, T: int, F: int = 3, batch=(4,), seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.kind, self.T, self.F = kind, T, F
        self.W = torch.randn(F, F, generator=g, dtype=torch.float64) / math.sqrt(F)
        self.b = torch.randn(F, generator=g, dtype=torch.float64)
        self.h0 = torch.randn(*batch, F, generator=g, dtype=torch.float64)
        self.scale = torch.rand(T, 1, generator=g, dtype=torch.float64) * 4
        th = 2 * math.pi * 5 / T
        R = torch.eye(F, dtype=torch.float64)
        R[:2, :2] = torch.tensor([[math.cos(th), -math.sin(th)], [math.sin(th), math.cos(th)]])
        self.R = R
        self.shape = (*batch, T, F)

    def step(self, prev, t=None):
        if self.kind == "residual":      # h_t = h_{t-1} + tanh(W h_{t-1} + b) / T
            return prev + torch.tanh(prev @ self.W.T + self.b) / self.T
        if self.kind == "rotation":      # an integrator of a (slightly growing) oscillation
            return (prev @ self.R.T) * (1 + 1e-3) + 0.01 * torch.tanh(prev)
        if self.kind == "coupling":      # coupling strength varying along the sequence
            scale = self.scale if t is None else self.scale[t]
            return torch.tanh(scale * (prev @ self.W.T) + self.b)
        if self.kind == "expanding":     # a linear chain that grows by 5% per step
            return 1.05 * prev + 0.01
        raise ValueError(self.kind)

    def __call__(self, x):
        prev = torch.cat([self.h0.unsqueeze(-2), x[..., :-1, :]], dim=-2)
        return self.step(prev)

    def sequential(self):
        out, h = [], self.h0
        for t in range(self.T):
            h = self.step(h, t)
            out.append(h)
        return torch.stack(out, dim=-2)


JACOBI_FAMILY = [Jacobi(), JacobiGS(7), JacobiGS(1), GSJacobi(7), GSJacobi(1), SlidingJacobi(1),
                 SlidingJacobi(8), SlidingJacobi(None)]
NEWTON_FAMILY = [Newton(), QuasiNewton(), ELK(1e-2), QuasiELK(1e-2)]
KINDS = ("residual", "rotation", "coupling", "expanding")


CASES = [(m, T) for m in JACOBI_FAMILY for T in (30, 100)] + \
    [(m, T) for m in NEWTON_FAMILY for T in (30, 60)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("method", "T"), CASES, ids=lambda v: repr(v))
def test_converged_means_within_the_bound(kind, method, T):
    chain = Chain(kind, T)
    ref = chain.sequential()
    x0 = torch.zeros(chain.shape, dtype=torch.float64)
    for tol in TOLS:
        sol = paraprop.solve(chain, x0, method=method, dim=-2, tol=tol, throw=False)
        assert sol.converged  # within the exactness bound every method converges
        err = float((sol.value - ref).abs().max())
        assert err <= BOUND_FACTOR * tol, (kind, T, repr(method), tol, err, sol.iterations)
        assert sol.stats["error_estimate"] <= tol * (1 + 1e-12) or \
            sol.stats["error_estimate"] == 0.0


@pytest.mark.parametrize("method", JACOBI_FAMILY + NEWTON_FAMILY, ids=repr)
def test_tol_zero_is_the_sequential_result(method):
    chain = Chain("residual", 50)
    x0 = torch.zeros(chain.shape, dtype=torch.float64)
    sol = paraprop.solve(chain, x0, method=method, dim=-2, tol=0)
    ref = paraprop.solve(chain, x0, method="sequential", dim=-2)
    if isinstance(method, Jacobi | SlidingJacobi):   # the same evaluations: bitwise
        assert torch.equal(sol.value, ref.value)
    else:
        assert float((sol.value - ref.value).abs().max()) <= 1e-12


@pytest.mark.parametrize("method", [Jacobi(), JacobiGS(4), GSJacobi(4)], ids=repr)
def test_the_jacobi_family_does_not_stop_on_a_small_step(method):
    """The old rule (forward difference <= tol) stopped the residual stack after one sweep with an
    error of almost the whole answer: every sweep moves it by about 1 / T."""
    chain = Chain("residual", 100)
    chain.h0 = torch.zeros_like(chain.h0)
    x0 = torch.zeros(chain.shape, dtype=torch.float64)
    sol = paraprop.solve(chain, x0, method=method, dim=-2, tol=0.05)
    assert sol.residuals[0] < 0.05          # the first step is already "small" ...
    assert sol.iterations > 2               # ... but the solve did not stop there
    assert float((sol.value - chain.sequential()).abs().max()) <= BOUND_FACTOR * 0.05


def test_newton_random_h0_case_of_the_issue():
    """The residual recurrence with a random h0 and tol=1e-3 stopped with error 0.57 after 3
    iterations under the residual rule."""
    T = 200
    g = torch.Generator().manual_seed(5)
    chain = Chain("residual", T, F=8, batch=(16,), seed=5)
    chain.h0 = torch.randn(16, 8, generator=g, dtype=torch.float64) * 3
    ref = chain.sequential()
    x0 = torch.zeros(chain.shape, dtype=torch.float64)
    for method in NEWTON_FAMILY:
        sol = paraprop.solve(chain, x0, method=method, dim=-2, tol=1e-3)
        assert float((sol.value - ref).abs().max()) <= BOUND_FACTOR * 1e-3, repr(method)


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
@pytest.mark.parametrize("method", [Jacobi(), JacobiGS(5), GSJacobi(5), SlidingJacobi(6)],
                         ids=repr)
def test_batch_shapes_and_raster_positions(batch, method):
    """Positions over two dims in raster order, any batch shape: the accumulating map along the
    flattened positions."""
    T1, T2, F = 6, 8, 2
    chain = Chain("residual", T1 * T2, F=F, batch=batch or (1,))

    def fn(x):  # x: (*batch, T1, T2, F)
        flat = x.reshape(*(batch or (1,)), T1 * T2, F)
        return chain(flat).reshape(x.shape)

    x0 = torch.zeros(*batch, T1, T2, F, dtype=torch.float64)
    ref = chain.sequential().reshape(x0.shape)
    for tol in TOLS:
        sol = paraprop.solve(fn, x0, method=method, dim=(-3, -2), tol=tol)
        assert float((sol.value - ref).abs().max()) <= BOUND_FACTOR * tol


def test_l2_norm_bounds_the_l2_error():
    chain = Chain("rotation", 120)
    ref = chain.sequential()
    x0 = torch.zeros(chain.shape, dtype=torch.float64)
    for method, tol in itertools.product(JACOBI_FAMILY[:4] + NEWTON_FAMILY, TOLS):
        sol = paraprop.solve(chain, x0, method=method, dim=-2, tol=tol, norm="l2")
        err = torch.linalg.vector_norm((sol.value - ref).reshape(4, -1), dim=1).max()
        assert float(err) <= BOUND_FACTOR * tol, (repr(method), tol, float(err))


def test_gs_jacobi_frozen_blocks_share_the_tolerance():
    """Each frozen block passes its error on to every later block; the blocks' shares of tol
    keep the sum within the bound on a map that carries errors unchanged."""
    chain = Chain("residual", 256)
    ref = chain.sequential()
    x0 = torch.zeros(chain.shape, dtype=torch.float64)
    for bs in (1, 4, 16):
        sol = paraprop.solve(chain, x0, method=GSJacobi(bs), dim=-2, tol=1e-4)
        assert float((sol.value - ref).abs().max()) <= BOUND_FACTOR * 1e-4


def test_x0_requiring_grad_gets_no_graph():
    """The solution does not depend on x0, so no gradient may flow to it (the old driver left
    an identity graph to x0)."""
    W = torch.randn(5, 5, dtype=torch.float64).tril(-1)
    x0 = torch.zeros(3, 5, dtype=torch.float64, requires_grad=True)
    for method in ("sequential", "jacobi", "newton", SlidingJacobi(2)):
        sol = paraprop.solve(lambda x, W=W: torch.tanh(x @ W.T + 1), x0, method=method)
        assert not sol.value.requires_grad
        with pytest.raises(RuntimeError, match="does not require grad"):
            sol.value.sum().backward()
        assert x0.grad is None


def test_x0_requiring_grad_with_a_recurrence_differentiates_the_inputs_only():
    cell = torch.nn.RNNCell(2, 3).double()
    u = torch.randn(4, 10, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.zeros(4, 3, dtype=torch.float64)
    rec = paraprop.Recurrence(cell, u, h0)
    x0 = rec.zeros().requires_grad_(True)
    sol = paraprop.solve(rec, x0, method="newton", dim=-2, tol=1e-12)
    sol.value.sum().backward()
    assert x0.grad is None
    ref = paraprop.solve(rec, rec.zeros(), method="sequential", dim=-2).value
    (gu,) = torch.autograd.grad(ref.sum(), u)
    torch.testing.assert_close(u.grad, gu, rtol=1e-10, atol=1e-12)


def test_error_estimate_is_reported():
    chain = Chain("coupling", 100)
    x0 = torch.zeros(chain.shape, dtype=torch.float64)
    sol = paraprop.solve(chain, x0, method="jacobi", dim=-2, tol=1e-6)
    est = sol.stats["error_estimate"]
    assert 0 <= est <= 1e-6
    err = float((sol.value - chain.sequential()).abs().max())
    assert err <= BOUND_FACTOR * 1e-6
    capped = paraprop.solve(chain, x0, method="jacobi", dim=-2, tol=1e-6, max_iters=2,
                            throw=False)
    assert not capped.converged and capped.stats["error_estimate"] == math.inf


@pytest.mark.parametrize("method", [Jacobi(), SlidingJacobi(256), Newton(), QuasiNewton()],
                         ids=repr)
def test_float32_tiny_increments_on_large_values(method):
    """Increments far below tol on values of size 10, in float32: the rounding floor must not
    mistake them for noise (each step is about 10 units in the last place of 10)."""
    T = 1000
    h0 = torch.full((2, 3), 10.0)

    def fn(x):
        prev = torch.cat([h0[:, None], x[:, :-1]], 1)
        return prev + 1e-5 * torch.tanh(prev)

    x0 = torch.full((2, T, 3), 10.0)   # a start near the answer: every sweep moves 1e-5
    ref = paraprop.solve(fn, x0, method="sequential", dim=-2).value
    assert float((ref[:, -1] - h0).abs().min()) > 5e-3   # the increments add up
    sol = paraprop.solve(fn, x0, method=method, dim=-2, tol=1e-4)
    assert float((sol.value - ref).abs().max()) <= BOUND_FACTOR * 1e-4


@pytest.mark.parametrize("method", [Jacobi(), SlidingJacobi(64), Newton(), QuasiNewton()],
                         ids=repr)
def test_float32_one_ulp_increments_from_a_warm_start(method):
    """The residual stack on values of 1e4 in float32: each step adds about one unit in the
    last place. A rule that counts rounding-level changes as "no change" stopped Jacobi after
    one sweep with an error of 0.98 at tol=1e-2."""
    T = 1000
    h0 = torch.full((1, 2), 1e4)
    W, b = torch.eye(2) * 0.5, torch.ones(2)

    def fn(x):
        prev = torch.cat([h0[:, None], x[:, :-1]], 1)
        return prev + torch.tanh(prev @ W.T + b) / T

    x0 = torch.full((1, T, 2), 1e4)
    ref = paraprop.solve(fn, x0, method="sequential", dim=-2).value
    sol = paraprop.solve(fn, x0, method=method, dim=-2, tol=1e-2)
    assert float((sol.value - ref).abs().max()) <= BOUND_FACTOR * 1e-2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("method", [Newton(), QuasiNewton(), ELK(), QuasiELK()], ids=repr)
def test_newton_family_returns_fn_x_within_tol_on_an_accumulating_map(method, dtype):
    """h_t = h_{t-1} + tanh(W h_{t-1} + b) / T, a plain fn (Jacobians by forward mode). A
    stopping sample returns fn(x), not the next iterate: its contraction estimate alone (about
    the next iterate) let ELK report converged=True at 1.3 x tol in float32."""
    g = torch.Generator().manual_seed(0)
    H, T = 8, 200
    W = (torch.randn(H, H, generator=g) * 0.5).to(dtype)
    b = torch.randn(H, generator=g).to(dtype)

    def fn(x):
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        return prev + torch.tanh(prev @ W.T + b) / T

    x0 = torch.zeros(3, T, H, dtype=dtype)
    ref = paraprop.solve(fn, x0, method="sequential", dim=1).value
    for tol in (1e-2, 1e-4):
        sol = paraprop.solve(fn, x0, method=method, dim=1, tol=tol)
        err = float((sol.value - ref).abs().max())
        assert sol.converged and err <= tol
        assert err <= sol.stats["error_estimate"] * 1.5   # the estimate is of the right size


# -- the final check at tol > 0 raises no false alarm on honest maps -----------------------------
class _Expanding:
    """``x_t = a x_{t-1} + 0.01``: errors grow by ``a`` per step (stated in ``growth`` or not)."""

    def __init__(self, a, T, B, stated):
        self.a = a
        if stated:
            self.growth = (a ** torch.arange(T - 1, -1, -1, dtype=torch.float64)).repeat(B)

    def __call__(self, x):
        prev = torch.cat([torch.full_like(x[:, :1], 0.1), x[:, :-1]], 1)
        return self.a * prev + 0.01

    def window(self, x, start, stop, cache):
        return self(x)[:, start:stop], None


CHECKED = [JacobiGS(None), JacobiGS(3), GSJacobi(None), GSJacobi(2), SlidingJacobi(None),
           SlidingJacobi(3), SlidingJacobi(1)]
DTYPE_TOLS = {torch.float64: (1e-2, 1e-5, 1e-9), torch.float32: (1e-2, 1e-4, 1e-6),
              torch.bfloat16: (0.1, 0.03), torch.float16: (0.05, 0.01)}


@pytest.mark.parametrize("gain", [0.3, 1.5, 5.0, 30.0])
@pytest.mark.parametrize("dtype", list(DTYPE_TOLS), ids=str)
def test_the_final_check_raises_no_false_alarm_on_honest_maps(dtype, gain):
    """The methods that certify by reasoning end with one evaluation of fn, compared with what
    a value within tol can have ((1 + L) tol plus rounding). On honest maps (contracting to
    strongly coupled, any dtype, hooks or none, both norms) it never fires."""
    from problems import FastTriangular, RandomTriangular, Windowed

    T = 12 if gain > 10 else 20
    prob = RandomTriangular((3,), (T,), (2,), dtype, seed=int(gain * 10), gain=gain,
                            scale=[0.1, 1.0, 3.0])
    maps = [prob, Windowed(prob, update=True)]
    if dtype in (torch.float64, torch.float32):   # row-subset products: their own rounding
        maps.append(FastTriangular((3,), (T,), (2,), dtype, seed=int(gain * 10), gain=gain))
    x0 = torch.zeros(3, T, 2, dtype=dtype)
    for fn in maps:
        ref = paraprop.solve(fn, x0, method="sequential", dim=1).value.double()
        for method, tol, norm in itertools.product(CHECKED, DTYPE_TOLS[dtype], ("max", "l2")):
            sol = paraprop.solve(fn, x0, method=method, dim=1, tol=tol, norm=norm)
            assert sol.stats["verification"] in ("evaluation", "iterations")
            err = (sol.value.double() - ref).reshape(3, -1)
            err = err.abs().amax(1) if norm == "max" else err.norm(dim=1)
            assert float(err.max()) <= BOUND_FACTOR * tol, (type(fn).__name__, repr(method))


@pytest.mark.parametrize("stated", [False, True])
@pytest.mark.parametrize("a", [1.1, 2.0])
def test_the_final_check_on_expanding_chains(a, stated):
    """Errors grow by a per step; the freezes fit a share of tol, the residuals stay far below
    the check's bound, stated growth or not: no false alarm (the error itself is the freeze
    estimates' business: with the growth stated it is within tol)."""
    fn = _Expanding(a, 24, 3, stated)
    x0 = torch.zeros(3, 24, 1, dtype=torch.float64)
    ref = paraprop.solve(fn, x0, method="sequential", dim=1).value
    for method in (SlidingJacobi(None), SlidingJacobi(4), GSJacobi(4), JacobiGS(4)):
        for tol in (1e-2, 1e-5):
            sol = paraprop.solve(fn, x0, method=method, dim=1, tol=tol)
            assert sol.converged and sol.stats["verification"] == "evaluation"
            if stated and isinstance(method, SlidingJacobi):
                assert float(((sol.value - ref) / ref.abs().clamp(min=1)).abs().max()) <= \
                    BOUND_FACTOR * tol


class _AmplifiedRounding:
    """``fn(x)_t = sin(30 (W x + b)_t)`` with ``b`` near 10, and an ``update`` hook that rounds
    its product one unit differently (as a row-subset product may): the step amplifies that
    unit about 300 times, past 16 units of the output, far below the size of the values."""

    def __init__(self, T):
        g = torch.Generator().manual_seed(0)
        n = 2 * T
        pos = torch.arange(n) // 2
        # weak coupling between positions (a change moves the next ones by 30 * 0.01): the
        # rounding is amplified inside a step, not along the sequence
        self.W = torch.randn(n, n, generator=g, dtype=torch.float64) * (pos[:, None] >
                                                                       pos[None, :]) * 0.01
        self.b = torch.linspace(5, 10, n, dtype=torch.float64)

    def _pre(self, x):
        return x.reshape(x.shape[0], -1) @ self.W.T + self.b

    def __call__(self, x):
        return torch.sin(30 * self._pre(x)).reshape(x.shape)

    def update(self, x, index):
        rows = (index[:, None] * 2 + torch.arange(2)).reshape(-1)
        pre = self._pre(x)[:, rows] * (1 + 2.0 ** -52)
        return torch.sin(30 * pre).reshape(x.shape[0], index.numel(), 2)


@pytest.mark.parametrize("method", [SlidingJacobi(1), SlidingJacobi(4), GSJacobi(4),
                                    JacobiGS(4)], ids=repr)
def test_a_hook_whose_rounding_a_step_amplifies_is_not_called_broken(method):
    """At tol=0 the hook's value is then not fn's bitwise: converged=False with the reason, not a
    ProtocolError or a NotTriangularError (a broken hook differs by the size of the values);
    a tol above the amplified rounding certifies it."""
    fn = _AmplifiedRounding(12)
    x0 = torch.zeros(2, 12, 2, dtype=torch.float64)
    ref = paraprop.solve(fn, x0, method="jacobi", dim=1, tol=0).value   # fn's own, bitwise
    sol = paraprop.solve(fn, x0, method=method, dim=1, tol=0, throw=False)
    assert not sol.converged and sol.stats["verification"] == "failed"
    why = sol.stats["not_converged"]
    assert "fn.update(x, index) rounds differently from fn(x)" in why
    assert "more than rounding (16 units in the last place)" in why
    assert "rounding amplified inside a step" in why
    ok = paraprop.solve(fn, x0, method=method, dim=1, tol=1e-9)
    assert ok.converged and float((ok.value - ref).abs().max()) <= 1e-8
