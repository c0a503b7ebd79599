"""TFRecord framing: find, check and cut the records of a TFRecord stream, byte-compatibly with TensorFlow.

Each record is ``uint64 length (LE) | uint32 masked_crc32c(length bytes) |
data[length] | uint32 masked_crc32c(data)``; GZIP and ZLIB compress the whole
file stream. See :mod:`shardkit.formats.crc` for the mask.

This module reads records from a known position (record index and byte
offset) and scans whole files (counts, offsets, verification); it knows
nothing of index files. :mod:`~shardkit.formats.tfrecord.index` builds and
checks those with the scans here, and :func:`~shardkit.formats.tfrecord.reader.read_tfrecord`
turns an index into the position to read from.

How the reader is fast (each step measured on ``benchmarks/tfrecord.py``):

- It works a block at a time (:data:`LOCAL_BLOCK_SIZE` bytes of a local file,
  small enough to stay in cache; :data:`~shardkit.io.files.BLOCK_SIZE` of a
  stream), and the per-record loops run in the framing kernel
  (:mod:`~shardkit.formats.tfrecord.kernel`: C when built, else Python): one
  call finds the record boundaries of the whole block and checks their length
  CRCs; one call per :data:`_BATCH` records checks their data CRCs and copies
  them out, handed out (by ``read_tfrecord``) through ``itertools.chain``: no
  Python frame per record (a local file under the compiled kernel: none per block
  either, :func:`~shardkit.formats.tfrecord.arrays.read_records`).
- ``read_arrays`` (:mod:`~shardkit.formats.tfrecord.arrays`, for
  ``read_tfrecord_batches``) makes no Python object per record, and reads a
  local uncompressed file with the compiled kernel's own reader, a batch per
  call; it hands a record that needs this module's checks and messages to
  :func:`_file_blocks` (with the file's size when opened), else it takes blocks
  from here and the kernel checks and copies (``large_binary``) or just checks
  and points at (``binary_view``) each block's records as soon as it is read.
- Local uncompressed files are read with one ``os.preadv`` per block, at a
  record boundary, into buffers reused once nothing holds them, by every reader
  of the process (:func:`~shardkit.formats.tfrecord.buffers.shared_buffers`: a fresh buffer per block cost about
  what the read does, in page faults). Not memory-mapped: a mapped file truncated under the
  reader kills the process with SIGBUS, and the map bought nothing measurable:
  on 100k 1 KB records, ``pread`` took 0.86-1.03x the map's CPU time with CRCs
  and 0.75-0.92x without, over three runs.
- Remote and compressed files are streamed: one ranged read per block. Remote
  blocks are fetched ahead of the reader, retried, and pinned to the version
  opened by :mod:`shardkit.io.remote` (or read from its local cache).

What the reader does with bad input (each case has a fault-injection test in
``tests/formats/test_faults_tfrecord.py``): every malformed byte sequence ends in a
:class:`~shardkit.CorruptRecordError` naming the url, record index and byte
offset, after the good records before it. A length field is never trusted for
an allocation: it is checked against its CRC (when verifying) and against the
bytes the file holds, and a record longer than a block is gathered a block at a
time. A damaged GZIP/ZLIB stream is reported at the record being inflated, with
the compressed position. A local file cut short while being read is reported
as truncated (even when the cut falls between records); a file replaced by a
rename while being read is read to its end as it was, since the open
descriptor keeps the old inode.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Generator, Iterator
from typing import Any, Final, NamedTuple

import numpy as np
from fsspec.implementations.local import LocalFileOpener

from shardkit.errors import CorruptRecordError
from shardkit.formats.crc import masked_crc32c
from shardkit.formats.sniff import describe_file
from shardkit.formats.tfrecord import kernel
from shardkit.formats.tfrecord.buffers import shared_buffers
from shardkit.io.files import (
    BLOCK_SIZE,
    CompressedStreamError,
    Stream,
    check_compression,
    open_input,
    open_raw,
    sniff_compression,
)
from shardkit.io.remote import RemoteOptions

__all__ = [
    "HEADER_BYTES",
    "LOCAL_BLOCK_SIZE",
    "OVERHEAD_BYTES",
    "count_records",
    "detect_compression",
    "read_batches",
    "scan_count",
    "scan_offsets",
    "unpack_header",
    "unpack_length",
    "verify_tfrecord",
]

Progress = Callable[[int], object]

HEADER_BYTES: Final = 12
"""A record's header: its ``uint64`` length and the masked CRC of those 8 bytes."""
OVERHEAD_BYTES: Final = 16
"""Bytes of framing around each record's data: its header and the ``uint32`` CRC of the data."""
unpack_length = struct.Struct("<Q").unpack_from
unpack_header = struct.Struct("<QI").unpack_from
_BATCH: Final = 128  # records cut and checked together; 32..1024 all measured about the same


