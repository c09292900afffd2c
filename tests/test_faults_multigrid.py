"""Faults of paraprop.multigrid and paraprop.distributed (issue 15): ``converged=True`` means
within the bound of the serial result, also for stacks that accumulate small steps; unchecked
runs say so; refused blocks, inputs and ranks get clear errors. Issue 27: every setting
assigned after construction (the blocks themselves, levels, coarsening) is honoured or refused
by name; a random operation in a block is named; tol=0 is bitwise for every relaxation."""

import math

import pytest
import torch
from torch import nn

from paraprop import ConvergenceError, StochasticModelError
from paraprop.distributed import PeerError, layer_range, spawn
from paraprop.multigrid import (
    ForwardStepper,
    Hierarchy,
    ParallelResidualStack,
    UncheckedResultWarning,
    mgrit,
)


class Accumulating(nn.Module):
    """``F(u) = tanh(W u + b)``: with ``u_{n+1} = u_n + h F(u_n)`` the states accumulate
    ``N`` steps of size ``h`` (the map where a last-step or residual rule stops far too
    early)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0]).to(weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            self.linear.bias.copy_(bias)

    def forward(self, u):
        return torch.tanh(self.linear(u))


def accumulating(depth, width=6, *, gain=1.5, shared=True, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    count = 1 if shared else depth
    w = torch.randn(count, width, width, generator=g, dtype=torch.float64) * gain \
        / math.sqrt(width)
    b = torch.randn(count, width, generator=g, dtype=torch.float64)
    return [Accumulating(w[0 if shared else n], b[0 if shared else n]).to(dtype)
            for n in range(depth)]


def serial_states(blocks, x, h):
    out = [x]
    with torch.no_grad():
        for blk in blocks:
            out.append(out[-1] + h * blk(out[-1]))
    return torch.stack(out)


def inputs(width=6, batch=4, seed=1, dtype=torch.float64):
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def max_err(a, b):
    return float((a - b).abs().max())


# -- the promise: converged means within 10 * tol of the serial states ---------------------------
CASES = [  # depth, h, gain, shared weights, levels, coarsening, relax
    (64, 1 / 64, 1.5, True, 2, 4, "FCF"),
    (64, 1 / 64, 3.0, False, 2, 4, "F"),
    (128, 1 / 128, 1.5, True, 3, 4, "FCF"),
    (256, 1 / 256, 1.5, False, 3, 4, "F"),
    (256, 1 / 256, 3.0, True, 2, 4, "FCF"),
    (64, 0.5, 3.0, True, 2, 4, "FCF"),  # large h: the coarse steps c h are unstable
    (64, 1.0, 1.5, True, 2, 4, "F"),
    (64, 2.0, 3.0, True, 3, 4, "FCF"),
    (128, 0.5, 3.0, False, 2, 2, "F"),
    (128, 2.0, 1.5, True, 2, 4, "FCF"),
    (256, 0.5, 0.5, False, 3, 4, "F"),
    (128, 0.5, 1.5, True, 3, 4, "FCF"),
]


def sensitivity(blocks, x, h):
    """How much the serial computation itself amplifies a relative perturbation of 1e-14:
    the floor below which no method can be compared with it."""
    return max_err(serial_states(blocks, x * (1 + 1e-14), h), serial_states(blocks, x, h)) / 1e-14


@pytest.mark.parametrize("depth,h,gain,shared,levels,c,relax", CASES)
def test_converged_means_within_tol_of_serial(depth, h, gain, shared, levels, c, relax):
    """With max_iters=None the solve always converges (its error estimate reaches tol, or the
    exactness bound), and then it is within 10 * tol of the serial states; a cap one cycle
    short of that is reported unconverged and raises."""
    blocks = accumulating(depth, gain=gain, shared=shared, seed=depth)
    x = inputs()
    ref = serial_states(blocks, x, h)
    assert sensitivity(blocks, x, h) < 1e6  # the serial result is defined to far below tol
    hier = Hierarchy.build(depth, levels=levels, coarsening=c)
    for tol in (1e-4, 1e-6, 1e-8):
        sol = mgrit(ForwardStepper(blocks), x, hier, h, relax=relax, tol=tol)
        assert sol.converged and sol.stats["checked"]
        assert sol.iterations <= hier.exact_cycles() == sol.stats["bound"]
        assert sol.stats["error_estimate"] <= tol
        assert max_err(sol.value, ref) <= 10 * tol, (tol, sol.iterations)
        if tol == 1e-6 and sol.iterations:
            cap = sol.iterations - 1
            short = mgrit(ForwardStepper(blocks), x, hier, h, relax=relax, tol=tol,
                          max_iters=cap, throw=False)
            assert not short.converged and short.iterations == cap
            with pytest.raises(ConvergenceError, match=f"max_iters={cap} iterations"):
                mgrit(ForwardStepper(blocks), x, hier, h, relax=relax, tol=tol, max_iters=cap)


@pytest.mark.parametrize("depth,h,gain,levels", [(64, 0.5, 3.0, 2), (64, 2.0, 3.0, 3),
                                                  (128, 1 / 128, 1.5, 3)])
def test_exactness_bound_is_the_serial_result(depth, h, gain, levels):
    """tol=None with max_iters=None runs N // c cycles: the serial result, also where the
    coarse propagator is unstable and amplifies rounding (checked, converged)."""
    blocks = accumulating(depth, gain=gain, seed=3)
    x = inputs()
    hier = Hierarchy.build(depth, levels=levels, coarsening=4)
    for relax in ("F", "FCF"):
        sol = mgrit(ForwardStepper(blocks), x, hier, h, relax=relax, tol=None)
        assert sol.iterations == hier.exact_cycles()
        assert sol.converged and sol.stats["checked"] and sol.stats["error_estimate"] == 0.0
        assert max_err(sol.value, serial_states(blocks, x, h)) <= 1e-10


def test_the_residual_understates_the_error():
    """On the accumulating stack the error adds up the residuals of the earlier C-points: it is
    several times the residual norm, so a residual rule would stop too early. The error
    estimate stops within 10 * tol for every tol."""
    depth, h = 256, 0.5
    blocks = accumulating(depth, gain=1.5, seed=0)
    x = inputs()
    ref = serial_states(blocks, x, h)
    hier = Hierarchy.build(depth, levels=2, coarsening=4)
    one = mgrit(ForwardStepper(blocks), x, hier, h, max_iters=1, tol=1e-8, throw=False)
    assert max_err(one.value, ref) > 5 * float(one.residuals[-1])
    for tol in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9):
        sol = mgrit(ForwardStepper(blocks), x, hier, h, tol=tol)
        assert sol.converged and max_err(sol.value, ref) <= 10 * tol, tol


def test_old_defaults_converge_or_raise():
    """The issue's case (max_cycles=2, tol=None gave error 11 on outputs of size 64 with
    converged=None): the defaults now converge to the serial output; 2 cycles with a tol raise
    ConvergenceError; 2 cycles without a tol are reported as not checked."""
    depth, h = 64, 1.0
    blocks = accumulating(depth, width=8, gain=3.0, seed=5)
    x = inputs(width=8, batch=8)
    ref = serial_states(blocks, x, h)[-1]
    net = ParallelResidualStack(blocks, h)
    with torch.no_grad():
        y = net(x)
    fwd = net.last_forward
    assert fwd.converged and fwd.stats["checked"] and fwd.stats["tol"] == 1e-5
    assert max_err(y, ref) <= 1e-4
    capped = ParallelResidualStack(blocks, h, max_iters=2)
    with pytest.raises(ConvergenceError, match=r"ParallelResidualStack \(forward\): "
                                               r"method='mgrit' did not converge within "
                                               r"max_iters=2 iterations"):
        with torch.no_grad():
            capped(x)
    with pytest.warns(UncheckedResultWarning, match=r"tol=None with max_iters=2 .* not the "
                                                    r"serial one"):
        unchecked = ParallelResidualStack(blocks, h, max_iters=2, tol=None)
    with torch.no_grad():
        y2 = unchecked(x)
    st = unchecked.last_forward
    assert st.converged is False and st.stats["checked"] is False
    assert max_err(y2, ref) > 1e-3  # indeed not the serial output
    # a cap that reaches the exactness bound converges, tol or not
    short = accumulating(8, width=8, gain=3.0, seed=5)
    for tol in (None, 1e-5):
        net = ParallelResidualStack(short, h, max_iters=2, tol=tol)
        with torch.no_grad():
            y3 = net(x)
        assert net.last_forward.converged
        assert max_err(y3, serial_states(short, x, h)[-1]) <= 1e-10


def test_throw_false_returns_the_unconverged_solution():
    blocks = accumulating(64, seed=6)
    x = inputs().requires_grad_(True)
    net = ParallelResidualStack(blocks, 1 / 64, max_iters=1, throw=False)
    net(x).sum().backward()
    for sol in (net.last_forward, net.last_backward):
        assert sol.converged is False and sol.stats["checked"] is True
        assert sol.iterations == 1 and sol.method == "mgrit"
        assert sol.residuals.dtype == torch.float64 and sol.residuals.dim() == 1
    with pytest.raises(ConvergenceError, match="pass throw=False to inspect") as info:
        mgrit(ForwardStepper(blocks), x.detach(), Hierarchy.build(64, levels=2, coarsening=4),
              1 / 64, max_iters=1)
    assert info.value.solution.iterations == 1 and not info.value.solution.converged


def test_backward_converges_to_the_serial_gradients():
    depth, h = 128, 1 / 128
    blocks = accumulating(depth, shared=False, seed=7)
    x = inputs().requires_grad_(True)
    net = ParallelResidualStack(blocks, h, levels=3, tol=1e-9)
    g = torch.autograd.grad(net(x).square().sum(), [x, *net.parameters()])
    u = x
    for blk in blocks:
        u = u + h * blk(u)
    g_ref = torch.autograd.grad(u.square().sum(), [x, *net.parameters()])
    assert all(max_err(a, b) <= 1e-7 for a, b in zip(g, g_ref, strict=True))
    assert net.last_backward.converged and net.last_forward.converged


# -- blocks MGRIT cannot reproduce: refused at forward time --------------------------------------
def _bn_blocks(n=8):
    return [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()) for _ in range(n)]


def test_train_mode_batchnorm_is_refused():
    net = ParallelResidualStack(_bn_blocks(), 0.1)
    x = torch.randn(5, 4)
    with pytest.raises(StochasticModelError,
                       match=r"blocks\[0\]\.1 is a BatchNorm1d in training mode, which updates "
                             r"its running statistics .* Call stack\.eval\(\) \(or "
                             r"blocks\[0\]\.1\.eval\(\)\) first .* plain nn\.Sequential"):
        net(x)
    assert all(float(b[1].running_mean.abs().max()) == 0 for b in net.blocks)  # untouched
    net.eval()
    with torch.no_grad():
        y = net(x)
    u = x
    with torch.no_grad():
        for b in net.blocks:
            u = u + 0.1 * b(u)
    assert max_err(y, u) <= 1e-5
    net.blocks[5].train()  # switched after construction: checked again at forward time
    with pytest.raises(ValueError, match=r"blocks\[5\]\.1 is a BatchNorm1d in training mode"):
        net(x)
    # batch statistics only (no running statistics): a pure function of the state, accepted
    plain = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False),
                           nn.Tanh()) for _ in range(8)]
    ParallelResidualStack(plain, 0.1)(x)


def test_train_mode_dropout_is_refused():
    blocks = [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Dropout(0.2)) for _ in range(8)]
    net = ParallelResidualStack(blocks, 0.1, batched=False)
    with pytest.raises(StochasticModelError,
                       match=r"blocks\[0\]\.2 is a Dropout in training mode, which draws random "
                             r"numbers at every call p=0.2, and MGRIT calls every block several "
                             r"times per solve"):
        net(torch.randn(5, 4))
    net.eval()
    net(torch.randn(5, 4))
    zero = [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Dropout(0.0)) for _ in range(8)]
    ParallelResidualStack(zero, 0.1)(torch.randn(5, 4))  # p = 0: the identity, accepted
    with pytest.raises(ValueError, match=r"blocks\[3\] is a BatchNorm1d in training mode"):
        mgrit(ForwardStepper([nn.Identity()] * 3 + [nn.BatchNorm1d(4)] + [nn.Identity()] * 4,
                             batched=False),
              torch.randn(5, 4), Hierarchy.build(8, levels=2, coarsening=2), 0.1)


def test_buffer_updates_are_caught():
    """A block of a type the check does not know that updates a buffer in forward."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 3)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, u):
            self.calls.add_(1)
            return torch.tanh(self.linear(u))

    for batched in (False, True):
        net = ParallelResidualStack([Counting() for _ in range(8)], 0.1, batched=batched)
        with pytest.raises(ValueError, match=r"a block updated its buffers .* during the MGRIT "
                                             r"forward solve"):
            net(torch.randn(2, 3))


