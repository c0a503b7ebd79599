"""Record index files: the byte offset of every record of a TFRecord file.

Format (all integers little-endian ``uint64``)::

    bytes 0..7     magic b"SKTFIDX1"
    bytes 8..15    N, the number of records
    bytes 16..23   size of the indexed (uncompressed) stream in bytes
    then N values  offset of record i, ascending, offsets[0] == 0

Record ``i`` occupies ``offsets[i]:offsets[i+1]`` (the last one ends at the
stored size), framing included. For a compressed file the offsets refer to the
uncompressed stream, so they give counts but cannot be used to seek.

The index of ``data.tfrecord`` lives beside it as ``data.tfrecord.idx``
(:func:`index_path_for`). :func:`read_index` also reads the two-column text
index of the ``tfrecord`` package (``offset length`` per line).

An index is trusted only as far as it is checked. :func:`read_index` refuses
one that contradicts itself (offsets not starting at 0, not ascending by at
least one record's framing, past the stored end). :func:`load_index`, what
datasets use, also checks it against the data file as it is now: the stream
size it stores (or the last ``offset + length`` of a text index) must equal
the file's size, and the last offset must hold a record header whose length
CRC is valid and whose record ends exactly at the end of the file (one
12-byte read). A file that grew, shrank or was rewritten with other record
boundaries fails with :class:`IndexFileError`, naming both files and the fix
(``shardkit index URL``). An index beside a compressed file cannot be checked
against it, so it is not used at all (counting scans instead).
``read_tfrecord(index=path)`` checks the index file it is given the same way
(:func:`load_given_index`); offsets given as an array are checked against the
end of the file when a read starts past them (:func:`check_ends_with_file`).

Index files are written atomically on local disks (temporary name, then
rename); object stores publish a file only when it is complete.

A checked index is kept in memory per process (:data:`CACHE_BYTES` of
offsets at most, least recently used dropped first), bound to the identity of
both files (size, modification time, inode; ETag or version remotely): a
sample-level shuffle reads a shard in many small ranges, and each would
otherwise read and check its whole index again. A file that changes gets a
new identity, so its index is read and checked afresh.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final, NamedTuple
from urllib.parse import urlsplit

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from shardkit.errors import ShardkitError, redact
from shardkit.formats.crc import masked_crc32c
from shardkit.io.files import open_raw

__all__ = [
    "INDEX_SUFFIX",
    "IndexFileError",
    "build_index",
    "implicit_index_for",
    "index_path_for",
    "check_ends_with_file",
    "load_given_index",
    "load_index",
    "read_index",
    "write_index",
]

logger = logging.getLogger("shardkit")

INDEX_SUFFIX: Final = ".idx"
_MAGIC: Final = b"SKTFIDX1"
_HEAD: Final = struct.Struct("<8sQQ")
_RECORD_HEADER: Final = struct.Struct("<QI")  # length, masked CRC of the length
_FRAMING: Final = 16  # bytes of framing around each record's data


CACHE_BYTES: Final = 64 << 20
"""Bytes of checked offsets :func:`load_index` keeps per process (8M records)."""


class IndexFileError(ShardkitError, ValueError):
    """An index file that does not describe its data file: stale, truncated or corrupt.

    ``url`` is the data file, ``index_url`` the index, ``problem`` what is wrong.
    """

    def __init__(self, url: str, index_url: str = "", problem: str = "") -> None:
        self.url, self.index_url, self.problem = url, index_url, problem
        if not problem:  # re-raised by DataLoader from a worker, which passes the message alone
            super().__init__(url)
            return
        super().__init__(
            f"index file {index_url} does not fit {url}: {problem}. Rebuild it with `shardkit index {url}` "
            "(or delete it, or read without it: index=False on a dataset, no index= to read_tfrecord)"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (IndexFileError, (self.url, self.index_url, self.problem))


class _Index(NamedTuple):
    """A parsed index: record offsets, and the stream size it describes (where the last record ends)."""

    offsets: np.ndarray
    end: int


def implicit_index_for(url: str) -> str | None:
    """Where the index of the data file at ``url`` is kept, ``url + ".idx"``; None for a url with a query
    string, which has no index beside it: ``.idx`` would land in a query value (a server that ignores
    the query answers with the shard itself), and a presigned url's signature covers its path, so no
    other path can be made up from it. Such a url's index can only be given explicitly."""
    if "://" in url and urlsplit(url).query:
        return None
    return url + INDEX_SUFFIX


