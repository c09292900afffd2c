"""Building, caching and loading the native (C) kernels of :mod:`paraprop.scan.native`.

On a small CPU a PyTorch operator costs a few microseconds of dispatch, so ``T`` small steps of
``h_t = A_t h_{t-1} + b_t`` cost ``T`` times that however small ``H`` is. These kernels run the
whole recurrence in one call: the sequential algorithm without per-step dispatch (the same
``O(T H^2)`` work, none of the ``H``-fold extra work of a tree scan), with the independent batch
rows split across threads.

The kernels are plain C (no PyTorch or Python headers), compiled on first use with the system C
compiler (``$CC``, else ``cc``/``gcc``) into a per-user cache directory (``$PARAPROP_CACHE_DIR``,
else ``$XDG_CACHE_HOME/paraprop``, else ``~/.cache/paraprop``) and loaded with :mod:`ctypes`.
Nothing needs to be installed: when no compiler is found or the build fails, :func:`available`
is ``False`` (``status()`` says why), ``method="auto"`` runs the pure-PyTorch methods and
``method="native"`` raises with that reason. ``PARAPROP_NATIVE=0`` disables the kernels.

Every cached library ``scan_kernels_<key>.so`` has a manifest ``scan_kernels_<key>.json``
written at build time with its size and sha256. A library is loaded only when it matches its
manifest: mapping a truncated shared library kills the process with SIGBUS, so a damaged one
(truncated, overwritten, no manifest, a manifest that is not what this module writes) is
rebuilt, and if the rebuild fails it is ignored; ``status()`` says which. Builders write to a
temporary directory in the cache and rename into place, so concurrent processes never see a
partial file.

Loading a library runs its code, so the cache is trusted only the way ssh trusts its files
(:mod:`paraprop.scan.native_cache` holds those checks and the manifests; this module decides what
to do with their answers). A library or manifest that fails the check in a safe cache directory
is rebuilt in place; a cache directory that fails it is not used at all: the
kernels are built into a private directory (``tempfile.mkdtemp``, mode 0700, removed at exit)
for this process, and if that directory is not safe either the kernels are unavailable. A
safe cache directory that this user cannot write (say root's, mode 0755) still serves the
libraries in it that pass the check; a library that has to be built goes to the private
directory instead. ``status()`` gives the reason in every case. The library is loaded through the
descriptor it was checked through (``/proc/self/fd/N`` where it exists), so the bytes loaded
are the bytes checked.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

from paraprop.scan import native_cache as trust

__all__ = ["available", "status"]

# the C source (package data, compiled twice: once per scalar type, with these definitions)
SOURCE = "kernels.c"
UNITS = {
    "f32": "#define SCALAR float\n#define PP_SINGLE 1\n#define SFX(name) name##_f32\n",
    "f64": "#define SCALAR double\n#define SFX(name) name##_f64\n",
}


@functools.cache
def body() -> str:
    """The kernels' C source (:data:`SOURCE`, shipped beside this module)."""
    return resources.files("paraprop.scan").joinpath(SOURCE).read_text(encoding="utf-8")


_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast", "-std=c99"]
_LIBS = ["-lm"]  # after the sources: the float64 cells call libm's tanh and exp
_DTYPES = {torch.float32: ("f32", ctypes.c_float), torch.float64: ("f64", ctypes.c_double)}

# Calls with at least this many (row, step) pairs use kernels compiled for their state size.
_SPECIALISE_MIN_WORK = 4096

_lock = threading.Lock()
_lib = None
_special: dict[tuple[int, int], ctypes.CDLL] = {}
_status = "not built yet"
_notes: list[str] = []  # what status() adds to "ok": cached libraries rebuilt, fallbacks taken


