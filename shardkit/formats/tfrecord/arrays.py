"""TFRecord records as Arrow arrays (:func:`read_arrays`, what ``read_tfrecord_batches`` reads with) or lists of
``bytes`` (:func:`read_records`, what ``read_tfrecord`` chains).

An array costs no Python object per record, and a local uncompressed file no
Python per block either: with the compiled kernel, ``read_views`` and
``read_pack`` (:mod:`~shardkit.formats.tfrecord.kernel`) read it themselves, a
batch per call, in reads of
:data:`~shardkit.formats.tfrecord.framing.LOCAL_BLOCK_SIZE` small enough that
the bytes a read brings in are still in the CPU's cache when their records'
CRCs are checked and their data viewed or moved. Whatever needs Python (the
end of the file, a bad CRC, a record cut short or longer than the buffer) is
handed to the block reader of :mod:`~shardkit.formats.tfrecord.framing` at that
record, which raises what is wrong there with its messages, or reads the long
record, after which the kernel reads on (:func:`_read_local`). Everything else
(streams, compressed files, the Python kernel) is read block by block from that
module's block readers, the kernel's ``pack`` or ``views`` called per block;
the tests compare the two ways on damaged files at every cut. Two layouts
(``arrow_type``):

- ``"large_binary"``: one values buffer and an offsets array per batch.
  ``read_pack`` reads the file into the values buffer itself and moves each
  record's data down over its framing as soon as it is checked (one copy, by
  the OS, plus a move of cache-hot bytes: reading into a scratch buffer and
  copying out of it was about 15% slower); reads stop about where the batch's records end, since what is
  read past them moves to the next values buffer. The values buffers are reused
  once the caller drops their arrays, by the readers of later files too
  (:func:`~shardkit.formats.tfrecord.buffers.shared_buffers`).
- ``"binary_view"``: a 16-byte view per record (length, first bytes, buffer,
  offset), the data left where it was read: the buffers read into are the
  arrays' data buffers (:data:`_VIEW_BUFFER` bytes each, shared by consecutive
  arrays; a block reader's blocks, however many a batch spans). Nothing is
  copied: the fastest way to read raw records.

Lists of ``bytes`` (:func:`read_records`) take the same path: the kernel's
``read_cut`` copies each record into a ``bytes`` as soon as its data CRC is
checked, the read it came in still in the cache, and returns a list before it
reads on (as lazy as the block reader). On 100k records of 1 KB this took
``read_tfrecord`` from 0.44x to 0.50x of reading the bytes (``benchmarks/tfrecord.py
--kernel-only``, load 17): the block reader's Python per 256 KB block (framing
into a fresh ends array, the block, the cut calls) was about 5 ms of its 49.

Over 600 lines: one module because the compiled reader's loop and its hand-overs
to the block reader (:func:`_read_local`) drive all three builders through one
interface (:class:`_Batches`).
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from typing import Any, Final, Generic, NamedTuple, TypeVar, cast

import numpy as np
import pyarrow as pa
from fsspec.implementations.local import LocalFileOpener

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.tfrecord import framing, kernel
from shardkit.formats.tfrecord.buffers import BlockBuffers, shared_buffers
from shardkit.formats.tfrecord.framing import (
    _FIRST_LOCAL_READ,  # pyright: ignore[reportPrivateUsage]
    OVERHEAD_BYTES,
    _Block,  # pyright: ignore[reportPrivateUsage]
    _blocks,  # pyright: ignore[reportPrivateUsage]
    _check_file_end,  # pyright: ignore[reportPrivateUsage]
    _data_error,  # pyright: ignore[reportPrivateUsage]
    _file_blocks,  # pyright: ignore[reportPrivateUsage]
    _first_read,  # pyright: ignore[reportPrivateUsage]
    _open,  # pyright: ignore[reportPrivateUsage]
    _Origin,  # pyright: ignore[reportPrivateUsage]
    _read_batches,  # pyright: ignore[reportPrivateUsage]
    _start,  # pyright: ignore[reportPrivateUsage]
)
from shardkit.io.remote import RemoteOptions

__all__ = ["ARROW_TYPES", "read_arrays", "read_records"]

_FIRST_RECORDS: Final = 4096  # a batch's views or offsets are made for this many records, grown if it has more

ARROW_TYPES: Final = ("large_binary", "binary_view")
"""The layouts :func:`read_arrays` builds (``arrow_type``)."""

_VIEW_BUFFER: Final = 2 << 20
"""Bytes of the buffers ``read_views`` reads a local file into (at most :data:`~shardkit.io.files.BLOCK_SIZE`),
:data:`~shardkit.formats.tfrecord.framing.LOCAL_BLOCK_SIZE` a read; consecutive arrays share one. On 100k records
of 1 KB in batches of 1024, 512 KB, 1 MB and 2 MB read at 0.65x, 0.67x and 0.69x of reading the bytes (fewer
buffer switches, each a Python call and a record read twice; 4 MB, past a core's L2 cache, was slower again)."""

_FIRST_VALUES: Final = 1 << 20  # bytes of a large_binary batch's values buffer, doubled while batches need more


def read_arrays(
    url: str,
    compression: str | None,
    verify: bool,
    storage_options: dict[str, Any] | None,
    remote: RemoteOptions | None,
    *,
    batch_records: int,
    start: int,
    stop: int | None,
    first: int = 0,
    offset: int = 0,
    end: int | None = None,
    arrow_type: str = "large_binary",
) -> Iterator[pa.LargeBinaryArray | pa.BinaryViewArray]:
    """The records ``start:stop`` of ``url`` as Arrow arrays of ``batch_records`` records (the last may be shorter);
    positions as for :func:`read_batches`; ``arrow_type`` one of :data:`ARROW_TYPES`.

    An error is raised after the array of the good records before it.
    """
    views = arrow_type == "binary_view"
    source, src = _open(url, compression, storage_options, seek_to=offset, remote=remote)
    if src.compression is not None:
        first = offset = 0
        end = None
    batches = (_ViewBatches if views else _CopiedBatches)(src, verify, batch_records)
    want = _Wanted(batch_records, start, stop, end)
    try:
        if isinstance(source, LocalFileOpener) and kernel.KERNEL.read_views is not None:
            yield from _read_local(source.fileno(), src, batches, want, first, offset)
        else:
            blocks = _blocks(source, src, first_index=first, offset=offset, check_headers=verify, end=end)
            try:
                for piece, last in _pieces(blocks, want, 0):
                    yield from batches.add(piece, last)  # (an error raised here leaves nothing to flush below)
            finally:
                blocks.close()
    except CorruptRecordError:
        yield from batches.flush()  # the good records first (or an earlier bad one)
        raise
    finally:
        source.close()
    yield from batches.flush()


RECORDS_PER_LIST: Final = 128
"""Records per list :func:`read_records` hands out (as the block reader's batches): 32..1024 measured about the
same."""


def read_records(
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
    """The records ``start:stop`` of ``url`` in lists of ``bytes`` (``read_tfrecord`` chains them); positions as for
    :func:`~shardkit.formats.tfrecord.framing.read_batches`, which reads them where the compiled ``read_cut`` does
    not (streams, compressed files, the Python kernel). An error is raised after the list of the good records
    before it."""
    source, src = _open(url, compression, storage_options, seek_to=offset, remote=remote)
    if not isinstance(source, LocalFileOpener) or kernel.KERNEL.read_cut is None:
        if src.compression is not None:
            first = offset = 0  # compressed streams cannot seek by record
            end = None
        yield from _read_batches(source, src, verify, start=start, stop=stop, first=first, offset=offset, end=end)
        return
    batches = _RecordBatches(src, verify, RECORDS_PER_LIST)
    try:
        yield from _read_local(
            source.fileno(), src, batches, _Wanted(RECORDS_PER_LIST, start, stop, end), first, offset
        )
    except CorruptRecordError:
        yield from batches.flush()  # the good records first
        raise
    finally:
        source.close()
    yield from batches.flush()


class _Wanted(NamedTuple):
    """Which records the caller wants, and how many to an array."""

    batch_records: int
    start: int
    stop: int | None
    end: int | None  # where records start:stop end in the file, when an index says so


def _read_local(fd: int, src: _Origin, batches: _Batches[_T], want: _Wanted, first: int, offset: int) -> Iterator[_T]:
    """A local uncompressed file's records by the compiled kernel's ``read_views``/``read_pack``/``read_cut``, a batch
    per call:
    no Python per block. What they hand back (a record longer than their buffer, a bad length CRC, a file cut
    short) is read by the block reader, a block at a time, with its checks and messages; then they go on."""
    chunk = min(framing.BLOCK_SIZE, framing.LOCAL_BLOCK_SIZE)  # each read small enough to be checked while in the cache
    size = _first_read(offset, want.end, chunk) if want.end is not None else min(_FIRST_LOCAL_READ, chunk)
    reader = _Reader(fd, first, offset, size, chunk, want)
    opened_size = os.fstat(fd).st_size
    while True:
        status = yield from _read_some(reader, batches, want)
        if status == kernel.READ_FULL:
            return
        if status == kernel.READ_END:  # at a record boundary: unless the file shrank, or an index overshot it
            unstarted = first > 0 and reader.position == offset
            _check_file_end(fd, src, reader.index, reader.position, b"", opened_size, unstarted, batches.verify)
            return
        if status == kernel.READ_BAD_DATA:
            raise reader.data_error(src)
        block = _one_block(fd, src, reader, batches.verify, want.end, opened_size)
        if block is None:
            return
        yield from _add_block(batches, block, want)
        batches.resume(reader, block.offset + int(block.ends[-1]), block.first_index + len(block.ends))
        if want.stop is not None and reader.index >= want.stop:
            return


def _read_some(reader: _Reader, batches: _Batches[_T], want: _Wanted) -> Generator[_T, None, int]:
    """Batches read by the kernel until it needs Python: returns its status (:data:`~kernel.READ_FULL` when the
    records wanted are all read)."""
    while True:
        left = want.batch_records - batches.count
        if want.stop is not None:
            left = min(left, want.stop - max(reader.index, want.start))
            if left <= 0:
                return kernel.READ_FULL
        status = batches.read(reader, left)
        if batches.count == want.batch_records or status == kernel.READ_PAUSED:
            yield from batches.flush()
        if status == kernel.READ_ROOM:
            batches.make_room(reader)
        elif status not in (kernel.READ_FULL, kernel.READ_PAUSED):
            return status


def _one_block(
    fd: int, src: _Origin, reader: _Reader, verify: bool, end: int | None, opened_size: int
) -> _Block | None:
    """The block reader's first block from where the kernel stopped: it raises what is wrong there, or gathers the
    record too long for the kernel's buffer."""
    blocks = _file_blocks(fd, src, reader.index, reader.position, verify, end, opened_size=opened_size)
    try:
        return next(blocks, None)
    finally:
        blocks.close()


def _add_block(batches: _Batches[_T], block: _Block, want: _Wanted) -> Iterator[_T]:
    for piece, last in _pieces(iter([block]), want, batches.count):
        yield from batches.add(piece, last)


class _Reader:
    """A local file as the kernel's ``read_views``/``read_pack`` read it: the buffer and their state over it
    (:data:`~shardkit.formats.tfrecord.kernel.READ_STATE`)."""

    def __init__(self, fd: int, index: int, pos: int, size: int, chunk: int, want: _Wanted) -> None:
        self.fd = fd
        limit = -1 if want.end is None else want.end
        self.state = np.array([0, 0, pos, size, index, want.start, limit, chunk], dtype=np.int64)
        self.buf = np.empty(0, dtype=np.uint8)

    @property
    def index(self) -> int:
        """The index of the record at ``start``: the next one."""
        return int(self.state[_INDEX])

    @property
    def position(self) -> int:
        """The file offset of the record at ``start``."""
        start, filled, pos = self.state[:3].tolist()
        return pos - (filled - start)

    def restart(self, position: int, index: int, buf: np.ndarray | None = None, floor: int = 0) -> None:
        """Read on from ``position`` (record ``index``), into ``buf`` if given, from byte ``floor``; what the buffer
        held from there is dropped."""
        self.state[_START] = self.state[_FILLED] = floor
        self.state[_POS], self.state[_INDEX] = position, index
        if buf is not None:
            self.buf = buf

    def data_error(self, src: _Origin) -> CorruptRecordError:
        """The error for the record at ``start``, whose data CRC the kernel found wrong."""
        start, filled, pos = self.state[:3].tolist()
        length = int.from_bytes(self.buf[start : start + 8].tobytes(), "little")
        ends = np.array([start + length + OVERHEAD_BYTES], dtype=np.int64)
        block = _Block(memoryview(self.buf), start, ends, self.index, pos - filled)  # pyright: ignore[reportArgumentType]
        return _data_error(block, 0, src)


_START, _FILLED, _POS, _INDEX, _CHUNK = (
    kernel.READ_STATE.index(name) for name in ("start", "filled", "pos", "index", "chunk")
)


class _Piece(NamedTuple):
    """Records ``lo:hi`` of a block, waiting to be packed into an array."""

    block: _Block
    lo: int
    hi: int

    def data_bytes(self) -> int:
        return int(self.block.ends[self.hi - 1]) - _start(self.block, self.lo) - OVERHEAD_BYTES * (self.hi - self.lo)


def _pieces(blocks: Iterator[_Block], want: _Wanted, count: int) -> Iterator[tuple[_Piece, bool]]:
    """The records wanted of the blocks as pieces of batches, each with whether it ends its batch (``count``: the
    records the batch under way has already)."""
    start, stop, batch_records = want.start, want.stop, want.batch_records
    for block in blocks:
        n = len(block.ends)
        lo = max(0, start - block.first_index)
        hi = n if stop is None else min(n, stop - block.first_index)
        while lo < hi:
            take = min(hi - lo, batch_records - count)
            count = (count + take) % batch_records
            yield _Piece(block, lo, lo + take), count == 0
            lo += take
        if stop is not None and block.first_index + n >= stop:
            return


_LARGE_BINARY: Final = pa.large_binary()


def _binary_array(values: np.ndarray, offsets: np.ndarray, used: int) -> pa.LargeBinaryArray:
    """An Arrow ``large_binary`` array over ``values[:used]`` and the offsets, without a copy."""
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(values[:used])]
    return cast(pa.LargeBinaryArray, pa.LargeBinaryArray.from_buffers(_LARGE_BINARY, len(offsets) - 1, buffers))


_T = TypeVar("_T")


class _Batches(Generic[_T]):
    """What the builders of batches (two array layouts, lists of ``bytes``) share: the records of the batch under
    way (``count``), and what follows a kernel call over a block's piece."""

    def __init__(self, src: _Origin, verify: bool, batch_records: int) -> None:
        self.src, self.verify, self.batch_records = src, verify, batch_records
        self.count = 0

    def add(self, piece: _Piece, last: bool) -> Iterator[_T]:
        """Check and add a block's piece (the block reader's), handing out the batch it ends (``last``)."""
        raise NotImplementedError

    def read(self, reader: _Reader, left: int) -> int:
        """Up to ``left`` records read by the kernel into this batch; its status."""
        raise NotImplementedError

    def make_room(self, reader: _Reader) -> None:
        """Room for the reader to go on after :data:`~kernel.READ_ROOM`."""
        raise NotImplementedError

    def resume(self, reader: _Reader, position: int, index: int) -> None:
        """The reader goes on at ``position`` (record ``index``)."""
        raise NotImplementedError

    def flush(self) -> Iterator[_T]:
        """The batch of the records checked so far, if any."""
        raise NotImplementedError

    def _added(self, piece: _Piece, bad: int, last: bool) -> Iterator[_T]:
        """Count the piece's good records; at a bad one (``bad >= 0``), hand out the batch and raise; at the end of a
        batch (``last``), hand it out."""
        self.count += (bad if bad >= 0 else piece.hi) - piece.lo
        if bad >= 0:
            yield from self.flush()
            raise _data_error(piece.block, bad, self.src)
        if last:
            yield from self.flush()


class _CopiedBatches(_Batches[pa.LargeBinaryArray]):
    """``large_binary`` arrays: each piece's CRCs are checked and its data copied into the batch's values buffer as
    soon as its block is read, while the block is still in the CPU's cache.

    A local file is read by the kernel's ``read_pack`` (:meth:`read`) into one scratch buffer of
    :data:`~shardkit.formats.tfrecord.framing.LOCAL_BLOCK_SIZE`, the data of each read's records copied out as
    they are checked: one pass over cache-hot bytes."""

    def __init__(self, src: _Origin, verify: bool, batch_records: int) -> None:
        super().__init__(src, verify, batch_records)
        self._reader: _Reader | None = None  # once read_pack reads into the values buffers
        self._capacity = _FIRST_VALUES  # of the values buffers
        self._spare = shared_buffers(self._capacity)  # values buffers, reused once the caller drops their arrays
        self._read_pack = cast(kernel._ReadPack, kernel.KERNEL.read_pack)  # (None for the Python kernel: unused)
        self._begin()

    def _begin(self) -> None:
        self._values = self._spare.take(self._capacity)
        self._new_offsets()

    def _new_offsets(self) -> None:
        """The next batch's offsets, the first 0 (the rest written by the kernel as it packs)."""
        self._offsets = np.empty(min(self.batch_records, _FIRST_RECORDS) + 1, dtype=np.int64)
        self._offsets[0] = 0
        self.count = 0

    def add(self, piece: _Piece, last: bool) -> Iterator[pa.LargeBinaryArray]:
        block, lo, hi = piece
        at = int(self._offsets[self.count])
        self._reserve(at + piece.data_bytes(), self.count + hi - lo + 1)
        offsets = self._offsets[self.count :]
        bad = kernel.KERNEL.pack(block.buf, block.first, block.ends, lo, hi, self.verify, self._values, offsets, at)
        yield from self._added(piece, bad, last)

    def read(self, reader: _Reader, left: int) -> int:
        """Up to ``left`` records read by the kernel into this batch; its status."""
        if self._reader is None:  # the first read: the records from here on are read into the values
            self._reader = reader
            self.resume(reader, reader.position, reader.index)
        count = self.count
        take = min(left, max(_FIRST_RECORDS, count))  # offsets grown by doubling, not a whole batch's at once
        if len(self._offsets) <= count + take:
            self._reserve(0, count + take + 1)
        got, status = self._read_pack(reader.fd, reader.buf, reader.state, take, self.verify, self._offsets[count:])
        self.count = count + got
        return status

    def make_room(self, reader: _Reader) -> None:
        """A values buffer twice the size, with the records so far and the bytes read after them."""
        self._reserve(2 * len(self._values), 0, keep=int(reader.state[_FILLED]))
        reader.buf = self._values

    def resume(self, reader: _Reader, position: int, index: int) -> None:
        """The reader goes on at ``position`` (record ``index``), reading after the batch's data."""
        reader.buf = self._values
        reader.restart(position, index, floor=int(self._offsets[self.count]))

    def _reserve(self, size: int, offsets: int, keep: int | None = None) -> None:
        """Room for ``size`` bytes of values and ``offsets`` offsets, grown by doubling (the offsets up to a batch's);
        the values' first ``keep`` bytes kept (default: the batch's data)."""
        if len(self._values) < size:  # a batch larger than any before: so are the buffers from now on
            self._capacity = max(size, 2 * self._capacity)
            self._spare = shared_buffers(self._capacity)
            grown = self._spare.take(self._capacity)
            at = int(self._offsets[self.count]) if keep is None else keep
            grown[:at] = self._values[:at]
            self._values = grown
        if len(self._offsets) < offsets:
            wider = np.empty(min(self.batch_records + 1, max(offsets, 2 * len(self._offsets), 64)), dtype=np.int64)
            wider[: self.count + 1] = self._offsets[: self.count + 1]
            self._offsets = wider

    def flush(self) -> Iterator[pa.LargeBinaryArray]:
        """The array of the records checked so far, if any.

        An array holds at most twice its data: one using less than half its
        values buffer gets a copy of its own (small, so cheap), and the buffer
        goes back to the pool; a caller keeping many small arrays must not
        keep a 1 MB buffer with each. A buffer no array holds stays this
        reader's, with the bytes read after the records (``read_pack``'s);
        else they move to the start of the next one.
        """
        values, count = self._values, self.count
        if not count:
            return
        offsets = self._offsets[: count + 1]
        used = int(offsets[count])
        held = 2 * used >= len(values)
        array = _binary_array(values if held else values[:used].copy(), offsets, used)
        if held:
            del values, self._values  # before _begin takes a buffer: one an array holds is not free until dropped
            self._begin()
            self._carry_over()
        else:
            self._new_offsets()
        yield array

    def _carry_over(self) -> None:
        """The bytes ``read_pack`` read after the records of the array just made, to the new values buffer."""
        reader = self._reader
        if reader is None:
            return
        start, filled = reader.state[:2].tolist()  # (_START, _FILLED)
        self._values[: filled - start] = reader.buf[start:filled]
        reader.state[_START], reader.state[_FILLED] = 0, filled - start
        reader.buf = self._values


class _ViewBatches(_Batches[pa.BinaryViewArray]):
    """``binary_view`` arrays: each piece's CRCs are checked and its views written as soon as its block is read,
    while the block is still in the CPU's cache (checked when the batch was whole, the first blocks of a batch of
    1 MB were not, and the checks took twice as long); the blocks are the array's data buffers.

    A local file is read by the kernel's ``read_views`` (:meth:`read`) into buffers of
    :data:`~shardkit.io.files.BLOCK_SIZE` from a pool, :data:`~shardkit.formats.tfrecord.framing.LOCAL_BLOCK_SIZE`
    a read, each read's records checked and viewed as soon as it is in; consecutive arrays share a buffer."""

    def __init__(self, src: _Origin, verify: bool, batch_records: int) -> None:
        super().__init__(src, verify, batch_records)
        self._pool: BlockBuffers | None = None  # the buffers read_views reads into
        self._reader: _Reader | None = None
        self._begin()

    def _begin(self) -> None:
        self._views = np.empty(kernel.VIEW_BYTES * min(self.batch_records, _FIRST_RECORDS), dtype=np.uint8)
        self._buffers: list[pa.Buffer] = []
        self._reader_buffer = -1  # the index of the reader's buffer among this batch's, once it has records there
        self.count = 0

    def add(self, piece: _Piece, last: bool) -> Iterator[pa.BinaryViewArray]:
        block, lo, hi = piece
        _check_view_buffer(block, lo, self.src)
        self._buffers.append(pa.py_buffer(block.buf))
        at = kernel.VIEW_BYTES * self.count
        self._reserve(at + kernel.VIEW_BYTES * (hi - lo))
        index = len(self._buffers) - 1
        bad = kernel.KERNEL.views(block.buf, block.first, block.ends, lo, hi, self.verify, self._views[at:], index)
        yield from self._added(piece, bad, last)

    def read(self, reader: _Reader, left: int) -> int:
        """Up to ``left`` records read by the kernel into this batch; its status."""
        if len(reader.buf) == 0:
            self.make_room(reader)
        if self._reader_buffer < 0:
            self._buffers.append(pa.py_buffer(reader.buf))  # until _seal: the bytes read so far
            self._reader, self._reader_buffer = reader, len(self._buffers) - 1
        take = min(left, max(_FIRST_RECORDS, self.count))  # views grown by doubling, not a whole batch's at once
        at = kernel.VIEW_BYTES * self.count
        self._reserve(at + kernel.VIEW_BYTES * take)
        read_views = cast(kernel._ReadViews, kernel.KERNEL.read_views)
        count, status = read_views(
            reader.fd, reader.buf, reader.state, take, self.verify, self._views[at:], self._reader_buffer
        )
        self.count += count
        return status

    def make_room(self, reader: _Reader) -> None:
        """Another buffer for the reader, from the record it stopped at: its present one is full."""
        self.resume(reader, reader.position, reader.index)

    def resume(self, reader: _Reader, position: int, index: int) -> None:
        """The reader goes on at ``position`` (record ``index``) in another buffer: views may point into this one."""
        self._seal()
        size = min(framing.BLOCK_SIZE, _VIEW_BUFFER)
        if self._pool is None:
            self._pool = shared_buffers(size)
        reader.restart(position, index, self._pool.take(size)[:size])

    def _seal(self) -> None:
        """The reader's buffer as this batch's data buffer: the bytes read into it so far (what its views point
        into), not the rest, unwritten."""
        if self._reader is not None and self._reader_buffer >= 0:
            filled = int(self._reader.state[_FILLED])
            self._buffers[self._reader_buffer] = pa.py_buffer(self._reader.buf[:filled])
        self._reader_buffer = -1

    def _reserve(self, size: int) -> None:
        """Room for ``size`` bytes of views: grown by doubling, up to a whole batch's."""
        if len(self._views) < size:
            full = kernel.VIEW_BYTES * self.batch_records
            grown = np.empty(min(full, max(size, 2 * len(self._views), 64 * kernel.VIEW_BYTES)), dtype=np.uint8)
            grown[: len(self._views)] = self._views
            self._views = grown

    def flush(self) -> Iterator[pa.BinaryViewArray]:
        """The array of the records checked so far, if any."""
        self._seal()
        views, count, buffers = self._views, self.count, self._buffers
        self._begin()
        if count:
            yield _view_array(views, count, buffers)


class _RecordBatches(_Batches[list[bytes]]):
    """Lists of ``bytes`` (``read_tfrecord``'s): a local file is read by the kernel's ``read_cut`` into one scratch
    buffer per file, each record's CRCs checked and its data copied into a ``bytes`` while the read's bytes are in
    the cache, a list per call: no Python per block."""

    def __init__(self, src: _Origin, verify: bool, batch_records: int) -> None:
        super().__init__(src, verify, batch_records)
        self._records: list[bytes] = []
        self._read_cut = cast(kernel._ReadCut, kernel.KERNEL.read_cut)  # (None for the Python kernel: unused)

    def add(self, piece: _Piece, last: bool) -> Iterator[list[bytes]]:
        block, lo, hi = piece
        records, bad = kernel.KERNEL.cut(block.buf, block.first, block.ends, lo, hi, self.verify)
        self._records += records
        yield from self._added(piece, bad, last)

    def read(self, reader: _Reader, left: int) -> int:
        if len(reader.buf) == 0:  # twice a read: what is left of one moves to the start before the next
            size = 2 * int(reader.state[_CHUNK])
            reader.buf = shared_buffers(size).take(size)[:size]
        records, status = self._read_cut(reader.fd, reader.buf, reader.state, left, self.verify)
        if self._records:
            self._records += records
        else:
            self._records = records
        self.count += len(records)
        return status

    def make_room(self, reader: _Reader) -> None:  # (read_cut hands a record longer than its buffer over instead)
        self.resume(reader, reader.position, reader.index)

    def resume(self, reader: _Reader, position: int, index: int) -> None:
        reader.restart(position, index)

    def flush(self) -> Iterator[list[bytes]]:
        records, self._records, self.count = self._records, [], 0
        if records:
            yield records


def _check_view_buffer(block: _Block, lo: int, src: _Origin) -> None:
    """Refuse a block too long for views to point into: one record gathered whole, of 2 GiB or more."""
    if len(block.buf) > kernel.MAX_VIEW_BUFFER:
        raise ShardkitError(
            f"{src.url}: record {block.first_index + lo} at offset {block.offset + _start(block, lo)} holds "
            f"{len(block.buf)} bytes, more than a binary_view array can point into (2 GiB, int32 offsets); "
            "read it with arrow_type='large_binary'"
        )


def _view_array(views: np.ndarray, count: int, buffers: list[pa.Buffer]) -> pa.BinaryViewArray:
    """An Arrow ``binary_view`` array of the first ``count`` views over the data ``buffers``, without a copy."""
    used = pa.py_buffer(views[: kernel.VIEW_BYTES * count])
    return cast(pa.BinaryViewArray, pa.Array.from_buffers(pa.binary_view(), count, [None, used, *buffers]))
