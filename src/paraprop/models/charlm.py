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


_JSON_MAX_BYTES = 1 << 20
_SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")


def _read_json(path: Path, expected: str):
    """The JSON object in ``path`` (at most 1 MiB); errors name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected {expected})")
    with open(path, "rb") as f:
        raw = f.read(_JSON_MAX_BYTES + 1)
    if len(raw) > _JSON_MAX_BYTES:
        raise ValueError(f"{path}: over {_JSON_MAX_BYTES} bytes, not {expected}")
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise ValueError(f"{path}: not valid JSON (expected {expected})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{path}: holds a JSON {type(rec).__name__}, not {expected}")
    return rec


def _weight_shapes(path: Path) -> dict[str, list[int]]:
    """Names and shapes of the tensors in a safetensors file, read from its header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # SafetensorError and friends: a truncated or foreign file
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: cannot be read as safetensors weights ({reason}); the file "
                         "is truncated or damaged") from None


def _check_sizes(path: Path, cfg: dict, shapes: dict, vocab: CharVocab) -> None:
    """Check the config's sizes against the weights' shapes and the vocabulary, before any
    model is built: a config that asks for more than the weights hold is refused by field."""
    conf = path / "config.json"
    for k in _SIZES:
        v = cfg.get(k)
        if not checks.is_int(v) or v < 1:
            raise ValueError(f"{conf}: {k} must be a positive int, got {v!r}")
    want = {"transformer.wte.weight": ("vocab_size", "n_embd"),
            "transformer.wpe.weight": ("n_positions", "n_embd")}
    for key, fields in want.items():
        if key not in shapes:
            raise ValueError(f"{path / 'model.safetensors'}: no tensor {key}; not the weights of "
                             "a GPT-2 char LM")
        for field, got in zip(fields, shapes[key], strict=False):
            if cfg[field] != got:
                raise ValueError(f"{conf}: {field}={cfg[field]} does not match the weights "
                                 f"({key} in model.safetensors has shape {shapes[key]}); "
                                 "refused before building the model")
    layers = {int(k.split(".")[2]) for k in shapes
              if k.startswith("transformer.h.") and k.split(".")[2].isdigit()}
    if len(layers) != cfg["n_layer"]:
        raise ValueError(f"{conf}: n_layer={cfg['n_layer']} does not match the weights "
                         f"(model.safetensors holds {len(layers)} layers); refused before "
                         "building the model")
    if cfg["n_embd"] % cfg["n_head"]:
        raise ValueError(f"{conf}: n_embd={cfg['n_embd']} is not a multiple of "
                         f"n_head={cfg['n_head']}")
    if len(vocab) != cfg["vocab_size"]:
        raise ValueError(f"{path / 'vocab.json'}: {len(vocab)} characters, but config.json says "
                         f"vocab_size={cfg['vocab_size']}")


def load_charlm(path):
    """``(model, vocab)`` saved by :func:`save_charlm`, the model in eval mode.

    Only ``config.json``, ``vocab.json`` and ``model.safetensors`` are read: no pickle-based
    weights (``pytorch_model.bin``; loading them can run code), no remote code, no download.
    The config's sizes are checked against the weights' shapes (read from the safetensors
    header) and the vocabulary before the model is built, so a config that asks for an absurd
    allocation is refused by field.

    Raises:
        FileNotFoundError: ``path`` is not a saved char LM (named in the message).
        ValueError: a file that is not what :func:`save_charlm` writes (not JSON, another
            model type, pickle-based or damaged weights), or a config that does not match the
            weights or the vocabulary; the message names the file and the field.
    """
    from transformers import GPT2LMHeadModel

    path = Path(path)
    expected = "a saved char LM (config.json, vocab.json and model.safetensors from paraprop " \
        "train charlm)"
    if not (path / "vocab.json").is_file() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a saved char LM (expected config.json and "
                                "vocab.json from paraprop train charlm)")
    rec = _read_json(path / "vocab.json", "the vocabulary of a char LM ({\"chars\": ...})")
    if not isinstance(rec.get("chars"), str):
        raise ValueError(f"{path / 'vocab.json'}: expected {{\"chars\": \"...\"}} (a string "
                         f"of the characters), got keys {sorted(rec)[:5]}")
    try:
        vocab = CharVocab(rec["chars"])
    except ValueError as e:
        raise ValueError(f"{path / 'vocab.json'}: {e}") from None
    cfg = _read_json(path / "config.json", "a GPT-2 config")
    if cfg.get("model_type") != "gpt2":
        raise ValueError(f"{path / 'config.json'}: model_type={cfg.get('model_type')!r}, not "
                         f"'gpt2'; expected {expected}")
    weights = path / "model.safetensors"
    if not weights.is_file():
        pickled = sorted(p.name for p in path.iterdir()
                         if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"))
        why = (f"; {', '.join(pickled)} {'is' if len(pickled) == 1 else 'are'} pickle-based, "
               "which paraprop does not load (loading pickles can run code)") if pickled else ""
        raise FileNotFoundError(f"{weights}: no such file (expected the weights that "
                                f"save_pretrained writes){why}")
    _check_sizes(path, cfg, _weight_shapes(weights), vocab)
    model = GPT2LMHeadModel.from_pretrained(path, use_safetensors=True, local_files_only=True,
                                            trust_remote_code=False)
    return model.eval(), vocab
