"""``paraprop train charlm``: a character-level language model, GPT-2-shaped
(:func:`~paraprop.models.charlm.char_gpt2`, the default) or Llama-shaped (``--arch llama``,
:func:`~paraprop.models.charlm.char_llama`, the same sizes), on Python's own documentation topics
(:func:`~paraprop.data.text.load_text`), for the decoding benchmark. Needs ``transformers``.

Both are trained the same way (the same data, steps, learning rate and seed): next-character
cross-entropy on random windows of the text (320 characters: the benchmark's
prompt and 256 new tokens fit, so every position embedding it uses is trained), AdamW with a
cosine schedule, a progress bar; the last 5% of the text is held out for the validation loss.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from paraprop import checks
from paraprop.data.text import CharVocab, load_text
from paraprop.models.charlm import DEFAULTS, char_gpt2, char_llama, load_charlm, save_charlm
from paraprop_lab.progress import progress as progress_bar
from paraprop_lab.training._common import check_out_dir, default_path

NAME = "charlm"
HELP = ("train a character-level GPT-2-shaped (or, --arch llama, Llama-shaped) LM on Python's "
        "documentation (needs transformers)")
TRAIN = {"steps": 1500, "batch_size": 8, "length": 320, "lr": 2e-3}
# the shapes: their builders, and the config field of their context (positions)
ARCHS = {"gpt2": char_gpt2, "llama": char_llama}
_CONTEXT = {"gpt2": "n_positions", "llama": "max_position_embeddings"}


def _arch(arch) -> str:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(map(repr, ARCHS))}, got {arch!r}")
    return arch


def context(model) -> tuple[str, int]:
    """``(field, positions)``: the config field of ``model``'s context and its value (GPT-2's
    ``n_positions``, Llama's ``max_position_embeddings``); another model type is refused."""
    kind = getattr(model.config, "model_type", None)
    if kind not in _CONTEXT:
        raise ValueError(f"model: a char LM of model_type {' or '.join(map(repr, _CONTEXT))} "
                         f"expected, got model_type={kind!r}")
    field = _CONTEXT[kind]
    return field, getattr(model.config, field)


def train_charlm(model, ids: torch.Tensor, *, steps: int, batch_size: int = 8,
                 length: int = 320, lr: float = 2e-3, seed: int = 0,
                 progress: bool = True) -> list[float]:
    """Fit ``model`` to the token stream ``ids`` (1-D int64) by next-token cross-entropy on
    ``batch_size`` random windows of ``length`` tokens per step; returns the loss of every step
    (left in eval mode)."""
    checks.positive_int("steps", steps)
    checks.positive_int("batch_size", batch_size)
    checks.positive_int("length", length, minimum=2)
    field, positions = context(model)
    if length > positions:
        raise ValueError(f"length must be at most the model's context {field}={positions}, "
                         f"got length={length}")
    if ids.dim() != 1 or ids.numel() <= length:
        raise ValueError(f"ids must be 1-D and longer than length={length}, got shape "
                         f"{tuple(ids.shape)}")
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    offsets = torch.arange(length + 1)
    history = []
    model.train()
    bar = progress_bar(range(steps), desc="train charlm", unit="steps", disable=not progress)
    for _ in bar:
        start = torch.randint(0, ids.numel() - length - 1, (batch_size,), generator=g)
        batch = ids[start[:, None] + offsets]
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append(loss.item())
        bar.set_postfix({"loss": f"{history[-1]:.3f}"})
    model.eval()
    return history


def validation_loss(model, ids: torch.Tensor, length: int | None = None) -> float:
    """Mean next-token cross-entropy (nats) over consecutive windows of ``length`` tokens of
    ``ids`` (default: the training length, or the model's context if shorter)."""
    length = length or min(TRAIN["length"], context(model)[1] - 1)
    n = (ids.numel() - 1) // length
    x = ids[: n * length + 1]
    with torch.no_grad():
        total = 0.0
        for i in range(0, n, 16):
            rows = torch.stack([x[j * length : (j + 1) * length + 1]
                                for j in range(i, min(n, i + 16))])
            logits = model(rows[:, :-1]).logits
            total += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1),
                reduction="sum"))
    return total / (n * length)


def corpus(vocab: CharVocab | None = None) -> tuple[CharVocab, torch.Tensor, torch.Tensor]:
    """``(vocab, train_ids, held_out_ids)`` of the documentation text."""
    text = load_text()
    vocab = vocab or CharVocab.of(text)
    ids = vocab.encode(text)
    cut = int(len(ids) * 0.95)
    return vocab, ids[:cut], ids[cut:]


