"""The package surface: every documented subpackage is reachable from ``import paraprop``."""

import subprocess
import sys

import pytest

import paraprop


@pytest.mark.parametrize("name", paraprop.SUBPACKAGES)
def test_subpackage_is_an_attribute(name):
    module = getattr(paraprop, name)
    assert module.__name__ == f"paraprop.{name}"
    assert name in dir(paraprop)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'paraprop' has no attribute 'nope'"):
        paraprop.nope  # noqa: B018


def test_import_paraprop_alone_reaches_nn():
    out = subprocess.run([sys.executable, "-c", "import paraprop; print(paraprop.nn.GRU.__name__)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "GRU"


def test_bppsa_lives_under_jacobians():
    code = ("import paraprop; print(paraprop.jacobians.bppsa.__name__, "
            "hasattr(paraprop, 'bppsa'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["paraprop.jacobians.bppsa", "False"]