def test_dtype_and_device_mismatch_are_named():
    blocks = accumulating(16, width=4)
    net = ParallelResidualStack(blocks, 0.1)
    with pytest.raises(TypeError, match=r"x must have the dtype of the blocks' parameters, "
                                        r"torch\.float64 \(blocks\[0\]\.linear\.weight\), got "
                                        r"torch\.float32"):
        net(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"x must be on the device of the blocks' parameters, "
                                         r"cpu \(blocks\[0\]\.linear\.weight\), got meta"):
        net(torch.randn(2, 4, dtype=torch.float64, device="meta"))
    hier = Hierarchy.build(16, levels=2, coarsening=4)
    with pytest.raises(TypeError, match=r"x must have the dtype of the blocks' parameters, "
                                        r"torch\.float64 \(blocks\[5\]\.linear\.weight\), got "
                                        r"torch\.float32"):
        mgrit(ForwardStepper(blocks[5:], 5), torch.randn(2, 4), hier, 0.1,
              parts=[(0, 5), (5, 16)], me=1)
    mixed = accumulating(16, width=4)
    mixed[9] = mixed[9].float()
    with pytest.raises(TypeError, match=r"torch\.float32 \(blocks\[9\]\.linear\.weight\), got "
                                        r"torch\.float64"):
        ParallelResidualStack(mixed, 0.1, batched=False)(inputs(width=4))


