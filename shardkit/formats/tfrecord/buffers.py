"""The buffers a local TFRecord file's blocks are read into, reused once nothing holds them.

A fresh multi-megabyte buffer per block costs a page fault per 4 KB page (the
kernel zeroes each page before the read fills it), about as much as the read
itself; reading into a buffer whose pages are already mapped does not. See
:class:`BlockBuffers`.
"""

from __future__ import annotations

import os
import sys
from typing import Final

import numpy as np

from shardkit.formats.tfrecord import kernel
from shardkit.io.files import BLOCK_SIZE

__all__ = ["BlockBuffers"]


def _references_when_free() -> int:
    """What ``sys.getrefcount`` says of a pooled buffer nothing else holds, in :meth:`BlockBuffers.take`'s loop.

    Measured rather than assumed: interpreters differ in the references a loop
    and the call itself add (3 on CPython 3.10-3.13), and a buffer in use has
    at least one more (the view of it that a block, array or record holds).
    """
    pool = [np.empty(1, dtype=np.uint8)]
    for buf in pool:
        return sys.getrefcount(buf)
    raise AssertionError("unreachable")


_FREE_REFERENCES: Final = _references_when_free()


class BlockBuffers:
    """The buffers a local file's blocks are read into: each reused once nothing outside holds it any more.

    A fresh multi-megabyte buffer per block costs a page fault per 4 KB page
    (the kernel zeroes each page before the read fills it), about as much as
    the read itself; reading into a buffer whose pages are already mapped
    does not. ``read_tfrecord`` copies every record out before the next block
    is read, so one buffer serves the whole file; an Arrow array from
    ``read_tfrecord_batches`` shares its block's buffer (compacted in place),
    which is then busy until the caller drops the array. Whether anything
    holds a buffer is read from its reference count (CPython's).
    """

    _POOL: Final = 4  # buffers kept per reader; while all are busy, blocks get one-off buffers

    def __init__(self) -> None:
        self._pool: list[np.ndarray] = []

    def read(self, fd: int, size: int, pos: int) -> bytes | memoryview:
        """Up to ``size`` bytes of the file at ``pos``: writable (read_arrays compacts records in place)."""
        if kernel.KERNEL is kernel.PYTHON:  # the Python kernel slices ``bytes`` faster than a memoryview
            return os.pread(fd, size, pos)
        buf = self.take(size)
        # numpy arrays are buffers; its stubs do not say so to the type checker
        return memoryview(buf)[: os.preadv(fd, [buf[:size]], pos)]  # pyright: ignore[reportArgumentType]

    def take(self, size: int) -> np.ndarray:
        """A free buffer of at least ``size`` bytes (held, it is busy: so is any view of it)."""
        for buf in self._pool:
            # the pool's, this loop's and getrefcount's own references only: no block, view or array holds it
            if len(buf) >= size and sys.getrefcount(buf) == _FREE_REFERENCES:
                return buf
        buf = np.empty(max(size, BLOCK_SIZE), dtype=np.uint8)
        if len(self._pool) < self._POOL and size <= BLOCK_SIZE:
            self._pool.append(buf)
        return buf
