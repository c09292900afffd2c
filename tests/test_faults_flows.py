"""Fault tests of paraprop.flows (issue 27), one class of defect per section, with flows built to
break the accelerated paths: zuko MAF/NSF, nflows and normflows, affine and spline, with dropout
and batch norm, in bf16 and fp16, under second-order autograd, torch.func and pickle.

1. A stochastic network (train mode with dropout or batch norm) is refused by name, at every call.
2. Low precision: tol=0 is bitwise the library's own loop in bf16 and fp16, every method.
3. Second order through the implicit gradient is refused, never wrong.
4. torch.func: an accelerated flow runs the library's loop; parallel_inverse refuses.
5. Pickling and deep copies: an accelerated flow saves, loads and copies as the plain flow; the
   handle refuses.
6. Overflow: an inverse that overflows raises.
7. Settings assigned on the handle after accelerate are honoured at the next call, or refused.
8. The library's own NaN (bf16 splines, NaN points): NonFiniteError naming the sample and the
   feature, for every method and tol.
9. Never more passes than the library's loop, every method, with and without gradients.
10. A random operation inside an autoregressive network (torch.randn_like) is named.
11. The bookkeeping of the passes (the proof of exactness and the budget) is the same in its
    host (NumPy, torch) and accelerator forms.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import zuko

import paraprop
from paraprop.flows import accelerate, parallel_inverse
from paraprop.flows.patches import is_patched
from paraprop.solvers import GSJacobi, JacobiGS, SlidingJacobi

nflows = pytest.importorskip("nflows")
nf = pytest.importorskip("normflows")
F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny flows: one thread."""


def _seeded(fn, seed=0):
    torch.manual_seed(seed)
    return fn()


def _zuko_maf(d=4, dropout=None, transforms=2):
    flow = zuko.flows.MAF(d, transforms=transforms)
    if dropout is not None:   # zuko has no dropout option: put one into the second network
        flow.transform.transforms[1].hyper[1] = torch.nn.Sequential(torch.nn.ReLU(), dropout)
    return flow


def _nflows_maf(d=4, **kw):
    from nflows.distributions import StandardNormal
    from nflows.flows import Flow
    from nflows.transforms import (
        CompositeTransform,
        MaskedAffineAutoregressiveTransform,
        ReversePermutation,
    )

    t = CompositeTransform([ReversePermutation(d), MaskedAffineAutoregressiveTransform(d, 8, **kw),
                            ReversePermutation(d), MaskedAffineAutoregressiveTransform(d, 8)])
    return Flow(t, StandardNormal([d]))


def _nflows_rq(d=4):
    from nflows.distributions import StandardNormal
    from nflows.flows import Flow
    from nflows.transforms import MaskedPiecewiseRationalQuadraticAutoregressiveTransform as RQ

    return Flow(RQ(d, 8, num_bins=4, tails="linear"), StandardNormal([d]))


def _normflows(kind="maf", d=4, **kw):
    if kind == "maf":
        layers = [nf.flows.MaskedAffineAutoregressive(d, 8, **kw), nf.flows.LULinearPermute(d)]
    else:
        layers = [nf.flows.AutoregressiveRationalQuadraticSpline(d, 2, 8, num_bins=4,
                                                                  init_identity=False, **kw),
                  nf.flows.LULinearPermute(d)]
    return nf.NormalizingFlow(nf.distributions.DiagGaussian(d), layers)


# -- 1. stochastic networks ------------------------------------------------------------------------
# name: (build a flow in train mode, the library's own loop, the module parallel_inverse takes,
#        the part and layer the message names)
STOCHASTIC = {
    "zuko MAF, dropout put into its network": (
        lambda: _zuko_maf(dropout=torch.nn.Dropout(0.3)),
        lambda f, y: f().transform.inv(y), lambda f: f,
        r"'transform.transforms.1'\): flow is in train mode, and its layer 'hyper.1.1' "
        r"\(Dropout\)"),
    "nflows MAF, dropout_probability": (
        lambda: _nflows_maf(dropout_probability=0.2),
        lambda f, y: f._transform.inverse(y)[0], lambda f: f,
        r"'_transform._transforms.1'\): flow is in train mode, and its layer "
        r"'autoregressive_net.blocks.0.dropout' \(Dropout\)"),
    "nflows MAF, use_batch_norm": (
        lambda: _nflows_maf(use_batch_norm=True),
        lambda f, y: f._transform.inverse(y)[0], lambda f: f,
        r"'_transform._transforms.1'\): flow is in train mode, and its layer "
        r"'autoregressive_net.blocks.0.batch_norm_layers.0' \(BatchNorm1d\) normalises with "
        r"batch statistics"),
    "normflows MAF, dropout_probability": (
        lambda: _normflows("maf", dropout_probability=0.2),
        lambda f, y: f.inverse(y), lambda f: f,
        r"'flows.0'\): flow is in train mode, and its layer "
        r"'autoregressive_net.blocks.0.dropout' \(Dropout\)"),
    "normflows RQ spline, dropout_probability": (
        lambda: _normflows("rqs", dropout_probability=0.2),
        lambda f, y: f.flows[0](y)[0], lambda f: f.flows[0].mprqat,
        r"'flows.0.mprqat'\): flow is in train mode, and its layer "
        r"'autoregressive_net.blocks.0.dropout' \(Dropout\)"),
}


