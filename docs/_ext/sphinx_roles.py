"""A griffe extension for the docs build: the reST bits of docstrings, in Markdown.

shardkit's docstrings cross-reference with Sphinx roles (``:func:`~shardkit.plan```)
and introduce code blocks with a paragraph ending in ``::``, which Markdown
would show verbatim. This turns each role into inline code holding the name
as a reader would type it (the last component with ``~``, the full path
otherwise), and a closing ``::`` into ``:`` (the indented block after it is
already a code block in Markdown, as reST double backticks are inline code).
The project writes usage examples under ``Example:``; griffe's Google parser
knows the section as ``Examples:`` (any other title is an admonition, in
which ``>>>`` lines would show as quotes), so the title is renamed.
Loaded by ``mkdocs.yml`` (mkdocstrings ``extensions``); it never touches the
package itself.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
LITERAL_MARKER = re.compile(r"(?<=\S)::$", flags=re.MULTILINE)
EXAMPLE_TITLE = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.MULTILINE)


def _plain(match: re.Match[str]) -> str:
    short, target = match.groups()
    if short:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def replace_roles(text: str) -> str:
    """``text`` with every Sphinx cross-reference role replaced by inline code,
    a ``::`` that ends a line (a reST literal-block marker) by ``:``, and an
    ``Example:`` section title by ``Examples:``."""
    text = EXAMPLE_TITLE.sub(r"\1Examples:", text)
    return LITERAL_MARKER.sub(":", ROLE.sub(_plain, text))


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = replace_roles(obj.docstring.value)
