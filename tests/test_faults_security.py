"""Faults of trust in the native kernel cache: a library that someone else could have written is
never loaded; the kernels are rebuilt privately or refused, and ``native_build.status()`` says why.

The attack (issue 27): a shared library planted in a cache directory another user can write,
next to a manifest that matches it, was loaded, and its constructor ran in this process. Here
the planted library's constructor writes a marker file; a control case proves that loading it
does write the marker, and every other case asserts that the marker never appears.

The kernels are compiled once for the module (:func:`build`); every build the cases trigger
copies that library instead of running the compiler (``native_build._compile`` replaced), so a case
costs no compilation. The decisions (which directory, which file, rebuild or refuse, what
``status()`` says) are taken in this process through ``native_build.status()`` with the module's
globals reset as a fresh import has them (:func:`fresh`); the case of issue 27 also runs end to
end in a fresh interpreter, where the private directory must be gone after exit. Other owners
are made with ``chown`` to an unused uid (and a cache this user cannot write by ``seteuid`` to
it), so those cases need root and skip otherwise.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from paraprop.scan import linear_recurrence, native_build, native_cache

FOREIGN = 12345  # a uid that no account on the test machine uses
ROOT = os.geteuid() == 0
SYSTEM_TMP = tempfile.gettempdir()
as_root = pytest.mark.skipif(not ROOT, reason="needs root to chown files to another uid")

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("PARAPROP_PLANTED_MARKER");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) { fputs("the planted library ran\n", f); fclose(f); }
}
"""

# Run in the subprocess: report status(), where the kernels were built, and check that a
# native-eligible scan equals the PyTorch reference. $PARAPROP_TEST_PREBUILT: "compile" by
# copying that library; $PARAPROP_TEST_BREAK_BUILD: every compilation fails.
SCRIPT = r"""
import json, os
import torch
from paraprop.scan import linear_recurrence, native_build

if os.environ.get("PARAPROP_TEST_PREBUILT"):
    with open(os.environ["PARAPROP_TEST_PREBUILT"], "rb") as f:
        prebuilt = f.read()
    def _copy(cc, args):
        if any(a.startswith("-D") for a in args):
            raise RuntimeError("only the generic kernels are prebuilt")
        with open(args[args.index("-o") + 1], "wb") as f:
            f.write(prebuilt)
    native_build._compile = _copy
if os.environ.get("PARAPROP_TEST_BREAK_BUILD"):
    def _no_compiler(cc, args):
        raise RuntimeError("simulated compiler failure")
    native_build._compile = _no_compiler
status = native_build.status()
g = torch.Generator().manual_seed(0)
A = 0.5 * torch.randn(2, 30, 3, 3, generator=g, dtype=torch.float64)
b = torch.randn(2, 30, 3, generator=g, dtype=torch.float64)
got = linear_recurrence(A, b, method="native" if native_build.available() else "sequential")
ref = linear_recurrence(A, b, method="sequential")
torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
print(json.dumps({"status": status, "available": native_build.available(),
                  "where": None if native_build._where is None else str(native_build._where)}))
"""


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """The generic kernel library, compiled once for the module with the real compiler, flags
    and sources (``native_build._compile_into``)."""
    cc = native_build._compiler()
    if cc is None:
        pytest.skip("no C compiler to build kernels")
    key, flags = native_build._key(cc)
    target = tmp_path_factory.mktemp("build") / f"scan_kernels_{key}.so"
    native_build._compile_into(cc, flags, target, target.with_suffix(".json"))
    return target


def copying(build: Path):
    """A stand-in for ``native_build._compile`` that writes the module's build where the compiler
    would have (the bytes are read now: the stand-in may run as another user)."""
    data = build.read_bytes()

    def compile_(cc, args):
        if any(a.startswith("-D") for a in args):
            raise RuntimeError("only the generic kernels are prebuilt")
        Path(args[args.index("-o") + 1]).write_bytes(data)

    return compile_


