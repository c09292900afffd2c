"""paraprop.networks: networks as recurrences over their layers, evaluated by every method."""

import math

import pytest
import torch
from torch import nn

import paraprop
from paraprop.networks import (
    LayerRecurrence,
    Step,
    UnsupportedModuleError,
    as_recurrence,
    balanced_blocks,
    evaluate,
    jacobi_gs_blocks,
    register_converter,
    top5_changes,
)
from paraprop.networks.evaluate import trace
from paraprop.solvers import METHODS, NEWTON_METHODS, GSJacobi, Jacobi, JacobiGS, SlidingJacobi

try:
    import torchvision
except ImportError:  # the 'vision' extra is optional; make test-oldest runs without it
    torchvision = None
needs_torchvision = pytest.mark.skipif(torchvision is None,
                                       reason="needs torchvision (pip install 'paraprop[vision]')")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the shared 2-core machine runs other jobs, and oversubscribed
    OpenMP threads make small convolutions erratic. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def mlp(depth=6, width=16, seed=0):
    torch.manual_seed(seed)
    inner = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
    return nn.Sequential(nn.Flatten(), nn.Linear(12, width), nn.ReLU(), *inner,
                         nn.Linear(width, 7)).eval()


def small_densenet(seed=0):
    """torchvision's DenseNet class at a small configuration (same code paths as 121/201)."""
    torch.manual_seed(seed)
    return torchvision.models.DenseNet(growth_rate=8, block_config=(2, 3, 2, 2),
                                       num_init_features=8, bn_size=2, num_classes=10).eval()


def small_resnet(seed=0):
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=10).eval()


# -- extraction equals the model's own forward --------------------------------------------------


def test_sequential_states_group_parameter_free_modules():
    model = mlp(depth=3)
    rec = as_recurrence(model)
    # Flatten leads into the first Linear; each ReLU/Tanh joins the Linear before it
    assert rec.names == ["0..2", "3.0..3.1", "4.0..4.1", "5.0..5.1", "6"]
    assert [s.inputs for s in rec.steps] == [(-1,), (0,), (1,), (2,), (3,)]
    x = torch.randn(5, 3, 4)
    assert torch.equal(rec(x), model(x))
    assert len(rec.states(x)) == len(rec) == 5


def test_leading_in_place_module_gets_a_copy_of_the_input():
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(3, 2)).eval()
    rec = as_recurrence(model)
    assert len(rec) == 1 and rec.steps[0].clone_input
    x = torch.randn(4, 3)
    keep = x.clone()
    out = rec(x)
    assert torch.equal(x, keep)  # the network input is not changed
    assert torch.equal(out, model(keep.clone()))


@needs_torchvision
def test_densenet121_recurrence_equals_forward():
    torch.manual_seed(0)
    model = torchvision.models.densenet121(num_classes=10).eval()
    rec = as_recurrence(model)
    # stem, 6 + 12 + 24 + 16 dense layers, 3 transitions, head
    assert len(rec) == 1 + 6 + 1 + 12 + 1 + 24 + 1 + 16 + 1 == 63
    names = rec.names
    assert names[0] == "features.conv0..features.pool0"
    assert names[1] == "features.denseblock1.denselayer1"
    assert names[7] == "features.transition1"
    assert names[-1] == "features.norm5..classifier"
    # a dense layer reads its block's input and every earlier layer of the block
    assert rec.steps[3].inputs == (0, 1, 2) and rec.steps[3].combine == "list"
    assert rec.steps[7].inputs == tuple(range(7)) and rec.steps[7].combine == "cat"
    assert rec.steps[8].inputs == (7,)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(rec(x), model(x))


@needs_torchvision
def test_densenet201_architecture_converts():
    model = torchvision.models.densenet201(num_classes=10).eval()
    rec = as_recurrence(model)
    assert len(rec) == 1 + 6 + 1 + 12 + 1 + 48 + 1 + 32 + 1
    assert sum(".denselayer" in n for n in rec.names) == 98
    # the head reads transition3 and the 32 layers of the last block
    assert rec.steps[-1].inputs == tuple(range(len(rec) - 34, len(rec) - 1))


