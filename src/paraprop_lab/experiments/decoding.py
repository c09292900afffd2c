"""Jacobi decoding of a character-level LM against the sequential KV-cached loop and ``generate``,
measured per case; shared by ``paraprop bench decoding`` and the decoding demo part.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from paraprop.decoding import generate  # noqa: E402
from paraprop_lab.experiments.harness import (  # noqa: E402
    interleaved,
    median,
    model_seconds,
)
from paraprop_lab.experiments.plots import save_figure  # noqa: E402

COLUMNS = ["method", "tokens_per_s", "model_calls", "tokens_per_call", "vs_sequential",
           "vs_generate", "model_ms", "ceiling", "same_tokens", "certified"]
# what the two columns of the model's own time mean, for the tables' notes
MODEL_TIME_NOTE = (
    "`model_ms`: the time inside the model's forward passes (their share of the fastest of 2 "
    "runs after the timed ones, by forward hooks, times the method's time); `ceiling`: the "
    "sequential loop's time (of the row's coupling) over it, `vs_sequential` if everything "
    "around the model cost nothing")


PROMPT = 48      # characters per prompt


TEMPERATURE = 0.8


def prompts(vocab, held: torch.Tensor, batch: int) -> torch.Tensor:
    """``batch`` prompts of :data:`PROMPT` characters of prose: held-out lines that start with
    a capital letter and run on for the whole prompt, spread evenly over the held-out text."""
    nl = vocab.index.get("\n")
    capital = torch.tensor([vocab.index[c] for c in vocab.chars if c.isupper()])
    starts = (held[:-PROMPT - 1] == nl).nonzero().flatten() + 1
    starts = starts[torch.isin(held[starts], capital)]
    windows = held[starts[:, None] + torch.arange(PROMPT)]
    starts = starts[~(windows == nl).any(1)]
    pick = starts[torch.linspace(0, len(starts) - 1, batch).long()]
    return torch.stack([held[s : s + PROMPT] for s in pick.tolist()])


SEQUENTIAL = "paraprop sequential (KV cache)"
GUMBEL = " (Gumbel-max coupling)"
PER_SAMPLE = ", per-sample advance"


def case_rows(model, ids, new: int, *, sample: bool, window: int, repeats: int,
              desc: str) -> list[dict]:
    """One row per method. Sampled, each coupling (the inverse CDF, and the Gumbel-max
    coupling's rows, named with :data:`GUMBEL`) is compared with its own sequential loop:
    ``same_tokens`` and ``vs_sequential`` against the loop with the same coupling and seed.
    ``certified``: whether paraprop's run is certified (``converged``; else how many tokens are
    not, which ``throw=False`` reports instead of raising). A batch of more than one sample
    also gets a row of Jacobi with ``batch_advance="per-sample"`` (:data:`PER_SAMPLE`; sampled:
    with the Gumbel-max coupling)."""
    # top_k=0: no top-k, as on the transformers side (generate's default is top_k=50)
    kw = {"do_sample": True, "temperature": TEMPERATURE, "top_k": 0} if sample else {}
    seed = 0

    def ours(**extra):
        def run():      # throw=False: an uncertified token is reported, not raised
            g = torch.Generator().manual_seed(seed) if sample else None
            return generate(model, ids, max_new_tokens=new, generator=g, throw=False, **kw,
                            **extra)
        return run

    def hf():
        hkw = {"do_sample": True, "temperature": TEMPERATURE, "top_k": 0} if sample else \
            {"do_sample": False}
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              pad_token_id=0, **hkw)

    cases = {"transformers generate": hf,
             SEQUENTIAL: ours(method="sequential"),
             f"jacobi (window {window}, n-gram guesses)": ours(window=window),
             f"jacobi (window {window}, no guesses)": ours(window=window, ngram=0)}
    if sample:
        cases.update({SEQUENTIAL + GUMBEL: ours(method="sequential", coupling="gumbel"),
                      f"jacobi (window {window}, n-gram guesses){GUMBEL}":
                          ours(window=window, coupling="gumbel")})
    if ids.shape[0] > 1:
        extra = {"coupling": "gumbel"} if sample else {}
        cases[f"jacobi (window {window}, n-gram guesses{PER_SAMPLE})"
              + (GUMBEL if sample else "")] = ours(window=window, batch_advance="per-sample",
                                                   **extra)
    with torch.no_grad():
        times = interleaved(cases, repeats=repeats, warmup=1, desc=desc)
        inside = model_seconds(model, cases, times, repeats=min(2, repeats))
        refs = {"": cases[SEQUENTIAL]()[0]}
        if sample:
            refs[GUMBEL] = cases[SEQUENTIAL + GUMBEL]()[0]
        hf_tokens = hf()
    gen_t = median(times["transformers generate"])
    rows = []
    for name, run in cases.items():
        t = median(times[name])
        coupling = GUMBEL if name.endswith(GUMBEL) else ""
        ref, seq_t = refs[coupling], median(times[SEQUENTIAL + coupling])
        if name == "transformers generate":
            tokens, calls, per = hf_tokens, new, 1.0
            same = bool(torch.equal(tokens, ref)) if not sample else "n/a (own RNG)"
            certified = "n/a"
        else:
            with torch.no_grad():
                tokens, sol = run()
            calls, per = sol.stats["model_calls"], sol.stats["tokens_per_call"]
            same = bool(torch.equal(tokens, ref))
            unc = len(sol.stats["uncertified"])
            certified = "yes" if sol.converged else f"no ({unc} uncertified)" if unc else "no"
        rows.append({"method": name, "tokens_per_s": ids.shape[0] * new / t,
                     "model_calls": calls, "tokens_per_call": per, "vs_sequential": seq_t / t,
                     "vs_generate": gen_t / t, "model_ms": 1e3 * inside[name],
                     "ceiling": seq_t / inside[name], "same_tokens": same, "certified": certified,
                     "time_s": t})
    return rows


def plot(path: Path, table: dict) -> Path:
    """Tokens per second of each method against the batch size, greedy and sampled."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, mode in zip(axes, ("greedy", "sampled"), strict=True):
        batches = sorted(b for (m, b) in table if m == mode)
        methods = [r["method"] for r in table[(mode, batches[0])]]
        for i, name in enumerate(methods):
            ys = [next(r["tokens_per_s"] for r in table[(mode, b)] if r["method"] == name)
                  for b in batches]
            ax.plot(batches, ys, marker="o", color=f"C{i}", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_yscale("log")
        ax.set_xlabel("batch size (sequences decoded together)")
        ax.set_title(f"{mode} decoding" + (f" (temperature {TEMPERATURE})"
                                            if mode == "sampled" else ""))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("generated tokens per second")
    axes[0].legend(fontsize=7)
    fig.suptitle("Character-level GPT-2-shaped LM, 256 new tokens: throughput by method",
                 fontsize=10)
    return save_figure(fig, path, dpi=110)