def reset(monkeypatch) -> None:
    """Put ``native``'s globals as a fresh import has them (restored after the test; the
    descriptors of libraries loaded meanwhile stay open, as the module keeps them)."""
    for name, value in (("_lib", None), ("_status", "not built yet"), ("_special", {}),
                        ("_notes", []), ("_where", None), ("_private", None), ("_fds", [])):
        monkeypatch.setattr(native_build, name, value)


@pytest.fixture
def fresh(monkeypatch, build, tmp_path) -> Path:
    """``native`` as a fresh process sees it, in this process: nothing loaded or chosen, the
    compiler replaced by a copy of :func:`build`, ``tempfile``'s directory a private one under
    ``tmp_path`` (returned)."""
    reset(monkeypatch)
    monkeypatch.setattr(native_build, "_compile", copying(build))
    monkeypatch.delenv("PARAPROP_NATIVE", raising=False)
    tmp = directory(tmp_path / "tmp", 0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def scan_check() -> None:
    """A native-eligible scan equals the PyTorch reference (natively when the kernels load)."""
    g = torch.Generator().manual_seed(0)
    A = 0.5 * torch.randn(2, 30, 3, 3, generator=g, dtype=torch.float64)
    b = torch.randn(2, 30, 3, generator=g, dtype=torch.float64)
    got = linear_recurrence(A, b, method="native" if native_build.available() else "sequential")
    ref = linear_recurrence(A, b, method="sequential")
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def run_here(monkeypatch, cache: Path, marker: Path) -> dict:
    """``native_build.status()`` in this process (after :func:`fresh`) with ``cache`` as the kernel
    cache; the scan must be correct and the planted library must not have run."""
    monkeypatch.setenv("PARAPROP_CACHE_DIR", str(cache))
    monkeypatch.setenv("PARAPROP_PLANTED_MARKER", str(marker))
    status = native_build.status()
    scan_check()
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    return {"status": status, "available": native_build.available(),
            "where": None if native_build._where is None else str(native_build._where)}


def run_fresh(cache: Path, marker: Path, build: Path, **env) -> dict:
    """Import paraprop in a new interpreter with ``cache`` as its kernel cache (builds copy
    ``build``); the process must exit 0 with a correct scan, and the planted library must not
    have run."""
    env = {**os.environ, "PARAPROP_CACHE_DIR": str(cache), "PARAPROP_TEST_PREBUILT": str(build),
           "PARAPROP_PLANTED_MARKER": str(marker), **env}
    env.pop("PARAPROP_NATIVE", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def library_name() -> str:
    """The file name of the generic kernel library this machine's processes look for."""
    return f"scan_kernels_{native_build._key(native_build._compiler())[0]}.so"


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    """A shared library whose constructor writes ``$PARAPROP_PLANTED_MARKER``."""
    if native_build._compiler() is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("planted")
    (d / "planted.c").write_text(PLANTED_C)
    subprocess.run([native_build._compiler(), "-shared", "-fPIC", "-o", str(d / "planted.so"),
                    str(d / "planted.c")], check=True, capture_output=True, timeout=120)
    return d / "planted.so"


def plant(cache: Path, planted: Path, *, uid: int | None = None, mode: int = 0o755,
          link: bool = False, manifest_uid: int | None = None) -> Path:
    """Put the planted library in ``cache`` under the name the kernels are looked up by, with a
    manifest that matches it (size and sha256): the library owned by ``uid`` and with ``mode``,
    or a symbolic link to it (``link``), the manifest owned by ``manifest_uid``. Returns the
    planted path."""
    target = cache / library_name()
    if link:
        target.symlink_to(planted)
    else:
        shutil.copyfile(planted, target)
        os.chmod(target, mode)
    size, sha = native_cache.digest(planted)
    manifest = target.with_suffix(".json")
    manifest.write_text(json.dumps({"version": 1, "library": target.name, "size": size,
                                    "sha256": sha}) + "\n")
    if uid is not None:
        os.chown(target, uid, uid)
    if manifest_uid is not None:
        os.chown(manifest, manifest_uid, manifest_uid)
    return target


def directory(path: Path, mode: int, uid: int | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def test_control_the_planted_library_runs_when_loaded(planted, tmp_path):
    """The marker is a real witness: loading the planted library writes it."""
    marker = tmp_path / "marker"
    env = {**os.environ, "PARAPROP_PLANTED_MARKER": str(marker)}
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(planted)!r})"],
                   env=env, check=True, timeout=120)
    assert marker.read_text() == "the planted library ran\n"


