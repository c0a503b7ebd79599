"""The buffers a local TFRecord file's blocks are read into, reused once nothing holds them.

A fresh multi-megabyte buffer per block costs a page fault per 4 KB page (the
kernel zeroes each page before the read fills it), about as much as the read
itself; reading into a buffer whose pages are already mapped does not. See
:class:`BlockBuffers`; :func:`shared_buffers` gives every reader of a process
the same pool of a size, so that a reader of the next file (a shard) does not
map its buffers afresh either.
"""

from __future__ import annotations

import sys
from typing import Final

import numpy as np

from shardkit.formats.tfrecord import kernel
from shardkit.io.files import BLOCK_SIZE, pread_exactly, preadv_exactly

__all__ = ["BlockBuffers", "shared_buffers"]


def _references_when_free() -> int:
    """What ``sys.getrefcount`` says of a pooled buffer nothing else holds, in :meth:`BlockBuffers.take`'s loop.

    Measured rather than assumed: interpreters differ in the references a
    local and the call itself add (3 on CPython 3.10-3.13), and a buffer in use
    has at least one more (the view of it that a block, array or record holds).
    """
    pool = [np.empty(1, dtype=np.uint8)]
    buf = pool[0]
    return sys.getrefcount(buf)


_FREE_REFERENCES: Final = _references_when_free()


class BlockBuffers:
    """The buffers a local file's blocks are read into: each reused once nothing outside holds it any more.

    A fresh multi-megabyte buffer per block costs a page fault per 4 KB page
    (the kernel zeroes each page before the read fills it), about as much as
    the read itself; reading into a buffer whose pages are already mapped
    does not. ``read_tfrecord`` copies every record out before the next block
    is read, so one buffer serves the whole file; a ``binary_view`` array from
    ``read_tfrecord_batches`` points into the blocks its records are in, and a
    ``large_binary`` one owns a values buffer from a pool of these, each busy
    until the caller drops the array. Whether anything holds a buffer is read
    from its reference count (CPython's).
    """

    _POOL_BYTES: Final = 4 * BLOCK_SIZE  # kept per reader; while all are busy, blocks get one-off buffers
    #: No buffer larger is kept: one a record over 2 GiB needed (its block, a batch's values) was kept by the
    #: process's pools after the arrays were dropped, 4 GiB of 6 at the peak; such a buffer is one-off.
    LARGEST_KEPT: Final = 256 << 20

    def __init__(self, block_size: int | None = None) -> None:
        """``block_size``: the size of the buffers kept (default :data:`~shardkit.io.files.BLOCK_SIZE`);
        as many are kept as fit in four of those blocks, at least four."""
        self._block_size = block_size or BLOCK_SIZE
        self._keep = max(4, self._POOL_BYTES // self._block_size)
        self._pool: list[np.ndarray] = []  # the buffer taken last at the end

    def read(self, fd: int, size: int, pos: int) -> bytes | memoryview:
        """``size`` bytes of the file at ``pos``, fewer only where it ends (a read over 2 GiB takes several
        ``pread`` calls): writable (read_arrays compacts records in place)."""
        if kernel.KERNEL is kernel.PYTHON:  # the Python kernel slices ``bytes`` faster than a memoryview
            return pread_exactly(fd, size, pos)
        buf = self.take(size)
        # numpy arrays are buffers; its stubs do not say so to the type checker
        return memoryview(buf)[: preadv_exactly(fd, buf[:size], pos)]  # pyright: ignore[reportArgumentType]

    def take(self, size: int) -> np.ndarray:
        """A free buffer of at least ``size`` bytes (held, it is busy: so is any view of it).

        The pool is searched from the buffer taken last, which is the likeliest
        to be still in the CPU's cache: cycling through many small buffers
        instead (the one taken longest ago first) read into memory the cache no
        longer held, and made ``binary_view`` batches 1.7x slower.
        """
        pool = self._pool
        for i in range(len(pool) - 1, -1, -1):
            buf = pool[i]
            # the pool's, this local's and getrefcount's own references only: no block, view or array holds it
            if len(buf) >= size and sys.getrefcount(buf) == _FREE_REFERENCES:
                pool.append(pool.pop(i))  # taken last now
                return buf
        buf = np.empty(max(size, self._block_size), dtype=np.uint8)
        if len(pool) < self._keep and size <= self._block_size <= self.LARGEST_KEPT:
            pool.append(buf)
        return buf


_SHARED_SIZES: Final = 4  # pools of this many buffer sizes are kept, the one used longest ago dropped first
_shared: dict[int, BlockBuffers] = {}  # by buffer size, the one used last at the end


def shared_buffers(block_size: int) -> BlockBuffers:
    """The process's pool of buffers of ``block_size`` bytes, shared by the readers of every file.

    A reader per file with a pool of its own mapped its buffers afresh for
    each file: per 105 MB file of 1 KB records in batches of 1,024, 1,075
    page faults (``large_binary``) and 442 (``binary_view``), against 140
    and none shared. Shared, a pool keeps what one kept (at most four
    blocks' worth of buffers, fewer while callers keep few arrays) for as
    long as the process lives, for at most four sizes. Threads may share a
    pool: :meth:`BlockBuffers.take` hands a buffer to one only, since the
    reference the taking thread holds makes it busy to every other.
    """
    pool = _shared.pop(block_size, None) or BlockBuffers(block_size)
    _shared[block_size] = pool
    while len(_shared) > _SHARED_SIZES:
        del _shared[next(iter(_shared))]
    return pool