def _cache_dir() -> Path:
    env = os.environ.get("PARAPROP_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "paraprop"


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


_where: Path | None = None  # the checked cache directory of this process (see _cache)
_private: Path | None = None  # the private fallback directory, once made
_fds: list[int] = []  # descriptors of the loaded libraries, kept open (see _open)


def _private_dir() -> Path:
    """A directory made for this process by ``tempfile.mkdtemp`` (mode 0700), removed at exit."""
    global _private
    if _private is None:
        _private = Path(os.path.realpath(tempfile.mkdtemp(prefix="paraprop-kernels-")))
        atexit.register(shutil.rmtree, _private, ignore_errors=True)
    return _private


def _cache() -> Path:
    """The directory this process builds and loads kernels in: the cache directory when it is
    safe (``native_cache.dir_problem``; created with mode 0700 if missing), else a private
    directory (the reason is noted for :func:`status`). Call with ``_lock`` held.

    Raises:
        RuntimeError: neither the cache directory nor a private directory is safe.
    """
    global _where
    if _where is not None:
        return _where
    root = _cache_dir()
    problem = trust.dir_problem(root)
    if problem is None:
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except OSError as e:
            problem = f"it cannot be created ({e.strerror or e})"
        else:
            problem = trust.dir_problem(root)
    if problem is None:  # from now on the resolved path: a link swapped later is not followed
        _where = Path(os.path.realpath(root))
        return _where
    return _go_private(f"the kernel cache directory {root} is not safe to load libraries from "
                       f"({problem})", "and neither is a private directory {private} "
                       "({fallback})")


def _go_private(reason: str, neither: str) -> Path:
    """Make the private directory (:func:`_private_dir`) the one this process builds and loads
    kernels in, noting ``reason`` (why not the cache directory) for :func:`status`. Call with
    ``_lock`` held.

    Arguments:
        reason: why the cache directory is not used, e.g. ``"the kernel cache directory ... is
            not safe to load libraries from (...)"``.
        neither: how the error continues when the private directory is not safe either, with
            the fields ``{private}`` and ``{fallback}`` (the directory and what is wrong).

    Raises:
        RuntimeError: the private directory cannot be made or is not safe.
    """
    global _where
    try:
        private = _private_dir()
        fallback = trust.dir_problem(private)
    except OSError as e:
        private, fallback = None, f"it cannot be created ({e.strerror or e})"
    if fallback is not None:
        raise RuntimeError(f"{reason}, " + neither.format(
            private=private or "(tempfile.mkdtemp)", fallback=fallback) + "; no library is "
            "loaded")
    assert private is not None      # made: fallback is None
    _notes.append(f"{reason}; built into the private directory {private} instead")
    _where = private
    return private


def _compile(cc: str, args: list[str]) -> None:
    """Run the C compiler ``cc`` with ``args``.

    Raises:
        RuntimeError: the compiler exits non-zero (the message ends with its stderr).
        OSError, subprocess.TimeoutExpired: it cannot be started, or runs over 300 s.
    """
    proc = subprocess.run([cc, *args], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling the scan kernels failed: {proc.stderr[-2000:]}")


def _compile_into(cc: str, flags: list[str], target: Path, manifest: Path) -> None:
    """Compile the kernels into ``target`` and record its size and sha256 in ``manifest``.

    Everything is written in a temporary directory inside the cache and renamed into place
    (atomic on one file system): the library first, then its manifest. A concurrent reader
    therefore sees either complete old files or complete new ones; a library paired with another
    builder's manifest fails verification and is rebuilt, never loaded unchecked.

    Raises:
        RuntimeError: the compilation failed.
        OSError: the cache directory cannot be written.
    """
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        tmpd = Path(tmp)
        (tmpd / "body.h").write_text(body())
        sources = []
        for suffix, defs in UNITS.items():
            src = tmpd / f"kernels_{suffix}.c"
            src.write_text(defs + '#include "body.h"\n')
            sources.append(str(src))
        out = tmpd / "lib.so"
        _compile(cc, [*flags, "-o", str(out), *sources, *_LIBS])
        # writable by no one else whatever the umask, or the check before loading refuses it
        os.chmod(out, stat.S_IMODE(os.stat(out).st_mode) & ~trust.GROUP_OTHER_WRITE)
        man = tmpd / "manifest.json"
        trust.write_manifest(man, out, target.name)
        os.replace(out, target)
        os.replace(man, manifest)


def _open(target: Path, fd: int) -> ctypes.CDLL:
    """Load the library checked through the open descriptor ``fd`` (``native_cache.checked``)
    and declare its kernels' signatures.

    The loader opens ``/proc/self/fd/<fd>`` where it exists, i.e. the very file that was checked
    and hashed, even if the name ``target`` was replaced since; elsewhere it opens ``target``
    (whose directory only this user or root can write). ``fd`` stays open for the life of the
    process once the library is loaded (the loader recognises a library by its name, so a
    descriptor number must not name two libraries), and is closed if loading fails.

    Raises:
        OSError: the dynamic loader refuses the file.
        AttributeError: a kernel symbol is missing.
    """
    by_fd = f"/proc/self/fd/{fd}"
    try:
        lib = ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(target))
    except BaseException:
        os.close(fd)
        raise
    _fds.append(fd)
    i64, ci, vp = ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p
    plain = [i64, i64, i64, ci, vp, i64, i64, vp, i64, i64, vp, i64, vp, i64, i64]
    fact = [i64, i64, i64, i64, ci, vp, i64, i64, vp, i64, i64, vp, vp, vp, i64, i64, vp, i64,
            vp, i64, i64]
    lstm = [i64, i64, i64, ci, ci, vp, i64, i64, vp, i64, i64, vp, i64, i64, vp, vp, i64, i64,
            vp, i64, vp, i64, i64]
    rnn = [i64, i64, i64, ci, vp, i64, i64, vp, vp, i64, vp, i64, i64]
    gru = [i64, i64, i64, vp, i64, i64, vp, vp, vp, i64, *[vp, i64, i64] * 4]
    lstm_fwd = [i64, i64, i64, vp, i64, i64, vp, vp, i64, vp, i64, *[vp, i64, i64] * 5]
    for suffix in UNITS:
        for kind, argtypes in (("dense", plain), ("diag", plain), ("factored", fact),
                               ("lstm", lstm), ("rnn_fwd", rnn), ("gru_fwd", gru),
                               ("lstm_fwd", lstm_fwd)):
            fn = getattr(lib, f"pp_{kind}_{suffix}")
            fn.argtypes, fn.restype = argtypes, None
    return lib


def _key(cc: str, defines: tuple[tuple[str, int], ...] = ()) -> tuple[str, list[str]]:
    """``(key, flags)``: the compiler flags for ``defines`` and the cache key of the library
    they build with ``cc`` (``scan_kernels_<key>.so``), a hash of the source, the flags, the
    compiler (path, size, mtime) and the CPU."""
    st = os.stat(cc)  # identifies the compiler without running it
    version = [f"{os.path.realpath(cc)}:{st.st_size}:{st.st_mtime_ns}"]
    cpu = ""
    try:  # -march=native: a library built on one CPU may not run on another
        cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("flags")), "")
    except OSError:
        pass
    flags = [*_FLAGS, *(f"-D{k}={v}" for k, v in defines)]
    key = hashlib.sha256("\n".join([body(), *UNITS.values(), *flags, *_LIBS, cc, *version, cpu,
                                    platform.machine()]).encode()).hexdigest()[:16]
    return key, flags