def test_control_the_stand_in_compiler_gives_working_kernels(fresh, tmp_path, monkeypatch):
    """The cases' builds are real kernels: a fresh cache is built (by copy) and used."""
    cache = tmp_path / "cache"
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    assert rec == {"status": "ok", "available": True, "where": str(cache)}
    assert native_cache.verify(cache / library_name(),
                          (cache / library_name()).with_suffix(".json")) is None


# -- the cache directory is not safe: build in a private directory -------------------------------
def private_build(rec: dict, cache: Path, reason: str, *, exited: bool = False) -> None:
    """The kernels were built and used in a private directory (gone after the process when
    it has ``exited``)."""
    status = rec["status"]
    assert rec["available"], rec
    assert status.startswith(f"ok (the kernel cache directory {cache} is not safe to load "
                             "libraries from ("), status
    assert reason in status, status
    assert f"built into the private directory {rec['where']} instead" in status, status
    assert Path(rec["where"]).name.startswith("paraprop-kernels-")
    if exited:
        assert not Path(rec["where"]).exists(), "the private directory was left behind"
    else:
        assert oct(os.stat(rec["where"]).st_mode & 0o777) == "0o700"


@pytest.mark.slow
@as_root
def test_world_writable_cache_of_another_user_is_not_used(build, planted, tmp_path):
    """The case of issue 27, end to end in a fresh interpreter: another user's world-writable
    cache with a matching manifest."""
    cache = directory(tmp_path / "cache", 0o777)
    lib = plant(cache, planted, uid=FOREIGN, manifest_uid=FOREIGN)
    os.chown(cache, FOREIGN, FOREIGN)
    before = lib.read_bytes()
    rec = run_fresh(cache, tmp_path / "marker", build)
    private_build(rec, cache, f"it is owned by uid {FOREIGN}, not by this user (uid 0)",
                  exited=True)
    assert lib.read_bytes() == before, "a file in another user's directory was changed"


@as_root
def test_world_writable_cache_of_another_user_in_process(fresh, planted, tmp_path, monkeypatch):
    cache = directory(tmp_path / "cache", 0o777)
    lib = plant(cache, planted, uid=FOREIGN, manifest_uid=FOREIGN)
    os.chown(cache, FOREIGN, FOREIGN)
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    private_build(rec, cache, f"it is owned by uid {FOREIGN}, not by this user (uid 0)")
    assert Path(rec["where"]).parent == fresh
    assert lib.read_bytes() == planted.read_bytes()


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o770, 0o2775], ids=oct)
def test_own_group_or_world_writable_cache_is_not_used(fresh, planted, tmp_path, monkeypatch,
                                                       mode):
    """A cache shared by a group (group-writable) is refused like a world-writable one."""
    cache = directory(tmp_path / "cache", mode)
    plant(cache, planted)
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    private_build(rec, cache, f"it is writable by its group or others (mode {oct(mode)})")


