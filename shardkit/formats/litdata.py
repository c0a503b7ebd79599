"""LitData optimized datasets, read in place: a shard is one chunk file, its counts from ``index.json``.

``litdata.optimize`` writes a directory of chunk files (``chunk-0-0.bin``, ...)
and an ``index.json`` naming them in order with their item counts
(``chunk_size``), the leaf serializers of a sample (``data_format``) and the
shape of the sample tree (``data_spec``). A chunk is::

    <uint32 n> <uint32 offsets[n + 1]> <items> [<Arrow IPC file> <uint32 len> b"LDARW01\\0"]

Item ``i`` is bytes ``[offsets[i], offsets[i + 1])``: one ``uint32`` size per
leaf, then the leaves, each decoded by its serializer's documented layout
(:data:`LEAVES`). A chunk of JSON-like dicts (ints, floats, strings, lists)
also ends with an Arrow IPC file holding the rows, which LitData's reader
prefers (its items may then be empty): so does this one, reading only the
record batches a range overlaps. A ``TokensLoader`` dataset's items are bare
token arrays laid end to end: each is a record ``{"input_ids": array}`` (what
:class:`~shardkit.TokenDataset` yields, so ``.pack`` applies), or with
``block_size=b`` a record is a block of ``b`` tokens of one chunk, as
``TokensLoader(block_size=b)`` cuts them (``dim // b`` per chunk, the rest of a
chunk dropped).

Counts come from ``index.json`` (no pass over the chunks) and are checked when
a chunk is read: a header count that disagrees, offsets that go backwards or
past the file's end, a footer that is cut off or holds another number of rows
are :class:`~shardkit.CorruptRecordError` with the chunk's url, the record and
the byte offset (``framing_intact`` false: under ``on_error="skip"`` the rest of
the range is skipped and counted); an item whose leaf sizes do not add up to
its length costs itself alone.

Nothing loaded runs code: a ``pickle`` leaf (LitData's fallback for any other
Python object) is refused when the index is read, as are encrypted chunks and
the in-file zstd frames (``compression_level="batch"``/``"sample"``); whole-chunk
zstd (``.zstd.bin``, ``compression_level="chunk"``) is inflated with
``zstandard``. The sample tree is rebuilt from its JSON (dicts, lists, tuples),
never by importing the types it names.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, NamedTuple

import fsspec
import numpy as np

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.base import BadRecord, FormatBase, FormatError
from shardkit.io.files import open_raw
from shardkit.io.remote import RemoteOptions

__all__ = ["INDEX_NAME", "LEAVES", "LitDataFormat", "LitDataIndex", "chunk_urls", "parse_index"]

INDEX_NAME: Final = "index.json"
FOOTER_MAGIC: Final = b"LDARW01\0"
FOOTER_ROWS: Final = 256
"""Rows per record batch of a chunk's Arrow footer, as LitData writes it (it reads batch ``i // 256``)."""

NUMPY_DTYPES: Final = (
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bool",
)  # fmt: skip
"""LitData's numpy dtype codes (``_NUMPY_DTYPES_MAPPING``): the code is the position; object,
bytes, str and void (14..17) are not plain data and are refused."""

TORCH_DTYPES: Final = (
    "float32", "float32", "float64", "float64", "complex64", "complex64", "complex128", "complex128",
    "float16", "float16", "bfloat16", "uint8", "int8", "int16", "int16", "int32", "int32", "int64",
    "int64", "bool", "uint16",
)  # fmt: skip
"""LitData's torch dtype codes (``_TORCH_DTYPES_MAPPING``), by position, as torch dtype names."""

LEAVES: Final = ("int", "float", "bool", "str", "text", "bytes", "numpy", "no_header_numpy", "tensor",
                 "no_header_tensor", "pil", "jpeg", "image", "json")  # fmt: skip
"""The LitData serializers read here (a ``data_format`` entry's name before any ``:``). A ``json`` leaf
(a list or dict in a sample) is read from the chunk's Arrow footer, which LitData writes beside it."""

