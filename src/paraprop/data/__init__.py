"""Data sets: the digits inside scikit-learn (embedded default), MNIST from IDX files, two moons."""

from paraprop.data.digits import load_digits
from paraprop.data.mnist import IDXError, find_mnist_dir, load_mnist, read_idx
from paraprop.data.moons import make_moons

__all__ = ["IDXError", "find_mnist_dir", "load_digits", "load_mnist", "make_moons", "read_idx"]