def index_path_for(url: str) -> str:
    """Where the index of the data file at ``url`` is kept: ``url + ".idx"`` (see :func:`implicit_index_for`).

    Raises:
        ShardkitError: ``url`` has a query string (a presigned url), so it has no index file beside it.
    """
    index_url = implicit_index_for(url)
    if index_url is None:
        raise ShardkitError(
            f"{url} has a query string (a presigned url?), so it has no index file beside it: appending "
            f"{INDEX_SUFFIX} would change a query value, and its signature covers its path. Index a copy "
            "of the file at a url without a query string, or give an index's url explicitly (index=...)"
        )
    return index_url


def write_index(url: str, offsets: np.ndarray, stream_size: int, storage_options: dict[str, Any] | None = None) -> None:
    """Write ``offsets`` (record byte offsets) and the stream size as an index file at ``url``, atomically."""
    write_offsets_file(url, _MAGIC, offsets, stream_size, storage_options)


def write_offsets_file(
    url: str, magic: bytes, offsets: np.ndarray, size: int, storage_options: dict[str, Any] | None = None
) -> None:
    """Write an offsets container (``magic``, count, data size, u64 offsets) at ``url``.

    On local disks it is written under a temporary name and renamed, so a
    reader never sees half of one; every format's index file goes through here.
    """
    payload = _HEAD.pack(magic, len(offsets), size) + np.asarray(offsets, dtype="<u8").tobytes()
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if not isinstance(fs, LocalFileSystem):
        with open_raw(url, "wb", storage_options) as f:
            f.write(payload)
        return
    partial = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        with open_raw(partial, "wb") as f:
            f.write(payload)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def read_index(url: str, storage_options: dict[str, Any] | None = None) -> np.ndarray:
    """The record offsets stored in an index file, as an ``int64`` array.

    Raises:
        IndexFileError: the file is neither format, or contradicts itself.
    """
    with open_raw(url, "rb", storage_options) as f:
        data = f.read()
    return _parse(data, url, url).offsets


def load_index(
    url: str, index_url: str | None = None, *, storage_options: dict[str, Any] | None = None
) -> np.ndarray | None:
    """The record offsets of the data file ``url``, from its index, checked against the file.

    ``index_url`` defaults to :func:`index_path_for` ``(url)``. Returns None
    when there is no index file (without a request when ``url`` has a query
    string: see :func:`implicit_index_for`), and when the data file is
    compressed (its index cannot be checked against it).

    Raises:
        IndexFileError: the index is corrupt, or does not describe the file as
            it is now (it grew, shrank or was rewritten since).
    """
    index_url = index_url if index_url is not None else implicit_index_for(url)
    if index_url is None:
        return None
    try:
        of_index = _identity(index_url, storage_options)
    except FileNotFoundError:
        return None
    identity = (_identity(url, storage_options), of_index)
    key = (url, index_url, repr(sorted((storage_options or {}).items())))
    cached = _CACHE.get(key, identity)
    if cached is not None:
        return cached
    offsets = _load_checked(url, index_url, storage_options)
    if offsets is not None and None not in identity:  # a bare size cannot tell a rewritten file: not kept
        offsets.flags.writeable = False  # shared by every caller of this process
        _CACHE.put(key, identity, offsets)
    return offsets


