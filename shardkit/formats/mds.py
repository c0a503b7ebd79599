"""Mosaic Streaming (MDS) shards, read in place: a directory with ``index.json`` and ``shard.NNNNN.mds`` files.

A shard is one file, ``[n: u32][offsets: (n + 1) x u32][config JSON][samples]``,
each offset absolute from the file's start, so sample ``i`` is bytes
``[offsets[i], offsets[i + 1])``: a range is one ranged read, no scan. A
sample is ``[a u32 size per variable-size column][each column's bytes]``, the
columns in ``index.json``'s order with the encodings MDS defines, decoded to
the dict Mosaic's ``StreamingDataset`` returns: int and float scalars as
numpy scalars (``int``: a Python int), ``str``, ``bytes``, ``json``,
``ndarray`` (dtype and shape from the encoding or the sample), ``str_int``,
``str_float``, ``str_decimal``; images (``jpeg``, ``png``, ``pil``) as their
encoded bytes (decode them in a ``map`` if you want pixels). A ``pkl`` column
is refused: unpickling runs code from the file, and nothing shardkit loads
does.

A compressed shard (``shard.00000.mds.zstd``, ``.gz``, ``.bz2``; ``.br`` and
``.snappy`` with their packages) is one compressed stream of that layout:
it is read whole, checked and inflated once, and kept in memory
(:data:`INFLATED_CACHE_BYTES`, least recently used dropped first) for the
next ranges of the same shard.

Counts come from ``index.json`` (``samples`` per shard), and are held to the
file: the file's size must be the ``bytes`` the index gives, and its own
header must count the same samples; a shard that disagrees (replaced,
truncated, a stale index) is a :class:`~shardkit.CorruptRecordError` at the
range's first record, never a short read. An offset table that is not
increasing or points past the file, a stream that does not inflate, and a
sample whose column sizes do not add up are located errors too (url, record,
byte offset); a bad sample alone costs that sample under ``on_error="skip"``.
"""

from __future__ import annotations

import bz2
import gzip
import json
import posixpath
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any, Final, NamedTuple

import fsspec
import numpy as np

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.base import BadRecord, FormatBase, ProcessCache
from shardkit.io.files import open_raw
from shardkit.io.identity import version
from shardkit.io.remote import RemoteOptions
from shardkit.io.retry import retried_call

__all__ = ["INFLATED_CACHE_BYTES", "MDSFormat", "MDSShard", "dataset_shards", "decode_column"]

INDEX: Final = "index.json"
INFLATED_CACHE_BYTES: Final = 512 << 20
"""Inflated compressed shards kept per process (Mosaic's default shard is 64 MiB)."""
INDEX_CACHE: Final = 64
"""Datasets' parsed ``index.json`` kept per process."""

_SCALARS: Final = {
    name: np.dtype(name)
    for name in (
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}
_VALUE_DTYPES: Final = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
                        34: "float32", 64: "uint64", 65: "int64", 66: "float64"}  # fmt: skip
_SHAPE_DTYPES: Final = ("uint8", "uint16", "uint32", "uint64")
_IMAGES: Final = ("jpeg", "png", "pil")
_TEXT: Final = {"str": str, "str_int": int, "str_float": float, "str_decimal": Decimal}
_SUFFIXES: Final = {"zstd": "zstd", "gz": "gz", "bz2": "bz2", "br": "br", "snappy": "snappy"}


class MDSError(ShardkitError, ValueError):
    """An MDS dataset shardkit cannot read as it is: a ``pkl`` column, an unknown encoding or compression."""


class MDSShard(NamedTuple):
    """One shard as ``index.json`` describes it: its file (compressed or not), samples, sizes, columns."""

    basename: str
    samples: int
    size: int  # bytes of the file as stored (compressed when zipped)
    raw_size: int  # bytes of the uncompressed layout
    compression: str | None
    names: tuple[str, ...]
    encodings: tuple[str, ...]
    sizes: tuple[int | None, ...]


def parse_index(data: bytes, url: str) -> dict[str, MDSShard]:
    """The shards of ``index.json`` ``data`` (read from ``url``) by basename, checked.

    Raises:
        MDSError: a shard of another format, a ``pkl`` column, an unknown encoding.
        CorruptRecordError: the file is not the JSON of an MDS index.
    """
    try:
        shards = json.loads(data)["shards"]
        parsed = [_shard(entry) for entry in shards]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as error:
        reason = f"not an MDS index.json ({type(error).__name__}: {str(error)[:200]})"
        raise CorruptRecordError(url, -1, 0, reason) from None
    for shard in parsed:
        for name, encoding in zip(shard.names, shard.encodings):
            check_encoding(name, encoding, f"{url} ({shard.basename})")
    return {shard.basename: shard for shard in parsed}


