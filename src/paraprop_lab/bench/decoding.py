"""``paraprop bench decoding``: exact Jacobi decoding of a character-level GPT-2-shaped LM
(``paraprop train charlm``: trained here on Python's documentation topics).

For greedy and sampled decoding (temperature 0.8) at batch 1, 4, 8 and 16, 256 new tokens after
prompts cut from held-out text: ``model.generate`` (transformers, with its KV cache),
paraprop's sequential KV-cached loop (the fairer baseline: the same model passes one token at
a time), and Jacobi decoding with and without n-gram guesses. Reported: tokens per second,
model passes, accepted tokens per pass, the speed ratios, and whether the tokens equal the
sequential ones (greedy: ``generate``'s too), and whether the run is certified. Sampled cases
also run the Gumbel-max coupling (``coupling="gumbel"``: its sequential loop and Jacobi with
n-gram guesses), each coupling compared with its own sequential loop. Batches above 1 also run
Jacobi with ``batch_advance="per-sample"`` (greedy; sampled: the Gumbel coupling's).

The image-model section (:mod:`paraprop_lab.experiments.decoding_images`): an autoregressive
image model on the digits (``paraprop train imagelm``), top-k sampling, both couplings, batch 1
and 8, windows 8/16/64: passes, tokens per pass and wall time against its sequential loop, the
same-image check, and a PNG of Jacobi samples above the sequential ones.

The peer rows (:mod:`paraprop_lab.experiments.decoding_peers`): transformers' prompt lookup
decoding (``prompt_lookup_num_tokens`` 3/5/10, n-gram 2/3) against paraprop's Jacobi decoding
and ``accelerate(model)``, greedy, batch 1, the short prompts and a long one: on the GPT-2-shaped
char LM, then on a Llama-shaped one of the same sizes trained the same way (``paraprop train
charlm --arch llama``, trained here when the results folder has none).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from paraprop.decoding import generate  # noqa: E402
from paraprop_lab.experiments import decoding_images, decoding_peers  # noqa: E402
from paraprop_lab.experiments import rows_sampling as _rows
from paraprop_lab.experiments.decoding import (  # noqa: E402
    COLUMNS,
    MODEL_TIME_NOTE,
    case_rows,
    plot,
    prompts,
)
from paraprop_lab.experiments.harness import machine_info  # noqa: E402
from paraprop_lab.experiments.report import markdown_table, text_table, write_results  # noqa: E402
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows
from paraprop_lab.training.charlm import corpus, trained_charlm  # noqa: E402

DESCRIPTION = "Jacobi decoding of a char LM: generate vs sequential KV-cached loop vs Jacobi"

# the headline rows on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("decoding.greedy", _rows.decoding_rows, 60)]


@with_device_rows("decoding", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
    repeats = repeats or (1 if quick else 3)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, vocab, info = trained_charlm(out_dir, **({"steps": 20} if quick else {}))
    model.requires_grad_(False)
    _, _, held = corpus(vocab)
    new = 32 if quick else 256
    window = 16
    payload = {"suite": "decoding", "machine": machine_info(), "repeats": repeats,
               "quick": quick, "model": {k: v for k, v in info.items() if k != "loss"},
               "new_tokens": new, "window": window}
    sections, table = [], {}
    for sample in (False, True):
        mode = "sampled" if sample else "greedy"
        for batch in ((1, 4) if quick else (1, 4, 8, 16)):
            ids = prompts(vocab, held, batch)
            rows = case_rows(model, ids, new, sample=sample, window=window, repeats=repeats,
                             desc=f"{mode} batch {batch}")
            table[(mode, batch)] = rows
            title = f"{mode} decoding, batch {batch}, {new} new tokens"
            print(f"\n{title}")
            print(text_table(rows, COLUMNS))
            # (the first table says what the model-time columns mean)
            note = "" if sections else MODEL_TIME_NOTE + ".\n\n"
            sections.append((title, note + markdown_table(rows, COLUMNS)))
            payload[f"{mode}_b{batch}"] = rows
    png = plot(out_dir / "decoding_throughput.png", table)
    sections.append(("throughput", f"![]({png.name})"))
    ex, _ = generate(model, prompts(vocab, held, 1), max_new_tokens=new, throw=False)
    payload["example"] = vocab.decode(ex[0])
    sections.append(("a greedy sample (prompt, then the generated text)",
                     "```\n" + payload["example"] + "\n```"))
    peer_sections, peer_payload = decoding_peers.section(model, vocab, held,
                                                         prompts(vocab, held, 4), quick=quick,
                                                         repeats=repeats,
                                                         model_name="GPT-2-shaped char LM")
    sections += peer_sections
    payload.update(peer_payload)
    llama, llama_vocab, llama_info = trained_charlm(out_dir, arch="llama",
                                                    **({"steps": 20} if quick else {}))
    llama.requires_grad_(False)
    _, _, llama_held = corpus(llama_vocab)
    payload["model_llama"] = {k: v for k, v in llama_info.items() if k != "loss"}
    peer_sections, peer_payload = decoding_peers.section(
        llama, llama_vocab, llama_held, prompts(llama_vocab, llama_held, 4), quick=quick,
        repeats=repeats, model_name="Llama-shaped char LM", key="peers_llama")
    sections += peer_sections
    payload.update(peer_payload)
    image_sections, image_payload = decoding_images.section(out_dir, quick=quick,
                                                            repeats=repeats)
    sections += image_sections
    payload.update(image_payload)
    write_results(out_dir, "decoding", payload, sections,
                  "paraprop bench decoding" + (" --quick" if quick else ""))
    return payload

