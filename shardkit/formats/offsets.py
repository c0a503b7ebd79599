"""Offset index files: one container for the index of every format that has one.

An index file holds the byte offset where each record of a data file starts,
so that counting needs no scan and a record range starts with a seek. Tar,
JSON lines and TFRecord share this container (all integers little-endian
``uint64``); only the magic tells them apart::

    bytes 0..7     magic, one per format (b"SKTARIX1", b"SKJSLIX1", b"SKTFIDX1")
    bytes 8..15    N, the number of records
    bytes 16..23   size in bytes of the data file it describes
    then N values  byte offset where record i starts, ascending

The index of ``data.tar`` lives beside it as ``data.tar.idx``
(:func:`index_path_for`); a url with a query string has none beside it
(:func:`implicit_index_for`).

An index is bound to its data file by that size and checked when it is used
(:func:`load_offsets`): a file that grew or shrank, or offsets that are not
ascending or point past the end, raise :class:`IndexFileError`, which names
both files and the fix; each format also checks that its last offset starts a
record. TFRecord checks its own way (:mod:`shardkit.formats.tfrecord.index`:
its size is that of the uncompressed stream, and it also reads a text index),
through the same container and errors.

Index files are written by rename on local disks, so a reader never sees half
of one; object stores publish a file only when it is complete.

A checked index may be kept in memory per process (:func:`checked_once`:
:data:`CACHE_BYTES` of offsets at most, least recently used dropped first),
bound to the identity of both files (size, modification time, inode; ETag or
version remotely): a sample-level shuffle reads a shard in many small ranges,
and each would otherwise read and check its whole index again. A file that
changes gets a new identity, so its index is read and checked afresh.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import urlsplit

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from shardkit.errors import ShardkitError
from shardkit.io.files import open_raw
from shardkit.io.identity import identity
from shardkit.io.options import RemoteOptions
from shardkit.io.retry import RetryPolicy, retried_call

__all__ = [
    "CACHE_BYTES",
    "HEAD",
    "INDEX_SUFFIX",
    "IndexFileError",
    "checked_once",
    "implicit_index_for",
    "index_path_for",
    "load_offsets",
    "unpack_offsets",
    "write_offsets",
]

INDEX_SUFFIX: Final = ".idx"
HEAD: Final = struct.Struct("<8sQQ")
"""The container's header: magic, record count, data size."""

CACHE_BYTES: Final = 64 << 20
"""Bytes of checked offsets :func:`checked_once` keeps per process (8M records)."""


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


def write_offsets(
    url: str, magic: bytes, offsets: np.ndarray, size: int, storage_options: dict[str, Any] | None = None
) -> None:
    """Write an index file at ``url``: ``magic``, the record ``offsets`` of a data file of ``size`` bytes.

    On local disks it is written under a temporary name and renamed, so a
    reader never sees half of one; every format's index file goes through here.
    """
    payload = HEAD.pack(magic, len(offsets), size) + np.asarray(offsets, dtype="<u8").tobytes()
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


def unpack_offsets(data: bytes, url: str, index_url: str) -> tuple[np.ndarray, int]:
    """The offsets (``uint64``, as stored) and the data size in an index file's bytes, whose
    :data:`HEAD` is whole and whose magic the caller checked.

    Raises:
        IndexFileError: the file holds more or fewer offsets than its header says.
    """
    _, count, size = HEAD.unpack_from(data)
    if len(data) != HEAD.size + 8 * count:
        raise IndexFileError(
            url, index_url, f"it should hold {count} offsets but has {len(data) - HEAD.size} bytes of them"
        )
    return np.frombuffer(data, dtype="<u8", count=count, offset=HEAD.size), int(size)


def load_offsets(
    url: str, magic: bytes, storage_options: dict[str, Any] | None = None, remote: RemoteOptions | None = None
) -> np.ndarray | None:
    """The record offsets in ``url``'s index file (:func:`index_path_for`), checked against ``url``'s size.

    Returns None when there is no index file, and without a request when ``url`` has a query
    string (:func:`implicit_index_for`). Both files are read, and ``url``'s size looked up, bounded
    and retried under ``remote`` (default :class:`~shardkit.io.remote.RemoteOptions`). The caller
    checks that the last offset starts a record of its format.

    Raises:
        IndexFileError: the index is of another format, corrupt, or does not describe the file as it is now.
    """
    index_url = implicit_index_for(url)
    if index_url is None:
        return None
    try:
        with open_raw(index_url, "rb", storage_options, remote=remote) as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if len(data) < HEAD.size or data[:8] != magic:
        raise IndexFileError(url, index_url, f"it does not start with {magic!r} (another format's index, or damaged)")
    offsets, size = unpack_offsets(data, url, index_url)
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    actual = int(retried_call(fs, "info", path, retry=remote.retry if remote else None)["size"])
    if actual != size:
        raise IndexFileError(url, index_url, f"it describes {size} bytes but the file has {actual} (rewritten since)")
    if len(offsets) and (int(offsets[-1]) >= size or np.any(np.diff(offsets.astype(np.int64)) <= 0)):
        raise IndexFileError(url, index_url, "its offsets are not ascending inside the file")
    return offsets.astype(np.int64)


# --------------------------------------------------------------------------- the per-process cache


Loader = Callable[[str, str, dict[str, Any] | None, RemoteOptions | None], np.ndarray | None]
"""``load(url, index_url, storage_options, remote)``: read ``index_url`` and check it against ``url``."""


def checked_once(
    url: str, index_url: str, storage_options: dict[str, Any] | None, load: Loader, remote: RemoteOptions | None = None
) -> np.ndarray | None:
    """``load(url, index_url, storage_options, remote)``, kept while both files keep their identity.

    None without a request when there is no file at ``index_url``. The offsets kept are
    read-only: every caller of this process shares them. A file whose store reports only
    its size is loaded every time (a bare size cannot tell a rewritten file). Identities are
    looked up bounded and retried under ``remote``'s ``retry``.
    """
    retry = remote.retry if remote is not None else None
    try:
        of_index = _identity(index_url, storage_options, retry)
    except FileNotFoundError:
        return None
    identity = (_identity(url, storage_options, retry), of_index)
    key = (url, index_url, repr(sorted((storage_options or {}).items())))
    cached = _CACHE.get(key, identity)
    if cached is not None:
        return cached
    offsets = load(url, index_url, storage_options, remote)
    if offsets is not None and None not in identity:
        offsets.flags.writeable = False
        _CACHE.put(key, identity, offsets)
    return offsets


def _identity(url: str, storage_options: dict[str, Any] | None, retry: RetryPolicy | None = None) -> Any:
    """What changes when the file at ``url`` may have: one ``stat`` locally, else the store's
    ETag/version/mtime (None when the store reports only a size).

    Raises:
        FileNotFoundError: there is no such file.
    """
    if "://" not in url or url.startswith("file://"):
        st = os.stat(url.removeprefix("file://"))
        return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return identity(retried_call(fs, "info", path, retry=retry))  # bounded: a stalled store fails, naming the url


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
