"""Griffe extension (see mkdocs.yml): reads paraprop's docstring conventions as Google style.

- ``Example:`` (the house heading, DESIGN.md) is read as ``Examples:``, so the doctest lines
  render as code.
- ``a, b: text`` in an ``Arguments:`` (or ``Attributes:``) section documents ``a`` and ``b``
  together; it is read as one entry per name with the same text, so every parameter name is
  still checked against the signature.
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


class HouseStyle(griffe.Extension):
    def on_object(self, *, obj, **kwargs):
        if obj.is_alias or obj.docstring is None:
            return
        value = HEADING.sub(r"\1Examples:", obj.docstring.value)
        obj.docstring.value = _split_grouped(value)
