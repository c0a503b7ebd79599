"""Globbing shard files on any fsspec filesystem: brace expansion, one listing per directory, identities kept.

:meth:`ShardList.from_glob <shardkit.shardlist.ShardList.from_glob>` is a
container's constructor; the I/O it needs is here, below it. Brace groups are
expanded first (ranges ``{00000..00127}`` with their zero padding, lists
``{train,val}``), then each part is globbed; a part without glob characters
names one file, looked up with one listing per directory rather than a HEAD
per file. A remote listing reports every file's identity
(:func:`shardkit.io.identity.identity`) for free: those are remembered
(:func:`~shardkit.io.identity.remember`), so the counts cache checks its rows
against them instead of listing the directories again in every reader.

What is wrong with the result (nothing matched, a file named that does not
exist, a directory named) is for the caller to say: :class:`Matches` reports
it, and the container raises its own error.

Every listing request is bounded and retried as a ranged read is
(:class:`~shardkit.io.retry.RetryPolicy`): a transient failure (a reset, a
5xx) is tried again, and a listing that still fails raises
:class:`~shardkit.io.retry.RemoteReadError` naming the url, the time spent
and the option that raises the bound. Over HTTP(S), where listing a
directory is one GET of its page, each call is given ``retry.timeout``
seconds (fsspec's HTTP filesystem would wait up to aiohttp's 5 minutes).
Elsewhere a glob may take many requests (S3 lists 1,000 keys per request),
so it is not cut short as a whole: each of its requests is bounded by the
store's client (botocore: 60 s to connect and 60 s to read, set with
``storage_options={"config_kwargs": {...}}``).
"""

from __future__ import annotations

import posixpath
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, Final, NamedTuple

import fsspec
from fsspec.implementations.local import LocalFileSystem

from shardkit.io.identity import identity, remember
from shardkit.io.retry import RemoteReadError, RetryPolicy, retried_call

__all__ = ["Matches", "expand_braces", "glob_files"]

_GLOB_MAGIC: Final = re.compile(r"[*?\[]")
_RANGE: Final = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


class Matches(NamedTuple):
    """What a pattern matched: ``files`` as sorted (url, byte size or None) pairs; ``missing``, the paths
    named without wildcards that are not files; ``directory``, the first of those that is a directory."""

    files: list[tuple[str, int | None]]
    missing: list[str]
    directory: str | None


def glob_files(pattern: str, storage_options: Mapping[str, Any] | None, retry: RetryPolicy | None = None) -> Matches:
    """The files ``pattern`` matches. Urls keep their protocol (``s3://...``) except on the local
    filesystem, where they are absolute paths. The filesystem's own errors are raised unredacted.
    Listing requests are bounded and retried under ``retry`` (default :class:`RetryPolicy`)."""
    fs, path = fsspec.core.url_to_fs(pattern, **dict(storage_options or {}))
    lister = _Lister(fs, retry or RetryPolicy())
    sizes: dict[str, int | None] = {}
    identities: dict[str, str | None] = {}
    literal: list[str] = []
    for part in expand_braces(path):
        if _GLOB_MAGIC.search(part):
            listed: dict[str, dict[str, Any]] = lister.call("glob", part, detail=True)
            found = {name: info for name, info in listed.items() if info.get("type") != "directory"}
            for name, info in found.items():
                sizes[name] = info.get("size")
                identities[name] = identity(info)
        else:
            literal.append(part)
    local = isinstance(fs, LocalFileSystem)
    if identities and not local:  # the counts cache checks these, not a new listing
        remember([fs.unstrip_protocol(name) for name in identities], list(identities.values()))
    missing = _stat_literal(lister, literal, sizes)
    directory = next((m for m in missing if lister.call("isdir", m)), None)
    files = sorted((name if local else fs.unstrip_protocol(name), size) for name, size in sizes.items())
    return Matches(files, missing, directory)


class _Lister:
    """Calls to one filesystem's listing methods, each bounded and retried under ``retry``
    (:func:`~shardkit.io.retry.retried_call`; see the module doc)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, retry: RetryPolicy) -> None:
        self.fs, self.retry = fs, retry

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            return retried_call(self.fs, method, path, retry=self.retry, **kwargs)
        except RemoteReadError as error:  # say where the bound of a dataset's listing is set
            raise RemoteReadError(f"{error} ({_OWN_LISTING})") from error


_OWN_LISTING: Final = (
    "a dataset lists its glob under its own retry=: give it retry=RetryPolicy(timeout=...), "
    "or list it yourself with ShardList.from_glob(pattern, retry=RetryPolicy(timeout=...))"
)


def _stat_literal(lister: _Lister, paths: Iterable[str], sizes: dict[str, int | None]) -> list[str]:
    """Record the sizes of existing files among ``paths`` with one listing per
    directory; return the paths that are not files."""
    by_dir: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        by_dir[posixpath.dirname(path.rstrip("/"))].append(path.rstrip("/"))
    missing = []
    for directory, wanted in by_dir.items():
        try:
            listing = {info["name"].rstrip("/"): info for info in lister.call("ls", directory, detail=True)}
        except FileNotFoundError:
            listing = {}
        for path in wanted:
            info = listing.get(path)
            if info is None or info.get("type") == "directory":
                missing.append(path)
            else:
                sizes[path] = info.get("size")
    return missing


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{a,b}`` lists and ``{00..12}`` ranges (zero padding kept),
    left to right and nested; braces that are neither stay literal."""
    open_at = pattern.find("{")
    while open_at != -1:
        close_at, options = _brace_group(pattern, open_at)
        if options is not None:
            head, tails = pattern[:open_at], expand_braces(pattern[close_at + 1 :])
            return [head + option + tail for part in options for option in expand_braces(part) for tail in tails]
        open_at = pattern.find("{", open_at + 1)
    return [pattern]


def _brace_group(pattern: str, open_at: int) -> tuple[int, list[str] | None]:
    """The index of the brace closing ``pattern[open_at]`` and the group's
    alternatives, or None when the group is not an expansion."""
    depth, parts, start = 0, [], open_at + 1
    for i in range(open_at + 1, len(pattern)):
        char = pattern[i]
        if char == "{":
            depth += 1
        elif char == "}" and depth:
            depth -= 1
        elif char == "}":
            parts.append(pattern[start:i])
            if len(parts) > 1:
                return i, parts
            bounds = _RANGE.match(parts[0])
            return i, (_number_range(*bounds.groups()) if bounds else None)
        elif char == "," and not depth:
            parts.append(pattern[start:i])
            start = i + 1
    return -1, None


def _number_range(first: str, last: str) -> list[str]:
    low, high = int(first), int(last)
    padded = any(len(b.lstrip("-")) > 1 and b.lstrip("-").startswith("0") for b in (first, last))
    width = max(len(first), len(last)) if padded else 0
    step = 1 if high >= low else -1
    return [f"{value:0{width}d}" for value in range(low, high + step, step)]
