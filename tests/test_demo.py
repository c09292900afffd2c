"""``paraprop demo``: its three modes, what it says up front and after each part, the order of
its parts (wins first), the sentence a losing part ends with (why, and where it wins instead),
the shipped checkpoints' fallback, and the plots' scales. Tiny fake parts and synthetic rows:
the real parts run in ``tests/test_cli.py``'s ``demo --quick``."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest

from paraprop_lab import demos
from paraprop_lab.cli import main
from paraprop_lab.demos import _weights


def _part(name: str, order: int, seconds: dict | None, calls: list, *, takes_full=True):
    mod = types.ModuleType(f"paraprop_lab.demos.{name}")
    mod.TITLE, mod.ORDER = f"part {name}", order
    if seconds is not None:
        mod.SECONDS = seconds

    def run(out, quick=False, full=False):
        calls.append((name, quick, full))
        print(f"{name} table")
        return {"headline": f"{name} headline", "why": f"On this machine, {name} wins.",
                "rows": [{"x": 1}]}

    def run_no_full(out, quick=False):
        calls.append((name, quick, None))
        return {"headline": f"{name} headline", "why": "x wins.", "rows": []}

    mod.run = run if takes_full else run_no_full
    return mod


@pytest.fixture
def fake_parts(monkeypatch):
    calls: list = []
    parts = [_part("a", 1, {"quick": 1, "default": 30, "full": 600}, calls),
             _part("b", 2, {"quick": 1, "default": 90, "full": 900}, calls, takes_full=False)]
    monkeypatch.setattr(demos, "parts", lambda: parts)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # no thread note: the output is fixed
    return calls


def test_default_mode_says_how_long_then_times_every_part(tmp_path, capsys, fake_parts):
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("paraprop demo: 2 parts, about 2 min 00 s (as measured on a "
                               "2-core CPU;")
    assert "loaded from checkpoints shipped with paraprop" in out
    assert "'paraprop demo --full' trains them" in out
    assert fake_parts == [("a", False, False), ("b", False, None)]
    assert "=== [1/2] part a ===" in out and "=== [2/2] part b ===" in out
    done = [line for line in lines if line.startswith("--- ")]
    assert len(done) == 2
    assert re.fullmatch(r"--- a: done in \d+\.\d s \(\d+\.\d s so far; about .+ to go\)", done[0])
    assert re.fullmatch(r"--- b: done in \d+\.\d s \(\d+\.\d s so far\)", done[1])
    assert out.index("a table") < out.index("--- a: done") < out.index("=== [2/2]")
    record = json.loads((tmp_path / "demo.json").read_text())
    assert record["mode"] == "default" and record["expected_seconds"] == 120
    assert [r["part"] for r in record["summary"]] == ["a", "b"]
    assert all(r["seconds"] >= 0 for r in record["summary"])
    assert "| part | seconds | headline | plots |" in (tmp_path / "demo.md").read_text()


def test_full_and_quick_modes(tmp_path, capsys, fake_parts):
    assert main(["demo", "--full", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "about 25 min 00 s" in out and "--full: every model is trained here" in out
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    assert "--quick: a smoke run" in capsys.readouterr().out
    # a part without a `full` argument has one version, run with quick=False under --full
    assert fake_parts == [("a", False, True), ("b", False, None), ("a", True, False),
                          ("b", True, None)]
    assert json.loads((tmp_path / "demo.json").read_text())["mode"] == "quick"


def test_quick_and_full_together_are_refused(tmp_path, capsys, fake_parts):
    assert main(["demo", "--quick", "--full", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"--quick and --full exclude each other", err)
    assert fake_parts == []


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of quick, default, full, got 'fast'"):
        demos.expected_seconds(demos.parts()[0], "fast")
    with pytest.raises(ValueError, match="mode must be one of quick, default, full, got 'x'"):
        demos.run_part(demos.parts()[0], Path("."), "x")


def test_parts_open_with_the_wins_and_fit_the_five_minutes():
    parts = demos.parts()
    names = [p.__name__.rsplit(".", 1)[-1] for p in parts]
    assert names[:4] == ["flows", "made", "bppsa", "decoding"]
    assert len(set(p.ORDER for p in parts)) == len(parts)
    for p in parts:
        assert set(p.SECONDS) == set(demos.MODES), p.__name__
        assert "full" in p.run.__code__.co_varnames or p.SECONDS["default"] == p.SECONDS["full"]
    # the promise printed up front: well inside the 5 minutes
    assert sum(demos.expected_seconds(p, "default") for p in parts) <= 180
    assert all(p.SECONDS["default"] <= 60 for p in parts)


def test_skip_note_names_the_extra():
    assert demos.skip_note(["zuko"]) == "skipped: needs zuko (pip install 'paraprop[flows]')"
    assert demos.skip_note(["torchvision", "diffusers"]) == (
        "skipped: needs torchvision, diffusers (pip install 'paraprop[diffusion,vision]')")


def test_a_missing_checkpoint_falls_back_to_training_the_full_model(tmp_path, monkeypatch,
                                                                   capsys):
    from paraprop_lab.demos import made

    monkeypatch.setattr(_weights, "WEIGHTS", tmp_path / "none")
    asked = {}

    class Trained(Exception):
        pass

    def trained_made(out_dir, data, *, hidden, epochs):
        asked.update(data=data, hidden=hidden, epochs=epochs)
        raise Trained

    monkeypatch.setattr(made, "trained_made", trained_made)
    with pytest.raises(Trained):
        made.run(tmp_path)
    assert asked == {"data": "digits", "hidden": (512, 512), "epochs": 30}
    assert "made_mnist_128x128_e20.pt: missing here, so this part trains the --full model" in \
        capsys.readouterr().out.replace(_weights.describe("made"), "made_mnist_128x128_e20.pt")


# -- the closing sentences: why a method lost here, and where it wins instead ----------------
def test_core_says_where_jacobi_wins_when_the_loop_wins(tmp_path, monkeypatch, capsys):
    from paraprop_lab.demos import core

    rows = [{"problem": "p", "method": "plain loop", "speedup": 1.0},
            {"problem": "p", "method": "jacobi", "speedup": 0.4}]
    monkeypatch.setattr(core, "run_problems",
                        lambda *a, **k: {"rows": rows, "why": "On this machine, the plain loop "
                                                              "wins."})
    res = core.run(tmp_path)
    assert res["why"].splitlines()[-1] == core.WHERE and core.WHERE in capsys.readouterr().out
    rows[1]["speedup"] = 3.0
    assert core.WHERE not in core.run(tmp_path)["why"]


def test_newton_says_the_native_loop_wins_on_a_cpu_and_newton_on_a_gpu():
    from paraprop_lab.demos.newton import explain

    rows = [{"method": "torch.nn.GRU", "fwd_ms": 400.0, "speedup": 1.0, "iterations": 30000},
            {"method": "newton", "fwd_ms": 380.0, "speedup": 400 / 380, "iterations": 4},
            {"method": "quasi_newton", "fwd_ms": 500.0, "speedup": 0.8, "iterations": 9},
            {"method": "native", "fwd_ms": 25.0, "speedup": 16.0, "iterations": 30000}]
    why, headline = explain(rows, 30000)
    assert why.startswith("On this machine, native wins (16.00x torch.nn.GRU): newton needs 4 "
                          "iterations instead of 30000 GRU steps")
    assert "the native forward, the same 30000 sequential steps in one compiled call, runs at " \
           "16.00x" in why
    assert "Newton wins where one iteration over all 30000 steps costs about one step: on a GPU" \
        in why
    assert headline == ("newton 4 iterations vs 30000 steps, 1.05x torch.nn.GRU; native loop "
                        "16.00x")


def test_tarflow_diffusion_fusion_and_rnn_say_where_they_win():
    from paraprop_lab.demos import bppsa, diffusion, fusion, tarflow

    base = {"method": "sequential, KV cache", "model_calls": 120, "time_ms": 20.0,
            "speedup": 1.0, "converged": True, "plan": "8 x sequential_cached",
            "iterations_per_block": " ".join(["15"] * 8)}
    jac = {**base, "method": "jacobi", "model_calls": 84, "time_ms": 60.0, "speedup": 1 / 3,
           "plan": "8 x jacobi"}
    why, _ = tarflow.explain([base, jac], T=16)
    assert why.startswith("On this machine, the KV-cached loop wins")
    assert "a pass over all 16 patches of a block costs about one cached call: on a GPU" in why

    loop = {"method": "diffusers loop", "iterations": 1000, "model_evals": 1000,
            "time_ms": 300.0, "speedup": 1.0}
    picard = {"method": "picard (window 128)", "iterations": 189, "model_evals": 24018,
              "time_ms": 900.0, "speedup": 1 / 3}
    why, _ = diffusion.explain([loop, picard], 1000)
    assert "Parallel sampling wins where one batched call over 127 steps costs about one loop " \
           "step: on a GPU" in why

    plain = {"mode": "unfused", "optimizer_ms": 1.0, "forward_ms": 4.0, "backward_ms": 6.0,
             "step_ms": 11.0, "opt_share": 1 / 11, "speedup": 1.0, "bitwise_equal": True}
    fused = {**plain, "mode": "backward", "optimizer_ms": 0.1, "backward_ms": 7.0,
             "speedup": 0.98}
    why, _ = fusion.explain([plain, fused])
    assert "Fusion pays where the optimizer's step is a large share of a training step" in why

    torch_row = {"method": "torch.nn.RNN + autograd", "speedup": 1.0, "bwd_speedup": 1.0}
    rows = [torch_row] + [{"method": m, "speedup": 0.9, "bwd_speedup": 1.5}
                          for m in ("nat", "scan", "chunked", "jacobi")]
    why, _ = bppsa.explain(rows, 1000, sweeps=30)
    assert why.startswith("On this machine, torch.nn.RNN wins")
    assert "It wins where the scan's one call replaces more sequential work: longer sequences" \
        in why


def test_decoding_says_where_jacobi_decoding_wins_when_it_loses():
    from paraprop_lab.demos.decoding import explain

    def row(method, calls, per, t):
        return {"method": method, "model_calls": calls, "tokens_per_call": per, "time_s": t,
                "vs_sequential": 0.1 / t, "same_tokens": True}

    rows = [row("transformers generate", 256, 1.0, 0.1), row("paraprop sequential", 256, 1.0, 0.1),
            row("jacobi (window 16, n-gram guesses)", 200, 1.3, 0.2)]
    why, _ = explain(rows, window=16)
    assert "Jacobi decoding wins where a 16-token pass costs about a one-token pass" in why
    rows[2] = row("jacobi (window 16, n-gram guesses)", 70, 3.7, 0.05)
    assert "Jacobi decoding wins where" not in explain(rows, window=16)[0]


def test_flows_headline_and_equality_in_the_sentence():
    from paraprop_lab.demos.flows import explain

    row = {"method": "zuko MAF(784, transforms=3)", "D": 784, "library_passes": 2352,
           "paraprop_passes": 19, "library_ms": 3000.0, "accelerated_ms": 40.0, "speedup": 75.0,
           "bitwise_equal": True}
    why, headline = explain([row])
    assert why.startswith("On this machine, accelerate(flow) wins: it needs 19 passes instead "
                          "of 2352 library passes")
    assert why.endswith("with bitwise the same samples.")
    assert headline == "zuko MAF sample(): 75.0x, 19 passes instead of 2352, bitwise the same " \
                       "samples"
    why, headline = explain([{**row, "bitwise_equal": False}])
    assert "NOT the same samples" in why and "NOT the same samples" in headline


# -- plots --------------------------------------------------------------------------------
def test_convergence_plot_scales_and_tick_labels(tmp_path, monkeypatch):
    from paraprop_lab.experiments import plots

    seen = []
    real = plots.save_figure

    def spy(fig, path, **kw):
        for ax in fig.axes:
            labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
            seen.append((ax.get_xscale(), bool(labels), ax.get_xlim()))
        return real(fig, path, **kw)

    monkeypatch.setattr(plots, "save_figure", spy)
    long = {"jacobi": {"forward difference": [10.0 ** -k for k in range(20)],
                       "true error": [10.0 ** -k for k in range(20)]},
            "gs_jacobi": {"forward difference": [0.5] * 327, "true error": [0.5] * 327}}
    plots.convergence_plot(tmp_path / "a.png", "t" * 300, long, tol=1e-5)
    assert [s for s, _, _ in seen] == ["log", "log"] and all(lab for _, lab, _ in seen)
    assert all(lo < 1 and hi > 327 for _, _, (lo, hi) in seen)   # 1 and 327 both inside
    seen.clear()
    short = {"jacobi": long["jacobi"], "jacobi_gs": {"forward difference": [1.0, 0.1, 0.0],
                                                     "true error": [1.0, 0.0, 0.0]}}
    plots.convergence_plot(tmp_path / "b.png", "short", short)
    assert [s for s, _, _ in seen] == ["linear", "linear"] and all(lab for _, lab, _ in seen)
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").is_file()


def test_log_iterations_axis_ticks():
    from paraprop_lab.experiments.plots import log_iterations_axis, plt

    fig, ax = plt.subplots()
    log_iterations_axis(ax, 327)
    assert [int(t) for t in ax.get_xticks()] == [1, 2, 5, 10, 20, 50, 100, 200, 327]
    log_iterations_axis(ax, 64)
    assert [int(t) for t in ax.get_xticks()] == [1, 2, 5, 10, 20, 64]
    plt.close(fig)


def test_a_long_title_is_not_clipped(tmp_path):
    from PIL import Image

    from paraprop_lab.experiments.plots import plt, save_figure

    sizes = []
    for title in ("short", "a very long title " * 12):
        fig, ax = plt.subplots(figsize=(4, 3))
        ax.plot([1, 2])
        ax.set_title(title)
        with Image.open(save_figure(fig, tmp_path / f"{len(title)}.png", dpi=50)) as image:
            sizes.append(image.size)
    assert sizes[1][0] > sizes[0][0]   # the saved area grew to hold the title