@needs_torchvision
def test_resnet_recurrence_equals_forward():
    model = small_resnet()
    rec = as_recurrence(model)
    assert rec.names[0] == "conv1..maxpool" and rec.names[-1] == "avgpool..fc"
    assert rec.names[1:-1] == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(rec(x), model(x))


# -- every method returns the sequential output ---------------------------------------------------

MODELS = {
    "mlp": (lambda: mlp(), (4, 3, 4)),
    "densenet": (small_densenet, (3, 3, 32, 32)),
    "resnet": (small_resnet, (2, 3, 32, 32)),
}


JACOBI_FAMILY = tuple(m for m in METHODS if m not in NEWTON_METHODS)
MODEL_NAMES = [name if name == "mlp" else pytest.param(name, marks=needs_torchvision)
               for name in sorted(MODELS)]


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("method", JACOBI_FAMILY)
def test_every_method_returns_the_sequential_output(name, method, device):
    make, shape = MODELS[name]
    model = make().to(device)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
    configured = {"jacobi_gs": JacobiGS(block_size=3), "gs_jacobi": GSJacobi(block_size=3),
                  "sliding_jacobi": SlidingJacobi(window=3)}
    out, sol = evaluate(model, x, method=configured.get(method, method), tol=0)
    with torch.no_grad():
        ref = model(x)
    assert torch.equal(out, ref)
    assert sol.stats["bitwise_equal"] and sol.stats["output_error"] == 0
    assert sol.converged and sol.iterations <= sol.stats["bound"]
    assert len(sol.stats["errors"]) == sol.iterations
    assert sol.stats["errors"][-1] == 0


