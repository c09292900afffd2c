"""Faults in the native kernel cache: a damaged cached library is rebuilt or ignored, never loaded.

Loading a truncated shared library kills the process with SIGBUS, so every case runs in a fresh
subprocess whose cache directory (``$PARAPROP_CACHE_DIR``) is a copy of one built once per
module, damaged in one way. The subprocess must exit 0, its scan must equal the PyTorch
reference, and ``native.status()`` must say what happened.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paraprop.scan import linear_recurrence, native

# The tests that build the kernels (in subprocesses).
builds = pytest.mark.skipif(native._compiler() is None, reason="no C compiler to build kernels")

# Run in the subprocess: argv = [output file, "break" to make every compilation fail, or "ok"].
SCRIPT = r"""
import json, sys
import torch
from paraprop.scan import linear_recurrence, native

if sys.argv[2] == "break":
    def _no_compiler(cc, args):
        raise RuntimeError("simulated compiler failure")
    native._compile = _no_compiler
status = native.status()
g = torch.Generator().manual_seed(0)
A = 0.5 * torch.randn(2, 40, 4, 4, generator=g, dtype=torch.float64)
a = torch.rand(2, 40, 4, generator=g, dtype=torch.float64)
b = torch.randn(2, 40, 4, generator=g, dtype=torch.float64)
dense = linear_recurrence(A, b, algorithm="sequential")
diag = linear_recurrence(a, b, algorithm="sequential")
torch.save({"A": A, "a": a, "b": b, "dense": dense, "diag": diag}, sys.argv[1])
print(json.dumps({"status": status, "available": native.available()}))
"""


def run_fresh(cache: Path, out: Path, *, break_build: bool = False,
              wait: bool = True) -> dict | subprocess.Popen:
    """Import paraprop in a new interpreter with ``cache`` as its kernel cache, take
    ``native.status()`` and run a dense and a diagonal native-eligible scan; check that it exits
    0 and that both scans equal the non-native reference. Returns the status record (or the
    running process when ``wait`` is False)."""
    env = {**os.environ, "PARAPROP_CACHE_DIR": str(cache)}
    env.pop("PARAPROP_NATIVE", None)
    argv = [sys.executable, "-c", SCRIPT, str(out), "break" if break_build else "ok"]
    if not wait:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    return check_result(proc.returncode, proc.stdout, proc.stderr, out)


def check_result(returncode: int, stdout: str, stderr: str, out: Path) -> dict:
    assert returncode == 0, f"subprocess died with {returncode}: {stderr[-3000:]}"
    res = torch.load(out, weights_only=True)
    ref_dense = linear_recurrence(res["A"], res["b"], algorithm="sequential", native=False)
    ref_diag = linear_recurrence(res["a"], res["b"], algorithm="sequential", native=False)
    torch.testing.assert_close(res["dense"], ref_dense, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(res["diag"], ref_diag, rtol=1e-10, atol=1e-12)
    return json.loads(stdout.strip().splitlines()[-1])


def entry(cache: Path) -> tuple[Path, Path]:
    """The one cached library of ``cache`` and its manifest."""
    libs = sorted(cache.glob("scan_kernels_*.so"))
    assert len(libs) == 1, f"expected one cached library in {cache}, found {libs}"
    return libs[0], libs[0].with_suffix(".json")


def assert_healthy(cache: Path) -> None:
    lib, manifest = entry(cache)
    rec = json.loads(manifest.read_text())
    assert rec["size"] == lib.stat().st_size
    assert native._verify(lib, manifest) is None


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A kernel cache built once, by a fresh process, for every test to copy."""
    cache = tmp_path_factory.mktemp("native-cache")
    rec = run_fresh(cache, tmp_path_factory.mktemp("out") / "r.pt")
    if not rec["status"].startswith("ok"):
        pytest.skip(f"the native kernels do not build here: {rec['status']}")
    assert rec["status"] == "ok" and rec["available"]
    assert_healthy(cache)
    return cache


