"""The shard format interface: one object per format, with defaults for its optional capabilities.

A :class:`ShardFormat` is everything a source, the CLI and the writer need to
know about one kind of shard file: how to count its records, read a record
range ``[start, stop)``, build (or skip) an index, recognise a file by its
suffix or first bytes, and optionally write it. Options that change how a
file is read (storage options, compression, decoding, column projection)
live on the format object, so ``fmt.read`` is a picklable ``read_fn`` and
``fmt.count`` a ``count_fn`` for :class:`~shardkit.ShardedDataset`.

Readers raise :class:`~shardkit.CorruptRecordError` with the url, record
index and byte offset of what is wrong, after yielding the good records
before it; ``framing_intact`` is true when the next record can still be found,
so that ``on_error="skip"`` costs just the bad record: the source then calls
``read(url, bad + 1, stop)`` again, and a format may remember where that
record starts (:class:`ResumeHint`) so that the retry seeks instead of
rescanning. A format that can go on past a bad record without reopening the
file may also have ``read_marked(url, start, stop)``, which yields a
:class:`BadRecord` in place of each such record and reads on; sources call it
instead of ``read`` when it exists (TFRecord does, for data CRC mismatches and
records that do not decode).

This module names no concrete format: the formats build on it, and
:mod:`shardkit.formats.registry`, above them all, finds the format of a file.
Index files of the formats that have one share one container
(:mod:`shardkit.formats.offsets`). What a format parses once and keeps (indexes,
open datasets, inflated shards) lives in a :class:`ProcessCache`: bounded, shared
by a process's threads, and empty again in each process a format is pickled into.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Final, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

import fsspec
import numpy as np

from shardkit.errors import CorruptRecordError, ShardkitError, check_int
from shardkit.io.files import open_raw, sniff_compression
from shardkit.io.remote import RemoteOptions, prefetch
from shardkit.io.retry import retried_call

__all__ = [
    "MAX_EXPANSION",
    "BadRecord",
    "CountBounded",
    "FormatBase",
    "FormatError",
    "ProcessCache",
    "RecordBound",
    "RecordWriter",
    "ResumeHint",
    "ShardFormat",
    "capabilities",
    "check_interface",
    "column_options",
    "max_records",
    "record_bound",
]

HEAD_BYTES: Final = 512
"""Bytes of a file's start handed to :meth:`ShardFormat.sniff`."""


class FormatError(ShardkitError, ValueError):
    """No registered format fits a file, or a format was given options it cannot use."""


_V = TypeVar("_V")


def _one(_value: object) -> int:
    return 1


class ProcessCache(Generic[_V]):
    """What a format parsed once, kept for this process: least recently used dropped first.

    Entries are dropped while there is more than one and their total weight (``weigh``
    of each; 1 each by default, so ``most`` counts entries) is over ``most``. A lock makes
    it safe for a process's threads; a value is built outside the lock, so two threads
    may build the same one and the second is kept. Pickled (to a DataLoader worker, a
    spawned process), it arrives empty: each process parses what it reads itself, and
    nothing parsed travels. ``weigh`` must be a module-level function for that.
    """

    def __init__(self, most: int, weigh: Callable[[_V], int] = _one) -> None:
        self.most = most
        self.weigh = weigh
        self._entries: OrderedDict[Hashable, _V] = OrderedDict()
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.most, self.weigh))

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, build: Callable[[], _V]) -> _V:
        """The value kept under ``key``, else ``build()``'s, kept."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        value = build()
        with self._lock:
            self._entries[key] = value
            while len(self._entries) > 1 and sum(map(self.weigh, self._entries.values())) > self.most:
                self._entries.popitem(last=False)
        return value


def column_options(columns: Sequence[str] | None, batch_size: int | None) -> tuple[list[str] | None, int | None]:
    """The checked ``columns=`` and ``batch_size=`` of a columnar format (Parquet, Lance)."""
    if columns is not None and (isinstance(columns, str) or not all(isinstance(c, str) for c in columns)):
        raise ShardkitError(f"columns must be a list of column names, got {columns!r}")
    if batch_size is not None:
        check_int("batch_size", batch_size, minimum=1, hint="or None for one row per record")
    return (list(columns) if columns is not None else None), batch_size


class RecordWriter(Protocol):
    """What :meth:`ShardFormat.writer` returns."""

    num_records: int
    num_bytes: int

    def write(self, record: Any, /) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ShardFormat(Protocol):
    """One shard file format. Implementations must be picklable (they travel to DataLoader workers).

    Attributes:
        name: the format's name (``"tar"``, ``"parquet"``, ``"jsonl"``, ``"tfrecord"``).
        suffixes: file name endings that mean this format, longest first
            (``(".tar.gz", ".tgz", ".tar")``).

    Optional, used by the sources when present (the built-in formats have them):
    ``read_marked(url, start, stop)`` yields a :class:`BadRecord` in place of a
    bad record and reads on; ``index_offsets(url)`` gives the checked record
    offsets from an index file (None without one; raises
    :class:`~shardkit.formats.offsets.IndexFileError` for one that does not fit),
    from which record counts are taken without a counting pass;
    ``prefetch(url, start, stop)`` and a ``remote``
    (:class:`~shardkit.io.remote.RemoteOptions`) attribute open remote shards ahead;
    ``record_bound(url)`` (:class:`CountBounded`) gives the most records the file's
    size can hold, so that a count above it is not made up under ``on_error="skip"``.
    """

    @property
    def name(self) -> str: ...

    @property
    def suffixes(self) -> tuple[str, ...]: ...

    def sniff(self, head: bytes) -> bool:
        """Whether a file starting with ``head`` (up to :data:`HEAD_BYTES`) is in this format."""
        ...

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Records ``[start, stop)`` of ``url`` (``stop=None`` or past the end: to its end)."""
        ...

    def count(self, url: str) -> int:
        """Records in ``url``: from its index or footer when there is one, else a scan."""
        ...

    def build_index(self, url: str) -> str | None:
        """Write ``url``'s index and return its path; None for a format that needs none."""
        ...