# --------------------------------------------------------------------------- reading


class _Origin(NamedTuple):
    """What error messages need to know about the stream being read."""

    url: str
    compression: str | None
    size: int | None = None  # bytes in the stream, when known up front (plain files): bounds record lengths

    def error(
        self,
        index: int,
        offset: int,
        reason: str,
        *,
        framing_intact: bool = False,
        compressed_offset: int | None = None,
    ) -> CorruptRecordError:
        if self.compression is not None:
            reason += f" (offset in the uncompressed {self.compression} stream)"
        elif offset == 0 and (hint := describe_file(self.url)):  # the first record: perhaps not TFRecord at all
            reason += f"; {hint}"
        return CorruptRecordError(
            self.url, index, offset, reason, framing_intact=framing_intact, compressed_offset=compressed_offset
        )

    def length_error(self, index: int, offset: int, header: bytes) -> CorruptRecordError:
        """A bad length CRC; at the very start of a plain read, say if the file looks compressed."""
        length, stored = unpack_header(header)
        reason = (
            f"length CRC mismatch: expected 0x{masked_crc32c(header[:8]):08x}, found 0x{stored:08x} "
            f"(length field reads {length})"
        )
        guess = sniff_compression(header) if offset == 0 and self.compression is None else None
        if guess is not None:
            reason += f"; the file starts like a {guess} stream: pass compression={guess!r} or 'auto'"
        return self.error(index, offset, reason)

    def truncated(
        self, index: int, offset: int, header: bytes, available: int, check_header: bool
    ) -> CorruptRecordError:
        """The stream ends ``available`` bytes into the record that starts with ``header``."""
        if len(header) < HEADER_BYTES:
            return self.error(
                index, offset, f"file ends inside record header: expected {HEADER_BYTES - available} more bytes"
            )
        if check_header and masked_crc32c(header[:8]) != unpack_header(header)[1]:
            return self.length_error(index, offset, header)
        missing = unpack_length(header)[0] + OVERHEAD_BYTES - available
        return self.error(index, offset, f"file ends inside record: expected {missing} more bytes")


class _Block(NamedTuple):
    """Whole records in a buffer: record ``i`` spans ``buf[ends[i-1]:ends[i]]``, record 0 ``buf[first:ends[0]]``."""

    buf: bytes | memoryview  # a memoryview: a local file's block, writable
    first: int
    ends: np.ndarray  # int64
    first_index: int
    offset: int  # stream offset of buf[0]


def _frame(buf: bytes | memoryview, check_headers: bool) -> tuple[np.ndarray, bool]:
    """End positions of the whole records of ``buf`` from its start (the kernel's walk, C or Python), and whether
    the walk stopped at a bad length CRC (checked only with ``check_headers``)."""
    return kernel.KERNEL.frame(buf, 0, len(buf), check_headers)


def _checked(block: _Block, bad_header: bool, src: _Origin) -> Iterator[_Block]:
    """Yield ``block`` (unless it is empty); with ``bad_header``, raise at the record after its last."""
    ends = block.ends
    if len(ends):
        yield block
    if bad_header:
        start = int(ends[-1]) if len(ends) else block.first
        raise src.length_error(
            block.first_index + len(ends), block.offset + start, bytes(block.buf[start : start + HEADER_BYTES])
        )


#: First read of a local file when no end offset is known (reads then double up to a block).
_FIRST_LOCAL_READ = 16 * 1024

