"""JSON lines shards: a record is one line parsed as JSON (plain, gzip or zstandard).

A line is the bytes up to a ``\\n``; the last line may lack it. Lines holding
only whitespace are not records (editors leave them), so record ``i`` is the
``i``-th non-blank line; errors name both the record index and the line number.

Reading cuts a block (:data:`~shardkit.io.files.BLOCK_SIZE`) at its newlines
with ``bytes.split`` and parses each line with ``json.loads``; local plain
files are read with ``os.pread``. ``.gz`` files are inflated on the fly;
``.zst`` files need the ``zstandard`` package (the ``zstd`` extra).

Trust nothing: a line that is not JSON (or not UTF-8) raises
:class:`~shardkit.CorruptRecordError` with the url, record index, byte offset
of the line and its line number, with ``framing_intact`` true: the next line
is still found, so ``on_error="skip"`` costs exactly that line. The reader
remembers where the line after the bad one starts (:class:`ResumeHint`), so
the retry seeks there. A newline index (``shardkit index``: the byte offset
of every record, bound to the file's size and checked when used: the byte
before the last offset must be a newline) gives counts without a scan and
ranges with a seek; compressed files get none (they cannot seek).

A line cut short at the end of a file (no newline, not JSON) is such a bad
line: it costs that record. A compressed stream that is cut short or damaged
yields every complete line before the damage, then raises at the record being
read with the offset where its line starts in the uncompressed stream (the
message names the compressed byte); ``framing_intact`` is false, since
nothing after the damage can be inflated, so the rest of the range is
skipped and counted under ``on_error="skip"``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from typing import Any, Final

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileOpener

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.base import FormatBase, RecordBound, ResumeHint, file_record_bound
from shardkit.formats.offsets import IndexFileError, index_path_for, load_offsets, write_offsets
from shardkit.io.files import BLOCK_SIZE, CompressedStreamError, open_input, open_output, open_raw
from shardkit.io.remote import RemoteOptions
from shardkit.io.retry import retried_call

__all__ = ["JsonlFormat", "JsonlWriter"]

INDEX_MAGIC: Final = b"SKJSLIX1"
_ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC: Final = b"\x1f\x8b"
COMPRESSIONS: Final = ("auto", None, "gzip", "zstd")


class _Zstd:
    """A zstandard-decompressing stream (``read``/``close``) over a raw file."""

    def __init__(self, raw: Any, url: str) -> None:
        try:
            import zstandard
        except ImportError:
            raise ShardkitError(
                f"{url} is zstandard-compressed: install the 'zstandard' package (pip install shardkit[zstd])"
            ) from None
        self._reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        self._raw = raw
        self._url = url
        self._error = zstandard.ZstdError

    def read(self, size: int = -1, /) -> bytes:
        try:
            return self._reader.read(size)
        except self._error as error:
            raise CompressedStreamError(self._url, f"zstd stream is damaged ({error})", -1) from None

    def close(self) -> None:
        self._raw.close()


class _Lines:
    """The lines of a file from a byte offset: (byte offset, line bytes) pairs, a block at a time."""

    def __init__(self, source: Any, offset: int) -> None:
        self._fd: int | None = source.fileno() if isinstance(source, LocalFileOpener) else None
        self._source: Any = source
        self.offset = offset

    def _read(self, pos: int) -> bytes:
        if self._fd is not None:
            return os.pread(self._fd, BLOCK_SIZE, pos)
        return self._source.read(BLOCK_SIZE)

    def blocks(self) -> Iterator[tuple[int, list[bytes]]]:
        """(offset of the first line, lines) for each block; lines keep no newline."""
        rest = b""
        pos = self.offset  # file offset just past what has been read
        while True:
            chunk = self._read(pos)
            if not chunk:
                if rest:
                    yield pos - len(rest), [rest]
                return
            pos += len(chunk)
            data = rest + chunk if rest else chunk
            cut = data.rfind(b"\n")
            if cut < 0:
                rest = data
                continue
            rest = data[cut + 1 :]
            yield pos - len(data), data[:cut].split(b"\n")


_CHUNK: Final = 512
"""Lines parsed by one ``map(json.loads, ...)``: no Python frame per line where none is blank or bad."""


def _parse_all(lines: list[bytes]) -> list[Any] | None:
    """Every line parsed, or None if one is blank or not JSON (the caller then goes line by line)."""
    try:
        return list(map(json.loads, lines))
    except (ValueError, RecursionError):
        return None


class _Position:
    """Where reading is: the next record, the byte offset of the next line, its line number (None: unknown)."""

    __slots__ = ("record", "at", "line")

    def __init__(self, record: int, line: int | None) -> None:
        self.record = record
        self.at = 0
        self.line = line

    def passed(self, lines: list[bytes]) -> None:
        """Past ``lines``, none of them blank."""
        self.record += len(lines)
        self.at += sum(map(len, lines)) + len(lines)
        if self.line is not None:
            self.line += len(lines)


class JsonlFormat(FormatBase):
    """JSON lines shards (``.jsonl``, ``.ndjson``, with ``.gz`` or ``.zst``): a record is a non-blank line.

    Args:
        compression: ``"auto"`` (from the first bytes), ``None``, ``"gzip"`` or ``"zstd"``.
        index: use a newline index beside the shard (``shardkit index``) to count and seek.
        storage_options: fsspec options.
        remote: how remote shards are read (:class:`~shardkit.io.remote.RemoteOptions`: readahead,
            retries, the local cache); local files ignore it.
    """

    name = "jsonl"
    suffixes = (".jsonl.gz", ".jsonl.zst", ".ndjson.gz", ".ndjson.zst", ".jsonl", ".ndjson")

    def __init__(
        self,
        *,
        compression: str | None = "auto",
        index: bool = True,
        storage_options: dict[str, Any] | None = None,
        remote: RemoteOptions | None = None,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ShardkitError(f"jsonl compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.compression = compression
        self.index = index
        self.storage_options = storage_options
        self.remote = remote
        self._hint: ResumeHint | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hint": None}

    def __repr__(self) -> str:
        return f"JsonlFormat(compression={self.compression!r}, index={self.index})"

    def sniff(self, head: bytes) -> bool:
        first = head.lstrip()[:1]
        return first in (b"{", b"[") and b"\n" in head

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Records ``[start, stop)`` of the JSON lines file at ``url``."""
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
        return self._read(url, start, stop)

    def _read(self, url: str, start: int, stop: int | None) -> Iterator[Any]:
        if stop is not None and stop <= start:
            return
        raw = open_raw(url, "rb", self.storage_options, remote=self.remote)
        try:
            compression = self._compression(raw)
            record, offset = (0, 0) if compression is not None else self._seek_point(url, start)
            if record > start:
                return  # the index says the file has no record `start`
            source = self._open(url, raw, compression, offset)
            yield from self._records(url, _Lines(source, offset), record, start, stop, compression)
        finally:
            raw.close()

    def _records(
        self, url: str, lines: _Lines, record: int, start: int, stop: int | None, compression: str | None
    ) -> Iterator[Any]:
        pos = _Position(record, None if record else 0)  # line numbers are known when reading from the file's start
        try:
            for at, block in lines.blocks():
                pos.at = at
                for i in range(0, len(block), _CHUNK):
                    chunk = block[i : i + _CHUNK]
                    values = _parse_all(chunk) if pos.record >= start else None
                    if values is None:  # lines to pass over, a blank line or a bad one: line by line
                        yield from self._line_by_line(url, chunk, pos, start, stop, compression)
                    else:
                        pos.passed(chunk)
                        if stop is not None and pos.record >= stop:
                            values = values[: len(values) - (pos.record - stop)]
                        yield from values
                    if stop is not None and pos.record >= stop:
                        return
        except CompressedStreamError as error:  # after every line before the damage; pos.at: where the cut line starts
            at = error.compressed_offset if error.compressed_offset >= 0 else None
            reason = f"{error.reason}; reading record {pos.record} (offset in the uncompressed {compression} stream)"
            raise CorruptRecordError(url, pos.record, pos.at, reason, compressed_offset=at) from None

    def _line_by_line(
        self, url: str, chunk: list[bytes], pos: _Position, start: int, stop: int | None, compression: str | None
    ) -> Iterator[Any]:
        """The records of ``chunk`` from record ``start`` to ``stop``: blank lines passed over, a bad line raised."""
        for line in chunk:
            if pos.line is not None:
                pos.line += 1
            if line.strip():
                if pos.record >= start:
                    try:
                        value = json.loads(line)
                    except (ValueError, RecursionError) as error:
                        raise self._bad(url, pos.record, pos.at, line, pos.line, error, compression) from None
                    yield value
                pos.record += 1
                if stop is not None and pos.record >= stop:
                    return
            pos.at += len(line) + 1

    def _bad(
        self,
        url: str,
        record: int,
        at: int,
        line: bytes,
        line_number: int | None,
        error: ValueError | RecursionError,
        compression: str | None,
    ) -> CorruptRecordError:
        if compression is None:
            self._hint = ResumeHint(url, record + 1, at + len(line) + 1)
        where = f"line {line_number}" if line_number is not None else "its line"
        note = f" (offset in the uncompressed {compression} stream)" if compression else ""
        reason = f"{where} is not valid JSON ({type(error).__name__}: {str(error)[:200]}){note}: {line[:60]!r}"
        return CorruptRecordError(url, record, at, reason, framing_intact=True)

    def _compression(self, raw: Any) -> str | None:
        if self.compression != "auto":
            return self.compression
        head = raw.read(4)
        raw.seek(0)
        if head[:2] == _GZIP_MAGIC:
            return "gzip"
        return "zstd" if head == _ZSTD_MAGIC else None

    def _open(self, url: str, raw: Any, compression: str | None, offset: int) -> Any:
        if compression == "zstd":
            return _Zstd(raw, url)
        if compression == "gzip":
            return open_input(url, "gzip", raw=raw)
        if offset:
            raw.seek(offset)
        return raw

    def _seek_point(self, url: str, start: int) -> tuple[int, int]:
        """(record index, byte offset) to read from for record ``start``: a hint, the index, else the start."""
        hint = self._hint
        if hint is not None and hint.url == url and hint.record == start:
            return start, hint.offset
        if not start:
            return 0, 0
        offsets = self.index_offsets(url)
        if offsets is None:
            return 0, 0
        if start >= len(offsets):
            return start + 1, 0
        return start, int(offsets[start])

    min_record_bytes: Final = 2
    """A record is a non-blank line: one character and the newline that ends it (the last may lack
    it, which :func:`~shardkit.formats.base.max_records` allows for by rounding up)."""

    def record_bound(self, url: str) -> RecordBound:
        """The most records ``url`` can hold by its size (see :func:`~shardkit.formats.base.max_records`)."""
        return file_record_bound(url, self.min_record_bytes, self.compression, self.storage_options, self.remote)

    def index_offsets(self, url: str) -> np.ndarray | None:
        """The record offsets of ``url`` from its index file, checked against the file; None without one.

        Raises:
            IndexFileError: the index does not fit the file (stale, damaged, of another format).
        """
        if not self.index or self.compression in ("gzip", "zstd") or url.lower().endswith((".gz", ".zst")):
            return None
        offsets = load_offsets(url, INDEX_MAGIC, self.storage_options, self.remote)
        if offsets is not None and len(offsets) and offsets[-1] > 0:
            with open_raw(url, "rb", self.storage_options, remote=self.remote) as f:
                f.seek(int(offsets[-1]) - 1)
                before = f.read(2)
            if before[:1] != b"\n" or before[1:2].isspace():
                raise IndexFileError(url, index_path_for(url), f"no line starts at its last offset {int(offsets[-1])}")
        return offsets

    def count(self, url: str) -> int:
        """Records in ``url``: from its index when there is a valid one, else a newline scan."""
        try:
            offsets = self.index_offsets(url)
        except IndexFileError as error:
            warnings.warn(f"{error}; counting its lines by a scan instead", stacklevel=2)
            offsets = None
        return len(offsets) if offsets is not None else len(self.scan(url))

    def scan(self, url: str) -> np.ndarray:
        """Byte offset of every record (non-blank line), in the (uncompressed) stream."""
        raw = open_raw(url, "rb", self.storage_options, remote=self.remote)
        try:
            compression = self._compression(raw)
            lines = _Lines(self._open(url, raw, compression, 0), 0)
            parts = []
            try:
                for at, block in lines.blocks():
                    lengths = np.fromiter((len(line) + 1 for line in block), dtype=np.int64, count=len(block))
                    starts = at + np.concatenate(([0], np.cumsum(lengths)[:-1]))
                    keep = np.fromiter((bool(line.strip()) for line in block), dtype=bool, count=len(block))
                    parts.append(starts[keep])
            except CompressedStreamError as error:
                raise CorruptRecordError(url, -1, -1, error.reason) from None
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        finally:
            raw.close()

    def build_index(self, url: str) -> str | None:
        """Write the newline index of ``url`` beside it (``url + ".idx"``) and return its path."""
        with open_raw(url, "rb", self.storage_options, remote=self.remote) as f:
            if self._compression(f) is not None:
                raise ShardkitError(
                    f"{url}: a compressed JSON lines file cannot seek, so it gets no index; its lines are counted by a scan"
                )
        offsets = self.scan(url)
        fs, path = fsspec.core.url_to_fs(url, **(self.storage_options or {}))
        index_url = index_path_for(url)
        size = int(retried_call(fs, "info", path, retry=self.remote.retry if self.remote else None)["size"])
        write_offsets(index_url, INDEX_MAGIC, offsets, size, self.storage_options)
        return index_url

    def writer(self, url: str, *, name: str | None = None) -> JsonlWriter:
        """A writer of JSON values to ``url``, gzip-compressed when ``name`` (default ``url``) ends with ``.gz``."""
        gzip = (name or url).lower().endswith(".gz") or self.compression == "gzip"
        return JsonlWriter(url, compression="gzip" if gzip else None, storage_options=self.storage_options)


class JsonlWriter:
    """Write JSON values one per line (``compression``: None or ``"gzip"``; by default, gzip when ``url`` ends with ``.gz``)."""

    def __init__(
        self, url: str, *, compression: str | None = "auto", storage_options: dict[str, Any] | None = None
    ) -> None:
        self.url = url
        self.num_records = 0
        self.num_bytes = 0
        if compression == "auto":
            compression = "gzip" if url.lower().endswith(".gz") else None
        self._sink: Any = open_output(url, compression, storage_options)

    def write(self, value: Any) -> None:
        if self._sink is None:
            raise ShardkitError(f"{self.url}: write() on a closed JsonlWriter")
        line = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        self._sink.write(line)
        self.num_records += 1
        self.num_bytes += len(line)

    def close(self) -> None:
        if self._sink is not None:
            sink, self._sink = self._sink, None
            sink.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