@needs_torchvision
def test_densenet121_jacobi_gs_exact_at_the_end_and_records_errors():
    torch.manual_seed(0)
    model = torchvision.models.densenet121(num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    out, sol = evaluate(model, x, method=JacobiGS(block_size=8), tol=0)
    with torch.no_grad():
        assert torch.equal(out, model(x))
    st = sol.stats
    assert sol.iterations <= st["bound"] == 8
    # before the first block is exact the output is the head applied to a wrong state
    assert st["errors"][0] > 0 and st["max_abs_errors"][0] > 0
    assert st["settled"] is not None and st["errors"][st["settled"] - 1:] == [0] * (
        sol.iterations - st["settled"] + 1)
    assert st["T"] == 63 and st["names"][0].startswith("features.conv0")


def test_stopping_on_forward_difference_then_max_abs_metric():
    model = mlp(depth=10)
    x = torch.randn(6, 3, 4)
    out, sol = evaluate(model, x, method="jacobi", tol=1e-3, metric="max_abs")
    with torch.no_grad():
        ref = model(x)
    assert sol.residuals[-1] <= 1e-3 or sol.iterations == sol.stats["bound"]
    assert sol.stats["errors"] == sol.stats["max_abs_errors"]
    assert float((out - ref).abs().max()) == pytest.approx(sol.stats["errors"][-1])


@needs_torchvision
def test_threaded_jacobi_gs_matches_the_sequential_drivers():
    model = small_densenet()
    x = torch.randn(2, 3, 32, 32)
    system = as_recurrence(model).bind(x)
    # one state per block: Jacobi, the iterates of paraprop.solve
    sol = paraprop.solve(system, system.x0, method="jacobi", dim=1, tol=0)
    one_each = [range(t, t + 1) for t in range(system.T)]
    par = jacobi_gs_blocks(system, one_each, workers=2, costs=[1.0] * system.T, tol=0)
    assert torch.equal(par.value, sol.value) and par.iterations == sol.iterations
    assert par.residuals.tolist() == pytest.approx(sol.residuals.tolist())
    assert par.stats["workers"] == 2
    # any partition: the iterates of jacobi_gs_blocks (Algorithm 2) on one thread
    blocks = [range(0, 1), range(1, 5), range(5, 6), range(6, 12), range(12, system.T)]
    sol = jacobi_gs_blocks(system, blocks, tol=0)
    seen = []
    par = jacobi_gs_blocks(system, blocks, workers=3, tol=0,
                           callback=lambda k, v, r: seen.append(v.clone()))
    assert torch.equal(par.value, sol.value) and par.iterations == sol.iterations <= len(blocks)
    assert par.evaluations == sol.evaluations and par.stats["positions"] == sol.stats["positions"]
    assert torch.equal(system.output(par.value), system.reference[-1])
    # every iterate, not only the last, is bitwise the one-thread iterate
    ref_seen = []
    jacobi_gs_blocks(system, blocks, tol=0, callback=lambda k, v, r: ref_seen.append(v.clone()))
    assert len(seen) == len(ref_seen)
    assert all(torch.equal(a, b) for a, b in zip(seen, ref_seen, strict=True))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_jacobi_gs_over_any_partition_is_exact_within_its_bound(name):
    make, shape = MODELS[name]
    model = make()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    system = as_recurrence(model).bind(x)
    g = torch.Generator().manual_seed(3)
    times = torch.rand(system.T, generator=g, dtype=torch.float64)
    blocks = balanced_blocks(times, budget=2 * float(times.max()))
    assert [i for b in blocks for i in b] == list(range(system.T))
    out, sol = evaluate(model, x, blocks=blocks, tol=0)
    with torch.no_grad():
        assert torch.equal(out, model(x))
    assert sol.iterations <= len(blocks) == sol.stats["bound"]
    assert sol.stats["blocks"] == [[b.start, b.stop] for b in blocks]
    # per iteration, one more block is final: a cap of k iterations leaves blocks >= k unsolved
    capped = jacobi_gs_blocks(system, blocks, tol=0, max_iters=1, throw=False)
    first = blocks[0].stop
    assert torch.equal(capped.value[:, :first], system.pack(system.reference)[:, :first])


def test_balanced_blocks_respect_the_budget():
    assert balanced_blocks([1.0, 1.0, 3.0, 1.0, 2.0]) == [range(0, 2), range(2, 3), range(3, 5)]
    assert balanced_blocks([1.0, 1.0, 1.0], budget=10) == [range(0, 3)]
    assert balanced_blocks([5.0, 1.0], budget=1) == [range(0, 1), range(1, 2)]
    with pytest.raises(ValueError, match="budget must be a number > 0, got 0"):
        balanced_blocks([1.0], budget=0)
    with pytest.raises(ValueError, match="times must be a non-empty sequence"):
        balanced_blocks([])


def test_partition_errors():
    model = mlp(depth=2)
    x = torch.randn(2, 3, 4)
    system = as_recurrence(model).bind(x)
    with pytest.raises(ValueError, match=r"blocks must split the states 0\.\.3 into non-empty "
                                         r"contiguous blocks in order, got \[\[0, 2\], \[1, 3\]\]"):
        jacobi_gs_blocks(system, [[0, 2], [1, 3]])
    with pytest.raises(TypeError, match="blocks must be a sequence of sequences"):
        jacobi_gs_blocks(system, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="blocks is only used by method='jacobi_gs'"):
        evaluate(model, x, method="jacobi", blocks=[[0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"blocks is only used by method='jacobi_gs' \(by name\), "
                                         r"got method=JacobiGS\(block_size=2\)"):
        evaluate(model, x, method=JacobiGS(block_size=2), blocks=[[0, 1, 2, 3]])
    with pytest.raises(ValueError, match="pass block_size or blocks, not both"):
        JacobiGS(block_size=2, blocks=[[0, 1, 2, 3]])
    with pytest.raises(paraprop.ConvergenceError,
                       match=r"method='jacobi_gs' did not converge within max_iters=1"):
        jacobi_gs_blocks(system, [[0], [1], [2], [3]], tol=0, max_iters=1)


def test_top5_changes_counts_ranked_entries():
    ref = torch.tensor([[0.0, 1, 2, 3, 4, 5, 6], [6.0, 5, 4, 3, 2, 1, 0]])
    assert top5_changes(ref, ref) == 0
    swapped = ref.clone()
    swapped[0, [5, 6]] = swapped[0, [6, 5]]  # top-1 and top-2 trade places: 2 entries differ
    assert top5_changes(swapped, ref) == 2
    assert top5_changes(ref[:, :3], ref[:, :3]) == 0  # fewer than 5 classes: all ranked
    assert top5_changes(-ref, ref) == 2 * 4  # reversed order: only the middle rank (label 3) stays


def test_register_converter_for_a_custom_model():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)) + x)

    class Skip(nn.Module):  # reads the input and the first state, like a long skip
        def __init__(self, b):
            super().__init__()
            self.b = b

        def forward(self, xs):
            return self.b(xs[1] + xs[0])

    register_converter(Net, lambda m: [Step("a", nn.Sequential(m.a, nn.ReLU()), (-1,)),
                                       Step("b", Skip(m.b), (-1, 0), "list")])
    net = Net().eval()
    x = torch.randn(3, 4)
    rec = as_recurrence(net)
    assert torch.equal(rec(x), net(x))
    out, _ = evaluate(net, x, method="jacobi", tol=0)
    assert torch.equal(out, net(x))


