"""TFRecord framing: read and write byte-compatibly with TensorFlow, without it.

Each record is ``uint64 length (LE) | uint32 masked_crc32c(length bytes) |
data[length] | uint32 masked_crc32c(data)``; GZIP and ZLIB compress the whole
file stream. See :mod:`shardkit.formats.crc` for the mask.

How the reader is fast (each step measured on ``benchmarks/tfrecord.py``):

- It works a block of :data:`~shardkit.io.files.BLOCK_SIZE` bytes at a time:
  one tight loop finds the record boundaries of the whole block, then the
  length CRCs of the block are checked at once with numpy.
- Records are cut and their data CRCs computed and compared in batches of
  :data:`_BATCH`, and handed out through ``itertools.chain``: no Python frame
  per record beyond the slicing loop.
- Local uncompressed files are read with one ``os.pread`` per block, at a
  record boundary. Not memory-mapped: a mapped file truncated under the reader
  kills the process with SIGBUS, and the map bought nothing measurable: on 100k
  1 KB records, ``pread`` took 0.86-1.03x the map's CPU time with CRCs and
  0.75-0.92x without, over three runs (the map's page faults cost about what
  copying the block does). A reused ``readinto`` buffer measured the same as a
  fresh ``bytes`` per block, which slices into records without a memoryview.
- Remote and compressed files are streamed: one ranged read per block. Remote
  blocks are fetched ahead of the reader, retried, and pinned to the version
  opened by :mod:`shardkit.io.remote` (or read from its local cache).

What the reader does with bad input (each case has a fault-injection test in
``tests/test_faults_tfrecord.py``): every malformed byte sequence ends in a
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

import itertools
import os
import struct
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Final, NamedTuple

import numpy as np
from fsspec.implementations.local import LocalFileOpener

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.base import BadRecord, FormatBase, FormatError, RecordBound, file_record_bound
from shardkit.formats.crc import crc32c, mask, masked_crc32c, masked_crc32c_of_lengths, unmask_array
from shardkit.formats.sniff import describe_file
from shardkit.io.files import (
    BLOCK_SIZE,
    CompressedStreamError,
    Sink,
    Stream,
    check_compression,
    open_input,
    open_output,
    open_raw,
    sniff_compression,
)
from shardkit.io.remote import RemoteOptions

__all__ = [
    "TFRecordFormat",
    "TFRecordWriter",
    "count_records",
    "detect_compression",
    "read_tfrecord",
    "scan_count",
    "scan_offsets",
    "verify_tfrecord",
]

IndexLike = str | os.PathLike[str] | Sequence[int] | np.ndarray
Progress = Callable[[int], object]

_HEADER: Final = 12
_OVERHEAD: Final = 16
_unpack_length = struct.Struct("<Q").unpack_from
_unpack_header = struct.Struct("<QI").unpack_from
_pack_u32 = struct.Struct("<I").pack
_pack_u64 = struct.Struct("<Q").pack
_U32_BYTES: Final = np.arange(4)
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
        length, stored = _unpack_header(header)
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
        if len(header) < _HEADER:
            return self.error(
                index, offset, f"file ends inside record header: expected {_HEADER - available} more bytes"
            )
        if check_header and masked_crc32c(header[:8]) != _unpack_header(header)[1]:
            return self.length_error(index, offset, header)
        missing = _unpack_length(header)[0] + _OVERHEAD - available
        return self.error(index, offset, f"file ends inside record: expected {missing} more bytes")


class _Block(NamedTuple):
    """Whole records in a buffer: record ``i`` spans ``buf[ends[i-1]:ends[i]]``, record 0 ``buf[first:ends[0]]``."""

    buf: bytes
    first: int
    ends: list[int]
    first_index: int
    offset: int  # stream offset of buf[0]


def _frame(buf: bytes, pos: int, end: int, last_start: int) -> list[int]:
    """End positions of the whole records in ``buf[pos:end]`` that start at or before ``last_start``.

    This loop is the reader's hot path, hence the inlined constants.
    """
    ends: list[int] = []
    add = ends.append
    unpack = _unpack_length
    last = min(end - 12, last_start)  # 12 = _HEADER
    while pos <= last:
        nxt = pos + unpack(buf, pos)[0] + 16  # 16 = _OVERHEAD
        if nxt > end:
            break
        add(nxt)
        pos = nxt
    return ends


def _checked(block: _Block, src: _Origin, check_headers: bool) -> Iterator[_Block]:
    """Yield ``block``; with a bad length CRC in it, yield the records before it, then raise."""
    if check_headers:
        bad = _first_bad_header(block)
        if bad is not None:
            if bad:
                yield block._replace(ends=block.ends[:bad])
            start = block.ends[bad - 1] if bad else block.first
            raise src.length_error(
                block.first_index + bad, block.offset + start, bytes(block.buf[start : start + _HEADER])
            )
    yield block


#: First read of a local file when no end offset is known (reads then double up to BLOCK_SIZE).
_FIRST_LOCAL_READ = 16 * 1024


def _first_read(offset: int, end: int | None) -> int:
    """Bytes to read first from ``offset``: up to ``end`` when an index says the records wanted end there.

    A short range (a block of a shuffled plan, one record) must not cost
    framing a whole :data:`BLOCK_SIZE` (a remote file: nor the readahead a
    large read starts); reads after the first are whole blocks.
    """
    return min(BLOCK_SIZE, end - offset) if end is not None and end > offset else BLOCK_SIZE


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
                raise src.truncated(index, offset, rest[:_HEADER], len(rest), check_headers)
            if offset == started and index > 0:
                raise src.error(index, offset, "file ends where this record should start (as the index says)")
            return
        buf = rest + chunk if rest else chunk
        ends = _frame(buf, 0, len(buf), len(buf))
        if ends:
            yield from _checked(_Block(buf, 0, ends, index, offset), src, check_headers)
            index += len(ends)
            offset += ends[-1]
        rest = buf[ends[-1] :] if ends else buf
        if len(rest) >= _HEADER:  # a record continues in the next read: check its length before trusting it
            if check_headers and masked_crc32c(rest[:8]) != _unpack_header(rest)[1]:
                raise src.length_error(index, offset, rest[:_HEADER])
            need = _unpack_length(rest)[0] + _OVERHEAD
            if need > len(rest) + BLOCK_SIZE:  # the next read would not finish it: gather it whole
                if src.size is not None and offset + need > src.size:
                    raise src.truncated(index, offset, rest[:_HEADER], src.size - offset, False)
                record = _gather(stream, src, index, offset, rest, need)
                yield _Block(record, 0, [need], index, offset)
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
            raise src.truncated(index, offset, head[:_HEADER], have, False)
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
    fd: int, src: _Origin, first_index: int, offset: int, check_headers: bool, end: int | None = None
) -> Generator[_Block, None, None]:
    """Blocks from a local file descriptor, each read with one ``os.pread`` at a record boundary.

    Not memory-mapped: a mapped file truncated under the reader kills the
    process with SIGBUS, while ``pread`` just returns fewer bytes, which is
    reported as a truncated record. A record longer than a block is read whole
    only after its length CRC is checked and the file is seen to hold it.
    """
    index = first_index
    pos = offset
    # Without an end, the first read is small and reads double up to a block: a
    # reader restarts here after each bad record it skips, and framing a whole
    # block per restart made a shard of many bad records cost quadratic time.
    size = _first_read(offset, end) if end is not None else min(_FIRST_LOCAL_READ, BLOCK_SIZE)
    opened_size = os.fstat(fd).st_size
    while True:
        buf = os.pread(fd, size, pos)
        ends = _frame(buf, 0, len(buf), len(buf))
        if ends:
            yield from _checked(_Block(buf, 0, ends, index, pos), src, check_headers)
            index += len(ends)
            pos += ends[-1]
            size = min(2 * size, BLOCK_SIZE) if end is None else BLOCK_SIZE
            continue
        if len(buf) < size:  # the file ends here
            _check_file_end(fd, src, index, pos, buf, opened_size, first_index > 0 and pos == offset, check_headers)
            return
        # A full block without one whole record: the first record is longer than a block.
        if len(buf) < _HEADER:  # (only with tiny test block sizes)
            size = _HEADER
            continue
        if check_headers and masked_crc32c(buf[:8]) != _unpack_header(buf)[1]:
            raise src.length_error(index, pos, buf[:_HEADER])
        need = _unpack_length(buf)[0] + _OVERHEAD
        available = os.fstat(fd).st_size - pos
        if need > available:
            raise src.truncated(index, pos, buf[:_HEADER], available, False)
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
        raise src.truncated(index, pos, tail[:_HEADER], len(tail), check_headers)
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
) -> Generator[_Block, None, None]:
    """Blocks of whole records from ``source`` at record ``first_index``, byte ``offset``
    (``end``: where the records wanted end, when an index says so).

    Raises :class:`~shardkit.CorruptRecordError` if the data ends inside a
    record and, with ``check_headers``, at a bad length CRC (after the blocks
    of the good records before it), so a corrupt length is reported where it is.
    """
    if isinstance(source, LocalFileOpener):
        return _file_blocks(source.fileno(), src, first_index, offset, check_headers, end)
    return _stream_blocks(source, src, first_index, offset, check_headers, end)


def _spans(block: _Block) -> tuple[np.ndarray, np.ndarray]:
    """Start and end positions of the block's records, as arrays."""
    ends = np.array(block.ends, dtype=np.int64)
    starts = np.empty_like(ends)
    starts[0] = block.first
    starts[1:] = ends[:-1]
    return starts, ends