INDEX_CACHE: Final = 64
"""Parsed ``index.json`` files kept per process."""


class LitDataIndex(NamedTuple):
    """A checked ``index.json``: the chunks in order and how their items decode."""

    url: str
    filenames: tuple[str, ...]
    items: tuple[int, ...]
    tokens: tuple[int | None, ...]
    leaves: tuple[str, ...]
    spec: Any
    compression: str | None
    tokens_loader: bool

    def chunk(self, url: str) -> int:
        """The position of the chunk file ``url`` in the index."""
        name = posixpath.basename(url)
        try:
            return self.filenames.index(name)
        except ValueError:
            raise FileNotFoundError(
                f"{url}: {self.url} names no chunk {name!r} (a chunk of another dataset?)"
            ) from None


def index_url(chunk: str) -> str:
    """The ``index.json`` beside the chunk file ``chunk``."""
    return posixpath.join(posixpath.dirname(chunk), INDEX_NAME)


def chunk_urls(index: LitDataIndex) -> list[str]:
    """The urls of ``index``'s chunk files, in its order."""
    directory = posixpath.dirname(index.url)
    return [posixpath.join(directory, name) for name in index.filenames]


def parse_index(data: bytes, url: str) -> LitDataIndex:
    """``index.json``'s bytes, checked: every chunk with a count, leaves this reader decodes, no pickle.

    Raises:
        ShardkitError: the file is not a LitData index, or its samples cannot be read without running code.
    """
    try:
        doc = json.loads(data)
        chunks, config = doc["chunks"], doc["config"]
        filenames = tuple(str(c["filename"]) for c in chunks)
        items = tuple(_count(c["chunk_size"]) for c in chunks)
        tokens = tuple(None if c.get("dim") is None else _count(c["dim"]) for c in chunks)
        leaves = tuple(str(f) for f in config["data_format"] or ())
    except (ValueError, KeyError, TypeError) as error:
        raise ShardkitError(f"{url} is not a LitData index ({type(error).__name__}: {error})") from None
    if any("/" in f or f in ("", ".", "..") for f in filenames):
        raise ShardkitError(f"{url} names a chunk outside its directory: {filenames}")
    _check_config(config, leaves, url)
    tokens_loader = config.get("item_loader") == "TokensLoader"
    spec = _parse_spec(config.get("data_spec"), url)
    if not tokens_loader and _leaf_count(spec) != len(leaves):
        raise ShardkitError(f"{url}: its data_spec has {_leaf_count(spec)} leaves, its data_format {len(leaves)}")
    if tokens_loader and (len(leaves) != 1 or leaves[0].split(":")[0] not in ("no_header_numpy", "no_header_tensor")):
        raise ShardkitError(f"{url}: a TokensLoader dataset holds one token array per item, not {list(leaves)}")
    return LitDataIndex(url, filenames, items, tokens, leaves, spec, config.get("compression"), tokens_loader)