@pytest.mark.parametrize("name", list(STOCHASTIC))
def test_a_stochastic_network_is_refused_at_every_accelerated_call(name):
    build, loop, _, where = STOCHASTIC[name]
    flow = _seeded(build)
    y = torch.randn(5, 4)
    handle = accelerate(flow)   # accepted in train mode: the mode may change before a call
    with torch.no_grad(), pytest.raises(
            paraprop.StochasticModelError,
            match=rf"paraprop.flows.accelerate \(autoregressive part {where}.*call flow.eval\(\) "
                  r"first .*; or call undo\(\) on the paraprop.flows.accelerate handle"):
        loop(flow, y)
    flow.eval()                 # deterministic now: the library's result, bitwise
    with torch.no_grad():
        got = loop(flow, y)
        handle.undo()
        assert torch.equal(got, loop(flow, y))
    flow.train()                # and back: refused again, since the check is at the call
    with accelerate(flow), torch.no_grad(), pytest.raises(paraprop.StochasticModelError):
        loop(flow, y)


@pytest.mark.parametrize("name", list(STOCHASTIC))
def test_parallel_inverse_refuses_a_stochastic_network(name):
    build, loop, target, where = STOCHASTIC[name]
    flow = _seeded(build)
    y = torch.randn(5, 4)
    layer = where.split("its layer ")[1]
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"paraprop.flows.parallel_inverse \(autoregressive part '.*'\): "
                             rf"transform is in train mode, and its layer {layer}.*call "
                             r"transform.eval\(\) first"):
        parallel_inverse(target(flow), y)
    flow.eval()
    with torch.no_grad():
        assert torch.equal(parallel_inverse(target(flow), y)[0], loop(flow, y))


def test_a_stochastic_layer_outside_the_solved_parts_is_not_refused():
    """normflows' spline layers invert in one pass (their loop is the sampling direction):
    parallel_inverse of the flow solves no part, so dropout there is the library's business."""
    flow = _seeded(lambda: _normflows("rqs", dropout_probability=0.2)).eval()
    y = torch.randn(5, 4)
    flow.flows[0].train()
    x, sol = parallel_inverse(flow, y)
    assert sol.stats["parts"] == [] and x.shape == y.shape


