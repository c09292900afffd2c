"""paraprop.flows: parallel_inverse and accelerate return the flow libraries' own results, bitwise,
with the libraries' gradients; accelerate patches instances only and undoes cleanly."""

import copy

import pytest
import torch
import zuko

import paraprop
from paraprop.flows import Accelerated, accelerate, parallel_inverse
from paraprop.solvers import GSJacobi, SlidingJacobi

nflows = pytest.importorskip("nflows")
nf = pytest.importorskip("normflows")
F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny flows: one thread is faster and immune to a busy machine."""


# -- the flows under test (small, random weights, deterministic networks) -------------------------
def _nflows_maf(d=6, context=None):
    from nflows.distributions import StandardNormal
    from nflows.flows import Flow
    from nflows.transforms import (
        CompositeTransform,
        MaskedAffineAutoregressiveTransform,
        ReversePermutation,
    )

    t = CompositeTransform([
        layer for _ in range(2) for layer in (
            ReversePermutation(d),
            MaskedAffineAutoregressiveTransform(d, 16, context_features=context))])
    embed = None if context is None else torch.nn.Linear(context, context)
    return Flow(t, StandardNormal([d]), embedding_net=embed).eval()


def _nflows_rq(d=5):
    from nflows.distributions import StandardNormal
    from nflows.flows import Flow
    from nflows.transforms import (
        CompositeTransform,
        MaskedPiecewiseRationalQuadraticAutoregressiveTransform,
        ReversePermutation,
    )

    t = CompositeTransform([
        MaskedPiecewiseRationalQuadraticAutoregressiveTransform(d, 16, num_bins=4,
                                                                tails="linear"),
        ReversePermutation(d),
        MaskedPiecewiseRationalQuadraticAutoregressiveTransform(d, 16, num_bins=4,
                                                                tails="linear")])
    return Flow(t, StandardNormal([d])).eval()


def _normflows(kind, d=6, context=None):
    flows = []
    for _ in range(2):
        if kind == "maf":
            flows.append(nf.flows.MaskedAffineAutoregressive(d, 16, context_features=context))
        elif kind == "rqs":
            flows.append(nf.flows.AutoregressiveRationalQuadraticSpline(
                d, 2, 16, num_context_channels=context, num_bins=4, init_identity=False))
        else:  # circular coordinates 0 and 2, permuted masks (the default)
            flows.append(nf.flows.CircularAutoregressiveRationalQuadraticSpline(
                d, 2, 16, [0, 2], num_bins=4, init_identity=False))
        flows.append(nf.flows.LULinearPermute(d))
    base = nf.distributions.DiagGaussian(d)
    cls = nf.ConditionalNormalizingFlow if context else nf.NormalizingFlow
    return cls(base, flows).eval()


def _seeded(fn, seed=0):
    torch.manual_seed(seed)
    return fn()


def _tensors(out):
    return [t for t in (out if isinstance(out, tuple | list) else (out,))
            if isinstance(t, torch.Tensor)]


C = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
X6 = torch.randn(5, 6, generator=torch.Generator().manual_seed(6))


def _on(f, t):
    """``t`` on the device of the flow ``f``'s parameters."""
    return t.to(next(f.parameters()).device)

