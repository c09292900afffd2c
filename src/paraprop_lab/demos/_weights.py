"""The trained checkpoints that ``paraprop demo`` loads instead of training for minutes.

They live in ``src/paraprop_lab/weights/`` (:data:`WEIGHTS`): demo material, so in the lab
package, which the library never imports, and not in ``paraprop`` (a user of the library does
not carry them). Each one was written by the exact command in :data:`CHECKPOINTS` (the training
jobs of ``paraprop train``, with ``OMP_NUM_THREADS=1``), and its quality was recorded right after
by ``python -m paraprop_lab.demos._weights`` into ``weights/manifest.json``, with its size and
SHA-256. ``tests/test_demo_weights.py`` reloads every checkpoint and recomputes that quality.

Two figures per checkpoint:

- ``fingerprint``: the model's output on a fixed input built from a seeded generator (no data):
  it must match wherever the checkpoint is read;
- ``quality``: the model's loss on data that ships with the package or with Python (the digits,
  two moons, Python's documentation text) or, for the MNIST MADE, on the MNIST files when they
  are present. Python's documentation text changes with the Python version, so the char LM's
  held-out loss is compared only where the text's SHA-256 is the recorded one.

Figures are compared within a relative ``1e-4``: the same weights give the same figure up to the
rounding of the machine's kernels.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

WEIGHTS = Path(__file__).resolve().parents[1] / "weights"
MANIFEST = WEIGHTS / "manifest.json"
RTOL = 1e-4

_T = "OMP_NUM_THREADS=1 paraprop train "
CHECKPOINTS = {
    "made": {
        "file": "made_mnist_128x128_e20.pt",
        "what": "MADE (hidden 128 x 128, logistic conditionals) on MNIST (the 10,000 test "
                "images), 20 epochs",
        "command": _T + "made --data mnist --hidden 128 128 --epochs 20 "
                        "--out src/paraprop_lab/weights/made_mnist_128x128_e20.pt",
    },
    "charlm": {
        "file": "charlm_s2000_l2_w64",
        "what": "character-level GPT-2-shaped LM (2 layers, width 64, 4 heads) on Python's "
                "documentation text, 2000 steps",
        "command": _T + "charlm --steps 2000 --width 64 --layers 2 "
                        "--out src/paraprop_lab/weights/charlm_s2000_l2_w64",
    },
    "ddpm": {
        "file": "ddpm_moons_e300.pt",
        "what": "MLP denoiser (3 x 128) on two moons, DDPM 1000 timesteps, 300 epochs",
        "command": _T + "ddpm --data moons --out src/paraprop_lab/weights/ddpm_moons_e300.pt "
                        "--png /tmp/ddpm_moons_e300.png",
    },
    "flowmatch": {
        "file": "flowmatch_moons_e2000.pt",
        "what": "MLP velocity model (3 x 128) on two moons, flow matching (rectified flow, "
                "FlowMatchEulerDiscreteScheduler convention, 1000 timesteps), 2000 epochs",
        "command": _T + "flowmatch --data moons --epochs 2000 "
                        "--out src/paraprop_lab/weights/flowmatch_moons_e2000.pt "
                        "--png /tmp/flowmatch_moons_e2000.png",
    },
    "tarflow": {
        "file": "tarflow_digits_e60_w32.pt",
        "what": "TarFlow (8 blocks x 1 layer, width 32, 16 patches of 2x2) on the digits, "
                "60 epochs",
        "command": _T + "tarflow --data digits --width 32 "
                        "--out src/paraprop_lab/weights/tarflow_digits_e60_w32.pt",
    },
    "imagelm": {
        "file": "imagelm_l16_e60",
        "what": "autoregressive image model (GPT-2-shaped, 2 layers, width 64, 4 heads, dropout "
                "0.1 in training) on the digits at 16 grey levels (a class token, then 64 "
                "pixels), 60 epochs",
        "command": _T + "imagelm --epochs 60 --out src/paraprop_lab/weights/imagelm_l16_e60 "
                        "--png /tmp/imagelm_l16_e60.png",
    },
}


def path(name: str) -> Path | None:
    """The shipped checkpoint ``name`` (a key of :data:`CHECKPOINTS`), or ``None`` when it is
    not there (an install without the package data)."""
    if name not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {name!r}; choose from {', '.join(CHECKPOINTS)}")
    p = WEIGHTS / CHECKPOINTS[name]["file"]
    return p if p.exists() else None


def manifest() -> dict:
    """The recorded figures, size and SHA-256 of every checkpoint (``weights/manifest.json``)."""
    return json.loads(MANIFEST.read_text())


def load(name: str):
    """The checkpoint ``name`` loaded, in eval mode, gradients off: a ``MADE``, ``(model,
    vocab)`` for the char LM, an ``MLPDenoiser`` (DDPM's noise model, flow matching's velocity
    model), a ``TarFlow`` or the image model's ``GPT2LMHeadModel``.

    Raises:
        FileNotFoundError: the checkpoint is not there.
    """
    p = path(name)
    if p is None:
        raise FileNotFoundError(f"{WEIGHTS / CHECKPOINTS[name]['file']}: the shipped checkpoint "
                                f"is missing (made by: {CHECKPOINTS[name]['command']})")
    if name == "made":
        from paraprop.models import MADE

        return MADE.load(p).eval().requires_grad_(False)
    if name == "charlm":
        from transformers.utils import logging as hf_logging

        from paraprop.models.charlm import load_charlm

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # its "Loading weights" bar: not the demo's output
        try:
            model, vocab = load_charlm(p)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        return model.eval().requires_grad_(False), vocab
    if name == "imagelm":
        from paraprop_lab.training.imagelm import load_imagelm

        return load_imagelm(p).requires_grad_(False)
    if name in ("ddpm", "flowmatch"):
        from paraprop.models.denoisers import MLPDenoiser

        return MLPDenoiser.load(p).eval().requires_grad_(False)
    from paraprop.models.tarflow import TarFlow

    return TarFlow.load(p).eval().requires_grad_(False)


def describe(name: str) -> str:
    """One line for the demo: what the checkpoint is and the command that made it."""
    c = CHECKPOINTS[name]
    return f"{c['what']}; shipped checkpoint {c['file']}, made by: {c['command']}"


# -- the figures ----------------------------------------------------------------------------
def _seeded(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def _text_sha() -> str:
    from paraprop.data.text import load_text

    return hashlib.sha256(load_text().encode()).hexdigest()


def figures(name: str, loaded=None) -> dict:
    """``{"fingerprint": ..., "quality": ..., ...}`` of checkpoint ``name`` (``loaded``: what
    :func:`load` returned, else it is loaded here). A figure that needs absent data (MNIST) is
    ``None``."""
    loaded = load(name) if loaded is None else loaded
    with torch.no_grad():
        if name == "made":
            return _made(loaded)
        if name == "charlm":
            return _charlm(*loaded)
        if name == "ddpm":
            return _ddpm(loaded)
        if name == "flowmatch":
            return _flowmatch(loaded)
        if name == "imagelm":
            return _imagelm(loaded)
        return _tarflow(loaded)


def _made(model) -> dict:
    from paraprop.data.mnist import find_mnist_dir, load_mnist

    D = model.features
    out = {"fingerprint": float(model.log_prob(_seeded(16, D)).mean()),
           "quality_name": "NLL (nats per pixel) of the first 256 MNIST test images, "
                           "dequantized (x * 255 + U(0, 1)) / 256 with seed 0", "quality": None}
    d = find_mnist_dir()
    if d is not None and d.is_dir():
        x = load_mnist(d)[0][:256].reshape(256, -1)
        x = (torch.round(x * 255) + _seeded(*x.shape)) / 256
        out["quality"] = float(-model.log_prob(x).mean() / D)
    return out


def held_out_text(vocab) -> torch.Tensor:
    """The held-out ids of the char LM's text: its last 5% (as
    :func:`paraprop_lab.training.charlm.corpus` cuts it; one id per character)."""
    from paraprop.data.text import load_text

    text = load_text()
    return vocab.encode(text[int(len(text) * 0.95):])


def _charlm(model, vocab) -> dict:
    ids = (torch.arange(64) * 7) % len(vocab)
    logp = torch.log_softmax(model(ids[None]).logits, -1)
    held = held_out_text(vocab)
    length = 320
    rows = torch.stack([held[i * length : (i + 1) * length + 1] for i in range(8)])
    logits = model(rows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             rows[:, 1:].reshape(-1))
    return {"fingerprint": float(logp[0, :-1].gather(-1, ids[1:, None]).mean()),
            "quality_name": "next-character cross-entropy (nats) on the first 8 windows of "
                            "320 held-out characters", "quality": float(loss),
            "text_sha256": _text_sha()}


def _ddpm(model) -> dict:
    from diffusers import DDPMScheduler

    from paraprop.data import make_moons

    g = torch.Generator().manual_seed(0)
    sched = DDPMScheduler(num_train_timesteps=1000)
    x = make_moons(2048, seed=1)
    noise = torch.randn(x.shape, generator=g)
    t = torch.randint(0, 1000, (len(x),), generator=g)
    loss = (model(sched.add_noise(x, noise, t), t) - noise).pow(2).mean()
    probe = model(_seeded(64, 2) * 4 - 2, torch.arange(0, 1000, 1000 // 64)[:64])
    return {"fingerprint": float(probe.abs().mean()),
            "quality_name": "DDPM noise-prediction loss on 2048 fresh moons points (seed 1), "
                            "timesteps and noise of seed 0", "quality": float(loss)}


def _flowmatch(model) -> dict:
    from paraprop.data import make_moons
    from paraprop_lab.training.flowmatch import flowmatch_loss

    loss = flowmatch_loss(model, make_moons(2048, seed=1), torch.Generator().manual_seed(0))
    probe = model(_seeded(64, 2) * 4 - 2, torch.linspace(1.0, 1000.0, 64))
    return {"fingerprint": float(probe.abs().mean()),
            "quality_name": "flow-matching velocity loss on 2048 fresh moons points (seed 1), "
                            "sigmas and noise of seed 0", "quality": float(loss)}


def _imagelm(model) -> dict:
    from paraprop_lab.training.imagelm import HELD_OUT, levels_of, pixel_loss, sequences

    ids = (torch.arange(65) * 7) % model.config.vocab_size
    logp = torch.log_softmax(model(ids[None]).logits, -1)
    held = sequences(levels_of(model))[1]
    return {"fingerprint": float(logp[0, :-1].gather(-1, ids[1:, None]).mean()),
            "quality_name": f"next-pixel cross-entropy (nats per pixel) of the last {HELD_OUT} "
                            "digits (held out), given their class",
            "quality": float(pixel_loss(model, held))}


def _tarflow(flow) -> dict:
    from paraprop.data import load_digits

    g = torch.Generator().manual_seed(0)
    x = load_digits()[0][:256, None] * 2 - 1
    x = x + flow.noise_std * torch.randn(x.shape, generator=g)
    D = x[0].numel()
    probe = _seeded(8, *x.shape[1:]) * 2 - 1
    return {"fingerprint": float(flow.log_prob(probe).mean() / D),
            "quality_name": "NLL (nats per pixel) of the first 256 digits plus the training "
                            "noise (seed 0)", "quality": float(-flow.log_prob(x).mean() / D)}


def _sha256(p: Path) -> tuple[str, int]:
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h, size = hashlib.sha256(), 0
    for f in files:
        data = f.read_bytes()
        h.update(f.relative_to(p).as_posix().encode() if p.is_dir() else b"")
        h.update(data)
        size += len(data)
    return h.hexdigest(), size


def record() -> dict:
    """Recompute every checkpoint's figures, size and SHA-256 and write ``manifest.json``."""
    import datetime
    import platform

    rec = {}
    for name, c in CHECKPOINTS.items():
        p = path(name)
        if p is None:
            raise FileNotFoundError(f"{WEIGHTS / c['file']}: run first: {c['command']}")
        sha, size = _sha256(p)
        rec[name] = {**c, "bytes": size, "sha256": sha, **figures(name)}
    rec["_recorded"] = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                        "python": platform.python_version(),
                        "by": "python -m paraprop_lab.demos._weights"}
    MANIFEST.write_text(json.dumps(rec, indent=1) + "\n")
    return rec


if __name__ == "__main__":
    for k, v in record().items():
        print(k, {f: v.get(f) for f in ("bytes", "fingerprint", "quality")} if k[0] != "_"
              else v)
    sys.exit(0)