# -- 2. low precision ------------------------------------------------------------------------------
LOW = {   # name: (build, the library's inverse, dim)
    "zuko MAF": (lambda: zuko.flows.MAF(6, transforms=3, randperm=True),
                 lambda f, y: f().transform.inv(y), 6),
    "zuko NSF": (lambda: zuko.flows.NSF(5, transforms=2), lambda f, y: f().transform.inv(y), 5),
    # zuko's other univariate transforms on the same masked networks
    "zuko SOSPF": (lambda: zuko.flows.SOSPF(4, transforms=2), lambda f, y: f().transform.inv(y),
                   4),
    "zuko BPF": (lambda: zuko.flows.BPF(4, transforms=2), lambda f, y: f().transform.inv(y), 4),
    "zuko conditional MAF": (lambda: zuko.flows.MAF(4, context=2, transforms=2),
                             lambda f, y: f(torch.ones(2, device=y.device, dtype=y.dtype))
                             .transform.inv(y), 4),
    "nflows MAF": (lambda: _nflows_maf(5), lambda f, y: f._transform.inverse(y)[0], 5),
    "nflows RQ": (lambda: _nflows_rq(5), lambda f, y: f._transform.inverse(y)[0], 5),
    "normflows MAF": (lambda: _normflows("maf", 5), lambda f, y: f.inverse(y), 5),
    "normflows RQ spline": (lambda: _normflows("rqs", 5), lambda f, y: f.flows[0](y)[0], 5),
}
METHODS = ["jacobi", SlidingJacobi(2), GSJacobi(3), JacobiGS(2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(LOW))
def test_low_precision_tol_0_is_bitwise_the_library(name, dtype, device):
    build, loop, d = LOW[name]
    flow = _seeded(build).to(device=device, dtype=dtype).eval()
    y = (2 * torch.randn(16, d, generator=torch.Generator().manual_seed(1))).to(device, dtype)
    with torch.no_grad():
        expected = loop(flow, y)
        assert torch.isfinite(expected).all()
        for method in METHODS:
            with accelerate(flow, method=method) as handle:
                got = loop(flow, y)
            assert torch.equal(got, expected), method
            assert handle.inversions > 0
            assert handle.passes <= handle.library_passes   # every method (section 9)
    if not name.startswith("zuko conditional"):   # (the zuko Flow takes its context itself)
        target = flow.flows[0].mprqat if name == "normflows RQ spline" else flow
        with torch.no_grad():
            x, sol = parallel_inverse(target, y, method="jacobi")
        assert sol.converged and torch.equal(x, expected)


def test_neural_autoregressive_flows_are_bitwise_the_library():
    """zuko's NAF: a monotonic neural univariate transform, inverted by bisection inside each
    pass of the library's loop (bf16: the bisection's fewest steps)."""
    flow = _seeded(lambda: zuko.flows.NAF(3, transforms=1)).to(torch.bfloat16)
    y = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        expected = flow().transform.inv(y)
        with accelerate(flow) as handle:
            assert torch.equal(flow().transform.inv(y), expected)
    assert handle.inversions == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tol_gt_0_certifies_each_part_or_says_no(dtype):
    """converged=True at tol > 0 promises each autoregressive part within tol of the exact inverse
    of the input that part was given (the library's own inverse of it, bitwise exact)."""
    flow = _seeded(lambda: zuko.flows.MAF(8, transforms=3, randperm=True)).to(dtype)
    y = (3 * torch.randn(64, 8, generator=torch.Generator().manual_seed(2))).to(dtype)
    transforms = list(reversed(flow().transform.transforms))   # inversion order
    for method in METHODS:
        for tol in (1e-1, 1e-2, 1e-3):
            with torch.no_grad():
                _, sol = parallel_inverse(flow, y, method=method, tol=tol, throw=False)
                inp = y
                for part, t in zip(sol.stats["parts"], transforms, strict=True):
                    exact = t.inv(inp)
                    if part.converged:
                        err = float((part.value.float() - exact.float()).abs().max())
                        assert err <= tol, (method, tol, err)
                    inp = part.value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_are_as_accurate_as_the_library(dtype, device):
    """The implicit gradient rounds differently from backpropagation through the library's D
    passes (other operations): both are compared with the float64 gradient, and ours is as
    close as the library's (measured: equal to 2 digits in bf16 and fp16)."""
    base = _seeded(lambda: zuko.flows.MAF(6, transforms=2, randperm=True))
    z = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))

    def grads(flow, zz):
        flow.zero_grad()
        x = flow().transform.inv(zz)
        (x.pow(2).sum() + x.sum()).backward()
        return torch.cat([p.grad.double().flatten() for p in flow.parameters()
                          if p.grad is not None])

    truth = grads(copy.deepcopy(base).to(device, F64), z.to(device, F64))
    flow = copy.deepcopy(base).to(device, dtype)
    library = grads(flow, z.to(device, dtype))
    with accelerate(flow) as handle:
        ours = grads(flow, z.to(device, dtype))
    assert handle.inversions == 2
    scale = float(truth.abs().max())
    err_lib = float((library - truth).abs().max()) / scale
    err_ours = float((ours - truth).abs().max()) / scale
    assert err_ours <= 2 * err_lib + torch.finfo(dtype).eps, (err_ours, err_lib)


# -- 3. second order -------------------------------------------------------------------------------
SECOND = {   # name: (build in float64, the inverse through the library's API)
    "zuko MAF": (lambda: zuko.flows.MAF(4, transforms=2), lambda f, z: f().transform.inv(z)),
    "zuko NSF": (lambda: zuko.flows.NSF(3, transforms=1), lambda f, z: f().transform.inv(z)),
    "nflows MAF": (lambda: _nflows_maf(4).eval(), lambda f, z: f._transform.inverse(z)[0]),
    "normflows MAF log_prob": (lambda: _normflows("maf", 4).eval(), lambda f, z: f.log_prob(z)),
}


