"""TriangularAnderson (``method="anderson"``) on generic triangular maps: the sequential result
within ``tol`` (bitwise at ``tol=0``), at most ``T`` iterations, per-sample stopping, a stopping
rule that bounds the error on maps that accumulate small steps, and the Jacobi family's checks
(NotTriangularError, argument validation)."""

from __future__ import annotations

import math

import pytest
import torch

import paraprop
from paraprop.solvers import Jacobi, TriangularAnderson
from problems import TOLERANCES, FastTriangular, RandomTriangular

pytestmark = pytest.mark.usefixtures("one_thread")

D = torch.float64
MEMORIES = [None, 1, 2, 3, 5]


def _err(a, b) -> float:
    return float((a - b).abs().max())


class Chain:
    """A Markov chain ``x_t = step(x_{t-1})``, ``x_{-1} = h0``, in the ``(B, T, F)`` layout of
    :func:`paraprop.solve` with ``dim=-2``.

    ``residual``: ``h + tanh(W h + b) / T`` (every step small, the sum large); ``expanding``:
    ``1.05 h + 0.01``; ``contracting``: ``0.5 h + 0.1 tanh(W h) + b``; ``flip``:
    ``-1.5 tanh(W h) + b`` (sign flips, Lipschitz > 1).
    """

    def __init__(self, kind: str, T: int, F: int = 3, B: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.kind, self.T = kind, T
        self.W = torch.randn(F, F, generator=g, dtype=D) / math.sqrt(F)
        self.b = torch.randn(F, generator=g, dtype=D)
        self.h0 = torch.randn(B, F, generator=g, dtype=D)
        self.shape = (B, T, F)

    def step(self, h):
        if self.kind == "residual":
            return h + torch.tanh(h @ self.W.T + self.b) / self.T
        if self.kind == "expanding":
            return 1.05 * h + 0.01
        if self.kind == "contracting":
            return 0.5 * h + 0.1 * torch.tanh(h @ self.W.T) + self.b
        if self.kind == "flip":
            return -1.5 * torch.tanh(h @ self.W.T) + self.b
        raise ValueError(self.kind)

    def __call__(self, x):
        return self.step(torch.cat([self.h0.unsqueeze(-2), x[..., :-1, :]], dim=-2))

    def sequential(self):
        out, h = [], self.h0
        for _ in range(self.T):
            h = self.step(h)
            out.append(h)
        return torch.stack(out, dim=-2)

    def x0(self):
        return torch.zeros(self.shape, dtype=D)


# -- the sequential result ----------------------------------------------------------------------

@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("gain", [0.5, 1.5, 3.0])
def test_random_triangular_maps_are_the_sequential_result(memory, fast, gain):
    cls = FastTriangular if fast else RandomTriangular
    prob = cls((2, 3), (13,), (2,), seed=int(gain * 10), gain=gain)
    x0 = prob.x0()
    ref = prob.reference(x0)
    T = 13
    exact = paraprop.solve(prob, x0, method=TriangularAnderson(memory=memory), dim=2, tol=0)
    assert exact.converged and exact.iterations <= T
    assert exact.method == "anderson"
    # every position takes fn's value once its inputs are final: the sequential evaluations
    assert torch.equal(exact.value, ref)
    assert exact.stats["error_estimate"] == 0.0
    # one more evaluation verifies the fixed point when the bound is reached still moving
    assert exact.iterations <= exact.evaluations <= exact.iterations + 1
    assert exact.stats["positions"] == exact.evaluations * T
    for tol in (1e-2, 1e-4, 1e-8):
        sol = paraprop.solve(prob, x0, method=TriangularAnderson(memory=memory), dim=2, tol=tol)
        assert sol.converged and sol.iterations <= T
        assert _err(sol.value, ref) <= tol, (tol, _err(sol.value, ref))
        assert sol.stats["error_estimate"] <= tol


def test_the_name_is_the_default_object():
    prob = RandomTriangular((3,), (10,), (2,), seed=4, gain=2.0)
    x0 = prob.x0()
    by_name = paraprop.solve(prob, x0, method="anderson", dim=1, tol=1e-6)
    by_object = paraprop.solve(prob, x0, method=TriangularAnderson(), dim=1, tol=1e-6)
    explicit = paraprop.solve(prob, x0, method=TriangularAnderson(memory=3), dim=1, tol=1e-6)
    assert torch.equal(by_name.value, by_object.value)
    assert torch.equal(by_name.value, explicit.value)
    assert by_name.iterations == by_object.iterations == explicit.iterations
    assert repr(TriangularAnderson(memory=4)) == "TriangularAnderson(memory=4)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tol_zero_in_both_dtypes(dtype, device):
    prob = RandomTriangular((4,), (16,), (3,), dtype=dtype, seed=8, gain=2.0)
    prob.W, prob.c, prob.scale = (t.to(device) for t in (prob.W, prob.c, prob.scale))
    x0 = prob.x0().to(device)
    sol = paraprop.solve(prob, x0, method="anderson", dim=1, tol=0)
    assert sol.value.dtype == dtype and sol.iterations <= 16 and sol.value.device == x0.device
    # a plain fn, computed by the same operations as the sequential loop: bitwise
    assert torch.equal(sol.value, prob.reference(x0))
    sol = paraprop.solve(prob, x0, method="anderson", dim=1, tol=TOLERANCES[dtype]["solve_tol"])
    assert _err(sol.value, prob.reference(x0)) <= TOLERANCES[dtype]["max_err"]


def test_memory_one_is_jacobi():
    """``memory=1`` keeps no history: plain fixed-point iteration, the same iterates."""
    prob = RandomTriangular((4,), (20,), (3,), seed=3, gain=2.0)
    x0 = prob.x0()
    a = paraprop.solve(prob, x0, method=TriangularAnderson(memory=1), dim=1, tol=0)
    j = paraprop.solve(prob, x0, method=Jacobi(), dim=1, tol=0)
    assert torch.equal(a.value, j.value) and a.iterations == j.iterations
    seen_a, seen_j = [], []
    paraprop.solve(prob, x0, method=TriangularAnderson(memory=1), dim=1, tol=0, max_iters=5,
                   throw=False, callback=lambda k, v, r: seen_a.append(v.clone()))
    paraprop.solve(prob, x0, method=Jacobi(), dim=1, tol=0, max_iters=5, throw=False,
                   callback=lambda k, v, r: seen_j.append(v.clone()))
    assert len(seen_a) == len(seen_j) == 5
    assert all(torch.equal(p, q) for p, q in zip(seen_a, seen_j, strict=True))


def test_memory_changes_the_iterates():
    """The extrapolation is used (else every memory would give Jacobi's iterates)."""
    prob = RandomTriangular((2,), (20,), (3,), seed=3, gain=2.0)
    x0 = prob.x0()
    seen = {}
    for m in (1, 3):
        its = []
        paraprop.solve(prob, x0, method=TriangularAnderson(memory=m), dim=1, tol=0, max_iters=4,
                       throw=False, callback=lambda k, v, r, its=its: its.append(v.clone()))
        seen[m] = its
    # the first iteration has one iterate, nothing to extrapolate from; the second has two
    assert torch.equal(seen[1][0], seen[3][0])
    assert not torch.equal(seen[1][1], seen[3][1])


@pytest.mark.parametrize("regularization", [0.0, 1e-3, 1e6])
def test_regularization_keeps_the_result(regularization):
    chain = Chain("contracting", 40)
    ref = chain.sequential()
    for tol in (1e-3, 1e-8, 0.0):
        sol = paraprop.solve(chain, chain.x0(), dim=-2, tol=tol,
                             method=TriangularAnderson(memory=4, regularization=regularization))
        assert sol.converged and sol.iterations <= 40
        assert _err(sol.value, ref) <= max(tol, 1e-12)


def test_raster_positions_and_l2_norm():
    chain = Chain("contracting", 48, F=2, B=3)
    ref = chain.sequential().reshape(3, 6, 8, 2)

    def fn(x):  # positions over two dims in raster order
        return chain(x.reshape(3, 48, 2)).reshape(x.shape)

    x0 = torch.zeros(3, 6, 8, 2, dtype=D)
    for tol in (1e-3, 1e-7):
        sol = paraprop.solve(fn, x0, method="anderson", dim=(1, 2), tol=tol)
        assert sol.value.shape == x0.shape and _err(sol.value, ref) <= tol
        l2 = paraprop.solve(fn, x0, method="anderson", dim=(1, 2), tol=tol, norm="l2")
        err = torch.linalg.vector_norm((l2.value - ref).reshape(3, -1), dim=1).max()
        assert float(err) <= tol


# -- the stopping rule --------------------------------------------------------------------------

KINDS = ("residual", "expanding", "contracting", "flip")


@pytest.mark.parametrize("memory", [1, 2, 3, 5])
@pytest.mark.parametrize("kind", KINDS)
def test_converged_means_within_tol(kind, memory):
    chain = Chain(kind, 60)
    ref = chain.sequential()
    for tol in (1e-2, 1e-4, 1e-7):
        sol = paraprop.solve(chain, chain.x0(), method=TriangularAnderson(memory=memory),
                             dim=-2, tol=tol, throw=False)
        assert sol.converged and sol.iterations <= 60
        err = _err(sol.value, ref)
        assert err <= tol, (kind, memory, tol, err, sol.iterations)
        assert sol.stats["error_estimate"] <= tol
        # cut short: converged only when within tol
        short = paraprop.solve(chain, chain.x0(), method=TriangularAnderson(memory=memory),
                               dim=-2, tol=tol, max_iters=4, throw=False)
        if short.converged:
            assert _err(short.value, ref) <= tol
        else:
            assert short.stats["error_estimate"] == math.inf


@pytest.mark.parametrize("memory", [1, 3, 5])
def test_an_accumulating_map_does_not_stop_on_a_small_residual(memory):
    """``h_t = h_{t-1} + tanh(W h_{t-1} + b) / T`` from ``h0 = 0``: every residual of the first
    iterate is about ``1 / T``, far below tol, while the answer is far from it. A rule on the
    residual alone would stop at once."""
    T, tol = 100, 0.05
    chain = Chain("residual", T)
    chain.h0 = torch.zeros_like(chain.h0)
    ref = chain.sequential()
    assert _err(ref, chain.x0()) > 10 * tol         # the answer is far from the start
    sol = paraprop.solve(chain, chain.x0(), method=TriangularAnderson(memory=memory), dim=-2,
                         tol=tol)
    assert sol.residuals[0] < tol                   # the first residual is already "small" ...
    assert sol.iterations > 2                       # ... but the solve did not stop there
    assert sol.converged and _err(sol.value, ref) <= tol
    short = paraprop.solve(chain, chain.x0(), method=TriangularAnderson(memory=memory),
                           dim=-2, tol=tol, max_iters=2, throw=False)
    assert not short.converged and _err(short.value, ref) > tol
    with pytest.raises(paraprop.ConvergenceError,
                       match=r"method='anderson' did not converge within max_iters=2"):
        paraprop.solve(chain, chain.x0(), method=TriangularAnderson(memory=memory), dim=-2,
                       tol=tol, max_iters=2)


def test_error_estimate_bounds_the_true_error_when_stopping_early():
    chain = Chain("contracting", 60)
    ref = chain.sequential()
    for tol in (1e-3, 1e-6):
        sol = paraprop.solve(chain, chain.x0(), method="anderson", dim=-2, tol=tol)
        assert sol.converged and sol.iterations < 60          # stopped on the estimate
        est = sol.stats["error_estimate"]
        assert 0 < est <= tol
        assert _err(sol.value, ref) <= tol


def test_per_sample_stopping():
    """An easy sample (weak coupling) stops before a hard one; each keeps its own result."""
    prob = FastTriangular((3,), (30,), (), seed=2, scale=[0.1, 1.0, 3.0])
    x0 = prob.x0()
    ref = prob.reference(x0)
    tol = 1e-8
    sol = paraprop.solve(prob, x0, method="anderson", dim=1, tol=tol)
    its = sol.stats["sample_iterations"]
    assert its.shape == (3,) and int(its.max()) == sol.iterations
    assert int(its[0]) < int(its[2])
    assert _err(sol.value, ref) <= tol
    for b, s in enumerate([0.1, 1.0, 3.0]):
        alone_prob = RandomTriangular((1,), (30,), (), seed=2, scale=[s])
        alone = paraprop.solve(alone_prob, x0[b : b + 1], method="anderson", dim=1, tol=tol)
        assert alone.iterations == int(its[b])
        assert _err(alone.value[0], sol.value[b]) <= 1e-12


# -- refusals -----------------------------------------------------------------------------------

def test_not_triangular_is_detected():
    prob = RandomTriangular((2,), (10,), (), seed=0, gain=3.0, strict=False)
    with pytest.raises(paraprop.NotTriangularError, match="depends on itself or on a later one"):
        paraprop.solve(prob, prob.x0(), method="anderson", tol=0)


class _ReadsLater:
    """Triangular except that position 2 also reads position 5."""

    def __init__(self):
        self.prob = RandomTriangular((2,), (8,), (), seed=6, gain=2.0)

    def __call__(self, x):
        y = self.prob(x).clone()
        y[:, 2] = y[:, 2] + 0.5 * torch.tanh(x[:, 5])
        return y


def test_reading_a_later_position_is_detected():
    fn = _ReadsLater()
    with pytest.raises(paraprop.NotTriangularError, match=r"position \(2,\)"):
        paraprop.solve(fn, fn.prob.x0(), method="anderson", tol=0)


class _SelfDependent:
    """Triangular except that position ``t`` also reads itself (a contraction there)."""

    def __init__(self, T, t):
        self.prob = RandomTriangular((2,), (T,), (), seed=6, gain=2.0)
        self.t = t

    def __call__(self, x):
        y = self.prob(x).clone()
        y[:, self.t] = y[:, self.t] + 0.5 * torch.tanh(x[:, self.t])
        return y


def test_self_dependence_before_the_end_is_caught():
    fn = _SelfDependent(8, 3)
    with pytest.raises(paraprop.NotTriangularError, match=r"position \(3,\)"):
        paraprop.solve(fn, fn.prob.x0(), method="anderson", tol=0)


def test_self_dependence_at_the_end_gives_the_sequential_loops_value():
    """Only the last position reads itself: within the sequential loop's T calls nothing can
    see it, so the last call computes that position as the loop does (x0's value there)."""
    fn = _SelfDependent(8, 7)
    x0 = fn.prob.x0()
    ref = paraprop.solve(fn, x0, method="sequential").value
    for method in ("jacobi", "anderson"):
        sol = paraprop.solve(fn, x0, method=method, tol=0)
        assert sol.converged and torch.equal(sol.value, ref) and sol.evaluations <= 8


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_memory_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"TriangularAnderson: memory must be a positive int or "
                                         r"None, got"):
        TriangularAnderson(memory=bad)


