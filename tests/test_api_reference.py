"""Every public name is in the API reference (docs/reference/*.md, built by ``make docs``).

A package's public names are its ``__all__`` (or, without one, the names it defines that do not
start with ``_``). The public packages are ``paraprop`` and its subpackages, found on disk, plus the
modules of ``paraprop.SUBPACKAGES`` (the lab behind the ``paraprop`` command, ``paraprop_lab``, is a
package of its own and not API). A name is in the reference when a ``::: target`` block of a
reference page documents it: directly (the target is the object, e.g. ``::: paraprop.solve.solve``
for a function that shares its module's name), or as a member of its documented package.
mkdocstrings renders a package's ``__all__`` but reads the source statically, so two kinds of names
need a block of their own: modules (submodules are not rendered inline) and names that are also a
submodule's name (``paraprop.solve`` the function and ``paraprop/solve.py`` the module: the static
reader sees the module). The checks read the pages and import the package; they do not need mkdocs.
"""

import importlib
import pkgutil
import re
import types
from pathlib import Path

import pytest

import paraprop

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"


def _public_packages() -> list[str]:
    found = {m.name for m in pkgutil.iter_modules(paraprop.__path__) if m.ispkg}
    names = sorted(found | set(paraprop.SUBPACKAGES))
    return ["paraprop", *(f"paraprop.{n}" for n in names)]


def _public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return sorted(n for n, v in vars(module).items() if not n.startswith("_")
                  and getattr(v, "__module__", None) == module.__name__)


def _submodule_names(module: types.ModuleType) -> set[str]:
    return {m.name for m in pkgutil.iter_modules(getattr(module, "__path__", []))}


def _targets() -> dict[str, list[str] | None]:
    """``::: target`` -> the members its options restrict it to (``None``: all public ones)."""
    out = {}
    for page in sorted(REFERENCE.glob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^:::\s+([\w.]+)\s*$", line)
            if not m:
                continue
            members = None
            for option in lines[i + 1:]:
                if option.strip() and not option.startswith(" "):
                    break
                if o := re.match(r"^\s+members:\s*(.*)$", option):
                    value = o.group(1).strip()
                    members = ([] if value in ("false", "[]", "")
                               else re.findall(r"\w+", value))
            out[m.group(1)] = members
    return out


def _resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _documented(package: str, name: str, targets: dict) -> bool:
    module = importlib.import_module(package)
    obj = getattr(module, name)
    shadowed = name in _submodule_names(module) and not isinstance(obj, types.ModuleType)
    if f"{package}.{name}" in targets and not shadowed:  # (a shadowed path renders the module)
        return True
    if not isinstance(obj, int | float | str | bool | tuple | frozenset | type(None)):
        for target in targets:  # the object itself, documented under its defining module
            if _resolve(target) is obj:
                return True
    members = targets.get(package, [])
    return (package in targets and (members is None or name in members)
            and not isinstance(obj, types.ModuleType) and not shadowed)


def test_every_target_exists():
    for target in _targets():
        _resolve(target)  # raises: a stale target after a module moved


def test_every_public_package_has_a_page():
    targets = _targets()
    missing = [p for p in _public_packages() if p not in targets]
    assert not missing, f"add docs/reference/<name>.md with '::: {missing[0]}' for: {missing}"


@pytest.mark.parametrize("package", _public_packages())
def test_every_public_name_is_in_the_reference(package):
    targets = _targets()
    module = importlib.import_module(package)
    missing = [n for n in _public_names(module) if not _documented(package, n, targets)]
    assert not missing, (
        f"public names of {package} not in docs/reference/*.md: {missing}; a module or a name "
        f"shared with a submodule needs its own '::: {package}.<module>[.<name>]' block")


def test_every_reference_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = [p.name for p in REFERENCE.glob("*.md")]
    assert pages
    missing = [p for p in pages if f"reference/{p}" not in config]
    assert not missing, f"add to mkdocs.yml's nav: {missing}"
