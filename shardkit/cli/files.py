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
from shardkit.cli.paths import is_url, shown

GLOB_CHARS = re.compile(r"[*?\[{]")


def expand(pattern: str) -> list[str]:
    """The files ``pattern`` names, as the user typed it (:func:`~shardkit.cli.paths.shown`): itself, or the
    sorted matches of a glob (``*?[`` or ``{a,b}``), where a Megatron ``X.bin`` and ``X.idx`` are one pair,
    named once by its ``.bin``; or the shards of the LitData or Lance dataset directory it names
    (:func:`dataset_shards`)."""
    if not GLOB_CHARS.search(pattern):
        shards = dataset_shards(pattern)
        return [shown(pattern, pattern)] if shards is None else shards.urls()
    from shardkit.shardlist import ShardList

    urls = [shown(url, pattern) for url in ShardList.from_glob(pattern).urls()]
    pairs = {url[:-4] for url in urls if url.endswith(".bin")}
    return [url for url in urls if not (url.endswith(".idx") and url[:-4] in pairs)]  # a Megatron pair once


def dataset_shards(directory: str) -> Any:
    """The ShardList, counts included, of the Mosaic MDS or LitData dataset (an ``index.json`` in it: MDS's
    lists ``shards``, LitData's ``chunks``) or Lance dataset (a ``_versions`` folder in it, read at its latest
    version) at ``directory``; None for anything else. Their shards are read in place: MDS shards, LitData
    chunks, Lance fragments (see :func:`format_of`)."""
    import posixpath

    import fsspec

    from shardkit.formats.registry import formats
    from shardkit.shardlist import ShardList

    if any(directory.lower().endswith(s) for fmt in formats().values() for s in fmt.suffixes):
        return None  # a shard file: not looked into
    fs, path = fsspec.core.url_to_fs(directory)
    try:
        if fs.isfile(posixpath.join(path, "index.json")):
            if _is_mds_index(fs, posixpath.join(path, "index.json")):
                from shardkit.formats.mds import dataset_shards as mds_shards

                return ShardList(*mds_shards(directory))
            from shardkit.formats.litdata import LitDataFormat, chunk_urls

            litdata = LitDataFormat()
            urls = chunk_urls(litdata.index(posixpath.join(directory.rstrip("/"), "index.json")))
            return ShardList(urls, num_records=[litdata.stored_count(url) for url in urls])
        if not fs.isdir(posixpath.join(path, "_versions")):
            return None
    except OSError:  # not a directory that can be looked into: the command reads it as a file
        return None
    from shardkit.formats.lance import LanceFormat, fragment_url

    lance = LanceFormat()
    dataset = lance.dataset(directory.rstrip("/"))
    urls = [fragment_url(directory, f.fragment_id, int(dataset.version)) for f in dataset.get_fragments()]
    return ShardList(urls, num_records=[lance.count(url) for url in urls])


def _is_mds_index(fs: Any, path: str) -> bool:
    """Whether the ``index.json`` at ``path`` is Mosaic's (``{"shards": [...], "version": 2}``), not LitData's."""
    import json

    try:
        with fs.open(path, "rb") as f:
            index = json.loads(f.read(1 << 26))
    except ValueError:
        return False  # not JSON: LitData's reader says what is wrong with it
    return isinstance(index, dict) and "shards" in index and "chunks" not in index


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
    from shardkit.formats.sniff import SNIFF_BYTES
    from shardkit.io.files import open_raw

    head = b""
    if "://" not in url or url.startswith("file://"):  # a remote file is not opened twice: its suffix decides
        try:
            with open_raw(url, "rb") as f:
                head = f.read(SNIFF_BYTES)
        except OSError:
            return False  # the command's own reading reports it
    what = companion(url, head)
    if what is not None:
        print(f"skipped {url}: {what}")
    return what is not None


def companion(url: str, head: bytes = b"") -> str | None:
    """What ``url`` is when it is an index or manifest file that a glob such as ``data/*`` picks up
    beside the shards, by its name and, where known, its first bytes ``head``; None for shard data."""
    from shardkit.formats.sniff import not_a_shard

    what = not_a_shard(url, head)
    if what is None and url.endswith("manifest.arrow"):
        what = "a shard manifest"
    return what


def shard_indices(urls: Sequence[str], source: str, *, report: bool = True) -> list[int]:
    """The indices of ``urls`` that are shard data, by name (:func:`companion`: nothing is opened);
    each index or manifest file left out is reported as ``skipped`` (with ``report``), as verify does."""
    kept = []
    for i, url in enumerate(urls):
        what = companion(url)
        if what is None:
            kept.append(i)
        elif report:
            print(f"skipped {shown(url, source)}: {what}")
    return kept


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


