"""The columns of a shard list and what makes them valid: urls, record counts, byte sizes.

A shard list is a table of one row per shard file: ``url`` (``string``, or
``large_string`` once the urls pass 2 GiB), ``num_records`` and ``size``
(``int64``, null when unknown). Every way of building one (urls given, a glob,
a manifest) goes through these checks, so a bad entry is refused the same way
whatever its source, with an error naming its position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as _compute

from shardkit.arrays import int64_values, valid_mask
from shardkit.errors import ShardkitError

__all__ = [
    "NUM_RECORDS",
    "SIZE",
    "URL",
    "IntColumn",
    "ShardListError",
    "build_table",
    "check_urls",
    "int64_array",
    "int_column",
    "same_values",
    "string_digest",
]

URL = "url"
NUM_RECORDS = "num_records"
SIZE = "size"

#: pyarrow.compute's functions are generated at import time: a type checker sees none of them.
pc: Any = _compute

#: What counts and sizes may be given as: ints and Nones, or an integer array.
IntColumn = Sequence["int | None"] | np.ndarray | pa.Array | pa.ChunkedArray


class ShardListError(ShardkitError, ValueError):
    """Urls, counts, a pattern or a manifest that cannot make a ShardList."""


def build_table(urls: Any, num_records: IntColumn | None, sizes: IntColumn | None) -> pa.Table:
    url_column = _url_column(urls)
    n = len(url_column)
    return pa.table(
        {
            URL: url_column,
            NUM_RECORDS: int_column(num_records, n, NUM_RECORDS),
            SIZE: int_column(sizes, n, "sizes"),
        }
    )


def _url_column(urls: Sequence[str] | pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    if isinstance(urls, (pa.Array, pa.ChunkedArray)):
        column: Any = urls
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise ShardListError(f"urls must be a string array, got type {column.type}")
    elif isinstance(urls, (str, bytes)):
        raise ShardListError("urls must be a sequence of urls, got a single string; wrap it in a list")
    else:
        column = _python_urls(urls if isinstance(urls, Sequence) else list(urls))
    check_urls(column, "urls")
    return column


def _python_urls(urls: Sequence[Any]) -> pa.Array:
    try:
        column = pa.array(urls, type=pa.string())
        if isinstance(column, pa.ChunkedArray):  # more than 2 GiB of url bytes
            column = pa.array(urls, type=pa.large_string())
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        for i, url in enumerate(urls):
            if url is not None and not isinstance(url, str):
                raise ShardListError(f"urls[{i}] is {type(url).__name__}, expected str") from err
        raise ShardListError(f"urls cannot be stored as UTF-8 text: {err}") from err
    return column


def check_urls(column: pa.Array | pa.ChunkedArray, label: str) -> None:
    """Refuse a missing (null) or empty url, naming its position under ``label``.

    No Python scalar is handed to pyarrow (that would import pandas: :mod:`shardkit.arrays`)
    unless a url is bad."""
    if column.null_count:
        missing = int(np.flatnonzero(~valid_mask(column))[0])
        raise ShardListError(f"{label}[{missing}] is missing (None); every shard needs a url")
    lengths = pc.binary_length(column)
    if len(column) and pc.min(lengths).as_py() == 0:
        empty = pc.index(pc.equal(lengths, 0), True).as_py()
        raise ShardListError(f"{label}[{empty}] is an empty string; every shard needs a url")


def string_digest(column: pa.ChunkedArray) -> str:
    """SHA-256 over every string's length (int64) then all the bytes, independent
    of the chunking and of the offsets' width."""
    lengths, data = hashlib.sha256(), hashlib.sha256()
    for chunk in column.chunks:
        if len(chunk) == 0:
            continue
        _, offsets_buffer, values = chunk.buffers()
        width = 8 if pa.types.is_large_string(chunk.type) else 4
        offsets = np.frombuffer(offsets_buffer, f"<i{width}", count=len(chunk) + 1, offset=chunk.offset * width)
        lengths.update(np.diff(offsets).astype("<i8").tobytes())
        if values is not None:
            data.update(memoryview(values)[int(offsets[0]) : int(offsets[-1])])
    return hashlib.sha256(lengths.digest() + data.digest()).hexdigest()


def int_column(values: IntColumn | None, n: int, label: str) -> pa.Array | pa.ChunkedArray:
    """An int64 column of ``n`` non-negative values or nulls."""
    if values is None:
        return pa.nulls(n, pa.int64())
    if isinstance(values, (pa.Array, pa.ChunkedArray, np.ndarray)):
        if isinstance(values, np.ndarray) and values.dtype.kind not in "iu":
            raise ShardListError(f"{label} must hold integers, got dtype {values.dtype}")
        try:
            array: Any = pa.array(values) if isinstance(values, np.ndarray) else values
            column = array.cast(pa.int64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
            raise ShardListError(f"{label} must hold integers that fit in int64: {err}") from err
    else:
        values = values if isinstance(values, Sequence) else list(values)
        try:
            column = pa.array(values, type=pa.int64())
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as err:
            for i, value in enumerate(values):
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                    raise ShardListError(f"{label}[{i}] is {value!r}, expected an int or None") from err
            raise ShardListError(f"{label} must hold integers that fit in int64: {err}") from err
    if len(column) != n:
        raise ShardListError(f"{label} has {len(column)} entries but there are {n} urls")
    negative = pc.index(pc.less(column, 0), True).as_py()
    if negative != -1:
        raise ShardListError(f"{label}[{negative}] is {column[negative].as_py()}; it must be >= 0 or None")
    return column


def int64_array(column: pa.ChunkedArray) -> np.ndarray | None:
    """The column as numpy (a view of the mapped file when it has one chunk),
    or None if any value is null."""
    if column.null_count:
        return None
    return int64_values(column)


def same_values(a: pa.ChunkedArray, b: pa.ChunkedArray) -> bool:
    """Whether two columns hold the same values (string and large_string urls compare by value)."""
    if a.type != b.type:  # string vs large_string urls
        a, b = a.cast(pa.large_string()), b.cast(pa.large_string())
    return a.equals(b)
