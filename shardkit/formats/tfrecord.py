"""TFRecord framing: read and write byte-compatibly with TensorFlow, without it.

Each record is ``uint64 length (LE) | uint32 masked_crc32c(length bytes) |
data[length] | uint32 masked_crc32c(data)``; GZIP and ZLIB compress the whole
file stream. See :mod:`shardkit.formats.crc` for the mask.

The reader fetches :data:`~shardkit.formats.io.BLOCK_SIZE` bytes at a time,
finds the record boundaries of the whole block in one tight loop, then checks
the block's CRCs in bulk (length CRCs vectorised with numpy, data CRCs with one
hardware CRC call per record) before handing out the records.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, Final, NamedTuple, Optional, Union

import numpy as np

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.crc import crc32c, mask, masked_crc32c, masked_crc32c_of_lengths, unmask_array
from shardkit.formats.io import BLOCK_SIZE, Sink, check_compression, open_input, open_output, open_raw, sniff_compression

__all__ = ["TFRecordWriter", "count_records", "detect_compression", "read_tfrecord", "scan_offsets", "verify_tfrecord"]

IndexLike = Union[str, "os.PathLike[str]", Sequence[int], np.ndarray]
Progress = Callable[[int], object]

_HEADER: Final = 12
_OVERHEAD: Final = 16
_unpack_length = struct.Struct("<Q").unpack_from
_unpack_header = struct.Struct("<QI").unpack_from
_pack_header = struct.Struct("<QI").pack
_pack_u32 = struct.Struct("<I").pack
_pack_u64 = struct.Struct("<Q").pack
_U32_BYTES: Final = np.arange(4)


# --------------------------------------------------------------------------- reading


class _Source(NamedTuple):
    """What error messages need to know about the stream being read."""

    url: str
    compression: Optional[str]

    def error(self, index: int, offset: int, reason: str) -> CorruptRecordError:
        if self.compression is not None:
            reason += f" (offset in the uncompressed {self.compression} stream)"
        return CorruptRecordError(self.url, index, offset, reason)


class _Block(NamedTuple):
    """Whole records found in one buffer: record ``i`` spans ``buf[ends[i-1]:ends[i]]``."""

    buf: bytes
    ends: list[int]
    first_index: int
    offset: int  # stream offset of buf[0]


def _blocks(stream: Any, src: _Source, *, first_index: int, offset: int, check_headers: bool) -> Iterator[_Block]:
    """Split a stream into blocks of whole records, raising on truncation.

    With ``check_headers`` every length CRC is verified before a block is
    yielded, so a corrupt length is reported where it is, not as garbage later.
    """
    rest = b""
    need = BLOCK_SIZE
    index = first_index
    while True:
        chunk = stream.read(need)
        if not chunk:
            if rest:
                _raise_truncated(rest, src, index, offset, check_headers)
            return
        buf = rest + chunk if rest else chunk
        end = len(buf)
        pos = 0
        ends: list[int] = []
        add = ends.append
        unpack = _unpack_length
        limit = end - 12  # _HEADER, inlined: this loop is the reader's hot path
        while pos <= limit:
            nxt = pos + unpack(buf, pos)[0] + 16  # _OVERHEAD
            if nxt > end:
                break
            add(nxt)
            pos = nxt
        if ends:
            block = _Block(buf, ends, index, offset)
            bad = _first_bad_header(block) if check_headers else None
            if bad is not None:  # hand out the good records before it, then raise
                if bad:
                    yield block._replace(ends=ends[:bad])
                start = ends[bad - 1] if bad else 0
                raise src.error(index + bad, offset + start, _length_crc_reason(buf[start : start + _HEADER]))
            yield block
            index += len(ends)
            offset += pos
        rest = buf[pos:]
        need = BLOCK_SIZE
        if len(rest) >= _HEADER:
            length, stored = _unpack_header(rest)
            if check_headers and masked_crc32c(rest[:8]) != stored:
                raise src.error(index, offset, _length_crc_reason(rest))
            need = max(BLOCK_SIZE, length + _OVERHEAD - len(rest))


def _raise_truncated(rest: bytes, src: _Source, index: int, offset: int, check_headers: bool) -> None:
    if len(rest) < _HEADER:
        raise src.error(index, offset, f"file ends inside record header: expected {_HEADER - len(rest)} more bytes")
    if check_headers and masked_crc32c(rest[:8]) != _unpack_header(rest)[1]:
        raise src.error(index, offset, _length_crc_reason(rest))
    missing = _unpack_length(rest)[0] + _OVERHEAD - len(rest)
    raise src.error(index, offset, f"file ends inside record: expected {missing} more bytes")


def _length_crc_reason(header: bytes) -> str:
    length, stored = _unpack_header(header)
    return (
        f"length CRC mismatch: expected 0x{masked_crc32c(header[:8]):08x}, found 0x{stored:08x} "
        f"(length field reads {length})"
    )


def _starts(block: _Block) -> np.ndarray:
    ends = np.array(block.ends, dtype=np.int64)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1]
    return starts


def _u32_at(arr: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Little-endian uint32 values stored at byte ``positions`` of ``arr``."""
    return np.ascontiguousarray(arr[positions[:, None] + _U32_BYTES]).view("<u4").ravel()


