"""TFRecord records as Arrow arrays: :func:`read_arrays`, what ``read_tfrecord_batches`` reads with.

The blocks come from :mod:`~shardkit.formats.tfrecord.framing` (its block
readers and error helpers: this module is the second consumer of its blocks,
beside ``read_batches``); the kernel's ``pack`` moves each record's data into
an Arrow ``large_binary`` array, so an array costs no Python object per record.

Records of one block read into the reader's own buffer (a local file's) are
compacted in place, each record's data moved back over the framing before it,
and the array shares the block's memory: no second copy. The arrays of a block
never overlap: each batch's records start after the end of the data the batch
before it moved. A batch with records in two blocks holds on to both and
copies its records once, into buffers of its own; so does any batch of a
stream's (read-only) blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, cast

import numpy as np
import pyarrow as pa

from shardkit.errors import CorruptRecordError
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

__all__ = ["read_arrays"]


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
) -> Iterator[pa.LargeBinaryArray]:
    """The records ``start:stop`` of ``url`` as Arrow arrays of ``batch_records`` records (the last may be shorter);
    positions as for :func:`read_batches`.

    An error is raised after the array of the good records before it.
    """
    source, src = _open(url, compression, storage_options, seek_to=offset, remote=remote)
    if src.compression is not None:
        first = offset = 0
        end = None
    blocks = _blocks(source, src, first_index=first, offset=offset, check_headers=verify, end=end)
    pending: list[_Piece] = []
    spare = BlockBuffers()  # the values of arrays whose records span two blocks
    count = 0
    try:
        for block in blocks:
            n = len(block.ends)
            lo = max(0, start - block.first_index)
            hi = n if stop is None else min(n, stop - block.first_index)
            while lo < hi:
                take = min(hi - lo, batch_records - count)
                pending.append(_Piece(block, lo, lo + take))
                count, lo = count + take, lo + take
                if count == batch_records:
                    full, pending, count = pending, [], 0
                    yield from _emit(full, src, verify, spare)  # (raising here, it is not emitted again below)
            if stop is not None and block.first_index + n >= stop:
                break
    except CorruptRecordError:
        yield from _emit(pending, src, verify, spare)  # the good records first (or an earlier bad one)
        raise
    finally:
        blocks.close()
        source.close()
    yield from _emit(pending, src, verify, spare)


class _Piece(NamedTuple):
    """Records ``lo:hi`` of a block, waiting to be packed into an array."""

    block: _Block
    lo: int
    hi: int

    def data_bytes(self) -> int:
        return int(self.block.ends[self.hi - 1]) - _start(self.block, self.lo) - OVERHEAD_BYTES * (self.hi - self.lo)


def _emit(pieces: list[_Piece], src: _Origin, verify: bool, spare: BlockBuffers) -> Iterator[pa.LargeBinaryArray]:
    """One array of the pieces' records; at a bad data CRC, the array of those before it, then the error.

    Records of one block read into the reader's own buffer are compacted in
    place (each record's data moved over the framing before it), so the array
    shares the block's memory: no second copy. Records from two blocks, or a
    block that is not ours to write (a stream's), are copied into new buffers.
    """
    if not pieces:
        return
    block = pieces[0].block
    if len(pieces) == 1 and isinstance(block.buf, memoryview) and not block.buf.readonly:
        base = _start(block, pieces[0].lo)  # earlier arrays of this block end before it: moving data back is safe
        values = np.frombuffer(block.buf, dtype=np.uint8)
    else:
        base = 0
        values = spare.take(sum(piece.data_bytes() for piece in pieces))
    offsets = np.empty(sum(piece.hi - piece.lo for piece in pieces) + 1, dtype=np.int64)
    pack = kernel.KERNEL.pack
    k = 0
    at = base
    for block, lo, hi in pieces:
        bad = pack(block.buf, block.first, block.ends, lo, hi, verify, values, offsets[k:], at)
        if bad >= 0:
            k += bad - lo
            if k:
                yield _binary_array(values, offsets[: k + 1], base)
            raise _data_error(block, bad, src)
        k += hi - lo
        at = int(offsets[k])
    yield _binary_array(values, offsets, base)


def _binary_array(values: np.ndarray, offsets: np.ndarray, base: int) -> pa.LargeBinaryArray:
    """An Arrow ``large_binary`` array over ``values[base:]`` and the offsets (from ``base``), without a copy."""
    if base:
        offsets -= base
    used = values[base : base + int(offsets[-1])]
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(used)]
    return cast(pa.LargeBinaryArray, pa.Array.from_buffers(pa.large_binary(), len(offsets) - 1, buffers))
