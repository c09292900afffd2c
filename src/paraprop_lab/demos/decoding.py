"""Demo part: a character-level LM decoded greedily, by the sequential loop and by Jacobi
decoding, with the same tokens."""

from __future__ import annotations

from pathlib import Path

from paraprop_lab.demos import _weights
from paraprop_lab.demos._common import part_model, part_result
from paraprop_lab.experiments.decoding import COLUMNS, case_rows, prompts
from paraprop_lab.experiments.explain import fewer_passes, pass_cost
from paraprop_lab.experiments.plots import time_bars

ORDER = 20
REQUIRES = ("transformers",)
TITLE = "Jacobi decoding: a language model's own tokens in fewer model passes"
SECONDS = {"quick": 5, "default": 11, "full": 2500}
CAVEAT = ("Caveat: the greedy speedup comes largely from repetitive text (the n-gram guesses "
          "propose what the text already said): a small char LM's greedy text repeats itself, "
          "as the sample shows; sampled text at temperature 0.8, or batch 16, gains little or "
          "loses on this CPU (`paraprop bench decoding`).")


def run(out_dir: Path, *, quick: bool = False, full: bool = False) -> dict:
    from paraprop.decoding import generate
    from paraprop_lab.training.charlm import trained_charlm

    def train():
        model, vocab, info = trained_charlm(out_dir, **({"steps": 20} if quick else {}))
        return (model.requires_grad_(False), vocab), info

    (model, vocab), info, full = part_model("charlm", out_dir, quick=quick, full=full,
                                            train=train)
    what = ("1500 steps, trained here" if full else "20 steps" if quick
            else "2 layers, width 64, shipped checkpoint")
    held = _weights.held_out_text(vocab)  # corpus(vocab)'s held-out ids, without the rest
    new = 32 if quick else 256
    ids = prompts(vocab, held, 1)
    rows = case_rows(model, ids, new, sample=False, window=16, repeats=1 if quick else 3,
                     desc="demo decoding")
    title = f"char LM (GPT-2 shape, {what}), greedy, batch 1, {new} new tokens"
    tokens, _ = generate(model, ids, max_new_tokens=new, throw=False)
    why, headline = explain(rows, window=16)
    plot = time_bars(
        out_dir / "demo_decoding.png", f"Greedy decoding of {new} tokens by a char LM (GPT-2 "
        f"shape, {what}), batch 1: the same tokens, fewer model passes",
        [("", [(r["method"], 1e3 * r["time_s"],
                f"{r['model_calls']} passes, {r['tokens_per_call']:.1f} tokens/pass"
                + (", same tokens" if r["same_tokens"] is True else ""))
               for r in rows])],
        xlabel="wall time for the whole sequence (ms, log scale)")
    return part_result(
        title, rows, COLUMNS, (why + " " + CAVEAT, headline), [plot],
        heading=f"{title}; same_tokens compares with paraprop's sequential KV-cached loop",
        sample=vocab.decode(tokens[0]), model={k: v for k, v in info.items() if k != "loss"})


def explain(rows: list[dict], *, window: int) -> tuple[str, str]:
    """The section's closing sentence and the part's headline, from its rows: Jacobi decoding's
    model passes (a ``window``-token pass each) against the sequential loop's one-token passes."""
    seq = next(r for r in rows if r["method"].startswith("paraprop sequential"))
    jacobi = [r for r in rows if r["method"].startswith("jacobi")]
    winner = max(rows, key=lambda r: r["vs_sequential"])
    m = winner if winner in jacobi else max(jacobi, key=lambda r: r["vs_sequential"])
    same = "the same tokens" if m["same_tokens"] is True else "different tokens"
    why = fewer_passes(
        m["method"], "the sequential loop", speedup=m["vs_sequential"],
        passes=m["model_calls"], steps=seq["model_calls"],
        cost=pass_cost(m["time_s"], m["model_calls"], seq["time_s"], seq["model_calls"]),
        step_word="one-token pass",
        detail=f" (a {window}-token window, {m['tokens_per_call']:.1f} tokens accepted)",
        winner="the sequential loop" if winner is seq else winner["method"],
        winner_speedup=winner["vs_sequential"])
    why = why[:-1] + f", with {same}."
    if winner is not m and m["vs_sequential"] <= 1:
        why += (f" Jacobi decoding wins where a {window}-token pass costs about a one-token pass "
                "(a GPU at batch 1) and where it accepts several tokens a pass (text that "
                "repeats itself).")
    headline = (f"Jacobi {m['tokens_per_call']:.1f} tokens per pass, {m['vs_sequential']:.2f}x "
                f"the sequential loop, {same}")
    return why, headline