# name: (build, [calls of the library's own API]); every call is seeded the same way
CASES = {
    "zuko MAF": (lambda: zuko.flows.MAF(6, transforms=3, randperm=True), [
        lambda f: f().sample((7,)), lambda f: f().rsample((2, 3)), lambda f: f().sample(),
        lambda f: f().rsample_and_log_prob((5,)), lambda f: f().transform.inv(_on(f, X6))]),
    "zuko MAF passes=2": (lambda: zuko.flows.MAF(6, transforms=2, passes=2), [
        lambda f: f().sample((7,))]),
    "zuko NSF": (lambda: zuko.flows.NSF(5, transforms=2), [
        lambda f: f().sample((6,)), lambda f: f().rsample_and_log_prob((4,))]),
    "zuko conditional MAF": (lambda: zuko.flows.MAF(5, context=3, transforms=2), [
        lambda f: f(_on(f, C)).sample((2,)), lambda f: f(_on(f, C[0])).rsample((3,))]),
    "nflows MAF": (_nflows_maf, [
        lambda f: f.sample(7), lambda f: f.sample_and_log_prob(4),
        lambda f: f._transform.inverse(_on(f, X6))]),
    "nflows conditional MAF": (lambda: _nflows_maf(context=3), [
        lambda f: f.sample(3, context=_on(f, C)),
        lambda f: f.sample_and_log_prob(2, context=_on(f, C))]),
    "nflows RQ": (_nflows_rq, [lambda f: f.sample(6), lambda f: f.sample_and_log_prob(3)]),
    "normflows MAF": (lambda: _normflows("maf"), [
        lambda f: f.sample(7), lambda f: f.log_prob(_on(f, X6)),
        lambda f: f.inverse(_on(f, X6)), lambda f: f.forward_kld(_on(f, X6))]),
    "normflows conditional MAF": (lambda: _normflows("maf", context=3), [
        lambda f: f.sample(4, context=_on(f, C)),
        lambda f: f.log_prob(_on(f, X6[:4]), context=_on(f, C))]),
    "normflows RQ spline": (lambda: _normflows("rqs"), [
        lambda f: f.sample(7), lambda f: f.log_prob(_on(f, X6))]),
    "normflows conditional RQ spline": (lambda: _normflows("rqs", context=3), [
        lambda f: f.sample(4, context=_on(f, C))]),
    "normflows circular RQ spline": (lambda: _normflows("circular"), [
        lambda f: f.sample(7), lambda f: f.log_prob(_on(f, X6.clamp(-2, 2)))]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_accelerate_is_bitwise_the_library(name, device):
    build, calls = CASES[name]
    flow = _seeded(build, 1).to(device)
    with torch.no_grad():
        expected = [_tensors(_seeded(lambda c=c: c(flow))) for c in calls]
        with accelerate(flow) as handle:
            got = [_tensors(_seeded(lambda c=c: c(flow))) for c in calls]
    for exp, out in zip(expected, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(exp, out, strict=True))
    assert handle.inversions > 0 and 0 < handle.passes <= handle.library_passes
    # after the context: the library's own methods, the same results
    with torch.no_grad():
        again = [_tensors(_seeded(lambda c=c: c(flow))) for c in calls]
    assert all(torch.equal(a, b) for exp, out in zip(expected, again, strict=True)
               for a, b in zip(exp, out, strict=True))
    assert all(paraprop.flows.patches.PATCH not in p.__dict__ for p in handle.parts)


def test_accelerate_takes_fewer_passes_on_a_deep_flow():
    flow = _seeded(lambda: zuko.flows.MAF(40, transforms=2), 2)
    with torch.no_grad(), accelerate(flow) as handle:
        flow().sample((8,))
    assert handle.library_passes == 80 and handle.passes < 40


# -- undo, context manager, double application -----------------------------------------------------
def test_undo_restores_the_instance_methods():
    flow = _seeded(_nflows_maf)
    parts = [m for m in flow.modules()
             if isinstance(m, nflows.transforms.autoregressive.AutoregressiveTransform)]
    expected = _seeded(lambda: flow.sample(5)).detach()
    handle = accelerate(flow)
    assert isinstance(handle, Accelerated) and handle.parts == tuple(parts) and handle.active
    assert all(p.inverse.__self__ is p and "inverse" in p.__dict__ for p in parts)
    assert type(parts[0]).inverse is not parts[0].inverse.__func__     # the instance, not the class
    for _ in range(2):   # applied once, it stays
        assert torch.equal(_seeded(lambda: flow.sample(5)), expected)
    assert handle.inversions == 4
    handle.undo()
    assert not handle.active and "undone" in repr(handle)
    assert all("inverse" not in p.__dict__ and p.inverse.__func__ is type(p).inverse
               for p in parts)
    assert torch.equal(_seeded(lambda: flow.sample(5)), expected)
    handle.undo()   # again: nothing
    with accelerate(flow) as again:   # and it can be applied anew
        assert torch.equal(_seeded(lambda: flow.sample(5)), expected)
    assert again.inversions == 2


def test_context_manager_undoes_on_an_exception():
    flow = zuko.flows.MAF(4, transforms=2)
    lazy = flow.transform.transforms[0]
    with pytest.raises(RuntimeError, match="inside"), accelerate(flow) as handle:
        assert "forward" in lazy.__dict__
        raise RuntimeError("inside")
    assert not handle.active and "forward" not in lazy.__dict__
    assert lazy.forward.__func__ is type(lazy).forward


def test_an_instance_method_set_before_is_kept():
    flow = zuko.flows.MAF(4, transforms=1)
    lazy = flow.transform.transforms[0]
    calls = []
    own = lazy.forward

    def spy(c=None):
        calls.append(c)
        return own(c)

    lazy.forward = spy
    z = torch.randn(3, 4)
    expected = flow().transform.inv(z)
    with accelerate(flow):
        assert torch.equal(flow().transform.inv(z), expected)
    assert lazy.forward is spy and len(calls) == 2


def test_double_application_is_refused():
    flow = _normflows("maf")
    with accelerate(flow):
        with pytest.raises(ValueError, match=r"flow is already accelerated \(2 of its 2 "
                                             r"autoregressive parts are patched\): call undo\(\) "
                                             r"on the earlier handle first"):
            accelerate(flow)
        with pytest.raises(ValueError, match="flow is already accelerated"):
            accelerate(flow.flows[0])   # a part of it
    accelerate(flow).undo()


def test_a_deep_copy_is_the_plain_flow():
    """copy.deepcopy copies the flow, not the patch (as pickling does): no handle would own a
    patched copy. The copy can be accelerated with a handle of its own."""
    flow = _seeded(_nflows_maf)
    with accelerate(flow) as handle:
        twin = copy.deepcopy(flow)
        assert all(paraprop.flows.patches.is_patched(p) for p in handle.parts)
    assert not any(paraprop.flows.patches.is_patched(m) for m in twin.modules())
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.01)
        expected = _seeded(lambda: twin.sample(4))   # the library's own loop
        with accelerate(twin) as own:
            assert torch.equal(_seeded(lambda: twin.sample(4)), expected)
    assert own.inversions == 2 and handle.inversions == 0


def test_settings_reach_the_solve():
    flow = _seeded(lambda: zuko.flows.MAF(8, transforms=1))
    with accelerate(flow, max_iters=1), pytest.raises(
            paraprop.ConvergenceError, match="did not converge within max_iters=1"):
        flow().sample((3,))
    with accelerate(flow, max_iters=1, throw=False) as handle:
        assert flow().sample((3,)).shape == (3, 8) and handle.passes == 1
    z = torch.randn(5, 8)
    with torch.no_grad():
        expected = flow().transform.inv(z)
        with accelerate(flow, method=SlidingJacobi(3), tol=1e-6) as handle:
            x = flow().transform.inv(z)
    assert float((x - expected).abs().max()) <= 1e-5 and handle.method == "sliding_jacobi"


def test_empty_batches_pass_through():
    flow = zuko.flows.MAF(4, transforms=2)
    nfl = _normflows("rqs", d=4)
    with accelerate(flow), accelerate(nfl):
        assert flow().sample((0,)).shape == (0, 4)
        assert nfl.sample(0)[0].shape == (0, 4)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: (torch.nn.Linear(2, 2), {}), ValueError,
     r"flow has no autoregressive part to accelerate \(looked for zuko's "
     r"MaskedAutoregressiveTransform; nflows' AutoregressiveTransform; normflows' "
     r"Autoregressive .*\), got Linear"),
    (lambda: (zuko.flows.RealNVP(4), {}), ValueError,
     r"flow has no autoregressive part to accelerate .*got RealNVP"),
    (lambda: ("flow", {}), TypeError,
     r"flow must be a zuko, nflows or normflows flow \(an nn.Module\), got str"),
    (lambda: (zuko.flows.MAF(3), {"tol": -1}), ValueError,
     r"tol must be a number >= 0, got -1"),
    (lambda: (zuko.flows.MAF(3), {"max_iters": 0}), ValueError,
     r"max_iters must be a positive int or None, got 0"),
    (lambda: (zuko.flows.MAF(3), {"method": "newton"}), ValueError,
     r"method='newton' is not supported|unknown method='newton'"),
    (lambda: (zuko.flows.MAF(3), {"method": "jacobix"}), ValueError,
     r"unknown method='jacobix'; choose one of sequential, jacobi"),
    (lambda: (zuko.flows.MAF(3), {"throw": "yes"}), TypeError,
     r"throw must be a bool, got 'yes'"),
    (lambda: (zuko.flows.MaskedAutoregressiveTransform(
        4, adjacency=torch.ones(4, 4, dtype=torch.bool).tril()), {}), NotImplementedError,
     r"flow contains a zuko MaskedAutoregressiveTransform built from an adjacency matrix"),
])
def test_accelerate_refuses(make, exc, match):
    flow, kwargs = make()
    with pytest.raises(exc, match=match):
        accelerate(flow, **kwargs)


