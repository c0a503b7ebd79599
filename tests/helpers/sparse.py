"""Real files over 2 GiB that cost no disk: sparse files (a hole of zeros between a few written bytes).

Linux moves at most :data:`PREAD_LIMIT` bytes per ``pread`` call, so an item
bigger than that is the real test of a reader that reads an item in one call.
The items here are ``HEAD + zeros + TAIL``: the markers show the item was read
whole and in place, and the zeros cost no disk and no time to write.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from shardkit.formats.crc import crc32c, mask, masked_crc32c
from shardkit.formats.megatron.index import encode_index

#: The most bytes one Linux ``read``/``pread`` moves (``MAX_RW_COUNT``).
PREAD_LIMIT = 0x7FFFF000
#: Item sizes used: just over 2 GiB, so over :data:`PREAD_LIMIT` too.
OVER_2_GIB = 2**31 + 16
HEAD, TAIL = b"HEAD", b"TAIL"
_ZEROS = bytes(64 << 20)


def sparse_file(path: Path, size: int, at: dict[int, bytes]) -> Path:
    """A file of ``size`` bytes, zeros (a hole) but for ``at`` (offset: bytes)."""
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in sorted(at.items()):
            f.seek(offset)
            f.write(data)
    return path


def crc32c_of_marked_zeros(size: int) -> int:
    """The CRC-32C of ``HEAD + zeros + TAIL`` of ``size`` bytes, computed a slice of zeros at a time."""
    crc = crc32c(HEAD)
    left = size - len(HEAD) - len(TAIL)
    while left:
        step = min(left, len(_ZEROS))
        crc = crc32c(_ZEROS[:step], crc)
        left -= step
    return crc32c(TAIL, crc)


def _frame(length: int) -> bytes:
    head = struct.pack("<Q", length)
    return head + struct.pack("<I", masked_crc32c(head))


def sparse_tfrecord(path: Path, length: int, after: bytes, *, crc_flip: int = 0) -> Path:
    """A valid TFRecord file: a record of ``length`` bytes (``HEAD + zeros + TAIL``, its CRC right but for
    the bits of ``crc_flip``), then a record ``after``."""
    footer = struct.pack("<I", mask(crc32c_of_marked_zeros(length)) ^ crc_flip)
    small = _frame(len(after)) + after + struct.pack("<I", masked_crc32c(after))
    data_at = len(_frame(0))
    end = data_at + length
    at = {0: _frame(length) + HEAD, end - len(TAIL): TAIL + footer + small}
    return sparse_file(path, end + len(footer) + len(small), at)


def sparse_megatron(prefix: Path, tokens: int) -> Path:
    """A valid Megatron pair (int32): documents ``[7, 8, 9]``, one of ``tokens`` tokens (``HEAD``, zeros,
    ``TAIL`` as int32s), ``[5, 6]``; the ``.bin``'s path."""
    dtype = np.dtype("<i4")
    prefix.with_suffix(".idx").write_bytes(encode_index(dtype, np.array([3, tokens, 2]), np.arange(4)))
    first = np.array([7, 8, 9], dtype).tobytes()
    big_end = 4 * (3 + tokens)
    at = {0: first + HEAD, big_end - len(TAIL): TAIL + np.array([5, 6], dtype).tobytes()}
    return sparse_file(prefix.with_suffix(".bin"), big_end + 8, at)
