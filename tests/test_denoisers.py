"""The diffusion models and their training job: timestep forms, dtypes, errors, save/load, the
moons data, a short training run, checkpoint reuse and the ``train ddpm`` CLI job."""

import subprocess
import sys

import pytest
import torch

from paraprop.data import make_moons
from paraprop.models import MLPDenoiser, small_unet
from paraprop.models.denoisers import load_unet, save_unet, timestep_embedding
from paraprop_lab.training import ddpm

pytest.importorskip("diffusers")


# -- MLPDenoiser ------------------------------------------------------------------------------
def test_mlp_denoiser_timestep_forms_agree():
    net = MLPDenoiser(dim=2, hidden=16, layers=2, seed=1)
    x = torch.randn(4, 2)
    a = net(x, 7)
    assert a.shape == (4, 2) and a.dtype == torch.float32
    for t in (torch.tensor(7), torch.full((4,), 7), torch.full((4,), 7.0), 7.0,
              torch.tensor(7, dtype=torch.int32)):
        assert torch.equal(a, net(x, t)), t
    per_row = net(x, torch.tensor([7, 8, 9, 10]))
    assert torch.equal(per_row[0], a[0]) and not torch.equal(per_row[1:], a[1:])
    # rows are independent: one row at a time gives the batched result
    rows = torch.cat([net(x[i:i + 1], torch.tensor([7 + i])) for i in range(4)])
    assert torch.allclose(rows, per_row, atol=1e-6)


def test_mlp_denoiser_float64_and_seed():
    net = MLPDenoiser(dim=3, hidden=8, layers=2, seed=2)
    x = torch.randn(5, 3, dtype=torch.float64)
    out32 = net(x.float(), 11)
    out64 = net.double()(x, 11)
    assert out64.dtype == torch.float64
    assert torch.allclose(out64.float(), out32, atol=1e-5)
    assert torch.equal(MLPDenoiser(seed=3).net[0].weight, MLPDenoiser(seed=3).net[0].weight)
    assert not torch.equal(MLPDenoiser(seed=3).net[0].weight, MLPDenoiser(seed=4).net[0].weight)
    state = torch.random.get_rng_state()
    MLPDenoiser(seed=5)
    assert torch.equal(state, torch.random.get_rng_state())     # the global RNG is untouched


def test_mlp_denoiser_config_and_schedule_length():
    net = MLPDenoiser(dim=2, hidden=8, layers=1, embed=4, num_train_timesteps=100, seed=1)
    assert net.config == {"dim": 2, "hidden": 8, "layers": 1, "embed": 4,
                          "num_train_timesteps": 100, "seed": 1}
    net.config["dim"] = 99                                       # a copy
    assert net.config["dim"] == 2
    # with 100 timesteps, t is embedded as 10 t: the embedding of a 1000-step model at 10 t
    long = MLPDenoiser(dim=2, hidden=8, layers=1, embed=4, num_train_timesteps=1000, seed=1)
    x = torch.randn(3, 2)
    assert torch.allclose(net(x, 4), long(x, 40), atol=1e-6)
    assert timestep_embedding(torch.tensor([0]), 4).tolist() == [[0.0, 0.0, 1.0, 1.0]]


@pytest.mark.parametrize("x, t, err, match", [
    (torch.randn(4, 3), 1, ValueError, r"x must have shape \(N, 2\), got \(4, 3\)"),
    (torch.randn(4), 1, ValueError, r"x must have shape \(N, 2\), got \(4,\)"),
    ([[0.0, 0.0]], 1, TypeError, "x must be a tensor of shape \\(N, 2\\), got list"),
    (torch.randn(4, 2, dtype=torch.float64), 1, ValueError,
     "x must have the model's dtype torch.float32, got torch.float64"),
    (torch.randn(4, 2), torch.arange(3), ValueError,
     r"t must be a scalar, a 0-d tensor or have shape \(4,\).*got shape \(3,\)"),
    (torch.randn(4, 2), torch.zeros(4, 1), ValueError, r"got shape \(4, 1\)"),
    (torch.randn(4, 2), "5", TypeError, "t must be an int, a float or a tensor.*got str"),
    (torch.randn(4, 2), True, TypeError, "got bool"),
    (torch.randn(4, 2), torch.ones(4, dtype=torch.bool), TypeError,
     "t must hold integer or floating-point timesteps, got torch.bool"),
])
def test_mlp_denoiser_bad_inputs(x, t, err, match):
    with pytest.raises(err, match=match):
        MLPDenoiser(dim=2, hidden=8, layers=1)(x, t)


