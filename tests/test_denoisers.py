"""The diffusion models and their training job: shapes, timestep forms, save/load, the CLI."""

import pytest
import torch

from paraprop.data import make_moons
from paraprop.models import MLPDenoiser, small_unet
from paraprop.models.denoisers import load_unet, save_unet
from paraprop.training import ddpm


def test_mlp_denoiser_timestep_forms_agree():
    net = MLPDenoiser(dim=2, hidden=16, layers=2, seed=1)
    x = torch.randn(4, 2)
    a = net(x, 7)
    assert a.shape == (4, 2)
    assert torch.equal(a, net(x, torch.tensor(7)))
    assert torch.equal(a, net(x, torch.full((4,), 7)))
    assert not torch.equal(a, net(x, torch.tensor([7, 8, 9, 10])))
    assert net.double()(x.double(), 7).dtype == torch.float64


def test_mlp_denoiser_bad_shapes():
    net = MLPDenoiser(dim=2, hidden=8, layers=1)
    with pytest.raises(ValueError, match=r"x must have shape \(N, 2\), got \(4, 3\)"):
        net(torch.randn(4, 3), 1)
    with pytest.raises(ValueError, match=r"t must be a scalar or have shape \(4,\).*\(3,\)"):
        net(torch.randn(4, 2), torch.arange(3))
    with pytest.raises(ValueError, match="embed must be even"):
        MLPDenoiser(embed=5)


def test_mlp_denoiser_save_load(tmp_path):
    net = MLPDenoiser(dim=3, hidden=8, layers=2, seed=4)
    net.save(tmp_path / "m.pt")
    back = MLPDenoiser.load(tmp_path / "m.pt")
    x = torch.randn(5, 3)
    assert torch.equal(net(x, 3), back(x, 3))
    with pytest.raises(FileNotFoundError, match="no such file"):
        MLPDenoiser.load(tmp_path / "missing.pt")


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
    with pytest.raises(ValueError, match="n must be an int >= 2"):
        make_moons(1)


def test_small_unet_forward_and_round_trip(tmp_path):
    unet = small_unet(8, 1, seed=0).eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        out = unet(x, torch.tensor([3, 900])).sample
        assert out.shape == x.shape
        save_unet(unet, tmp_path / "u.pt")
        back = load_unet(tmp_path / "u.pt").eval()
        assert torch.equal(out, back(x, torch.tensor([3, 900])).sample)
    with pytest.raises(ValueError, match="not a UNet2DModel checkpoint"):
        torch.save({"kind": "other"}, tmp_path / "o.pt")
        load_unet(tmp_path / "o.pt")


def test_train_ddpm_runs():
    x = make_moons(256)
    net = MLPDenoiser(hidden=16, layers=2)
    hist = ddpm.train_ddpm(net, x, epochs=2, batch_size=64, progress=False)
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(hist)))


@pytest.mark.slow
def test_cli_job_writes_checkpoint_and_png(tmp_path, capsys):
    from paraprop.cli import main

    out = tmp_path / "m.pt"
    assert main(["train", "ddpm", "--data", "moons", "--epochs", "1", "--n", "256",
                 "--out", str(out)]) == 0
    assert out.exists() and out.with_suffix(".png").exists()
    assert "trained DDPM on moons (256 samples), 1 epochs" in capsys.readouterr().out
    assert isinstance(MLPDenoiser.load(out), MLPDenoiser)
