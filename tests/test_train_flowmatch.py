"""``paraprop train flowmatch`` (issue 31 item 4): the flow-matching loss in diffusers'
``FlowMatchEulerDiscreteScheduler`` convention (``x_sigma = (1 - sigma) x0 + sigma eps``, the
velocity ``eps - x0``, timestep ``1000 sigma``), a short training run whose loss decreases,
samples of the plain diffusers loop, checkpoints that load back bit for bit, the CLI job and its
refusals. Tiny models and data: each test well under a second."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
from paraprop.data import make_moons  # noqa: E402
from paraprop.models import MLPDenoiser  # noqa: E402
from paraprop.models.denoisers import small_unet  # noqa: E402
from paraprop_lab.training import flowmatch as fm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_mlp(seed: int = 0) -> MLPDenoiser:
    return MLPDenoiser(dim=2, hidden=16, layers=2, embed=8, seed=seed)


def test_the_loss_is_the_schedulers_convention():
    seen = {}

    def model(x, t):   # predicts a zero velocity and records what it read
        seen["x"], seen["t"] = x, t
        return torch.zeros_like(x)

    x0 = make_moons(8, seed=2)
    loss = fm.flowmatch_loss(model, x0, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.rand(len(x0), generator=g)
    assert torch.equal(seen["t"], sigma * 1000)
    assert torch.allclose(seen["x"], (1 - sigma[:, None]) * x0 + sigma[:, None] * noise)
    assert torch.equal(loss, (noise - x0).pow(2).mean())
    # at sigma on the scheduler's grid, x_sigma is the scheduler's own scale_noise
    sched = fm.flowmatch_scheduler()
    sched.set_timesteps(4)
    t = sched.timesteps[1]
    want = sched.scale_noise(x0, t[None], noise)
    s = float(t) / 1000
    assert torch.allclose((1 - s) * x0 + s * noise, want, atol=1e-6)


def test_the_exact_velocity_carries_the_noise_to_the_data(device):
    # the straight line's velocity eps - x0, integrated by the diffusers loop from the same
    # noise, lands on x0: the sign and the time direction of the convention
    x0 = make_moons(16, seed=3).to(device)
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7)).to(device)
    calls = []

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros((), device=device))

        def forward(self, x, t):
            calls.append(float(t))
            return eps - x0

    out = fm.draw_samples(Oracle(), tuple(x0.shape), steps=6, seed=7)
    assert out.device == x0.device
    assert torch.allclose(out, x0, atol=1e-5)
    sched = fm.flowmatch_scheduler()
    sched.set_timesteps(6)
    assert calls == sched.timesteps.tolist() and calls[0] == 1000.0


def test_training_decreases_the_loss_on_a_fixed_seed():
    x, held = make_moons(512, seed=0), make_moons(1024, seed=1)
    net = tiny_mlp()

    def held_out_loss(model):   # the same sigmas and noise before and after
        with torch.no_grad():
            return float(fm.flowmatch_loss(model, held, torch.Generator().manual_seed(0)))

    before = held_out_loss(net)
    kw = {"epochs": 8, "batch_size": 32, "lr": 1e-2, "seed": 0, "progress": False}
    hist = fm.train_flowmatch(net, x, **kw)
    assert len(hist) == 8 and all(torch.isfinite(torch.tensor(hist)))
    assert hist[-1] < 0.9 * hist[0] and not net.training
    assert held_out_loss(net) < 0.95 * before
    again = tiny_mlp()
    assert fm.train_flowmatch(again, x, **kw) == hist
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(),
                                                 again.state_dict().values(), strict=True))


def test_the_digits_unet_trains_and_draws(tmp_path):
    # digit-shaped images in [-1, 1] (the digits themselves: ddpm_data, tests/test_denoisers.py)
    x = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert fm.flowmatch_data("moons", n=8, seed=1).shape == (8, 2)
    unet = small_unet(8, widths=(8, 16), seed=0)
    hist = fm.train_flowmatch(unet, x, epochs=1, batch_size=4, progress=False)
    assert len(hist) == 1 and torch.isfinite(torch.tensor(hist[0]))
    png = fm.samples_png(tmp_path / "d.png", unet.eval(), "digits", x, steps=2, shift=3.0)
    assert png.exists() and png.stat().st_size > 1000


def test_the_checkpoint_loads_back_bitwise(tmp_path):
    kw = {"epochs": 1, "n": 64, "batch_size": 32, "progress": False}
    model, info = fm.trained_flowmatch(tmp_path, "moons", **kw)
    assert info["trained_now"] and info["checkpoint"].endswith("flowmatch_moons_e1_b32_n64.pt")
    again, info2 = fm.trained_flowmatch(tmp_path, "moons", **kw)
    assert not info2["trained_now"] and info2["checkpoint"] == info["checkpoint"]
    assert not again.training and isinstance(again, MLPDenoiser)
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x, t = torch.randn(3, 2), torch.tensor([1000.0, 500.5, 1.0])
    assert torch.equal(model(x, t), again(x, t))
    assert fm.checkpoint_name("moons", 300) == "flowmatch_moons_e300.pt"
    assert fm.checkpoint_name("digits", 2, lr=5e-4, seed=1) == \
        "flowmatch_digits_e2_s1_lr0.0005.pt"


def test_bad_arguments_are_refused_by_name():
    x = make_moons(16)
    net = tiny_mlp()
    with pytest.raises(ValueError, match="epochs must be a positive int, got 0"):
        fm.train_flowmatch(net, x, epochs=0)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        fm.train_flowmatch(net, x, epochs=1, batch_size=0)
    with pytest.raises(ValueError, match=r"lr must be a finite number > 0, got nan"):
        fm.train_flowmatch(net, x, epochs=1, lr=float("nan"))
    with pytest.raises(ValueError, match=r"x must be a floating-point tensor \(N, ...\), got "
                                         r"torch.int64 \(4, 2\)"):
        fm.train_flowmatch(net, torch.zeros(4, 2, dtype=torch.long), epochs=1)
    with pytest.raises(ValueError, match="unknown data='mnist'; choose one of moons, digits"):
        fm.flowmatch_data("mnist")
    with pytest.raises(ValueError, match="unknown data='mnist'; choose one of moons, digits"):
        fm.trained_flowmatch("unused", "mnist")
    with pytest.raises(ValueError, match="shift must be a finite number > 0, got -1.0"):
        fm.flowmatch_scheduler(-1.0)
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        fm.draw_samples(net, (4, 2), steps=0)


def test_cli_job_writes_checkpoint_and_png(tmp_path, capsys):
    from paraprop_lab.cli import main

    out = tmp_path / "m.pt"
    assert main(["train", "flowmatch", "--data", "moons", "--epochs", "1", "--n", "64",
                 "--batch-size", "32", "--sample-steps", "3", "--out", str(out)]) == 0
    assert out.exists() and out.with_suffix(".png").exists()
    text = capsys.readouterr().out
    assert "trained flow matching on moons (64 x 2), MLPDenoiser" in text and "1 epochs" in text
    assert MLPDenoiser.load(out).config["num_train_timesteps"] == 1000


@pytest.mark.parametrize("args, message", [
    (["--sample-steps", "0"], "sample_steps must be a positive int, got 0"),
    (["--shift", "0"], "shift must be a finite number > 0, got 0.0"),
    (["--epochs", "0"], "epochs must be a positive int, got 0"),
    (["--batch-size", "-2"], "batch_size must be a positive int, got -2"),
    (["--lr", "inf"], "lr must be a finite number > 0, got inf"),
    (["--n", "1"], "n must be an int >= 2, got 1"),
])
def test_cli_refuses_bad_settings_before_writing(tmp_path, capsys, args, message):
    from paraprop_lab.cli import main

    out = tmp_path / "m.pt"
    assert main(["train", "flowmatch", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_cli_refuses_unknown_data(capsys):
    from paraprop_lab.cli import main

    with pytest.raises(SystemExit):
        main(["train", "flowmatch", "--data", "mnist"])
    assert "invalid choice: 'mnist'" in capsys.readouterr().err
