"""The scripts in examples/ run end to end at their --smoke size and print their check.

Each runs in a subprocess from the repository root, as a user would run it (the layer-parallel
one under torchrun with 2 gloo processes on localhost; ``--standalone`` lets torchrun pick a
free port), and must exit 0 with its final "OK" line: the script itself asserts that paraprop's
result equals the plain PyTorch / library one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

# script -> (launcher, the pattern its last line must match)
CASES = {
    "flow_sampling.py": ([sys.executable], r"samples bitwise equal to zuko's own sample: OK$"),
    "gru_classifier.py": ([sys.executable], r"gradients equal to torch's within .*: OK$"),
    "layer_parallel_resnet.py": (TORCHRUN, r"first gradients equal to serial on every rank: OK$"),
    "fused_optimizer.py": ([sys.executable], r"parameters and losses bitwise equal: OK$"),
    "para_rnn_bitstreams.py": ([sys.executable],
                               r"gradients equal to autograd through the loop within .*: OK$"),
}


# further runs of a script with options (each also at its --smoke size)
VARIANTS = [("gru_classifier.py", ("--cell", "lstm"))]


def run_example(script: str, *options: str) -> str:
    launcher, _ = CASES[script]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*launcher, str(EXAMPLES / script), "--smoke", *options], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"{script} --smoke {' '.join(options)} exited "
                                  f"{proc.returncode}\nstdout:\n{proc.stdout}\n"
                                  f"stderr:\n{proc.stderr[-4000:]}")
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("script", "options"), [(s, ()) for s in sorted(CASES)] + VARIANTS,
                         ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_example_smoke(script, options):
    out = run_example(script, *options)
    lines = out.strip().splitlines()
    assert lines, f"{script} printed nothing"
    assert re.search(CASES[script][1], lines[-1]), f"{script}: unexpected last line\n{out}"
    if "--cell" in options:  # the run used the cell it was asked for
        cell = options[options.index("--cell") + 1]
        assert re.search(rf"^{cell.upper()}, T=", out, flags=re.M), out


def test_lstm_run_uses_the_lstm_drop_in():
    """``--cell lstm`` swaps torch.nn.LSTM for paraprop.nn.LSTM (the smoke run checks the
    gradients); the README says so."""
    source = (EXAMPLES / "gru_classifier.py").read_text()
    assert re.search(r'"lstm": \(nn\.LSTM, paraprop\.nn\.LSTM\)', source)
    readme = (EXAMPLES / "README.md").read_text()
    assert "--cell lstm" in readme and "paraprop.nn.LSTM" in readme
    assert "no LSTM" not in readme


def test_every_example_is_tested_and_listed():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == set(CASES), "examples/*.py and CASES differ"
    readme = (EXAMPLES / "README.md").read_text()
    for name in scripts:
        assert name in readme, f"{name} is not in examples/README.md"
        doc = (EXAMPLES / name).read_text()
        assert "--smoke" in doc and '"""' in doc.split("\n", 1)[0], \
            f"{name} needs a module docstring and a --smoke option"