class FormatBase:
    """A :class:`ShardFormat` with every optional capability at its default. The built-in
    formats subclass it and override what they can do better; so may a format of your own.
    A registered format that does not subclass it gets these defaults through
    :func:`capabilities`, so sources reach every format the same way.

    Attributes:
        storage_options: fsspec options for the files (None: the defaults).
        remote: how remote files are read (:class:`~shardkit.io.remote.RemoteOptions`; None: defaults).
    """

    storage_options: dict[str, Any] | None = None
    remote: RemoteOptions | None = None

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        raise NotImplementedError(f"{type(self).__name__} must define read(url, start, stop)")

    def read_marked(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Records ``[start, stop)`` with a :class:`BadRecord` in place of each bad record the reader
        can step over. By default :meth:`read`: a bad record ends the read with its
        :class:`~shardkit.CorruptRecordError`, and the source reads again from the record after it."""
        return self.read(url, start, stop)

    def index_offsets(self, url: str) -> np.ndarray | None:
        """The checked record offsets of ``url`` from its index file; None (the default): no index.

        Raises:
            IndexFileError: the index does not fit the file (stale, damaged, of another format).
        """
        return None

    def stored_count(self, url: str) -> int | None:
        """Records in ``url`` that the format can tell without a counting pass (an index file, a
        footer), None when it cannot. By default the length of :meth:`index_offsets`."""
        offsets = self.index_offsets(url)
        return None if offsets is None else len(offsets)

    def record_bound(self, url: str) -> RecordBound | None:
        """The most records ``url`` can hold by its size (see :func:`max_records`); None (the
        default): no bound, as for Parquet, where a row of nulls takes next to no bytes."""
        return None

    def prefetch(self, url: str, start: int, stop: int | None) -> None:
        """Start opening remote ``url`` for a later read of ``[start, stop)``: its first blocks when
        the range starts at the file's start, else just the open. Local files: nothing."""
        if "://" not in url or url.startswith("file://"):  # local: no fsspec lookup per hinted range
            return
        prefetch(url, self.storage_options, self.remote, offset=0 if start == 0 else None)


class _Adapted(FormatBase):
    """A registered format that does not subclass :class:`FormatBase`, with the defaults
    for what it lacks; picklable, as the format itself must be."""

    def __init__(self, fmt: ShardFormat) -> None:
        self.format = fmt
        self.name, self.suffixes = fmt.name, fmt.suffixes
        self.storage_options = _plain_attribute(fmt, "storage_options")
        self.remote = _plain_attribute(fmt, "remote")

    def sniff(self, head: bytes) -> bool:
        return self.format.sniff(head)

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        return self.format.read(url, start, stop)

    def count(self, url: str) -> int:
        return self.format.count(url)

    def build_index(self, url: str) -> str | None:
        return self.format.build_index(url)

    def __repr__(self) -> str:
        return repr(self.format)


def _plain_attribute(fmt: object, name: str) -> Any:
    # Options a user's format may carry as plain attributes; methods of the same name are not options.
    value = vars(fmt).get(name) if hasattr(fmt, "__dict__") else None
    return None if callable(value) else value


def capabilities(fmt: ShardFormat) -> FormatBase:
    """``fmt`` itself when it is a :class:`FormatBase`, else ``fmt`` with the default capabilities.

    Raises:
        FormatError: ``fmt`` lacks part of the :class:`ShardFormat` interface.
    """
    if isinstance(fmt, FormatBase):
        return fmt
    return _Adapted(check_interface(fmt))


def check_interface(fmt: object) -> ShardFormat:
    """``fmt``, if it has the whole :class:`ShardFormat` interface.

    Raises:
        FormatError: naming what the interface is, when ``fmt`` lacks part of it.
    """
    if not isinstance(fmt, ShardFormat):
        raise FormatError(
            f"{fmt!r} lacks part of the ShardFormat interface (name, suffixes, sniff, read, count, build_index)"
        )
    return fmt


class ResumeHint(NamedTuple):
    """Where the record after a bad one starts, kept by a reader to seek there on the retry."""

    url: str
    record: int
    offset: int


class BadRecord(NamedTuple):
    """Yielded by a format's ``read_marked`` in place of one record that is bad while the
    records after it can still be read (a data CRC mismatch, a record that does not
    decode): the source raises ``error`` or skips just that record (``on_error``),
    and the same iterator goes on with the next one."""

    error: CorruptRecordError


# --------------------------------------------------------------------------- how many records a file can hold

MAX_EXPANSION: Final[dict[str | None, int]] = {None: 1, "gzip": 1032, "zlib": 1032, "zstd": 1 << 16}
"""The most bytes one byte of a compressed stream inflates to, per compression. Deflate (gzip, zlib)
tops out near 1032:1 (a 258-byte match per 2 bits); zstd's densest block is an RLE block, 128 KiB from
4 bytes (32768:1), taken twice over to be safe. A bound from these is loose but never too low."""


def max_records(size: int, min_record_bytes: int, compression: str | None = None) -> int:
    """The most records a file of ``size`` bytes can hold when each takes at least ``min_record_bytes``
    of its (decompressed) stream; ``compression`` multiplies the size by :data:`MAX_EXPANSION`.

    Rounded up, so that a last record without its separator (a JSON line with no newline) still fits.

    Raises:
        ValueError: a compression without a known expansion.
    """
    if compression not in MAX_EXPANSION:
        raise ValueError(
            f"no known expansion for compression {compression!r}; known: {sorted(map(str, MAX_EXPANSION))}"
        )
    return -(-size * MAX_EXPANSION[compression] // min_record_bytes)


class RecordBound(NamedTuple):
    """What a shard's size says about its record count: at most ``most`` records (see :func:`max_records`)."""

    size: int
    compression: str | None
    most: int


@runtime_checkable
class CountBounded(Protocol):
    """An optional capability of a :class:`ShardFormat`: every record takes at least some bytes, so a
    file's size bounds its record count. A count above the bound is a lie (see :func:`record_bound`)."""

    def record_bound(self, url: str) -> RecordBound | None:
        """The most records ``url`` can hold, by its size and compression; None: no bound."""
        ...


def record_bound(fmt: object, url: str) -> RecordBound | None:
    """``fmt.record_bound(url)`` for a :class:`CountBounded` format; None (no bound) for any other,
    such as Parquet, where a row of nulls takes next to no bytes."""
    return fmt.record_bound(url) if isinstance(fmt, CountBounded) else None


def file_record_bound(
    url: str,
    min_record_bytes: int,
    compression: str | None,
    storage_options: dict[str, Any] | None,
    remote: RemoteOptions | None = None,
) -> RecordBound:
    """The :class:`RecordBound` of the file at ``url``, for a format whose records take ``min_record_bytes``.

    ``compression="auto"`` looks at the file's first bytes: a gzip, zlib or zstd start takes that
    expansion (a plain file whose first bytes merely look like zlib gets a looser bound, never a tighter one).
    The size is looked up, and the first bytes read, bounded and retried under ``remote``'s ``retry``.
    """
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    size = int(retried_call(fs, "info", path, retry=remote.retry if remote else None)["size"])
    if compression == "auto":
        with open_raw(url, "rb", storage_options, remote=remote) as f:
            compression = _compression_of(f.read(4))
    return RecordBound(size, compression, max_records(size, min_record_bytes, compression))


def _compression_of(head: bytes) -> str | None:
    return "zstd" if head == b"\x28\xb5\x2f\xfd" else sniff_compression(head)