# -- other stochastic blocks (issue 27, item 2): the shared determinism check, per block ----------
class FunctionalDropout(nn.Module):
    """Dropout applied through an attribute, as transformers' blocks do (no Dropout module)."""

    def __init__(self, p):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.dropout = p

    def forward(self, u):
        return nn.functional.dropout(torch.tanh(self.linear(u)), self.dropout, self.training)


@pytest.mark.parametrize("make,where,match", [
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.RReLU()), r"blocks\[0\]\.1",
     r"is a RReLU in training mode, which draws random numbers at every call"),
    (lambda: FunctionalDropout(0.1), r"blocks\[0\]",
     r"is a FunctionalDropout in training mode, which applies dropout in train mode "
     r"\(dropout=0.1\)"),
    (lambda: nn.Sequential(nn.Conv1d(4, 4, 1), nn.InstanceNorm1d(4, track_running_stats=True)),
     r"blocks\[0\]\.1", r"is a InstanceNorm1d in training mode, which updates its running "
                         r"statistics"),
], ids=["rrelu", "functional-dropout", "instancenorm-running-stats"])
def test_other_stochastic_blocks_are_refused(make, where, match):
    blocks = [make() for _ in range(8)]
    x = torch.randn(5, 4) if "Instance" not in match else torch.randn(5, 4, 3)
    net = ParallelResidualStack(blocks, 0.1, batched=False)
    with pytest.raises(StochasticModelError, match=where + " " + match + r".* Call stack\.eval"):
        net(x)
    with pytest.raises(StochasticModelError, match=where):
        mgrit(ForwardStepper(blocks, batched=False), x, Hierarchy.build(8, levels=2,
                                                                         coarsening=2), 0.1)
    net.eval()                          # eval mode: a fixed function, the serial result
    with torch.no_grad():
        assert max_err(net(x), net.serial_forward(x)) <= 1e-5