@pytest.mark.parametrize("kw, match", [
    ({"embed": 5}, "embed must be even.*got 5"),
    ({"dim": 0}, "dim must be a positive int, got 0"),
    ({"layers": 1.5}, "layers must be a positive int, got 1.5"),
    ({"num_train_timesteps": 0}, "num_train_timesteps must be a positive int, got 0"),
    ({"seed": -1}, "seed must be an int >= 0, got -1"),
])
def test_mlp_denoiser_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        MLPDenoiser(**kw)


def test_mlp_denoiser_save_load(tmp_path):
    net = MLPDenoiser(dim=3, hidden=8, layers=2, num_train_timesteps=50, seed=4)
    net.save(tmp_path / "sub" / "m.pt")
    back = MLPDenoiser.load(tmp_path / "sub" / "m.pt")
    assert back.config == net.config
    x = torch.randn(5, 3)
    t = torch.tensor([0, 1, 2, 3, 49])
    assert torch.equal(net(x, t), back(x, t))
    with pytest.raises(FileNotFoundError, match="no such file"):
        MLPDenoiser.load(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt: cannot be read as a paraprop MLPDenoiser"):
        MLPDenoiser.load(tmp_path / "junk.pt")


# -- moons ------------------------------------------------------------------------------------
def test_moons_data():
    x = make_moons(1000, seed=3)
    assert x.shape == (1000, 2) and x.dtype == torch.float32
    assert torch.allclose(x.mean(0), torch.zeros(2), atol=1e-5)
    assert torch.allclose(x.std(0), torch.ones(2), atol=1e-5)
    assert torch.equal(x, make_moons(1000, seed=3))
    assert not torch.equal(x, make_moons(1000, seed=4))
    # both moons appear in any prefix (the points are in random order)
    head = x[:100]
    assert bool((head[:, 1] > 0.5).any()) and bool((head[:, 1] < -0.5).any())
    # without noise: the same angles, so the noisy points lie within a few noise widths
    clean = make_moons(1000, noise=0.0, seed=3)
    assert 0 < float((x - clean).abs().max()) < 0.5


@pytest.mark.parametrize("args, kw, match", [
    ((1,), {}, "n must be an int >= 2, got 1"),
    ((10.0,), {}, "n must be an int >= 2, got 10.0"),
    ((10,), {"noise": -0.1}, "noise must be a finite number >= 0, got -0.1"),
    ((10,), {"seed": -2}, "seed must be an int >= 0, got -2"),
])
def test_moons_errors(args, kw, match):
    with pytest.raises(ValueError, match=match):
        make_moons(*args, **kw)


# -- small_unet -------------------------------------------------------------------------------
def test_small_unet_forward_and_round_trip(tmp_path):
    unet = small_unet(8, 1, seed=0).eval()
    assert sum(p.numel() for p in unet.parameters()) < 500_000
    x = torch.randn(2, 1, 8, 8)
    t = torch.tensor([3, 900])
    with torch.no_grad():
        out = unet(x, t).sample
        assert out.shape == x.shape
        save_unet(unet, tmp_path / "u.pt")
        back = load_unet(tmp_path / "u.pt")
        assert not back.training
        assert torch.equal(out, back(x, t).sample)
    assert torch.equal(small_unet(8, seed=1).conv_in.weight, small_unet(8, seed=1).conv_in.weight)
    torch.save({"kind": "other"}, tmp_path / "o.pt")
    with pytest.raises(ValueError, match="not a paraprop UNet2DModel checkpoint"):
        load_unet(tmp_path / "o.pt")
    with pytest.raises(TypeError, match="model must be a diffusers UNet2DModel, got MLPDenoiser"):
        save_unet(MLPDenoiser(), tmp_path / "m.pt")


@pytest.mark.parametrize("args, kw, match", [
    ((6,), {"widths": (8, 16, 32)}, "sample_size must be divisible by 4.*got 6"),
    ((8,), {"widths": ()}, "widths must be a non-empty tuple of positive ints"),
    ((0,), {}, "sample_size must be a positive int, got 0"),
    ((8, 0), {}, "channels must be a positive int, got 0"),
])
def test_small_unet_errors(args, kw, match):
    with pytest.raises(ValueError, match=match):
        small_unet(*args, **kw)


def test_import_models_does_not_import_diffusers():
    code = "import sys, paraprop.models; print('diffusers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- training ---------------------------------------------------------------------------------
def test_train_ddpm_runs():
    x = make_moons(256)
    net = MLPDenoiser(hidden=16, layers=2)
    hist = ddpm.train_ddpm(net, x, epochs=3, batch_size=64, progress=False)
    assert len(hist) == 3 and all(torch.isfinite(torch.tensor(hist)))
    assert hist[-1] < hist[0] * 1.2 and not net.training
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        ddpm.train_ddpm(net, x, steps=0, epochs=1)
    with pytest.raises(ValueError, match="x must be a floating-point tensor"):
        ddpm.train_ddpm(net, torch.zeros(4, 2, dtype=torch.long), epochs=1)


def test_ddpm_data():
    assert ddpm.ddpm_data("moons", n=64).shape == (64, 2)
    digits = ddpm.ddpm_data("digits", n=10)
    assert digits.shape == (10, 1, 8, 8) and digits.min() >= -1 and digits.max() <= 1
    assert digits.min() == -1
    with pytest.raises(ValueError, match="unknown data='cifar'; choose one of moons, digits"):
        ddpm.ddpm_data("cifar")


def test_trained_denoiser_reuses_its_checkpoint(tmp_path):
    kw = {"epochs": 1, "n": 128, "steps": 50, "progress": False}
    model, info = ddpm.trained_denoiser(tmp_path, "moons", **kw)
    assert info["trained_now"] and info["checkpoint"].endswith("ddpm_moons_e1_T50_n128.pt")
    again, info2 = ddpm.trained_denoiser(tmp_path, "moons", **kw)
    assert not info2["trained_now"] and info2["checkpoint"] == info["checkpoint"]
    x = torch.randn(3, 2)
    assert torch.equal(model(x, 5), again(x, 5)) and again.config["num_train_timesteps"] == 50
    assert ddpm.checkpoint_name("moons", 150) == "ddpm_moons_e150.pt"
    assert ddpm.checkpoint_name("digits", 2, lr=5e-4, seed=1) == "ddpm_digits_e2_s1_lr0.0005.pt"


def test_samples_png_images(tmp_path):
    x = ddpm.ddpm_data("digits", n=5)
    unet = small_unet(8, widths=(8, 16)).eval()
    png = ddpm.samples_png(tmp_path / "d.png", unet, "digits", x, steps=20)
    assert png.exists() and png.stat().st_size > 1000


@pytest.mark.slow
def test_cli_job_writes_checkpoint_and_png(tmp_path, capsys):
    from paraprop_lab.cli import main

    out = tmp_path / "m.pt"
    assert main(["train", "ddpm", "--data", "moons", "--epochs", "1", "--n", "256",
                 "--steps", "100", "--out", str(out)]) == 0
    assert out.exists() and out.with_suffix(".png").exists()
    text = capsys.readouterr().out
    assert "trained DDPM on moons (256 x 2), MLPDenoiser" in text and "1 epochs" in text
    assert MLPDenoiser.load(out).config["num_train_timesteps"] == 100
    assert main(["train", "ddpm", "--data", "moons", "--n", "1", "--out", str(out)]) == 2
    assert "n must be an int >= 2, got 1" in capsys.readouterr().err
