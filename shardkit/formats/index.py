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
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final, Optional

import numpy as np

from shardkit.errors import ShardkitError
from shardkit.formats.io import open_raw
from shardkit.formats.tfrecord import scan_offsets

__all__ = ["INDEX_SUFFIX", "build_index", "index_path_for", "read_index", "write_index"]

INDEX_SUFFIX: Final = ".idx"
_MAGIC: Final = b"SKTFIDX1"
_HEAD: Final = struct.Struct("<8sQQ")


def index_path_for(url: str) -> str:
    """Where the index of the data file at ``url`` is kept: ``url + ".idx"``."""
    return url + INDEX_SUFFIX


def write_index(
    url: str, offsets: np.ndarray, stream_size: int, storage_options: Optional[dict[str, Any]] = None
) -> None:
    """Write ``offsets`` (record byte offsets) and the stream size as an index file at ``url``."""
    offsets = np.asarray(offsets, dtype="<u8")
    with open_raw(url, "wb", storage_options) as f:
        f.write(_HEAD.pack(_MAGIC, len(offsets), stream_size))
        f.write(offsets.tobytes())


def read_index(url: str, storage_options: Optional[dict[str, Any]] = None) -> np.ndarray:
    """The record offsets stored in an index file, as an ``int64`` array."""
    with open_raw(url, "rb", storage_options) as f:
        data = f.read()
    if data[:8] == _MAGIC:
        if len(data) < _HEAD.size:
            raise ShardkitError(f"{url}: index file is truncated")
        _, count, _ = _HEAD.unpack_from(data)
        if len(data) != _HEAD.size + 8 * count:
            raise ShardkitError(f"{url}: index file should hold {count} offsets but has {len(data) - _HEAD.size} bytes")
        return np.frombuffer(data, dtype="<u8", count=count, offset=_HEAD.size).astype(np.int64)
    try:
        table = np.array(data.split(), dtype=np.int64).reshape(-1, 2)
    except ValueError:
        raise ShardkitError(f"{url}: not a shardkit index file nor a text 'offset length' index") from None
    return table[:, 0].copy()


def build_index(
    url: str,
    index_url: Optional[str] = None,
    *,
    compression: Optional[str] = "auto",
    storage_options: Optional[dict[str, Any]] = None,
    progress: Optional[Callable[[int], object]] = None,
) -> str:
    """Scan a TFRecord file and write its index; return the index's URL.

    The index goes to ``index_url`` (default :func:`index_path_for` ``(url)``).
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
    write_index(target, offsets, size, storage_options)
    return target
