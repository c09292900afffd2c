"""Data: the embedded digits and the MNIST IDX reader, including broken files."""

import gzip
import struct

import numpy as np
import pytest
import torch

from paraprop.data import IDXError, find_mnist_dir, load_digits, load_mnist, read_idx, write_idx


def _write_idx(path, arr, code=0x08, gz=False):
    header = bytes([0, 0, code, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if gz else data)


def test_digits():
    x, y = load_digits()
    assert x.shape == (1797, 8, 8) and x.dtype == torch.float32
    assert 0 <= float(x.min()) and float(x.max()) == 1.0 and set(y.tolist()) == set(range(10))


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip_and_loader(tmp_path, gz):
    imgs = np.random.default_rng(0).integers(0, 256, (5, 28, 28))
    labs = np.arange(5)
    suffix = ".gz" if gz else ""
    _write_idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}", imgs, gz=gz)
    _write_idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}", labs, gz=gz)
    assert np.array_equal(read_idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}"), imgs)
    x, y = load_mnist(tmp_path)
    assert x.shape == (5, 28, 28) and y.tolist() == [0, 1, 2, 3, 4]
    assert torch.allclose(x * 255, torch.tensor(imgs, dtype=torch.float32))


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(("dtype", "code"), [(np.uint8, 0x08), (np.int8, 0x09), (np.int16, 0x0B),
                                             (np.int32, 0x0C), (np.float32, 0x0D),
                                             (np.float64, 0x0E)])
def test_write_idx_round_trips_every_idx_type(tmp_path, dtype, code, gz):
    array = (np.arange(-12, 12) * 3).reshape(2, 3, 4).astype(dtype)
    path = tmp_path / ("x-idx3" + (".gz" if gz else ""))
    assert write_idx(path, array) == path
    back = read_idx(path)
    assert back.dtype.kind == array.dtype.kind and back.dtype.itemsize == array.dtype.itemsize
    assert back.shape == array.shape and np.array_equal(back, array)
    raw = gzip.decompress(path.read_bytes()) if gz else path.read_bytes()
    assert raw[:4] == bytes([0, 0, code, 3]) and raw[4:16] == b"".join(
        n.to_bytes(4, "big") for n in (2, 3, 4))
    assert raw[16:] == array.astype(array.dtype.newbyteorder(">")).tobytes()  # big-endian


def test_write_idx_refusals(tmp_path):
    with pytest.raises(TypeError, match="array must be a numpy array, got list"):
        write_idx(tmp_path / "a", [1, 2])
    for dtype in (np.int64, np.float16, np.bool_):
        with pytest.raises(ValueError, match=f"dtype {np.dtype(dtype)}, which IDX has no type"):
            write_idx(tmp_path / "a", np.zeros(3, dtype))
    with pytest.raises(ValueError, match=r"shape \(\); IDX holds one or more dimensions"):
        write_idx(tmp_path / "a", np.array(3, np.uint8))
    huge = np.broadcast_to(np.zeros(1, np.uint8), (2, 2**32))   # no memory behind it
    with pytest.raises(ValueError, match=r"shape \(2, 4294967296\); .*each below 2\*\*32"):
        write_idx(tmp_path / "a", huge)
    assert not (tmp_path / "a").exists()


def test_truncated_bad_magic_and_corrupt_gzip(tmp_path):
    imgs = np.zeros((3, 4, 4))
    p = tmp_path / "a-idx3-ubyte"
    _write_idx(p, imgs)
    p.write_bytes(p.read_bytes()[:-5])
    with pytest.raises(IDXError, match=r"a-idx3-ubyte: \d+ bytes, expected \d+ .*truncated"):
        read_idx(p)
    p.write_bytes(b"\x12\x34\x08\x03rest")
    with pytest.raises(IDXError, match="a-idx3-ubyte: bad magic number 12340803"):
        read_idx(p)
    g = tmp_path / "b-idx3-ubyte.gz"
    g.write_bytes(b"not gzip at all")
    with pytest.raises(IDXError, match=r"b-idx3-ubyte.gz: cannot be read as gzip"):
        read_idx(g)
    with pytest.raises(IDXError, match="no such file"):
        read_idx(tmp_path / "missing")


def test_mismatched_label_count(tmp_path):
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((4, 28, 28)))
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(3))
    with pytest.raises(IDXError, match=r"t10k-labels-idx1-ubyte: \(3,\) labels for 4 images"):
        load_mnist(tmp_path)
    with pytest.raises(ValueError, match="unknown split='valid'"):
        load_mnist(tmp_path, split="valid")


