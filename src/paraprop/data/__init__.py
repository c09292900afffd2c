"""Data sets: the digits inside scikit-learn (embedded default), MNIST from IDX files, two moons,
the text of Python's own documentation topics, and BPPSA's synthetic bitstreams."""

from paraprop.data.bitstreams import bitstreams
from paraprop.data.digits import load_digits
from paraprop.data.mnist import IDXError, find_mnist_dir, load_mnist, read_idx, write_idx
from paraprop.data.moons import make_moons
from paraprop.data.text import CharVocab, load_text

__all__ = ["CharVocab", "IDXError", "bitstreams", "find_mnist_dir", "load_digits", "load_mnist",
           "load_text", "make_moons", "read_idx", "write_idx"]
