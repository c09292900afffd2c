"""Demo part: a character-level LM decoded greedily, by the sequential loop and by Jacobi
decoding, with the same tokens."""

from __future__ import annotations

from pathlib import Path

from paraprop.experiments.decoding import COLUMNS, case_rows, prompts
from paraprop.experiments.report import markdown_table, text_table

ORDER = 27
TITLE = "Jacobi decoding: a language model's own tokens in fewer model passes"


def run(out_dir: Path, *, quick: bool = False) -> dict:
    from paraprop.decoding import generate
    from paraprop.training.charlm import corpus, trained_charlm

    out_dir.mkdir(parents=True, exist_ok=True)
    model, vocab, info = trained_charlm(out_dir, **({"steps": 20} if quick else {}))
    model.requires_grad_(False)
    _, _, held = corpus(vocab)
    new = 32 if quick else 256
    ids = prompts(vocab, held, 1)
    rows = case_rows(model, ids, new, sample=False, window=16, repeats=1 if quick else 3,
                     desc="demo decoding")
    title = f"char LM (GPT-2 shape), greedy, batch 1, {new} new tokens"
    print(f"{title}; same_tokens compares with paraprop's sequential KV-cached loop")
    print(text_table(rows, COLUMNS))
    seq, jac = rows[1], rows[2]
    cost = (jac["time_s"] / jac["model_calls"]) / (seq["time_s"] / seq["model_calls"])
    why = (f"Jacobi decoding accepted {jac['tokens_per_call']:.1f} tokens per pass and a "
           f"16-token pass costs {cost:.1f} one-token passes here, so it ran at "
           f"{jac['vs_sequential']:.2f}x the sequential loop, with the same tokens" + (
               ": the guesses were good (greedy text repeats itself; n-grams guess it)."
               if jac["vs_sequential"] > 1 else
               ": it pays only when a pass accepts more tokens than it costs."))
    print(why)
    tokens, _ = generate(model, ids, max_new_tokens=new)
    text = vocab.decode(tokens[0])
    print("sample: " + repr(text))
    md = markdown_table(rows, COLUMNS) + "\n\n" + why + "\n\n```\n" + text + "\n```"
    return {"rows": rows, "sections": [(title, md)], "model": {k: v for k, v in info.items()
                                                               if k != "loss"}}