def _first_bad_header(block: _Block) -> Optional[int]:
    """Index (within the block) of the first record whose length CRC is wrong."""
    starts = _starts(block)
    lengths = np.array(block.ends, dtype=np.int64) - starts - _OVERHEAD
    stored = _u32_at(np.frombuffer(block.buf, np.uint8), starts + 8)
    bad = np.flatnonzero(masked_crc32c_of_lengths(lengths.astype(np.uint64)) != stored)
    return int(bad[0]) if bad.size else None


def _records(block: _Block, lo: int, hi: int, src: _Source, verify: bool) -> Iterator[bytes]:
    """Records ``lo:hi`` of a block; with ``verify``, raise at the first bad data CRC.

    Records are sliced one at a time as they are consumed: slicing a whole block
    up front makes the allocator return and re-fault memory on every block.
    """
    buf = block.buf
    ends = block.ends[lo:hi]
    starts = block.ends[lo - 1 : hi - 1] if lo else [0, *block.ends[: hi - 1]]
    if not verify:
        for a, b in zip(starts, ends):
            yield buf[a + 12 : b - 4]  # 12 = _HEADER
        return
    stored = _u32_at(np.frombuffer(buf, np.uint8), np.array(ends, dtype=np.int64) - 4)
    check = crc32c
    for a, b, want in zip(starts, ends, unmask_array(stored).tolist()):
        record = buf[a + 12 : b - 4]
        if check(record) != want:
            raise src.error(
                block.first_index + lo + ends.index(b),
                block.offset + a,
                f"data CRC mismatch: expected 0x{masked_crc32c(record):08x}, "
                f"found 0x{mask(want):08x} (over {len(record)} data bytes)",
            )
        yield record


def detect_compression(head: bytes) -> Optional[str]:
    """``None``, "gzip" or "zlib" for a stream starting with ``head`` (>= 12 bytes if present).

    A valid TFRecord length CRC means plain (a compressed stream passes that
    check with odds of 2**-32); otherwise the gzip magic or a zlib header; an
    unrecognised start is treated as plain, so reading it reports the bad header.
    """
    if len(head) >= _HEADER and masked_crc32c(head[:8]) == _unpack_header(head)[1]:
        return None
    return sniff_compression(head)


def _open(
    url: str, compression: Optional[str], storage_options: Optional[dict[str, Any]], seek_to: int = 0
) -> tuple[Any, _Source]:
    """Open ``url`` for record reading, resolving ``compression="auto"``.

    ``seek_to`` is honoured only when the stream is not compressed.
    """
    check_compression(compression, allow_auto=True)
    raw = open_raw(url, "rb", storage_options)
    try:
        head = b""
        if compression == "auto":  # the first block itself, unless about to seek away
            head = raw.read(_HEADER if seek_to else BLOCK_SIZE)
            compression = detect_compression(head)
        if compression is None and seek_to:
            raw.seek(seek_to)
            head = b""
        return open_input(url, compression, raw=raw, head=head), _Source(url, compression)
    except BaseException:
        raw.close()
        raise


def _wrong_compression_hint(exc: CorruptRecordError, head: bytes) -> CorruptRecordError:
    """Point at the likely cause when the very first header of a plain read is bad."""
    guess = sniff_compression(head)
    if exc.record_index == 0 and exc.offset == 0 and guess is not None:
        return CorruptRecordError(
            exc.url, 0, 0, f"{exc.reason}; the file starts like a {guess} stream: pass compression={guess!r} or 'auto'"
        )
    return exc


