"""mkdocs hooks (see mkdocs.yml).

- The home page is README.md: docs/index.md is a stub whose page shows README.md, with the
  links rewritten from the repository root's view (``docs/solve.md``) to the site's
  (``solve.md``), and its title's anchor renamed (``#home``: ``#paraprop`` is the package's).
- The examples are part of the site: examples/README.md is the page ``examples/`` and the
  scripts it links to are served beside it, as they are in the repository.
- The docstrings cross-reference in Sphinx's roles (``:func:`paraprop.solve```), which Markdown
  renders as ``:func:<code>paraprop.solve</code>``. Each becomes an optional cross-reference:
  a link where the reference documents the name, plain code where it does not.
- A reference page ends with its package's constants (the names of its ``__all__`` that are
  neither classes, functions nor modules), name and value, each with an anchor
  (``#paraprop.nn.FORWARD_TOL``; ``__version__`` has none): the rendered reference leaves
  them out of the listing of classes and functions (docs/_ext/griffe_house_style.py).
"""

import html
import importlib
import inspect
import re
import types
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj):<code>(~?)([\w.]+)</code>")
TARGET = re.compile(r"^:::\s+(paraprop[\w.]*)\s*$", flags=re.M)


def on_files(files, config, **kwargs):
    for path in sorted(EXAMPLES.iterdir()):
        if path.is_file() and path.suffix in (".md", ".py"):
            files.append(File.generated(config, f"examples/{path.name}",
                                        abs_src_path=str(path)))
    return files


def _show(value) -> str:
    """A constant's value as a reader would write it (classes by name, dtypes as torch's)."""
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, tuple | list):
        inner = ", ".join(_show(v) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})" if isinstance(value, tuple) \
            else f"[{inner}]"
    if isinstance(value, frozenset | set):
        return "{" + ", ".join(sorted(_show(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_show(k)}: {_show(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _constants(markdown: str) -> str:
    rows = []
    for target in TARGET.findall(markdown):
        try:
            module = importlib.import_module(target)
        except ImportError:
            continue  # a function's own block
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if (isinstance(value, types.ModuleType)
                    or inspect.isclass(value) or callable(value)):
                continue
            # (an anchor's id is Markdown: a dunder's underscores would read as emphasis)
            anchor = "" if name.startswith("_") else f"[](){{#{target}.{name}}}"
            rows.append(f"| {anchor}`{name}` | `{_show(value)}` |")
    if not rows:
        return markdown
    return markdown.rstrip() + "\n\n## Constants\n\n| name | value |\n|---|---|\n" + \
        "\n".join(rows) + "\n"


def on_page_markdown(markdown, page, **kwargs):
    if page.file.src_uri.startswith("reference/"):
        return _constants(markdown)
    if page.file.src_uri != "index.md":
        return markdown
    text = re.sub(r"\]\(docs/", "](", README.read_text(encoding="utf-8"))
    return re.sub(r"\A# (.*)", r"# \1 { #home }", text)


def _autoref(match: re.Match) -> str:
    short, target = match.groups()
    shown = target.rsplit(".", 1)[-1] if short else target
    # resolved (or left as plain code, since it is optional) by the autorefs plugin
    return (f'<autoref identifier="{html.escape(target)}" optional>'
            f"<code>{html.escape(shown)}</code></autoref>")


def on_page_content(html_text, page, **kwargs):
    return ROLE.sub(_autoref, html_text)
