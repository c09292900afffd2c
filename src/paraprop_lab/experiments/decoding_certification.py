"""What the decoding certificate's rounding bound costs: how many Jacobi runs are certified
(``converged=True``), how many positions are not, and whether every run gave its sequential
loop's tokens, greedy and sampled (both couplings), on the shipped char LM and on tiny random
models (the rows of decoding.md's tables).

- ``charlm``: the shipped ``charlm_s2000_l2_w64``, float32, 8 held-out prompts of 48 characters,
  one at a time, 256 new tokens, window 16 with n-gram guesses; sampled at temperature 0.8 with
  ``top_k=0`` (as ``paraprop bench decoding``), seed = the prompt's index;
- ``tiny``: random GPT-2, Llama and Qwen2 models (2 layers, width 64, vocabularies of 64 and
  1,000 tokens, 4 seeds: 24 runs per row), 4 left-padded prompts, 48 new tokens; sampled with
  ``top_p=0.9``; in float64, float32, bfloat16 and float16.

    OMP_NUM_THREADS=1 python -m paraprop_lab.experiments.decoding_certification [--only charlm]
"""

from __future__ import annotations

import argparse
import time

import torch

from paraprop.decoding import generate

MODES = {"greedy": {}, "sampled": {"coupling": "inverse_cdf"},
         "sampled, gumbel": {"coupling": "gumbel"}}


def _tally(rows: list[dict], name: str, dtype: str, mode: str, runs: list) -> dict:
    """One table row from ``runs``: ``(out, sol, ref)`` each."""
    positions = sum(sol.stats["new_tokens"] * out.shape[0] for out, sol, _ in runs)
    unc = sum(len(sol.stats["uncertified"]) for _, sol, _ in runs)
    bad = sum(bool(sol.converged and not torch.equal(out, ref)) for out, sol, ref in runs)
    row = {"model": name, "dtype": dtype, "decoding": mode, "runs": len(runs),
           "certified": sum(bool(sol.converged) for _, sol, _ in runs),
           "same_tokens": sum(bool(torch.equal(out, ref)) for out, _, ref in runs),
           "uncertified_pct": 100.0 * unc / max(positions, 1),
           "certified_but_different": bad,
           "repeat_ratio": max(sol.stats["repeat_ratio"] for _, sol, _ in runs),
           "tokens_per_call": sum(sol.stats["tokens_per_call"] for _, sol, _ in runs)
           / len(runs)}
    rows.append(row)
    print(f"{name:8s} {dtype:9s} {mode:16s} certified {row['certified']:2d}/{len(runs)}, "
          f"same tokens {row['same_tokens']:2d}/{len(runs)}, uncertified "
          f"{row['uncertified_pct']:.3g} %, certified but different {bad}, repeat ratio "
          f"{row['repeat_ratio']:.3g}, tokens/pass {row['tokens_per_call']:.2f}", flush=True)
    return row


def _pair(model, ids, kw, seed: int | None):
    def g():
        return None if seed is None else torch.Generator().manual_seed(seed)
    seq = {k: v for k, v in kw.items() if k != "window"}
    ref, _ = generate(model, ids, method="sequential", generator=g(), **seq)
    out, sol = generate(model, ids, throw=False, generator=g(), **kw)
    return out, sol, ref


def charlm(rows: list[dict], prompts: int = 8, new: int = 256) -> None:
    from paraprop_lab.demos import _weights
    from paraprop_lab.experiments.decoding import TEMPERATURE
    from paraprop_lab.experiments.decoding import prompts as make_prompts

    if _weights.path("charlm") is None:
        print("charlm: the shipped checkpoint is missing; skipped")
        return
    model, vocab = _weights.load("charlm")
    ids = make_prompts(vocab, _weights.held_out_text(vocab), prompts)
    for mode, extra in MODES.items():
        sample = mode != "greedy"
        kw = {"max_new_tokens": new, "window": 16, **extra}
        if sample:
            kw.update(do_sample=True, temperature=TEMPERATURE, top_k=0)
        runs = [_pair(model, ids[i : i + 1], kw, i if sample else None)
                for i in range(prompts)]
        _tally(rows, "charlm", "float32", mode, runs)


def _tiny(kind: str, vocab: int, seed: int):
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_positions=96, n_embd=64, n_layer=2, n_head=4, **common)).eval()
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    cfg = cls[0](hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                 **common)
    return cls[1](cfg).eval()


def tiny(rows: list[dict], dtypes: list[str], new: int = 48) -> None:
    for d in dtypes:
        dtype = getattr(torch, d)
        for mode, extra in MODES.items():
            sample = mode != "greedy"
            kw = {"max_new_tokens": new, "eos_token_id": [], **extra}
            if sample:
                kw.update(do_sample=True, top_p=0.9)
            runs = []
            for kind in ("gpt2", "llama", "qwen2"):
                for vocab in (64, 1000):
                    for seed in range(4):
                        model = _tiny(kind, vocab, seed).to(dtype)
                        g = torch.Generator().manual_seed(100 + seed)
                        ids = torch.randint(3, vocab, (4, 8), generator=g)
                        mask = torch.ones_like(ids)
                        mask[1, :4] = 0
                        mask[2, :1] = 0
                        ids = ids.masked_fill(mask == 0, 0)
                        runs.append(_pair(model, ids, {**kw, "attention_mask": mask},
                                          seed if sample else None))
            _tally(rows, "tiny", d, mode, runs)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["charlm", "tiny"], default=None)
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows: list[dict] = []
    start = time.perf_counter()
    with torch.no_grad():
        if args.only in (None, "charlm"):
            charlm(rows)
        if args.only in (None, "tiny"):
            tiny(rows, args.dtypes)
    print(f"({time.perf_counter() - start:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