def test_inactive_dropout_attribute_and_eval_switch_after_construction():
    blocks = [FunctionalDropout(0.0) for _ in range(8)]   # p = 0: the identity, accepted
    net = ParallelResidualStack(blocks, 0.1)
    net(torch.randn(3, 4))
    blocks[6].dropout = 0.3             # assigned after construction: checked at forward time
    with pytest.raises(StochasticModelError, match=r"blocks\[6\] is a FunctionalDropout"):
        net(torch.randn(3, 4))
    blocks[6].eval()
    net(torch.randn(3, 4))


# -- settings assigned after construction (issue 27, item 5) ------------------------------------
@pytest.mark.parametrize("attr,value,exc,match", [
    ("relax", "C", ValueError, r"unknown relax='C'; choose one of F, FCF"),
    ("tol", -1.0, ValueError, r"tol must be a number >= 0 or None, got -1.0"),
    ("max_iters", 0, ValueError, r"max_iters must be a positive int or None, got 0"),
    ("step_size", 0.0, ValueError, r"step_size must be"),
    ("backward_mode", "adjont", ValueError, r"unknown backward='adjont'"),
    ("c_weight", 3.0, ValueError, r"c_weight must be a number in \(0, 2\], got 3.0"),
    ("throw", "yes", TypeError, r"throw must be a bool"),
    ("warm_start", 1, TypeError, r"warm_start must be a bool"),
])
def test_settings_assigned_after_construction_are_checked(attr, value, exc, match):
    net = ParallelResidualStack(accumulating(16, width=4), 0.1)
    setattr(net, attr, value)
    with pytest.raises(exc, match=match):
        net(inputs(width=4))


