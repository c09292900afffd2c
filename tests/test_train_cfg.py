"""``paraprop train cfg``: the class-conditional digits model for classifier-free guidance, its
training loss, the CLI, and guided sampling through paraprop against the diffusers loop."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("sklearn")

import paraprop  # noqa: E402
from paraprop_lab.cli import main  # noqa: E402
from paraprop_lab.training import cfg  # noqa: E402
from paraprop_lab.training.ddpm import sample_loop  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(epochs=2):
    x, labels = cfg.digits_with_labels(64)
    model = cfg.make_model(0)
    hist = cfg.train_cfg(model, x, labels, steps=100, epochs=epochs, batch_size=32,
                         progress=False)
    return model.eval().requires_grad_(False), hist


def test_training_lowers_the_loss_and_is_reproducible():
    model, hist = _tiny(epochs=3)
    assert hist[-1] < hist[0]
    again, hist2 = _tiny(epochs=3)
    assert hist == hist2
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 again.state_dict().values(), strict=True))


def test_guided_sampling_through_paraprop_is_the_loops():
    """The guided model (null class unconditional, labels conditional) sampled with DDIM:
    picard at tol=0 gives the diffusers loop's sample bit for bit, in fewer or as many calls."""
    from diffusers import DDIMScheduler

    model, _ = _tiny()
    labels = torch.tensor([0, 3, 7])
    net = cfg.guided(model, labels, 3.0)
    ref = sample_loop(net, DDIMScheduler(num_train_timesteps=100), (3, 1, 8, 8), 10, seed=0)
    x, sol = paraprop.diffusion.sample(net, DDIMScheduler(num_train_timesteps=100),
                                       (3, 1, 8, 8), num_inference_steps=10, method="sequential",
                                       generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, ref)
    y, sol = paraprop.diffusion.sample(net, DDIMScheduler(num_train_timesteps=100),
                                       (3, 1, 8, 8), num_inference_steps=10, method="picard",
                                       tol=0, throw=False,
                                       generator=torch.Generator().manual_seed(0))
    assert sol.stats["model_calls"] <= 10
    if sol.converged:
        assert torch.equal(y, ref)
    else:   # the UNet's batched calls may round apart: then named, never certified
        assert sol.stats["loop_bitwise"] is False


def test_bad_settings_are_refused_by_name(tmp_path, capsys):
    x, labels = cfg.digits_with_labels(8)
    with pytest.raises(ValueError, match=r"drop must be in \[0, 1\)"):
        cfg.train_cfg(cfg.make_model(), x, labels, epochs=1, drop=1.0, progress=False)
    with pytest.raises(ValueError, match="same number of samples, got 8 and 7"):
        cfg.train_cfg(cfg.make_model(), x, labels[:7], epochs=1, progress=False)
    assert main(["train", "cfg", "--epochs", "1", "--guidance", "1", "--out",
                 str(tmp_path / "m.pt")]) == 2
    assert "guidance must be > 1" in capsys.readouterr().err
    assert not (tmp_path / "m.pt").exists()   # refused before any training


def test_the_cli_writes_the_checkpoint_and_the_figure(tmp_path, capsys):
    out = tmp_path / "cfg.pt"
    assert main(["train", "cfg", "--epochs", "1", "--n", "64", "--steps", "50", "--out",
                 str(out)]) == 0
    assert out.exists() and out.with_suffix(".png").exists()
    model = cfg.load(out)
    assert model.config.num_class_embeds == 11
    assert "class-conditional DDPM on the digits" in capsys.readouterr().out
