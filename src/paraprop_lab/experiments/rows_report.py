"""Reports of device rows (:mod:`paraprop_lab.experiments.rows`): ``NAME.json``, ``NAME.md`` and one
plot ``NAME.png``, in the format ``paraprop report`` stores (the command, date and machine lines
first, then the tables), so that a GPU run's figures join ``docs/benchmarks.md``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from paraprop_lab.experiments.device import record, resolve
from paraprop_lab.experiments.plots import plt, save_figure
from paraprop_lab.experiments.report import fmt, markdown_table, text_table, write_results
from paraprop_lab.experiments.rows import Context, RowSpec, run_specs

ROW_COLUMNS = ["suite", "name", "shape", "baseline", "baseline_ms", "method", "method_ms",
               "ratio", "unit", "target", "met", "max_dev", "bound", "within"]
CHOICE_COLUMNS = ["suite", "name", "shape", "candidates_ms", "fastest", "auto", "agrees",
                  "auto_vs_fastest"]
MISSING_COLUMNS = ["suite", "name", "status", "reason"]

METHOD = (
    "Each row runs its baseline and the parallel method on the same device, the same weights "
    "and the same inputs, in interleaved rounds (A B A B ...); every timed call starts and ends "
    "with a synchronization of the device, so a time is the wall time of the call as a user "
    "sees it (launch overhead included). Times are medians; `ratio` is the baseline's median "
    "over the method's (or, for the scan, the fraction of the copy bandwidth), from the same "
    "run. `max_dev` is the largest deviation of the method's result from the sequential "
    "result on this device (absolute unless the row's note says relative; token rows count "
    "differing tokens) and `bound` what the method promises (its stopping tolerance; 0: "
    "bitwise). Models are trained in the run, on the device, by the training jobs' own "
    "functions. A row that did not fit the time budget, or failed, is listed with its reason "
    "under 'Not measured'.")


def split(records: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Measured rows, measured choices, and the rows that were skipped or failed."""
    rows = [r for r in records if r["status"] == "ok" and r["kind"] == "row"]
    choices = [r for r in records if r["status"] == "ok" and r["kind"] == "choice"]
    missing = [r for r in records if r["status"] != "ok"]
    return rows, choices, missing


def _choice_cells(c: dict) -> dict:
    return {**c, "candidates_ms": ", ".join(f"{k} {fmt(v)}" for k, v in c["times_ms"].items())}


def tables(records: list[dict]) -> list[tuple[str, str]]:
    """The report's sections: rows, ``auto`` choices, what was not measured, the notes."""
    rows, choices, missing = split(records)
    out = [("Method", METHOD)]
    if rows:
        out.append(("Rows: baseline vs method (times in ms)", markdown_table(rows, ROW_COLUMNS)))
    if choices:
        out.append(("auto choices: the measurements that set them (times in ms)",
                    markdown_table([_choice_cells(c) for c in choices], CHOICE_COLUMNS)))
    if missing:
        out.append(("Not measured", markdown_table(missing, MISSING_COLUMNS)))
    notes = [f"- `{r['suite']}.{r['name']}`: {r['note'].strip()}" for r in [*rows, *choices]
             if r.get("note", "").strip()]
    if notes:
        out.append(("Notes", "\n".join(notes)))
    return out