def _second_order(flow, call, z, kind):
    """A gradient penalty: the gradient in z with a graph, then its square differentiated."""
    params = [p for p in flow.parameters() if p.requires_grad]
    zz = z.clone().requires_grad_()
    out = call(flow, zz)
    if kind == "hessian in z":
        return torch.autograd.functional.hessian(lambda v: call(flow, v).pow(3).sum(), z)
    if kind == "incoming gradient depends on x":
        loss = out.pow(3).sum()
    else:   # a constant incoming gradient: the case the earlier refusal missed
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum()
    (g,) = torch.autograd.grad(loss, zz, create_graph=True)
    penalty = g.pow(2).sum()
    if kind.endswith("backward()"):
        flow.zero_grad()
        penalty.backward()
        return [p.grad for p in params]
    return [a for a in torch.autograd.grad(penalty, params, allow_unused=True) if a is not None]


@pytest.mark.parametrize("kind", ["constant incoming gradient, grad in the parameters",
                                  "constant incoming gradient, backward()",
                                  "incoming gradient depends on x", "hessian in z"])
@pytest.mark.parametrize("name", list(SECOND))
def test_second_order_is_refused_never_wrong(name, kind):
    build, call = SECOND[name]
    flow = _seeded(build, 3).to(F64)
    z = torch.randn(3, 4 if "NSF" not in name else 3, dtype=F64,
                    generator=torch.Generator().manual_seed(4))
    expected = _second_order(flow, call, z, kind)   # the library's own second order
    values = expected if isinstance(expected, list) else [expected]
    assert values and max(float(v.abs().max()) for v in values) > 1e-3
    with accelerate(flow), pytest.raises(
            NotImplementedError,
            match=r"paraprop.flows computes the gradients of an inverse by implicit "
                  r"differentiation, first order only.*call undo\(\) on the "
                  r"paraprop.flows.accelerate handle"):
        _second_order(flow, call, z, kind)


def test_first_order_with_a_graph_is_still_the_library_gradient():
    """create_graph=True alone is fine: the first-order values are the library's."""
    flow = _seeded(lambda: zuko.flows.MAF(4, transforms=2), 3).to(F64)
    z = torch.randn(3, 4, dtype=F64, requires_grad=True)
    (want,) = torch.autograd.grad(flow().transform.inv(z).sum(), z, create_graph=True)
    with accelerate(flow):
        (got,) = torch.autograd.grad(flow().transform.inv(z).sum(), z, create_graph=True)
    assert got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    x, _ = parallel_inverse(flow, z)   # the same refusal through parallel_inverse
    (g,) = torch.autograd.grad(x.sum(), z, create_graph=True)
    with pytest.raises(NotImplementedError, match="first order only"):
        torch.autograd.grad(g.pow(2).sum(), list(flow.parameters()), allow_unused=True)


# -- 4. torch.func ---------------------------------------------------------------------------------
def test_torch_func_runs_the_library_loop_and_parallel_inverse_refuses():
    flow = _seeded(lambda: zuko.flows.MAF(4, transforms=2), 5).to(F64)
    z = torch.randn(3, 4, dtype=F64)
    params = dict(flow.named_parameters())

    def loss(p, v):
        return torch.func.functional_call(flow, p, ()).transform.inv(v).pow(3).sum()

    want_p, want_z = torch.func.grad(loss, argnums=(0, 1))(params, z)
    want_j = torch.func.jacrev(lambda v: flow().transform.inv(v))(z)
    with accelerate(flow) as handle:
        got_p, got_z = torch.func.grad(loss, argnums=(0, 1))(params, z)
        got_j = torch.func.jacrev(lambda v: flow().transform.inv(v))(z)
        got_v = torch.func.vmap(lambda v: flow().transform.inv(v))(z[:, None])
    assert handle.inversions == 0   # the library's own loop ran
    assert torch.equal(got_z, want_z) and torch.equal(got_j, want_j)
    assert all(torch.equal(got_p[k], want_p[k]) for k in want_p)
    assert torch.equal(got_v[:, 0], flow().transform.inv(z).detach())
    with pytest.raises(NotImplementedError, match=r"paraprop.flows.parallel_inverse cannot run "
                                                  r"under torch.func transforms"):
        torch.func.grad(lambda v: parallel_inverse(flow, v)[0].sum())(z)


# -- 5. pickling -----------------------------------------------------------------------------------
SAVES = {
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch.save": lambda obj: _torch_round_trip(obj),
}


def _torch_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


PICKLED = {   # name: (build, the library's sampling call that runs the accelerated loop)
    "zuko MAF": (lambda: zuko.flows.MAF(4, transforms=2), lambda f: f().sample((5,))),
    "nflows MAF": (lambda: _nflows_maf(4).eval(), lambda f: f.sample(5)),
    "normflows MAF": (lambda: _normflows("maf", 4).eval(),
                      lambda f: f.log_prob(torch.linspace(-1, 1, 20).view(5, 4))),
    "normflows RQ spline": (lambda: _normflows("rqs", 4).eval(), lambda f: f.sample(5)[0]),
}