def _shard(entry: dict[str, Any]) -> MDSShard:
    if entry.get("format") != "mds":
        raise ValueError(f"a shard of format {entry.get('format')!r}; shardkit reads 'mds' shards")
    raw, zipped = entry["raw_data"], entry.get("zip_data")
    stored = zipped or raw
    compression = entry.get("compression")
    return MDSShard(
        str(stored["basename"]),
        _count(entry["samples"]),
        _count(stored["bytes"]),
        _count(raw["bytes"]),
        str(compression).split(":")[0] if zipped else None,
        tuple(map(str, entry["column_names"])),
        tuple(map(str, entry["column_encodings"])),
        tuple(None if s is None else _count(s) for s in entry["column_sizes"]),
    )


def _count(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def check_encoding(name: str, encoding: str, where: str) -> None:
    """Raise :class:`MDSError` for a column shardkit will not decode (``pkl``) or does not know."""
    kind = encoding.split(":")[0]
    if kind == "pkl":
        raise MDSError(
            f"{where}: column {name!r} is pkl-encoded; shardkit does not unpickle (it would run code from the "
            "file): re-write the column with a json, bytes or ndarray encoding"
        )
    if kind not in _SCALARS and kind not in _TEXT and kind not in ("int", "bytes", "json", "ndarray", *_IMAGES):
        raise MDSError(f"{where}: column {name!r} has the encoding {encoding!r}, which is not an MDS encoding")


def decode_column(encoding: str, data: bytes | memoryview) -> Any:
    """One column's value from its bytes, as Mosaic's ``mds_decode`` returns it (images: their bytes).

    Raises:
        ValueError: bytes that do not fit the encoding.
    """
    kind, _, config = encoding.partition(":")
    if kind == "bytes" or kind in _IMAGES:
        return bytes(data)
    if kind in _TEXT:
        return _TEXT[kind](bytes(data).decode("utf-8"))
    if kind == "int":
        return int(_exact(data, np.dtype(np.int64)))
    if kind in _SCALARS:
        return _exact(data, _SCALARS[kind])
    if kind == "json":
        return json.loads(bytes(data).decode("utf-8"))
    if kind == "ndarray":
        return _ndarray(config, data)
    raise ValueError(f"no MDS encoding {encoding!r}")


def _exact(data: bytes | memoryview, dtype: np.dtype) -> Any:
    if len(data) != dtype.itemsize:
        raise ValueError(f"{len(data)} bytes for a {dtype} scalar")
    return np.frombuffer(data, dtype)[0]


def _ndarray(config: str, data: bytes | memoryview) -> np.ndarray:
    args = config.split(":") if config else []
    at = 0
    if args:
        dtype = np.dtype(args[0])
    else:
        dtype, at = np.dtype(_VALUE_DTYPES[data[0]]), 1  # KeyError (a ValueError's kin): caught as bad bytes
    if len(args) == 2:
        shape = tuple(map(int, args[1].split(",")))
    else:
        byte = data[at]
        ndim, shape_dtype = byte >> 2, np.dtype(_SHAPE_DTYPES[byte % 4])
        shape = tuple(int(d) for d in np.frombuffer(data, shape_dtype, ndim, at + 1))
        at += 1 + ndim * shape_dtype.itemsize
    values = len(data) - at
    if values != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ValueError(f"{values} value bytes for a {dtype} array of shape {shape}")
    return np.frombuffer(data, dtype, offset=at).reshape(shape)


def dataset_shards(
    root: str, storage_options: dict[str, Any] | None = None, remote: RemoteOptions | None = None
) -> tuple[list[str], list[int]]:
    """The shard urls of the MDS dataset at ``root`` (a directory holding ``index.json``) and their counts."""
    base = root.rstrip("/")
    with open_raw(f"{base}/{INDEX}", "rb", storage_options, remote=remote) as f:
        shards = parse_index(f.read(), f"{base}/{INDEX}")
    return [f"{base}/{name}" for name in shards], [s.samples for s in shards.values()]


class MDSFormat(FormatBase):
    """Mosaic Streaming MDS shards as a :class:`~shardkit.formats.base.ShardFormat`: a record is a sample dict.

    A shard url is a ``shard.NNNNN.mds[.zstd]`` file with its dataset's ``index.json``
    beside it (in the directory above, for a split's shards listed as ``split/shard...``).

    Args:
        storage_options: fsspec options.
        remote: how remote shards are read (:class:`~shardkit.io.remote.RemoteOptions`).
    """

    name = "mds"
    suffixes = (".mds.zstd", ".mds.gz", ".mds.bz2", ".mds.br", ".mds.snappy", ".mds")

    def __init__(self, *, storage_options: dict[str, Any] | None = None, remote: RemoteOptions | None = None) -> None:
        self.storage_options = storage_options
        self.remote = remote
        self._indexes: ProcessCache[dict[str, MDSShard]] = ProcessCache(INDEX_CACHE)
        self._inflated: ProcessCache[bytes] = ProcessCache(INFLATED_CACHE_BYTES, len)

    def __repr__(self) -> str:
        return "MDSFormat()"

    def sniff(self, head: bytes) -> bool:
        """MDS shards have no magic: known by their suffix alone."""
        return False

    # -- the index

    def shard(self, url: str) -> MDSShard:
        """What the dataset's ``index.json`` says of the shard at ``url`` (read once per directory per process).

        Raises:
            FileNotFoundError: no ``index.json`` beside the shard (nor one directory up).
            CorruptRecordError: the index does not list this shard.
        """
        directory, name = posixpath.split(url)
        for root, key in (
            (directory, name),
            (posixpath.dirname(directory), posixpath.basename(directory) + "/" + name),
        ):
            shards = self._index(root)
            if shards is not None and key in shards:
                return shards[key]
            if shards is not None:
                reason = f"its dataset's {root}/{INDEX} does not list it (a shard of another dataset, or a stale index)"
                raise CorruptRecordError(url, 0, -1, reason)
        raise FileNotFoundError(
            f"{url}: no {INDEX} beside it; an MDS dataset is a directory with {INDEX} and its shards"
        )

    def _index(self, root: str) -> dict[str, MDSShard] | None:
        try:
            return self._indexes.get(root, lambda: self._read_index(root))
        except FileNotFoundError:
            return None  # not kept: an index written later is found

    def _read_index(self, root: str) -> dict[str, MDSShard]:
        with open_raw(f"{root}/{INDEX}", "rb", self.storage_options, remote=self.remote) as f:
            data = f.read()
        return parse_index(data, f"{root}/{INDEX}")

    def stored_count(self, url: str) -> int:
        """Samples in the shard at ``url``, from ``index.json`` (held to the file when it is read)."""
        return self.shard(url).samples

    def count(self, url: str) -> int:
        return self.stored_count(url)

    def build_index(self, url: str) -> str | None:
        """``index.json`` is the index: none to build."""
        return None

    # -- reading

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Samples ``[start, stop)`` of the shard at ``url`` as dicts; a bad sample raises after those before it."""
        _check_range(start, stop)
        return _raising(self._samples(url, start, stop))

    def read_marked(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """:meth:`read` with a :class:`~shardkit.formats.base.BadRecord` in place of a sample that does not decode."""
        _check_range(start, stop)
        return self._samples(url, start, stop)

    def _samples(self, url: str, start: int, stop: int | None) -> Iterator[Any]:
        shard = self.shard(url)
        stop = shard.samples if stop is None else min(stop, shard.samples)
        if start >= stop:
            return
        if shard.compression is None:
            with open_raw(url, "rb", self.storage_options, remote=self.remote) as f:
                size = f.seek(0, 2)
                _check_size(url, shard, size, start, "file")
                view = _Ranged(f)
                offsets = _offsets(url, shard, view, size, start, stop)
                data = view.read(int(offsets[0]), int(offsets[-1] - offsets[0]))
        else:
            raw = self._inflate(url, shard, start)
            offsets = _offsets(url, shard, _Ranged(raw), len(raw), start, stop)
            data = memoryview(raw)[int(offsets[0]) : int(offsets[-1])]
        yield from _decoded(url, shard, data, offsets, start)

    def _inflate(self, url: str, shard: MDSShard, start: int) -> bytes:
        """The uncompressed layout of the compressed shard ``url``, checked against the index, cached
        under the file's identity (a file replaced since is read again)."""
        fs, path = fsspec.core.url_to_fs(url, **(self.storage_options or {}))
        key = (url, version(retried_call(fs, "info", path, retry=self.remote.retry if self.remote else None)))
        return self._inflated.get(key, lambda: self._inflate_now(url, shard, start))

    def _inflate_now(self, url: str, shard: MDSShard, start: int) -> bytes:
        with open_raw(url, "rb", self.storage_options, remote=self.remote) as f:
            stored = f.read()
        _check_size(url, shard, len(stored), start, "compressed file")
        try:
            raw = _decompressor(shard.compression, url)(stored)
        except MDSError:
            raise
        except Exception as error:  # each library has its own error for a damaged stream
            reason = f"its {shard.compression} stream does not inflate ({type(error).__name__}: {str(error)[:200]})"
            raise CorruptRecordError(url, start, -1, reason) from None
        _check_size(url, shard, len(raw), start, f"inflated {shard.compression} stream", expected=shard.raw_size)
        return raw


class _Ranged:
    """Reads at an offset from a file object or from bytes."""

    def __init__(self, source: Any) -> None:
        self._source = source

    def read(self, offset: int, size: int) -> bytes:
        if isinstance(self._source, (bytes, bytearray)):
            return bytes(self._source[offset : offset + size])
        self._source.seek(offset)
        return bytes(self._source.read(size))


def _check_size(url: str, shard: MDSShard, size: int, start: int, what: str, expected: int | None = None) -> None:
    want = shard.size if expected is None else expected
    if size != want:
        reason = (
            f"the {what} has {size} bytes but index.json says {want}: it is truncated, replaced, or the index is "
            "stale; re-write the dataset or its index"
        )
        raise CorruptRecordError(url, start, min(size, want), reason)


def _offsets(url: str, shard: MDSShard, view: _Ranged, size: int, start: int, stop: int) -> np.ndarray:
    """Offsets ``start..stop`` (inclusive) of the shard's table, checked against its header, size and each other."""
    head = view.read(0, 4)
    count = int.from_bytes(head, "little") if len(head) == 4 else -1
    if count != shard.samples:
        reason = f"its header counts {count} samples but index.json says {shard.samples}: the index is stale"
        raise CorruptRecordError(url, start, 0, reason)
    table = view.read(4 + 4 * start, 4 * (stop - start + 1))
    offsets = np.frombuffer(table, "<u4").astype(np.int64)
    first_data = 4 + 4 * (count + 1)
    bad = np.flatnonzero((offsets < first_data) | (offsets > size) | (np.diff(offsets, prepend=offsets[0]) < 0))
    if len(offsets) != stop - start + 1 or bad.size:
        at = start + (int(bad[0]) if bad.size else len(offsets))
        reason = f"the offset of sample {at} in its table is out of order or past the file's {size} bytes"
        raise CorruptRecordError(url, max(at - 1, start), 4 + 4 * at, reason)
    return offsets


def _decoded(url: str, shard: MDSShard, data: bytes | memoryview, offsets: np.ndarray, start: int) -> Iterator[Any]:
    base = int(offsets[0])
    view = memoryview(data)
    for i in range(len(offsets) - 1):
        a, b = int(offsets[i]) - base, int(offsets[i + 1]) - base
        try:
            yield _sample(shard, view[a:b])
        except (ValueError, KeyError, IndexError, UnicodeDecodeError, RecursionError) as error:
            reason = f"the sample does not decode ({type(error).__name__}: {str(error)[:200]})"
            yield BadRecord(CorruptRecordError(url, start + i, a + base, reason, framing_intact=True))


def _sample(shard: MDSShard, data: memoryview) -> dict[str, Any]:
    variable = sum(1 for s in shard.sizes if s is None)
    head = np.frombuffer(data, "<u4", variable) if variable else ()
    sizes, k = [], 0
    for size in shard.sizes:
        if size is None:
            size, k = int(head[k]), k + 1
        sizes.append(size)
    at = 4 * variable
    if at + sum(sizes) != len(data):
        raise ValueError(f"its column sizes add up to {at + sum(sizes)} bytes, but the sample has {len(data)}")
    sample = {}
    for name, encoding, size in zip(shard.names, shard.encodings, sizes):
        sample[name] = decode_column(encoding, data[at : at + size])
        at += size
    return sample


def _decompressor(compression: str | None, url: str) -> Callable[[bytes], bytes]:
    if compression == "zstd":
        import zstandard

        return lambda data: zstandard.ZstdDecompressor().decompressobj().decompress(data)
    if compression == "gz":
        return gzip.decompress
    if compression == "bz2":
        return bz2.decompress
    if compression in ("br", "snappy"):
        package = {"br": "brotli", "snappy": "snappy"}[compression]
        try:
            module = __import__(package)
        except ImportError:
            raise MDSError(f"{url} is {compression}-compressed: install the {package!r} package") from None
        return module.decompress
    raise MDSError(f"{url}: no known MDS compression {compression!r} (zstd, gz, bz2, br, snappy)")


def _check_range(start: int, stop: int | None) -> None:
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")


def _raising(records: Iterator[Any]) -> Iterator[Any]:
    for record in records:
        if record.__class__ is BadRecord:
            raise record.error
        yield record