def format_of(url: str, forced: str | None = None, compression: str | None = "auto", *, option: bool = True) -> Any:
    """The format to read ``url`` with, None for TFRecord (which the commands read themselves): ``forced``
    (``--format``) when given, else the one its suffix names, else the one its first bytes show.

    A file whose first bytes show no format is read as TFRecord only when it is a compressed stream (or
    ``compression`` says so); a file named TFRecord whose first bytes are another format's is read as
    neither. Both are errors (exit 2) before any record is read, not a corrupt record 0, whose fix names the
    command's ``--format`` option (``option``), else the file name's suffix.

    Raises:
        FormatError: the format is not recognised, or the name contradicts the first bytes.
    """
    from shardkit.formats.base import FormatError
    from shardkit.formats.registry import format_for, formats

    if forced is not None:
        fmt = formats()[forced]
        return None if fmt.name == "tfrecord" else fmt
    in_place = in_place_format(url)  # a Lance fragment, a LitData chunk beside its index.json
    if in_place is not None:
        return in_place
    by_name = _named(url)
    if by_name is not None and (by_name.name != "tfrecord" or is_url(url)):
        return None if by_name.name == "tfrecord" else by_name  # a remote file is not opened twice
    head = _head(url)
    if head is None:
        return None  # unreadable: the TFRecord reader reports why, as for any file
    if by_name is not None:
        _check_tfrecord_head(url, head, option)
        return None
    try:
        fmt = format_for(url, head)
    except FormatError:
        if compression in ("gzip", "zlib") or _compressed(head):
            return None  # a compressed TFRecord stream: its reader checks it
        how = "if it is one, say which with --format" if option else "if it is one, name it with its suffix"
        raise FormatError(
            f"{url}: format not recognised: neither its name nor its first bytes match a shard format "
            f"({', '.join(formats())}); {how}"
        ) from None
    return None if fmt.name == "tfrecord" else fmt


def _named(url: str) -> Any:
    """The format ``url``'s suffix names, None when no suffix matches."""
    from shardkit.formats.base import FormatError
    from shardkit.formats.registry import format_for

    try:
        return format_for(url, head=b"")
    except FormatError:
        return None


def _head(url: str) -> bytes | None:
    from shardkit.formats.sniff import SNIFF_BYTES
    from shardkit.io.files import open_raw

    try:
        with open_raw(url, "rb") as f:
            return f.read(SNIFF_BYTES)
    except OSError:
        return None


def _compressed(head: bytes) -> bool:
    from shardkit.io.files import sniff_compression

    return sniff_compression(head) is not None


def _check_tfrecord_head(url: str, head: bytes, option: bool) -> None:
    """Refuse a file named TFRecord that starts like another format (and not like a TFRecord record)."""
    from shardkit.formats.base import FormatError
    from shardkit.formats.registry import formats
    from shardkit.formats.sniff import kind_of

    everything = formats()
    kind = kind_of(head)
    if kind is None or everything["tfrecord"].sniff(head) or _compressed(head):
        return  # a TFRecord, perhaps damaged: its reader says where
    what = kind[0]
    other = next((f.name for f in everything.values() if f.name != "tfrecord" and f.sniff(head)), None)
    if other is None:
        raise FormatError(f"{url}: its name says TFRecord, but this is {what}")
    how = f"read it with --format {other}" if option else f"name it with a {everything[other].suffixes[-1]} suffix"
    raise FormatError(f"{url}: its name says TFRecord, but this is {what}; {how}")


def in_place_format(url: str) -> Any:
    """The format of a shard of a dataset read in place (see :func:`dataset_shards`), None for any other."""
    import posixpath

    import fsspec

    if "#fragment=" in url:
        from shardkit.formats.lance import LanceFormat

        return LanceFormat()
    if not url.endswith(".bin"):
        return None
    fs, path = fsspec.core.url_to_fs(url)
    try:  # a Megatron .bin has its .idx beside it; a LitData chunk, its dataset's index.json
        litdata = fs.isfile(posixpath.join(posixpath.dirname(path), "index.json")) and not fs.isfile(path[:-4] + ".idx")
    except OSError:
        return None
    if not litdata:
        return None
    from shardkit.formats.litdata import LitDataFormat

    return LitDataFormat()


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