@pytest.mark.parametrize("save", list(SAVES))
@pytest.mark.parametrize("name", list(PICKLED))
def test_an_accelerated_flow_saves_and_loads_as_the_plain_flow(name, save):
    build, call = PICKLED[name]
    flow = _seeded(build)
    with torch.no_grad():
        expected = _seeded(lambda: call(flow), 7)
        handle = accelerate(flow)
        loaded = SAVES[save](flow)
        assert not any(is_patched(m) for m in loaded.modules())      # plain: no patch ...
        assert torch.equal(_seeded(lambda: call(loaded), 7), expected)   # ... the library's
        assert handle.active and all(is_patched(p) for p in handle.parts)   # the original: kept
        assert torch.equal(_seeded(lambda: call(flow), 7), expected)
        n = handle.inversions
        with accelerate(loaded) as again:   # the loaded flow can be accelerated anew
            assert torch.equal(_seeded(lambda: call(loaded), 7), expected)
        assert again.inversions > 0 and handle.inversions == n   # with its own counters
        assert not any(is_patched(m) for m in loaded.modules())
        twin = copy.deepcopy(flow)   # a deep copy is the plain flow too (no handle owns it)
        assert not any(is_patched(m) for m in twin.modules())
        assert torch.equal(_seeded(lambda: call(twin), 7), expected)
        with accelerate(twin) as own:   # and gets a handle of its own
            assert torch.equal(_seeded(lambda: call(twin), 7), expected)
        assert own.inversions > 0 and handle.inversions == n
        assert all(is_patched(p) for p in handle.parts)   # the original: still accelerated
    handle.undo()


def test_the_handle_refuses_to_be_pickled():
    flow = zuko.flows.MAF(3, transforms=1)
    with accelerate(flow) as handle:
        for save in SAVES.values():
            with pytest.raises(TypeError, match=r"an Accelerated handle \(from "
                                                r"paraprop.flows.accelerate\) cannot be pickled "
                                                r"or copied.*Pickle, torch.save or "
                                                r"copy.deepcopy the flow itself instead: it loads "
                                                r"\(or copies\) as the library's plain flow"):
                save(handle)
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            copy.deepcopy(handle)


# -- 6. overflow -----------------------------------------------------------------------------------
def test_an_inverse_that_overflows_in_fp16_raises_instead_of_returning_inf():
    """Where the exact inverse itself overflows fp16 (the library's loop then returns inf / NaN
    without a word), paraprop raises NonFiniteError naming where."""
    torch.manual_seed(0)
    flow = zuko.flows.MAF(6, transforms=1, hidden_features=(16,))
    with torch.no_grad():
        for p in flow.parameters():
            p.mul_(4.0)
    flow = flow.half()
    y = (3 * torch.randn(8, 6, generator=torch.Generator().manual_seed(4))).half()
    with torch.no_grad():
        assert not torch.isfinite(flow().transform.inv(y)).all()   # the library's own result
        for method in ("jacobi", "sequential"):
            with pytest.raises(paraprop.NonFiniteError, match=r"non-finite value .* sample"):
                parallel_inverse(flow, y, method=method)
        with accelerate(flow), pytest.raises(paraprop.NonFiniteError):
            flow().transform.inv(y)


# -- 7. settings assigned on the handle ------------------------------------------------------------
def _coupled(scale, d=6, transforms=2, **kw):
    """A zuko MAF in float64 whose weights are scaled: ``scale=3`` couples the features strongly
    (the inverse needs every pass of the library's loop)."""
    flow = _seeded(lambda: zuko.flows.MAF(d, transforms=transforms, **kw)).to(F64)
    with torch.no_grad():
        for p in flow.parameters():
            p.mul_(scale)
    return flow