def _count(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 1 << 32:
        raise ValueError(f"a count must be an int in [0, 2**32), got {value!r}")
    return value


def _check_config(config: dict[str, Any], leaves: tuple[str, ...], url: str) -> None:
    """Refuse what cannot be read without running code, or is not read here, naming it and the way out."""
    names = [leaf.split(":")[0] for leaf in leaves]
    if "pickle" in names:
        raise ShardkitError(
            f"{url}: leaf {names.index('pickle')} of its samples is pickled (LitData's fallback for objects it has "
            "no serializer for); unpickling runs code, so shardkit does not: optimize those values as ints, "
            "floats, strings, bytes or arrays"
        )
    unknown = sorted(set(names) - set(LEAVES))
    if unknown:
        raise ShardkitError(f"{url}: serializers {unknown} are not read by shardkit; it reads {list(LEAVES)}")
    if config.get("encryption"):
        raise ShardkitError(f"{url}: its chunks are encrypted; shardkit reads unencrypted LitData chunks")
    level = config.get("compression_level")
    if config.get("compression") not in (None, "zstd") or (config.get("compression") and level not in (None, "chunk")):
        raise ShardkitError(
            f"{url}: compression {config.get('compression')!r} at level {level!r} is not read by shardkit; "
            "it reads uncompressed chunks and whole-chunk zstd (optimize with compression_level='chunk')"
        )


# --------------------------------------------------------------------------- the sample tree


def _parse_spec(text: Any, url: str) -> Any:
    """``data_spec`` (LitData's pytree JSON) as nested ``("dict", keys, children)``, ``("list"|"tuple", None,
    children)`` or None for a leaf."""
    if text is None:
        return None
    try:
        protocol, schema = json.loads(text)
        if protocol != 1:
            raise ValueError(f"pytree protocol {protocol}, not 1")
        return _node(schema, 0)
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ShardkitError(f"{url}: its data_spec cannot be read ({type(error).__name__}: {error})") from None


_KINDS: Final = {
    "builtins.dict": "dict",
    "collections.OrderedDict": "dict",
    "builtins.list": "list",
    "builtins.tuple": "tuple",
}


def _node(schema: dict[str, Any], depth: int) -> Any:
    if depth > 64:
        raise ValueError("the sample tree is nested more than 64 deep")
    kind = schema["type"]
    if kind is None:
        return None
    if kind not in _KINDS:
        raise ValueError(f"a {kind} in the sample tree: shardkit rebuilds dicts, lists and tuples only")
    children = [_node(child, depth + 1) for child in schema["children_spec"]]
    keys = json.loads(schema["context"]) if _KINDS[kind] == "dict" else None
    if keys is not None and (not isinstance(keys, list) or len(keys) != len(children)):
        raise ValueError(f"a dict of {len(children)} values has keys {keys!r}")
    return (_KINDS[kind], keys, children)


def _leaf_count(spec: Any) -> int:
    return 1 if spec is None else sum(_leaf_count(child) for child in spec[2])


def _build(spec: Any, leaves: Iterator[Any]) -> Any:
    if spec is None:
        return next(leaves)
    kind, keys, children = spec
    values = [_build(child, leaves) for child in children]
    if kind == "dict":
        return dict(zip(keys, values))
    return values if kind == "list" else tuple(values)


def builder(spec: Any) -> Callable[[list[Any]], Any]:
    """``build(leaves)``: the sample tree of ``spec`` around its decoded leaves; a flat dict (the usual
    sample) without walking the tree."""
    if spec is None:
        return lambda leaves: leaves[0]
    kind, keys, children = spec
    if kind == "dict" and all(child is None for child in children):
        return lambda leaves: dict(zip(keys, leaves))
    return lambda leaves: _build(spec, iter(leaves))


# --------------------------------------------------------------------------- leaves


def _torch_dtype(code: int) -> Any:
    import torch

    return getattr(torch, TORCH_DTYPES[code])


def _numpy_dtype(code: int) -> np.dtype:
    return np.dtype(NUMPY_DTYPES[code])


def _array(data: memoryview, dtype: Any, shape: Sequence[int]) -> np.ndarray:
    count = math.prod(shape)
    if count * dtype.itemsize != len(data):
        raise ValueError(f"{len(data)} bytes do not hold {tuple(shape)} of {dtype}")
    return np.frombuffer(data, dtype=dtype, count=count).reshape(shape).copy()


def _numpy(data: memoryview) -> np.ndarray:
    code, ndim = struct.unpack_from("<II", data)
    shape = struct.unpack_from(f"<{ndim}I", data, 8)
    return _array(data[8 + 4 * ndim :], _numpy_dtype(code), shape)


def _tensor(data: memoryview) -> Any:
    import torch

    code, ndim = struct.unpack_from(">II", data)
    shape = struct.unpack_from(f">{ndim}I", data, 8)
    dtype = _torch_dtype(code)
    return (
        _torch_of(data[8 + 4 * ndim :], dtype, shape) if len(data) > 8 + 4 * ndim else torch.empty(shape, dtype=dtype)
    )


def _torch_of(data: memoryview, dtype: Any, shape: Sequence[int]) -> Any:
    import torch

    if not len(data):  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype).reshape(tuple(shape))
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(tuple(shape))


