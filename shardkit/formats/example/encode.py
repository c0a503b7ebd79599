"""tf.Example encoded from Python and numpy values, as TensorFlow serializes it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardkit.formats.example.wire import F1_LEN, F2_LEN, KIND_BYTES, KIND_FLOAT, KIND_INT64, SMALL_PACKED, U64

__all__ = ["encode_example"]


def _encode_varint(value: int) -> bytes:
    value &= U64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + _encode_varint(len(payload)) + payload


def _encode_varints(values: np.ndarray) -> bytes:
    """Packed varint encoding of an int64 array (negatives as 10-byte varints)."""
    if len(values) < SMALL_PACKED:
        return b"".join(_encode_varint(int(v)) for v in values)
    u = values.astype(np.int64).view(np.uint64)
    shifts = np.arange(10, dtype=np.uint64) * np.uint64(7)
    groups = (u[:, None] >> shifts) & np.uint64(0x7F)
    more = (u[:, None] >> (shifts + np.uint64(7))) != 0
    more[:, -1] = False
    nbytes = more.sum(axis=1) + 1
    keep = np.arange(10) < nbytes[:, None]
    return (groups.astype(np.uint8) | (more.astype(np.uint8) << 7))[keep].tobytes()


def _kind_of(key: str, value: Any) -> tuple[int, Any]:
    """Which Feature kind a Python/numpy value encodes as, and its values."""
    if isinstance(value, np.ndarray):
        kind = value.dtype.kind
        if kind in "iub":
            return KIND_INT64, value.ravel().astype(np.int64)
        if kind == "f":
            return KIND_FLOAT, value.ravel().astype("<f4")
        if kind in "SUO":
            return KIND_BYTES, value.ravel().tolist()
        raise TypeError(f"feature {key!r}: cannot encode an array of dtype {value.dtype}")
    if isinstance(value, (bytes, bytearray, str, int, float, np.generic)):
        value = [value]
    if not isinstance(value, Sequence):
        raise TypeError(
            f"feature {key!r}: expected bytes, str, int, float, a sequence or an array, not {type(value).__name__}"
        )
    if not value:
        return 0, value
    first = value[0]
    if isinstance(first, (bytes, bytearray, str, np.bytes_, np.str_)):
        return KIND_BYTES, value
    if all(isinstance(v, (int, np.integer)) for v in value):  # bool is an int
        return KIND_INT64, np.array(value, dtype=np.int64)
    return KIND_FLOAT, np.array(value, dtype="<f4")


def _encode_feature(key: str, value: Any) -> bytes:
    kind, values = _kind_of(key, value)
    if kind == KIND_BYTES:
        items = (v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values)
        body = _delimited(KIND_BYTES, b"".join(_delimited(F1_LEN, item) for item in items))
    elif kind == KIND_INT64:
        body = _delimited(KIND_INT64, _delimited(F1_LEN, _encode_varints(values)) if len(values) else b"")
    elif kind == KIND_FLOAT:
        body = _delimited(KIND_FLOAT, _delimited(F1_LEN, values.tobytes()) if len(values) else b"")
    else:
        body = b""  # an empty list: a Feature with no kind set
    entry = _delimited(F1_LEN, key.encode("utf-8")) + _delimited(F2_LEN, body)
    return _delimited(F1_LEN, entry)


def encode_example(features: Mapping[str, Any]) -> bytes:
    """Serialize a mapping as a ``tf.train.Example``.

    Values: ``bytes``/``str`` or sequences of them -> ``bytes_list``; ints, bools
    or integer arrays -> ``int64_list``; floats or float arrays -> ``float_list``
    (float32); an empty list -> a Feature with no kind set (decodes to ``[]``).

    Example:
        >>> import numpy as np
        >>> import shardkit
        >>> record = shardkit.encode_example({"image": [b"<png bytes>"], "box": np.zeros(4), "id": 7})
        >>> sorted(shardkit.decode_example(record).items())
        [('box', array([0., 0., 0., 0.], dtype=float32)), ('id', array([7])), ('image', [b'<png bytes>'])]
    """
    return _delimited(F1_LEN, b"".join(_encode_feature(key, value) for key, value in features.items()))
