"""The networks job, benchmark suite and demo part built on paraprop.networks (smoke runs)."""

import json

import pytest
import torch

# the suite and the demo part build torchvision's architectures (the optional 'vision' extra)
pytest.importorskip("torchvision", reason="needs torchvision (pip install 'paraprop[vision]')")

from paraprop.networks import as_recurrence, evaluate
from paraprop.solvers import GSJacobi
from paraprop_lab import bench
from paraprop_lab.bench import networks as suite
from paraprop_lab.cli import main
from paraprop_lab.demos import networks as demo
from paraprop_lab.training import jobs
from paraprop_lab.training.networks import (
    accuracy,
    checkpoint_classes,
    image_data,
    load_weights,
    make_network,
    save_checkpoint,
    split,
    train_network,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_networks_are_recurrences_of_the_benchmark_sizes():
    mlp = make_network("mlp", depth=5, width=16)
    rec = as_recurrence(mlp)
    assert len(rec) == 6  # Flatten joins the first Linear; each ReLU its Linear
    x = torch.randn(2, 1, 32, 32)
    assert torch.equal(rec(x), mlp(x))
    with pytest.raises(ValueError, match="unknown arch='vgg'"):
        make_network("vgg")


def test_image_data_resizes_and_repeats_channels():
    x, y = image_data("digits", size=32, channels=3)
    assert x.shape == (1797, 3, 32, 32) and y.shape == (1797,)
    assert torch.equal(x[:, 0], x[:, 2])
    xt, yt, xh, yh = split("digits", x, y)
    assert len(xt) == 1500 and len(xh) == 297
    with pytest.raises(ValueError, match="unknown data='cifar'"):
        image_data("cifar")


def test_brief_training_learns_and_checkpoints_round_trip(tmp_path):
    x, y = image_data("digits", size=8, channels=1)
    xt, yt, xh, yh = split("digits", x, y)
    model = make_network("mlp", size=8, depth=2, width=32)
    before = accuracy(model, xh, yh)
    rec = train_network(model, xt, yt, steps=60, batch_size=64, lr=3e-3, progress=False)
    after = accuracy(model, xh, yh)
    assert after > max(before, 0.5) and rec["loss_last"] < rec["loss_first"]
    assert not model.training
    path = save_checkpoint(tmp_path / "m.pt", model, "mlp", {"weights": "test"})
    fresh = make_network("mlp", size=8, depth=2, width=32, seed=1)
    assert load_weights(fresh, path) == {"weights": "test"}
    assert accuracy(fresh, xh, yh) == after
    assert checkpoint_classes(path) == 10
    torch.save(model.state_dict(), tmp_path / "plain.pt")  # a plain state_dict loads too
    assert load_weights(make_network("mlp", size=8, depth=2, width=32), tmp_path / "plain.pt") == {}
    with pytest.raises(ValueError, match="its weights do not fit the model"):
        load_weights(make_network("mlp", size=8, depth=3, width=32), path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_weights(fresh, tmp_path / "missing.pt")


def test_train_job_reports_weights_and_evaluates(tmp_path, capsys):
    assert "densenet" in jobs()
    out = tmp_path / "mlp.pt"
    argv = ["train", "densenet", "--arch", "mlp", "--data", "digits", "--steps", "5",
            "--out", str(out), "--eval-batch", "4"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "weights = random initialisation, then trained here: 5 Adam steps" in text
    assert "Jacobi-GS over 25 states" in text and out.is_file()
    assert main(["train", "densenet", "--arch", "mlp", "--data", "digits", "--steps", "0",
                 "--weights", str(out), "--out", str(tmp_path / "b.pt"),
                 "--eval-batch", "0"]) == 0
    assert f"weights = loaded from {out}" in capsys.readouterr().out


def test_evaluate_on_a_trained_mlp_matches_forward():
    x, y = image_data("digits", size=8, channels=1)
    model = make_network("mlp", size=8, depth=4, width=16)
    train_network(model, x[:500], y[:500], steps=20, progress=False)
    out, sol = evaluate(model, x[-6:], method=GSJacobi(block_size=2), tol=0)
    with torch.no_grad():
        assert torch.equal(out, model(x[-6:]))


def test_bench_suite_quick(tmp_path):
    assert "networks" in bench.suites()
    payload = suite.run(tmp_path, quick=True, repeats=1)
    rows = payload["rows"]
    # every network has one state per block; a time-balanced partition is added only when it
    # merges states (it comes from measured layer times, so which networks get one varies)
    by_net: dict = {}
    for r in rows:
        by_net.setdefault(r["network"], []).append(r)
    assert list(by_net) == ["small DenseNet", "MLP 6x32"]
    for net, rs in by_net.items():
        assert rs[0]["variant"] == "one state per block"
        assert [r["variant"] for r in rs[1:]] in ([], ["balanced"]), net
        if len(rs) == 2:
            assert rs[1]["n_blocks"] < rs[0]["n_blocks"]
    for r in rows:
        assert r["exact"] is True and r["top5@stop"] >= 0
        assert 1 <= r["iterations"] <= r["n_blocks"] <= r["states"]
        assert r["par_ms_est"] > 0 and r["est_speedup"] == pytest.approx(
            r["seq_ms_est"] / r["par_ms_est"])
    assert by_net["small DenseNet"][0]["est_speedup_paper"] is not None
    assert by_net["MLP 6x32"][0]["est_speedup_paper"] is None
    for m in payload["measured"]:
        assert m["threaded_iters"] >= 1 and m["measured_speedup"] > 0
    record = json.loads((tmp_path / "networks.json").read_text())
    assert record["suite"] == "networks" and record["quick"] is True
    assert (tmp_path / "networks.md").read_text().startswith("# networks")
    assert len(list(tmp_path.glob("networks_*_fig1d.png"))) == 2


def test_demo_part_quick(tmp_path, capsys):
    assert demo.ORDER == 70 and demo.TITLE
    res = demo.run(tmp_path, quick=True)
    assert res["rows"][0]["exact"] is True and "measured_speedup" in res["rows"][-1]
    assert res["headline"] and " wins" in res["why"] and res["why"] in md_all(res)
    assert "None" not in md_all(res)
    assert res["sections"] and (tmp_path / "demo_networks_fig1d.png").is_file()
    assert "Estimated (a worker per block, no overhead)" in capsys.readouterr().out


def md_all(res):
    return "\n".join(md for _, md in res["sections"])