def _build(defines: tuple[tuple[str, int], ...] = ()) -> ctypes.CDLL:
    """Compile (once per source, compiler, CPU and ``defines``) and load a kernel library.

    The library lives in the directory :func:`_cache` picks (the cache when it is safe, else a
    private one). A cached library is loaded only after ``native_cache.checked`` accepts it
    (its owner, its mode, its manifest's size and sha256). One that fails (or that the dynamic
    loader refuses) is rebuilt, and the rebuild is noted for :func:`status` ("untrusted" or
    "damaged"); when the rebuild fails the cached file is left alone and never loaded. A build
    that cannot be written into the cache directory (``OSError``) is made in the private
    directory instead (:func:`_compile_into_or_private`). Call with ``_lock`` held.

    Arguments:
        defines: ``-D`` macros, e.g. ``(("PP_FIXED_H", 8), ("PP_FIXED_K", 0))``.

    Returns:
        The loaded library, its kernel signatures declared.

    Raises:
        RuntimeError: no compiler, the compilation failed, no safe directory (see
            :func:`_cache`), no directory to write the build in, or a damaged or untrusted
            cached library could not be rebuilt (the message says what was wrong with it and
            why the rebuild failed).
        OSError: the first build in the private directory cannot be written.
    """
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC)")
    key, flags = _key(cc, defines)
    where = _cache()
    target = where / f"scan_kernels_{key}.so"
    manifest = target.with_suffix(".json")
    problem = None  # what is wrong with the cached library, if there is one
    if os.path.lexists(target) or os.path.lexists(manifest):
        fd, problem = trust.checked(target, manifest)
        if fd is not None:
            try:
                return _open(target, fd)
            except OSError as e:  # verified bytes the loader refuses: try a fresh build once
                problem = f"the dynamic loader refuses it ({e})"
    what = problem and ("untrusted" if any(w in problem for w in trust.UNTRUSTED) else "damaged")
    try:
        built = _compile_into_or_private(cc, flags, target, manifest)
    except Exception as e:
        if problem is None:  # first build: failures propagate as is
            raise
        raise RuntimeError(f"the cached kernel library {target} is {what} ({problem}) and "
                           f"rebuilding it failed ({e}); it is ignored") from e
    if problem is not None:
        _notes.append(f"rebuilt the {what} cached {target.name}: {problem}")
    return _open_built(*built)


