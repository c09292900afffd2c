"""``paraprop bench pararnn``: ParaRNN's diagonal cells, Newton forward vs their sequential loop.

The ParaGRU / ParaLSTM section of ``paraprop bench newton`` (same sizes, same measurement:
:func:`paraprop_lab.bench.newton.para_section`) as a suite of its own, so that the issue's target
row can be measured in a minute rather than inside the half-hour Newton suite, plus the same
cells as jitted JAX ``lax.scan`` peers (:mod:`paraprop_lab.experiments.jax_peers`, when JAX is
installed) on the same inputs.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from paraprop.nn import ParaGRU, ParaLSTM
from paraprop_lab.bench import newton
from paraprop_lab.experiments import rows_recurrent as _rows
from paraprop_lab.experiments.harness import interleaved, machine_info, median
from paraprop_lab.experiments.report import markdown_table, text_table, write_results
from paraprop_lab.experiments.rows import RowSpec
from paraprop_lab.experiments.rows_report import with_device_rows

DESCRIPTION = "ParaGRU / ParaLSTM: Newton forward vs their sequential loop, and JAX lax.scan"

# the headline rows on a GPU (``run(device="cuda")``, ``make gpu-check``)
DEVICE_ROWS = [RowSpec("pararnn.gru", _rows.para_rows("gru"), 75),
               RowSpec("pararnn.lstm", _rows.para_rows("lstm"), 75)]

COLUMNS = ["cell", "T", "hidden", "batch", "rounds", "sequential_ms", "newton_ms", "speedup",
           "newton_iters", "err", "jax_ms", "newton_vs_jax"]


def jax_ms(cell: str, T: int, H: int, B: int, repeats: int) -> float:
    """The cell's JAX peer forward on the inputs :func:`newton.para_section` draws (NaN
    without JAX)."""
    from paraprop_lab.experiments import jax_peers

    if not jax_peers.available():
        return float("nan")
    torch.manual_seed(2000 + H)
    model = {"ParaGRU": ParaGRU, "ParaLSTM": ParaLSTM}[cell](newton.INPUTS, H, batch_first=True)
    x = torch.randn(B, T, newton.INPUTS, generator=torch.Generator().manual_seed(T + 1))
    run = jax_peers.peer(model).runner(x.transpose(0, 1).contiguous())
    return 1e3 * median(interleaved({"jax": run}, repeats=repeats, warmup=1,
                                    desc=f"{cell} JAX")["jax"])


@with_device_rows("pararnn", DEVICE_ROWS)
def run(out_dir: Path, *, quick: bool, repeats: int | None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = newton.QUICK if quick else newton.FULL
    para = newton.para_section(cfg, quick, repeats)
    for row in para["rows"]:
        row["jax_ms"] = jax_ms(row["cell"], row["T"], row["hidden"], row["batch"],
                               repeats or (1 if quick else 3))
        row["newton_vs_jax"] = row["jax_ms"] / row["newton_ms"]
    title = (f"ParaGRU / ParaLSTM forward (T={para['T']}, hidden {para['hidden']}, batch "
             f"{para['batch']}, input {newton.INPUTS}): Newton vs the sequential loop")
    print(f"\n{title}; times in ms")
    print(text_table(para["rows"], COLUMNS))
    goal = newton.para_targets(para)
    took = time.perf_counter() - t0
    note = ("The same module, weights and inputs (N(0, 1)) for both forwards, no graph; "
            "`newton` is `forward=\"newton\"` at the default tolerance, `sequential` the "
            "module's step-by-step loop; `err` is the largest difference of the two outputs; "
            "`jax_ms` the same cell as a jitted JAX lax.scan on the same inputs. Medians of "
            f"interleaved rounds. Suite time {took:.0f} s.")
    sections = [("Method", note), (title, markdown_table(para["rows"], COLUMNS))]
    if goal:
        print("\nIssue targets (2-core CPU):")
        print(text_table(goal, ["target", "measured", "met"]))
        sections.insert(1, ("Targets", markdown_table(goal, ["target", "measured", "met"])))
    payload = {"suite": "pararnn", "machine": machine_info(), "quick": quick,
               "repeats": repeats, **para, "targets": goal, "seconds": took}
    cmd = "paraprop bench pararnn" + (" --quick" if quick else "") + (
        f" --repeats {repeats}" if repeats else "")
    write_results(out_dir, "pararnn", payload, sections, cmd)
    return payload
