"""What the file commands share: the files a command's arguments name, each checked in turn
with one line per failure, record counts from index files, and progress bars.

``inspect``, ``verify``, ``index`` and ``plan`` all take shard files; every one is
checked even after a failure (:func:`each_file`), and the worst exit code wins.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from typing import Any

from shardkit.cli.exits import EXIT_OK, fail, stdout_closed

GLOB_CHARS = re.compile(r"[*?\[{]")


def expand(pattern: str) -> list[str]:
    """The files ``pattern`` names: itself, or the sorted matches of a glob (``*?[`` or ``{a,b}``), where a
    Megatron ``X.bin`` and ``X.idx`` are one pair, named once by its ``.bin``."""
    if not GLOB_CHARS.search(pattern):
        return [pattern]
    from shardkit.shardlist import ShardList

    urls = ShardList.from_glob(pattern).urls()
    pairs = {url[:-4] for url in urls if url.endswith(".bin")}
    return [url for url in urls if not (url.endswith(".idx") and url[:-4] in pairs)]  # a Megatron pair once


def each_file(args: argparse.Namespace, job: Callable[[str], Any], listed: Sequence[str] = ()) -> int:
    """Run ``job(url)`` on every file in ``listed`` (taken literally) and every file
    ``args.urls`` names, even after failures; report each failure on its own line
    and return the worst exit code."""
    status = _run_each(args, job, listed)
    for pattern in args.urls:
        try:
            urls = expand(pattern)
        except Exception as error:  # noqa: BLE001 - reported, then the next pattern
            status = max(status, fail(args, error, pattern))
            continue
        status = max(status, _run_each(args, job, urls))
    return status


def _run_each(args: argparse.Namespace, job: Callable[[str], Any], urls: Sequence[str]) -> int:
    status = EXIT_OK
    for url in urls:
        try:
            if not _skipped(url):
                job(url)
        except Exception as error:  # noqa: BLE001 - one line per bad file, then the next
            if isinstance(error, BrokenPipeError) and stdout_closed():
                raise  # nobody reads on: main ends quietly
            status = max(status, fail(args, error, url))
    return status


def _skipped(url: str) -> bool:
    """Whether ``url`` is an index or manifest file, not shard data (say so): a glob such as
    ``data/*`` picks them up beside the shards, and they are not corrupt shards."""
    from shardkit.formats.sniff import SNIFF_BYTES, not_a_shard
    from shardkit.io.files import open_raw

    head = b""
    if "://" not in url or url.startswith("file://"):  # a remote file is not opened twice: its suffix decides
        try:
            with open_raw(url, "rb") as f:
                head = f.read(SNIFF_BYTES)
        except OSError:
            return False  # the command's own reading reports it
    what = not_a_shard(url, head)
    if what is not None:
        print(f"skipped {url}: {what}")
    return what is not None


def index_counts(urls: list[str]) -> list[int | None]:
    """Each file's record count from the index file beside it, None where there is none.

    Each index is checked against its file (:func:`~shardkit.formats.tfrecord.index.load_index`):
    a stale or corrupt one is an error naming both files, never a wrong count.
    """
    import posixpath

    import fsspec

    from shardkit.formats.offsets import implicit_index_for
    from shardkit.io.retry import retried_call

    located = {url: implicit_index_for(url) for url in urls}  # None: a url with a query string has no index
    indexes = {url: (index, *fsspec.core.url_to_fs(index)) for url, index in located.items() if index is not None}
    by_directory: dict[Any, set[str]] = {}
    for _, fs, path in indexes.values():
        by_directory.setdefault((fs, posixpath.dirname(path)), set()).add(path)
    present: set[str] = set()
    for (fs, directory), wanted in by_directory.items():
        try:  # one listing per directory rather than one request per file
            present.update(wanted.intersection(retried_call(fs, "ls", directory, detail=False)))
        except Exception:  # noqa: BLE001 - a store that cannot list (plain HTTP): ask per file
            present.update(path for path in wanted if retried_call(fs, "isfile", path))
    none = ("", None, "")
    return [_indexed_count(url, indexes.get(url, none)[0], indexes.get(url, none)[2] in present) for url in urls]


def _indexed_count(url: str, index: str, present: bool) -> int | None:
    """``url``'s record count without reading its records: its index file (checked against the file), or the
    count the file or its dataset holds (a Parquet or ArrayRecord footer, MDS's index.json)."""
    from shardkit.formats.tfrecord.index import load_index

    fmt = _named_format(url)
    if fmt is not None and fmt.name in _COUNTS_INSIDE:
        return fmt.stored_count(url)
    if not present:
        return None
    if fmt is not None and hasattr(fmt, "index_offsets"):
        offsets = fmt.index_offsets(url)
        return None if offsets is None else len(offsets)
    offsets = load_index(url, index)
    return None if offsets is None else len(offsets)


_COUNTS_INSIDE = ("parquet", "array_record", "mds")
"""Formats whose files (footers) or datasets (MDS's index.json) hold their record counts: no index file beside them."""


def _named_format(url: str) -> Any:
    """The format ``url``'s suffix names, other than TFRecord (which this module reads itself); None otherwise."""
    from shardkit.formats.base import FormatError
    from shardkit.formats.registry import format_for

    try:
        fmt = format_for(url, head=b"")
    except FormatError:
        return None
    return None if fmt.name == "tfrecord" else fmt


def format_of(url: str) -> Any:
    """The format of the file at ``url`` (suffix, then first bytes), None for TFRecord or unknown."""
    from shardkit.formats.base import FormatError
    from shardkit.formats.registry import format_for

    try:
        fmt = format_for(url)
    except FormatError:
        return None  # TFRecord, perhaps compressed: its reader says what is wrong
    return None if fmt.name == "tfrecord" else fmt


def _progress_bar(url: str, compression: str | None, storage_options: dict | None = None) -> Any:
    """A tqdm bar over a TFRecord file's bytes (total unknown if it is compressed)."""
    import fsspec
    from tqdm import tqdm

    if compression == "auto":
        compression = detect_compression(url)
    from shardkit.io.retry import retried_call

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    total = retried_call(fs, "size", path) if compression is None else None
    return tqdm(total=total, unit="B", unit_scale=True, desc=url, leave=True, disable=None)


def detect_compression(url: str) -> str | None:
    from shardkit.formats.tfrecord import detect_compression
    from shardkit.io.files import open_raw

    with open_raw(url, "rb") as raw:
        return detect_compression(raw.read(12))


def with_progress(url: str, compression: str | None, job: Callable[[Callable[[int], None]], Any]) -> Any:
    """Run ``job(progress)`` with a progress bar that ``progress(bytes_done)`` advances."""
    with _progress_bar(url, compression) as bar:
        return job(lambda done: bar.update(done - bar.n))
