"""mkdocs hooks (see mkdocs.yml).

- The home page is README.md: docs/index.md is a stub whose page shows README.md, with the
  links rewritten from the repository root's view (``docs/solve.md``) to the site's
  (``solve.md``), and its title's anchor renamed (``#home``: ``#paraprop`` is the package's).
- The docstrings cross-reference in Sphinx's roles (``:func:`paraprop.solve```), which Markdown
  renders as ``:func:<code>paraprop.solve</code>``. Each becomes an optional cross-reference:
  a link where the reference documents the name, plain code where it does not.
"""

import html
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj):<code>(~?)([\w.]+)</code>")


def on_page_markdown(markdown, page, **kwargs):
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
