"""The trust checks of the native kernels' cache (:mod:`paraprop.scan.native_build` decides
what to build and load; this module says whether a directory or a file may be trusted).

Loading a library runs its code, so the cache is trusted only the way ssh trusts its files: a
directory and every file loaded from it must be owned by this user (or by root, who can change
this user's files anyway) and writable by no one else (no group or other write bit), every
directory above it must be owned by this user or root and not writable by others unless it is
sticky (like ``/tmp``), and symbolic links are checked where they point (the library and its
manifest must not be links at all): :func:`dir_problem`, :func:`open_checked`.

Every cached library has a manifest written at build time with its size and sha256
(:func:`write_manifest`). A library is accepted only when it matches its manifest
(:func:`checked`): mapping a truncated shared library kills the process with SIGBUS. The library
is checked and hashed through one open file descriptor, which the loader then uses, so the bytes
loaded are the bytes checked. Every function here returns the problem as text (for
``native_build.status()``) instead of raising.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path

MANIFEST_VERSION = 1
MANIFEST_MAX_BYTES = 1 << 16
GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH

def this_uid() -> int:
    geteuid = getattr(os, "geteuid", None)
    if geteuid is None:
        raise RuntimeError("file ownership cannot be checked on this platform (no os.geteuid), "
                           "so no cached library is loaded")
    return geteuid()


def owner_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a file or directory with status ``st`` may not be trusted by ``uid`` (owner, write
    bits), or ``None``."""
    if st.st_uid not in (uid, 0):
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid}) or root"
    if st.st_mode & GROUP_OTHER_WRITE:
        return (f"it is writable by its group or others (mode "
                f"{oct(stat.S_IMODE(st.st_mode))})")
    return None


def ancestor_problem(path: str, uid: int) -> str | None:
    """Why the existing directory (or link) ``path`` above the cache lets someone else swap
    what lies below it: owned by another user, or writable by others without the sticky bit."""
    st = os.lstat(path)
    if st.st_uid not in (uid, 0):
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid}) or root"
    if (not stat.S_ISLNK(st.st_mode) and st.st_mode & GROUP_OTHER_WRITE
            and not st.st_mode & stat.S_ISVTX):
        return (f"{path} is writable by its group or others without the sticky bit (mode "
                f"{oct(stat.S_IMODE(st.st_mode))})")
    return None


def dir_problem(root: Path) -> str | None:
    """Why the directory ``root`` is not a safe place to load libraries from, or ``None``.

    Safe means: ``root`` (symbolic links resolved) is a directory owned by this user or root and
    not writable by its group or others, and every directory above it, on the path as written
    and on the resolved path, is owned by this user or root and not writable by others unless
    it is sticky. Components that do not exist yet are skipped (they are created with mode
    0700). Never raises.
    """
    try:
        uid = this_uid()
        written = os.path.abspath(root)
        real = os.path.realpath(root)
        for path in (written, real):
            for part in reversed(Path(path).parents):
                try:
                    problem = ancestor_problem(str(part), uid)
                except FileNotFoundError:
                    break
                if problem:
                    return problem
        try:  # the cache itself as written, when it is a link: whose link
            if os.path.islink(written):
                problem = ancestor_problem(written, uid)
                if problem:
                    return problem
        except FileNotFoundError:
            pass
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return f"{real} is not a directory"
        problem = owner_problem(st, uid)
        return None if problem is None else f"{real}: {problem}"
    except (OSError, RuntimeError) as e:
        return f"it cannot be examined ({getattr(e, 'strerror', None) or e})"