LOCAL_BLOCK_SIZE: Final = 256 * 1024
"""A local file's reads (at most :data:`BLOCK_SIZE`): small enough that the bytes a read brings in are still in a
core's L2 cache when the kernel frames, checks and copies their records. On 100k records of 1 KB, 256 KB blocks
made ``read_tfrecord`` 1.4x and ``read_tfrecord_batches`` 1.1x as fast as 4 MB ones (128 KB and 1 MB: slower)."""


def _first_read(offset: int, end: int | None, block_size: int | None = None) -> int:
    """Bytes to read first from ``offset``: up to ``end`` when an index says the records wanted end there.

    A short range (a block of a shuffled plan, one record) must not cost
    framing a whole :data:`BLOCK_SIZE` (a remote file: nor the readahead a
    large read starts); reads after the first are whole blocks.
    """
    block_size = block_size or BLOCK_SIZE
    return min(block_size, end - offset) if end is not None and end > offset else block_size


def _stream_blocks(
    stream: Stream, src: _Origin, first_index: int, offset: int, check_headers: bool, end: int | None = None
) -> Generator[_Block, None, None]:
    """Blocks from a stream read :data:`BLOCK_SIZE` bytes at a time (the first up to ``end``, when known).

    A record longer than a block is gathered read by read up to its stated
    length, never by one request of that length: a corrupt length field can say
    2**64 - 1 (with a valid CRC, when unverified or forged), and must cost at
    most the bytes the stream really holds; when the stream's size is known
    (``src.size``), a length it cannot hold is reported without reading on.
    """
    index = first_index
    rest = b""
    started = offset
    size = _first_read(offset, end)
    while True:
        chunk = _read_some(stream, src, index, offset, size)
        size = BLOCK_SIZE
        if not chunk:
            if rest:
                raise src.truncated(index, offset, rest[:HEADER_BYTES], len(rest), check_headers)
            if offset == started and index > 0:
                raise src.error(index, offset, "file ends where this record should start (as the index says)")
            return
        buf = rest + chunk if rest else chunk
        ends, bad_header = _frame(buf, check_headers)
        yield from _checked(_Block(buf, 0, ends, index, offset), bad_header, src)
        done = int(ends[-1]) if len(ends) else 0
        index += len(ends)
        offset += done
        rest = buf[done:]
        if len(rest) >= HEADER_BYTES:  # a record continues in the next read: check its length before trusting it
            if check_headers and masked_crc32c(rest[:8]) != unpack_header(rest)[1]:
                raise src.length_error(index, offset, rest[:HEADER_BYTES])
            need = unpack_length(rest)[0] + OVERHEAD_BYTES
            if need > len(rest) + BLOCK_SIZE:  # the next read would not finish it: gather it whole
                if src.size is not None and offset + need > src.size:
                    raise src.truncated(index, offset, rest[:HEADER_BYTES], src.size - offset, False)
                record = _gather(stream, src, index, offset, rest, need)
                yield _Block(record, 0, np.array([need], dtype=np.int64), index, offset)
                index += 1
                offset += need
                rest = b""


def _gather(stream: Stream, src: _Origin, index: int, offset: int, head: bytes, need: int) -> bytes:
    """Read on from ``head`` (the record's first bytes) to the record's ``need`` bytes, a block at most per read."""
    parts = [head]
    have = len(head)
    while have < need:
        chunk = _read_some(stream, src, index, offset, min(need - have, BLOCK_SIZE))
        if not chunk:
            raise src.truncated(index, offset, head[:HEADER_BYTES], have, False)
        parts.append(chunk)
        have += len(chunk)
    return b"".join(parts)


def _read_some(stream: Stream, src: _Origin, index: int, offset: int, size: int) -> bytes:
    """``stream.read(size)``, with a damaged compressed stream reported at record ``index``."""
    try:
        return stream.read(size)
    except CompressedStreamError as error:
        at = error.compressed_offset if error.compressed_offset >= 0 else None
        if error.not_compressed:
            raise src.error(index, offset, error.reason, compressed_offset=at) from None
        raise src.error(index, offset, f"{error.reason}; reading record {index}", compressed_offset=at) from None


