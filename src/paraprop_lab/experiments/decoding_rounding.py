"""How far the logits of a window pass round from the sequential loop's one-token pass: the
measurement behind the decoding certificate's bound ``delta = k * eps * sqrt(layers) *
max|logits|`` (:func:`paraprop.decoding.model_checks.rounding_factor`).

For each model and dtype, each prompt is decoded by a plain KV-cached loop (the prefill of the
prompt, then one-token passes; greedy for half the prompts, sampled at temperature 0.8 for the
others, so that the text is the model's own in that dtype). The same tokens are then fed again in
two other ways, and the logits of every new position compared with the loop's:

- ``window``: the prefill of the prompt, then windows of 16 tokens on the cache (the cache
  entries then come from window passes, as in Jacobi decoding);
- ``prefill``: one pass over the whole sequence.

Reported per model, dtype and way: the largest ratio ``max_v |difference| / (eps * sqrt(layers)
* max_v |logits|)`` (``eps`` of the dtype: for float64 the model's own rounding, before the
float32 scores; ``max|logits|`` of the loop's logits at that position), where (prompt, new
position), the largest ratio per range of new positions (to see whether it grows with the cached
positions), and the largest ratio over ``sqrt(max(1, (P + t) / 256))`` (the bound's growth with
the positions, :data:`paraprop.decoding.model_checks.POSITIONS`).

    OMP_NUM_THREADS=1 python -m paraprop_lab.experiments.decoding_rounding [--prompts 8]
        [--new 256] [--json out.json]

The shipped char LM (``charlm_s2000_l2_w64``) is skipped when its checkpoint is missing.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import torch

from paraprop.decoding.model_checks import POSITIONS

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
WINDOW = 16
BINS = (0, 16, 32, 64, 128, 192, 256)


def _tiny(kind: str, layers: int, width: int, vocab: int = 53, positions: int = 320):
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width,
                                      n_layer=layers, n_head=2)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width,
                                   intermediate_size=3 * width // 2, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=positions)
    return transformers.LlamaForCausalLM(cfg).eval()


def models(which: list[str]):
    """``{name: (model (float32), prompts-maker, layers)}`` for the names in ``which``."""
    out = {}
    for name in which:
        if name == "charlm":
            from paraprop_lab.demos import _weights
            from paraprop_lab.experiments.decoding import prompts

            if _weights.path("charlm") is None:
                print("charlm: the shipped checkpoint is missing; skipped")
                continue
            model, vocab = _weights.load("charlm")
            held = _weights.held_out_text(vocab)
            out[name] = (model, lambda n, held=held, vocab=vocab: prompts(vocab, held, n), 2)
        else:
            kind, layers, width = name.split("-")
            model = _tiny(kind, int(layers[:-1]), int(width[1:]))
            vocab = model.config.vocab_size

            def make(n, vocab=vocab):
                g = torch.Generator().manual_seed(1)
                return torch.randint(3, vocab, (n, 24), generator=g)
            out[name] = (model, make, int(layers[:-1]))
    return out


def _cache(model) -> dict:
    """A fresh dynamic cache, under the keyword ``model``'s forward takes it."""
    from transformers import DynamicCache

    from paraprop.decoding.lm import cache_keyword

    return {cache_keyword(model): DynamicCache(), "use_cache": True}


def loop(model, prompt: torch.Tensor, new: int, sample: bool, seed: int):
    """The KV-cached loop's tokens ``(1, P + new)`` and its logits ``(new, V)`` (float64: exact)."""
    g = torch.Generator().manual_seed(seed)
    cache = _cache(model)
    out = model(prompt, **cache)
    seq, rows = [prompt], []
    for t in range(new):
        logits = out.logits[:, -1].double()
        rows.append(logits[0])
        if sample:
            p = torch.softmax(logits.double() / 0.8, -1)
            tok = torch.multinomial(p, 1, generator=g)
        else:
            tok = logits.argmax(-1, keepdim=True)
        seq.append(tok)
        if t + 1 < new:
            out = model(tok, **cache)
    return torch.cat(seq, 1), torch.stack(rows)


