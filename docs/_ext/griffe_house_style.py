"""Griffe extension (see mkdocs.yml): reads paraprop's docstring conventions as Google style.

- ``Example:`` (the house heading of the docstrings) is read as ``Examples:``, so the doctest lines
  render as code.
- ``a, b: text`` in an ``Arguments:`` (or ``Attributes:``) section documents ``a`` and ``b``
  together; it is read as one entry per name with the same text, so every parameter name is
  still checked against the signature.
- What the reference shows of a package is its classes and functions. Once the package is
  loaded (after griffe's dataclasses extension has made the ``__init__`` signatures), this
  extension removes from the tree: module-level constants (and the package's aliases of them),
  dunder methods (``__call__``, ``__repr__``, ``__post_init__``, ...; ``__init__`` stays,
  merged into its class's signature) and class attributes without a docstring of their own (a
  dataclass's fields are in its ``Attributes:`` section). (Marking them not public would not
  do: griffe re-wraps an alias's members, and the wrappers forget the mark.) The constants are
  listed at the end of their package's page by docs/_ext/hooks.py; private bases are left out
  of "Bases:" by the class template (docs/_ext/templates/).
"""

import re

import griffe

HEADING = re.compile(r"^(\s*)Example:\s*$", flags=re.M)
SECTIONS = re.compile(r"^(\s*)(?:Arguments|Args|Parameters|Attributes):\s*$")
GROUPED = re.compile(r"^(\s+)(\w+(?:\s*,\s*\w+)+):(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split_grouped(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i, section_indent = 0, None
    while i < len(lines):
        line = lines[i]
        if m := SECTIONS.match(line):
            section_indent = len(m.group(1))
        elif line.strip() and section_indent is not None and _indent(line) <= section_indent:
            section_indent = None
        m = GROUPED.match(line) if section_indent is not None else None
        if m and _indent(line) > section_indent:
            indent, names, first = m.groups()
            rest, j = [], i + 1
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > len(indent)):
                if not lines[j].strip() and (j + 1 >= len(lines)
                                             or _indent(lines[j + 1]) <= len(indent)):
                    break
                rest.append(lines[j])
                j += 1
            for name in re.split(r"\s*,\s*", names):
                out += [f"{indent}{name}:{first}", *rest]
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _is_constant(member) -> bool:
    if member.is_alias:
        try:
            member = member.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return False  # an external name: not ours to hide
    return member.is_attribute


def _not_api(obj, out: list) -> list:
    """``(parent, name)`` of what is not API in ``obj`` and under it (see the module docstring);
    collected first and removed after, so that every alias still resolves while it is judged."""
    for name, member in obj.members.items():
        if obj.is_module and name != "__all__" and _is_constant(member):
            out.append((obj, name))
        elif member.is_alias:
            continue
        elif obj.is_class and name.startswith("__") and name.endswith("__") and name != "__init__":
            out.append((obj, name))
        elif obj.is_class and member.is_attribute and member.docstring is None:
            out.append((obj, name))
        elif member.is_module or member.is_class:
            _not_api(member, out)
    return out


class HouseStyle(griffe.Extension):
    def on_module(self, *, mod, **kwargs):
        # fired for a loaded package after every extension's on_package (griffe's dataclasses
        # extension, which griffe adds after this one, makes the __init__ signatures there)
        if mod.path == "paraprop":
            for parent, name in _not_api(mod, []):
                parent.del_member(name)

    def on_object(self, *, obj, **kwargs):
        if obj.is_alias or obj.docstring is None:
            return
        value = HEADING.sub(r"\1Examples:", obj.docstring.value)
        obj.docstring.value = _split_grouped(value)