def checkpoint_dir(out_dir, *, steps: int, seed: int = 0, arch: str = "gpt2",
                   **model_kw) -> Path:
    """``out_dir/charlm_s{steps}`` (``arch="llama"``: ``out_dir/charlm_llama_s{steps}``), with
    a tag for every setting off its default (e.g. ``charlm_s1500_w64``)."""
    tag = "".join(f"_{k[0]}{v}" for k, v in sorted(model_kw.items()) if v != DEFAULTS[k])
    name = "charlm" if _arch(arch) == "gpt2" else f"charlm_{arch}"
    return Path(out_dir) / f"{name}_s{steps}{'_seed' + str(seed) if seed else ''}{tag}"


def trained_charlm(out_dir, *, arch: str = "gpt2", steps: int | None = None, seed: int = 0,
                   progress: bool = True, **model_kw):
    """``(model, vocab, info)``: the char LM of shape ``arch`` (``"gpt2"``: :func:`char_gpt2`,
    ``"llama"``: :func:`char_llama`) saved in :func:`checkpoint_dir` under ``out_dir``, or one
    trained now (default settings, :data:`TRAIN`, the same for both shapes) and saved there."""
    _arch(arch)
    steps = TRAIN["steps"] if steps is None else steps
    path = checkpoint_dir(out_dir, steps=steps, seed=seed, arch=arch, **model_kw)
    if (path / "vocab.json").is_file():
        model, vocab = load_charlm(path)
        if model.config.model_type != arch:
            raise ValueError(f"{path / 'config.json'}: model_type="
                             f"{model.config.model_type!r}, but the cache of arch={arch!r} "
                             "was asked for; remove the directory to train it again")
        return model, vocab, {"checkpoint": str(path), "trained_now": False}
    vocab, train, held = corpus()
    model = ARCHS[arch](len(vocab), seed=seed, **model_kw)
    hist = train_charlm(model, train, steps=steps, seed=seed, progress=progress,
                        length=min(TRAIN["length"], context(model)[1]))
    save_charlm(model, vocab, path)
    return model, vocab, {"checkpoint": str(path), "trained_now": True, "loss": hist,
                          "validation_loss": validation_loss(model, held)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=list(ARCHS), default="gpt2",
                   help="the model's shape: GPT-2 (default) or Llama, of the same sizes")
    p.add_argument("--steps", type=int, default=TRAIN["steps"])
    p.add_argument("--batch-size", type=int, default=TRAIN["batch_size"])
    p.add_argument("--length", type=int, default=TRAIN["length"], help="characters per window")
    p.add_argument("--lr", type=float, default=TRAIN["lr"])
    p.add_argument("--width", type=int, default=DEFAULTS["width"])
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="directory to save the model and vocab.json in (default: "
                        "results/charlm_s{steps}, --arch llama: "
                        "results/charlm_llama_s{steps}, where the benchmark looks)")
    p.add_argument("--prompt", default="The for statement",
                   help="prompt of the greedy sample printed at the end")


def run(args) -> int:
    start = time.perf_counter()
    out = check_out_dir(default_path(args.out, checkpoint_dir(
        "results", steps=args.steps, seed=args.seed, arch=args.arch, width=args.width,
        layers=args.layers, heads=args.heads)), what="the directory to save the model in")
    vocab, train, held = corpus()
    model = ARCHS[args.arch](len(vocab), width=args.width, layers=args.layers,
                             heads=args.heads, seed=args.seed)
    hist = train_charlm(model, train, steps=args.steps, batch_size=args.batch_size,
                        length=args.length, lr=args.lr, seed=args.seed)
    out = save_charlm(model, vocab, out)
    val = validation_loss(model, held)
    from paraprop.decoding import generate

    tokens, sol = generate(model, vocab.encode(args.prompt)[None], max_new_tokens=120,
                           throw=False)
    params = sum(p.numel() for p in model.parameters())
    shape = "GPT-2" if args.arch == "gpt2" else "Llama"
    print(f"trained a {shape}-shaped char LM ({params} parameters, vocabulary {len(vocab)}) on "
          f"{len(train)} characters for {args.steps} steps: loss {hist[0]:.3f} -> "
          f"{hist[-1]:.3f}, held-out {val:.3f} nats/char, in "
          f"{time.perf_counter() - start:.0f} s; saved {out}")
    note = "" if sol.converged else " (not every token certified: " \
        f"{sol.stats.get('uncertified_cause', sol.message)})"
    print("greedy sample: " + repr(vocab.decode(tokens[0])) + note)
    return 0