def windows(model, seq: torch.Tensor, P: int, new: int) -> torch.Tensor:
    """The logits ``(new, V)`` of the prefill of the prompt, then windows of :data:`WINDOW`
    tokens on the cache."""
    cache = _cache(model)
    rows = [model(seq[:, :P], **cache).logits[0, -1:]]
    a = P
    while a < P + new - 1:
        b = min(a + WINDOW, P + new - 1)
        rows.append(model(seq[:, a:b], **cache).logits[0])
        a = b
    return torch.cat(rows).double()


def prefill(model, seq: torch.Tensor, P: int, new: int) -> torch.Tensor:
    """The logits ``(new, V)`` of one pass over the whole sequence."""
    return model(seq[:, : P + new - 1]).logits[0, P - 1:].double()


def measure(name: str, model, make, layers: int, dtype: torch.dtype, n_prompts: int,
            new: int) -> list[dict]:
    """One row per way (``window``, ``prefill``): the largest ratio, where, and per bin."""
    m = copy.deepcopy(model).to(dtype)      # the float32 weights stay as they are
    eps = torch.finfo(dtype).eps
    unit = eps * math.sqrt(layers)
    ids = make(n_prompts)
    P = ids.shape[1]
    worst = {w: (0.0, -1, -1) for w in ("window", "prefill")}
    per_bin = {w: [0.0] * (len(BINS) - 1) for w in worst}
    per_sqrt = {w: 0.0 for w in worst}
    with torch.no_grad():
        for i in range(n_prompts):
            seq, ref = loop(m, ids[i : i + 1], new, sample=i % 2 == 1, seed=i)
            scale = ref.abs().amax(-1)
            for way, fn in (("window", windows), ("prefill", prefill)):
                got = fn(m, seq, P, new)
                r = ((got - ref).abs().amax(-1) / (unit * scale)).double()
                t = int(r.argmax())
                if float(r[t]) > worst[way][0]:
                    worst[way] = (float(r[t]), i, t)
                for j in range(len(BINS) - 1):
                    part = r[BINS[j] : BINS[j + 1]]
                    if len(part):
                        per_bin[way][j] = max(per_bin[way][j], float(part.max()))
                pos = torch.arange(new, dtype=torch.float64) + P
                grown = r / torch.sqrt((pos / POSITIONS).clamp(min=1.0))
                per_sqrt[way] = max(per_sqrt[way], float(grown.max()))
    return [{"model": name, "layers": layers, "dtype": str(dtype).removeprefix("torch."),
             "way": way, "prompts": n_prompts, "new": new, "prompt_len": P,
             "max_ratio": worst[way][0], "at_prompt": worst[way][1],
             "at_position": worst[way][2], "max_ratio_position_form": per_sqrt[way],
             "by_position": {f"{BINS[j]}-{BINS[j + 1]}": per_bin[way][j]
                             for j in range(len(BINS) - 1)}} for way in worst]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+",
                    default=["charlm", "gpt2-2l-w32", "llama-2l-w32", "gpt2-6l-w64",
                             "llama-6l-w64"])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    start = time.perf_counter()
    for name, (model, make, layers) in models(args.models).items():
        for d in args.dtypes:
            for row in measure(name, model, make, layers, DTYPES[d], args.prompts, args.new):
                rows.append(row)
                bins = " ".join(f"{v:.2f}" for v in row["by_position"].values())
                print(f"{name:14s} {d:9s} {row['way']:8s} max {row['max_ratio']:6.3f} "
                      f"at prompt {row['at_prompt']} position {row['at_position']:3d}; "
                      f"position form {row['max_ratio_position_form']:.3f}; by position "
                      f"{' '.join(str(b) for b in BINS)}: {bins}", flush=True)
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
