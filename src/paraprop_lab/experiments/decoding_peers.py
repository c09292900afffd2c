"""The decoding bench's peer rows: transformers' own n-gram speculation (``model.generate(...,
prompt_lookup_num_tokens=k)``, prompt lookup decoding) against paraprop's Jacobi decoding, greedy,
batch 1, on short prompts and on a long one, each run's tokens checked equal to ``generate``'s.
The bench runs it for each char LM (``paraprop train charlm``: GPT-2-shaped, then
``--arch llama``, Llama-shaped, trained the same way), one table per model, titled with it.

For each prompt: ``generate``; prompt lookup with ``k`` in :data:`LOOKUP` and its n-gram size in
:data:`NGRAM` (the best of them is the peer a user would pick); paraprop's ``jacobi`` (window 16,
its n-gram guesses); and the same through :func:`paraprop.decoding.accelerate` (the user's own
``generate`` call). Wall time is the best of ``repeats``, one thread, measured side by side in one
process. paraprop's rows say whether the run was certified (``accelerate`` serves only a certified
run; an uncertified one falls through to ``generate``, which then computes the call and its time).
"""

from __future__ import annotations

import time
import warnings

import torch

from paraprop import FallThroughWarning
from paraprop.decoding import accelerate, generate

LOOKUP = (3, 5, 10)   # prompt_lookup_num_tokens
NGRAM = (2, 3)        # max_matching_ngram_size
LONG = 248            # characters of the long prompt
COLUMNS = ["prompt", "method", "model passes", "time (ms)", "x generate", "x best lookup",
           "same tokens", "certified"]


def _best(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _calls(model, fn) -> tuple[int, object]:
    """Model forward passes of one call of ``fn`` (a hook on the model's forward)."""
    count = [0]
    handle = model.register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
    try:
        out = fn()
    finally:
        handle.remove()
    return count[0], out


def prompt_rows(model, ids: torch.Tensor, new: int, *, label: str, repeats: int,
                lookups=LOOKUP, ngrams=NGRAM) -> list[dict]:
    """The rows of one prompt ``ids`` ``(1, P)`` (see the module doc)."""
    mask = torch.ones_like(ids)
    plain = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                 pad_token_id=0)
    runs = {"generate": lambda: model.generate(ids, **plain)}
    for k in lookups:
        for n in ngrams:
            runs[f"prompt lookup k={k}, n-gram {n}"] = (
                lambda k=k, n=n: model.generate(ids, **plain, prompt_lookup_num_tokens=k,
                                                max_matching_ngram_size=n))
    certified = {}

    def jacobi():
        out, sol = generate(model, ids, attention_mask=mask, max_new_tokens=new,
                            eos_token_id=[], window=16, throw=False)
        certified["paraprop jacobi (window 16)"] = sol.converged
        return out

    runs["paraprop jacobi (window 16)"] = jacobi

    def accelerated():
        # (an uncertified run falls through to generate, warned once: counted as not served)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallThroughWarning)
            with accelerate(model, window=16) as handle:
                out = model.generate(ids, **plain)
        certified["paraprop accelerate(model), generate's call"] = handle.counters.served == 1
        return out

    runs["paraprop accelerate(model), generate's call"] = accelerated
    rows, times = [], {}
    ref = None
    with torch.no_grad():
        for name, fn in runs.items():
            passes, out = _calls(model, fn)
            seconds, out = _best(fn, repeats)
            if ref is None:
                ref = out
            times[name] = seconds
            rows.append({"prompt": label, "method": name, "model passes": passes,
                         "time (ms)": round(1e3 * seconds, 2),
                         "same tokens": bool(torch.equal(out, ref)),
                         "certified": certified.get(name, "-")})
    lookup = [n for n in times if n.startswith("prompt lookup")]
    best = min(times[n] for n in lookup) if lookup else float("nan")
    for row in rows:
        t = times[row["method"]]
        row["x generate"] = round(times["generate"] / t, 2)
        row["x best lookup"] = round(best / t, 2)
    return rows


def section(model, vocab, held: torch.Tensor, prompts, *, quick: bool, repeats: int,
            model_name: str = "GPT-2-shaped char LM", key: str = "peers"):
    """``(sections, payload)`` of the peer rows of ``model`` (``model_name`` opens the table's
    title; the rows are the payload's ``key``): the short prompts of the bench (``prompts``
    ``(B, P)``, each alone) and a long one of :data:`LONG` characters, ``256`` new tokens
    (``quick``: one short prompt, 32 tokens, ``k=3`` only)."""
    from paraprop_lab.experiments.report import markdown_table, text_table

    new = 32 if quick else 256
    cases = [(f"short {i + 1} ({prompts.shape[1]} chars)", prompts[i:i + 1])
             for i in range(1 if quick else prompts.shape[0])]
    if not quick:
        start = len(held) // 3
        cases.append((f"long ({LONG} chars)", held[start:start + LONG][None]))
    rows = []
    for label, ids in cases:
        rows += prompt_rows(model, ids.long(), new, label=label, repeats=repeats,
                            lookups=(3,) if quick else LOOKUP, ngrams=(2,) if quick else NGRAM)
    title = (f"{model_name}, greedy, batch 1, {new} new tokens: transformers' prompt lookup vs "
             "paraprop (tokens checked equal to generate's)")
    print(f"\n{title}")
    print(text_table(rows, COLUMNS))
    return [(title, markdown_table(rows, COLUMNS))], {key: rows}