def _file_blocks(
    fd: int,
    src: _Origin,
    first_index: int,
    offset: int,
    check_headers: bool,
    end: int | None = None,
    block_size: int | None = None,
    opened_size: int | None = None,
) -> Generator[_Block, None, None]:
    """Blocks from a local file descriptor, each read with one ``os.pread`` at a record boundary
    (of ``block_size`` bytes, default :data:`LOCAL_BLOCK_SIZE`, bar a record longer than that).

    ``opened_size``: the file's size when the reader opened it, when it read some of the file before (the
    compiled reader of ``read_tfrecord_batches`` hands a record over here): a file ending at ``offset`` then
    shrank (or is reported by the caller), it is not an index pointing past its end.

    Not memory-mapped: a mapped file truncated under the reader kills the
    process with SIGBUS, while ``pread`` just returns fewer bytes, which is
    reported as a truncated record. A record longer than a block is read whole
    only after its length CRC is checked and the file is seen to hold it.
    """
    index = first_index
    pos = offset
    block_size = block_size or min(BLOCK_SIZE, LOCAL_BLOCK_SIZE)
    # Without an end, the first read is small and reads double up to a block: a
    # reader restarts here after each bad record it skips, and framing a whole
    # block per restart made a shard of many bad records cost quadratic time.
    size = _first_read(offset, end, block_size) if end is not None else min(_FIRST_LOCAL_READ, block_size)
    handed_over = opened_size is not None
    opened_size = os.fstat(fd).st_size if opened_size is None else opened_size
    buffers = shared_buffers(block_size)
    while True:
        buf = buffers.read(fd, size, pos)
        ends, bad_header = _frame(buf, check_headers)
        yield from _checked(_Block(buf, 0, ends, index, pos), bad_header, src)
        if len(ends):
            index += len(ends)
            pos += int(ends[-1])
            size = min(2 * size, block_size) if end is None else block_size
            continue
        if len(buf) < size:  # the file ends here
            unstarted = first_index > 0 and pos == offset and not handed_over
            _check_file_end(fd, src, index, pos, bytes(buf), opened_size, unstarted, check_headers)
            return
        # A full block without one whole record: the first record is longer than a block.
        if len(buf) < HEADER_BYTES:  # (only with tiny test block sizes)
            size = HEADER_BYTES
            continue
        header = bytes(buf[:HEADER_BYTES])
        if check_headers and masked_crc32c(header[:8]) != unpack_header(header)[1]:
            raise src.length_error(index, pos, header)
        need = unpack_length(header)[0] + OVERHEAD_BYTES
        available = os.fstat(fd).st_size - pos
        if need > available:
            raise src.truncated(index, pos, header, available, False)
        size = need


def _check_file_end(
    fd: int, src: _Origin, index: int, pos: int, tail: bytes, opened_size: int, unstarted: bool, check_headers: bool
) -> None:
    """At the end of a local file (``tail`` read at ``pos``), raise unless it ends cleanly at a record boundary.

    The file is compared with its size when the reader opened it, so a file
    cut short under the reader is an error even when the cut falls on a
    record boundary. ``unstarted``: nothing was read from the offset an index gave.
    """
    if tail:
        raise src.truncated(index, pos, tail[:HEADER_BYTES], len(tail), check_headers)
    file_size = os.fstat(fd).st_size
    if file_size < opened_size:
        reason = f"file shrank from {opened_size} to {file_size} bytes while being read (truncated under the reader)"
        raise src.error(index, pos, reason)
    if unstarted:
        raise src.error(index, pos, "file ends where this record should start (as the index says)")


def _blocks(
    source: Stream | LocalFileOpener,
    src: _Origin,
    *,
    first_index: int,
    offset: int,
    check_headers: bool,
    end: int | None = None,
    block_size: int | None = None,
) -> Generator[_Block, None, None]:
    """Blocks of whole records from ``source`` at record ``first_index``, byte ``offset``
    (``end``: where the records wanted end, when an index says so; ``block_size``: a local
    file's reads, default :data:`LOCAL_BLOCK_SIZE`; a stream's are always :data:`BLOCK_SIZE`).

    Raises :class:`~shardkit.CorruptRecordError` if the data ends inside a
    record and, with ``check_headers``, at a bad length CRC (after the blocks
    of the good records before it), so a corrupt length is reported where it is.
    """
    if isinstance(source, LocalFileOpener):
        return _file_blocks(source.fileno(), src, first_index, offset, check_headers, end, block_size)
    return _stream_blocks(source, src, first_index, offset, check_headers, end)