def test_settings_assigned_after_construction_are_honoured():
    blocks = accumulating(16, width=4, seed=2)
    net = ParallelResidualStack(blocks, 1 / 16)
    x = inputs(width=4).requires_grad_()
    net.tol, net.backward_mode = 1e-12, "serial"
    net(x).square().sum().backward()
    fwd, bwd = net.last_forward, net.last_backward
    assert fwd.stats["tol"] == 1e-12 and fwd.stats["error_estimate"] <= 1e-12
    assert bwd.iterations == 0 and bwd.method == "sequential"
    mixed = accumulating(7, width=4) + [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double()]
    net = ParallelResidualStack(mixed, 0.1)
    assert net.batched is False
    with pytest.raises(ValueError, match="batched=True needs blocks that share an architecture"):
        net.batched = True
    with pytest.raises(TypeError, match="batched must be a bool or None, got 'yes'"):
        net.batched = "yes"
    assert net.batched is False


def test_blocks_changed_after_construction_are_honoured():
    """net.blocks.append / replace / delete after construction: the next forward solves the
    stack as it is now (before, an appended block was ignored: converged=True and the 16-block
    result)."""
    blocks = accumulating(16, width=4, shared=False)
    extra = accumulating(2, width=4, shared=False, seed=5)
    x = inputs(width=4)
    net = ParallelResidualStack(blocks, 1 / 16, coarsening=4, levels=2, tol=0.0)
    with torch.no_grad():
        net(x)
        net.blocks.append(extra[0])
        y = net(x)
    assert torch.equal(y, serial_states([*blocks, extra[0]], x, 1 / 16)[-1])
    st = net.last_forward
    assert st.converged and st.stats["bound"] == 4 and len(net.blocks) == 17
    with torch.no_grad():
        net.blocks[3] = extra[1]
        y = net(x)
    now = [*blocks[:3], extra[1], *blocks[4:], extra[0]]
    assert torch.equal(y, serial_states(now, x, 1 / 16)[-1])
    x.requires_grad_()   # the gradients follow the blocks as they are now
    net(x).square().sum().backward()
    assert extra[1].linear.weight.grad is not None and blocks[3].linear.weight.grad is None
    del net.blocks[1:]
    with pytest.raises(ValueError, match=r"levels=2 with coarsening \(4,\) needs at least 4 "
                                         r"layers, got 1"):
        net(x)


