"""Reading a TFRecord file's records: :func:`read_tfrecord`, the public reader.

It resolves where to start (from an index file or offsets the caller gives,
checked against the file: :mod:`shardkit.formats.tfrecord.index`) and leaves
the framing, the checks and the speed to :mod:`shardkit.formats.tfrecord.arrays`
(a local file under the compiled kernel) and :mod:`shardkit.formats.tfrecord.framing`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from shardkit.errors import ShardkitError
from shardkit.formats.tfrecord import index as index_files
from shardkit.formats.tfrecord.arrays import ARROW_TYPES, read_arrays, read_records
from shardkit.io.remote import RemoteOptions

__all__ = ["IndexLike", "read_tfrecord", "read_tfrecord_batches"]

IndexLike = str | os.PathLike[str] | Sequence[int] | np.ndarray
"""Where ``read_tfrecord(index=...)`` takes record offsets from: an index file's path, or the offsets."""


def read_tfrecord(
    url: str,
    *,
    compression: str | None = "auto",
    verify: bool = True,
    start: int = 0,
    stop: int | None = None,
    index: IndexLike | None = None,
    storage_options: dict[str, Any] | None = None,
    remote: RemoteOptions | None = None,
) -> Iterator[bytes]:
    """Iterate over the records of a TFRecord file as ``bytes``.

    Args:
        url: a path or any fsspec URL (file://, memory://, s3://, gs://, http(s)://).
        compression: ``None``, ``"gzip"``, ``"zlib"`` or ``"auto"`` (decide from
            the first bytes: valid TFRecord header, gzip magic, zlib header).
        verify: check the length and data CRC of every record returned; a
            mismatch or a file ending inside a record raises
            :class:`~shardkit.CorruptRecordError` after the good records before it.
        start, stop: record indices, like ``records[start:stop]``.
        index: offsets of the records (an array, or the path of an index file
            written by :func:`~shardkit.build_index`); on an uncompressed file the
            reader then seeks straight to ``start`` instead of scanning to it.
            An index file is checked against the file first
            (:func:`~shardkit.formats.tfrecord.index.load_index`); an array is checked
            against the file's end when ``start`` is past its last record. One
            that does not fit raises :class:`~shardkit.formats.offsets.IndexFileError`.
        storage_options: passed to fsspec.
        remote: how a remote file is read (readahead, retries, local cache):
            a :class:`~shardkit.io.remote.RemoteOptions`; local files ignore it.

    The file is opened on the first ``next()`` and closed when the iterator is
    exhausted or garbage collected. Records are read a block at a time, so
    memory stays at a few blocks (:data:`~shardkit.io.files.BLOCK_SIZE`)
    plus any record longer than a block.

    Malformed input of any kind (bad CRCs, impossible lengths, a file ending
    inside a record, a damaged GZIP/ZLIB stream) raises
    :class:`~shardkit.CorruptRecordError` with the url, record index and byte
    offset, after the good records before it. A local file truncated while it
    is read raises one too; a file replaced by a rename while it is read is
    read to its end as it was when opened (the open file keeps the old data).
    """
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
    return itertools.chain.from_iterable(_read(url, compression, verify, start, stop, index, storage_options, remote))