# -- gradients: the library's, through the accelerated path ----------------------------------------
@pytest.fixture
def float64():
    """Flows built and sampled in float64 (their base distributions draw in the default dtype)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    yield
    torch.set_default_dtype(dtype)


GRAD_CASES = {
    "zuko MAF rsample": (lambda: zuko.flows.MAF(5, transforms=2, randperm=True),
                         lambda f: f().rsample_and_log_prob((6,))),
    "zuko conditional NSF rsample": (lambda: zuko.flows.NSF(4, context=2, transforms=2),
                                     lambda f: f(_on(f, C[:3, :2].to(F64))).rsample((2,))),
    "nflows MAF sample": (_nflows_maf, lambda f: f.sample_and_log_prob(6)),
    "nflows RQ sample": (_nflows_rq, lambda f: f.sample_and_log_prob(6)),
    "normflows MAF log_prob": (lambda: _normflows("maf"),
                               lambda f: f.log_prob(_on(f, X6.to(F64)))),
    "normflows RQ spline sample": (lambda: _normflows("rqs"), lambda f: f.sample(6)),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_equal_the_library(name, float64, device):
    build, call = GRAD_CASES[name]
    flow = _seeded(build, 3).to(device)

    def loss():
        out = _tensors(_seeded(lambda: call(flow)))
        return sum((o * torch.linspace(-1, 1, o.numel(), device=o.device).reshape(o.shape)).sum()
                   + (o ** 2).sum() for o in out)

    def grads():
        flow.zero_grad()
        value = loss()
        value.backward()
        return value.detach(), [p.grad.clone() for p in flow.parameters() if p.grad is not None]

    expected, g_lib = grads()
    with accelerate(flow) as handle:
        value, g_par = grads()
    assert handle.inversions > 0
    assert torch.equal(value, expected)
    assert len(g_lib) == len(g_par) and len(g_lib) > 0
    for a, b in zip(g_lib, g_par, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def _made_transforms():
    from nflows.transforms import CompositeTransform, ReversePermutation
    from nflows.transforms import MaskedAffineAutoregressiveTransform as Affine
    from nflows.transforms import MaskedPiecewiseRationalQuadraticAutoregressiveTransform as RQ

    return {
        "nflows conditional MAF": CompositeTransform([
            Affine(5, 16, context_features=3), ReversePermutation(5),
            Affine(5, 16, context_features=3)]),
        "nflows conditional RQ": RQ(5, 16, context_features=3, num_bins=4, tails="linear"),
        "normflows MAF": nf.flows.MaskedAffineAutoregressive(5, 16, num_blocks=2),
    }


@pytest.mark.parametrize("name", ["nflows conditional MAF", "nflows conditional RQ",
                                  "normflows MAF"])
def test_made_gradients_reach_parameters_points_and_context(name, float64):
    """nflows / normflows inverses return log|det| too: their last pass is the one
    differentiable pass (the implicit gradient hooked on the conditionals' parameters), and the
    gradients of outputs and log|det| with respect to the parameters, the points and the
    context are the library's."""
    t = _seeded(lambda: _made_transforms()[name], 5)
    with torch.no_grad():
        for p in t.parameters():
            p.mul_(1.5)
    y = torch.randn(7, 5, generator=torch.Generator().manual_seed(1)).requires_grad_()
    c = torch.randn(7, 3, generator=torch.Generator().manual_seed(2)).requires_grad_()
    inputs = [y, c] if name.startswith("nflows") else [y]

    def run():
        out, ladj = t.inverse(*inputs)
        loss = (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum() + \
            out.pow(2).sum() + (ladj * torch.linspace(0.5, 2, ladj.numel())).sum()
        return (out.detach(), ladj.detach(),
                torch.autograd.grad(loss, [*t.parameters(), *inputs]))

    want_out, want_ladj, want = run()
    with accelerate(t) as handle:
        out, ladj, got = run()
    assert torch.equal(out, want_out) and torch.equal(ladj, want_ladj)
    assert handle.passes <= handle.library_passes
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_second_order_is_refused_not_wrong():
    """The implicit gradient is first order: a double backward through it raises, where it
    would otherwise differ from the library's own second derivative without a word."""
    flow = _seeded(lambda: zuko.flows.MAF(4, transforms=1), 4).to(F64)
    z = torch.randn(3, 4, dtype=F64, requires_grad=True)
    (g_lib,) = torch.autograd.grad(flow().transform.inv(z).pow(3).sum(), z, create_graph=True)
    torch.autograd.grad(g_lib.sum(), z)          # the library's own second order works
    x, _ = parallel_inverse(flow, z)
    (g_par,) = torch.autograd.grad(x.pow(3).sum(), z, create_graph=True)
    torch.testing.assert_close(g_par, g_lib, rtol=1e-10, atol=1e-12)   # first order: equal
    with pytest.raises(NotImplementedError, match="first order only"):
        torch.autograd.grad(g_par.sum(), z)


def test_gradient_reaches_the_points_inverted():
    flow = _seeded(lambda: zuko.flows.MAF(5, transforms=2), 4).to(F64)
    z = torch.randn(4, 5, dtype=F64, requires_grad=True)
    (g_lib,) = torch.autograd.grad(flow().transform.inv(z).pow(3).sum(), z)
    x, _ = parallel_inverse(flow, z)
    (g_par,) = torch.autograd.grad(x.pow(3).sum(), z)
    torch.testing.assert_close(g_par, g_lib, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        assert not parallel_inverse(flow, z)[0].requires_grad


# -- parallel_inverse -----------------------------------------------------------------------------
def test_zuko_inverse_equals_library(device):
    torch.manual_seed(0)
    for passes in (None, 3):
        flow = zuko.flows.MAF(12, transforms=3, randperm=True, passes=passes).to(device)
        t = flow().transform
        y = torch.randn(20, 12, device=device)
        with torch.no_grad():
            expected = t.inv(y)
        x, sol = parallel_inverse(t, y)
        assert torch.equal(x, expected)
        parts = sol.stats["parts"]
        assert len(parts) == 3 and all(s.converged for s in parts) and sol.converged
        assert sol.evaluations == sum(s.evaluations for s in parts)
    spline = zuko.flows.NSF(6, transforms=2).to(device)().transform
    y = torch.randn(10, 6, device=device)
    with torch.no_grad():
        assert torch.equal(parallel_inverse(spline, y)[0], spline.inv(y))
    adjacency = torch.ones(4, 4, dtype=torch.bool).tril()
    built = zuko.flows.MaskedAutoregressiveTransform(4, adjacency=adjacency)()
    with pytest.raises(NotImplementedError, match="built from an adjacency matrix"):
        parallel_inverse(built, torch.randn(3, 4))


def test_nflows_inverse_equals_library(device):
    from nflows.transforms import (
        CompositeTransform,
        MaskedAffineAutoregressiveTransform,
        MaskedPiecewiseRationalQuadraticAutoregressiveTransform,
        RandomPermutation,
    )

    torch.manual_seed(1)
    t = CompositeTransform([
        MaskedAffineAutoregressiveTransform(10, 32, context_features=3),
        RandomPermutation(10),
        MaskedPiecewiseRationalQuadraticAutoregressiveTransform(
            10, 32, num_bins=4, tails="linear", context_features=3),
    ]).eval().to(device)
    y, c = torch.randn(16, 10, device=device), torch.randn(16, 3, device=device)
    with torch.no_grad():
        expected, _ = t.inverse(y, c)
    x, sol = parallel_inverse(t, y, context=c)
    assert torch.equal(x, expected)
    assert sol.evaluations < 20
    with pytest.raises(TypeError, match="transform must be a zuko, nflows or normflows "
                                        "transform or flow, got Linear"):
        parallel_inverse(torch.nn.Linear(2, 2), y)
    with pytest.raises(ValueError, match=r"y must be a tensor of shape \(N, D\)"):
        parallel_inverse(t, torch.randn(3, device=device))


def test_normflows_inverse_equals_library(device):
    torch.manual_seed(2)
    y, c = torch.randn(8, 6, device=device), torch.randn(8, 3, device=device)
    maf = nf.flows.MaskedAffineAutoregressive(6, 16, context_features=3).eval().to(device)
    rqs = nf.flows.AutoregressiveRationalQuadraticSpline(6, 2, 16, num_bins=4,
                                                          init_identity=False).eval().to(device)
    circ = nf.flows.CircularAutoregressiveRationalQuadraticSpline(
        6, 2, 16, [1, 4], num_bins=4, init_identity=False).eval().to(device)   # permuted masks
    with torch.no_grad():
        x, sol = parallel_inverse(maf, y, context=c)
        assert torch.equal(x, maf.inverse(y, context=c)[0]) and sol.converged
        # the splines' loop is their forward (sampling): invert their .mprqat
        for layer in (rqs, circ):
            x, sol = parallel_inverse(layer.mprqat, y)
            assert torch.equal(x, layer(y)[0]) and sol.evaluations < 6 * 2
            assert torch.equal(parallel_inverse(layer, y)[0], layer.inverse(y)[0])
        assert not torch.equal(paraprop.flows.normflows_parts.order(circ.mprqat).cpu(),
                               torch.arange(6))
        # MAF: its two autoregressive layers solved; the splines' inverse is one pass, the
        # library's own
        for kind, solved in (("maf", 2), ("rqs", 0), ("circular", 0)):
            flow = _normflows(kind).to(device)
            x, sol = parallel_inverse(flow, y)
            assert torch.equal(x, flow.inverse(y)) and len(sol.stats["parts"]) == solved
        cond = _normflows("maf", context=3).to(device)
        assert torch.equal(parallel_inverse(cond, y, context=c)[0], cond.inverse(y, context=c))
        # a block method needs the permuted order of the circular spline's MADE
        x, sol = parallel_inverse(circ.mprqat, y, method=GSJacobi(2), tol=1e-7)
        assert sol.converged and float((x - circ(y)[0]).abs().max()) <= 1e-5


@pytest.mark.parametrize("make,exc,match", [
    (lambda: (_normflows("maf"), torch.randn(4, 6), torch.randn(4, 3)), ValueError,
     r"context must be None: a normflows NormalizingFlow takes no context \(a "
     r"ConditionalNormalizingFlow does\), got context of shape \(4, 3\)"),
    (lambda: (_normflows("maf"), torch.randn(4, 5), None), ValueError,
     r"y must have shape \(N, 6\) \(6 features, as the flow\), got \(4, 5\)"),
    (lambda: (_normflows("maf"), torch.randn(4, 6, dtype=F64), None), TypeError,
     r"y must have the dtype of the flow's parameters, torch.float32, got torch.float64"),
    (lambda: (_normflows("maf", context=3), torch.randn(4, 6), None), ValueError,
     r"context is needed: MaskedAffineAutoregressive takes 3 context features; pass context "
     r"of shape \(4, 3\)"),
    (lambda: (_normflows("rqs", context=3), torch.randn(4, 6), torch.randn(4, 2)), ValueError,
     r"context must have shape \(4, 3\) \(the rows of y, the context features of "
     r"MaskedPiecewiseRationalQuadraticAutoregressive\), got \(4, 2\)"),
    (lambda: (nf.flows.MaskedAffineAutoregressive(6, 8), torch.randn(4, 6), torch.randn(4, 3)),
     ValueError, r"context must be None: MaskedAffineAutoregressive was built without "
                 r"context_features, got context of shape \(4, 3\)"),
    (lambda: (nf.distributions.DiagGaussian(6), torch.randn(4, 6), None), TypeError,
     r"transform must be a normflows NormalizingFlow or flow layer, got DiagGaussian"),
    (lambda: (_nflows_maf().sample, torch.randn(4, 6), None), TypeError,
     r"transform must be a zuko, nflows or normflows transform or flow, got method"),
])
def test_normflows_inverse_refuses(make, exc, match):
    t, y, c = make()
    with pytest.raises(exc, match=match):
        parallel_inverse(t, y, context=c)


def test_parallel_inverse_methods_caps_and_errors(device):
    t = zuko.flows.MAF(6, transforms=2).to(device)().transform
    y = torch.randn(5, 6, device=device)
    with torch.no_grad():
        expected = t.inv(y)
    for method in ("jacobi", SlidingJacobi(2), GSJacobi(3)):
        with torch.no_grad():
            x, sol = parallel_inverse(t, y, method=method)
        assert torch.equal(x, expected)      # tol=0: the library's own fixed point, bitwise
        assert sol.converged
    with pytest.raises(paraprop.ConvergenceError, match="did not converge within max_iters=1"):
        parallel_inverse(t, y, max_iters=1)
    x, sol = parallel_inverse(t, y, max_iters=1, throw=False)
    assert not sol.converged
    with pytest.raises(ValueError, match="unknown method='newtonx'"):
        parallel_inverse(t, y, method="newtonx")
    with pytest.raises(ValueError, match="method=Newton.* is not supported here; choose one of "
                                         "sequential, jacobi"):
        parallel_inverse(t, y, method=paraprop.solvers.Newton())
    with pytest.raises(ValueError, match="tol must be a number >= 0, got -1"):
        parallel_inverse(t, y, tol=-1)
    with pytest.raises(ValueError, match="max_iters must be a positive int or None, got 0"):
        parallel_inverse(t, y, max_iters=0)
    with pytest.raises(TypeError, match="throw must be a bool, got 1"):
        parallel_inverse(t, y, throw=1)


def test_flows_is_a_subpackage_of_paraprop():
    assert paraprop.flows.parallel_inverse is parallel_inverse
    assert not hasattr(paraprop.sampling, "parallel_inverse")


@pytest.mark.slow
def test_bench_flows_quick(tmp_path):
    from paraprop_lab.bench import flows

    payload = flows.run(tmp_path, quick=True, repeats=1)
    assert payload["rows"] and all(r["bitwise equal"] for r in payload["rows"])
    assert (tmp_path / "flows.md").exists() and (tmp_path / "flows.json").exists()


def test_a_flow_built_under_inference_mode_samples_bitwise():
    """A flow built and sampled under ``torch.inference_mode()`` (its order buffers are
    inference tensors, without a version counter) samples the library's own values."""
    torch.manual_seed(0)
    with torch.inference_mode():
        flow = zuko.flows.MAF(5, transforms=2, randperm=True)
        torch.manual_seed(1)
        want = flow().sample((4,))
        with accelerate(flow):
            torch.manual_seed(1)
            got = flow().sample((4,))
    assert torch.equal(got, want)