def test_levels_and_coarsening_assigned_later_are_honoured_or_refused():
    """Every setting of the constructor may be assigned later (docs/multigrid.md): levels and
    coarsening too (before, net.coarsening=8 was ignored and net.levels=2 raised "property
    has no setter")."""
    blocks = accumulating(32, width=4, shared=False)
    x = inputs(width=4)
    net = ParallelResidualStack(blocks, 1 / 32, coarsening=4, levels=3, tol=0.0)
    with torch.no_grad():
        net(x)
        net.levels, net.coarsening = 2, 8
        y = net(x)
    st = net.last_forward.stats
    assert (st["levels"], st["coarsening"], st["bound"]) == (2, [8], 4)
    assert net.hierarchy.coarsening == (8,) and net.levels == 2
    assert torch.equal(y, net.serial_forward(x))
    with torch.no_grad():
        net.coarsening = [2, 4]
        net.levels = 3
        net(x)
    assert net.last_forward.stats["coarsening"] == [2, 4]
    net.levels = 4   # three coarsenings but two factors: refused at the forward, by name
    with pytest.raises(ValueError, match=r"coarsening=\(2, 4\) must have levels - 1 = 3 "
                                         r"entries"):
        net(x)
    with pytest.raises(ValueError, match=r"levels must be a positive int, got 0"):
        net.levels = 0
    net.levels, net.coarsening = 2, 64
    with pytest.raises(ValueError, match=r"levels=2 with coarsening \(64,\) needs at least 64 "
                                         r"layers, got 32"):
        net(x)
    with pytest.raises(AttributeError, match=r"ParallelResidualStack.hierarchy follows from the "
                                             r"blocks, levels and coarsening: assign those"):
        net.hierarchy = Hierarchy.build(32, levels=2, coarsening=4)


class _Noisy(nn.Module):
    """A block with Gaussian noise in training mode, from torch.randn_like (no layer that a
    list of stochastic modules could know)."""

    def __init__(self, width=4, seed=0):
        super().__init__()
        self.linear = nn.Linear(width, width).double()

    def forward(self, u):
        out = torch.tanh(self.linear(u))
        return out + 0.1 * torch.randn_like(out) if self.training else out


@pytest.mark.parametrize("tol", [1e-6, 0.0], ids=["batched (vmap)", "block by block (tol=0)"])
def test_a_random_operation_in_a_block_is_named(tol):
    """A block calling torch.randn_like in train mode: the batched evaluation failed with torch's
    raw vmap randomness error, and block by block (tol=0) nothing noticed it. Both name the
    cause and the fix."""
    torch.manual_seed(0)
    net = ParallelResidualStack([_Noisy() for _ in range(16)], 1 / 16, tol=tol).train()
    x = inputs(width=4)
    how = "vmap refused a random operation" if tol else "drew random numbers during the solve"
    with pytest.raises(StochasticModelError,
                       match=rf"ParallelResidualStack \(forward\): a block .*{how}.* MGRIT "
                             r"evaluates every block several times per solve.* Call "
                             r"stack.eval\(\) if the block draws only in training mode"):
        net(x)
    net.eval()
    with torch.no_grad():
        assert torch.equal(net(x), net.serial_forward(x)) or tol > 0
    assert net.last_forward.converged


