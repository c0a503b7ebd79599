"""LitData chunks as a shard format (see :mod:`shardkit.formats.litdata` for the layout and the checks)."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import Any, Final

import fsspec
import numpy as np

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.base import BadRecord, FormatBase, FormatError, ProcessCache
from shardkit.formats.litdata.index import INDEX_NAME, LitDataIndex, index_url, parse_index
from shardkit.formats.litdata.leaves import TORCH_DTYPES, builder, leaf_decoder, numpy_dtype, torch_dtype, torch_of
from shardkit.io.files import open_raw
from shardkit.io.remote import RemoteOptions

__all__ = ["FOOTER_MAGIC", "INDEX_CACHE", "LitDataFormat"]

FOOTER_MAGIC: Final = b"LDARW01\0"

INDEX_CACHE: Final = 64
"""Parsed ``index.json`` files kept per process."""


class LitDataFormat(FormatBase):
    """LitData optimized datasets: a shard is a chunk file, beside the dataset's ``index.json``.

    Args:
        images: ``"bytes"`` (the default: JPEG and other encoded images as their bytes) or
            ``"pil"`` (decoded with Pillow). Raw PIL leaves are PIL images either way.
        block_size: for a ``TokensLoader`` dataset, a record is a block of this many tokens of one
            chunk (as ``TokensLoader(block_size=...)`` yields them); None: a record is an item,
            ``{"input_ids": array}``.
        storage_options: fsspec options.
        remote: how remote chunks are read (:class:`~shardkit.io.remote.RemoteOptions`).
    """

    name = "litdata"
    suffixes = ()  # chunks are ".bin" like Megatron's: they are known by the index.json beside them

    def __init__(
        self,
        *,
        images: str = "bytes",
        block_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        remote: RemoteOptions | None = None,
    ) -> None:
        if images not in ("bytes", "pil"):
            raise FormatError(f"images must be 'bytes' or 'pil', got {images!r}")
        if block_size is not None and (type(block_size) is not int or block_size < 1):
            raise FormatError(f"block_size must be an int >= 1 or None, got {block_size!r}")
        self.images = images
        self.block_size = block_size
        self.storage_options = storage_options
        self.remote = remote
        self._indexes: ProcessCache[LitDataIndex] = ProcessCache(INDEX_CACHE)

    def __repr__(self) -> str:
        return f"LitDataFormat(images={self.images!r}, block_size={self.block_size!r})"

    def sniff(self, head: bytes) -> bool:
        return False  # a chunk has no magic; the CLI reads a dataset by its directory

    def index(self, url: str) -> LitDataIndex:
        """The checked ``index.json`` of the dataset whose chunk (or directory, or index) is ``url``."""
        where = url if url.endswith(INDEX_NAME) else index_url(url)
        fs, path = fsspec.core.url_to_fs(where, **(self.storage_options or {}))
        key = (where, *_local_identity(path)) if "file" in _protocols(fs) else (where,)
        return self._indexes.get(key, lambda: self._read_index(where))

    def _read_index(self, where: str) -> LitDataIndex:
        try:
            with open_raw(where, "rb", self.storage_options, remote=self.remote) as f:
                data = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{where} does not exist: a LitData dataset is a directory of chunks with the index.json "
                "litdata.optimize writes"
            ) from None
        return parse_index(data, where)

    def stored_count(self, url: str) -> int:
        """Records of the chunk ``url`` by ``index.json``: items, or blocks of ``block_size`` tokens."""
        index = self.index(url)
        at = index.chunk(url)
        if self.block_size is None:
            return index.items[at]
        if not index.tokens_loader:
            raise FormatError(f"{index.url}: block_size= reads TokensLoader datasets; this one is not")
        tokens = index.tokens[at]
        if tokens is None:
            raise ShardkitError(f"{index.url}: chunk {index.filenames[at]} has no token count (dim)")
        return tokens // self.block_size

    def count(self, url: str) -> int:
        return self.stored_count(url)

    def build_index(self, url: str) -> str | None:
        """``index.json`` is the index: check it, return None."""
        self.stored_count(url)
        return None

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Records ``[start, stop)`` of the chunk file ``url``."""
        _check_range(start, stop)
        return self._records(url, start, stop, marked=False)

    def read_marked(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """:meth:`read`, with a :class:`~shardkit.formats.base.BadRecord` in place of an item that does not decode."""
        _check_range(start, stop)
        return self._records(url, start, stop, marked=True)

    def _records(self, url: str, start: int, stop: int | None, *, marked: bool) -> Iterator[Any]:
        index = self.index(url)
        expected = self.stored_count(url)
        stop = expected if stop is None else min(stop, expected)
        if start >= stop:
            return
        with _Chunk(url, index, self.storage_options, self.remote) as chunk:
            offsets = chunk.offsets(index.items[index.chunk(url)], start)
            if self.block_size is not None:
                yield from chunk.blocks(offsets, self.block_size, start, stop, index.leaves[0])
            elif index.tokens_loader:
                decode = leaf_decoder(index.leaves[0], self.images)
                yield from chunk.documents(offsets, start, stop, decode)
            elif chunk.footer is not None:
                yield from chunk.footer_rows(start, stop, len(offsets) - 1)
            else:
                decoders = [leaf_decoder(leaf, self.images) for leaf in index.leaves]
                yield from chunk.items(offsets, start, stop, decoders, builder(index.spec), marked)


def _check_range(start: int, stop: int | None) -> None:
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")


def _protocols(fs: Any) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def _local_identity(path: str) -> tuple[int, ...]:
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return st.st_size, st.st_mtime_ns, st.st_ino


class _Chunk:
    """One open chunk file: its header checked against the index, its items read by ranged reads."""

    def __init__(self, url: str, index: LitDataIndex, storage_options: Any, remote: RemoteOptions | None) -> None:
        self.url = url
        self._file: Any = open_raw(url, "rb", storage_options, remote=remote)
        self._data: bytes | None = None
        if index.compression == "zstd":
            self._data = _inflate(url, self._file.read())
            self.size = len(self._data)
        else:
            self.size = int(self._file.seek(0, 2))
        self.footer = self._footer()

    def __enter__(self) -> _Chunk:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._file.close()

    def bytes_at(self, offset: int, size: int) -> memoryview:
        if self._data is not None:
            return memoryview(self._data)[offset : offset + size]
        self._file.seek(offset)
        return memoryview(self._file.read(size))

    def offsets(self, items: int, record: int) -> np.ndarray:
        """The item offsets of the header, checked: the index's count, in order, within the file.

        A fault is raised at ``record`` (the range's first): the chunk's framing cannot be trusted.
        """
        head = self.bytes_at(0, 4)
        if len(head) < 4:
            raise CorruptRecordError(self.url, record, 0, f"the chunk has {self.size} bytes: no header")
        n = struct.unpack("<I", head)[0]
        if n != items:
            reason = f"the chunk's header holds {n} items, index.json says {items}: the index is not of this chunk"
            raise CorruptRecordError(self.url, record, 0, reason)
        raw = self.bytes_at(4, 4 * (n + 1))
        if len(raw) < 4 * (n + 1):
            raise CorruptRecordError(self.url, record, 4, f"the chunk ends at byte {self.size}, inside its header")
        offsets = np.frombuffer(raw, dtype="<u4").astype(np.int64)
        if offsets[0] != 4 * (n + 2) or np.any(np.diff(offsets) < 0):
            bad = 0 if offsets[0] != 4 * (n + 2) else int(np.flatnonzero(np.diff(offsets) < 0)[0]) + 1
            raise CorruptRecordError(
                self.url, record, 4 + 4 * bad, f"item offset {bad} ({offsets[bad]}) is out of order"
            )
        end = self.size - (0 if self.footer is None else self.footer[1] + 12)
        if offsets[-1] < end and self.footer is None:
            reason = f"{end - int(offsets[-1])} bytes follow the chunk's items and no Arrow footer ends it (cut off?)"
            raise CorruptRecordError(self.url, record, int(offsets[-1]), reason)
        return offsets

    def _footer(self) -> tuple[int, int] | None:
        """(start, length) of the trailing Arrow IPC file, None without one."""
        if self.size < 12:
            return None
        tail = bytes(self.bytes_at(self.size - 12, 12))
        if tail[4:] != FOOTER_MAGIC:
            return None
        length = struct.unpack_from("<I", tail)[0]
        return (self.size - 12 - length, length) if length <= self.size - 12 else None

    def items(
        self, offsets: np.ndarray, start: int, stop: int, decoders: list[Any], build: Any, marked: bool
    ) -> Iterator[Any]:
        """Items ``[start, stop)`` decoded into their sample tree; one whose bytes are past the file's end ends the read."""
        span = 1 << 20
        sizes = struct.Struct(f"<{len(decoders)}I")
        i = start
        while i < stop:
            j = min(stop, i + max(1, int(np.searchsorted(offsets[i + 1 : stop + 1], offsets[i] + span, side="right"))))
            lo, hi = int(offsets[i]), int(offsets[j])
            data = self.bytes_at(lo, hi - lo)
            bounds = (offsets[i : j + 1] - lo).tolist()
            for k in range(i, j):
                a, b = bounds[k - i], bounds[k - i + 1]
                if b > len(data):
                    reason = f"item {k} is bytes [{offsets[k]}, {offsets[k + 1]}) but the chunk ends at byte {lo + len(data)}"
                    raise CorruptRecordError(self.url, k, int(offsets[k]), reason)
                try:
                    yield build(_leaves(data[a:b], decoders, sizes))
                # RuntimeError: torch's, for a tensor leaf whose shape does not fit its bytes
                except (ValueError, struct.error, IndexError, UnicodeDecodeError, OverflowError, RuntimeError) as error:
                    bad = CorruptRecordError(
                        self.url, k, int(offsets[k]), f"the item does not decode ({error})", framing_intact=True
                    )
                    if not marked:
                        raise bad from None
                    yield BadRecord(bad)
            i = j

    def documents(self, offsets: np.ndarray, start: int, stop: int, decode: Any) -> Iterator[Any]:
        """Items ``[start, stop)`` of a TokensLoader chunk, each ``{"input_ids": numpy array}``."""
        for k in range(start, stop):
            lo, hi = int(offsets[k]), int(offsets[k + 1])
            data = self.bytes_at(lo, hi - lo)
            if len(data) < hi - lo:
                reason = f"item {k} is bytes [{lo}, {hi}) but the chunk ends at byte {lo + len(data)}"
                raise CorruptRecordError(self.url, k, lo, reason)
            tokens = decode(data)
            yield {"input_ids": tokens.numpy() if hasattr(tokens, "numpy") else tokens}

    def blocks(self, offsets: np.ndarray, size: int, start: int, stop: int, leaf: str) -> Iterator[Any]:
        """Blocks ``[start, stop)`` of ``size`` tokens of a TokensLoader chunk, as TokensLoader yields them."""
        name, _, code = leaf.partition(":")
        dtype = numpy_dtype(int(code)) if name == "no_header_numpy" else np.dtype(TORCH_DTYPES[int(code)])
        step = size * dtype.itemsize
        base = int(offsets[0])
        for k in range(start, stop):
            data = self.bytes_at(base + k * step, step)
            if len(data) < step:
                reason = f"block {k} is bytes [{base + k * step}, {base + (k + 1) * step}), past the chunk's end ({self.size})"
                raise CorruptRecordError(self.url, k, base + k * step, reason)
            if name == "no_header_numpy":
                yield np.frombuffer(data, dtype=dtype).copy()
            else:
                yield torch_of(data, torch_dtype(int(code)), (-1,))

    def footer_rows(self, start: int, stop: int, items: int) -> Iterator[dict[str, Any]]:
        """Rows ``[start, stop)`` from the Arrow footer, reading only the record batches they fall in."""
        import pyarrow as pa

        assert self.footer is not None
        at, length = self.footer
        try:
            reader = pa.ipc.open_file(pa.py_buffer(bytes(self.bytes_at(at, length))))
            rows = sum(reader.get_batch(b).num_rows for b in range(reader.num_record_batches))
        except (pa.ArrowInvalid, OSError, ValueError) as error:
            raise CorruptRecordError(self.url, start, at, f"the Arrow footer cannot be read ({error})") from None
        if rows != items:
            reason = f"the Arrow footer holds {rows} rows, the chunk's header {items}"
            raise CorruptRecordError(self.url, start, at, reason)
        first = 0
        for b in range(reader.num_record_batches):
            batch = reader.get_batch(b)
            end = first + batch.num_rows
            if end > start and first < stop:
                yield from batch.slice(max(start - first, 0), min(stop, end) - max(start, first)).to_pylist()
            first = end


def _leaves(item: memoryview, decoders: list[Any], header: struct.Struct) -> list[Any]:
    """The decoded leaves of one item: ``uint32`` sizes (``header``), one per leaf, then the leaves' bytes."""
    sizes = header.unpack_from(item)
    at = header.size
    if at + sum(sizes) != len(item):
        raise ValueError(f"its {len(sizes)} leaf sizes add up to {at + sum(sizes)} bytes, the item has {len(item)}")
    out = []
    for size, decode in zip(sizes, decoders):
        out.append(decode(item[at : at + size]))
        at += size
    return out


def _inflate(url: str, data: bytes) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise ShardkitError(
            f"{url} is zstd-compressed: reading it needs zstandard (pip install shardkit[zstd])"
        ) from None
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34)
    except zstandard.ZstdError as error:
        raise CorruptRecordError(url, 0, -1, f"the zstd chunk does not inflate ({error})") from None
