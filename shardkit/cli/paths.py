"""Paths as the user typed them: what the commands print for a file.

A command reads files named by a path, a glob or a url, and names each one it
reports on. It names it the way the user wrote the argument that led to it:

- relative to the working directory when the argument was relative (a path or
  a glob, quoted or expanded by the shell), normalised: ``../x/y``, never
  ``/cwd/../x/y`` nor ``./x``;
- absolute when the argument was absolute (normalised too);
- a url (``s3://...``, ``file://...``) exactly as listed.

A relative name is read relative to the same working directory, so the name
printed is also the name read, and errors from the readers carry it as is.
"""

from __future__ import annotations

import os


def is_url(text: str) -> bool:
    """Whether ``text`` is an fsspec url (``s3://...``) rather than a local path."""
    return "://" in text


def shown(url: str, typed: str) -> str:
    """``url`` (a file that the argument ``typed`` named) as the user would write it (see the module doc)."""
    if is_url(url):
        return url
    if typed.startswith("file://"):  # a local listing drops the protocol the user gave
        return f"file://{os.path.normpath(url)}"
    if is_url(typed):
        return url
    if os.path.isabs(typed):
        return os.path.normpath(os.path.abspath(url))
    return os.path.relpath(os.path.abspath(url))


def key(url: str) -> str:
    """One spelling per file, to compare names that arrived in different forms (relative, absolute)."""
    return url if is_url(url) else os.path.normpath(os.path.abspath(url))
