"""The framing kernel: find, check and copy out the records of a block, in C (``_tfrecord.c``) when built, else Python.

Four operations, each over many records at once, so the reader has no
Python loop per record beyond handing the records out:

- ``frame`` walks a buffer from a record boundary and
  returns the end offset of each whole record (an ``int64`` array), checking
  each length CRC on the way if asked; it stops at a record the buffer does not
  hold whole (the caller reads on, or reports the truncation) and says whether
  it stopped at a bad length CRC.
- ``cut`` checks the data CRCs of records ``lo:hi`` and
  copies each record's data into a ``bytes``, stopping at the first bad CRC.
- ``pack`` does the same into one values buffer and an
  ``int64`` offsets array (an Arrow binary array's buffers): no Python object
  per record.
- ``views`` checks the data CRCs of records ``lo:hi`` and writes an Arrow
  ``binary_view`` view of each (16 bytes: length, prefix, buffer, offset),
  leaving the data where it was read: no copy at all.

Three more, compiled only, read a local file themselves, a batch per call
(the fast path of ``read_tfrecord_batches`` and ``read_tfrecord``, :mod:`~shardkit.formats.tfrecord.arrays`):
``read_views``, ``read_pack`` and ``read_cut`` (a ``bytes`` per record) read
the file in cache-sized pieces and frame, check and view (or copy out) each
piece's records while they are in the cache, until the batch is whole or
something needs Python (the end of the file, a bad CRC, a cut or overlong
record: see :data:`READ_FULL` and the statuses after it). The Python kernel
has none: without them the reader takes its blocks from
:mod:`~shardkit.formats.tfrecord.framing` and calls ``views``, ``pack`` or
``cut`` per block, which the tests compare with the fast path.

Record ``i`` of a block spans ``buf[start_i:ends[i]]`` where ``start_0`` is
the block's ``first`` offset and ``start_i = ends[i - 1]``.

The backend is picked once, at import: :data:`BACKEND` names it. The compiled
one is used when ``shardkit.formats._tfrecord`` is built, unless
``SHARDKIT_PURE_PYTHON=1`` is set (the same switch as the tf.Example decoder's).
Both return the same ends, records and first bad record for any bytes; the
tests run them side by side on valid, mutated and truncated files. The C
kernel computes CRC-32C itself (carry-less multiplication with AVX-512 or AVX2,
or SSE4.2, when the CPU has them, else tables; the data CRCs of twelve records at a
time: with AVX2 folding, six at once, three by the crc32 instruction and three by
carry-less multiplication, the two units side by side), to the ``crc32c`` package's values.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Final, NamedTuple, Protocol

import numpy as np

from shardkit.formats.crc import crc32c, masked_crc32c_of_lengths, unmask_array

__all__ = [
    "BACKEND",
    "COMPILED",
    "INLINE_BYTES",
    "KERNEL",
    "MAX_VIEW_BUFFER",
    "PYTHON",
    "READ_BAD_DATA",
    "READ_END",
    "READ_FULL",
    "READ_HAND_OVER",
    "READ_PAUSED",
    "READ_ROOM",
    "READ_STATE",
    "VIEW_BYTES",
    "Kernel",
]

_U32_BYTES: Final = np.arange(4)
_U64_BYTES: Final = np.arange(8)
_unpack_length = struct.Struct("<Q").unpack_from


class _Frame(Protocol):
    def __call__(self, buf: Any, pos: int, end: int, check_lengths: bool) -> tuple[np.ndarray, bool]: ...


class _Cut(Protocol):
    def __call__(
        self, buf: Any, first: int, ends: np.ndarray, lo: int, hi: int, verify: bool
    ) -> tuple[list[bytes], int]: ...


class _Pack(Protocol):
    def __call__(
        self,
        buf: Any,
        first: int,
        ends: np.ndarray,
        lo: int,
        hi: int,
        verify: bool,
        values: np.ndarray,
        offsets: np.ndarray,
        base: int,
    ) -> int: ...


class _Views(Protocol):
    def __call__(
        self, buf: Any, first: int, ends: np.ndarray, lo: int, hi: int, verify: bool, out: np.ndarray, index: int
    ) -> int: ...


class _ReadViews(Protocol):
    def __call__(
        self, fd: int, buf: np.ndarray, state: np.ndarray, max_records: int, verify: bool, out: np.ndarray, index: int
    ) -> tuple[int, int]: ...


class _ReadPack(Protocol):
    def __call__(
        self, fd: int, buf: np.ndarray, state: np.ndarray, max_records: int, verify: bool, offsets: np.ndarray
    ) -> tuple[int, int]: ...


class _ReadCut(Protocol):
    def __call__(
        self, fd: int, buf: np.ndarray, state: np.ndarray, max_records: int, verify: bool
    ) -> tuple[list[bytes], int]: ...


READ_STATE: Final = ("start", "filled", "pos", "size", "index", "skip", "limit", "chunk")
"""The ``int64`` state ``read_views`` and ``read_pack`` read and update, in order: the buffer's next record
(``start``) and end of data (``filled``), the file offset after it (``pos``), the next read's size (``size``,
doubling up to ``chunk``), the next record's index (``index``), the index of the first record to hand out
(``skip``: the ones before are framed only) and where the records wanted end (``limit``, -1 when unknown:
reads stop there)."""
READ_FULL: Final = 0
"""``max_records`` records handed out."""
READ_END: Final = 1
"""The file ends at a record boundary (the caller checks it did not shrink)."""
READ_HAND_OVER: Final = 2
"""A bad length CRC, the file ending inside a record, or a record longer than the buffer at ``index``: the
block reader takes over there and reports it (or gathers the long record)."""
READ_BAD_DATA: Final = 3
"""The record at ``start`` (``index``) has a bad data CRC; the good ones before it are handed out."""
READ_ROOM: Final = 4
"""The buffer has no room for the rest of the record at ``start``: ``read_views`` reads it into another,
``read_pack`` into a larger one (the data below ``floor`` kept). (A record that alone fills most of the buffer
is handed over instead.)"""
READ_PAUSED: Final = 5
"""``read_cut`` only: the records of the bytes read so far are handed out, fewer than ``max_records``; the next call
reads on (as lazy as the block reader, which hands out a block's records before reading the next)."""


class Kernel(NamedTuple):
    """One backend's operations (see the module docstring)."""

    name: str
    frame: _Frame
    """``frame(buf, pos, end, check_lengths) -> (ends, bad_length)``: ``bad_length`` says the record after the last
    end (which starts at ``ends[-1]``, or ``pos``) has a bad length CRC."""
    cut: _Cut
    """``cut(buf, first, ends, lo, hi, verify) -> (records, bad)``: the data of records ``lo:hi``, up to the first
    with a bad data CRC (``bad``, an index into ``ends``; -1 when none)."""
    pack: _Pack
    """``pack(buf, first, ends, lo, hi, verify, values, offsets, base) -> bad``: the data of records ``lo:hi``
    copied into ``values`` from byte ``base``; ``offsets[0] = base``, ``offsets[k + 1]`` where record
    ``lo + k`` ends; ``bad`` as for ``cut``."""
    views: _Views
    """``views(buf, first, ends, lo, hi, verify, out, index) -> bad``: the Arrow ``binary_view`` views of records
    ``lo:hi`` written to ``out`` (``uint8``, 16 bytes a view, from ``out[0]``), their data left where it is in
    ``buf``, the array's data buffer ``index``; ``bad`` as for ``cut`` (the views before it are written)."""
    read_views: _ReadViews | None = None
    """``read_views(fd, buf, state, max_records, verify, out, index) -> (count, status)``: the file ``fd`` read
    into ``buf`` from ``state`` (:data:`READ_STATE`, updated), the views of up to ``max_records`` checked records
    written to ``out`` (over data buffer ``index``, ``buf`` itself); ``status`` one of :data:`READ_FULL`..."""
    read_pack: _ReadPack | None = None
    """``read_pack(fd, buf, state, max_records, verify, offsets) -> (count, status)``: as ``read_views``, each
    record's data then moved down in ``buf`` over the framing, from ``offsets[0]`` (at most ``start``;
    ``offsets[k + 1]`` where the ``k``-th ends): ``buf`` is the values buffer, read and compacted in place."""
    read_cut: _ReadCut | None = None
    """``read_cut(fd, buf, state, max_records, verify) -> (records, status)``: as ``read_pack``, each record's data
    copied into a ``bytes`` as soon as it is checked (``read_tfrecord``), ``buf`` a scratch buffer (what is left of
    a read moves to its start)."""


# --------------------------------------------------------------------------- Python


def _u32_at(arr: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Little-endian uint32 values stored at byte ``positions`` of ``arr``."""
    return np.ascontiguousarray(arr[positions[:, None] + _U32_BYTES]).view("<u4").ravel()


def _walk(buf: Any, pos: int, end: int) -> list[int]:
    """End offsets of the whole records in ``buf[pos:end]``; the pure-Python reader's hot loop, constants inlined."""
    ends: list[int] = []
    add = ends.append
    unpack = _unpack_length
    last = end - 12  # 12: a header
    while pos <= last:
        nxt = pos + unpack(buf, pos)[0] + 16  # 16: header and data CRC
        if nxt > end:
            break
        add(nxt)
        pos = nxt
    return ends


def frame_python(buf: Any, pos: int, end: int, check_lengths: bool) -> tuple[np.ndarray, bool]:
    """:attr:`Kernel.frame` in Python: the walk, then every length CRC checked at once with numpy.

    The header after the last whole record is checked too when the buffer
    holds it, as the C kernel checks a length before trusting it.
    """
    ends = np.array(_walk(buf, pos, end), dtype=np.int64)
    if not check_lengths:
        return ends, False
    starts = np.concatenate((np.array([pos], dtype=np.int64), ends))
    if end - int(starts[-1]) < 12:  # no header after the last record
        starts = starts[:-1]
    arr = np.frombuffer(buf, np.uint8)
    lengths = np.ascontiguousarray(arr[starts[:, None] + _U64_BYTES]).view("<u8").ravel()
    bad = np.flatnonzero(masked_crc32c_of_lengths(lengths) != _u32_at(arr, starts + 8))
    if not bad.size:
        return ends, False
    return ends[: int(bad[0])], True


def cut_python(buf: Any, first: int, ends: np.ndarray, lo: int, hi: int, verify: bool) -> tuple[list[bytes], int]:
    """:attr:`Kernel.cut` in Python: slices, and their CRCs compared as one list."""
    bounds = ends[lo:hi].tolist()
    starts = [int(ends[lo - 1]) if lo else first, *bounds[:-1]]
    records = [bytes(buf[a + 12 : b - 4]) for a, b in zip(starts, bounds)]
    if not verify:
        return records, -1
    wanted = unmask_array(_u32_at(np.frombuffer(buf, np.uint8), ends[lo:hi] - 4)).tolist()
    crcs = list(map(crc32c, records))
    if crcs == wanted:
        return records, -1
    k = next(k for k, (got, want) in enumerate(zip(crcs, wanted)) if got != want)
    return records[:k], lo + k


def pack_python(
    buf: Any,
    first: int,
    ends: np.ndarray,
    lo: int,
    hi: int,
    verify: bool,
    values: np.ndarray,
    offsets: np.ndarray,
    base: int,
) -> int:
    """:attr:`Kernel.pack` in Python: :func:`cut_python`, then the records joined into ``values``."""
    records, bad = cut_python(buf, first, ends, lo, hi, verify)
    sizes = np.fromiter(map(len, records), dtype=np.int64, count=len(records))
    offsets[0] = base
    np.cumsum(sizes, out=offsets[1 : len(records) + 1])
    offsets[1 : len(records) + 1] += base
    joined = b"".join(records)
    values[base : base + len(joined)] = np.frombuffer(joined, np.uint8)
    return bad


VIEW_BYTES: Final = 16
"""Bytes of one Arrow ``binary_view`` view: the length, then the data itself when it has at most
:data:`INLINE_BYTES`, else its first 4 bytes, the data buffer's index and the offset in it (``int32`` each)."""
INLINE_BYTES: Final = 12
MAX_VIEW_BUFFER: Final = 2**31 - 1
"""The largest data buffer a view can point into (its offsets are ``int32``)."""


def views_python(
    buf: Any, first: int, ends: np.ndarray, lo: int, hi: int, verify: bool, out: np.ndarray, index: int
) -> int:
    """:attr:`Kernel.views` in Python: :func:`cut_python` checks the CRCs, numpy writes the views."""
    if len(buf) > MAX_VIEW_BUFFER:
        raise ValueError(f"views: a buffer of {len(buf)} bytes (binary_view offsets are int32)")
    bad = cut_python(buf, first, ends, lo, hi, verify)[1] if verify else -1
    k = (bad if bad >= 0 else hi) - lo
    stops = ends[lo : lo + k]
    starts = np.concatenate((np.array([int(ends[lo - 1]) if lo else first], np.int64), stops[:-1]))[:k]
    offsets, lengths = starts + 12, stops - starts - 16
    rows = out[: VIEW_BYTES * k].reshape(k, VIEW_BYTES)
    rows[:] = 0
    words = rows.view("<i4")  # (k, 4): length, prefix or inline data, buffer index, offset
    words[:, 0] = lengths
    data = np.frombuffer(buf, np.uint8)
    positions = offsets[:, None] + np.arange(INLINE_BYTES)
    short = lengths <= INLINE_BYTES
    inline = np.arange(INLINE_BYTES) < lengths[short, None]
    rows[short, 4:] = np.where(inline, data[np.minimum(positions[short], max(len(data) - 1, 0))], 0)
    rows[~short, 4:8] = data[positions[~short, :4]]
    words[~short, 2] = index
    words[~short, 3] = offsets[~short]
    return bad


PYTHON: Final = Kernel("python", frame_python, cut_python, pack_python, views_python)
"""The pure-Python kernel, always available (the tests compare the compiled one with it)."""


# --------------------------------------------------------------------------- C


def _load_c_backend() -> Any:
    """The compiled kernel (``_tfrecord.c``), or ``None`` when it is not built or ``SHARDKIT_PURE_PYTHON`` is set."""
    if os.environ.get("SHARDKIT_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from shardkit.formats import _tfrecord  # pyright: ignore[reportAttributeAccessIssue]
    except ImportError:  # not built (no compiler at install time): the Python kernel serves
        return None
    return _tfrecord


COMPILED: Final = _load_c_backend()
"""The compiled kernel module, or None: then the Python kernel serves."""


def _c_kernel(module: Any) -> Kernel:
    c_frame, c_cut, c_pack, c_views = module.frame, module.cut, module.pack, module.views

    def frame(buf: Any, pos: int, end: int, check_lengths: bool) -> tuple[np.ndarray, bool]:
        out = np.empty(max(0, end - pos) // 16 + 1, dtype=np.int64)  # 16: the smallest record
        count, bad = c_frame(buf, pos, end, out, check_lengths)
        return out[:count], bool(bad)

    return Kernel("c", frame, c_cut, c_pack, c_views, module.read_views, module.read_pack, module.read_cut)


KERNEL: Final = _c_kernel(COMPILED) if COMPILED is not None else PYTHON
"""The kernel the reader uses: the compiled one when built, else :data:`PYTHON`."""

BACKEND: Final = KERNEL.name
"""Which kernel frames and checks TFRecord records: ``"c"`` (the compiled extension) or ``"python"``
(it is not built, or the environment sets ``SHARDKIT_PURE_PYTHON=1``)."""
