"""Character-level language models shaped like GPT-2 (``transformers``' ``GPT2LMHeadModel``)
or like Llama (``LlamaForCausalLM``), built from a config (nothing downloaded), with their
vocabulary; saved and loaded with the config checked against the weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from paraprop import checks
from paraprop.data.text import CharVocab

DEFAULTS = {"width": 128, "layers": 4, "heads": 4, "context": 512}


def _check_sizes_asked(vocab_size, width, layers, heads, context) -> None:
    checks.positive_int("vocab_size", vocab_size)
    for name, v in (("width", width), ("layers", layers), ("heads", heads),
                    ("context", context)):
        checks.positive_int(name, v)
    if width % heads:
        raise ValueError(f"width must be a multiple of heads={heads}, got width={width}")


def char_gpt2(vocab_size: int, *, width: int = 128, layers: int = 4, heads: int = 4,
              context: int = 512, seed: int = 0):
    """A randomly initialised ``GPT2LMHeadModel`` with ``layers`` blocks of ``width`` units and
    ``heads`` heads over ``context`` positions (needs ``transformers``)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    _check_sizes_asked(vocab_size, width, layers, heads, context)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=context, n_embd=width, n_layer=layers,
                     n_head=heads, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def char_llama(vocab_size: int, *, width: int = 128, layers: int = 4, heads: int = 4,
               context: int = 512, seed: int = 0):
    """A randomly initialised ``LlamaForCausalLM`` sized like :func:`char_gpt2`: ``layers``
    blocks of ``width`` units, ``heads`` attention heads (as many key/value heads: no grouped
    queries), ``context`` positions (``max_position_embeddings``; rotary positions have no
    weights), the output layer tied to the embedding as in GPT-2, no dropout (needs
    ``transformers``).

    The MLP is ``4 * width`` wide, GPT-2's width, not Llama's usual 8/3 rule: the two char LMs
    then have comparable sizes (the gated MLP has three matrices, so this one has about 1.2x
    the parameters of the GPT-2 of the same sizes, which has position embeddings and biases
    instead)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _check_sizes_asked(vocab_size, width, layers, heads, context)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=context,
                      tie_word_embeddings=True, attention_dropout=0.0, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg)


def save_charlm(model, vocab: CharVocab, path) -> Path:
    """Save the model (``save_pretrained``) and its vocabulary (``vocab.json``) in the
    directory ``path``."""
    path = Path(path)
    model.save_pretrained(path)
    (path / "vocab.json").write_text(json.dumps({"chars": vocab.chars}))
    return path


_JSON_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class _Arch:
    """What :func:`load_charlm` checks of one ``model_type`` before building the model."""

    label: str                       # in messages: "a GPT-2 of config.json"
    config: str                      # the transformers classes (looked up when used)
    model: str
    sizes: tuple[str, ...]           # config fields that must be positive ints
    optional: tuple[str, ...]        # null or a positive int
    embeddings: dict[str, tuple[str, ...]]  # tensor -> the config fields of its dimensions
    blocks: str                      # the blocks' tensor names: f"{blocks}{i}.<...>"
    layers: str                      # the config field of the number of blocks,
    width: str                       # of the width,
    heads: str                       # of the attention heads,
    kv_heads: str | None = None      # of the key/value heads (None: as many as heads)


_ARCHS = {
    "gpt2": _Arch(label="GPT-2", config="GPT2Config", model="GPT2LMHeadModel",
                  sizes=("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"),
                  optional=("n_inner",),
                  embeddings={"transformer.wte.weight": ("vocab_size", "n_embd"),
                              "transformer.wpe.weight": ("n_positions", "n_embd")},
                  blocks="transformer.h.", layers="n_layer", width="n_embd", heads="n_head"),
    "llama": _Arch(label="Llama", config="LlamaConfig", model="LlamaForCausalLM",
                   sizes=("vocab_size", "hidden_size", "num_hidden_layers",
                          "num_attention_heads", "num_key_value_heads", "intermediate_size",
                          "max_position_embeddings"),
                   optional=("head_dim",),
                   embeddings={"model.embed_tokens.weight": ("vocab_size", "hidden_size")},
                   blocks="model.layers.", layers="num_hidden_layers", width="hidden_size",
                   heads="num_attention_heads", kv_heads="num_key_value_heads"),
}


def _classes(arch: _Arch):
    """``(config class, model class)`` of ``arch`` from ``transformers``."""
    import transformers

    return getattr(transformers, arch.config), getattr(transformers, arch.model)


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




def _check_sizes(path: Path, cfg: dict, shapes: dict, vocab: CharVocab, arch: _Arch) -> None:
    """Check the config's sizes against the weights' shapes and the vocabulary, before the
    model is built: a config that asks for more than the weights hold is refused by field.

    First the sizes that make big tensors or many modules (vocabulary, positions, width,
    layers) are compared with the weights without building anything; then the model is built
    on the ``meta`` device (no memory) and every tensor of its state dict is compared with the
    safetensors header (:func:`_compare_with_meta`).
    """
    conf = path / "config.json"
    for k in arch.sizes:
        v = cfg.get(k)
        if v is None or not checks.is_int(v) or v < 1:
            raise ValueError(f"{conf}: {k} must be a positive int, got {v!r}")
    for k in arch.optional:
        v = cfg.get(k)
        if v is not None and (not checks.is_int(v) or v < 1):
            raise ValueError(f"{conf}: {k} must be null or a positive int, got {v!r}")
    for key, fields in arch.embeddings.items():
        if key not in shapes:
            raise ValueError(f"{path / 'model.safetensors'}: no tensor {key}; not the weights of "
                             f"a {arch.label} char LM")
        for field, got in zip(fields, shapes[key], strict=False):
            if cfg[field] != got:
                raise ValueError(f"{conf}: {field}={cfg[field]} does not match the weights "
                                 f"({key} in model.safetensors has shape {shapes[key]}); "
                                 "refused before building the model")
    layers = {int(i) for i in (k[len(arch.blocks):].split(".")[0] for k in shapes
                               if k.startswith(arch.blocks)) if i.isdecimal()}
    if len(layers) != cfg[arch.layers]:
        raise ValueError(f"{conf}: {arch.layers}={cfg[arch.layers]} does not match the weights "
                         f"(model.safetensors holds {len(layers)} layers); refused before "
                         "building the model")
    if cfg[arch.width] % cfg[arch.heads]:
        raise ValueError(f"{conf}: {arch.width}={cfg[arch.width]} is not a multiple of "
                         f"{arch.heads}={cfg[arch.heads]}")
    if arch.kv_heads is not None and cfg[arch.heads] % cfg[arch.kv_heads]:
        raise ValueError(f"{conf}: {arch.heads}={cfg[arch.heads]} is not a multiple of "
                         f"{arch.kv_heads}={cfg[arch.kv_heads]}")
    if len(vocab) != cfg["vocab_size"]:
        raise ValueError(f"{path / 'vocab.json'}: {len(vocab)} characters, but config.json says "
                         f"vocab_size={cfg['vocab_size']}")
    _compare_with_meta(path, cfg, shapes, arch)


def _meta_state(cfg: dict, arch: _Arch) -> dict:
    """The state dict of ``arch``'s model built from ``cfg`` on the ``meta`` device (shapes
    only, no memory), its tied entries included."""
    import torch

    config_cls, model_cls = _classes(arch)
    with torch.device("meta"):
        model = model_cls(config_cls.from_dict(cfg))
    return model.state_dict(keep_vars=True)


def _compare_with_meta(path: Path, cfg: dict, shapes: dict, arch: _Arch) -> None:
    """Every tensor the config makes (built on ``meta``) against the safetensors header: the
    same names (a tied tensor may be saved once, the names transformers ignores on loading may
    be extra) and the same shapes; a difference is refused naming the tensor and the config
    fields that decide it."""
    import re

    conf, weights = path / "config.json", path / "model.safetensors"
    try:
        state = _meta_state(cfg, arch)
    except Exception as e:  # an unknown activation, a field of the wrong type, ...
        first = (str(e).strip().splitlines() or [""])[0][:200]
        unknown = [f"{k}={json.dumps(v)}" for k, v in cfg.items() if isinstance(e, KeyError)
                   and e.args and isinstance(v, str) and v == e.args[0]]
        which = f" ({', '.join(unknown)} is not known to it)" if unknown else ""
        raise ValueError(f"{conf}: transformers cannot build a {arch.label} from it{which} "
                         f"({type(e).__name__}: {first})") from None
    for name, t in state.items():
        got = shapes.get(name)
        if got is None:
            if any(other in shapes and state[other] is t for other in state):
                continue  # tied (lm_head.weight is the token embedding): saved once
            raise ValueError(f"{weights}: no tensor {name} (shape {list(t.shape)}), which a "
                             f"{arch.label} of {conf.name} has; not the weights of this config")
        if list(t.shape) != list(got):
            want = list(t.shape)
            dims = [i for i in range(max(len(want), len(got)))
                    if i >= len(want) or i >= len(got) or want[i] != got[i]]
            fields = _deciding_fields(cfg, name, dims, arch)
            named = ", ".join(fields) if fields else "the config"
            raise ValueError(f"{conf}: {named} does not match the weights ({name} in "
                             f"{weights.name} has shape {list(got)}, the config makes it "
                             f"{want}); refused before building the model")
    ignored = getattr(_classes(arch)[1], "_keys_to_ignore_on_load_unexpected", None) or []
    for name in shapes:
        if name not in state and not any(re.search(p, name) for p in ignored):
            raise ValueError(f"{weights}: holds a tensor {name} (shape {list(shapes[name])}) "
                             f"that a {arch.label} of {conf.name} does not have; not the weights "
                             "of this config")


def _deciding_fields(cfg: dict, name: str, dims: list[int], arch: _Arch) -> list[str]:
    """``field=value`` (as in config.json) of the config fields that decide the dimensions
    ``dims`` of the tensor ``name``: each integer or null field is changed in turn (integers
    doubled, null set to 1) and a one-layer model is built on ``meta`` to see whether those
    dimensions change."""
    import re

    probe = re.sub(rf"^{re.escape(arch.blocks)}\d+\.", f"{arch.blocks}0.", name)
    base_cfg = dict(cfg, **{arch.layers: 1})

    def shape(c: dict) -> list[int] | None:
        try:
            t = _meta_state(c, arch).get(probe)
        except Exception:
            return None
        return None if t is None else list(t.shape)

    base = shape(base_cfg)
    if base is None:
        return []
    found = []
    for k, v in cfg.items():
        if k == arch.layers or not (v is None or checks.is_int(v)):
            continue
        s = shape(dict(base_cfg, **{k: 1 if v is None else 2 * v}))
        if s is not None and (len(s) != len(base) or any(s[i] != base[i] for i in dims
                                                        if i < len(s))):
            found.append(f"{k}={json.dumps(v)}")
    return found


def load_charlm(path):
    """``(model, vocab)`` saved by :func:`save_charlm`, the model in eval mode: a GPT-2-shaped
    char LM (``model_type`` ``"gpt2"`` in ``config.json``, :func:`char_gpt2`) or a
    Llama-shaped one (``"llama"``, :func:`char_llama`); another model type is refused.

    Only ``config.json``, ``vocab.json`` and ``model.safetensors`` are read: no pickle-based
    weights (``pytorch_model.bin``; loading them can run code), no remote code, no download.
    The config's sizes are checked against the weights' shapes (read from the safetensors
    header) and the vocabulary before the model is built: the big sizes first without building
    anything (the token embedding's shape, GPT-2's position embedding, the number of blocks),
    then every tensor of the model built on the ``meta`` device (no memory). So a config that
    asks for an absurd allocation (``vocab_size``, ``n_positions``, ``n_embd``, ``n_inner``,
    ``n_layer``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ...) or weights
    that miss a tensor of the config are refused by field or tensor, never filled with random
    values. (A Llama's ``max_position_embeddings`` makes no tensor, rotary positions have no
    weights: it is checked as a positive int only.)

    Raises:
        FileNotFoundError: ``path`` is not a saved char LM (named in the message).
        ValueError: a file that is not what :func:`save_charlm` writes (not JSON, another
            model type, pickle-based or damaged weights), or a config that does not match the
            weights or the vocabulary; the message names the file and the field.
    """
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
    cfg = _read_json(path / "config.json", "a GPT-2 or Llama config")
    arch = _ARCHS.get(cfg.get("model_type"))
    if arch is None:
        supported = " or ".join(repr(k) for k in _ARCHS)
        raise ValueError(f"{path / 'config.json'}: model_type={cfg.get('model_type')!r}, not "
                         f"{supported} (the model types a char LM can have); expected "
                         f"{expected}")
    weights = path / "model.safetensors"
    if not weights.is_file():
        pickled = sorted(p.name for p in path.iterdir()
                         if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"))
        why = (f"; {', '.join(pickled)} {'is' if len(pickled) == 1 else 'are'} pickle-based, "
               "which paraprop does not load (loading pickles can run code)") if pickled else ""
        raise FileNotFoundError(f"{weights}: no such file (expected the weights that "
                                f"save_pretrained writes){why}")
    _check_sizes(path, cfg, _weight_shapes(weights), vocab, arch)
    config_cls, model_cls = _classes(arch)
    model = model_cls.from_pretrained(path, config=config_cls.from_dict(cfg),
                                      use_safetensors=True, local_files_only=True,
                                      trust_remote_code=False)
    return model.eval(), vocab