def read_tfrecord(
    url: str,
    *,
    compression: Optional[str] = "auto",
    verify: bool = True,
    start: int = 0,
    stop: Optional[int] = None,
    index: Optional[IndexLike] = None,
    storage_options: Optional[dict[str, Any]] = None,
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
        storage_options: passed to fsspec.

    The file is opened on the first ``next()`` and closed when the iterator is
    exhausted or garbage collected.
    """
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
    return _read(url, compression, verify, start, stop, index, storage_options)


def _read(
    url: str,
    compression: Optional[str],
    verify: bool,
    start: int,
    stop: Optional[int],
    index: Optional[IndexLike],
    storage_options: Optional[dict[str, Any]],
) -> Iterator[bytes]:
    first = offset = 0
    if index is not None and start and compression in (None, "auto"):
        offsets = _offsets_from(index, storage_options)
        if start >= len(offsets):
            return
        first, offset = start, int(offsets[start])
    stream, src = _open(url, compression, storage_options, seek_to=offset)
    if src.compression is not None:
        first = offset = 0  # compressed streams cannot seek by record
    try:
        for block in _blocks(stream, src, first_index=first, offset=offset, check_headers=verify):
            n = len(block.ends)
            lo = max(0, start - block.first_index)
            hi = n if stop is None else min(n, stop - block.first_index)
            if lo < hi:
                yield from _records(block, lo, hi, src, verify)
            if stop is not None and block.first_index + n >= stop:
                return
    except CorruptRecordError as exc:
        if first == 0 and src.compression is None:
            raise _wrong_compression_hint(exc, _peek(url, storage_options)) from None
        raise
    finally:
        stream.close()


def _peek(url: str, storage_options: Optional[dict[str, Any]]) -> bytes:
    with open_raw(url, "rb", storage_options) as raw:
        return raw.read(_HEADER)


def _offsets_from(index: IndexLike, storage_options: Optional[dict[str, Any]]) -> np.ndarray:
    if isinstance(index, (str, os.PathLike)):
        from shardkit.formats.index import read_index

        return read_index(os.fspath(index), storage_options)
    return np.asarray(index, dtype=np.int64)


def _scan(
    url: str,
    compression: Optional[str],
    storage_options: Optional[dict[str, Any]],
    *,
    check_headers: bool,
    progress: Optional[Progress] = None,
) -> Iterator[tuple[_Block, _Source]]:
    stream, src = _open(url, compression, storage_options)
    try:
        for block in _blocks(stream, src, first_index=0, offset=0, check_headers=check_headers):
            yield block, src
            if progress is not None:
                progress(block.offset + block.ends[-1])
    finally:
        stream.close()


def count_records(url: str, *, compression: Optional[str] = "auto", storage_options: Optional[dict[str, Any]] = None) -> int:
    """Number of records in a TFRecord file, from a fast framing scan (no CRC checks).

    Raises :class:`~shardkit.CorruptRecordError` if the file ends inside a record.
    """
    return sum(len(block.ends) for block, _ in _scan(url, compression, storage_options, check_headers=False))


def scan_offsets(
    url: str,
    *,
    compression: Optional[str] = "auto",
    storage_options: Optional[dict[str, Any]] = None,
    progress: Optional[Progress] = None,
) -> np.ndarray:
    """Byte offset of every record (in the uncompressed stream), as ``int64``.

    Length CRCs are checked so that a corrupt length cannot produce a wrong
    index; ``progress(nbytes)`` is called after each block with the bytes done.
    """
    blocks = _scan(url, compression, storage_options, check_headers=True, progress=progress)
    parts = [block.offset + _starts(block) for block, _ in blocks]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def verify_tfrecord(
    url: str,
    *,
    compression: Optional[str] = "auto",
    storage_options: Optional[dict[str, Any]] = None,
    progress: Optional[Progress] = None,
) -> int:
    """Check every length and data CRC; return the number of records.

    Raises :class:`~shardkit.CorruptRecordError` at the first bad record;
    ``progress(nbytes)`` is called after each block with the bytes done.
    """
    count = 0
    blocks = _scan(url, compression, storage_options, check_headers=True, progress=progress)
    for block, src in blocks:
        for _ in _records(block, 0, len(block.ends), src, True):
            count += 1
    return count


# --------------------------------------------------------------------------- writing


class TFRecordWriter:
    """Write records to a TFRecord file at any fsspec URL.

    Use as a context manager::

        with TFRecordWriter("s3://bucket/train-0.tfrecord") as writer:
            writer.write(record)

    ``compression`` is ``None``, ``"gzip"`` or ``"zlib"`` (whole-stream, as TensorFlow).
    """

    def __init__(self, url: str, compression: Optional[str] = None, storage_options: Optional[dict[str, Any]] = None) -> None:
        self.url = url
        self.compression = compression
        self.num_records = 0
        self.num_bytes = 0  # framed, uncompressed bytes written so far
        self._sink: Optional[Sink] = open_output(url, compression, storage_options)

    def write(self, record: Union[bytes, bytearray, memoryview]) -> None:
        """Append one record."""
        if self._sink is None:
            raise ShardkitError(f"{self.url}: write() on a closed TFRecordWriter")
        length = len(record)
        length_bytes = _pack_u64(length)
        self._sink.write(length_bytes + _pack_u32(masked_crc32c(length_bytes)))
        self._sink.write(record)
        self._sink.write(_pack_u32(masked_crc32c(record)))
        self.num_records += 1
        self.num_bytes += length + _OVERHEAD

    def close(self) -> None:
        """Flush and close the file; calling it again does nothing."""
        if self._sink is not None:
            sink, self._sink = self._sink, None
            sink.close()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