def _u32_at(arr: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Little-endian uint32 values stored at byte ``positions`` of ``arr``."""
    return np.ascontiguousarray(arr[positions[:, None] + _U32_BYTES]).view("<u4").ravel()


def _first_bad_header(block: _Block) -> int | None:
    """Index (within the block) of the first record whose length CRC is wrong."""
    starts, ends = _spans(block)
    stored = _u32_at(np.frombuffer(block.buf, np.uint8), starts + 8)
    bad = np.flatnonzero(masked_crc32c_of_lengths(ends - starts - _OVERHEAD) != stored)
    return int(bad[0]) if bad.size else None


def _batches(block: _Block, lo: int, hi: int, src: _Origin, verify: bool) -> Iterator[list[bytes]]:
    """Records ``lo:hi`` of a block in lists of up to :data:`_BATCH`.

    With ``verify``, each batch's data CRCs are checked before it is handed
    out; at a bad one, the records before it come as a last batch, then the
    error is raised. Cutting and checking a batch at a time keeps the per-record
    work in tight loops (the CRCs are compared as one list), and lets the
    memory of a batch be reused by the next while it is still in cache.
    """
    buf = block.buf
    ends = block.ends
    starts = [block.first, *ends[:-1]]
    wants: list[int] = []
    if verify:  # the CRCs the footers promise, unmasked, all at once
        stored = _u32_at(np.frombuffer(buf, np.uint8), np.array(ends[lo:hi], dtype=np.int64) - 4)
        wants = unmask_array(stored).tolist()
    for i in range(lo, hi, _BATCH):
        j = min(i + _BATCH, hi)
        records = [buf[a + 12 : b - 4] for a, b in zip(starts[i:j], ends[i:j])]
        if verify:
            expected = wants[i - lo : j - lo]
            crcs = list(map(crc32c, records))
            if crcs != expected:
                k = next(k for k, (got, want) in enumerate(zip(crcs, expected)) if got != want)
                yield records[:k]
                reason = _data_crc_reason(records[k], mask(expected[k]))
                raise src.error(block.first_index + i + k, block.offset + starts[i + k], reason, framing_intact=True)
        yield records


def _data_crc_reason(record: bytes, stored: int) -> str:
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
    if len(head) >= _HEADER and masked_crc32c(head[:8]) == _unpack_header(head)[1]:
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
            head = raw.read(_HEADER if seek_to or local else max(BLOCK_SIZE, _HEADER))
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
            (:func:`~shardkit.formats.index.load_index`); an array is checked
            against the file's end when ``start`` is past its last record. One
            that does not fit raises :class:`~shardkit.formats.index.IndexFileError`.
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
    first = offset = 0
    end = None
    offsets = _seek_offsets(url, index, start, storage_options) if start and compression in (None, "auto") else None
    if offsets is not None:
        if start >= len(offsets):  # checked: the file has no record past them
            return
        first, offset = start, int(offsets[start])
        end = int(offsets[stop]) if stop is not None and stop < len(offsets) else None
        if offset < 0:
            raise ShardkitError(f"{url}: the index gives offset {offset} for record {start}; rebuild the index")
    source, src = _open(url, compression, storage_options, seek_to=offset, remote=remote)
    if src.compression is not None:
        first = offset = 0  # compressed streams cannot seek by record
        end = None
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


def _seek_offsets(
    url: str, index: IndexLike | None, start: int, storage_options: dict[str, Any] | None
) -> np.ndarray | None:
    """The record offsets to seek to ``start`` by, or None to scan from the file's start.

    An index file is checked against the file as :func:`~shardkit.formats.index.load_index` checks
    it. Offsets given as an array are trusted where they lead to a record (its CRCs are checked as
    it is read), and checked against the file's end when ``start`` is past them: a file that grew
    or was rewritten since would otherwise read as if it had nothing left.

    Raises:
        IndexFileError: the index does not fit the file; its message names both and the fix.
    """
    from shardkit.formats import index as index_files  # imports this module

    if index is None:
        return None
    if isinstance(index, (str, os.PathLike)):
        return index_files.load_given_index(url, os.fspath(index), storage_options)
    offsets = np.asarray(index, dtype=np.int64)
    if start >= len(offsets) and not index_files.check_ends_with_file(url, offsets, storage_options):
        return None  # compressed: these offsets cannot seek, and the stream is read from its start
    return offsets


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
                progress(block.offset + block.ends[-1])
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


# --------------------------------------------------------------------------- writing


class TFRecordWriter:
    """Write records to a TFRecord file at any fsspec URL.

    Use as a context manager::

        with TFRecordWriter("s3://bucket/train-0.tfrecord") as writer:
            writer.write(record)

    ``compression`` is ``None``, ``"gzip"`` or ``"zlib"`` (whole-stream, as TensorFlow).
    """

    def __init__(self, url: str, compression: str | None = None, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.compression = compression
        self.num_records = 0
        self.num_bytes = 0  # framed, uncompressed bytes written so far
        self._sink: Sink | None = open_output(url, compression, storage_options)

    def write(self, record: bytes | bytearray | memoryview) -> None:
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


# --------------------------------------------------------------------------- the format object


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
            :func:`~shardkit.formats.index.load_index`) to seek to a range's
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
        return len(head) >= _HEADER and masked_crc32c(head[:8]) == _unpack_header(head)[1]

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
            header = file.read(_HEADER)
        if len(header) < _HEADER or masked_crc32c(header[:8]) != _unpack_header(header)[1]:
            return None  # not a plain file at that offset (compressed, "auto" resolved so)
        after = np.zeros(error.record_index + 2, dtype=np.int64)
        after[-1] = error.offset + _unpack_length(header)[0] + _OVERHEAD
        return _SHARD_ENDS if after[-1] >= size else after

    min_record_bytes: Final = 16
    """An empty record still takes its 8-byte length and two 4-byte CRCs."""

    def record_bound(self, url: str) -> RecordBound:
        """The most records ``url`` can hold by its size (see :func:`~shardkit.formats.base.max_records`)."""

        return file_record_bound(url, self.min_record_bytes, self.compression, self.storage_options)

    def index_offsets(self, url: str) -> np.ndarray | None:
        """The record offsets from ``url``'s index file, checked against the file; None when there
        is none, the file is compressed, or ``index=False``.

        Raises:
            IndexFileError: the index does not fit the file; seeking never uses such an index.
        """
        if not self.index or self.compression in ("gzip", "zlib"):
            return None
        from shardkit.formats.index import load_index

        return load_index(url, storage_options=self.storage_options)

    def count(self, url: str) -> int:
        """Records in ``url``: from its index file if there is a valid one, else a framing scan.

        An index that does not fit the file (see :func:`~shardkit.formats.index.load_index`)
        is not used: a warning names it and the fix, and the file is scanned.
        """
        import warnings

        from shardkit.formats.index import IndexFileError

        try:
            offsets = self.index_offsets(url)
        except IndexFileError as error:
            warnings.warn(f"{error}; counting its records by a framing scan instead", stacklevel=2)
            offsets = None
        if offsets is not None:
            return len(offsets)
        return scan_count(url, compression=self.compression, storage_options=self.storage_options, remote=self.remote)

    def build_index(self, url: str) -> str | None:
        from shardkit.formats.index import build_index

        return build_index(url, compression=self.compression, storage_options=self.storage_options)

    def writer(self, url: str, *, name: str | None = None) -> TFRecordWriter:
        compression = self.compression if self.compression in ("gzip", "zlib") else None
        return TFRecordWriter(url, compression, self.storage_options)

    def _decoder(self) -> Callable[[bytes], Any] | None:
        if callable(self.decode):
            return self.decode
        if self.decode == "raw":
            return None
        from shardkit.formats import example

        return example.decode_example if self.decode == "example" else example.decode_sequence_example

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
