"""A character-level language model shaped like GPT-2 (a ``transformers``
``GPT2LMHeadModel`` built from a config, nothing downloaded), with its vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

from paraprop import checks
from paraprop.data.text import CharVocab

DEFAULTS = {"width": 128, "layers": 4, "heads": 4, "context": 512}


def char_gpt2(vocab_size: int, *, width: int = 128, layers: int = 4, heads: int = 4,
              context: int = 512, seed: int = 0):
    """A randomly initialised ``GPT2LMHeadModel`` with ``layers`` blocks of ``width`` units and
    ``heads`` heads over ``context`` positions (needs ``transformers``)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    checks.positive_int("vocab_size", vocab_size)
    for name, v in (("width", width), ("layers", layers), ("heads", heads),
                    ("context", context)):
        checks.positive_int(name, v)
    if width % heads:
        raise ValueError(f"width must be a multiple of heads={heads}, got width={width}")
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=context, n_embd=width, n_layer=layers,
                     n_head=heads, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def save_charlm(model, vocab: CharVocab, path) -> Path:
    """Save the model (``save_pretrained``) and its vocabulary (``vocab.json``) in the
    directory ``path``."""
    path = Path(path)
    model.save_pretrained(path)
    (path / "vocab.json").write_text(json.dumps({"chars": vocab.chars}))
    return path


def load_charlm(path):
    """``(model, vocab)`` saved by :func:`save_charlm`, the model in eval mode.

    Raises:
        FileNotFoundError: ``path`` is not a saved char LM (named in the message).
    """
    from transformers import GPT2LMHeadModel

    path = Path(path)
    if not (path / "vocab.json").is_file() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a saved char LM (expected config.json and "
                                "vocab.json from paraprop train charlm)")
    vocab = CharVocab(json.loads((path / "vocab.json").read_text())["chars"])
    return GPT2LMHeadModel.from_pretrained(path).eval(), vocab