@as_root
def test_cache_linked_to_another_users_directory_is_not_used(fresh, planted, tmp_path,
                                                             monkeypatch):
    theirs = directory(tmp_path / "theirs", 0o755)
    plant(theirs, planted, uid=FOREIGN, manifest_uid=FOREIGN)
    os.chown(theirs, FOREIGN, FOREIGN)
    (tmp_path / "cache").symlink_to(theirs)
    rec = run_here(monkeypatch, tmp_path / "cache", tmp_path / "marker")
    private_build(rec, tmp_path / "cache", f"{theirs}: it is owned by uid {FOREIGN}")


def test_nowhere_safe_refuses_with_the_reason(fresh, planted, tmp_path, monkeypatch):
    """An unsafe cache and an unsafe temporary directory: no kernels (the scans run on the
    PyTorch algorithms), and status() says why."""
    cache = directory(tmp_path / "cache", 0o777)
    plant(cache, planted)
    tmp = directory(tmp_path / "open-tmp", 0o777)  # writable by all, no sticky bit
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    assert not rec["available"], rec
    status = rec["status"]
    assert status.startswith(f"unavailable: the kernel cache directory {cache} is not safe to "
                             "load libraries from (")
    assert (f"and neither is a private directory {tmp}/paraprop-kernels-" in status
            and f"{tmp} is writable by its group or others without the sticky bit (mode 0o777)"
            in status and "no library is loaded" in status), status
    assert not list(tmp.glob("*/*")), "something was built in the unsafe directory"


# -- the cache directory is safe, a file in it is not: rebuild in place ---------------------------
REBUILD = {
    "foreign-library": (dict(uid=FOREIGN), f"the library is owned by uid {FOREIGN}, not by this "
                                           "user (uid 0) or root"),
    "group-writable-library": (dict(mode=0o775), "the library is writable by its group or "
                                                 "others (mode 0o775)"),
    "linked-library": (dict(link=True), "the library is a symbolic link"),
    "foreign-manifest": (dict(manifest_uid=FOREIGN), f"its manifest is owned by uid {FOREIGN}, "
                                                     "not by this user (uid 0) or root"),
}


@pytest.mark.parametrize("case", list(REBUILD))
def test_untrusted_file_in_a_safe_cache_is_rebuilt(fresh, planted, tmp_path, monkeypatch, case):
    kw, reason = REBUILD[case]
    if FOREIGN in kw.values() and not ROOT:
        pytest.skip("needs root to chown files to another uid")
    cache = directory(tmp_path / "cache", 0o700)
    lib = plant(cache, planted, **kw)
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    assert rec["available"] and rec["where"] == str(cache), rec
    assert rec["status"] == f"ok (rebuilt the untrusted cached {lib.name}: {reason})", rec
    st = os.lstat(lib)  # replaced by a library of this user, which the next process loads
    assert not os.path.islink(lib) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
    assert native_cache.verify(lib, lib.with_suffix(".json")) is None
    assert lib.read_bytes() != planted.read_bytes()
    reset(monkeypatch)  # the next process uses the repaired cache as is
    assert run_here(monkeypatch, cache, tmp_path / "marker")["status"] == "ok"


def test_untrusted_file_that_cannot_be_rebuilt_is_ignored(fresh, planted, tmp_path, monkeypatch):
    cache = directory(tmp_path / "cache", 0o700)
    lib = plant(cache, planted, mode=0o775)

    def no_compiler(cc, args):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(native_build, "_compile", no_compiler)
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    assert not rec["available"], rec
    assert rec["status"] == (f"unavailable: the cached kernel library {lib} is untrusted (the "
                             "library is writable by its group or others (mode 0o775)) and "
                             "rebuilding it failed (simulated compiler failure); it is ignored")
    assert lib.read_bytes() == planted.read_bytes()  # left alone, and never loaded


