"""TFRecord records as Arrow arrays: :func:`read_arrays`, what ``read_tfrecord_batches`` reads with.

The blocks come from :mod:`~shardkit.formats.tfrecord.framing` (its block
readers and error helpers: this module is the second consumer of its blocks,
beside ``read_batches``); an array costs no Python object per record.

A local file is read in blocks of
:data:`~shardkit.formats.tfrecord.framing.LOCAL_BLOCK_SIZE`, small enough that
the bytes a read brings in are still in the CPU's cache when the kernel checks
their CRCs, and each block's records are checked (and copied) as soon as it
is read, not when their batch is whole. Two layouts (``arrow_type``):

- ``"large_binary"``: the kernel's ``pack`` copies each record's data into the
  batch's values buffer beside an offsets array. The values buffers are
  reused once the caller drops their arrays (:class:`~shardkit.formats.tfrecord.buffers.BlockBuffers`).
  (Compacting a 4 MB block in place, which the arrays then shared, copied
  nothing but read the block's records out of memory, not cache: about 10%
  slower.)
- ``"binary_view"``: the kernel's ``views`` writes a 16-byte view per record
  (length, first bytes, buffer, offset) and the data stays where it was read:
  the blocks themselves are the array's data buffers, however many blocks a
  batch spans. Nothing is copied: the fastest way to read raw records.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final, NamedTuple, cast

import numpy as np
import pyarrow as pa

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.tfrecord import kernel
from shardkit.formats.tfrecord.buffers import BlockBuffers
from shardkit.formats.tfrecord.framing import (
    OVERHEAD_BYTES,
    _Block,  # pyright: ignore[reportPrivateUsage]
    _blocks,  # pyright: ignore[reportPrivateUsage]
    _data_error,  # pyright: ignore[reportPrivateUsage]
    _open,  # pyright: ignore[reportPrivateUsage]
    _Origin,  # pyright: ignore[reportPrivateUsage]
    _start,  # pyright: ignore[reportPrivateUsage]
)
from shardkit.io.remote import RemoteOptions

__all__ = ["ARROW_TYPES", "read_arrays"]

_FIRST_RECORDS: Final = 4096  # a batch's views or offsets are made for this many records, grown if it has more

ARROW_TYPES: Final = ("large_binary", "binary_view")
"""The layouts :func:`read_arrays` builds (``arrow_type``)."""

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
    blocks = _blocks(source, src, first_index=first, offset=offset, check_headers=verify, end=end)
    batches = (_ViewBatches if views else _CopiedBatches)(src, verify, batch_records)
    try:
        for piece, last in _pieces(blocks, batch_records, start, stop):
            yield from batches.add(piece, last)  # (an error raised here leaves nothing to flush below)
    except CorruptRecordError:
        yield from batches.flush()  # the good records first (or an earlier bad one)
        raise
    finally:
        blocks.close()
        source.close()
    yield from batches.flush()


class _Piece(NamedTuple):
    """Records ``lo:hi`` of a block, waiting to be packed into an array."""

    block: _Block
    lo: int
    hi: int

    def data_bytes(self) -> int:
        return int(self.block.ends[self.hi - 1]) - _start(self.block, self.lo) - OVERHEAD_BYTES * (self.hi - self.lo)


def _pieces(
    blocks: Iterator[_Block], batch_records: int, start: int, stop: int | None
) -> Iterator[tuple[_Piece, bool]]:
    """Records ``start:stop`` of the blocks as pieces of batches of ``batch_records``: each with whether it ends its
    batch."""
    count = 0
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


def _binary_array(values: np.ndarray, offsets: np.ndarray, base: int) -> pa.LargeBinaryArray:
    """An Arrow ``large_binary`` array over ``values[base:]`` and the offsets (from ``base``), without a copy."""
    if base:
        offsets -= base
    used = values[base : base + int(offsets[-1])]
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(used)]
    return cast(pa.LargeBinaryArray, pa.Array.from_buffers(pa.large_binary(), len(offsets) - 1, buffers))


class _CopiedBatches:
    """``large_binary`` arrays: each piece's CRCs are checked and its data copied into the batch's values buffer as
    soon as its block is read, while the block is still in the CPU's cache."""

    def __init__(self, src: _Origin, verify: bool, batch_records: int) -> None:
        self._src, self._verify, self._batch_records = src, verify, batch_records
        self._capacity = _FIRST_VALUES  # of the values buffers
        self._spare = BlockBuffers(self._capacity)  # values buffers, reused once the caller drops their arrays
        self._begin()

    def _begin(self) -> None:
        self._values = self._spare.take(self._capacity)
        self._offsets = np.zeros(min(self._batch_records, _FIRST_RECORDS) + 1, dtype=np.int64)
        self._count = 0

    def add(self, piece: _Piece, last: bool) -> Iterator[pa.LargeBinaryArray]:
        block, lo, hi = piece
        at = int(self._offsets[self._count])
        self._reserve(at + piece.data_bytes(), self._count + hi - lo + 1)
        offsets = self._offsets[self._count :]
        bad = kernel.KERNEL.pack(block.buf, block.first, block.ends, lo, hi, self._verify, self._values, offsets, at)
        self._count += (bad if bad >= 0 else hi) - lo
        if bad >= 0:
            yield from self.flush()
            raise _data_error(block, bad, self._src)
        if last:
            yield from self.flush()

    def _reserve(self, size: int, offsets: int) -> None:
        """Room for ``size`` bytes of values and ``offsets`` offsets, grown by doubling (the offsets up to a batch's)."""
        if len(self._values) < size:  # a batch larger than any before: so are the buffers from now on
            self._capacity = max(size, 2 * self._capacity)
            self._spare = BlockBuffers(self._capacity)
            grown = self._spare.take(self._capacity)
            at = int(self._offsets[self._count])
            grown[:at] = self._values[:at]
            self._values = grown
        if len(self._offsets) < offsets:
            wider = np.empty(min(self._batch_records + 1, max(offsets, 2 * len(self._offsets), 64)), dtype=np.int64)
            wider[: self._count + 1] = self._offsets[: self._count + 1]
            self._offsets = wider

    def flush(self) -> Iterator[pa.LargeBinaryArray]:
        """The array of the records checked so far, if any.

        An array holds at most twice its data: one using less than half its
        values buffer gets a copy of its own (small, so cheap), and the buffer
        goes back to the pool; a caller keeping many small arrays must not
        keep a 1 MB buffer with each.
        """
        values, offsets, count = self._values, self._offsets, self._count
        used = int(offsets[count])
        if 2 * used < len(values):
            values = values[:used].copy()
        del self._values  # before _begin takes a buffer: one an array holds is not free until it is dropped
        self._begin()
        if count:
            yield _binary_array(values, offsets[: count + 1], 0)