def _compile_into_or_private(cc: str, flags: list[str], target: Path,
                             manifest: Path) -> tuple[Path, Path]:
    """:func:`_compile_into` ``target`` and ``manifest``; when that fails with an ``OSError`` (a
    cache directory that is safe but that this user cannot write, e.g. root's, mode 0755, or a
    full disk), in the private directory instead (:func:`_go_private`, noted for
    :func:`status`). Call with ``_lock`` held.

    Returns:
        The paths of the library and manifest built.

    Raises:
        RuntimeError: the compilation failed, or the private directory is not safe, or
            building there failed too (the message gives both reasons).
        OSError: writing into the private directory (already in use) failed.
    """
    try:
        _compile_into(cc, flags, target, manifest)
        return target, manifest
    except OSError as e:
        if _private is not None and target.parent == _private:
            raise
        reason = (f"writing into the kernel cache directory {target.parent} failed "
                  f"({e.strerror or e})")
        private = _go_private(reason, "and a private directory {private} is not safe either "
                                      "({fallback})")
    target, manifest = private / target.name, private / manifest.name
    try:
        _compile_into(cc, flags, target, manifest)
    except Exception as e2:
        raise RuntimeError(f"{reason}, and building into the private directory {private} "
                           f"failed too ({e2})") from e2
    return target, manifest


def _open_built(target: Path, manifest: Path) -> ctypes.CDLL:
    """Load a library this process has just built, after the same check as a cached one.

    Raises:
        RuntimeError: it fails the check (e.g. replaced meanwhile by a file of someone else).
    """
    fd, problem = trust.checked(target, manifest)
    if fd is None:
        raise RuntimeError(f"the kernel library {target} just built fails its check "
                           f"({problem}); it is not loaded")
    return _open(target, fd)


def _load():
    global _lib, _status
    if _lib is not None or _status != "not built yet":
        return _lib
    with _lock:
        if _lib is None and _status == "not built yet":
            if os.environ.get("PARAPROP_NATIVE", "1") == "0":
                _status = "disabled by PARAPROP_NATIVE=0"
            else:
                try:
                    _lib = _build()
                    _status = "ok"
                except Exception as e:  # any failure means: use the PyTorch algorithms
                    _status = f"unavailable: {e}"
    return _lib


def _library(H: int, K: int, work: int):
    """The generic library, or for large calls (``work`` = rows x steps) one built for this
    ``(H, K)``; a failed specialised build falls back to the generic library."""
    lib = _load()
    if work < _SPECIALISE_MIN_WORK or H > 128 or K > 512:
        return lib
    key = (H, K)
    if key not in _special:
        with _lock:
            if key not in _special:
                try:
                    _special[key] = _build((("PP_FIXED_H", H), ("PP_FIXED_K", K)))
                except Exception as e:  # keep the generic kernels
                    _notes.append(f"generic kernels for H={H}, K={K}: {e}")
                    _special[key] = lib
    return _special[key]


def available() -> bool:
    """Whether the native kernels are built and loaded (builds them on first call)."""
    return _load() is not None


def status() -> str:
    """``"ok"``, or why the native kernels are not used.

    Returns:
        ``"ok"`` when the kernels are loaded and nothing went wrong; ``"ok (...)"`` when they
        are loaded but this process built them in a private directory because the cache
        directory is not safe or cannot be written, rebuilt a damaged or untrusted cached
        library, or fell back to the generic kernels for a specialised build (the parentheses
        say which and why);
        ``"disabled by PARAPROP_NATIVE=0"`` or ``"unavailable: <reason>"`` otherwise, e.g. no
        compiler, a failed build, no safe directory to build in, or a damaged or untrusted
        cached library that could not be rebuilt.
    """
    _load()
    if _status == "ok" and _notes:
        return f"ok ({'; '.join(_notes)})"
    return _status