def test_env_variable_selects_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PARAPROP_MNIST_DIR", str(tmp_path))
    assert find_mnist_dir() == tmp_path


def test_official_mnist_test_set():
    directory = find_mnist_dir()
    if directory is None or not directory.is_dir():
        pytest.skip("MNIST test set not found (set PARAPROP_MNIST_DIR or ../shared/data/mnist)")
    x, y = load_mnist(directory)
    assert x.shape == (10000, 28, 28) and y.shape == (10000,)
    assert y[:5].tolist() == [7, 2, 1, 0, 4]


def test_corrupt_deflate_stream_names_the_file(tmp_path):
    # a valid gzip header (magic, deflate, no flags) followed by an invalid deflate block
    g = tmp_path / "c-idx3-ubyte.gz"
    g.write_bytes(b"\x1f\x8b\x08\x00" + struct.pack("<I", 0) + b"\x00\xff" + b"\xff" * 16)
    with pytest.raises(IDXError, match=r"c-idx3-ubyte.gz: cannot be read as gzip"):
        read_idx(g)


def test_truncated_header(tmp_path):
    p = tmp_path / "h-idx3-ubyte"
    p.write_bytes(bytes([0, 0, 0x08, 3]) + (5).to_bytes(4, "big"))
    with pytest.raises(IDXError, match=r"h-idx3-ubyte: truncated header \(8 bytes, 3 dims\)"):
        read_idx(p)


def test_loader_rejects_bad_contents(tmp_path):
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(2))
    imgs = tmp_path / "t10k-images-idx3-ubyte"
    arr = np.zeros((2, 3, 3), dtype=">i2")
    imgs.write_bytes(bytes([0, 0, 0x0B, 3]) + b"".join(int(n).to_bytes(4, "big")
                                                        for n in arr.shape) + arr.tobytes())
    with pytest.raises(IDXError, match=r"t10k-images-idx3-ubyte: expected uint8 images"):
        load_mnist(tmp_path)
    _write_idx(imgs, np.zeros((2, 3, 3)))
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([3, 12]))
    with pytest.raises(IDXError, match=r"t10k-labels-idx1-ubyte: label 12 out of range 0-9"):
        load_mnist(tmp_path)


def test_no_mnist_directory(monkeypatch):
    import paraprop.data.mnist as mnist

    monkeypatch.setattr(mnist, "find_mnist_dir", lambda mnist_dir=None: None)
    with pytest.raises(IDXError, match=r"no MNIST directory: pass mnist_dir, set \$PARAPROP"):
        load_mnist()


def test_gzip_that_expands_beyond_its_header_is_not_expanded(tmp_path):
    """A decompression bomb: a header for 3 images of 4x4, then 64 MB of zeros that compress
    to about 64 kB. Only what the header announces (plus one byte) is decompressed."""
    header = bytes([0, 0, 0x08, 3]) + b"".join(n.to_bytes(4, "big") for n in (3, 4, 4))
    g = tmp_path / "bomb-idx3-ubyte.gz"
    with gzip.open(g, "wb") as f:
        f.write(header)
        for _ in range(64):
            f.write(bytes(1 << 20))
    assert g.stat().st_size < 1 << 17
    with pytest.raises(IDXError, match=r"bomb-idx3-ubyte.gz: more than the 64 bytes expected "
                                       r"for shape \(3, 4, 4\) \(trailing data"):
        read_idx(g)


@pytest.mark.parametrize("gz", [False, True])
def test_header_that_announces_more_than_the_file_holds(tmp_path, gz):
    """A header of 10**9 images of 10**4 x 10**4 pixels (10**17 bytes, past int64 products of
    numpy) in a file of a few bytes: refused from the header, nothing that size is read."""
    header = bytes([0, 0, 0x08, 3]) + b"".join(int(n).to_bytes(4, "big")
                                               for n in (10**9, 10**4, 10**4))
    p = tmp_path / ("huge-idx3-ubyte" + (".gz" if gz else ""))
    p.write_bytes(gzip.compress(header + bytes(16)) if gz else header + bytes(16))
    match = (r"huge-idx3-ubyte.gz: the header announces shape \(1000000000, 10000, 10000\) "
             r"\(100000000000000000 bytes\), more than a gzip file of \d+ bytes can hold"
             if gz else r"huge-idx3-ubyte: 32 bytes, expected 100000000000000016 for shape "
             r"\(1000000000, 10000, 10000\)")
    with pytest.raises(IDXError, match=match):
        read_idx(p)