# -- clear errors ----------------------------------------------------------------------------


def test_unknown_architecture_is_named():
    class Opaque(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(UnsupportedModuleError, match=r"model \(Opaque\).*arbitrary Python"):
        as_recurrence(Opaque())
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        as_recurrence(lambda x: x)


def test_container_without_forward_is_named():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ModuleList([nn.ReLU()])))
    with pytest.raises(UnsupportedModuleError, match=r"module '1\.0' \(ModuleList\).*without"):
        as_recurrence(model)


@needs_torchvision
def test_training_mode_is_refused_naming_the_module():
    model = torchvision.models.densenet121(num_classes=10)  # training mode
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"networks.as_recurrence: model is in train mode, and its layer "
                             r"'features\.norm0' \(BatchNorm2d\).*model\.eval\(\)"):
        as_recurrence(model)
    drop = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    with pytest.raises(ValueError, match=r"its layer '1' \(Dropout\) draws random numbers"):
        as_recurrence(drop)
    as_recurrence(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))  # training mode without either


@needs_torchvision
def test_overridden_torchvision_forward_is_refused():
    class Tweaked(torchvision.models.ResNet):
        def forward(self, x):
            return super().forward(x) * 2

    model = Tweaked(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1]).eval()
    with pytest.raises(UnsupportedModuleError, match=r"Tweaked\) overrides ResNet\.forward"):
        as_recurrence(model)


def test_in_place_input_change_and_tuple_outputs_are_named():
    class AddInPlace(nn.Module):
        def forward(self, x):
            return x.add_(1)

    rec = as_recurrence(nn.Sequential(nn.Linear(2, 2), AddInPlace()))  # AddInPlace joins state 0
    rec2 = LayerRecurrence([Step("lin", nn.Linear(2, 2), (-1,)), Step("bad", AddInPlace(), (0,))])
    x = torch.randn(3, 2)
    lin = rec.steps[0].module[0]
    assert torch.equal(rec(x), lin(x) + 1)  # it changes the fresh Linear output: fine
    with pytest.raises(RuntimeError, match=r"step 1 \('bad'\) changed its input in place"):
        rec2.states(x)
    lstm = nn.Sequential(nn.Linear(2, 4), nn.LSTM(4, 4))
    with pytest.raises(TypeError, match=r"step 1 \('1'\) returned tuple, not a tensor"):
        as_recurrence(lstm.eval()).bind(torch.randn(3, 2))


def test_recurrence_and_sequential_validation():
    with pytest.raises(ValueError, match="Sequential '\\(the model\\)' is empty"):
        as_recurrence(nn.Sequential())
    with pytest.raises(ValueError, match="at least one step"):
        LayerRecurrence([])
    with pytest.raises(ValueError, match=r"step 0 \('a'\) reads inputs \(0,\)"):
        LayerRecurrence([Step("a", nn.Identity(), (0,))])
    with pytest.raises(ValueError, match=r"combine='single' needs exactly one input"):
        LayerRecurrence([Step("a", nn.Identity(), (-1,)), Step("b", nn.Identity(), (-1, 0))])
    with pytest.raises(ValueError, match="unknown combine='sum'"):
        LayerRecurrence([Step("a", nn.Identity(), (-1,), "sum")])
    with pytest.raises(TypeError, match="cls must be a class"):
        register_converter("Net", lambda m: [])
    with pytest.raises(TypeError, match=r"state 0 \('0'\) has dtype torch.int64"):
        as_recurrence(nn.Sequential(nn.Identity())).bind(torch.ones(2, 3, dtype=torch.long))


