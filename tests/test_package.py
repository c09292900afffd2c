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


def test_version_is_the_one_in_pyproject():
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    assert paraprop.__version__ == declared
    assert re.search(rf"^## \[(Unreleased|{re.escape(declared)})\]",
                     (root / "CHANGELOG.md").read_text(), re.M)


def test_the_typed_marker_ships():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert (root / "src" / "paraprop" / "py.typed").exists()
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in data["package-data"]["paraprop"]