def open_checked(path: Path) -> tuple[int | None, str | None]:
    """Open ``path`` for reading without following a symbolic link or blocking on a FIFO, and
    check the opened file: a regular file owned by this user (or root), writable by no one else.

    Returns:
        ``(fd, None)``, or ``(None, problem)``; ``FileNotFoundError`` propagates.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None, "is a symbolic link"
        return None, f"cannot be read ({e.strerror or e})"
    problem: str | None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        else:
            owner = owner_problem(st, this_uid())
            problem = None if owner is None else owner.replace("it is ", "is ", 1)
    except (OSError, RuntimeError) as e:
        problem = f"cannot be examined ({getattr(e, 'strerror', None) or e})"
    if problem is not None:
        os.close(fd)
        return None, problem
    return fd, None


def digest_fd(fd: int) -> tuple[int, str]:
    """Size in bytes and sha256 (hex) of the open file ``fd``, read from its start."""
    h = hashlib.sha256()
    size = 0
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def digest(path: Path) -> tuple[int, str]:
    """Size in bytes and sha256 (hex) of the file at ``path``; ``OSError`` if it cannot be read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return digest_fd(fd)
    finally:
        os.close(fd)


# What a problem of checked() is: "untrusted" (ownership, links, write bits) or "damaged".
UNTRUSTED = ("is owned by", "is writable by", "is a symbolic link")


def _open_part(path: Path, what: str, missing: str) -> tuple[int | None, str | None]:
    """:func:`open_checked` of a library or its manifest, ``what`` naming it in the problem;
    ``missing`` is the problem of a file that is not there."""
    try:
        fd, problem = open_checked(path)
    except FileNotFoundError:
        return None, missing
    return (fd, None) if problem is None else (None, f"{what} {problem}")


def checked(target: Path, manifest: Path) -> tuple[int | None, str | None]:
    """Check a cached library against the manifest written when it was built, and both files'
    ownership and modes (:func:`open_checked`).

    Returns:
        ``(fd, None)`` with ``fd`` an open descriptor of the library whose size and sha256 are
        those its manifest records, or ``(None, problem)`` saying what is wrong (a missing,
        unreadable, garbage or foreign manifest counts as wrong). Never raises.
    """
    mfd, problem = _open_part(manifest, "its manifest", "its manifest is missing")
    if mfd is None:
        return None, problem
    try:
        raw = os.read(mfd, MANIFEST_MAX_BYTES + 1)
    except OSError as e:
        return None, f"its manifest cannot be read ({e.strerror or e})"
    finally:
        os.close(mfd)
    if len(raw) > MANIFEST_MAX_BYTES:
        return None, f"its manifest is malformed (over {MANIFEST_MAX_BYTES} bytes)"
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None, "its manifest is not valid JSON"
    if not (isinstance(rec, dict) and rec.get("version") == MANIFEST_VERSION
            and rec.get("library") == target.name and type(rec.get("size")) is int
            and isinstance(rec.get("sha256"), str)):
        return None, "its manifest is malformed (not a version-1 record of this library)"
    fd, problem = _open_part(target, "the library", "the library is missing (its manifest is "
                             "there)")
    if fd is None:
        return None, problem
    try:
        size, sha = digest_fd(fd)
    except OSError as e:
        os.close(fd)
        return None, f"the library cannot be read ({e.strerror or e})"
    if size != rec["size"] or sha != rec["sha256"]:
        os.close(fd)
        if size != rec["size"]:
            return None, f"its size is {size} bytes, its manifest says {rec['size']}"
        return None, "its sha256 does not match its manifest (same size, other bytes)"
    return fd, None


def verify(target: Path, manifest: Path) -> str | None:
    """``None`` when the cached library ``target`` may be loaded (:func:`checked`), else what
    is wrong with it or its ``manifest``. Never raises."""
    fd, problem = checked(target, manifest)
    if fd is not None:
        os.close(fd)
    return problem


def write_manifest(manifest: Path, library: Path, name: str) -> None:
    """Record the size and sha256 of the built ``library`` in ``manifest`` (mode 0644) as the
    library ``name`` (the name it will have in the cache)."""
    size, sha = digest(library)
    manifest.write_text(json.dumps({"version": MANIFEST_VERSION, "library": name,
                                    "size": size, "sha256": sha}) + "\n")
    os.chmod(manifest, 0o644)
