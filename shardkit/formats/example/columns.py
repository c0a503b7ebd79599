"""Fixed-shape features of many tf.Example records decoded into columns, as ``tf.io.parse_example`` does.

:func:`decode_columns` fills one array per feature for a block of records,
without a dict per record; :class:`ColumnBatches` does it batch by batch over
a source's records, and :class:`FeatureCheck` checks one record against the
features, so that a record that does not fit is a bad record of its own.
The compiled backend fills the arrays in C; the pure-Python path decodes
each record and copies its values, with the same checks and messages.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Optional

import numpy as np

from shardkit.errors import ShardkitError
from shardkit.formats.example.backend import COMPILED
from shardkit.formats.example.wire import KIND_BYTES, KIND_FLOAT, KIND_INT64, BytesLike, Value, decode_example_python

__all__ = ["ColumnBatches", "FeatureCheck", "FeatureSpec", "decode_columns"]

FeatureSpec = tuple[str, tuple[int, ...]]
"""A fixed-shape feature for :func:`decode_columns`: ``(dtype, shape)``, dtype ``"int64"``, ``"float32"`` or ``"bytes"``."""

_KINDS: Final = {"int64": KIND_INT64, "float32": KIND_FLOAT, "bytes": KIND_BYTES}
_KIND_NAMES: Final = {kind: name for name, kind in _KINDS.items()}
_DTYPES: Final = {KIND_INT64: np.int64, KIND_FLOAT: np.float32, KIND_BYTES: np.int64}  # bytes: their int64 offsets


@dataclass(frozen=True)
class _Column:
    """One requested feature: its name, kind (Feature member tag), shape and values per record."""

    name: str
    kind: int
    shape: tuple[int, ...]
    size: int


def _columns(features: Mapping[str, FeatureSpec]) -> list[_Column]:
    """Check a ``features`` mapping of :func:`decode_columns` and normalise it."""
    out = []
    for name, spec in features.items():
        dtype, shape = spec if isinstance(spec, tuple) and len(spec) == 2 else (spec, None)
        if not isinstance(name, str):
            raise ValueError(f"feature names are str, as decode_example's keys are: got {name!r}")
        if dtype not in _KINDS or not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(
                f"feature {name!r}: expected (dtype, shape) with dtype one of {sorted(_KINDS)} and shape a tuple of"
                f' sizes, e.g. ("int64", ()) or ("float32", (3,)); got {spec!r}'
            )
        if dtype == "bytes" and (len(shape) > 1 or shape == (0,)):
            raise ValueError(f"feature {name!r}: bytes take shape () or (k,) with k >= 1, not {shape!r}")
        out.append(_Column(name, _KINDS[dtype], shape, int(np.prod(shape, dtype=np.int64))))
    return out


def decode_columns(records: Sequence[BytesLike], features: Mapping[str, FeatureSpec]) -> dict[str, Any]:
    """Decode fixed-shape features of many serialized ``tf.train.Example`` s into columns, as ``tf.io.parse_example`` does.

    ``features`` maps names to ``(dtype, shape)``: an ``"int64"`` or ``"float32"``
    feature becomes a numpy array of shape ``(len(records), *shape)``; a
    ``"bytes"`` feature of shape ``()`` a ``pyarrow.LargeBinaryArray`` of one
    value per record (one buffer and offsets, no per-record objects), of shape
    ``(k,)`` a ``pyarrow.FixedSizeListArray`` of ``k`` values per record. Values
    are exactly those of :func:`decode_example`; a Feature with no values fits
    a shape of size 0 whatever its kind. Other features are validated and skipped.

    Raises :class:`~shardkit.ShardkitError` naming the record (its index in
    ``records``) and the feature when a record is malformed, lacks a feature,
    or holds another kind or number of values.

    Example:
        >>> import shardkit
        >>> records = [shardkit.encode_example({"label": i, "xy": [i / 2, -i / 2], "id": b"r%d" % i}) for i in range(3)]
        >>> columns = shardkit.decode_columns(records, {"label": ("int64", ()), "xy": ("float32", (2,)), "id": ("bytes", ())})
        >>> columns["label"], columns["xy"][2], columns["id"].to_pylist()
        (array([0, 1, 2]), array([ 1., -1.], dtype=float32), [b'r0', b'r1', b'r2'])
    """
    return _decode_columns(records, features, COMPILED)


def _decode_columns(records: Sequence[BytesLike], features: Mapping[str, FeatureSpec], compiled: Any) -> dict[str, Any]:
    """:func:`decode_columns` with the compiled module ``compiled``, or in Python if it is ``None``."""
    columns = _columns(features)
    n = len(records)
    outs = tuple(
        np.empty((n * c.size + 1,) if c.kind == KIND_BYTES else (n, *c.shape), dtype=_DTYPES[c.kind]) for c in columns
    )
    if compiled is not None:
        names, kinds, sizes, shapes = (tuple(getattr(c, k) for c in columns) for k in ("name", "kind", "size", "shape"))
        datas = compiled.decode_columns(records, names, kinds, sizes, shapes, outs)
    else:
        datas = _decode_columns_python(records, columns, outs)
    return {c.name: _column_value(c, out, data) for c, out, data in zip(columns, outs, datas)}


class ColumnBatches:
    """An iterator of :func:`decode_columns` batches of ``batch_size`` records drawn from ``records``.

    The last batch is shorter if the records run out. A batch is drawn and
    decoded in one step, so no partial batch is ever pending: where the
    records' iterator has a ``state_dict()`` (a shardkit source's), this one's
    is the same, and resuming from it starts at the next batch's first record.
    """

    def __init__(self, records: Iterator[BytesLike], features: Mapping[str, FeatureSpec], batch_size: int) -> None:
        _columns(features)  # a bad spec fails here, not at the first batch
        self._records = records
        self._features = dict(features)
        self._batch_size = batch_size

    def __iter__(self) -> ColumnBatches:
        return self

    def __next__(self) -> dict[str, Any]:
        block = list(itertools.islice(self._records, self._batch_size))
        if not block:
            raise StopIteration
        return decode_columns(block, self._features)

    def state_dict(self) -> Any:
        return self._records.state_dict()  # pyright: ignore[reportAttributeAccessIssue]


class FeatureCheck:
    """A record reader's ``decode`` that returns each record as it is after checking that it
    fits ``features`` (:func:`decode_columns` of the record alone; raises like it).

    ``TFRecordDataset(features=..., on_error="skip")`` reads with it, so that a record that
    does not fit is a bad record of its own, located and skipped like one with a bad CRC,
    instead of failing the whole batch it would land in. It decodes every record once more
    (about a microsecond for small records with the compiled decoder).
    """

    def __init__(self, features: Mapping[str, FeatureSpec]) -> None:
        self._columns = _columns(features)
        self._args = tuple(tuple(getattr(c, k) for c in self._columns) for k in ("name", "kind", "size", "shape"))
        # One record's outputs, written and thrown away by every check.
        self._outs = tuple(
            np.empty((c.size + 1,) if c.kind == KIND_BYTES else (1, *c.shape), dtype=_DTYPES[c.kind])
            for c in self._columns
        )

    def __call__(self, record: BytesLike) -> BytesLike:
        outs = self._outs
        try:
            if COMPILED is not None:
                COMPILED.decode_columns((record,), *self._args, outs)
            else:
                _decode_columns_python((record,), self._columns, outs)
        except ShardkitError as error:  # the batch place ("record 0") means nothing here
            message = str(error).replace(" of record 0", "").replace("record 0: ", "")
            raise ShardkitError(message.replace("record 0 ", "the record ")) from None
        return record

    def __repr__(self) -> str:
        wanted = ", ".join(f"{c.name}: {_KIND_NAMES[c.kind]}{list(c.shape)}" for c in self._columns)
        return f"the features {{{wanted}}}"


def _column_value(column: _Column, out: np.ndarray, data: Optional[bytes]) -> Any:
    if column.kind != KIND_BYTES:
        return out
    import pyarrow as pa  # a dependency already; imported here, as decoding single records does not need it

    values = pa.Array.from_buffers(pa.large_binary(), len(out) - 1, [None, pa.py_buffer(out), pa.py_buffer(data)])
    return pa.FixedSizeListArray.from_arrays(values, column.shape[0]) if column.shape else values


def _decode_columns_python(
    records: Sequence[BytesLike], columns: list[_Column], outs: tuple[np.ndarray, ...]
) -> list[Optional[bytes]]:
    datas = [bytearray() if c.kind == KIND_BYTES else None for c in columns]
    for out, c in zip(outs, columns):
        if c.kind == KIND_BYTES:
            out[0] = 0
    for i, record in enumerate(records):
        try:
            decoded = decode_example_python(record)
        except ShardkitError as exc:
            raise ShardkitError(f"record {i}: {exc}") from None
        for c, out, data in zip(columns, outs, datas):
            values = _column_values(decoded, c, i)
            if data is not None:
                for j, value in enumerate(values):
                    data += value
                    out[i * c.size + j + 1] = len(data)
            elif c.size:
                out[i] = np.asarray(values).reshape(c.shape)
    return [bytes(data) if data is not None else None for data in datas]


def _column_values(decoded: dict[str, Value], column: _Column, i: int) -> Value:
    """Record ``i``'s value of ``column``, checked to be of its kind and size."""
    name, want = column.name, _KIND_NAMES[column.kind]
    if name not in decoded:
        raise ShardkitError(f"record {i} has no feature {name!r} (wanted: {want} of shape {column.shape!r})")
    value = decoded[name]
    kind = "bytes" if isinstance(value, list) else "int64" if value.dtype == np.int64 else "float32"
    if len(value) and kind != want:
        raise ShardkitError(
            f"feature {name!r} of record {i} holds {kind} values, expected {want} of shape {column.shape!r}"
        )
    if len(value) != column.size:
        raise ShardkitError(
            f"feature {name!r} of record {i} has {len(value)} values, expected {column.size} for {want} of shape {column.shape!r}"
        )
    return value
