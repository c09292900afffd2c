"""``paraprop train imagelm``: a small autoregressive image model, a decoder-only
``transformers`` ``GPT2LMHeadModel`` built from a config, on the 8x8 digits quantized to a few
grey levels, for sampled Jacobi decoding (``paraprop.decoding.generate``). Needs
``transformers``.

An image is a sequence of ``1 + 64`` tokens: its class (the digit, token ``levels + label``),
then its 64 pixels in raster order, each a grey level ``0 .. levels - 1``. Sampling an image of
a class is ``generate(model, [[levels + label]], max_new_tokens=64, do_sample=True,
top_k=...)``, with top-k sampling as autoregressive image models use it (Speculative Jacobi
Decoding's setting). The loss is the next-token cross-entropy on the pixels (the class token
is given, never predicted); the last :data:`HELD_OUT` digits are held out for the validation
loss (nats per pixel).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from paraprop import checks
from paraprop.data import load_digits
from paraprop_lab.training._common import (
    check_out_dir,
    check_out_file,
    default_path,
    fit,
    n_parameters,
    report_trained,
    save_png,
    subplots,
    tile,
)

NAME = "imagelm"
HELP = "train an autoregressive image model (GPT-2-shaped) on the digits' grey levels " \
    "(needs transformers)"
PIXELS = 64                 # 8 x 8, raster order
CLASSES = 10
HELD_OUT = 180              # the last digits, for the validation loss
DEFAULTS = {"levels": 16, "width": 64, "layers": 2, "heads": 4}
TRAIN = {"epochs": 60, "batch_size": 64, "lr": 3e-3, "dropout": 0.1}
META = "imagelm.json"       # the levels and classes, next to config.json and the weights
WEIGHTS_FILE = "model.safetensors"


def quantize(images: torch.Tensor, levels: int) -> torch.Tensor:
    """Images ``(N, 8, 8)`` in ``[0, 1]`` (the digits' 17 values ``k / 16``) as grey levels
    ``(N, 64)`` int64 in ``0 .. levels - 1``, raster order (``floor(k * levels / 17)``)."""
    checks.positive_int("levels", levels, minimum=2)
    k = torch.round(images.reshape(len(images), -1) * 16).long().clamp(0, 16)
    return k * levels // 17


def dequantize(pixels: torch.Tensor, levels: int) -> torch.Tensor:
    """Grey levels ``(N, 64)`` as images ``(N, 1, 8, 8)`` in ``[-1, 1]`` (for the figures)."""
    return (pixels.reshape(-1, 1, 8, 8).float() / (levels - 1)) * 2 - 1


def sequences(levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held_out)``: the digits as token sequences ``(N, 65)`` int64, the class token
    ``levels + label`` then the 64 grey levels; the last :data:`HELD_OUT` digits held out."""
    images, labels = load_digits()
    seq = torch.cat([(labels + levels)[:, None], quantize(images, levels)], 1)
    return seq[:-HELD_OUT], seq[-HELD_OUT:]


def image_gpt2(levels: int = DEFAULTS["levels"], *, width: int = DEFAULTS["width"],
               layers: int = DEFAULTS["layers"], heads: int = DEFAULTS["heads"],
               dropout: float = 0.0, seed: int = 0):
    """A randomly initialised ``GPT2LMHeadModel`` over ``levels + 10`` tokens and 65 positions
    (no BOS/EOS/pad: an image is always 64 pixels), with ``dropout`` in training (the job's
    default 0.1: 1,617 images overfit without it; sampling runs in eval mode, where it is
    off)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    checks.positive_int("levels", levels, minimum=2)
    checks.nonneg_number("dropout", dropout)
    if dropout >= 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    for name, v in (("width", width), ("layers", layers), ("heads", heads)):
        checks.positive_int(name, v)
    if width % heads:
        raise ValueError(f"width must be a multiple of heads={heads}, got width={width}")
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=levels + CLASSES, n_positions=1 + PIXELS, n_embd=width,
                     n_layer=layers, n_head=heads, bos_token_id=None, eos_token_id=None,
                     pad_token_id=None, resid_pdrop=dropout, embd_pdrop=dropout,
                     attn_pdrop=dropout)
    return GPT2LMHeadModel(cfg)


def levels_of(model) -> int:
    """The number of grey levels of an image model (its vocabulary less the 10 classes)."""
    return int(model.config.vocab_size) - CLASSES


def pixel_loss(model, seq: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per pixel) of the 64 pixels of ``seq`` ``(N, 65)``
    given the class token."""
    logits = model(seq[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             seq[:, 1:].reshape(-1))


def train_imagelm(model, seq: torch.Tensor, *, epochs: int, batch_size: int = 64,
                  lr: float = 3e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Fit ``model`` to the sequences ``seq`` ``(N, 65)`` by :func:`pixel_loss` with Adam
    (:func:`paraprop_lab.training._common.fit`); returns the mean loss of every epoch (left in
    eval mode)."""
    checks.positive_int("epochs", epochs)
    if seq.dim() != 2 or seq.shape[1] != 1 + PIXELS or seq.dtype != torch.long:
        raise ValueError(f"seq must be int64 of shape (N, {1 + PIXELS}), got {seq.dtype} "
                         f"{tuple(seq.shape)}")
    return fit(model, seq, lambda b: pixel_loss(model, b), epochs=epochs,
               batch_size=batch_size, lr=lr, seed=seed, progress=progress,
               desc="train imagelm", label="nats/pixel")


def save_imagelm(model, path) -> Path:
    """Save the model in the directory ``path``: ``config.json``, its weights in float32
    ``model.safetensors`` (the tied output layer once) and :data:`META`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(path / "config.json")
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(path / WEIGHTS_FILE))
    (path / META).write_text(json.dumps({"levels": levels_of(model), "classes": CLASSES,
                                         "pixels": PIXELS}) + "\n")
    return path


def load_imagelm(path):
    """The model saved by :func:`save_imagelm`, in eval mode (only JSON and safetensors are
    read: no pickle, no download).

    Raises:
        FileNotFoundError: ``path`` is not a saved image model.
        ValueError: its weights do not match its config.
    """
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    path = Path(path)
    for name in ("config.json", WEIGHTS_FILE, META):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path}: not a saved image model (no {name}; expected "
                                    "what paraprop train imagelm writes)")
    model = GPT2LMHeadModel(GPT2Config.from_json_file(path / "config.json"))
    state = load_file(str(path / WEIGHTS_FILE))
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:       # a shape that differs from the config's
        raise ValueError(f"{path / WEIGHTS_FILE}: does not match config.json ({e})") from None
    missing = [k for k in missing if k != "lm_head.weight"]   # tied to the token embedding
    if missing or unexpected:
        raise ValueError(f"{path / WEIGHTS_FILE}: does not match config.json (missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]})")
    meta = json.loads((path / META).read_text())
    if meta.get("levels") != levels_of(model):
        raise ValueError(f"{path / META}: levels={meta.get('levels')!r}, but config.json has "
                         f"{levels_of(model)} grey levels")
    return model.eval()


def class_prompts(labels, levels: int) -> torch.Tensor:
    """Prompts ``(B, 1)`` int64: the class token ``levels + label`` of each digit in
    ``labels`` (a list or tensor of digits 0..9)."""
    labels = torch.as_tensor(labels, dtype=torch.long)
    if labels.dim() != 1 or bool(((labels < 0) | (labels >= CLASSES)).any()):
        raise ValueError(f"labels must be a list of digits 0..9, got {labels.tolist()}")
    return (labels + levels)[:, None]


def sample_images(model, labels, *, seed: int = 0, top_k: int = 10,
                  temperature: float = 1.0, **kw):
    """Images of the digits ``labels``, sampled with ``paraprop.decoding.generate`` (top-k
    sampling, the Gumbel-max coupling unless ``kw`` says otherwise): ``(images, solution)``,
    the images ``(B, 64)`` grey levels."""
    from paraprop.decoding import generate

    ids = class_prompts(labels, levels_of(model))
    kw = {"coupling": "gumbel", **kw}
    out, sol = generate(model, ids, max_new_tokens=PIXELS, do_sample=True, top_k=top_k,
                        temperature=temperature, generator=torch.Generator().manual_seed(seed),
                        **kw)
    return out[:, 1:], sol


def image_grid(path, rows: list[tuple[str, torch.Tensor]], levels: int, cols: int = 10):
    """A PNG of image rows ``(title, grey levels (N, 64))``, one panel each, ``cols`` images
    per line."""
    fig, axes = subplots(len(rows), 1, figsize=(cols * 0.6 + 0.6, 1.3 * len(rows) * max(
        1, -(-max(len(p) for _, p in rows) // cols)) / 2 + 0.6), squeeze=False)
    for ax, (title, pixels) in zip(axes[:, 0], rows, strict=True):
        ax.imshow(tile(dequantize(pixels, levels), cols=cols).numpy(), cmap="gray", vmin=0,
                  vmax=1)
        ax.set_title(title, fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    return save_png(fig, path)


def checkpoint_name(*, epochs: int, seed: int = 0, **model_kw) -> str:
    """``imagelm_l{levels}_e{epochs}``, with a tag for every model setting off its default
    (e.g. ``imagelm_l16_e60_w32``)."""
    levels = model_kw.pop("levels", DEFAULTS["levels"])
    tag = "".join(f"_{k[0]}{v}" for k, v in sorted(model_kw.items()) if v != DEFAULTS[k])
    return f"imagelm_l{levels}_e{epochs}{'_seed' + str(seed) if seed else ''}{tag}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--levels", type=int, default=DEFAULTS["levels"], help="grey levels")
    p.add_argument("--epochs", type=int, default=TRAIN["epochs"])
    p.add_argument("--batch-size", type=int, default=TRAIN["batch_size"])
    p.add_argument("--lr", type=float, default=TRAIN["lr"])
    p.add_argument("--dropout", type=float, default=TRAIN["dropout"],
                   help="dropout in training (off when sampling, in eval mode)")
    p.add_argument("--width", type=int, default=DEFAULTS["width"])
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", type=int, default=10, help="top-k of the samples drawn at the end")
    p.add_argument("--out", default=None,
                   help="directory to save the model in (default: results/imagelm_l{levels}_"
                        "e{epochs})")
    p.add_argument("--png", default=None,
                   help="PNG of samples (two per digit) above held-out digits (default: "
                        "OUT.png beside the directory)")


def run(args) -> int:
    start = time.perf_counter()
    model_kw = {"levels": args.levels, "width": args.width, "layers": args.layers,
                "heads": args.heads}
    out = check_out_dir(default_path(args.out, Path("results") / checkpoint_name(
        epochs=args.epochs, seed=args.seed, **model_kw)), what="the directory to save the model in")
    png_path = check_out_file(default_path(args.png, out.with_suffix(".png")), "--png",
                              example="imagelm.png")
    train, held = sequences(args.levels)
    model = image_gpt2(seed=args.seed, dropout=args.dropout, **model_kw)
    hist = train_imagelm(model, train, epochs=args.epochs, batch_size=args.batch_size,
                         lr=args.lr, seed=args.seed)
    save_imagelm(model, out)
    with torch.no_grad():
        val = float(pixel_loss(model, held))
        labels = list(range(CLASSES)) * 2
        pixels, sol = sample_images(model, labels, seed=args.seed, top_k=args.top_k,
                                    throw=False)
    png = image_grid(png_path,
                     [(f"samples (top-k {args.top_k}, Gumbel-max coupling, jacobi)", pixels),
                      ("held-out digits", held[:20, 1:])], args.levels)
    took = time.perf_counter() - start
    print(f"{n_parameters(model)} parameters; held-out {val:.4f} nats/pixel; samples: "
          f"{sol.stats['model_calls']} model passes for {PIXELS} pixels x {len(labels)} "
          f"images, certified: {sol.converged}")
    return report_trained(f"an image model ({args.levels} grey levels) on the digits", hist,
                          [out, png], unit="nats/pixel", seconds=took)