@pytest.mark.parametrize("relax,w", [("F", 1.0), ("FCF", 0.7), ("FCF", 1.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_tol_zero_with_large_steps_is_bitwise_after_the_bound(relax, w, dtype):
    """With F-relaxation or a weighted C-relaxation the coarse correction reaches the serial
    states at the exactness bound only up to rounding (b + (W - b)); tol=0 then stops at a zero
    residual, bitwise, a cycle or two later (before: converged=True at the bound, a few ulp
    off with steps of 0.5)."""
    blocks = _mlp(32, dtype, seed=1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).to(dtype)
    net = ParallelResidualStack(blocks, 0.5, coarsening=8, levels=2, relax=relax, c_weight=w,
                                tol=0.0)
    with torch.no_grad():
        y = net(x)
    st = net.last_forward
    assert st.converged and torch.equal(y, net.serial_forward(x))
    assert st.stats["bound"] <= st.iterations <= 2 * st.stats["bound"]
    assert float(st.residuals[-1]) == 0.0
    if st.iterations == st.stats["bound"]:
        return   # bitwise at the bound already (these weights: the weighted C-relaxations)
    net.max_iters = st.stats["bound"]   # the bound alone: not bitwise here, so not converged
    with torch.no_grad(), pytest.raises(ConvergenceError, match=r"tol=0 with relax=.* stops "
                                                                r"only at a zero residual"):
        net(x)
    assert relax == "F" or w != 1


# -- low precision and tol=0: the batched evaluation rounds differently (issue 27, item 3) -------
def _mlp(depth, dtype, seed=0):
    from paraprop.models.blocks import mlp_blocks

    return [b.to(dtype) for b in mlp_blocks(depth, 6, kind="iid", gain=1.5, seed=seed)]


LOWP = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("dtype", list(LOWP.values()), ids=list(LOWP))
def test_low_precision_stack_is_the_serial_loop(dtype, device):
    """bf16 / fp16: the blocks run one by one (the batched vmap rounds several ulp away from
    the loop), so tol=0 gives bitwise the serial network and a tol holds; gradients within
    twice autograd's own deviation from float64 plus one eps (docs/multigrid.md)."""
    blocks = [b.to(device) for b in _mlp(32, dtype)]
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    for tol in (0.0, 1e-2):
        net = ParallelResidualStack(blocks, 1 / 32, coarsening=4, levels=2, tol=tol)
        with torch.no_grad():
            y, ref = net(x), net.serial_forward(x)
        st = net.last_forward
        assert st.converged and st.stats["batched"] is False
        assert torch.equal(y, ref) if tol == 0 else max_err(y.float(), ref.float()) <= tol
    blocks64 = [b.to(device, torch.float64) for b in _mlp(32, dtype)]    # the same weights
    grads = []
    for run, bl in (("mgrit", blocks), ("autograd", blocks), ("float64", blocks64)):
        xi = (x.double() if run == "float64" else x).clone().requires_grad_()
        if run == "mgrit":
            y = ParallelResidualStack(bl, 1 / 32, coarsening=4, levels=2)(xi)
        else:
            y = xi
            for b in bl:
                y = y + (1 / 32) * b(y)
        (y.double() ** 2).sum().backward()
        grads.append([xi.grad.double(), *(p.grad.double() for b in bl for p in b.parameters())])
        for b in bl:
            b.zero_grad()

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    for ours, theirs, exact in zip(*grads, strict=True):
        assert rel(ours, exact) <= 2 * rel(theirs, exact) + torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 1e-3),
                                       (torch.float32, 0.0), (torch.float64, 0.0)],
                         ids=["bf16", "fp16", "f32-tol0", "f64-tol0"])
def test_batched_true_is_refused_where_it_cannot_be_exact(dtype, tol):
    blocks = _mlp(16, dtype)
    x = torch.randn(3, 6).to(dtype)
    match = r"batched=True with .*rounds differently from the per-block serial loop"
    net = ParallelResidualStack(blocks, 1 / 16, tol=tol, batched=True)
    with pytest.raises(ValueError, match=r"ParallelResidualStack: " + match + r".* pass "
                                         r"batched=None"):
        net(x)
    hier = Hierarchy.build(16, levels=2, coarsening=4)
    with pytest.raises(ValueError, match=r"mgrit \(ForwardStepper\(batched=True\)\): " + match
                                         + r".* pass a ForwardStepper\(\.\.\., batched=False\)"):
        mgrit(ForwardStepper(blocks), x, hier, 1 / 16, tol=tol)
    net.batched = None                   # the stack's choice: block by block for this solve
    with torch.no_grad():
        y = net(x)
    assert net.last_forward.stats["batched"] is False
    if tol == 0:
        assert torch.equal(y, net.serial_forward(x))
    net.tol = 1e-3 if dtype in (torch.float32, torch.float64) else tol
    if dtype in (torch.float32, torch.float64):   # batched again where it is exact enough
        with torch.no_grad():
            net(x)
        assert net.last_forward.stats["batched"] is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("depth,levels,c,relax,w", [(16, 2, 4, "FCF", 1.0), (19, 2, 3, "F", 1.0),
                                                    (23, 3, 2, "FCF", 0.7), (37, 3, 3, "F", 1.0)])