def test_settings_assigned_on_the_handle_are_honoured_at_the_next_call():
    flow = _coupled(1.0)
    z = torch.randn(5, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = flow().transform.inv(z)
        with accelerate(flow, tol=0.3) as handle:
            assert not torch.equal(flow().transform.inv(z), want)   # stopped early at tol=0.3
            handle.tol = 0.0
            assert handle.tol == 0.0 and torch.equal(flow().transform.inv(z), want)
            handle.max_iters = 1
            with pytest.raises(paraprop.ConvergenceError, match="max_iters=1"):
                flow().transform.inv(z)
            handle.throw = False   # the unconverged value, no error
            assert not torch.equal(flow().transform.inv(z), want)
            handle.max_iters, handle.throw = None, True
            assert torch.equal(flow().transform.inv(z), want)
    weak = _coupled(0.2)   # a weakly coupled flow: Jacobi stops before the library's D passes
    with torch.no_grad():
        want = weak().transform.inv(z)
        with accelerate(weak) as handle:
            weak().transform.inv(z)
            assert handle.passes < handle.library_passes
            handle.method = "sequential"   # one pass per feature: exactly the library's count
            before = handle.passes
            assert torch.equal(weak().transform.inv(z), want)
            assert handle.method == "sequential" and handle.passes - before == 12
            handle.method = SlidingJacobi(2)
            assert handle.method == "sliding_jacobi" and "sliding_jacobi" in repr(handle)


@pytest.mark.parametrize(("name", "value", "exc", "match"), [
    ("tol", -1, ValueError, r"tol must be a number >= 0, got -1"),
    ("method", "newton", ValueError, r"unknown method='newton'; choose one of sequential, jacobi"),
    ("max_iters", 0, ValueError, r"max_iters must be a positive int or None, got 0"),
    ("throw", 1, TypeError, r"throw must be a bool, got 1"),
    ("passes", 3, AttributeError, r"Accelerated.passes is read-only: the settings that may be "
                                  r"assigned after paraprop.flows.accelerate are method, tol, "
                                  r"max_iters, throw"),
    ("active", False, AttributeError, r"Accelerated.active is read-only"),
    ("flow", None, AttributeError, r"Accelerated.flow is read-only"),
    ("tolerance", 0.0, AttributeError, r"Accelerated.tolerance is not a setting.*call undo\(\) "
                                       r"and accelerate the flow again"),
])
def test_a_bad_setting_on_the_handle_is_refused_by_name(name, value, exc, match):
    flow = zuko.flows.MAF(3, transforms=1)
    with accelerate(flow, tol=0.1) as handle:
        with pytest.raises(exc, match=match):
            setattr(handle, name, value)
        assert (handle.tol, handle.method, handle.max_iters, handle.throw, handle.active) == (
            0.1, "jacobi", None, True, True)   # nothing changed
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del handle.tol


# -- 8. the library's own NaN: NonFiniteError, the same for every method ---------------------------
ALL_METHODS = ["jacobi", "sliding_jacobi", "gs_jacobi", "jacobi_gs", "anderson", "sequential",
               SlidingJacobi(2), GSJacobi(2)]


def test_a_library_nan_raises_for_every_method_and_tol():
    """nflows' quadratic and cubic splines in bf16: the library's inverse is NaN for one sample
    (its root formula rounds outside its domain, then 0 * NaN spreads through the masked
    network). Every method at every tol raises NonFiniteError naming that sample and feature;
    before, sliding_jacobi returned converged=True with finite values where the library has
    NaN, and raised NotTriangularError blaming dropout at tol=0."""
    from nflows.transforms import CompositeTransform, RandomPermutation
    from nflows.transforms import MaskedPiecewiseCubicAutoregressiveTransform as Cubic
    from nflows.transforms import MaskedPiecewiseQuadraticAutoregressiveTransform as Quadratic

    torch.manual_seed(0)
    t = CompositeTransform([Quadratic(5, 8, num_bins=4, tails="linear"), RandomPermutation(5),
                            Cubic(4, 5, 8)]).to(torch.bfloat16)
    y = (torch.rand(6, 5) * 0.8 + 0.1).bfloat16()
    with torch.no_grad():
        library = t.inverse(y)[0]
        assert torch.isnan(library).any(-1).tolist() == [False, True, False, False, False, False]
        for method in ALL_METHODS:
            for tol in (0.0, 1e-2, 0.1):
                with pytest.raises(paraprop.NonFiniteError,
                                   match=r"the inverse of the autoregressive part "
                                         r"'_transforms.0' \(MaskedPiecewiseQuadratic\w+\) has a "
                                         r"non-finite value \(NaN or inf\) at sample 1, feature 4, "
                                         r"computed (from features that are final|in pass 2 of "
                                         r"the library's own loop).*undo\(\)"):
                    parallel_inverse(t, y, method=method, tol=tol, throw=False)
        with accelerate(t, tol=0.01, method="sliding_jacobi"), \
                pytest.raises(paraprop.NonFiniteError, match="sample 1, feature 4"):
            t.inverse(y)


@pytest.mark.parametrize("name", ["zuko MAF", "nflows MAF", "normflows MAF"])
def test_a_nan_in_the_points_raises_naming_sample_and_feature(name):
    """A NaN in the points: the library's first pass computes it (and spreads it to the
    sample's every feature): every method names the sample and the feature."""
    build, inv = {
        "zuko MAF": (lambda: zuko.flows.MAF(5, transforms=2), lambda f: f),
        "nflows MAF": (lambda: _nflows_maf(5), lambda f: f),
        "normflows MAF": (lambda: _normflows("maf", 5), lambda f: f),
    }[name]
    flow = _seeded(build).to(F64).eval()
    y = torch.randn(4, 5, dtype=F64, generator=torch.Generator().manual_seed(2))
    y[2, 3] = float("nan")
    with torch.no_grad():
        for method in ALL_METHODS:
            with pytest.raises(paraprop.NonFiniteError,
                               match=r"has a non-finite value \(NaN or inf\) at sample 2, "
                                     r"feature \d, computed"):
                parallel_inverse(inv(flow), y, method=method)


# -- 9. never more passes than the library's loop ------------------------------------------------
PASSES = {   # name: (build a strongly coupled flow, the library's call that runs the loop)
    "zuko MAF": (lambda: _coupled(4.0), lambda f, z: f().transform.inv(z)),
    "zuko MAF, coupling passes=2": (lambda: _coupled(4.0, passes=2),
                                    lambda f, z: f().transform.inv(z)),
    "zuko MAF, random order": (lambda: _coupled(4.0, randperm=True),
                               lambda f, z: f().transform.inv(z)),
    "nflows MAF": (lambda: _scaled(_nflows_maf(6), 3.0),
                   lambda f, z: torch.cat([t.reshape(len(z), -1) for t in
                                           f._transform.inverse(z)], 1)),
    "normflows MAF": (lambda: _scaled(_normflows("maf", 6), 3.0),
                      lambda f, z: torch.cat([t.reshape(len(z), -1)
                                              for t in f.inverse_and_log_det(z)], 1)),
}


def _scaled(flow, scale):
    flow = flow.to(F64).eval()
    with torch.no_grad():
        for p in flow.parameters():
            p.mul_(scale)
    return flow


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name", list(PASSES))
def test_never_more_passes_than_the_library(name, grad):
    """Every method, every tol, with and without gradients: the passes of each inverse (the
    final and the differentiable one included) are at most the library's; before, a strongly
    coupled MAF took D + 1 per transform (the verifying pass), and the block methods more."""
    build, call = PASSES[name]
    flow = _seeded(build)
    z = torch.randn(8, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.set_grad_enabled(grad):
        want = call(flow, z)
        for method in ALL_METHODS:
            for tol in (0.0, 1e-3):
                with accelerate(flow, method=method, tol=tol) as handle:
                    got = call(flow, z)
                assert 0 < handle.passes <= handle.library_passes, (method, tol, handle.passes)
                if tol == 0:
                    assert torch.equal(got, want), method


def test_the_stats_say_how_each_inverse_ended():
    """A solver whose passes may not add a final feature is stopped where the budget would run
    out, and the library's own loop finishes from the features proven exact (stats say so)."""
    z = torch.randn(8, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    # a MAF with one pass per feature: every method proves the features within the library's
    # 6 passes; one with 3 passes over groups of features: Jacobi-GS's block sweeps prove one
    # feature per call, which could exceed the library's 3 passes, so the budget stops it
    for flow, method, start, passes in (
            (_coupled(4.0), "jacobi", "exact prefix", 6),
            (_coupled(4.0), GSJacobi(2), "exact prefix", 6),
            (_coupled(1.0, transforms=1, passes=3), JacobiGS(block_size=2), "budget", 3)):
        with torch.no_grad():
            want = flow().transform.inv(z)
            x, sol = parallel_inverse(flow, z, method=method, tol=1e-3)
        assert sol.converged and torch.equal(x, want)
        for part in sol.stats["parts"]:
            st = part.stats
            assert st["finished_by"].startswith(start), st["finished_by"]
            assert part.evaluations == st["sequential_steps"] <= st["library_passes"] == passes
            assert (st["fallback_passes"] > 0) == (start == "budget")


# -- 10. a random operation inside an autoregressive network -----------------------------------
class _Noise(torch.nn.Module):
    """Gaussian noise in training mode by torch.randn_like: no list of stochastic layers knows
    it (before, the solver blamed the map: NotTriangularError, or a random result)."""

    def forward(self, x):
        return x + 0.3 * torch.randn_like(x) if self.training else x


@pytest.mark.parametrize("method", ["jacobi", "sliding_jacobi", "sequential"])
def test_a_random_operation_in_the_network_is_named(method):
    flow = _seeded(lambda: zuko.flows.MAF(4, transforms=2)).to(F64)
    flow.transform.transforms[1].hyper[1] = torch.nn.Sequential(torch.nn.ReLU(), _Noise())
    z = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    match = (r"the network of the autoregressive part 'transform.transforms.1' "
             r"\(MaskedAutoregressiveTransform\) drew random numbers during the inverse.*"
             r"Call flow.eval\(\) if it draws only in training mode")
    with torch.no_grad():
        with pytest.raises(paraprop.StochasticModelError, match=match):
            parallel_inverse(flow, z, method=method)
        with accelerate(flow, method=method), pytest.raises(paraprop.StochasticModelError,
                                                            match=match):
            flow().transform.inv(z)
        flow.eval()   # the noise is off: the library's result, bitwise
        want = flow().transform.inv(z)
        assert torch.equal(parallel_inverse(flow, z, method=method)[0], want)


# -- 11. the pass bookkeeping: its host (NumPy, torch) and device forms agree ----------------------
def _triangular(order: torch.Tensor, dtype, kind: str, seed: int = 0):
    """``x -> tanh(W x + b) + y`` with ``W`` strictly triangular in ``order`` (ties: groups);
    ``kind``: ``"nan"`` puts a NaN at sample 1, feature 3 whatever the input (the library's own
    NaN), ``"overflow"`` an inf wherever a non-final input of the last group exceeds 0.5."""
    g = torch.Generator().manual_seed(seed)
    D = order.numel()
    mask = (order[None, :] < order[:, None]).to(F64)
    W = (torch.randn(D, D, generator=g, dtype=F64) * mask * 0.7).to(dtype)
    b = torch.randn(D, generator=g, dtype=F64).to(dtype)

    def make(y):
        def h(x):
            z = torch.tanh(x @ W.T + b) + y
            if kind == "nan":
                z = z.clone()
                z[1, 3] = float("nan")
            elif kind == "overflow":
                z = torch.where((x.abs() > 0.5) & (order == order.max()),
                                torch.full_like(z, float("inf")), z)
            return z
        return h
    return make


def _tracked_outcome(h, y, order, method, passes):
    from paraprop.flows import part_solve

    cfg = part_solve.settings(method, 0.0, None, False)
    try:
        r = part_solve.tracked_solve(h, y, order, cfg, passes=passes, where="part")
    except paraprop.NonFiniteError as e:
        return ("NonFiniteError", str(e))
    return (r.x, r.evaluations, r.why, r.exact, r.complete, r.fallback, r.groups)


def _same_outcome(a, b) -> bool:
    if isinstance(a[0], str) or isinstance(b[0], str):
        return a == b
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_pass_bookkeeping_is_the_same_on_every_path(monkeypatch, dtype):
    """Passes keeps its proof on the host in NumPy (float32/64/16), else in torch operators
    (bfloat16; every accelerator): the same passes, stops, values and errors either way, for
    Jacobi (whose iterate is the last pass's output), methods whose iterate is not, tied
    groups, a budget below D, the library's own NaN, an overflow in a non-final iterate, and an
    array large enough for the host's NumPy comparison of iterates."""
    from paraprop.flows import passes as proofs

    calls = {"numpy": 0}
    learn_numpy = proofs.Passes._learn_numpy

    def counted(self, *a):
        calls["numpy"] += 1
        return learn_numpy(self, *a)

    init = proofs.Passes.__init__

    def on_device(self, *a, **k):   # the accelerators' form of the bookkeeping, on the host
        init(self, *a, **k)
        self.host = False

    cases = []
    for (N, D), methods, kinds in (((3, 7), ("jacobi", "jacobi_gs", "anderson"),
                                    ("plain", "nan", "overflow")),
                                   ((70, 64), ("jacobi",), ("plain",))):
        g = torch.Generator().manual_seed(D)
        for ties in (False, True):
            order = torch.randperm(D, generator=g) // (2 if ties else 1)
            G = int(order.unique().numel())
            y = torch.randn(N, D, generator=g).to(dtype)
            for kind in kinds:
                make = _triangular(order, dtype, kind)
                for method in methods:
                    for passes in {D, max(G, D - 2)}:
                        cases.append((make(y), y, order, method, passes))
    with torch.no_grad():
        monkeypatch.setattr(proofs.Passes, "_learn_numpy", counted)
        host = [_tracked_outcome(*c) for c in cases]
        assert (calls["numpy"] > 0) == (dtype != torch.bfloat16)
        monkeypatch.setattr(proofs, "_NUMPY_DTYPES", ())
        torch_host = [_tracked_outcome(*c) for c in cases]
        monkeypatch.setattr(proofs.Passes, "__init__", on_device)
        device = [_tracked_outcome(*c) for c in cases]
    kinds_seen = {type(o[0]) for o in host}
    assert kinds_seen == {str, torch.Tensor}   # errors and values both exercised
    for a, b, c in zip(host, torch_host, device, strict=True):
        assert _same_outcome(a, b) and _same_outcome(a, c)
