"""Faults in the native kernel cache: a damaged cached library is rebuilt or ignored, never loaded.

The kernels are compiled once for the module (:func:`built_cache`); every case copies that
cache, damages it in one way, and every build the case triggers copies the module's library
instead of running the compiler (``native_build._compile`` replaced). The decisions are taken
in this process through ``native_build.status()`` with the module's globals reset as a fresh
import has them (:func:`fresh`). Loading a truncated shared library kills the process with
SIGBUS, so here the loader (``native_build._open``) is guarded: it only ever receives the bytes
of the module's build, and anything else is recorded and refused (the case then fails) instead
of being mapped. The concurrent builders run as real processes (a scan in each, checked against
the PyTorch reference), repairing one truncated cache at once.
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

from paraprop.scan import linear_recurrence, native_build, native_cache

# Run in the subprocess: argv = [output file, barrier directory, number of processes]. Every
# "compilation" copies $PARAPROP_TEST_PREBUILT, once all the processes have reached it (each
# leaves a file in the barrier directory and waits for the others, 60 s at most), so that their
# builds overlap.
SCRIPT = r"""
import json, os, sys, time
import torch
from paraprop.scan import linear_recurrence, native_build

with open(os.environ["PARAPROP_TEST_PREBUILT"], "rb") as f:
    prebuilt = f.read()