class _ViewBatches:
    """``binary_view`` arrays: each piece's CRCs are checked and its views written as soon as its block is read,
    while the block is still in the CPU's cache (checked when the batch was whole, the first blocks of a batch of
    1 MB were not, and the checks took twice as long); the blocks are the array's data buffers."""

    def __init__(self, src: _Origin, verify: bool, batch_records: int) -> None:
        self._src, self._verify, self._batch_records = src, verify, batch_records
        self._begin()

    def _begin(self) -> None:
        self._views = np.empty(kernel.VIEW_BYTES * min(self._batch_records, _FIRST_RECORDS), dtype=np.uint8)
        self._buffers: list[pa.Buffer] = []
        self._count = 0

    def add(self, piece: _Piece, last: bool) -> Iterator[pa.BinaryViewArray]:
        block, lo, hi = piece
        _check_view_buffer(block, lo, self._src)
        self._buffers.append(pa.py_buffer(block.buf))
        at = kernel.VIEW_BYTES * self._count
        self._reserve(at + kernel.VIEW_BYTES * (hi - lo))
        index = len(self._buffers) - 1
        bad = kernel.KERNEL.views(block.buf, block.first, block.ends, lo, hi, self._verify, self._views[at:], index)
        self._count += (bad if bad >= 0 else hi) - lo
        if bad >= 0:
            yield from self.flush()
            raise _data_error(block, bad, self._src)
        if last:
            yield from self.flush()

    def _reserve(self, size: int) -> None:
        """Room for ``size`` bytes of views: grown by doubling, up to a whole batch's."""
        if len(self._views) < size:
            full = kernel.VIEW_BYTES * self._batch_records
            grown = np.empty(min(full, max(size, 2 * len(self._views), 64 * kernel.VIEW_BYTES)), dtype=np.uint8)
            grown[: len(self._views)] = self._views
            self._views = grown

    def flush(self) -> Iterator[pa.BinaryViewArray]:
        """The array of the records checked so far, if any."""
        views, count, buffers = self._views, self._count, self._buffers
        self._begin()
        if count:
            yield _view_array(views, count, buffers)


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