def test_tol_zero_is_bitwise_the_serial_loop(depth, levels, c, relax, w, dtype, device):
    """tol=0 means bitwise the serial network or converged=False: the blocks then run one by
    one on states of their own (a row of a buffer would meet BLAS at another alignment and round
    differently), so the fixed point is the serial loop's, bit for bit."""
    blocks = [b.to(device) for b in _mlp(depth, dtype, seed=depth)]
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(depth)).to(device, dtype)
    net = ParallelResidualStack(blocks, 1.5 / depth, coarsening=c, levels=levels, relax=relax,
                                c_weight=w, tol=0)
    with torch.no_grad():
        y = net(x)
    st = net.last_forward
    assert st.converged and st.stats["batched"] is False
    assert torch.equal(y, net.serial_forward(x))
    hier = Hierarchy.build(depth, levels=levels, coarsening=c)
    sol = mgrit(ForwardStepper(blocks, batched=False), x, hier, 1.5 / depth, relax=relax,
                c_weight=w, tol=0)
    assert sol.converged and torch.equal(sol.value, serial_states(blocks, x, 1.5 / depth))


# -- distributed -----------------------------------------------------------------------------
def test_layer_range_rank_out_of_range():
    with pytest.raises(ValueError, match=r"rank must be an int in 0 \.\. 1 \(world=2\), got 2"):
        layer_range(10, rank=2, world=2)
    with pytest.raises(ValueError, match=r"rank must be an int in 0 \.\. 2 \(world=3\), got -1"):
        layer_range(10, rank=-1, world=3)
    with pytest.raises(ValueError, match=r"rank must be an int in 0 \.\. 1 \(world=2\), got 1\.0"):
        layer_range(10, rank=1.0, world=2)
    assert layer_range(10, rank=1, world=2) == (5, 10)


def _mismatched_inputs(rank, case):
    """Rank 0 and rank 1 pass different inputs (or rank 1 a refused block); every rank must
    raise, none may compute on uninitialised memory or wait for the timeout."""
    from paraprop.distributed import LayerParallelStack

    blocks = accumulating(16, width=3)
    if case == "batchnorm" and rank == 1:
        blocks[12] = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).double()
    a, b = layer_range(16)
    stack = LayerParallelStack(blocks[a:b], 0.1, depth=16, timeout=20)
    shape = (2, 3) if rank == 0 or case != "shape" else (4, 3)
    dtype = torch.float32 if rank == 1 and case == "dtype" else torch.float64
    x = torch.randn(*shape, dtype=dtype)
    if case == "shape":
        expect = (PeerError, rf"rank {rank} \(forward\): the ranks passed inputs of different "
                             r"shapes or dtypes \(rank 0: shape \(2, 3\), torch\.float64; "
                             r"rank 1: shape \(4, 3\), torch\.float64\)")
    elif rank == 0:
        expect = (PeerError, r"rank 0 \(forward\): rank\(s\) \[1\] refused their input or "
                             r"blocks")
    elif case == "dtype":
        expect = (TypeError, r"x must have the dtype of the blocks' parameters, torch\.float64 "
                             r"\(blocks\[8\]\.linear\.weight\), got torch\.float32")
    else:
        expect = (ValueError, r"blocks\[12\]\.1 is a BatchNorm1d in training mode")
    with pytest.raises(expect[0], match=expect[1]) as info:
        with torch.no_grad():
            stack(x)
    return type(info.value).__name__


@pytest.mark.slow
@pytest.mark.parametrize("case", ["shape", "dtype", "batchnorm"])
def test_distributed_mismatch_raises_on_every_rank(case):
    names = spawn(_mismatched_inputs, 2, case, timeout=120, threads=1)
    want = {"shape": ["PeerError", "PeerError"], "dtype": ["PeerError", "TypeError"],
            "batchnorm": ["PeerError", "StochasticModelError"]}[case]
    assert names == want
