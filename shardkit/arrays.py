"""pyarrow columns as numpy arrays, read from their buffers.

pyarrow imports pandas, when it is installed, the first time a process converts
between Arrow and Python or numpy (``pa.array``, ``to_numpy``, a Python scalar
handed to a compute function): 44 MiB and 0.3-0.9 s in each such process, every
spawned DataLoader worker included. What a worker needs of its shard list as
numpy is integer columns and which entries are null, and both are plain buffers
(values, and a validity bitmap of one bit per entry, least significant first):
these functions read them as such. They are duck-typed (``.chunks``,
``.buffers()``, ``.type``), so the pure planning layer uses them without
importing pyarrow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["int64_values", "valid_mask"]


def valid_mask(column: Any) -> np.ndarray:
    """A bool array, True where ``column`` (a pyarrow Array or ChunkedArray) holds a value, False where null."""
    parts = [_chunk_valid(chunk) for chunk in _chunks(column)]
    return np.concatenate(parts) if parts else np.empty(0, bool)


def int64_values(column: Any, fill: int = 0) -> np.ndarray:
    """An int64 column's values, ``fill`` where null. A column of one chunk without nulls is
    returned as a read-only view of its buffer (of the mapped file, for a mapped table)."""
    if str(column.type) != "int64":  # not a shard list's column: pyarrow's own conversion
        return np.asarray(column.fill_null(fill).to_numpy(zero_copy_only=False), dtype=np.int64)
    parts = []
    for chunk in _chunks(column):
        if chunk.null_count == len(chunk):  # no value to read (nor, for an empty chunk, a buffer to read it from)
            parts.append(np.full(len(chunk), fill, np.int64))
            continue
        values = np.frombuffer(chunk.buffers()[1], np.int64, count=len(chunk), offset=chunk.offset * 8)
        values.flags.writeable = False  # as pyarrow's zero-copy to_numpy: the column is not changed through it
        if chunk.null_count:
            values = np.where(_chunk_valid(chunk), values, np.int64(fill))
        parts.append(values)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def _chunks(column: Any) -> list[Any]:
    chunks = getattr(column, "chunks", None)  # an Array is its own one chunk
    return [column] if chunks is None else chunks


def _chunk_valid(chunk: Any) -> np.ndarray:
    n = len(chunk)
    if chunk.null_count == 0:
        return np.ones(n, bool)
    if chunk.null_count == n:
        return np.zeros(n, bool)
    start = chunk.offset
    bitmap = np.frombuffer(chunk.buffers()[0], np.uint8, count=(start + n + 7) // 8)
    return np.unpackbits(bitmap, bitorder="little", count=start + n)[start:].astype(bool)