@pytest.mark.parametrize("bad", [-1, -1e-9, float("inf"), float("nan"), "1e-3", True])
def test_regularization_must_be_a_finite_nonnegative_number(bad):
    with pytest.raises(ValueError, match=r"TriangularAnderson: regularization must be"):
        TriangularAnderson(regularization=bad)


def test_non_finite_values_are_named():
    prob = RandomTriangular((2,), (8,), (), seed=1)

    def fn(x):
        y = prob(x).clone()
        y[1, 4] = float("nan")
        return y

    with pytest.raises(paraprop.NonFiniteError, match=r"sample \(1,\), position \(4,\)"):
        paraprop.solve(fn, prob.x0(), method="anderson")


def test_residual_stop_ends_on_the_residual_for_a_caller_that_certifies():
    """``residual_stop()`` (the diffusion certificate's Anderson, whose final check certifies):
    a sample stops on the sweep whose residual is ``<= tol``, without the plain steps of the
    stopping rule, so in fewer sweeps; the solver it came from is unchanged, and its own stop
    still follows the rule."""
    chain = Chain("contracting", 60)
    plain = TriangularAnderson(memory=3)
    quick = plain.residual_stop()
    assert quick is not plain and not plain._residual_stop and quick._residual_stop
    assert (quick.memory, quick.regularization) == (plain.memory, plain.regularization)
    for tol in (1e-3, 1e-6):
        a = paraprop.solve(chain, chain.x0(), method=plain, dim=-2, tol=tol)
        b = paraprop.solve(chain, chain.x0(), method=quick, dim=-2, tol=tol, throw=False)
        assert b.iterations < a.iterations, (tol, b.iterations, a.iterations)
        # its last sweep's residual was within tol
        assert float(b.residuals[-1]) <= tol
