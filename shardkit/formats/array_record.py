"""ArrayRecord shards (Grain's default format), read in place with the ``array-record`` package.

An ArrayRecord file is a Riegeli container: records in chunks of
``group_size`` records (the writer's option, stored in the file), every chunk
and block header hashed, and a footer holding every chunk's offset and record
count. So counts come from the footer (no scan), a range ``[start, stop)``
reads only the chunks it overlaps, and a record is found by its index.

Reading goes through the package's own reader (``array_record_module``), so
what shardkit yields is byte for byte what Grain's ``ArrayRecordDataSource``
yields. Records are usually serialized ``tf.Example`` messages: ``decode``
is ``"example"`` (:func:`~shardkit.decode_example`, as ``TFRecordDataset``
decodes them), ``"raw"`` (the bytes) or a callable on the bytes.

Trust nothing; what the reader's checks turn into:

- a file whose footer or postscript cannot be read (truncated, a block header
  that does not hash): the package's reader opens it with zero records and
  ``ok()`` false. That is an error at the file's first record naming the byte
  Riegeli names, never a count of 0.
- a chunk whose header or data does not hash (a flipped byte, a damaged zstd
  block): one :class:`~shardkit.CorruptRecordError` with ``records=n`` for the
  chunk's records (like a Parquet row group), with the chunk's byte offset;
  under ``on_error="skip"`` it costs that chunk alone, counted.
- a record that does not decode under ``decode``: a
  :class:`~shardkit.formats.base.BadRecord` for that record alone.

The package is not fork-safe: once a process has used it (reader or writer),
its C++ thread pool exists there, and a DataLoader worker forked from that
process can die of a segmentation fault inside the package when it reads
(seen with ``num_workers=2``, now and then, more often on a loaded machine).
So a forked child of a process in which shardkit used the package refuses to
read, with an error naming the fix: DataLoader workers started with
``multiprocessing_context="spawn"`` or ``"forkserver"``, whose processes start
clean. (A parent that used the package directly, not through shardkit, is not
seen.)

The package reads local files only. A remote shard is read from the local
cache (``cache_dir=``): the whole object is fetched once, bound to its
identity (:mod:`shardkit.io.cache`), and read from there; without a
``cache_dir`` a remote shard is refused with an error that says so.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from typing import Any, Final

import fsspec
from fsspec.implementations.local import LocalFileOpener

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.base import BadRecord, FormatBase, FormatError
from shardkit.formats.example import decode_example
from shardkit.io.files import make_parent_dirs, open_raw
from shardkit.io.remote import RemoteOptions

__all__ = ["DECODERS", "SIGNATURE", "ArrayRecordFormat", "ArrayRecordWriter"]

DECODERS: Final = ("example", "raw")

SIGNATURE: Final = bytes.fromhex(
    "83af70d10d884a3f00000000000000004000000000000000"  # the first block header (hashed, previous 0, next 64)
    "91bac23c9287e1a90000000000000000e19f13c0e9b1c37273"  # the file signature chunk's header, type 's'
)
"""The first bytes of every Riegeli file, ArrayRecord's included: a constant, checksummed start."""

SPAN_RECORDS: Final = 256
"""Records read by one call into the package (whole chunks): fewer calls where chunks are small (Grain's group_size:1)."""

_READ_OPTIONS: Final = "readahead_buffer_size:0,max_parallelism:0"
"""Each chunk is read when asked for: a range is read chunk by chunk, one process per worker."""

_GROUP: Final = re.compile(r"(?:^|,)group_size:(\d+)")
_AT_BYTE: Final = re.compile(r"(?:chunk|block) at (\d+)|at byte (\d+)")


_USED_BY: int | None = None
"""The process in which shardkit first used the package (its thread pool does not survive a fork); None: none."""


def _module(url: str) -> Any:
    """The package's module, for use in this process; refused in a child forked from a process that used it."""
    global _USED_BY
    if _USED_BY is not None and _USED_BY != os.getpid():
        raise ShardkitError(
            f"{url}: this process was forked from one that used the array-record package, whose thread pool does "
            "not survive a fork (reading here can die of a segmentation fault inside the package): start the "
            "DataLoader's workers with multiprocessing_context='spawn' or 'forkserver'"
        )
    _USED_BY = os.getpid()
    try:
        from array_record.python import array_record_module  # pyright: ignore[reportAttributeAccessIssue]  (a compiled module)
    except ImportError:
        raise ShardkitError(
            f"{url}: reading or writing ArrayRecord files needs the 'array-record' package: pip install array-record"
        ) from None
    return array_record_module


