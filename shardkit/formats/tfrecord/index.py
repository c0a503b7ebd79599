"""TFRecord index files: the byte offset of every record of a TFRecord file.

The container of :mod:`shardkit.formats.offsets` (all integers little-endian ``uint64``)::

    bytes 0..7     magic b"SKTFIDX1"
    bytes 8..15    N, the number of records
    bytes 16..23   size of the indexed (uncompressed) stream in bytes
    then N values  offset of record i, ascending, offsets[0] == 0

Record ``i`` occupies ``offsets[i]:offsets[i+1]`` (the last one ends at the
stored size), framing included. For a compressed file the offsets refer to the
uncompressed stream, so they give counts but cannot be used to seek.

The index of ``data.tfrecord`` lives beside it as ``data.tfrecord.idx``
(:func:`~shardkit.formats.offsets.index_path_for`). :func:`read_index` also reads the two-column text
index of the ``tfrecord`` package (``offset length`` per line).

An index is trusted only as far as it is checked. :func:`read_index` refuses
one that contradicts itself (offsets not starting at 0, not ascending by at
least one record's framing, past the stored end). :func:`load_index`, what
datasets use, also checks it against the data file as it is now: the stream
size it stores (or the last ``offset + length`` of a text index) must equal
the file's size, and the last offset must hold a record header whose length
CRC is valid and whose record ends exactly at the end of the file (one
12-byte read). A file that grew, shrank or was rewritten with other record
boundaries fails with :class:`~shardkit.formats.offsets.IndexFileError`, naming both files and the fix
(``shardkit index URL``). An index beside a compressed file cannot be checked
against it, so it is not used at all (counting scans instead).
``read_tfrecord(index=path)`` checks the index file it is given the same way
(:func:`load_given_index`); offsets given as an array are checked against the
end of the file when a read starts past them (:func:`check_ends_with_file`).

Index files are written by :func:`~shardkit.formats.offsets.write_offsets`
(by rename on local disks). A checked index is kept in memory per process,
bound to the identity of both files
(:func:`~shardkit.formats.offsets.checked_once`): a sample-level shuffle reads
a shard in many small ranges, and each would otherwise read and check its
whole index again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import fsspec
import numpy as np

from shardkit.errors import redact
from shardkit.formats.crc import masked_crc32c
from shardkit.formats.offsets import (
    HEAD,
    IndexFileError,
    checked_once,
    implicit_index_for,
    index_path_for,
    unpack_offsets,
    write_offsets,
)
from shardkit.formats.tfrecord.framing import (
    HEADER_BYTES,
    OVERHEAD_BYTES,
    detect_compression,
    scan_offsets,
    unpack_header,
)
from shardkit.io.files import open_raw
from shardkit.io.options import RemoteOptions
from shardkit.io.retry import retried_call

__all__ = [
    "INDEX_MAGIC",
    "build_index",
    "check_ends_with_file",
    "load_given_index",
    "load_index",
    "read_index",
]

logger = logging.getLogger("shardkit")

INDEX_MAGIC: Final = b"SKTFIDX1"


class _Index(NamedTuple):
    """A parsed index: record offsets, and the stream size it describes (where the last record ends)."""

    offsets: np.ndarray
    end: int


def read_index(url: str, storage_options: dict[str, Any] | None = None) -> np.ndarray:
    """The record offsets stored in an index file, as an ``int64`` array.

    Raises:
        IndexFileError: the file is neither format, or contradicts itself.
    """
    with open_raw(url, "rb", storage_options) as f:
        data = f.read()
    return _parse(data, url, url).offsets


def load_index(
    url: str,
    index_url: str | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    remote: RemoteOptions | None = None,
) -> np.ndarray | None:
    """The record offsets of the data file ``url``, from its index, checked against the file.

    ``index_url`` defaults to :func:`~shardkit.formats.offsets.index_path_for` ``(url)``. Returns None
    when there is no index file (without a request when ``url`` has a query
    string: see :func:`~shardkit.formats.offsets.implicit_index_for`), and when the data file is
    compressed (its index cannot be checked against it). Both files are read and looked up bounded
    and retried under ``remote`` (default :class:`~shardkit.io.remote.RemoteOptions`).

    Raises:
        IndexFileError: the index is corrupt, or does not describe the file as
            it is now (it grew, shrank or was rewritten since).
    """
    index_url = index_url if index_url is not None else implicit_index_for(url)
    if index_url is None:
        return None
    return checked_once(url, index_url, storage_options, _load_checked, remote)


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
    index_url = index_url or f"<the {len(offsets)} offsets passed as index=>"
    with open_raw(url, "rb", storage_options) as f:
        if detect_compression(f.read(12)) is not None:
            return False
        size = f.seek(0, os.SEEK_END)
        if not len(offsets) and size:
            raise IndexFileError(url, index_url, f"it lists no records, but the file has {size} bytes")
        _check_last_record(f, offsets, size, url, index_url)
    return True


def _load_checked(
    url: str, index_url: str, storage_options: dict[str, Any] | None, remote: RemoteOptions | None
) -> np.ndarray | None:
    """Read ``index_url`` and check it against ``url`` as it is now (see :func:`load_index`)."""
    try:
        with open_raw(index_url, "rb", storage_options, remote=remote) as f:
            data = f.read()
    except FileNotFoundError:
        return None
    index = _parse(data, url, index_url)
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    size = int(retried_call(fs, "info", path, retry=remote.retry if remote else None)["size"])
    with open_raw(url, "rb", storage_options, remote=remote) as f:
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


def _check_last_record(f: Any, offsets: np.ndarray, size: int, url: str, index_url: str) -> None:
    """The last offset must start a record (valid length CRC) that ends at the end of the file."""
    if not len(offsets):
        return
    last = int(offsets[-1])
    f.seek(last)
    header = f.read(HEADER_BYTES)
    if len(header) == HEADER_BYTES:
        length, stored = unpack_header(header)
        if masked_crc32c(header[:8]) == stored and last + length + OVERHEAD_BYTES == size:
            return
    raise IndexFileError(
        url, index_url, f"no record of the file ends at its end from the index's last offset {last} (rewritten since?)"
    )


def _parse(data: bytes, url: str, index_url: str) -> _Index:
    """Parse either index format and check it is consistent in itself."""
    if data[:8] == INDEX_MAGIC:
        if len(data) < HEAD.size:
            raise IndexFileError(
                url, index_url, f"truncated: {len(data)} bytes, shorter than the {HEAD.size}-byte header"
            )
        offsets, stream_size = unpack_offsets(data, url, index_url)
        if len(offsets) and int(offsets.max()) > np.iinfo(np.int64).max:
            raise IndexFileError(url, index_url, f"offset {int(offsets.max())} is not a file position")
        return _consistent(_Index(offsets.astype(np.int64), stream_size), url, index_url)
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
    if steps.size and steps.min() < OVERHEAD_BYTES:
        bad = int(np.flatnonzero(steps < OVERHEAD_BYTES)[0]) + 1
        raise IndexFileError(
            url,
            index_url,
            f"offset {bad} ({offsets[bad]}) is not past offset {bad - 1} ({offsets[bad - 1]}) by a record",
        )
    if offsets[-1] + OVERHEAD_BYTES > index.end:
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

    The index goes to ``index_url`` (default :func:`~shardkit.formats.offsets.index_path_for` ``(url)``).
    Length CRCs are checked during the scan so a corrupt file cannot yield a
    wrong index; ``progress(nbytes)`` is called with the bytes scanned so far.
    """
    size = 0

    def track(nbytes: int) -> None:
        nonlocal size
        size = nbytes
        if progress is not None:
            progress(nbytes)

    offsets = scan_offsets(url, compression=compression, storage_options=storage_options, progress=track)
    target = index_url if index_url is not None else index_path_for(url)
    write_offsets(target, INDEX_MAGIC, offsets, size, storage_options)
    return target
