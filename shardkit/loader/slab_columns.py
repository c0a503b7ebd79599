"""Column batches through :class:`~shardkit.MixedLoader`: whole columns from the
workers to the main process, cut into batches with no per-sample work.

A column batch is what ``TFRecordDataset(features=..., batch_size=...)``
yields (:func:`~shardkit.decode_columns`): a dict of one column per feature,
a numpy array of ``n`` rows for numbers, a ``pyarrow`` binary array (one
values buffer and offsets) for bytes. ``ParquetDataset(batch_size=...)``
yields numpy arrays only, those of strings, bytes and lists of object dtype:
such a *held* column (:func:`held`) has no flat layout for a slab, so it
travels pickled with the message, is cut and joined as a numpy array, and
is saved in a state as the list of its items. Pickling one and handing it over the
way DataLoader does costs as much per batch as the decoding itself, so:

* in the worker, :meth:`SlabRing.put <shardkit.loader.slabs.SlabRing.put>` writes
  each numeric column as is and each bytes column as a ``uint8`` values
  buffer plus ``int64`` offsets (rebased to 0) into a free slab; only the
  layout (:class:`InSlab` / :class:`BinaryInSlab` per column) is pickled;
* the main process views the slab as numpy arrays and :class:`Binary`
  columns (:func:`from_slab`), and :func:`join_columns` cuts an output batch
  from row ranges of several micro-batches with one ``np.concatenate`` per
  column (two for bytes: values and shifted offsets).

The public output form, the same types as ``DataLoader(batch_size=None)``
gives for a column batch: a dict with a ``torch`` tensor per numeric column
(``torch.from_numpy`` of memory of its own) and a ``pyarrow.LargeBinaryArray``
per bytes column (a ``FixedSizeListArray`` of them for shape ``(k,)``).

A micro-batch cut part-way and saved in a loader state travels as plain data
(:func:`plain`, numpy arrays and ints, see :func:`shardkit.state.encode`) and
comes back with :func:`from_plain`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardkit.loader.collate import Part

__all__ = [
    "Binary",
    "BinaryInSlab",
    "as_parts",
    "columns_length",
    "from_plain",
    "held",
    "join_columns",
    "plain",
    "tail",
]


@dataclass(frozen=True, slots=True)
class Binary:
    """A bytes column: item ``i`` is ``values[offsets[i]:offsets[i + 1]]``;
    ``list_size`` items per row (0: one item per row, shape ``()``)."""

    values: np.ndarray  # uint8
    offsets: np.ndarray  # int64, items + 1 of them; need not start at 0
    list_size: int

    def rows(self) -> int:
        return (len(self.offsets) - 1) // max(self.list_size, 1)


@dataclass(frozen=True, slots=True)
class BinaryInSlab:
    """Where a bytes column lies in a slab: its values and its offsets (from 0)."""

    values: Any  # an InSlab (typed Any: slabs imports this module)
    offsets: Any
    list_size: int


def as_parts(batch: Any) -> dict[str, np.ndarray | Binary]:
    """A column batch (numpy arrays, tensors, pyarrow binary arrays) as numpy arrays
    and :class:`Binary` columns, without copying."""
    if not isinstance(batch, Mapping) or not batch:
        raise TypeError(
            f"MixedLoader over a column-batch dataset expects dicts of columns (what decode_columns makes), "
            f"got {type(batch).__name__}"
        )
    parts = {name: _as_part(name, column) for name, column in batch.items()}
    lengths = {len(p) if isinstance(p, np.ndarray) else p.rows() for p in parts.values()}
    if len(lengths) != 1:
        raise ValueError(f"the columns of a column batch differ in length: {sorted(lengths)} rows")
    return parts


def held(column: Any) -> bool:
    """Whether ``column`` is a numpy column of values other than numbers (strings, bytes, lists,
    dates: Parquet batches): it travels with the message, pickled, and comes out as a numpy array."""
    return isinstance(column, np.ndarray) and column.dtype.kind not in "biuf"


def _as_part(name: str, column: Any) -> np.ndarray | Binary:
    if isinstance(column, np.ndarray) and column.ndim == 1 and held(column):
        return column
    if isinstance(column, np.ndarray) and column.dtype.kind in "biuf" and column.ndim >= 1:
        return column
    if isinstance(column, torch.Tensor) and column.ndim >= 1:
        return column.numpy()
    binary = _binary(column)
    if binary is None:
        raise TypeError(
            f"column {name!r} is a {type(column).__name__}; a column batch holds numpy arrays or tensors "
            "of one row per sample (of values other than numbers: one-dimensional), and pyarrow binary arrays "
            "without nulls"
        )
    return binary


def _binary(column: Any) -> Binary | None:
    """A pyarrow (large) binary array, or a fixed-size list of them, as a :class:`Binary`; else None."""
    import pyarrow as pa

    list_size = 0
    if isinstance(column, pa.FixedSizeListArray):
        list_size, column = column.type.list_size, column.flatten()
    if not isinstance(column, (pa.LargeBinaryArray, pa.BinaryArray)) or column.null_count:
        return None
    wide = np.int64 if isinstance(column, pa.LargeBinaryArray) else np.int32
    _, offsets, values = column.buffers()
    offsets = np.frombuffer(offsets, wide)[column.offset : column.offset + len(column) + 1]
    values = np.frombuffer(values, np.uint8) if values is not None else np.zeros(0, np.uint8)
    return Binary(values, offsets.astype(np.int64, copy=False), list_size)


def columns_length(parts: Any) -> int | None:
    """Rows in a column batch of :func:`as_parts` form; None if it is not one."""
    if not isinstance(parts, dict) or not parts:
        return None
    lengths = {
        len(p) if isinstance(p, np.ndarray) else p.rows() if isinstance(p, Binary) else -1 for p in parts.values()
    }
    return lengths.pop() if len(lengths) == 1 and -1 not in lengths else None


def from_slab(skeleton: dict[str, Any], view: Any) -> dict[str, np.ndarray | Binary]:
    """The columns of a slab batch, as numpy views made by ``view(place)``."""
    out: dict[str, np.ndarray | Binary] = {}
    for name, place in skeleton.items():
        if isinstance(place, BinaryInSlab):
            out[name] = Binary(view(place.values).numpy(), view(place.offsets).numpy(), place.list_size)
        elif isinstance(place, np.ndarray):  # a held column came with the message
            out[name] = place
        else:
            out[name] = view(place).numpy()
    return out


def join_columns(parts: list[Part]) -> dict[str, Any]:
    """Rows ``start:stop`` of several column micro-batches, joined into one batch
    of the public form, in memory of its own."""
    return {name: _join([(p[name], a, b) for p, a, b in parts]) for name in parts[0][0]}


def _join(parts: list[Part]) -> Any:
    if isinstance(parts[0][0], Binary):
        values, offsets, list_size = _join_binary(parts)
        return _arrow(values, offsets, list_size)
    joined = np.concatenate([column[a:b] for column, a, b in parts])
    return joined if held(joined) else torch.from_numpy(joined)


def _join_binary(parts: list[Part]) -> tuple[np.ndarray, np.ndarray, int]:
    """Values and offsets (from 0) of rows ``a:b`` of each part, one after another."""
    list_size = parts[0][0].list_size
    k = max(list_size, 1)
    values, offsets = [], [np.zeros(1, np.int64)]
    total = 0
    for column, a, b in parts:
        cut = column.offsets[a * k : b * k + 1]
        low, high = int(cut[0]), int(cut[-1])
        values.append(column.values[low:high])
        offsets.append(cut[1:] + (total - low))
        total += high - low
    return np.concatenate(values), np.concatenate(offsets), list_size


def _arrow(values: np.ndarray, offsets: np.ndarray, list_size: int) -> Any:
    import pyarrow as pa

    items = len(offsets) - 1
    array = pa.Array.from_buffers(pa.large_binary(), items, [None, pa.py_buffer(offsets), pa.py_buffer(values)])
    return pa.FixedSizeListArray.from_arrays(array, list_size) if list_size else array


def tail(parts: dict[str, Any], start: int, stop: int) -> dict[str, np.ndarray | Binary]:
    """Rows ``start:stop`` of a column micro-batch, in memory of their own."""
    out: dict[str, np.ndarray | Binary] = {}
    for name, column in parts.items():
        if isinstance(column, Binary):
            out[name] = Binary(*_join_binary([(column, start, stop)]))
        else:
            out[name] = column[start:stop].copy()
    return out


def plain(parts: dict[str, np.ndarray | Binary]) -> dict[str, Any]:
    """A column micro-batch as plain data for a saved state."""
    return {name: _plain(column) for name, column in parts.items()}


def _plain(column: np.ndarray | Binary) -> Any:
    if isinstance(column, Binary):
        return {"values": column.values, "offsets": column.offsets, "list_size": column.list_size}
    if column.dtype.hasobject:  # a state holds no object arrays: their items, as a list
        return {"objects": list(column)}
    return column


def from_plain(value: Any) -> dict[str, np.ndarray | Binary] | None:
    """:func:`plain`'s inverse; None if ``value`` is not of its form."""
    if not isinstance(value, dict):
        return None
    out: dict[str, np.ndarray | Binary] = {}
    for name, column in value.items():
        if isinstance(column, np.ndarray):
            out[name] = column
            continue
        if isinstance(column, dict) and set(column) == {"objects"} and type(column["objects"]) is list:
            out[name] = _objects(column["objects"])
            continue
        if not (isinstance(column, dict) and set(column) == {"values", "offsets", "list_size"}):
            return None
        values, offsets, list_size = column["values"], column["offsets"], column["list_size"]
        if not (_array_of(values, np.uint8) and _array_of(offsets, np.int64) and type(list_size) is int):
            return None
        k = max(list_size, 1)
        if list_size < 0 or len(offsets) < 1 or (len(offsets) - 1) % k or not _monotone(offsets, len(values)):
            return None
        out[name] = Binary(values, offsets, list_size)
    return out


def _objects(items: list[Any]) -> np.ndarray:
    """A one-dimensional object array of ``items`` (items that are arrays stay items, not a new axis)."""
    array = np.empty(len(items), dtype=object)
    for index, item in enumerate(items):
        array[index] = item
    return array


def _array_of(value: Any, dtype: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == dtype and value.ndim == 1


def _monotone(offsets: np.ndarray, size: int) -> bool:
    return bool(offsets[0] >= 0 and offsets[-1] <= size and np.all(np.diff(offsets) >= 0))
