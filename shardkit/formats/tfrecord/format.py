"""TFRecord as a :class:`~shardkit.formats.base.ShardFormat`: what the sources read TFRecord shards with.

It puts the pieces of the package together: the reader (records by index,
seeking with an index file), the index files, the framing scans (counts,
the offset of a bad record), the writer, and the tf.Example decoders. Its own
work is the bad-record path: where the record after a bad one starts, so that
``on_error="skip"`` costs that record alone.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Final

import numpy as np

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.base import BadRecord, FormatBase, FormatError, RecordBound, file_record_bound
from shardkit.formats.crc import masked_crc32c
from shardkit.formats.example import decode_example, decode_sequence_example
from shardkit.formats.offsets import IndexFileError
from shardkit.formats.tfrecord import index as index_files
from shardkit.formats.tfrecord.framing import (
    HEADER_BYTES,
    OVERHEAD_BYTES,
    scan_count,
    scan_offsets,
    unpack_header,
    unpack_length,
)
from shardkit.formats.tfrecord.reader import read_tfrecord
from shardkit.formats.tfrecord.writer import TFRecordWriter
from shardkit.io.files import check_compression, open_raw
from shardkit.io.remote import RemoteOptions

__all__ = ["DECODERS", "TFRecordFormat"]

DECODERS: Final = ("example", "sequence_example", "raw")

#: Returned by ``TFRecordFormat._index_past`` when the bad record was the last of its file.
_SHARD_ENDS: Final = object()


class TFRecordFormat(FormatBase):
    """TFRecord as a :class:`~shardkit.formats.base.ShardFormat`; picklable (the ``read_fn`` of ``TFRecordDataset``).

    Args:
        decode: ``"raw"`` (the record bytes, the default), ``"example"``,
            ``"sequence_example"`` or a callable on the record bytes.
        compression: ``None``, ``"gzip"``, ``"zlib"`` or ``"auto"``.
        verify: check every record's CRCs (see :func:`read_tfrecord`).
        index: use index files beside the shards (checked with
            :func:`~shardkit.formats.tfrecord.index.load_index`) to seek to a range's
            first record and to count; without one, a framing scan counts.
        storage_options: fsspec options.
        remote: how remote shards are read (:class:`~shardkit.io.remote.RemoteOptions`:
            readahead across shard boundaries, retries, the local cache); local files ignore it.

    :meth:`read` raises at the first bad record; :meth:`read_marked`, what
    sources read with, yields a :class:`~shardkit.formats.base.BadRecord` in
    place of a record whose data CRC is wrong or that does not decode, and
    reads on (seeking past it by the index, or by the bad record's own checked
    header), so that ``on_error="skip"`` costs that record alone.
    """

    name = "tfrecord"
    suffixes = (".tfrecord.gz", ".tfrecords.gz", ".tfrecord", ".tfrecords", ".tfrec")

    def __init__(
        self,
        *,
        decode: str | Callable[[bytes], Any] = "raw",
        compression: str | None = "auto",
        verify: bool = True,
        index: bool = True,
        storage_options: dict[str, Any] | None = None,
        remote: RemoteOptions | None = None,
    ) -> None:

        check_compression(compression, allow_auto=True)
        if not callable(decode) and decode not in DECODERS:
            raise FormatError(f"decode must be one of {DECODERS} or a callable on the record bytes, got {decode!r}")
        self.decode = decode
        self.compression = compression
        self.verify = verify
        self.index = index
        self.storage_options = storage_options
        self.remote = remote
        # The last shard scanned for a bad record's offset: one scan per shard, not one per
        # bad record (a shard of many undecodable records would otherwise be read again for each).
        self._scanned: tuple[str, np.ndarray | None] | None = None

    def __repr__(self) -> str:
        return (
            f"TFRecordFormat(decode={self._decoder_name()}, compression={self.compression!r}, "
            f"verify={self.verify}, index={self.index})"
        )

    def sniff(self, head: bytes) -> bool:
        return len(head) >= HEADER_BYTES and masked_crc32c(head[:8]) == unpack_header(head)[1]

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Records ``[start, stop)`` of ``url``, decoded; a bad record raises its
        :class:`~shardkit.CorruptRecordError` after the records before it."""
        _check_range(start, stop)
        if self._decoder() is None:
            return read_tfrecord(
                url,
                compression=self.compression,
                verify=self.verify,
                start=start,
                stop=stop,
                index=self._seek_index(url, start),
                storage_options=self.storage_options,
                remote=self.remote,
            )
        return _raising(self.read_marked(url, start, stop))

    def read_marked(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Records ``[start, stop)`` of ``url``, decoded, with a :class:`~shardkit.formats.base.BadRecord`
        in place of each record that is bad while the framing around it is fine (a data CRC
        mismatch, bytes that do not decode); reading goes on with the next record. Other errors
        (a bad length, a truncated file, a stale index) are raised."""
        _check_range(start, stop)
        return self._records(url, start, stop, self._seek_index(url, start))

    def _seek_index(self, url: str, start: int) -> np.ndarray | None:
        """The checked offsets when reading from ``start`` can seek with them (raises IndexFileError)."""
        return self.index_offsets(url) if start > 0 and self.compression in (None, "auto") else None

    def _records(self, url: str, start: int, stop: int | None, offsets: np.ndarray | None) -> Iterator[Any]:

        decode = self._decoder()
        position, index = start, offsets
        while True:  # one pass per run of good records; a bad data CRC ends read_tfrecord's iterator
            records = read_tfrecord(
                url,
                compression=self.compression,
                verify=self.verify,
                start=position,
                stop=stop,
                index=index,
                storage_options=self.storage_options,
                remote=self.remote,
            )
            try:
                yield from records if decode is None else self._decoded(decode, url, position, records)
                return
            except CorruptRecordError as error:
                if not error.framing_intact or error.record_index < position:
                    raise
                yield BadRecord(error)
                position = error.record_index + 1
                index = self._index_past(url, error, offsets)
                if index is _SHARD_ENDS:  # the bad record was the file's last
                    return

    def _decoded(self, decode: Callable[[bytes], Any], url: str, start: int, records: Iterator[bytes]) -> Iterator[Any]:

        for position, record in enumerate(records, start):
            try:
                sample = decode(record)
            except Exception as error:  # the CRCs were fine: only this record is bad
                sample = BadRecord(self._decode_error(url, position, error))
            yield sample

    def _decode_error(self, url: str, position: int, error: Exception) -> CorruptRecordError:
        """The error for record ``position``, whose CRCs are fine but whose bytes do not decode."""
        try:
            offsets = self.index_offsets(url) if self.compression in (None, "auto") else None
        except ShardkitError:  # a stale index only costs the offset in the message
            offsets = None
        if offsets is None:
            offsets = self._scanned_offsets(url)
        offset = int(offsets[position]) if offsets is not None and position < len(offsets) else -1
        reason = (
            f"the record's CRCs are fine but it does not decode with {self._decoder_name()}: "
            f"{type(error).__name__}: {error}"
        )
        return CorruptRecordError(url, position, offset, reason, framing_intact=True)

    def _scanned_offsets(self, url: str) -> np.ndarray | None:
        """Record offsets of ``url`` from a framing scan (no index file), on the bad-record path only;
        None when a later bad frame stops the scan (it only costs the offset in the message)."""
        if self._scanned is None or self._scanned[0] != url:
            try:
                offsets = scan_offsets(url, compression=self.compression, storage_options=self.storage_options)
            except ShardkitError:
                offsets = None
            self._scanned = (url, offsets)
        return self._scanned[1]

    def _index_past(self, url: str, error: CorruptRecordError, offsets: np.ndarray | None) -> Any:
        """Offsets that let ``read_tfrecord`` seek to the record after the bad one at ``error.offset``.

        With an index file (``offsets``), that index. Else, in an uncompressed file, the bad
        record's header (its length CRC was checked) gives the next offset: an
        array holding just that offset at its index saves rescanning the file
        from its start after each bad record; ``_SHARD_ENDS`` when that offset
        is the end of the file (the bad record was the last, and no record is
        claimed past it). A compressed stream cannot seek: None, and the next
        pass decompresses from the start again.
        """
        if offsets is not None:
            return _SHARD_ENDS if error.record_index + 1 >= len(offsets) else offsets
        if self.compression not in (None, "auto"):
            return None
        with open_raw(url, "rb", self.storage_options) as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(error.offset)
            header = file.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES or masked_crc32c(header[:8]) != unpack_header(header)[1]:
            return None  # not a plain file at that offset (compressed, "auto" resolved so)
        after = np.zeros(error.record_index + 2, dtype=np.int64)
        after[-1] = error.offset + unpack_length(header)[0] + OVERHEAD_BYTES
        return _SHARD_ENDS if after[-1] >= size else after

    min_record_bytes: Final = 16
    """An empty record still takes its 8-byte length and two 4-byte CRCs."""

    def record_bound(self, url: str) -> RecordBound:
        """The most records ``url`` can hold by its size (see :func:`~shardkit.formats.base.max_records`)."""

        return file_record_bound(url, self.min_record_bytes, self.compression, self.storage_options, self.remote)

    def index_offsets(self, url: str) -> np.ndarray | None:
        """The record offsets from ``url``'s index file, checked against the file; None when there
        is none, the file is compressed, or ``index=False``.

        Raises:
            IndexFileError: the index does not fit the file; seeking never uses such an index.
        """
        if not self.index or self.compression in ("gzip", "zlib"):
            return None
        return index_files.load_index(url, storage_options=self.storage_options, remote=self.remote)

    def count(self, url: str) -> int:
        """Records in ``url``: from its index file if there is a valid one, else a framing scan.

        An index that does not fit the file (see :func:`~shardkit.formats.tfrecord.index.load_index`)
        is not used: a warning names it and the fix, and the file is scanned.
        """
        try:
            offsets = self.index_offsets(url)
        except IndexFileError as error:
            warnings.warn(f"{error}; counting its records by a framing scan instead", stacklevel=2)
            offsets = None
        if offsets is not None:
            return len(offsets)
        return scan_count(url, compression=self.compression, storage_options=self.storage_options, remote=self.remote)

    def build_index(self, url: str) -> str | None:
        return index_files.build_index(url, compression=self.compression, storage_options=self.storage_options)

    def writer(self, url: str, *, name: str | None = None) -> TFRecordWriter:
        compression = self.compression if self.compression in ("gzip", "zlib") else None
        return TFRecordWriter(url, compression, self.storage_options)

    def _decoder(self) -> Callable[[bytes], Any] | None:
        if callable(self.decode):
            return self.decode
        if self.decode == "raw":
            return None
        return decode_example if self.decode == "example" else decode_sequence_example

    def _decoder_name(self) -> str:
        return getattr(self.decode, "__name__", repr(self.decode)) if callable(self.decode) else repr(self.decode)


def _check_range(start: int, stop: int | None) -> None:
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")


def _raising(records: Iterator[Any]) -> Iterator[Any]:
    """``records`` with the first :class:`~shardkit.formats.base.BadRecord` raised as its error."""

    for record in records:
        if record.__class__ is BadRecord:
            raise record.error
        yield record