def _spans(block: _Block) -> tuple[np.ndarray, np.ndarray]:
    """Start and end positions of the block's records, as arrays."""
    ends = block.ends
    starts = np.empty_like(ends)
    if len(ends):
        starts[0] = block.first
        starts[1:] = ends[:-1]
    return starts, ends


def _start(block: _Block, i: int) -> int:
    """Where record ``i`` of the block starts, in its buffer."""
    return int(block.ends[i - 1]) if i else block.first


def _data_error(block: _Block, i: int, src: _Origin) -> CorruptRecordError:
    """The error for record ``i`` of the block, whose data CRC the kernel found wrong."""
    start, end = _start(block, i), int(block.ends[i])
    stored = int.from_bytes(block.buf[end - 4 : end], "little")
    reason = _data_crc_reason(block.buf[start + HEADER_BYTES : end - 4], stored)
    return src.error(block.first_index + i, block.offset + start, reason, framing_intact=True)


def _batches(block: _Block, lo: int, hi: int, src: _Origin, verify: bool) -> Iterator[list[bytes]]:
    """Records ``lo:hi`` of a block in lists of up to :data:`_BATCH`.

    With ``verify``, each batch's data CRCs are checked as it is cut (by the
    kernel, C or Python); at a bad one, the records before it come as a last
    batch, then the error is raised. Cutting a batch at a time lets the memory
    of a batch be reused by the next while it is still in cache.
    """
    cut = kernel.KERNEL.cut
    for i in range(lo, hi, _BATCH):
        records, bad = cut(block.buf, block.first, block.ends, i, min(i + _BATCH, hi), verify)
        if bad >= 0:
            if records:
                yield records
            raise _data_error(block, bad, src)
        yield records


def _data_crc_reason(record: bytes | memoryview, stored: int) -> str:
    return (
        f"data CRC mismatch: expected 0x{masked_crc32c(record):08x}, found 0x{stored:08x} "
        f"(over {len(record)} data bytes)"
    )


def detect_compression(head: bytes) -> str | None:
    """``None``, "gzip" or "zlib" for a stream starting with ``head`` (>= 12 bytes if present).

    A valid TFRecord length CRC means plain (a compressed stream passes that
    check with odds of 2**-32); otherwise the gzip magic or a zlib header; an
    unrecognised start is treated as plain, so reading it reports the bad header.
    """
    if len(head) >= HEADER_BYTES and masked_crc32c(head[:8]) == unpack_header(head)[1]:
        return None
    return sniff_compression(head)


def _open(
    url: str,
    compression: str | None,
    storage_options: dict[str, Any] | None,
    seek_to: int = 0,
    remote: RemoteOptions | None = None,
) -> tuple[Stream | LocalFileOpener, _Origin]:
    """Open ``url`` for record reading, resolving ``compression="auto"``.

    A local uncompressed file comes back as its open file (read with
    ``os.pread``), anything else as a stream. ``seek_to`` is honoured only when
    the data is not compressed.
    """
    check_compression(compression, allow_auto=True)
    raw = open_raw(url, "rb", storage_options, remote=remote)
    try:
        local = isinstance(raw, LocalFileOpener)
        head = b""
        if compression == "auto":  # read the first block itself, unless seeking or reading locally
            head = raw.read(HEADER_BYTES if seek_to or local else max(BLOCK_SIZE, HEADER_BYTES))
            compression = detect_compression(head)
        if compression is None and local:
            return raw, _Origin(url, None)
        size = getattr(raw, "size", None) if compression is None else None
        src = _Origin(url, compression, size if isinstance(size, int) else None)
        if compression is None and seek_to:
            raw.seek(seek_to)
            head = b""
        return open_input(url, compression, raw=raw, head=head), src
    except BaseException:
        raw.close()
        raise


