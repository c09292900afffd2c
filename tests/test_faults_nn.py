"""paraprop.nn.RNN / GRU keep the drop-in promise (issue 15, item 2).

1. With the default ``tol`` every parallel forward matches torch.nn within the stated bound of
   docs/recurrences.md ("Accuracy"), long-memory cells included, in float32 and float64, and
   the default stays above float32's rounding floor (Newton does not run to ``T`` iterations).
2. Batch 0, double backward and torch.func transforms behave as for torch.nn.RNN / GRU, or
   raise NotImplementedError naming the alternative.
"""

import pytest
import torch

import paraprop
import paraprop.nn as pnn
from paraprop.nn import FORWARD_TOL, ParallelForward, ScanBackward

pytestmark = pytest.mark.usefixtures("one_thread")


# -- 1. accuracy with the default tolerance ----------------------------------------------------
# The stated bound (docs/recurrences.md): max |out - torch| <= 5 * tol * max(1, max |out|) with
# the default tol.
BOUND = {dtype: 5 * tol for dtype, tol in FORWARD_TOL.items()}
H, I, B = 16, 4, 2


def cells(kind: str, dtype, seed: int = 0):
    """torch's module and ours (forward set later) with the same weights.

    ``*-long``: long memory. GRU: the update gate's biases at +5 each (z ~ 1 - 5e-5: states
    remember ~20000 steps); ``gru-long-big`` z biases at +4 and the candidate's input bias at
    +2, so the states approach 1. RNN tanh: an orthogonal ``W_hh``; ReLU: the identity
    (IRNN), states growing to ~10.
    """
    torch.manual_seed(seed)
    if kind.startswith("gru"):
        ref, ours = torch.nn.GRU(I, H), pnn.GRU(I, H)
        with torch.no_grad():
            if kind == "gru-long":
                ref.bias_ih_l0[H:2 * H] = 5.0
                ref.bias_hh_l0[H:2 * H] = 5.0
            elif kind == "gru-long-big":
                ref.bias_ih_l0[H:2 * H] = 4.0
                ref.bias_hh_l0[H:2 * H] = 4.0
                ref.bias_ih_l0[2 * H:] = 2.0
    else:
        nl = "relu" if "relu" in kind else "tanh"
        ref, ours = torch.nn.RNN(I, H, nonlinearity=nl), pnn.RNN(I, H, nonlinearity=nl)
        if kind.endswith("-long"):
            with torch.no_grad():
                if nl == "tanh":
                    ref.weight_hh_l0.copy_(torch.linalg.qr(torch.randn(H, H))[0])
                else:
                    ref.weight_hh_l0.copy_(torch.eye(H))
                    ref.bias_ih_l0.zero_()
                    ref.bias_hh_l0.zero_()
                ref.weight_ih_l0.mul_(0.3)
    ref.to(dtype)
    ours.to(dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


KINDS = ["gru", "gru-long", "gru-long-big", "rnn-tanh", "rnn-tanh-long", "rnn-relu",
         "rnn-relu-long"]
# T per method: long enough for the long-memory effects, short enough for a test (the slow
# methods on long-memory cells run close to their T-iteration bound)
LENGTHS = {"newton": 2000, "quasi_newton": 1000, "jacobi_gs": 1000, "jacobi": 400,
           "gs_jacobi": 400, "sliding_jacobi": 400, "quasi_elk": 400, "elk": 120}
DTYPES = {"f64": torch.float64, "f32": torch.float32}


def kernels(mod):
    """The sequential kernel that ran per layer (``last_forward``'s records of the loop)."""
    assert all(s.method == "sequential" and s.converged for s in mod.last_forward)
    return [s.stats["kernel"] for s in mod.last_forward]


def inputs(T: int, dtype, seed: int = 1):
    return torch.randn(T, B, I, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(dtype)


def test_default_tolerances():
    assert FORWARD_TOL == {torch.float64: 1e-10, torch.float32: 1e-5}
    fwd = ParallelForward()
    assert fwd.tol is None and fwd.tol_for(torch.float32) == 1e-5
    assert fwd.tol_for(torch.float64) == 1e-10
    with pytest.raises(ValueError, match=r"no default tol for torch.float16 .* "
                                         r"pass ParallelForward\(tol=\.\.\.\)"):
        fwd.tol_for(torch.float16)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("method", list(LENGTHS))
@pytest.mark.parametrize("kind", KINDS)
def test_default_tol_matches_torch_within_the_stated_bound(kind, method, dtype):
    ref, ours = cells(kind, dtype)
    ours.forward_config = method
    T = LENGTHS[method]
    x = inputs(T, dtype)
    with torch.no_grad():
        want, h_want = ref(x)
        got, h_got = ours(x)
    (sol,) = ours.last_forward
    assert sol.stats["tol"] == FORWARD_TOL[dtype]
    assert sol.converged
    assert sol.stats["error_estimate"] <= FORWARD_TOL[dtype]
    bound = BOUND[dtype] * max(1.0, float(want.abs().max()))
    assert float((got - want).abs().max()) <= bound
    assert float((h_got - h_want).abs().max()) <= bound


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("kind", ["gru-long", "gru-long-big", "rnn-tanh-long"])
def test_default_tol_is_above_the_rounding_floor_of_newton(kind, dtype):
    """Float32 Newton steps stop shrinking near 1e-6 on long-memory cells; a default below that
    would run every solve to its T-iteration bound (right, but as slow as T Newton steps)."""
    ref, ours = cells(kind, dtype)
    ours.forward_config = "newton"
    x = inputs(2000, dtype, seed=3)
    with torch.no_grad():
        want = ref(x)[0]
        got = ours(x)[0]
    assert ours.last_forward[0].iterations <= 20
    assert float((got - want).abs().max()) <= BOUND[dtype] * max(1.0, float(want.abs().max()))


def test_issue_long_memory_gru_newton_float32():
    """The reported case: update gate near 1, hidden 16, float32, forward='newton' (then
    3.8e-4 from torch.nn.GRU at T=5000 with a residual-based stop; T=2000 here)."""
    torch.manual_seed(0)
    ref = torch.nn.GRU(1, 16)
    with torch.no_grad():
        ref.bias_ih_l0[16:32] = 5.0
        ref.bias_hh_l0[16:32] = 5.0
    ours = pnn.GRU(1, 16, forward="newton")
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2000, 4, 1, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = float((ours(x)[0] - ref(x)[0]).abs().max())
    assert err <= BOUND[torch.float32]
    assert ours.last_forward[0].iterations <= 20


def test_gradients_of_a_long_memory_gru_newton_forward():
    ref, ours = cells("gru-long", torch.float32)
    ours.forward_config = "newton"
    x = inputs(500, torch.float32)
    w = torch.randn(500, B, H, generator=torch.Generator().manual_seed(4))
    for m in (ref, ours):
        (m(x)[0] * w).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        rel = float((p.grad - q.grad).abs().max() / q.grad.abs().max())
        assert rel <= 1e-3, name


def test_unconverged_forward_with_throw_false_is_reported():
    ref, ours = cells("gru-long", torch.float64)
    ours.forward_config = ParallelForward(method="jacobi", max_iters=3, throw=False)
    with torch.no_grad():
        ours(inputs(50, torch.float64))
    (sol,) = ours.last_forward
    assert not sol.converged and sol.iterations == 3
    assert sol.result is paraprop.Result.max_iters_reached
    assert sol.stats["error_estimate"] == float("inf")
    ours.forward_config = ParallelForward(method="jacobi", max_iters=3)
    with pytest.raises(paraprop.ConvergenceError, match="max_iters=3"):
        with torch.no_grad():
            ours(inputs(50, torch.float64))


# -- 2. batch 0, double backward, torch.func ----------------------------------------------------
MODULES = [(pnn.GRU, torch.nn.GRU), (pnn.RNN, torch.nn.RNN)]
MIDS = ["gru", "rnn"]


def pair(cls, tcls, **kw):
    torch.manual_seed(0)
    kw = {"forward": "sequential", "backward": "scan", **kw}   # unless given (defaults: auto)
    ref = tcls(3, 4, num_layers=2, dtype=torch.float64)
    ours = cls(3, 4, num_layers=2, dtype=torch.float64, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def grads_of(mod, x, h0, loss):
    mod.zero_grad()
    xi = x.clone().requires_grad_()
    hi = h0.clone().requires_grad_()
    out, hn = mod(xi, hi)
    loss(out, hn).backward()
    return out.detach(), hn.detach(), xi.grad, hi.grad, [p.grad for p in mod.parameters()]


@pytest.mark.parametrize("cls,tcls", MODULES, ids=MIDS)
@pytest.mark.parametrize("forward", ["sequential", "newton"])
@pytest.mark.parametrize("backward", ["scan", "jacobi"])
def test_batch_zero_with_grad_is_torch(cls, tcls, forward, backward):
    ref, ours = pair(cls, tcls, forward=forward, backward=backward)
    x = torch.randn(5, 0, 3, dtype=torch.float64)
    h0 = torch.randn(2, 0, 4, dtype=torch.float64)

    def loss(out, hn):
        return out.sum() + hn.sum()

    want, got = grads_of(ref, x, h0, loss), grads_of(ours, x, h0, loss)
    assert got[0].shape == want[0].shape == (5, 0, 4) and got[1].shape == (2, 0, 4)
    assert got[2].shape == x.shape and got[3].shape == h0.shape
    for g, w in zip(got[4], want[4], strict=True):
        assert torch.equal(g, w)
    # batch_first and the no-grad path as well
    ref_bf, ours_bf = pair(cls, tcls, forward=forward, backward=backward, batch_first=True)
    with torch.no_grad():
        assert ours_bf(torch.randn(0, 5, 3, dtype=torch.float64))[0].shape == (0, 5, 4)


def double_backward(mod, x):
    mod.zero_grad()
    xi = x.clone().requires_grad_()
    out, hn = mod(xi)
    (g,) = torch.autograd.grad((out ** 2).sum() + hn.sum(), xi, create_graph=True)
    first = g.detach().clone()
    (g ** 2).sum().backward()
    return first, xi.grad, [p.grad for p in mod.parameters()]


@pytest.mark.parametrize("cls,tcls", MODULES, ids=MIDS)
@pytest.mark.parametrize("forward", ["sequential", "newton"])
@pytest.mark.parametrize("backward", ["scan", "jacobi"])
def test_double_backward_refused_with_the_alternative(cls, tcls, forward, backward):
    ref, ours = pair(cls, tcls, forward=forward, backward=backward)
    x = torch.randn(6, 2, 3, dtype=torch.float64)
    want_first = double_backward(ref, x)[0]
    xi = x.clone().requires_grad_()
    out, hn = ours(xi)
    (g,) = torch.autograd.grad((out ** 2).sum() + hn.sum(), xi, create_graph=True)
    # the first-order gradient is right, and carries a graph (as torch's does) ...
    assert float((g.detach() - want_first).abs().max()) <= 1e-10
    assert g.requires_grad
    # ... whose differentiation is refused with the alternative named
    with pytest.raises(NotImplementedError,
                       match=rf"paraprop.nn.{cls.__name__}\(backward='{backward}'\) computes "
                             r"first-order gradients only .* use backward='autograd'"):
        (g ** 2).sum().backward()


@pytest.mark.parametrize("cls,tcls", MODULES, ids=MIDS)
def test_double_backward_with_autograd_backward_is_torch(cls, tcls):
    ref, ours = pair(cls, tcls, backward="autograd")
    x = torch.randn(6, 2, 3, dtype=torch.float64)
    want, got = double_backward(ref, x), double_backward(ours, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for g, w in zip(got[2], want[2], strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("cls,tcls", MODULES, ids=MIDS)
@pytest.mark.parametrize("backward", ["scan", "jacobi", "autograd"])
def test_torch_func_grad_and_jacrev_are_torch(cls, tcls, backward):
    ref, ours = pair(cls, tcls, backward=backward)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    for transform in (torch.func.jacrev, torch.func.jacfwd):
        want = transform(lambda z: ref(z)[0])(x)
        got = transform(lambda z: ours(z)[0])(x)
        assert torch.equal(got, want)
    want = torch.func.grad(lambda z: ref(z)[0].sum())(x)
    assert torch.equal(torch.func.grad(lambda z: ours(z)[0].sum())(x), want)
    params = {k: v.detach() for k, v in ours.named_parameters()}

    def loss(mod):
        return lambda p: torch.func.functional_call(mod, p, (x,))[0].pow(2).sum()

    want = torch.func.grad(loss(ref))(params)
    got = torch.func.grad(loss(ours))(params)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("cls,tcls", MODULES, ids=MIDS)
def test_vmap_fails_as_in_torch(cls, tcls):
    ref, ours = pair(cls, tcls)
    xs = torch.randn(3, 5, 2, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="Batching rule not implemented") as want:
        torch.func.vmap(lambda z: ref(z)[0])(xs)
    with pytest.raises(RuntimeError, match="Batching rule not implemented") as got:
        torch.func.vmap(lambda z: ours(z)[0])(xs)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("cls,tcls", MODULES, ids=MIDS)
@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap"])
def test_parallel_forward_under_torch_func_is_refused(cls, tcls, transform):
    _, ours = pair(cls, tcls, forward="newton")
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    run = {"grad": lambda: torch.func.grad(lambda z: ours(z)[0].sum())(x),
           "jacrev": lambda: torch.func.jacrev(lambda z: ours(z)[0])(x),
           "vmap": lambda: torch.func.vmap(lambda z: ours(z)[0])(x[None])}[transform]
    with pytest.raises(NotImplementedError,
                       match=rf"paraprop.nn.{cls.__name__}\(forward='newton'\) cannot run under "
                             r"torch.func transforms .* use forward='sequential'"):
        run()


# -- 3. settings assigned after construction (issue 27, item 5) ----------------------------------
# The constructor refuses dropout, bidirectional and proj_size; torch.nn's attributes can still be
# assigned afterwards, and those that fixed the parameters (num_layers, bias, sizes, the
# nonlinearity) would make the module compute something else. Every call checks them.
ALL = [(pnn.RNN, torch.nn.RNN), (pnn.GRU, torch.nn.GRU), (pnn.LSTM, torch.nn.LSTM)]
ALL_IDS = ["rnn", "gru", "lstm"]
LATER = [
    ("dropout", 0.5, NotImplementedError, r"does not support dropout between layers \(got "
                                          r"dropout=0.5\)"),
    ("bidirectional", True, NotImplementedError, r"does not support bidirectional=True"),
    ("proj_size", 2, NotImplementedError, r"does not support proj_size"),
    ("num_layers", 3, ValueError, r"num_layers was assigned after construction \(expected "
                                  r"num_layers=2, the value the parameters were built for; "
                                  r"found 3\)"),
    ("bias", False, ValueError, r"bias was assigned after construction \(expected bias=True"),
    ("hidden_size", 5, ValueError, r"hidden_size was assigned .* found 5\)"),
    ("input_size", 4, ValueError, r"input_size was assigned .* found 4\)"),
]


def _call_paths(m, x):
    """The module's entry paths: scan backward with a graph, no graph, torch.func."""
    xi = x.clone().requires_grad_()
    yield lambda: m(xi)[0].sum().backward()
    yield lambda: m(x)
    yield lambda: torch.func.grad(lambda z: m(z)[0].sum())(x)


@pytest.mark.parametrize("cls,tcls", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("attr,value,exc,match", LATER, ids=[c[0] for c in LATER])
def test_settings_assigned_after_construction_are_refused_at_call_time(cls, tcls, attr, value,
                                                                        exc, match):
    m = cls(3, 4, num_layers=2, forward="sequential")     # torch's kernel: bitwise at the end
    x = torch.randn(5, 2, 3)
    before = getattr(m, attr)
    setattr(m, attr, value)
    m.train()
    for call in _call_paths(m, x):
        with pytest.raises(exc, match=rf"paraprop.nn.{cls.__name__}"):
            call()
        with pytest.raises(exc, match=match):
            call()
    with torch.no_grad():
        with pytest.raises(exc, match=match):
            m(x)
    setattr(m, attr, before)          # restored: the module runs again, as torch's
    ref = tcls(3, 4, num_layers=2)
    ref.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert torch.equal(m(x)[0], ref(x)[0])


def test_a_module_saved_before_the_check_existed_still_loads_and_runs(tmp_path):
    m = pnn.GRU(3, 4)
    del m.__dict__["_structure"]            # as a module pickled by an earlier version
    torch.save(m, tmp_path / "m.pt")
    m = torch.load(tmp_path / "m.pt", weights_only=False)
    assert m(torch.randn(5, 2, 3))[0].shape == (5, 2, 4)
    m.num_layers = 2                        # checked from then on
    with pytest.raises(ValueError, match="num_layers was assigned after construction"):
        m(torch.randn(5, 2, 3))


def test_rnn_nonlinearity_assigned_after_construction_is_refused():
    """torch.nn.RNN reads ``mode`` (set at construction), so an assigned ``nonlinearity`` is
    ignored by torch itself; the drop-in refuses it instead."""
    m = pnn.RNN(3, 4)
    m.nonlinearity = "relu"
    with pytest.raises(ValueError, match=r"nonlinearity was assigned after construction "
                                         r"\(expected nonlinearity='tanh', .* found 'relu'\)"):
        m(torch.randn(5, 2, 3))
    m.nonlinearity = "tanh"
    m.mode = "RNN_RELU"
    with pytest.raises(ValueError, match=r"mode was assigned after construction \(expected "
                                         r"mode='RNN_TANH'"):
        m(torch.randn(5, 2, 3))


def test_bias_true_assigned_to_a_bias_free_module_is_refused():
    m = pnn.GRU(3, 4, bias=False)
    m.bias = True
    with pytest.raises(ValueError, match=r"bias was assigned after construction \(expected "
                                         r"bias=False, .* found True\)"):
        m(torch.randn(5, 2, 3, requires_grad=True))
    m.bias = 1                          # not the bool the parameters were built for
    with pytest.raises(ValueError, match=r"expected bias=False, .* found 1\)"):
        m(torch.randn(5, 2, 3))


@pytest.mark.parametrize("cls,tcls", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("forward", ["sequential", "newton"])
def test_batch_first_assigned_after_construction_is_honoured(cls, tcls, forward):
    """``batch_first`` does not change the parameters: both torch and the drop-in read it at
    every call, so an assignment is honoured, outputs and gradients as torch's."""
    torch.manual_seed(0)
    ref = tcls(3, 4, num_layers=2, dtype=torch.float64)
    ours = cls(3, 4, num_layers=2, dtype=torch.float64, forward=forward)
    ours.load_state_dict(ref.state_dict())
    ref.batch_first = ours.batch_first = True
    x = torch.randn(2, 7, 3, dtype=torch.float64)
    got, want = [], []
    for m, out in ((ours, got), (ref, want)):
        xi = x.clone().requires_grad_()
        y = m(xi)[0]
        y.pow(2).sum().backward()
        out += [y.detach(), xi.grad]
    assert got[0].shape == (2, 7, 4)
    assert err(got[0], want[0]) <= 1e-10 and err(got[1], want[1]) <= 1e-10


def err(a, b):
    return float((a - b).abs().max())


def test_para_cells_check_their_options_on_assignment():
    m = pnn.ParaGRU(3, 4)
    with pytest.raises(ValueError, match="unknown forward='deer'"):
        m.forward_config = "deer"
    with pytest.raises(TypeError, match="backward must be one of"):
        m.backward_config = 3


# -- 4. torch.jit (issue 27, cryptic errors) ------------------------------------------------------
class _Wrapper(torch.nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("make", [lambda: pnn.RNN(3, 4), lambda: pnn.GRU(3, 4),
                                  lambda: pnn.LSTM(3, 4, forward="newton"),
                                  lambda: pnn.ParaGRU(3, 4)],
                         ids=["rnn", "gru", "lstm", "paragru"])
def test_jit_script_is_refused_by_name(make):
    m = make()
    name = type(m).__name__
    match = (rf"paraprop.nn.{name} cannot be compiled by torch.jit.script: .* use "
             rf"torch.compile\(module\) instead, or the module without jit")
    with pytest.raises(NotImplementedError, match=match):
        torch.jit.script(m)
    with pytest.raises(NotImplementedError, match=match):     # inside a scripted model
        torch.jit.script(_Wrapper(m))


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("cls", [pnn.RNN, pnn.GRU, pnn.LSTM], ids=ALL_IDS)
def test_jit_trace_is_refused_by_name(cls):
    m = cls(3, 4)
    x = torch.randn(5, 2, 3)
    match = (rf"paraprop.nn.{cls.__name__} cannot be traced by torch.jit.trace: .* use "
             r"torch.compile\(module\) instead, or the module without jit. To export torch's "
             rf"own module, load the state dict into torch.nn.{cls.__name__}")
    with pytest.raises(NotImplementedError, match=match):
        torch.jit.trace(m, (x,))
    with pytest.raises(NotImplementedError, match=match):
        torch.jit.trace(_Wrapper(m), (x,))
    assert m(x)[0].shape == (5, 2, 4)     # the module itself is untouched


# -- 5. torch.autocast ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls,tcls", ALL, ids=ALL_IDS)
def test_autocast_runs_torch_or_is_refused_by_name(cls, tcls):
    torch.manual_seed(0)
    ref = tcls(3, 4, num_layers=2)
    ours = cls(3, 4, num_layers=2, backward="scan")
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(6, 2, 3)
    name = cls.__name__
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # the scan backward cannot follow autocast's per-operation dtypes: refused by name
        with pytest.raises(NotImplementedError,
                           match=rf"paraprop.nn.{name}\(backward='scan'\) does not run under "
                                 r"torch.autocast: .* use backward='autograd'"):
            ours(x.clone().requires_grad_())
        ours.forward_config = "newton"
        with pytest.raises(NotImplementedError,
                           match=rf"paraprop.nn.{name}\(forward='newton'\) does not run under "
                                 r"torch.autocast .*\(module.to\(torch.bfloat16\): the solve then "
                                 r"runs in float32"):
            with torch.no_grad():
                ours(x)
        # without a graph, the sequential forward is torch's module under autocast, bitwise
        for kernel in ("sequential", "native", "auto"):
            ours.forward_config = kernel
            with torch.no_grad():
                got, want = ours(x)[0], ref(x)[0]
            assert got.dtype == want.dtype and torch.equal(got, want)
            assert kernels(ours) == ([] if kernel == "sequential" else ["torch", "torch"])
        # backward='autograd': torch's module and torch's backward under autocast, bitwise
        ours.forward_config = "sequential"
        ours.backward_config = "autograd"
        grads = []
        for m in (ours, ref):
            m.zero_grad()
            xi = x.clone().requires_grad_()
            y = m(xi)[0]
            y.float().pow(2).sum().backward()
            grads.append([y.detach(), xi.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


# -- 6. low precision (issue 27, item 3) ----------------------------------------------------------
# bf16 / fp16 modules: the sequential forward is torch's kernel in that dtype (bitwise torch's
# outputs); the Jacobian factors, the scan or Jacobi backward and a parallel forward compute in
# float32 and round to the module's dtype. The stated bound (docs/recurrences.md, "Low
# precision"): outputs and gradients within LOW_BOUND times torch's own deviation from the
# float64 computation with the same (rounded) weights and inputs, plus one eps of the dtype, both
# relative to the largest value.
LOW_BOUND = 2.0
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _low_run(m, x, w, dtype=None):
    m.zero_grad()
    xi = x.clone().requires_grad_()
    out, h = m(xi)
    h = h[0] if isinstance(h, tuple) else h
    ((out.double() * w).sum() + h.double().sum()).backward()
    return [out.detach().double(), xi.grad.double(),
            *(p.grad.double() for p in m.parameters())], out


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("dtype", list(LOW.values()), ids=list(LOW))
@pytest.mark.parametrize("path", ["sequential-scan", "sequential-jacobi", "newton-scan"])
@pytest.mark.parametrize("cls,tcls", ALL, ids=ALL_IDS)
def test_low_precision_within_the_stated_bound_of_torch(cls, tcls, path, dtype, device):
    torch.manual_seed(1)
    fwd, bwd = path.split("-")
    ref = tcls(4, 8, num_layers=2).to(device, dtype)
    ours = cls(4, 8, num_layers=2, forward=fwd, backward=bwd).to(device, dtype)
    ours.load_state_dict(ref.state_dict())
    ref64 = tcls(4, 8, num_layers=2).to(device, torch.float64)
    ref64.load_state_dict(ref.state_dict())            # the same rounded weights in float64
    T = 60
    x = torch.randn(T, 3, 4).to(device, dtype)
    w = torch.randn(T, 3, 8, dtype=torch.float64).to(device)
    exact, _ = _low_run(ref64, x.double(), w)
    theirs, t_out = _low_run(ref, x, w)
    ours_, o_out = _low_run(ours, x, w)
    assert o_out.dtype == dtype and all(p.grad.dtype == dtype for p in ours.parameters())
    for e, t, o in zip(exact, theirs, ours_, strict=True):
        assert _rel(o, e) <= LOW_BOUND * _rel(t, e) + torch.finfo(dtype).eps
    if fwd == "sequential":
        if device.type == "cpu":                       # torch's own kernel in this dtype
            assert torch.equal(o_out, t_out)
        assert ours.last_forward == ()
    else:                                              # solved in float32, said so
        assert [s.stats["compute_dtype"] for s in ours.last_forward] == [torch.float32] * 2
        assert [s.converged for s in ours.last_forward] == [True, True]
    assert ours.last_backward.compute_dtype == torch.float32


@pytest.mark.parametrize("dtype", list(LOW.values()), ids=list(LOW))
@pytest.mark.parametrize("cls,tcls", ALL, ids=ALL_IDS)
def test_low_precision_native_forward_falls_back_to_torch_and_says_so(cls, tcls, dtype):
    """The native loop is float32/float64 only: a bf16/fp16 module runs torch's kernel in its
    own dtype (no silent upcast), and last_forward names the kernel that ran."""
    torch.manual_seed(0)
    ref = tcls(3, 4, num_layers=2).to(dtype)
    ours = cls(3, 4, num_layers=2, forward="native").to(dtype)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 2, 3).to(dtype)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got, want = ours(x)[0], ref(x)[0]
        assert got.dtype == dtype and torch.equal(got, want)
        assert kernels(ours) == ["torch", "torch"]
        assert all(s.stats["compute_dtype"] == dtype for s in ours.last_forward)


@pytest.mark.parametrize("kernel", ["native", "auto"])
def test_native_kernel_runs_on_the_cpu_only_and_the_stats_say_which_ran(kernel, device):
    """The native C loops are CPU-only: elsewhere torch's kernel runs, and last_forward says
    so; the outputs are torch's either way (within the native loop's rounding)."""
    from paraprop.scan import native

    torch.manual_seed(0)
    ref = torch.nn.GRU(3, 4, num_layers=2, dtype=torch.float64).to(device)
    ours = pnn.GRU(3, 4, num_layers=2, dtype=torch.float64, forward=kernel, device=device)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(9, 2, 3, dtype=torch.float64).to(device)
    with torch.no_grad():
        got, want = ours(x)[0], ref(x)[0]
    ran = "native" if device.type == "cpu" and native.available() else "torch"
    assert kernels(ours) == [ran, ran]
    assert err(got, want) <= 1e-12


def test_low_precision_parallel_forward_honours_an_explicit_tol():
    torch.manual_seed(0)
    ours = pnn.GRU(3, 4, forward=ParallelForward(method="jacobi", tol=1e-2)).to(torch.bfloat16)
    with torch.no_grad():
        ours(torch.randn(30, 2, 3).to(torch.bfloat16))
    (sol,) = ours.last_forward
    assert sol.stats["tol"] == 1e-2 and sol.stats["compute_dtype"] == torch.float32
    assert sol.stats["error_estimate"] <= 1e-2


# -- 7. the one-block path of other devices, run with CPU tensors (issue 28) ----------------------
@pytest.mark.parametrize("forward", ["sequential", "newton"])
@pytest.mark.parametrize("cls,tcls", [(pnn.GRU, torch.nn.GRU), (pnn.LSTM, torch.nn.LSTM)],
                         ids=["gru", "lstm"])
def test_one_block_path_of_other_devices_equals_torch(monkeypatch, cls, tcls, forward):
    """Off the CPU the gates and factors are recomputed in one block over all steps (the CPU
    uses cache-sized blocks); with CPU_BLOCKS off the CPU runs that same path."""
    from paraprop.jacobians import cells

    monkeypatch.setattr(cells, "CPU_BLOCKS", False)
    assert cells.steps_per_block(torch.device("cpu"), 37, 8, 4) == 37
    torch.manual_seed(0)
    ref = tcls(3, 5, num_layers=2, dtype=torch.float64)
    ours = cls(3, 5, num_layers=2, dtype=torch.float64, forward=forward)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(37, 3, 3, dtype=torch.float64)
    res = []
    for m in (ours, ref):
        xi = x.clone().requires_grad_()
        y = m(xi)[0]
        y.pow(2).sum().backward()
        res.append([y.detach(), xi.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*res, strict=True):
        assert err(a, b) <= 1e-10 * max(1.0, float(b.abs().max()))


def test_steps_per_block_per_device():
    from paraprop.jacobians import cells

    cpu, gpu = torch.device("cpu"), torch.device("meta")
    assert cells.steps_per_block(cpu, 1000, 8192, 16) == 512
    assert cells.steps_per_block(cpu, 1000, 8, 16) == 1
    assert cells.steps_per_block(gpu, 1000, 8192, 16) == 1000
    assert cells.steps_per_block(gpu, 0, 8192, 16) == 1


@pytest.mark.parametrize("cls,tcls", ALL, ids=ALL_IDS)
def test_last_backward_names_the_scan_kernel_that_ran(cls, tcls, device):
    """The native C scan runs on the CPU only (float32/float64); elsewhere a torch or Triton
    method runs, and last_backward says which."""
    from paraprop.scan import native

    ours = cls(3, 4, num_layers=2, dtype=torch.float64, device=device, backward="scan")
    x = torch.randn(30, 2, 3, dtype=torch.float64).to(device).requires_grad_()
    ours(x)[0].sum().backward()
    assert ours.last_backward.kind == "scan"
    ran = [s.method for s in ours.last_backward.layers]
    assert len(ran) == 2 and ours.last_backward.converged
    if device.type == "cpu" and native.available():
        assert ran == ["native", "native"]
    else:
        assert "native" not in ran
    ours.backward_config = ScanBackward(method="blelloch")
    ours(x)[0].sum().backward()
    assert [s.method for s in ours.last_backward.layers] == ["blelloch", "blelloch"]


@pytest.mark.parametrize("cls", [paraprop.nn.RNN, paraprop.nn.GRU, paraprop.nn.LSTM])
def test_gradient_penalty_wrt_the_weights_is_refused_not_silently_none(cls):
    # a gradient penalty: the input gradient with create_graph=True, then its gradient with
    # respect to the weights. The incoming gradient of out.sum() is a constant, so a refusing
    # node anchored on it alone is pruned and torch returns None for every weight (silently
    # wrong); anchored on the saved inputs too, the refusal is reached
    m = cls(3, 4, backward="scan")
    x = torch.randn(5, 2, 3, requires_grad=True)
    out, _ = m(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = g.pow(2).sum()
    with pytest.raises(NotImplementedError, match="first-order gradients only"):
        torch.autograd.grad(penalty, list(m.parameters()), allow_unused=True)


def test_triton_backward_wider_than_its_kernel_is_refused_at_construction():
    """The first GPU run met this inside a training step (an LSTM of hidden 64 has a state of
    128 for the kernels' 64): now the module refuses it when built or configured, by name."""
    from paraprop.nn import GRU, LSTM, RNN, ParaLSTM, ScanBackward

    tb = ScanBackward(method="triton")
    with pytest.raises(ValueError, match=r"LSTM\(hidden_size=40\) has a state of 80 \(2 x"):
        LSTM(4, 40, backward=tb)
    with pytest.raises(ValueError, match=r"GRU\(hidden_size=65\) has a state of 65:"):
        GRU(4, 65, backward=tb)
    with pytest.raises(ValueError, match=r"RNN\(hidden_size=65\)"):
        RNN(4, 65, backward=tb)
    assert LSTM(4, 32, backward=tb).backward_config == tb           # 64: fits
    assert GRU(4, 64, backward=tb).backward_config == tb
    assert ParaLSTM(4, 200, backward=tb).backward_config == tb      # diagonal: any width
    wide = LSTM(4, 40)
    before = wide.backward_config
    with pytest.raises(ValueError, match="method='auto'"):
        wide.backward_config = tb
    assert wide.backward_config == before
    wide.backward_config = ScanBackward(method="chunked")            # other methods: any width