def load_given_index(url: str, index_url: str, storage_options: dict[str, Any] | None = None) -> np.ndarray | None:
    """:func:`load_index` of an index file the caller named (``read_tfrecord(index=path)``): checked
    against ``url`` the same way; None when ``url`` is compressed (its index cannot seek).

    Raises:
        FileNotFoundError: there is no file at ``index_url``.
        IndexFileError: the index does not describe the file as it is now.
    """
    offsets = load_index(url, index_url, storage_options=storage_options)
    if offsets is None:
        read_index(index_url, storage_options)  # raises FileNotFoundError when it is missing, not compressed
    return offsets


def check_ends_with_file(
    url: str, offsets: np.ndarray, storage_options: dict[str, Any] | None = None, index_url: str = ""
) -> bool:
    """Check that ``url`` holds no record past the last of ``offsets``, as a read from a start past them
    trusts (one 12-byte read); False when the file is compressed (the offsets cannot be checked).

    Raises:
        IndexFileError: the file goes on past the record at the last offset (it grew or was rewritten).
    """
    from shardkit.formats.tfrecord import detect_compression  # tfrecord imports this module

    index_url = index_url or f"<the {len(offsets)} offsets passed as index=>"
    with open_raw(url, "rb", storage_options) as f:
        if detect_compression(f.read(12)) is not None:
            return False
        size = f.seek(0, os.SEEK_END)
        if not len(offsets) and size:
            raise IndexFileError(url, index_url, f"it lists no records, but the file has {size} bytes")
        _check_last_record(f, offsets, size, url, index_url)
    return True


def _load_checked(url: str, index_url: str, storage_options: dict[str, Any] | None) -> np.ndarray | None:
    """Read ``index_url`` and check it against ``url`` as it is now (see :func:`load_index`)."""
    from shardkit.formats.tfrecord import detect_compression  # tfrecord imports this module

    try:
        with open_raw(index_url, "rb", storage_options) as f:
            data = f.read()
    except FileNotFoundError:
        return None
    index = _parse(data, url, index_url)
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    size = int(fs.info(path)["size"])
    with open_raw(url, "rb", storage_options) as f:
        if index.end != size:
            if detect_compression(f.read(12)) is not None:
                logger.info(
                    "shardkit: not using the index %s of the compressed file %s", redact(index_url), redact(url)
                )
                return None
            change = "grew" if size > index.end else "shrank"
            raise IndexFileError(
                url, index_url, f"it describes {index.end} bytes but the file has {size} (it {change})"
            )
        _check_last_record(f, index.offsets, size, url, index_url)
    return index.offsets


def _identity(url: str, storage_options: dict[str, Any] | None) -> Any:
    """What changes when the file at ``url`` may have: one ``stat`` locally, else the store's
    ETag/version/mtime (None when the store reports only a size).

    Raises:
        FileNotFoundError: there is no such file.
    """
    if "://" not in url or url.startswith("file://"):
        st = os.stat(url.removeprefix("file://"))
        return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
    from shardkit.io.identity import describe as identity_of

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    found = identity_of(fs.info(path))
    return found if any(not part.startswith("size=") for part in found.split(",") if part) else None