def plot(path: Path, records: list[dict], title: str) -> Path | None:
    """Each measured row's ratio against its target (log scale; rows without a target in
    grey); ``None`` where no row was measured."""
    rows = [r for r in split(records)[0] if math.isfinite(r["ratio"]) and r["ratio"] > 0]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 0.32 * len(rows) + 1.6))
    ys = range(len(rows))
    colors = ["tab:green" if r["met"] else "tab:red" if r["met"] is False else "tab:grey"
              for r in rows]
    ax.barh(list(ys), [r["ratio"] for r in rows], color=colors)
    for y, r in zip(ys, rows, strict=True):
        if r["target"] is not None:
            ax.plot([r["target"]] * 2, [y - 0.4, y + 0.4], color="k", lw=1.5)
    ax.set_yticks(list(ys), [f"{r['suite']}.{r['name']}" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("ratio: baseline time / method time (scan: fraction of copy bandwidth); "
                  "black tick = target", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    return save_figure(fig, path, dpi=100)


def write(out_dir: Path, name: str, records: list[dict], machine: dict, command: str, *,
          extra: list[tuple[str, str]] = (), payload: dict | None = None) -> dict:
    """Write ``name.json``, ``name.md`` and ``name.png`` (if any row was measured)."""
    title = f"{name}: device rows on {machine.get('device', '?')}"
    png = plot(out_dir / f"{name}.png", records, title)
    sections = tables(records)
    if png is not None:
        sections.insert(2 if len(sections) > 1 else 1, ("Ratios against the targets",
                                                        f"![]({png.name})"))
    full = {"suite": name, "machine": machine, **(payload or {}), "records": records}
    write_results(out_dir, name, full, [*sections[:1], *extra, *sections[1:]], command)
    return full


def device_suite(out_dir: Path, suite: str, specs: list[RowSpec], device: torch.device, *,
                 quick: bool, repeats: int | None) -> dict:
    """``paraprop bench SUITE`` by its device rows (GPU scale, or tiny with ``quick``),
    reported as ``SUITE_DEVICE.json`` / ``.md`` / ``.png`` off the CPU (e.g. ``made_cuda.md``:
    the CPU report of the same suite is not replaced), ``SUITE.*`` on the CPU."""
    out_dir = Path(out_dir)
    ctx = Context(device, "tiny" if quick else "gpu", repeats)
    records = list(run_specs(specs, ctx))
    rows, choices, missing = split(records)
    for heading, recs, cols in (("rows", rows, ["name", "ratio", "target", "met", "max_dev"]),
                                ("auto choices", [_choice_cells(c) for c in choices],
                                 ["name", "fastest", "auto", "candidates_ms"]),
                                ("not measured", missing, MISSING_COLUMNS)):
        if recs:
            print(f"\n{suite} {heading} on {device}:")
            print(text_table(recs, cols))
    cpu = device.type == "cpu"
    cmd = (f"paraprop bench {suite}" + ("" if cpu else f" --device {device.type}")
           + (" --quick" if quick else "") + (f" --repeats {repeats}" if repeats else ""))
    return write(out_dir, suite if cpu else f"{suite}_{device.type}", records, record(device),
                 cmd, payload={"quick": quick, "repeats": repeats})


def with_device_rows(suite: str, specs: list[RowSpec]):
    """The ``run`` of a suite that has a CPU report and device rows ``specs``: decorates the
    suite's CPU run ``cpu_run(out_dir, *, quick, repeats)`` into ``run(out_dir, *, quick=False,
    repeats=None, device=None)``, which measures on the CPU (``device`` ``None`` or ``"cpu"``)
    by ``cpu_run`` and on any other device by the rows (:func:`device_suite`, reported as
    ``SUITE_DEVICE``). The device is checked first (:func:`resolve`: an unknown one, or CUDA
    where torch sees none, is a ``ValueError`` before anything runs)."""
    def decorate(cpu_run):
        def run(out_dir: Path, *, quick: bool = False, repeats: int | None = None,
                device: str | None = None) -> dict:
            dev = resolve(device)
            if dev.type != "cpu":
                return device_suite(Path(out_dir), suite, specs, dev, quick=quick,
                                    repeats=repeats)
            return cpu_run(out_dir, quick=quick, repeats=repeats)
        run.__module__, run.__doc__ = cpu_run.__module__, cpu_run.__doc__
        return run
    return decorate


def cpu_only(suite: str, device, why: str) -> None:
    """The check of a suite without device rows: nothing for the CPU (or ``None``), else a
    ``ValueError`` that names the suite, the device and ``why``.

    Raises:
        ValueError: a device other than the CPU (or one :func:`resolve` refuses).
    """
    dev = resolve(device)
    if dev.type != "cpu":
        raise ValueError(f"paraprop bench {suite} measures on the CPU only, not on {dev}: {why}; "
                         "the GPU rows are those of paraprop bench gpu (make gpu-check)")