def _pil(data: memoryview) -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ShardkitError(
            "this LitData dataset holds PIL images: reading them needs Pillow (pip install pillow)"
        ) from None
    width, height, size = struct.unpack_from("<III", data)
    mode = bytes(data[12 : 12 + size]).decode("utf-8")
    return Image.frombytes(mode, (width, height), bytes(data[12 + size :]))


def _decoded_image(data: memoryview) -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ShardkitError("images='pil' decodes images with Pillow: pip install pillow") from None
    import io

    image = Image.open(io.BytesIO(bytes(data)))
    image.load()
    return image


def leaf_decoder(leaf: str, images: str) -> Callable[[memoryview], Any]:
    """How a leaf of the ``data_format`` entry ``leaf`` decodes from its bytes."""
    name, _, arg = leaf.partition(":")
    simple: dict[str, Callable[[memoryview], Any]] = {
        "int": lambda b: struct.unpack("<q", b)[0],
        "float": lambda b: struct.unpack("<d", b)[0],
        "bool": lambda b: b[0] != 0,
        "str": lambda b: bytes(b).decode("utf-8"),
        "text": lambda b: bytes(b).decode("utf-8"),
        "bytes": bytes,
        "numpy": _numpy,
        "tensor": _tensor,
        "pil": _pil,
        "jpeg": _decoded_image if images == "pil" else bytes,
        "image": _decoded_image if images == "pil" else bytes,
    }
    if name in simple:
        return simple[name]
    if name == "no_header_numpy":
        dtype = _numpy_dtype(int(arg))
        return lambda b: _array(b, dtype, (len(b) // dtype.itemsize,))
    if name == "no_header_tensor":
        dtype = _torch_dtype(int(arg))
        return lambda b: _torch_of(b, dtype, (-1,))
    if name == "json":
        return _no_footer
    raise ShardkitError(f"no decoder for LitData leaf {leaf!r}")


def _no_footer(data: memoryview) -> Any:
    raise ValueError("a json leaf is read from the chunk's Arrow footer, and this chunk has none")


# --------------------------------------------------------------------------- the format


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
        self._indexes: OrderedDict[tuple[Any, ...], LitDataIndex] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_indexes", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._indexes, self._lock = OrderedDict(), threading.Lock()

    def __repr__(self) -> str:
        return f"LitDataFormat(images={self.images!r}, block_size={self.block_size!r})"

    def sniff(self, head: bytes) -> bool:
        return False  # a chunk has no magic; the CLI reads a dataset by its directory

    def index(self, url: str) -> LitDataIndex:
        """The checked ``index.json`` of the dataset whose chunk (or directory, or index) is ``url``."""
        where = url if url.endswith(INDEX_NAME) else index_url(url)
        fs, path = fsspec.core.url_to_fs(where, **(self.storage_options or {}))
        key = (where, *_local_identity(path)) if "file" in _protocols(fs) else (where,)
        with self._lock:
            if key in self._indexes:
                self._indexes.move_to_end(key)
                return self._indexes[key]
        try:
            with open_raw(where, "rb", self.storage_options, remote=self.remote) as f:
                data = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{where} does not exist: a LitData dataset is a directory of chunks with the index.json "
                "litdata.optimize writes"
            ) from None
        parsed = parse_index(data, where)
        with self._lock:
            self._indexes[key] = parsed
            while len(self._indexes) > INDEX_CACHE:
                self._indexes.popitem(last=False)
        return parsed

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
                except (ValueError, struct.error, IndexError, UnicodeDecodeError, OverflowError) as error:
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
        dtype = _numpy_dtype(int(code)) if name == "no_header_numpy" else np.dtype(TORCH_DTYPES[int(code)])
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
                yield _torch_of(data, _torch_dtype(int(code)), (-1,))

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