def test_sticky_world_writable_parent_is_accepted(fresh, tmp_path, monkeypatch):
    """A private cache inside a sticky world-writable directory (like /tmp) is safe: the
    kernels are built there once and reused by the next process, no false refusal."""
    cache = directory(tmp_path / "shared", 0o1777) / "mine"
    first = run_here(monkeypatch, cache, tmp_path / "marker")
    assert first["status"] == "ok" and first["where"] == str(cache), first
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"  # created private
    lib = cache / library_name()
    mtime = lib.stat().st_mtime_ns
    reset(monkeypatch)
    assert run_here(monkeypatch, cache, tmp_path / "marker")["status"] == "ok"
    assert lib.stat().st_mtime_ns == mtime, "a safe cached library was rebuilt"


# -- the cache directory is safe but this user cannot write it: build privately -------------------
def unwritable(monkeypatch, cache: Path) -> None:
    """Make every build into ``cache`` fail as a directory without write permission does (for
    the cases that do not need root; the real refusal is tested as another uid below)."""
    real = native_build._compile_into

    def compile_into(cc, flags, target, manifest):
        if target.parent == cache:
            raise PermissionError(errno.EACCES, "Permission denied", str(cache / ".build-x"))
        return real(cc, flags, target, manifest)

    monkeypatch.setattr(native_build, "_compile_into", compile_into)


def built_privately(rec: dict, cache: Path, extra: str = "") -> None:
    assert rec["available"], rec
    assert rec["status"] == (f"ok (writing into the kernel cache directory {cache} failed "
                             "(Permission denied); built into the private directory "
                             f"{rec['where']} instead{extra})"), rec
    assert Path(rec["where"]).name.startswith("paraprop-kernels-")


def verified(where: Path) -> str | None:
    """What :func:`native_cache.verify` says of the generic library in ``where``."""
    return native_cache.verify(where / library_name(),
                                where / Path(library_name()).with_suffix(".json"))


@as_root
def test_cache_of_root_that_this_user_cannot_write(fresh, tmp_path, monkeypatch):
    """Root's cache, mode 0755, seen by another user (``seteuid``): trusted but not
    writable, so the kernels are built in a private directory instead of being unavailable."""
    base = Path(tempfile.mkdtemp(dir=SYSTEM_TMP))  # tmp_path's parents are closed to others
    try:
        os.chmod(base, 0o755)
        cache = directory(base / "cache", 0o755)
        tmp = directory(base / "tmp", 0o1777)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        monkeypatch.setenv("PARAPROP_CACHE_DIR", str(cache))
        if native_cache.dir_problem(cache) is not None:
            pytest.skip(f"{SYSTEM_TMP} is not a safe place for this case")
        os.seteuid(FOREIGN)
        try:
            status, where = native_build.status(), native_build._where
            check = verified(where)  # as that user, whose files they are
        finally:
            os.seteuid(0)
        assert not list(cache.iterdir()), "something was written into the unwritable cache"
        built_privately({"status": status, "available": native_build.available(),
                         "where": str(where)}, cache)
        assert check is None and where.parent == tmp and where.stat().st_uid == FOREIGN
        scan_check()
    finally:
        shutil.rmtree(base)


def test_unwritable_cache_builds_privately(fresh, tmp_path, monkeypatch):
    cache = directory(tmp_path / "cache", 0o755)
    unwritable(monkeypatch, cache)
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    built_privately(rec, cache)
    assert Path(rec["where"]).parent == fresh and verified(Path(rec["where"])) is None
    assert not list(cache.iterdir())


def test_unwritable_cache_serves_its_good_library(fresh, build, tmp_path, monkeypatch):
    """A library already in the unwritable cache that passes the check is loaded from it."""
    cache = directory(tmp_path / "cache", 0o755)
    shutil.copyfile(build, cache / build.name)
    shutil.copyfile(build.with_suffix(".json"), cache / build.with_suffix(".json").name)
    unwritable(monkeypatch, cache)
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    assert rec == {"status": "ok", "available": True, "where": str(cache)}
    assert native_build._private is None, "a private directory was made for nothing"