def test_evaluate_validates_its_arguments():
    model = mlp(depth=2)
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="unknown metric='top1'"):
        evaluate(model, x, metric="top1")
    with pytest.raises(ValueError, match="unknown method='multigrid'"):
        evaluate(model, x, method="multigrid")
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        evaluate(model, [1.0])
    # block sizes are settings of the solver objects now: evaluate itself takes none
    with pytest.raises(TypeError, match="unexpected keyword argument 'block_size'"):
        evaluate(model, x, method="jacobi", block_size=2)
    with pytest.raises(TypeError, match="method must be a method name or a solver object"):
        evaluate(model, x, method=object())
    with pytest.raises(ValueError, match=r"tol must be a number >= 0, got -1"):
        evaluate(model, x, method="jacobi", tol=-1)
    with pytest.raises(ValueError, match=r"max_iters must be a positive int or None, got 0"):
        evaluate(model, x, method="jacobi", max_iters=0)
    with pytest.raises(ValueError, match=r"top5_changes' needs network outputs shaped "
                                         r"\(batch, classes\), got \(2, 3, 4\)"):
        evaluate(nn.Sequential(nn.Tanh()), x)
    with pytest.raises(paraprop.ConvergenceError):
        evaluate(model, x, method="jacobi", tol=0, max_iters=1)
    _, sol = evaluate(model, x, method="jacobi", tol=0, max_iters=1, throw=False)
    assert not sol.converged and sol.stats["settled"] is None


@needs_torchvision
@pytest.mark.parametrize("method", NEWTON_METHODS)
def test_newton_methods_refuse_wide_layer_states(method):
    """A network's padded layer state has thousands of features: the plain-fn Newton path
    (one forward-mode product per feature) refuses it with advice instead of exhausting memory."""
    make, shape = MODELS["densenet"]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="forward-mode product per feature"):
        evaluate(make(), x, method=method, tol=0)


@pytest.mark.parametrize(("method", "cls"), [("jacobi_gs", JacobiGS), ("gs_jacobi", GSJacobi)])
def test_hybrid_names_mean_one_state_per_block_in_evaluate(method, cls):
    # by name the hybrids use blocks of one state (the paper's DenseNet setting); an object
    # keeps its own block size, and its default is ceil(sqrt(T)) as in paraprop.solve
    model = mlp(depth=6)
    x = torch.randn(3, 3, 4, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(x)
    out, sol = evaluate(model, x, method=method, tol=0)
    assert torch.equal(out, ref) and sol.stats["block_size"] == 1
    assert sol.method == method
    out, sol = evaluate(model, x, method=cls(block_size=2), tol=0)
    assert torch.equal(out, ref) and sol.stats["block_size"] == 2
    T = sol.stats["T"]
    out, sol = evaluate(model, x, method=cls(), tol=0)
    assert torch.equal(out, ref) and sol.stats["block_size"] == math.ceil(math.sqrt(T))


def test_evaluate_and_trace_accept_solver_objects():
    model = mlp(depth=4)
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(5))
    system = as_recurrence(model).bind(x)
    for solver in (Jacobi(), JacobiGS(block_size=2), GSJacobi(block_size=2),
                   SlidingJacobi(window=2)):
        sol = trace(system, method=solver, tol=0)
        assert sol.method == solver.name and sol.converged
        assert torch.equal(system.output(sol.value), system.reference[-1])
        assert sol.stats["bitwise_equal"]


@pytest.mark.parametrize("method", ["sequential", "jacobi", "gs_jacobi"])
def test_under_inference_mode_every_method_returns_the_forward(method):
    """Under ``torch.inference_mode()`` (its tensors have no version counter, which the check
    for modules changing their input in place reads) the states are copied for the steps, so
    an in-place module cannot corrupt an earlier state, and the output is the forward's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8),
                          nn.ReLU(inplace=True), nn.Linear(8, 8)).eval()
    x = torch.randn(3, 8)
    with torch.inference_mode():
        out, sol = evaluate(model, x, method=method, tol=0)
        ref = model(x.clone())
    assert torch.equal(out, ref) and sol.converged