def read_batches(
    url: str,
    compression: str | None,
    verify: bool,
    storage_options: dict[str, Any] | None,
    remote: RemoteOptions | None,
    *,
    start: int,
    stop: int | None,
    first: int = 0,
    offset: int = 0,
    end: int | None = None,
) -> Iterator[list[bytes]]:
    """The records ``start:stop`` of ``url`` in batches, framing from record ``first`` at byte ``offset``
    (a record boundary an index gave; ``end``: where the records wanted end, when it says so).

    A compressed stream cannot seek: it is read from its start, whatever the position.
    """
    source, src = _open(url, compression, storage_options, seek_to=offset, remote=remote)
    if src.compression is not None:
        first = offset = 0  # compressed streams cannot seek by record
        end = None
    yield from _read_batches(source, src, verify, start=start, stop=stop, first=first, offset=offset, end=end)


def _read_batches(
    source: Stream | LocalFileOpener,
    src: _Origin,
    verify: bool,
    *,
    start: int,
    stop: int | None,
    first: int,
    offset: int,
    end: int | None,
) -> Iterator[list[bytes]]:
    """:func:`read_batches` from what :func:`_open` opened (closed when done)."""
    blocks = _blocks(source, src, first_index=first, offset=offset, check_headers=verify, end=end)
    try:
        for block in blocks:
            n = len(block.ends)
            lo = max(0, start - block.first_index)
            hi = n if stop is None else min(n, stop - block.first_index)
            if lo < hi:
                yield from _batches(block, lo, hi, src, verify)
            if stop is not None and block.first_index + n >= stop:
                return
    finally:
        blocks.close()
        source.close()


def _scan(
    url: str,
    compression: str | None,
    storage_options: dict[str, Any] | None,
    *,
    check_headers: bool,
    progress: Progress | None = None,
    remote: RemoteOptions | None = None,
) -> Iterator[tuple[_Block, _Origin]]:
    source, src = _open(url, compression, storage_options, remote=remote)
    blocks = _blocks(source, src, first_index=0, offset=0, check_headers=check_headers)
    try:
        for block in blocks:
            yield block, src
            if progress is not None:
                progress(block.offset + int(block.ends[-1]))
    finally:
        blocks.close()
        source.close()


def scan_count(
    url: str,
    *,
    compression: str | None = "auto",
    storage_options: dict[str, Any] | None = None,
    remote: RemoteOptions | None = None,
) -> int:
    """Number of records in one TFRecord file, from a fast framing scan (no CRC checks).

    Raises :class:`~shardkit.CorruptRecordError` if the file ends inside a record.
    Named like :func:`scan_offsets`, its sibling: ``count_records`` is
    :meth:`ShardedDataset.count_records() <shardkit.ShardedDataset.count_records>`,
    which fills in the counts of a whole shard list (manifest, index files,
    cache or ``count_fn``) and returns the dataset.
    """
    scan = _scan(url, compression, storage_options, check_headers=False, remote=remote)
    return sum(len(block.ends) for block, _ in scan)


count_records = scan_count
"""The old name of :func:`scan_count`, kept so that code importing it still works."""


def scan_offsets(
    url: str,
    *,
    compression: str | None = "auto",
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> np.ndarray:
    """Byte offset of every record (in the uncompressed stream), as ``int64``.

    Length CRCs are checked so that a corrupt length cannot produce a wrong
    index; ``progress(nbytes)`` is called after each block with the bytes done.
    """
    blocks = _scan(url, compression, storage_options, check_headers=True, progress=progress)
    parts = [block.offset + _spans(block)[0] for block, _ in blocks]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def verify_tfrecord(
    url: str,
    *,
    compression: str | None = "auto",
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> int:
    """Check every length and data CRC; return the number of records.

    Raises :class:`~shardkit.CorruptRecordError` at the first bad record;
    ``progress(nbytes)`` is called after each block with the bytes done.
    """
    count = 0
    for block, src in _scan(url, compression, storage_options, check_headers=True, progress=progress):
        for batch in _batches(block, 0, len(block.ends), src, True):
            count += len(batch)
    return count