barrier, n = sys.argv[2], int(sys.argv[3])
def _copy(cc, args):
    if any(a.startswith("-D") for a in args):
        raise RuntimeError("only the generic kernels are prebuilt")
    open(os.path.join(barrier, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(barrier)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(args[args.index("-o") + 1], "wb") as f:
        f.write(prebuilt)
native_build._compile = _copy
status = native_build.status()
g = torch.Generator().manual_seed(0)
A = 0.5 * torch.randn(2, 40, 4, 4, generator=g, dtype=torch.float64)
a = torch.rand(2, 40, 4, generator=g, dtype=torch.float64)
b = torch.randn(2, 40, 4, generator=g, dtype=torch.float64)
method = "native" if native_build.available() else "sequential"
dense = linear_recurrence(A, b, method=method)
diag = linear_recurrence(a, b, method=method)
torch.save({"A": A, "a": a, "b": b, "dense": dense, "diag": diag}, sys.argv[1])
print(json.dumps({"status": status, "available": native_build.available()}))
"""


def check_scans(A, a, b, dense, diag) -> None:
    ref_dense = linear_recurrence(A, b, method="sequential")
    ref_diag = linear_recurrence(a, b, method="sequential")
    torch.testing.assert_close(dense, ref_dense, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(diag, ref_diag, rtol=1e-10, atol=1e-12)


def check_result(returncode: int, stdout: str, stderr: str, out: Path) -> dict:
    assert returncode == 0, f"subprocess died with {returncode}: {stderr[-3000:]}"
    res = torch.load(out, weights_only=True)
    check_scans(res["A"], res["a"], res["b"], res["dense"], res["diag"])
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
    assert native_cache.verify(lib, manifest) is None


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A kernel cache holding the generic library, compiled once for the module with the real
    compiler, flags and sources (``native_build._compile_into``), for every case to copy."""
    cc = native_build._compiler()
    if cc is None:
        pytest.skip("no C compiler to build kernels")
    cache = tmp_path_factory.mktemp("native-cache")
    os.chmod(cache, 0o700)
    key, flags = native_build._key(cc)
    target = cache / f"scan_kernels_{key}.so"
    native_build._compile_into(cc, flags, target, target.with_suffix(".json"))
    assert_healthy(cache)
    return cache


def reset(monkeypatch) -> None:
    """Put ``native``'s globals as a fresh import has them (restored after the test; the
    descriptors of libraries loaded meanwhile stay open, as the module keeps them)."""
    for name, value in (("_lib", None), ("_status", "not built yet"), ("_special", {}),
                        ("_notes", []), ("_where", None), ("_private", None), ("_fds", [])):
        monkeypatch.setattr(native_build, name, value)


class Fresh:
    """``native`` as a fresh process sees it, in this process (see :func:`fresh`)."""

    def __init__(self, monkeypatch, good: bytes):
        self.monkeypatch, self.good, self.refused = monkeypatch, good, []

    def compile(self, cc, args) -> None:
        """Stand-in for ``native_build._compile``: writes the module's build."""
        if any(a.startswith("-D") for a in args):
            raise RuntimeError("only the generic kernels are prebuilt")
        Path(args[args.index("-o") + 1]).write_bytes(self.good)

    def open(self, target, fd):
        """Guard of ``native_build._open``: only the module's build reaches the dynamic loader."""
        if os.pread(fd, len(self.good) + 1, 0) != self.good:
            self.refused.append(str(target))
            os.close(fd)
            raise OSError(f"the test's guard refused to load {target}: not the module's build")
        return self.real_open(target, fd)

    def run(self, cache: Path) -> dict:
        """``native_build.status()`` with ``cache`` as the kernel cache, a dense and a diagonal scan
        (native when the kernels load) checked against the PyTorch reference; nothing but the
        module's build was offered to the loader."""
        self.monkeypatch.setenv("PARAPROP_CACHE_DIR", str(cache))
        status = native_build.status()
        g = torch.Generator().manual_seed(0)
        A = 0.5 * torch.randn(2, 40, 4, 4, generator=g, dtype=torch.float64)
        a = torch.rand(2, 40, 4, generator=g, dtype=torch.float64)
        b = torch.randn(2, 40, 4, generator=g, dtype=torch.float64)
        method = "native" if native_build.available() else "sequential"
        check_scans(A, a, b, linear_recurrence(A, b, method=method),
                    linear_recurrence(a, b, method=method))
        assert not self.refused, f"a file other than a fresh build reached the loader: " \
                                 f"{self.refused}"
        return {"status": status, "available": native_build.available()}

    def restart(self) -> None:
        """As if the next process started."""
        reset(self.monkeypatch)


@pytest.fixture
def fresh(monkeypatch, built_cache) -> Fresh:
    """``native`` with its globals reset, the compiler replaced by a copy of the module's build
    and the loader guarded (:class:`Fresh`)."""
    f = Fresh(monkeypatch, entry(built_cache)[0].read_bytes())
    f.real_open = native_build._open
    reset(monkeypatch)
    monkeypatch.setattr(native_build, "_compile", f.compile)
    monkeypatch.setattr(native_build, "_open", f.open)
    monkeypatch.delenv("PARAPROP_NATIVE", raising=False)
    return f


def test_control_a_copy_of_the_module_cache_is_used_as_is(fresh, built_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache)
    lib = entry(cache)[0]
    mtime = lib.stat().st_mtime_ns
    assert fresh.run(cache) == {"status": "ok", "available": True}
    assert lib.stat().st_mtime_ns == mtime and native_build._where == cache


def test_control_the_guard_refuses_other_bytes(fresh, built_cache, tmp_path):
    """The guard is a real witness: a library that passes the check but is not the module's
    build (here: its manifest rewritten to match damaged bytes) is caught at the loader."""
    cache = damaged_copy(built_cache, tmp_path, "same-size-corrupt")
    lib, manifest = entry(cache)
    size, sha = native_cache.digest(lib)
    manifest.write_text(json.dumps({"version": 1, "library": lib.name, "size": size,
                                    "sha256": sha}))
    with pytest.raises(AssertionError, match="a file other than a fresh build reached the "
                                             "loader"):
        fresh.run(cache)


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


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damaged_cache_is_rebuilt(fresh, built_cache, tmp_path, how):
    cache = damaged_copy(built_cache, tmp_path, how)
    rec = fresh.run(cache)
    assert rec["available"]
    assert rec["status"].startswith("ok (rebuilt the damaged cached scan_kernels_"), rec
    assert re.search(DAMAGE[how][1], rec["status"]), rec["status"]
    assert_healthy(cache)
    fresh.restart()  # the repaired cache is used as is by the next process
    assert fresh.run(cache)["status"] == "ok"


@pytest.mark.parametrize("how", ["truncated", "garbage-manifest"])
def test_damaged_cache_that_cannot_be_rebuilt_is_ignored(fresh, built_cache, tmp_path,
                                                         monkeypatch, how):
    cache = damaged_copy(built_cache, tmp_path, how)
    before = {p.name: p.read_bytes() for p in cache.iterdir()}

    def no_compiler(cc, args):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(native_build, "_compile", no_compiler)
    rec = fresh.run(cache)  # correct via the fallback
    assert not rec["available"]
    status = rec["status"]
    assert status.startswith("unavailable: the cached kernel library "), status
    assert "is damaged (" in status and "rebuilding it failed (simulated compiler failure)" \
        in status and "it is ignored" in status, status
    assert {p.name: p.read_bytes() for p in cache.iterdir()} == before  # left alone
    # and still refused by the next (working) process
    fresh.restart()
    monkeypatch.setattr(native_build, "_compile", fresh.compile)
    assert fresh.run(cache)["status"].startswith("ok (rebuilt")


@pytest.mark.slow
def test_concurrent_builders(built_cache, tmp_path):
    """Two processes repairing one truncated cache at the same time (their builds held until
    both are in one) both get correct results from the real loader, and the cache they leave
    verifies."""
    cache = damaged_copy(built_cache, tmp_path, "truncated")
    env = {**os.environ, "PARAPROP_CACHE_DIR": str(cache),
           "PARAPROP_TEST_PREBUILT": str(entry(built_cache)[0])}
    env.pop("PARAPROP_NATIVE", None)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    outs = [tmp_path / f"r{i}.pt" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(out), str(barrier),
                               str(len(outs))], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for out in outs]
    try:
        for proc, out in zip(procs, outs, strict=True):
            stdout, stderr = proc.communicate(timeout=300)
            rec = check_result(proc.returncode, stdout, stderr, out)
            assert rec["available"] and rec["status"].startswith("ok (rebuilt the damaged"), rec
    finally:   # a failed check leaves no process (or its pipes) behind for a later test
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    assert len(list(barrier.iterdir())) == len(outs), "the builds did not both run"
    assert_healthy(cache)
    assert entry(cache)[0].read_bytes() == entry(built_cache)[0].read_bytes()
    assert not list(cache.glob(".build-*")), "a temporary build directory was left behind"


def test_verify_never_raises(tmp_path):
    """The check itself copes with anything in place of the files."""
    lib, manifest = tmp_path / "scan_kernels_x.so", tmp_path / "scan_kernels_x.json"
    assert native_cache.verify(lib, manifest) == "its manifest is missing"
    manifest.mkdir()
    assert native_cache.verify(lib, manifest) == "its manifest is not a regular file"
    manifest.rmdir()
    os.mkfifo(manifest)  # opening a FIFO would block: refused without opening it
    assert native_cache.verify(lib, manifest) == "its manifest is not a regular file"
    manifest.unlink()
    manifest.write_bytes(b"\xff\xfe")
    assert native_cache.verify(lib, manifest) == "its manifest is not valid JSON"
    manifest.write_text("[" * 100_000)
    assert "its manifest is malformed (over" in native_cache.verify(lib, manifest)
    manifest.write_text("[" * 60_000)
    assert native_cache.verify(lib, manifest) in ("its manifest is not valid JSON",
                                             "its manifest is malformed (not a version-1 "
                                             "record of this library)")
    manifest.write_text(json.dumps({"version": 1, "library": "other.so", "size": 3,
                                    "sha256": "00"}))
    assert "its manifest is malformed" in native_cache.verify(lib, manifest)
    manifest.write_text(json.dumps({"version": 1, "library": lib.name, "size": 3,
                                    "sha256": "00"}))
    assert native_cache.verify(lib, manifest) == "the library is missing (its manifest is there)"
    lib.mkdir()
    assert native_cache.verify(lib, manifest) == "the library is not a regular file"