def read_tfrecord_batches(
    url: str,
    *,
    batch_records: int = 1024,
    compression: str | None = "auto",
    verify: bool = True,
    start: int = 0,
    stop: int | None = None,
    index: IndexLike | None = None,
    storage_options: dict[str, Any] | None = None,
    remote: RemoteOptions | None = None,
    arrow_type: str = "large_binary",
) -> Iterator[pa.LargeBinaryArray | pa.BinaryViewArray]:
    """Iterate over the records of a TFRecord file as Arrow arrays of many records each.

    The records of :func:`read_tfrecord` (the same bytes, the same checks and
    the same errors), ``batch_records`` to an array (the last may be shorter),
    with no Python object per record, which makes this the fastest way to read
    raw records. Both CRCs of every record are checked with ``verify``.

    ``arrow_type`` picks the arrays' layout:

    - ``"large_binary"`` (the default): ``pyarrow.LargeBinaryArray`` s, one
      values buffer and one offsets buffer each; every Arrow function takes them.
    - ``"binary_view"``: ``pyarrow.BinaryViewArray`` s (Arrow's string-view
      layout; pyarrow >= 16), whose data buffers are the file's bytes as read:
      no record is copied, the faster of the two (about 1.1x as fast on 100k
      records of 1 KB: ``benchmarks/tfrecord.py --kernel-only``). ``to_pylist()``,
      ``cast(pa.large_binary())``, Parquet and IPC writes take them; some
      compute functions do not yet (``pyarrow.compute.binary_length``: cast
      first). An array holds on to the blocks its records are in.

    Other arguments are :func:`read_tfrecord`'s.

    A bad record raises :class:`~shardkit.CorruptRecordError` (url, record
    index, byte offset) after an array of the good records before it.

    Example:
        >>> for records in shardkit.read_tfrecord_batches("train-00000.tfrecord", batch_records=4096):
        ...     lengths = pyarrow.compute.binary_length(records)  # doctest: +SKIP
    """
    if batch_records < 1:
        raise ValueError(f"batch_records must be at least 1, got {batch_records}")
    if arrow_type not in ARROW_TYPES:
        raise ValueError(f"arrow_type must be one of {', '.join(map(repr, ARROW_TYPES))}, got {arrow_type!r}")
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
    return _read_arrays(
        url, compression, verify, start, stop, index, storage_options, remote, batch_records, arrow_type
    )


def _read_arrays(
    url: str,
    compression: str | None,
    verify: bool,
    start: int,
    stop: int | None,
    index: IndexLike | None,
    storage_options: dict[str, Any] | None,
    remote: RemoteOptions | None,
    batch_records: int,
    arrow_type: str,
) -> Iterator[pa.LargeBinaryArray | pa.BinaryViewArray]:
    position = _position(url, compression, start, stop, index, storage_options)
    if position is None:
        return
    first, offset, end = position
    yield from read_arrays(
        url,
        compression,
        verify,
        storage_options,
        remote,
        batch_records=batch_records,
        start=start,
        stop=stop,
        first=first,
        offset=offset,
        end=end,
        arrow_type=arrow_type,
    )


def _read(
    url: str,
    compression: str | None,
    verify: bool,
    start: int,
    stop: int | None,
    index: IndexLike | None,
    storage_options: dict[str, Any] | None,
    remote: RemoteOptions | None = None,
) -> Iterator[list[bytes]]:
    """The batches of records ``start:stop``; ``read_tfrecord`` chains them."""
    position = _position(url, compression, start, stop, index, storage_options)
    if position is None:
        return
    first, offset, end = position
    yield from read_records(
        url, compression, verify, storage_options, remote, start=start, stop=stop, first=first, offset=offset, end=end
    )


def _position(
    url: str,
    compression: str | None,
    start: int,
    stop: int | None,
    index: IndexLike | None,
    storage_options: dict[str, Any] | None,
) -> tuple[int, int, int | None] | None:
    """Where to frame from to read records ``start:stop``: (record index, byte offset, end offset or None);
    None when the index shows there is nothing to read."""
    offsets = _seek_offsets(url, index, start, storage_options) if start and compression in (None, "auto") else None
    if offsets is None:
        return 0, 0, None
    if start >= len(offsets):  # checked: the file has no record past them
        return None
    offset = int(offsets[start])
    end = int(offsets[stop]) if stop is not None and stop < len(offsets) else None
    if offset < 0:
        raise ShardkitError(f"{url}: the index gives offset {offset} for record {start}; rebuild the index")
    return start, offset, end


def _seek_offsets(
    url: str, index: IndexLike | None, start: int, storage_options: dict[str, Any] | None
) -> np.ndarray | None:
    """The record offsets to seek to ``start`` by, or None to scan from the file's start.

    An index file is checked against the file as :func:`~shardkit.formats.tfrecord.index.load_index` checks
    it. Offsets given as an array are trusted where they lead to a record (its CRCs are checked as
    it is read), and checked against the file's end when ``start`` is past them: a file that grew
    or was rewritten since would otherwise read as if it had nothing left.

    Raises:
        IndexFileError: the index does not fit the file; its message names both and the fix.
    """
    if index is None:
        return None
    if isinstance(index, (str, os.PathLike)):
        return index_files.load_given_index(url, os.fspath(index), storage_options)
    offsets = np.asarray(index, dtype=np.int64)
    if start >= len(offsets) and not index_files.check_ends_with_file(url, offsets, storage_options):
        return None  # compressed: these offsets cannot seek, and the stream is read from its start
    return offsets
