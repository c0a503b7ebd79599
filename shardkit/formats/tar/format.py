"""Tar as a :class:`~shardkit.formats.base.ShardFormat`: ranges of samples, counts, and the tar index.

The index (``shardkit index``) is the container of :mod:`shardkit.formats.offsets`
holding the byte offset of each sample's first header, checked when used:
the tar's size, ascending offsets, a sound header at the last offset, and
(while reading) no index boundary inside a sample.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, Final

import fsspec
import numpy as np

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.base import FormatBase, RecordBound, ResumeHint, file_record_bound
from shardkit.formats.offsets import IndexFileError, index_path_for, load_offsets, write_offsets
from shardkit.formats.tar.headers import _BLOCK, _Blocks, _checksum_ok
from shardkit.formats.tar.parser import _Bad, _located_by_index, _Parser
from shardkit.formats.tar.writer import TarWriter
from shardkit.io.files import open_input, open_raw
from shardkit.io.remote import RemoteOptions
from shardkit.io.retry import retried_call

__all__ = ["INDEX_MAGIC", "TarFormat"]

INDEX_MAGIC: Final = b"SKTARIX1"


class TarFormat(FormatBase):
    """WebDataset tar shards (``.tar``, ``.tar.gz``/``.tgz``): a record is a sample.

    Args:
        compression: ``"auto"`` (gzip when the file starts with its magic),
            ``None`` or ``"gzip"``.
        index: use a tar index beside the shard (``shardkit index``) to count
            and to seek to a range's first sample.
        storage_options: fsspec options.
        remote: how remote shards are read (:class:`~shardkit.io.remote.RemoteOptions`: readahead,
            retries, the local cache); local files ignore it.
    """

    name = "tar"
    suffixes = (".tar.gz", ".tgz", ".tar")

    def __init__(
        self,
        *,
        compression: str | None = "auto",
        index: bool = True,
        storage_options: dict[str, Any] | None = None,
        remote: RemoteOptions | None = None,
    ) -> None:
        if compression not in ("auto", None, "gzip"):
            raise ShardkitError(f"tar compression must be 'auto', None or 'gzip', got {compression!r}")
        self.compression = compression
        self.index = index
        self.storage_options = storage_options
        self.remote = remote
        self._hint: ResumeHint | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hint": None}

    def __repr__(self) -> str:
        return f"TarFormat(compression={self.compression!r}, index={self.index})"

    def sniff(self, head: bytes) -> bool:
        if head[:2] == b"\x1f\x8b":
            return False  # any gzip stream: decided by the suffix
        return len(head) >= _BLOCK and head[257:262] == b"ustar" and _checksum_ok(head[:_BLOCK])

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """Samples ``[start, stop)`` of the tar at ``url``."""
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
        return self._read(url, start, stop)

    def _read(self, url: str, start: int, stop: int | None) -> Iterator[dict[str, Any]]:
        if stop is not None and stop <= start:
            return
        raw = open_raw(url, "rb", self.storage_options, remote=self.remote)
        try:
            compressed = self._compressed(raw)
            hint = self._hint if not compressed else None
            if hint is not None and (hint.url, hint.record) == (url, start):  # the retry after a damaged sample
                offsets, first, offset = None, start, hint.offset
            else:
                offsets = None if compressed else self._index_for(url, start)
                first = start if offsets is not None and start else 0
                if first and start >= len(offsets):  # type: ignore[arg-type]  # the index says there is no sample `start`
                    return
                offset = int(offsets[start]) if first else 0  # type: ignore[index]
            self._hint = None
            if offset:
                raw.seek(offset)
            source = open_input(url, "gzip", raw=raw) if compressed else raw
            parser = _Parser(url, _Blocks(source, offset), first, compressed)
            try:
                for _, sample in parser.samples(offsets):
                    index = parser.index
                    if index < start:
                        continue
                    if isinstance(sample, _Bad):
                        raise self._lost(url, sample, compressed)
                    yield sample
                    if stop is not None and index + 1 >= stop:
                        return
            except CorruptRecordError as error:
                raise _located_by_index(error, offsets) from None
        finally:
            raw.close()

    def _lost(self, url: str, bad: _Bad, compressed: bool) -> CorruptRecordError:
        """The error for a damaged sample; the retry for the next one seeks where it starts (plain files)."""
        if not compressed:
            self._hint = ResumeHint(url, bad.error.record_index + 1, bad.resume)
        return bad.error

    def _index_for(self, url: str, start: int) -> np.ndarray | None:
        """The checked index, to seek to ``start`` and to find the sample after a bad one.

        Reading from the start needs no index: one that does not fit the file is then not used.
        """
        if not start:
            try:
                return self.index_offsets(url)
            except IndexFileError:
                return None
        return self.index_offsets(url)

    def _compressed(self, raw: Any) -> bool:
        if self.compression != "auto":
            return self.compression == "gzip"
        compressed = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        return compressed

    min_record_bytes: Final = _BLOCK
    """A sample is at least one member, and a member at least its 512-byte header (empty data)."""

    def record_bound(self, url: str) -> RecordBound:
        """The most samples ``url`` can hold by its size (see :func:`~shardkit.formats.base.max_records`)."""
        return file_record_bound(url, self.min_record_bytes, self.compression, self.storage_options, self.remote)

    def index_offsets(self, url: str) -> np.ndarray | None:
        """The record offsets of ``url`` from its index file, checked against the file; None without one.

        Raises:
            IndexFileError: the index does not fit the file (stale, damaged, of another format).
        """
        if not self.index or self.compression == "gzip" or url.lower().endswith((".gz", ".tgz")):
            return None
        offsets = load_offsets(url, INDEX_MAGIC, self.storage_options, self.remote)
        if offsets is not None and len(offsets):
            with open_raw(url, "rb", self.storage_options, remote=self.remote) as f:
                f.seek(int(offsets[-1]))
                header = f.read(_BLOCK)
            if len(header) < _BLOCK or not _checksum_ok(header):
                raise IndexFileError(url, index_path_for(url), f"no tar header at its last offset {int(offsets[-1])}")
        return offsets

    def count(self, url: str) -> int:
        """Samples in ``url``: from its index when there is a valid one, else a header scan."""
        try:
            offsets = self.index_offsets(url)
        except IndexFileError as error:
            warnings.warn(f"{error}; counting its samples by a scan instead", stacklevel=2)
            offsets = None
        if offsets is not None:
            return len(offsets)
        return len(self.scan(url))

    def scan(self, url: str, *, strict: bool = False) -> np.ndarray:
        """Byte offset of each sample's first header (in the uncompressed stream), checking every header.

        A sample lost to a damaged header counts as one sample at the damage's
        offset, as the reader numbers it; ``strict`` raises its error instead.
        """
        raw = open_raw(url, "rb", self.storage_options, remote=self.remote)
        try:
            compressed = self._compressed(raw)
            source = open_input(url, "gzip", raw=raw) if compressed else raw
            parser = _Parser(url, _Blocks(source, 0), 0, compressed)
            starts = []
            for at, sample in parser.samples():
                if strict and isinstance(sample, _Bad):
                    raise sample.error
                starts.append(at)
            return np.array(starts, dtype=np.int64)
        finally:
            raw.close()

    def build_index(self, url: str) -> str | None:
        """Write the tar index of ``url`` beside it (``url + ".idx"``) and return its path."""
        with open_raw(url, "rb", self.storage_options, remote=self.remote) as f:
            if f.read(2) == b"\x1f\x8b":
                raise ShardkitError(
                    f"{url}: a gzip-compressed tar cannot seek, so it gets no index; its samples are counted by a scan"
                )
        offsets = self.scan(url, strict=True)  # an index never records damage: it would seek into it
        fs, path = fsspec.core.url_to_fs(url, **(self.storage_options or {}))
        index_url = index_path_for(url)
        size = int(retried_call(fs, "info", path, retry=self.remote.retry if self.remote else None)["size"])
        write_offsets(index_url, INDEX_MAGIC, offsets, size, self.storage_options)
        return index_url

    def writer(self, url: str, *, name: str | None = None) -> TarWriter:
        """A writer of samples to ``url`` (``name``: the name it will be renamed to; unused)."""
        return TarWriter(url, storage_options=self.storage_options)
