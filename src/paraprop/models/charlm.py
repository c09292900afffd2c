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
    """Check the config's sizes against the weights' shapes and the vocabulary, before the
    model is built: a config that asks for more than the weights hold is refused by field.

    First the sizes that make big tensors or many modules (vocabulary, positions, width,
    layers) are compared with the weights without building anything; then the model is built
    on the ``meta`` device (no memory) and every tensor of its state dict is compared with the
    safetensors header (:func:`_compare_with_meta`).
    """
    conf = path / "config.json"
    for k in _SIZES:
        v = cfg.get(k)
        if v is None or not checks.is_int(v) or v < 1:
            raise ValueError(f"{conf}: {k} must be a positive int, got {v!r}")
    inner = cfg.get("n_inner")
    if inner is not None and (not checks.is_int(inner) or inner < 1):
        raise ValueError(f"{conf}: n_inner must be null or a positive int, got {inner!r}")
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
    _compare_with_meta(path, cfg, shapes)


def _meta_state(cfg: dict) -> dict:
    """The state dict of ``GPT2LMHeadModel`` built from ``cfg`` on the ``meta`` device (shapes
    only, no memory), its tied entries included."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config.from_dict(cfg))
    return model.state_dict(keep_vars=True)


def _compare_with_meta(path: Path, cfg: dict, shapes: dict) -> None:
    """Every tensor the config makes (built on ``meta``) against the safetensors header: the
    same names (a tied tensor may be saved once, the names transformers ignores on loading may
    be extra) and the same shapes; a difference is refused naming the tensor and the config
    fields that decide it."""
    import re

    from transformers import GPT2LMHeadModel

    conf, weights = path / "config.json", path / "model.safetensors"
    try:
        state = _meta_state(cfg)
    except Exception as e:  # an unknown activation, a field of the wrong type, ...
        first = (str(e).strip().splitlines() or [""])[0][:200]
        unknown = [f"{k}={json.dumps(v)}" for k, v in cfg.items() if isinstance(e, KeyError)
                   and e.args and isinstance(v, str) and v == e.args[0]]
        which = f" ({', '.join(unknown)} is not known to it)" if unknown else ""
        raise ValueError(f"{conf}: transformers cannot build a GPT-2 from it{which} "
                         f"({type(e).__name__}: {first})") from None
    for name, t in state.items():
        got = shapes.get(name)
        if got is None:
            if any(other in shapes and state[other] is t for other in state):
                continue  # tied (lm_head.weight is transformer.wte.weight): saved once
            raise ValueError(f"{weights}: no tensor {name} (shape {list(t.shape)}), which a "
                             f"GPT-2 of {conf.name} has; not the weights of this config")
        if list(t.shape) != list(got):
            want = list(t.shape)
            dims = [i for i in range(max(len(want), len(got)))
                    if i >= len(want) or i >= len(got) or want[i] != got[i]]
            fields = _deciding_fields(cfg, name, dims)
            named = ", ".join(fields) if fields else "the config"
            raise ValueError(f"{conf}: {named} does not match the weights ({name} in "
                             f"{weights.name} has shape {list(got)}, the config makes it "
                             f"{want}); refused before building the model")
    ignored = getattr(GPT2LMHeadModel, "_keys_to_ignore_on_load_unexpected", None) or []
    for name in shapes:
        if name not in state and not any(re.search(p, name) for p in ignored):
            raise ValueError(f"{weights}: holds a tensor {name} (shape {list(shapes[name])}) "
                             f"that a GPT-2 of {conf.name} does not have; not the weights of "
                             "this config")


def _deciding_fields(cfg: dict, name: str, dims: list[int]) -> list[str]:
    """``field=value`` (as in config.json) of the config fields that decide the dimensions
    ``dims`` of the tensor ``name``: each integer or null field is changed in turn (integers
    doubled, null set to 1) and a one-layer model is built on ``meta`` to see whether those
    dimensions change."""
    import re

    probe = re.sub(r"^transformer\.h\.\d+\.", "transformer.h.0.", name)
    base_cfg = dict(cfg, n_layer=1)

    def shape(c: dict) -> list[int] | None:
        try:
            t = _meta_state(c).get(probe)
        except Exception:
            return None
        return None if t is None else list(t.shape)

    base = shape(base_cfg)
    if base is None:
        return []
    found = []
    for k, v in cfg.items():
        if k == "n_layer" or not (v is None or checks.is_int(v)):
            continue
        s = shape(dict(base_cfg, **{k: 1 if v is None else 2 * v}))
        if s is not None and (len(s) != len(base) or any(s[i] != base[i] for i in dims
                                                        if i < len(s))):
            found.append(f"{k}={json.dumps(v)}")
    return found


def load_charlm(path):
    """``(model, vocab)`` saved by :func:`save_charlm`, the model in eval mode.

    Only ``config.json``, ``vocab.json`` and ``model.safetensors`` are read: no pickle-based
    weights (``pytorch_model.bin``; loading them can run code), no remote code, no download.
    The config's sizes are checked against the weights' shapes (read from the safetensors
    header) and the vocabulary before the model is built: the big sizes first without building
    anything, then every tensor of the model built on the ``meta`` device (no memory). So a
    config that asks for an absurd allocation (``vocab_size``, ``n_positions``, ``n_embd``,
    ``n_inner``, ``n_layer``, ...) or weights that miss a tensor of the config are refused by
    field or tensor, never filled with random values.

    Raises:
        FileNotFoundError: ``path`` is not a saved char LM (named in the message).
        ValueError: a file that is not what :func:`save_charlm` writes (not JSON, another
            model type, pickle-based or damaged weights), or a config that does not match the
            weights or the vocabulary; the message names the file and the field.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

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
    model = GPT2LMHeadModel.from_pretrained(path, config=GPT2Config.from_dict(cfg),
                                            use_safetensors=True, local_files_only=True,
                                            trust_remote_code=False)
    return model.eval(), vocab