def test_unwritable_cache_with_an_untrusted_library(fresh, planted, tmp_path, monkeypatch):
    """The rebuild of a planted library goes to the private directory; the planted file is
    left alone and never loaded."""
    cache = directory(tmp_path / "cache", 0o755)
    lib = plant(cache, planted, mode=0o777)
    unwritable(monkeypatch, cache)
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    built_privately(rec, cache, f"; rebuilt the untrusted cached {lib.name}: the library is "
                                "writable by its group or others (mode 0o777)")
    assert verified(Path(rec["where"])) is None
    assert lib.read_bytes() == planted.read_bytes()


def test_unwritable_cache_and_no_safe_private_directory(fresh, tmp_path, monkeypatch):
    cache = directory(tmp_path / "cache", 0o755)
    unwritable(monkeypatch, cache)
    tmp = directory(tmp_path / "open-tmp", 0o777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    assert not rec["available"], rec
    assert rec["status"].startswith(
        f"unavailable: writing into the kernel cache directory {cache} failed (Permission "
        f"denied), and a private directory {tmp}/paraprop-kernels-"), rec
    assert rec["status"].endswith(f"is not safe either ({tmp} is writable by its group or "
                                  "others without the sticky bit (mode 0o777)); no library is "
                                  "loaded"), rec


def test_unwritable_cache_and_a_failing_compiler(fresh, tmp_path, monkeypatch):
    cache = directory(tmp_path / "cache", 0o755)
    unwritable(monkeypatch, cache)

    def no_compiler(cc, args):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(native_build, "_compile", no_compiler)
    rec = run_here(monkeypatch, cache, tmp_path / "marker")
    assert not rec["available"], rec
    assert rec["status"] == (
        f"unavailable: writing into the kernel cache directory {cache} failed (Permission "
        f"denied), and building into the private directory {native_build._private} failed too "
        "(simulated compiler failure)"), rec


# -- the checks themselves, in process ------------------------------------------------------------
def test_dir_problem_accepts_private_and_sticky_directories(tmp_path):
    assert native_cache.dir_problem(directory(tmp_path / "mine", 0o700)) is None
    assert native_cache.dir_problem(directory(tmp_path / "readable", 0o755)) is None
    sticky = directory(tmp_path / "sticky", 0o1777)
    assert native_cache.dir_problem(directory(sticky / "c", 0o700)) is None
    assert native_cache.dir_problem(sticky / "not" / "there" / "yet") is None  # made 0700 later
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    assert native_cache.dir_problem(tmp_path / "link") is None


def test_dir_problem_refuses_writable_directories(tmp_path):
    assert native_cache.dir_problem(directory(tmp_path / "a", 0o777)) == \
        f"{tmp_path / 'a'}: it is writable by its group or others (mode 0o777)"
    assert native_cache.dir_problem(directory(tmp_path / "b", 0o770)) == \
        f"{tmp_path / 'b'}: it is writable by its group or others (mode 0o770)"
    assert native_cache.dir_problem(directory(tmp_path / "s", 0o1777)) == \
        f"{tmp_path / 's'}: it is writable by its group or others (mode 0o1777)"  # itself
    above = directory(tmp_path / "open", 0o777)
    for below in (directory(above / "c", 0o700), above / "missing" / "c"):
        assert native_cache.dir_problem(below) == (f"{above} is writable by its group or others "
                                              "without the sticky bit (mode 0o777)")
    (tmp_path / "file").write_text("x")
    assert native_cache.dir_problem(tmp_path / "file") == f"{tmp_path / 'file'} is not a directory"
    # a link into a writable directory is judged where it points
    (tmp_path / "to-open").symlink_to(above / "c")
    assert "without the sticky bit" in native_cache.dir_problem(tmp_path / "to-open")


@as_root
def test_dir_problem_refuses_directories_of_another_user(tmp_path):
    theirs = directory(tmp_path / "theirs", 0o755, uid=FOREIGN)
    assert native_cache.dir_problem(theirs) == (f"{theirs}: it is owned by uid {FOREIGN}, not by "
                                           "this user (uid 0) or root")
    mine = directory(theirs / "mine", 0o700, uid=0)  # theirs can swap it: refused
    assert native_cache.dir_problem(mine) == (f"{theirs} is owned by uid {FOREIGN}, not by this "
                                         "user (uid 0) or root")
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    os.lchown(link, FOREIGN, FOREIGN)  # a link of theirs on the way is refused too
    assert native_cache.dir_problem(link / "mine2") == (
        f"{link} is owned by uid {FOREIGN}, not by this user (uid 0) or root")


def built_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A library and manifest that pass the check (any file: only bytes are compared)."""
    lib, manifest = tmp_path / "scan_kernels_x.so", tmp_path / "scan_kernels_x.json"
    lib.write_bytes(b"\x7fELF not really")
    size, sha = native_cache.digest(lib)
    manifest.write_text(json.dumps({"version": 1, "library": lib.name, "size": size,
                                    "sha256": sha}))
    return lib, manifest


def test_checked_file_modes_and_links(tmp_path):
    lib, manifest = built_pair(tmp_path)
    fd, problem = native_cache.checked(lib, manifest)
    assert problem is None and fd is not None
    os.close(fd)
    os.chmod(lib, 0o666)
    assert native_cache.verify(lib, manifest) == ("the library is writable by its group or others "
                                             "(mode 0o666)")
    os.chmod(lib, 0o644)
    os.chmod(manifest, 0o620)
    assert native_cache.verify(lib, manifest) == (
        "its manifest is writable by its group or others (mode 0o620)")
    os.chmod(manifest, 0o644)
    real = tmp_path / "real.so"
    lib.rename(real)
    lib.symlink_to(real)
    assert native_cache.verify(lib, manifest) == "the library is a symbolic link"
    real_manifest = tmp_path / "real.json"
    manifest.rename(real_manifest)
    manifest.symlink_to(real_manifest)
    assert native_cache.verify(lib, manifest) == "its manifest is a symbolic link"


def test_a_fresh_build_that_fails_the_check_is_not_loaded(tmp_path):
    lib, manifest = built_pair(tmp_path)
    os.chmod(lib, 0o666)
    with pytest.raises(RuntimeError, match=rf"the kernel library {lib} just built fails its "
                                           r"check \(the library is writable by its group or "
                                           r"others \(mode 0o666\)\); it is not loaded"):
        native_build._open_built(lib, manifest)


@as_root
def test_checked_foreign_files(tmp_path):
    lib, manifest = built_pair(tmp_path)
    os.chown(lib, FOREIGN, FOREIGN)
    assert native_cache.verify(lib, manifest) == (f"the library is owned by uid {FOREIGN}, not by "
                                             "this user (uid 0) or root")
    os.chown(lib, 0, 0)
    os.chown(manifest, FOREIGN, 0)
    assert native_cache.verify(lib, manifest) == (
        f"its manifest is owned by uid {FOREIGN}, not by this user (uid 0) or root")


def test_this_process_loads_only_checked_libraries():
    """The kernels of this test process come from a checked directory, loaded through the
    checked descriptor."""
    if not native_build.available():
        pytest.skip(native_build.status())
    assert native_build._where is not None
    assert native_cache.dir_problem(native_build._where) is None
    assert native_build._fds, "no descriptor kept for the loaded library"
    for fd in native_build._fds:
        st = os.fstat(fd)
        assert st.st_uid in (os.geteuid(), 0) and not st.st_mode & 0o022
    g = torch.Generator().manual_seed(1)
    a, b = torch.rand(1, 20, 2, generator=g), torch.randn(1, 20, 2, generator=g)
    torch.testing.assert_close(linear_recurrence(a, b, method="native"),
                               linear_recurrence(a, b, method="sequential"))
