"""A real MNIST IDX reader (gz or raw) with validation of magic numbers, counts and sizes.

The directory is found by :func:`find_mnist_dir`: the argument, else ``$PARAPROP_MNIST_DIR``, else
``../shared/data/mnist`` next to the working directory or next to this repository.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch

ENV = "PARAPROP_MNIST_DIR"
# the IDX type codes (big-endian where it matters)
_DTYPES: dict[int, np.dtype] = {code: np.dtype(t) for code, t in (
    (0x08, np.uint8), (0x09, np.int8), (0x0B, ">i2"), (0x0C, ">i4"), (0x0D, ">f4"), (0x0E, ">f8"))}
_FILES = {
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
}


class IDXError(ValueError):
    """A missing, truncated or corrupt IDX file (the message names the file).

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "labels-idx1-ubyte"
        >>> _ = path.write_bytes(bytes([0, 0, 8, 1]) + (3).to_bytes(4, "big") + b"\x01")
        >>> read_idx(path)                       # announces 3 labels, holds 1
        Traceback (most recent call last):
        paraprop.data.mnist.IDXError: .../labels-idx1-ubyte: 9 bytes, expected 11 for shape (3,) ...
    """


# Deflate expands at most about 1032:1, so a gzip file of n bytes holds at most this many times n.
_GZIP_MAX_RATIO = 1032


def _gunzip_bounded(path: Path) -> bytes:
    """Decompress ``path``, reading no more than its IDX header announces (plus one byte, to
    tell trailing data), and refusing a header that announces more than a gzip file of this
    size can hold: a small file that expands to gigabytes (a decompression bomb) is never
    expanded."""
    with gzip.open(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _DTYPES:
            return head  # read_idx reports the bad magic number
        dims = f.read(4 * head[3])
        if len(dims) < 4 * head[3]:
            return head + dims  # read_idx reports the truncated header
        shape = [int.from_bytes(dims[4 * i : 4 * i + 4], "big") for i in range(head[3])]
        body = int(np.prod(shape, dtype=object)) * _DTYPES[head[2]].itemsize
        limit = _GZIP_MAX_RATIO * path.stat().st_size
        if body > limit:
            raise IDXError(f"{path}: the header announces shape {tuple(shape)} ({body} bytes), "
                           f"more than a gzip file of {path.stat().st_size} bytes can hold "
                           f"(at most {limit}); corrupt or not an IDX file")
        return head + dims + f.read(body + 1)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (``.gz`` or raw) into a numpy array, validating its header and size.

    A ``.gz`` file is decompressed only as far as its header announces, and a header that
    announces more than the file can hold is refused (:func:`_gunzip_bounded`).

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "labels-idx1-ubyte"
        >>> _ = path.write_bytes(bytes([0, 0, 8, 1]) + (3).to_bytes(4, "big") + bytes([7, 2, 1]))
        >>> read_idx(path)                       # magic (uint8, 1 dim), 3, the data
        array([7, 2, 1], dtype=uint8)
    """
    path = Path(path)
    try:
        raw = _gunzip_bounded(path) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise IDXError(f"{path}: no such file") from None
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise IDXError(f"{path}: cannot be read as {'gzip' if path.suffix == '.gz' else 'IDX'}"
                       f" ({e})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise IDXError(f"{path}: bad magic number {raw[:4].hex() or '(empty)'}; not an IDX file")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise IDXError(f"{path}: truncated header ({len(raw)} bytes, {ndim} dims)")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = _DTYPES[raw[2]]
    expected = header + int(np.prod(shape, dtype=object)) * dtype.itemsize
    if len(raw) > expected:
        raise IDXError(f"{path}: more than the {expected} bytes expected for shape {shape} "
                       "(trailing data; corrupt or not an IDX file)")
    if len(raw) != expected:
        raise IDXError(f"{path}: {len(raw)} bytes, expected {expected} for shape {shape} "
                       f"(truncated or corrupt)")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def write_idx(path: str | os.PathLike, array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file (gzip-compressed if the name ends in ``.gz``) that
    :func:`read_idx` reads back equal, in the IDX type of its dtype (uint8, int8, int16, int32,
    float32, float64; stored big-endian). Returns the path.

    Raises:
        TypeError: ``array`` is not a numpy array.
        ValueError: a dtype IDX has no type for, no dimensions, or a dimension of ``2**32`` or
            more (a numpy array has at most 64 dimensions, within IDX's 255).

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "images-idx3-ubyte.gz"
        >>> images = np.arange(8, dtype=np.uint8).reshape(2, 2, 2)
        >>> np.array_equal(read_idx(write_idx(path, images)), images)
        True
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"array must be a numpy array, got {type(array).__name__}")
    code = next((c for c, t in _DTYPES.items()
                 if (t.kind, t.itemsize) == (array.dtype.kind, array.dtype.itemsize)), None)
    if code is None:
        raise ValueError(f"array has dtype {array.dtype}, which IDX has no type for; expected "
                         "uint8, int8, int16, int32, float32 or float64")
    if array.ndim == 0 or any(n >= 2**32 for n in array.shape):
        raise ValueError(f"array has shape {array.shape}; IDX holds one or more dimensions, "
                         "each below 2**32")
    raw = (bytes([0, 0, code, array.ndim]) + b"".join(n.to_bytes(4, "big") for n in array.shape)
           + array.astype(_DTYPES[code], copy=False).tobytes())
    path = Path(path)
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


def find_mnist_dir(mnist_dir: str | os.PathLike | None = None) -> Path | None:
    """The MNIST directory from the argument, ``$PARAPROP_MNIST_DIR`` or ``../shared/data/mnist``
    (relative to the working directory, then to this repository); ``None`` if none exists.

    Example:
        >>> find_mnist_dir("/data/mnist")             # the argument first
        PosixPath('/data/mnist')
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"PARAPROP_MNIST_DIR": "/elsewhere/mnist"}):
        ...     find_mnist_dir()                      # then the environment
        PosixPath('/elsewhere/mnist')
    """
    if mnist_dir is not None:
        return Path(mnist_dir)
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    repo = Path(__file__).resolve().parents[3]
    for base in (Path.cwd(), repo):
        cand = base.parent / "shared" / "data" / "mnist"
        if cand.is_dir():
            return cand
    return None


def _locate(directory: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx") + ".gz",
                 stem.replace("-idx", ".idx")):
        if (directory / name).is_file():
            return directory / name
    raise IDXError(f"{directory / stem}[.gz]: no such file")


def load_mnist(mnist_dir: str | os.PathLike | None = None, *, split: str = "test"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST images ``(N, 28, 28)`` float32 in ``[0, 1]`` and labels ``(N,)`` int64.

    Arguments:
        mnist_dir: directory of the IDX files (see :func:`find_mnist_dir` for the fallbacks).
        split: ``"test"`` (t10k files, 10,000 images) or ``"train"``.

    Raises:
        IDXError: missing, truncated or inconsistent files, a header announcing 0 images or 0
            rows or columns (the message names the file).
        ValueError: unknown split.

    Example:
        >>> import pathlib, tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = write_idx(folder / "t10k-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
        >>> _ = write_idx(folder / "t10k-labels-idx1-ubyte", np.array([7, 2], np.uint8))
        >>> images, labels = load_mnist(folder)          # split="test": the t10k files
        >>> images.shape, images.dtype, labels.tolist()
        (torch.Size([2, 28, 28]), torch.float32, [7, 2])
    """
    if not isinstance(split, str) or split not in _FILES:
        raise ValueError(f"unknown split={split!r}; choose 'test' or 'train'")
    directory = find_mnist_dir(mnist_dir)
    if directory is None:
        raise IDXError(f"no MNIST directory: pass mnist_dir, set ${ENV}, or put the IDX files "
                       "in ../shared/data/mnist")
    if not directory.is_dir():
        where = "mnist_dir" if mnist_dir is not None else f"${ENV}"
        raise IDXError(f"{directory}: no such MNIST directory (from {where})")
    img_path, lab_path = (_locate(directory, s) for s in _FILES[split])
    images, labels = read_idx(img_path), read_idx(lab_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise IDXError(f"{img_path}: expected uint8 images (N, rows, cols), got "
                       f"{images.dtype} {images.shape}")
    n, rows, cols = images.shape
    if n == 0:
        raise IDXError(f"{img_path}: the header announces 0 images; expected at least 1")
    if rows == 0 or cols == 0:
        raise IDXError(f"{img_path}: the header announces images of {rows} x {cols} pixels "
                       "(rows x cols); expected at least 1 x 1")
    if labels.ndim != 1 or len(labels) != len(images):
        raise IDXError(f"{lab_path}: {labels.shape} labels for {len(images)} images")
    if labels.max(initial=0) > 9:
        raise IDXError(f"{lab_path}: label {labels.max()} out of range 0-9")
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    return x, torch.from_numpy(labels.astype(np.int64))