class ArrayRecordFormat(FormatBase):
    """ArrayRecord as a :class:`~shardkit.formats.base.ShardFormat`; picklable (readers open per read).

    Args:
        decode: ``"example"`` (:func:`~shardkit.decode_example`), ``"raw"`` (the record
            bytes, the default) or a callable on the record bytes.
        options: the writer's options for :meth:`writer` (the package's option
            string, e.g. ``"group_size:1024"``; empty: its defaults, zstd-compressed).
        storage_options: fsspec options.
        remote: how remote shards are read; they need its ``cache_dir`` (see the module's docstring).
    """

    name = "array_record"
    suffixes = (".array_record", ".arrayrecord")

    def __init__(
        self,
        *,
        decode: str | Callable[[bytes], Any] = "raw",
        options: str = "",
        storage_options: dict[str, Any] | None = None,
        remote: RemoteOptions | None = None,
    ) -> None:
        if not callable(decode) and decode not in DECODERS:
            raise FormatError(f"decode must be one of {DECODERS} or a callable on the record bytes, got {decode!r}")
        self.decode = decode
        self.options = options
        self.storage_options = storage_options
        self.remote = remote

    def __repr__(self) -> str:
        name = getattr(self.decode, "__name__", repr(self.decode)) if callable(self.decode) else repr(self.decode)
        return f"ArrayRecordFormat(decode={name})"

    def sniff(self, head: bytes) -> bool:
        """A Riegeli file's signature (a Riegeli file of other records reads as ``"raw"`` records)."""
        return head[: len(SIGNATURE)] == SIGNATURE

    # -- counts

    def stored_count(self, url: str) -> int:
        """Records in ``url``, from its footer (the file's own, hashed: no scan).

        Raises:
            CorruptRecordError: the footer cannot be read (a truncated or damaged file).
        """
        with _Opened(url, self) as reader:
            return reader.count

    def count(self, url: str) -> int:
        return self.stored_count(url)

    def build_index(self, url: str) -> str | None:
        """The footer is the index: none to build."""
        return None

    # -- reading

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Records ``[start, stop)`` of ``url``, decoded; a bad record raises after the records before it."""
        _check_range(start, stop)
        return _raising(self._records(url, start, stop))

    def read_marked(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """:meth:`read` with a :class:`~shardkit.formats.base.BadRecord` in place of each record that does
        not decode; a chunk that does not hash is raised (``records=n``: the whole chunk)."""
        _check_range(start, stop)
        return self._records(url, start, stop)

    def _records(self, url: str, start: int, stop: int | None) -> Iterator[Any]:
        decode = self._decoder()
        with _Opened(url, self) as reader:
            stop = reader.count if stop is None else min(stop, reader.count)
            at = start
            while at < stop:
                records = reader.span(at, min(stop, reader.span_end(at)))
                for position, record in enumerate(records, at):
                    yield record if decode is None else _decoded(decode, url, position, record)
                at += len(records)

    def _decoder(self) -> Callable[[bytes], Any] | None:
        if callable(self.decode):
            return self.decode
        return decode_example if self.decode == "example" else None

    # -- writing

    def writer(self, url: str, *, name: str | None = None) -> ArrayRecordWriter:
        """A writer of records (bytes) to the local file ``url`` (``name``: what it is renamed to; unused)."""
        return ArrayRecordWriter(url, self.options)


class _Opened:
    """The package's reader over ``url`` (a local path, or the cached copy of a remote object), checked."""

    def __init__(self, url: str, fmt: ArrayRecordFormat) -> None:
        self.url = url
        module = _module(url)
        self._file = open_raw(url, "rb", fmt.storage_options, remote=fmt.remote)
        if not isinstance(self._file, LocalFileOpener):
            self._file.close()
            raise ShardkitError(
                f"{url}: ArrayRecord files are read by the array-record package, which reads local files; "
                "give cache_dir= to read a remote one from the local cache"
            )
        try:
            self._reader = module.ArrayRecordReader(_local_path(self._file), _READ_OPTIONS)
        except Exception as error:  # the package raises on a file too short to hold a postscript
            self._file.close()
            raise _corrupt(url, 0, str(error), intact=False) from None
        self.count = int(self._reader.num_records())
        if not self._reader.ok():
            self.close()
            raise _corrupt(url, 0, self._why_not_ok(), intact=False)
        written = _GROUP.search(self._reader.writer_options_string())
        self.group = max(1, int(written.group(1))) if written else 65536

    def _why_not_ok(self) -> str:
        try:
            self._reader.read(0, 1)
        except Exception as error:  # noqa: BLE001 - the reader says what is wrong only when asked to read
            return f"its footer cannot be read: {error}"
        return "its footer cannot be read"

    def span_end(self, start: int) -> int:
        """Where a read from ``start`` ends: the end of a chunk, :data:`SPAN_RECORDS` records or more on."""
        group = self.group
        return (start + max(SPAN_RECORDS, group)) // group * group

    def span(self, start: int, stop: int) -> list[bytes]:
        """Records ``[start, stop)`` in one call; when a chunk in it does not hash, the chunks before it,
        then the error for that chunk alone (``records``: its records from ``start`` on)."""
        try:
            return self._reader.read(start, stop)
        except RuntimeError:
            pass
        good: list[bytes] = []
        at = start
        while at < stop:  # chunk by chunk, to find the bad one
            upto = min(stop, (at // self.group + 1) * self.group)
            try:
                good += self._reader.read(at, upto)
            except RuntimeError as error:
                if good:
                    return good  # the caller asks again from the bad chunk
                records = min(self.count, (at // self.group + 1) * self.group) - at
                raise _corrupt(self.url, at, str(error), intact=True, records=records) from None
            at = upto
        return good

    def close(self) -> None:
        try:
            self._reader.close()
        except RuntimeError:  # a reader that is not ok() raises its failure again on close: already reported
            pass
        finally:
            self._file.close()

    def __enter__(self) -> _Opened:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _local_path(f: LocalFileOpener) -> str:
    return str(getattr(f, "path", None) or f.name)


def _corrupt(url: str, record: int, message: str, *, intact: bool, records: int = 1) -> CorruptRecordError:
    """The located error for what the Riegeli reader said, at the byte it names (-1 when it names none)."""
    found = _AT_BYTE.search(message)
    offset = int(found.group(1) or found.group(2)) if found else -1
    reason = f"the ArrayRecord (Riegeli) reader: {message.strip()[:300]}"
    return CorruptRecordError(url, record, offset, reason, framing_intact=intact, records=records)


def _decoded(decode: Callable[[bytes], Any], url: str, position: int, record: bytes) -> Any:
    try:
        return decode(record)
    except Exception as error:  # the chunk hashed fine: only this record is bad
        name = getattr(decode, "__name__", repr(decode))
        reason = f"the record's chunk is intact but it does not decode with {name}: {type(error).__name__}: {error}"
        return BadRecord(CorruptRecordError(url, position, -1, reason, framing_intact=True))


def _check_range(start: int, stop: int | None) -> None:
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")


def _raising(records: Iterator[Any]) -> Iterator[Any]:
    for record in records:
        if record.__class__ is BadRecord:
            raise record.error
        yield record


class ArrayRecordWriter:
    """Records (bytes, or dicts encoded as tf.Example) to a local ArrayRecord file; ``close`` writes the footer."""

    def __init__(self, url: str, options: str = "") -> None:
        fs, path = fsspec.core.url_to_fs(url)
        if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            raise ShardkitError(f"{url}: the array-record package writes local files only")
        self.url = url
        self.num_records = 0
        self.num_bytes = 0
        make_parent_dirs(url)
        self._writer: Any = _module(url).ArrayRecordWriter(path, options)

    def write(self, record: Any) -> None:
        """Append one record: bytes as they are, a dict as a tf.Example."""
        if self._writer is None:
            raise ShardkitError(f"{self.url}: write() on a closed writer")
        if isinstance(record, dict):
            from shardkit.formats.example import encode_example

            record = encode_example(record)
        if not isinstance(record, (bytes, bytearray, memoryview)):
            raise ShardkitError(
                f"record {self.num_records}: an ArrayRecord record is bytes (or a dict, written as a tf.Example), "
                f"got {type(record).__name__}"
            )
        data = bytes(record)
        self._writer.write(data)
        self.num_records += 1
        self.num_bytes += len(data)

    def close(self) -> None:
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        writer.close()

    def __enter__(self) -> ArrayRecordWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