def truncate(lib: Path, manifest: Path) -> None:
    with open(lib, "r+b") as f:
        f.truncate(lib.stat().st_size // 2)


def corrupt_same_size(lib: Path, manifest: Path) -> None:
    data = bytearray(lib.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(x ^ 0xFF for x in data[mid:mid + 64])
    lib.write_bytes(bytes(data))


def delete_manifest(lib: Path, manifest: Path) -> None:
    manifest.unlink()


def garble_manifest(lib: Path, manifest: Path) -> None:
    manifest.write_bytes(b"\x00\xff{not json" * 10)


def wrong_record(lib: Path, manifest: Path) -> None:
    manifest.write_text(json.dumps({"version": 1, "library": lib.name, "size": "big"}))


def delete_library(lib: Path, manifest: Path) -> None:
    lib.unlink()


DAMAGE = {
    "truncated": (truncate, r"its size is \d+ bytes, its manifest says \d+"),
    "same-size-corrupt": (corrupt_same_size, "its sha256 does not match its manifest"),
    "no-manifest": (delete_manifest, "its manifest is missing"),
    "garbage-manifest": (garble_manifest, "its manifest is not valid JSON"),
    "malformed-manifest": (wrong_record, "its manifest is malformed"),
    "no-library": (delete_library, "the library is missing"),
}


def damaged_copy(built_cache: Path, tmp_path: Path, how: str) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache)
    DAMAGE[how][0](*entry(cache))
    return cache


@pytest.mark.slow
@builds
@pytest.mark.parametrize("how", list(DAMAGE))
def test_damaged_cache_is_rebuilt(built_cache, tmp_path, how):
    cache = damaged_copy(built_cache, tmp_path, how)
    rec = run_fresh(cache, tmp_path / "r.pt")
    assert rec["available"]
    assert rec["status"].startswith("ok (rebuilt the damaged cached scan_kernels_"), rec
    assert re.search(DAMAGE[how][1], rec["status"]), rec["status"]
    assert_healthy(cache)
    if how == "truncated":  # the repaired cache is used as is by the next process
        assert run_fresh(cache, tmp_path / "r2.pt")["status"] == "ok"


@pytest.mark.slow
@builds
@pytest.mark.parametrize("how", ["truncated", "garbage-manifest"])
def test_damaged_cache_that_cannot_be_rebuilt_is_ignored(built_cache, tmp_path, how):
    cache = damaged_copy(built_cache, tmp_path, how)
    rec = run_fresh(cache, tmp_path / "r.pt", break_build=True)  # correct via the fallback
    assert not rec["available"]
    status = rec["status"]
    assert status.startswith("unavailable: the cached kernel library "), status
    assert "is damaged (" in status and "rebuilding it failed (simulated compiler failure)" \
        in status and "it is ignored" in status, status
    # the damaged file was left alone and is still refused by the next (working) process
    assert run_fresh(cache, tmp_path / "r2.pt")["status"].startswith("ok (rebuilt")


@pytest.mark.slow
@builds
def test_concurrent_builders(built_cache, tmp_path):
    """Three processes repairing one truncated cache at once all get correct results, and the
    cache they leave verifies."""
    cache = damaged_copy(built_cache, tmp_path, "truncated")
    outs = [tmp_path / f"r{i}.pt" for i in range(3)]
    procs = [run_fresh(cache, out, wait=False) for out in outs]
    for proc, out in zip(procs, outs, strict=True):
        stdout, stderr = proc.communicate(timeout=300)
        rec = check_result(proc.returncode, stdout, stderr, out)
        assert rec["available"] and rec["status"].startswith("ok"), rec
    assert_healthy(cache)
    assert not list(cache.glob(".build-*")), "a temporary build directory was left behind"


def test_verify_never_raises(tmp_path):
    """The check itself copes with anything in place of the files."""
    lib, manifest = tmp_path / "scan_kernels_x.so", tmp_path / "scan_kernels_x.json"
    assert native._verify(lib, manifest) == "its manifest is missing"
    manifest.mkdir()
    assert native._verify(lib, manifest) == "its manifest is not a regular file"
    manifest.rmdir()
    os.mkfifo(manifest)  # opening a FIFO would block: refused without opening it
    assert native._verify(lib, manifest) == "its manifest is not a regular file"
    manifest.unlink()
    manifest.write_bytes(b"\xff\xfe")
    assert native._verify(lib, manifest) == "its manifest is not valid JSON"
    manifest.write_text("[" * 100_000)
    assert "its manifest is malformed (over" in native._verify(lib, manifest)
    manifest.write_text("[" * 60_000)
    assert native._verify(lib, manifest) in ("its manifest is not valid JSON",
                                             "its manifest is malformed (not a version-1 "
                                             "record of this library)")
    manifest.write_text(json.dumps({"version": 1, "library": "other.so", "size": 3,
                                    "sha256": "00"}))
    assert "its manifest is malformed" in native._verify(lib, manifest)
    manifest.write_text(json.dumps({"version": 1, "library": lib.name, "size": 3,
                                    "sha256": "00"}))
    assert native._verify(lib, manifest) == "the library is missing (its manifest is there)"
    lib.mkdir()
    assert native._verify(lib, manifest) == "the library is not a regular file"
