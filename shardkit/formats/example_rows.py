"""tf.Example records as Parquet rows, JSON lines and tar samples, and back: what ``shardkit convert
--decode example`` writes and reads.

Each feature becomes one field, its kind kept so that the way back re-encodes
the same record (byte for byte for records as :func:`~shardkit.encode_example`
and TensorFlow write them):

- **Parquet**: one column per feature: ``binary``, ``int64`` or ``float``
  (float32, as in tf.Example); a ``list<...>`` column for a feature that does
  not hold exactly one value in every one of the first records
  (:func:`scalar_features`).
- **JSON lines**: one field per feature: a single value where Parquet would
  have a scalar column (and the record holds one value), else a list; floats
  keep a ``.0``, so they read back as floats; bytes are a string when they
  are UTF-8 text, else ``{"base64": "..."}``.
- **tar**: one member per feature, ``<key>.<name>`` holding the raw bytes of a
  feature with exactly one bytes value, else ``<key>.<name>.<kind>.json`` with
  ``kind`` one of ``int64``, ``float``, ``bytes`` (a JSON list; bytes as
  base64 strings) or ``empty``. Tar readers lowercase member extensions, so
  in ``name`` every character other than ``a-z 0-9 _ -`` is written as
  ``%xx`` (``image/encoded`` -> ``image%2fencoded``).

Not kept: a feature whose value list is empty but typed (``int64_list {}``)
comes back as an empty feature of no kind (Parquet and JSON lines store an
empty list, which has no kind); a Parquet column of nulls omits the feature.
"""

from __future__ import annotations

import base64
import json
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

import numpy as np

from shardkit.errors import ShardkitError
from shardkit.formats.example import decode_example, encode_example

__all__ = [
    "example_from_row",
    "example_from_sample",
    "looks_like_examples",
    "row_from_example",
    "sample_from_example",
    "scalar_features",
]

_SAFE = frozenset(string.ascii_lowercase + string.digits + "_-")
_KINDS = ("int64", "float", "bytes", "empty")


def looks_like_examples(records: Sequence[bytes]) -> bool:
    """Whether the records (the first few of a file) all decode as tf.Examples with at least one feature
    among them (an empty record decodes as an empty Example, and so does nothing else)."""
    try:
        decoded = [decode_example(record) for record in records]
    except ShardkitError:
        return False
    return any(decoded)


def scalar_features(records: Iterable[bytes]) -> frozenset[str]:
    """The features holding exactly one value in every record that has them: Parquet scalar columns."""
    seen: set[str] = set()
    several: set[str] = set()
    for record in records:
        for name, value in decode_example(record).items():
            seen.add(name)
            if len(value) != 1:
                several.add(name)
    return frozenset(seen - several)


def _kind(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return "int64" if value.dtype == np.int64 else "float"
    return "bytes" if value else "empty"


def row_from_example(record: bytes, scalars: frozenset[str], *, json_lines: bool) -> dict[str, Any]:
    """A Parquet row (``json_lines=False``) or JSON object of the tf.Example ``record``."""
    row: dict[str, Any] = {}
    for name, value in decode_example(record).items():
        kind = _kind(value)
        if kind == "bytes":
            items: list[Any] = [_json_bytes(v) for v in value] if json_lines else list(value)
        elif kind == "float" and not json_lines:
            items = list(value)  # numpy float32 scalars: pyarrow makes a float32 column
        else:
            items = value.tolist() if isinstance(value, np.ndarray) else []
        scalar = name in scalars and (len(items) == 1 or not json_lines)  # JSON may vary; a column may not
        if scalar and len(items) != 1:
            raise ShardkitError(
                f"feature {name!r} holds {len(items)} values, but exactly 1 in every one of the first records, "
                "so its Parquet column is not a list; convert with --decode raw, or to jsonl or tar"
            )
        row[name] = items[0] if scalar else (np.asarray(items, np.float32) if kind == "float" else items)
    if json_lines:
        row = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in row.items()}
    return row


def _json_bytes(value: bytes) -> Any:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(value).decode("ascii")}


def example_from_row(row: Mapping[str, Any]) -> bytes:
    """The tf.Example of a Parquet row or JSON object (see the module docstring); ``__key__`` and
    ``__url__`` are dropped, a null omits its feature."""
    features = {}
    for name, value in row.items():
        if name.startswith("__") or value is None:
            continue
        values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
        features[name] = [_from_json(name, v) for v in values]
    return _encode(features)


def _from_json(name: str, value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) != {"base64"}:
            raise ShardkitError(
                f"field {name!r} holds {value!r}: a tf.Example feature holds bytes, ints or floats "
                "(bytes that are not text as {'base64': ...})"
            )
        return base64.b64decode(value["base64"], validate=True)
    return value.encode() if isinstance(value, str) else value


def _encode(features: Mapping[str, list[Any]]) -> bytes:
    """encode_example, with each feature's list typed (an all-float list stays float, ints int)."""
    typed: dict[str, Any] = {}
    for name, values in features.items():
        if values and all(isinstance(v, (float, np.floating)) for v in values):
            typed[name] = np.asarray(values, np.float32)
        elif values and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            typed[name] = np.asarray(values, np.int64)
        else:
            typed[name] = values
    try:
        return encode_example(typed)
    except (TypeError, ValueError) as error:
        raise ShardkitError(f"cannot write {sorted(features)} as a tf.Example: {error}") from None


def _member_name(name: str) -> str:
    return "".join(c if c in _SAFE else "".join(f"%{b:02x}" for b in c.encode()) for c in name)


def sample_from_example(record: bytes, key: str) -> dict[str, Any]:
    """A tar sample (``{"__key__": key, member extension: bytes}``) of the tf.Example ``record``."""
    sample: dict[str, Any] = {"__key__": key}
    for name, value in decode_example(record).items():
        kind = _kind(value)
        if kind == "bytes" and len(value) == 1:
            sample[_member_name(name)] = value[0]
            continue
        items = [base64.b64encode(v).decode("ascii") for v in value] if kind == "bytes" else list(value)
        items = [float(v) for v in items] if kind == "float" else items
        sample[f"{_member_name(name)}.{kind}.json"] = json.dumps(
            [int(v) for v in items] if kind == "int64" else items
        ).encode()
    return sample


def example_from_sample(sample: Mapping[str, Any]) -> bytes:
    """The tf.Example of a tar sample, read as :func:`sample_from_example` writes them."""
    features: dict[str, list[Any]] = {}
    for ext, data in sample.items():
        if ext.startswith("__"):
            continue
        data = data.encode() if isinstance(data, str) else bytes(data)
        stem, _, kind = ext.removesuffix(".json").rpartition(".")
        if ext.endswith(".json") and kind in _KINDS:
            values = json.loads(data)
            if kind == "bytes":
                values = [base64.b64decode(v, validate=True) for v in values]
            elif kind == "float":
                values = [float(v) for v in values]
            features[unquote(stem)] = values
        else:
            features[unquote(ext)] = [data]
    return _encode(features)
