"""Batches that advance per sample (``generate(..., batch_advance="per-sample")``,
``SlidingJacobi(window, advance="per-sample")``): the tokens of the sequential loop (greedy:
``model.generate``'s) whatever the samples' pace, in fewer passes than the batch minimum on a
batch whose samples accept at different rates; the solver mode on plain triangular maps."""

from __future__ import annotations

import pytest
import torch

import paraprop
from paraprop.decoding import accelerate, generate
from paraprop.solvers import SlidingJacobi

transformers = pytest.importorskip("transformers")

from problems import FastTriangular, RandomTriangular, Windowed  # noqa: E402
from test_decoding import V, hf, make  # noqa: E402
from test_sliding import RunningMean, _warm_started_accumulating  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

P = 8


def paced(B: int, device, padded: bool, seed: int = 3):
    """``B`` prompts that the tiny models continue at different paces: sample 0 a repeated
    three-token motif (its greedy text settles into a loop the n-gram guesses predict), the
    others random; with ``padded``, samples 1 and 2 (mod B) left-padded by different amounts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P), generator=g)
    ids[0] = torch.tensor([5, 9, 17] * P)[:P]
    mask = torch.ones(B, P, dtype=torch.long)
    if padded:
        mask[1, : P // 2] = 0
        mask[2 % B, :2] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def _run(model, ids, mask, n, **kw):
    return generate(model, ids, attention_mask=mask, max_new_tokens=n, **kw)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("B", [3, 8])
def test_greedy_per_sample_is_generate(device, name, dtype, padded, B):
    model = make(name, device, dtype)
    ids, mask = paced(B, device, padded)
    ref = hf(model, ids, mask, 40, eos_token_id=None)
    seq, _ = _run(model, ids, mask, 40, eos_token_id=[], method="sequential")
    assert torch.equal(seq, ref)
    for window in (4, 16):
        out, sol = _run(model, ids, mask, 40, eos_token_id=[], window=window,
                        batch_advance="per-sample")
        assert torch.equal(out, ref), window
        assert sol.converged and sol.stats["uncertified"] == []
        assert sol.stats["batch_advance"] == "per-sample"
        assert sol.stats["model_calls"] <= 40


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_eos_mid_run_in_one_sample(device, name):
    model = make(name, device)
    ids, mask = paced(5, device, padded=True)
    free = hf(model, ids, mask, 30, eos_token_id=None)
    eos = int(free[1, P + 5])           # sample 1 emits it at its 6th new position
    ref = hf(model, ids, mask, 30, eos_token_id=eos)
    out, sol = _run(model, ids, mask, 30, eos_token_id=eos, window=4,
                    batch_advance="per-sample")
    assert torch.equal(out, ref)
    assert sol.converged and sol.stats["batch_advance"] == "per-sample"
    row = out[1, P:].tolist()
    assert all(t == 0 for t in row[row.index(eos) + 1 :])     # padded after its EOS


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("coupling", ["inverse_cdf", "gumbel"])
def test_sampled_per_sample_is_the_sequential_sampler(device, name, coupling):
    model = make(name, device)
    ids, mask = paced(4, device, padded=True)
    outs = []
    for kw in ({"method": "sequential"}, {"window": 4, "batch_advance": "per-sample"},
               {"method": SlidingJacobi(8, advance="per-sample", span=12)}):
        g = torch.Generator().manual_seed(11)
        out, sol = _run(model, ids, mask, 30, eos_token_id=[], do_sample=True, top_k=0,
                        temperature=0.8, generator=g, coupling=coupling, **kw)
        assert sol.converged
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fewer_passes_than_the_minimum(device, name):
    """On a batch whose samples accept at different rates, each sample's own window lets the
    fast ones go on: fewer passes than the batch minimum (same tokens). The fed block is wider
    (the price)."""
    model = make(name, device)
    ids, mask = paced(8, device, padded=False)
    ref = hf(model, ids, mask, 40, eos_token_id=None)
    res = {}
    for adv in ("minimum", "per-sample"):
        out, sol = _run(model, ids, mask, 40, eos_token_id=[], window=4, batch_advance=adv)
        assert torch.equal(out, ref) and sol.converged
        assert sol.stats["batch_advance"] == adv
        res[adv] = sol.stats
    assert res["per-sample"]["model_calls"] < res["minimum"]["model_calls"]
    assert res["per-sample"]["fed_positions"] > res["minimum"]["fed_positions"]   # the price


def test_batch_one_and_the_default(device):
    model = make("gpt2", device)
    ids, mask = paced(3, device, padded=False)
    _, sol = _run(model, ids, mask, 12, eos_token_id=[])
    assert sol.stats["batch_advance"] == "minimum"          # the default (measured, docs)
    _, sol = _run(model, ids, mask, 12, eos_token_id=[], method="sequential")
    assert sol.stats["batch_advance"] == "minimum"
    # one sample: both modes are the same run
    one = [_run(model, ids[:1], mask[:1], 12, eos_token_id=[], batch_advance=a)[1]
           for a in ("minimum", "per-sample")]
    assert one[0].stats["model_calls"] == one[1].stats["model_calls"]
    assert one[0].stats["batch_advance"] == one[1].stats["batch_advance"] == "per-sample"


def test_accelerate_passes_batch_advance(device):
    model = make("gpt2", device, fresh=True)
    ids, mask = paced(3, device, padded=True)
    ref = hf(model, ids, mask, 20, eos_token_id=None, pad_token_id=0)
    with accelerate(model, batch_advance="per-sample") as handle:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, ref) and handle.counters.served == 1
    assert handle.solution is not None
    assert handle.solution.stats["batch_advance"] == "per-sample"


def test_errors():
    model = make("gpt2", "cpu")
    ids, mask = paced(3, "cpu", padded=False)
    with pytest.raises(ValueError, match="batch_advance must be one of 'minimum', "
                                         "'per-sample' or None, got 'fastest'"):
        _run(model, ids, mask, 5, batch_advance="fastest")
    with pytest.raises(ValueError, match="batch_advance='per-sample' applies to "
                                         "method='jacobi'.*got method='gs_jacobi'"):
        _run(model, ids, mask, 5, batch_advance="per-sample", method="gs_jacobi")
    with pytest.raises(ValueError, match="batch_advance='per-sample' applies to "
                                         "method='jacobi'.*got method='sequential'"):
        _run(model, ids, mask, 5, batch_advance="per-sample", method="sequential")
    with pytest.raises(ValueError, match=r"batch_advance='per-sample' disagrees with "
                                         r"method=SlidingJacobi\(window=4\), which advances "
                                         "by the 'minimum'"):
        _run(model, ids, mask, 5, batch_advance="per-sample", method=SlidingJacobi(4))
    with pytest.raises(ValueError, match="unknown batch_advance='both'; choose one of "
                                         "minimum, per-sample"):
        accelerate(model, batch_advance="both")
    with pytest.raises(ValueError, match="SlidingJacobi: advance must be one of 'minimum', "
                                         "'per-sample', got 'ragged'"):
        SlidingJacobi(4, advance="ragged")
    with pytest.raises(ValueError, match="SlidingJacobi: span .* applies to "
                                         "advance='per-sample' only, got span=8 with "
                                         "advance='minimum'"):
        SlidingJacobi(4, span=8)
    with pytest.raises(ValueError, match=r"SlidingJacobi: span must be at least the window "
                                         r"\(4\), got 3"):
        SlidingJacobi(4, advance="per-sample", span=3)
    with pytest.raises(ValueError, match="SlidingJacobi: span must be a positive int or "
                                         "None, got 0"):
        SlidingJacobi(4, advance="per-sample", span=0)
    assert repr(SlidingJacobi(4, advance="per-sample", span=9)) == \
        "SlidingJacobi(window=4, advance='per-sample', span=9)"


# -- the solver mode on plain triangular maps -----------------------------------------------

class Recorded(Windowed):
    """An honest ``window`` hook (bitwise ``prob``'s values) that records its blocks."""

    def __init__(self, prob):
        super().__init__(prob)
        self.blocks: list[tuple[int, int]] = []

    def window(self, x, start, stop, cache):
        self.blocks.append((start, stop))
        return super().window(x, start, stop, cache)


PACES = [0.1, 0.5, 1.0, 3.0]     # per-sample scales: samples that converge at different paces


@pytest.mark.parametrize("window,span", [(2, None), (3, 5), (6, 30)])
@pytest.mark.parametrize("hook", ["window", "update", "none"])
def test_solver_per_sample_equals_sequential(window, span, hook):
    """tol=0: the sequential result, bitwise where the hook computes fn's values bitwise (a
    block wider than a sample's window included), in at most T sweeps; the block never wider
    than the span."""
    cls = FastTriangular if hook == "update" else RandomTriangular
    prob = cls((4,), (30,), (), seed=window, scale=PACES)
    fn = Recorded(prob) if hook == "window" else prob
    x0 = prob.x0()
    ref = prob.reference(x0)
    solver = SlidingJacobi(window, advance="per-sample", span=span)
    sol = paraprop.solve(fn, x0, method=solver, dim=1, tol=0, throw=False)
    assert sol.iterations <= prob.T and sol.stats["advance"] == "per-sample"
    if hook == "update":      # fn.update rounds like fn here or not: the final check says
        assert sol.converged or sol.stats["verification"] == "failed"
        assert float((sol.value - ref).abs().max()) <= 1e-12
    else:
        assert sol.converged and torch.equal(sol.value, ref)
    if isinstance(fn, Recorded):
        widths = [b - a for a, b in fn.blocks]
        assert max(widths) <= (2 * window if span is None else span)
        assert max(widths) > window        # a sample ran ahead of the slowest one's window


@pytest.mark.parametrize("window", [2, 7])
def test_solver_per_sample_keeps_the_window_protocols_promise(window):
    """The cached-prefix protocol: positions below ``start`` are final (RunningMean asserts
    it and that ``start`` never moves back); the value within rounding of the sequential
    loop's (its running sum rounds differently from the full pass)."""
    m = RunningMean(B=3)
    x0 = torch.zeros(m.shape, dtype=torch.float64)
    ref = paraprop.solve(m, x0, method="sequential", dim=-2).value
    sol = paraprop.solve(m, x0, method=SlidingJacobi(window, advance="per-sample"), dim=-2,
                         tol=0, throw=False)
    assert sol.converged or "by rounding only" in sol.stats["not_converged"]
    assert float((sol.value - ref).abs().max()) <= 1e-12
    assert float((sol.value - m.sequential()).abs().max()) <= 1e-12


def test_solver_per_sample_fewer_sweeps_on_samples_of_different_pace():
    """Samples of different contraction (scale 0.1 .. 3): each advances at its own pace, and
    the batch needs fewer sweeps than with the minimum, with the sequential result."""
    prob = FastTriangular((4,), (40,), (), seed=2, scale=PACES)
    x0 = prob.x0()
    ref = prob.reference(x0)
    sweeps = {}
    for adv in ("minimum", "per-sample"):
        sol = paraprop.solve(prob, x0, method=SlidingJacobi(6, advance=adv), dim=1, tol=0,
                             throw=False)
        assert float((sol.value - ref).abs().max()) <= 1e-12
        sweeps[adv] = sol.iterations
    assert sweeps["per-sample"] < sweeps["minimum"]


def test_solver_per_sample_on_an_accumulating_map():
    """The map that breaks estimated freezes (accumulating small steps, warm started): tol=0
    gives the sequential result; at tol > 0 the freeze rule (which measures the gains between
    sweeps) keeps it within tol in the per-sample mode too."""
    fn, _, x0, ref = _warm_started_accumulating(B=3)
    x0 = x0.clone()
    x0[1] = 0.0                 # a sample far from its result: it advances at another pace
    exact = paraprop.solve(fn, x0, method=SlidingJacobi(16, advance="per-sample"), dim=-2,
                           tol=0, throw=False)
    assert float((exact.value - ref).abs().max()) <= 1e-12
    tol = 1e-2
    sol = paraprop.solve(fn, x0, method=SlidingJacobi(64, advance="per-sample"), dim=-2,
                         tol=tol, throw=False)
    assert sol.converged and float((sol.value - ref).abs().max()) <= tol


def test_the_default_advance_is_chosen_per_device():
    """``batch_advance=None``: "minimum" on a CPU (measured faster there), "per-sample" on CUDA
    (the first GPU run: 1.10x generate at batch 8 against 0.98x); an explicit choice or a
    solver's own advance wins everywhere."""
    from paraprop.decoding import decode

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode._solver("jacobi", None, 100, None, cpu).advance == "minimum"
    assert decode._solver("jacobi", None, 100, None, cuda).advance == "per-sample"
    assert decode._solver("jacobi", None, 100, "minimum", cuda).advance == "minimum"
    assert decode._solver("jacobi", None, 100, "per-sample", cpu).advance == "per-sample"
    assert decode.default_advance("meta") == "minimum"              # not measured: the minimum
    own = SlidingJacobi(8)
    assert decode._solver(own, None, 100, None, cuda) is own           # its own "minimum"
    assert not hasattr(decode._solver("gs_jacobi", None, 100, None, cuda), "advance")