class _IndexCache:
    """Checked offsets by (url, index url, options), each valid while both files keep their identity; LRU by bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: OrderedDict[tuple[str, str, str], tuple[Any, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str, str], identity: Any) -> np.ndarray | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != identity:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: tuple[str, str, str], identity: Any, offsets: np.ndarray) -> None:
        if offsets.nbytes > self.limit:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self._bytes += offsets.nbytes - (0 if old is None else old[1].nbytes)
            self._entries[key] = (identity, offsets)
            while self._bytes > self.limit:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def after_fork(self) -> None:
        """A forked child starts with a fresh lock (one held by a thread of the parent would never be released)."""
        self._lock = threading.Lock()


_CACHE: Final = _IndexCache(CACHE_BYTES)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_CACHE.after_fork)


def _check_last_record(f: Any, offsets: np.ndarray, size: int, url: str, index_url: str) -> None:
    """The last offset must start a record (valid length CRC) that ends at the end of the file."""
    if not len(offsets):
        return
    last = int(offsets[-1])
    f.seek(last)
    header = f.read(_RECORD_HEADER.size)
    if len(header) == _RECORD_HEADER.size:
        length, stored = _RECORD_HEADER.unpack(header)
        if masked_crc32c(header[:8]) == stored and last + length + _FRAMING == size:
            return
    raise IndexFileError(
        url, index_url, f"no record of the file ends at its end from the index's last offset {last} (rewritten since?)"
    )


def _parse(data: bytes, url: str, index_url: str) -> _Index:
    """Parse either index format and check it is consistent in itself."""
    if data[:8] == _MAGIC:
        if len(data) < _HEAD.size:
            raise IndexFileError(
                url, index_url, f"truncated: {len(data)} bytes, shorter than the {_HEAD.size}-byte header"
            )
        _, count, stream_size = _HEAD.unpack_from(data)
        if len(data) != _HEAD.size + 8 * count:
            raise IndexFileError(
                url, index_url, f"it should hold {count} offsets but has {len(data) - _HEAD.size} bytes of them"
            )
        offsets = np.frombuffer(data, dtype="<u8", count=count, offset=_HEAD.size)
        if count and int(offsets.max()) > np.iinfo(np.int64).max:
            raise IndexFileError(url, index_url, f"offset {int(offsets.max())} is not a file position")
        return _consistent(_Index(offsets.astype(np.int64), int(stream_size)), url, index_url)
    try:
        table = np.array(data.split(), dtype=np.int64).reshape(-1, 2)
    except (ValueError, OverflowError):
        raise IndexFileError(url, index_url, "not a shardkit index file nor a text 'offset length' index") from None
    offsets, lengths = table[:, 0].copy(), table[:, 1]
    if len(offsets) and not np.array_equal(offsets[1:], offsets[:-1] + lengths[:-1]):
        bad = int(np.flatnonzero(offsets[1:] != offsets[:-1] + lengths[:-1])[0])
        raise IndexFileError(
            url,
            index_url,
            f"line {bad + 1}: record at {offsets[bad]} of length {lengths[bad]} is not followed by line {bad + 2}",
        )
    end = int(offsets[-1] + lengths[-1]) if len(offsets) else 0
    return _consistent(_Index(offsets, end), url, index_url)


def _consistent(index: _Index, url: str, index_url: str) -> _Index:
    """Offsets start at 0 and ascend by at least one record's framing; the last record ends by ``end``."""
    offsets = index.offsets
    if not len(offsets):
        if index.end:
            raise IndexFileError(url, index_url, f"no records, yet {index.end} bytes")
        return index
    if offsets[0] != 0:
        raise IndexFileError(url, index_url, f"the first record is at {offsets[0]}, not 0")
    steps = np.diff(offsets)
    if steps.size and steps.min() < _FRAMING:
        bad = int(np.flatnonzero(steps < _FRAMING)[0]) + 1
        raise IndexFileError(
            url,
            index_url,
            f"offset {bad} ({offsets[bad]}) is not past offset {bad - 1} ({offsets[bad - 1]}) by a record",
        )
    if offsets[-1] + _FRAMING > index.end:
        raise IndexFileError(
            url, index_url, f"the last offset {offsets[-1]} leaves no room for a record before {index.end}"
        )
    return index


def build_index(
    url: str,
    index_url: str | None = None,
    *,
    compression: str | None = "auto",
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int], object] | None = None,
) -> str:
    """Scan a TFRecord file and write its index; return the index's URL.

    The index goes to ``index_url`` (default :func:`index_path_for` ``(url)``).
    Length CRCs are checked during the scan so a corrupt file cannot yield a
    wrong index; ``progress(nbytes)`` is called with the bytes scanned so far.
    """
    from shardkit.formats.tfrecord import scan_offsets  # tfrecord imports this module

    size = 0

    def track(nbytes: int) -> None:
        nonlocal size
        size = nbytes
        if progress is not None:
            progress(nbytes)

    offsets = scan_offsets(url, compression=compression, storage_options=storage_options, progress=track)
    target = index_url if index_url is not None else index_path_for(url)
    write_index(target, offsets, size, storage_options)
    return target
