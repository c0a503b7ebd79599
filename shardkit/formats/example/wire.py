"""The protobuf wire format of tf.Example and tf.SequenceExample, decoded in pure Python.

A hand-written protobuf wire-format decoder; it beat protobuf's C runtime (upb,
with descriptors built at runtime) on the benchmark's records because the
values come out as numpy arrays straight from the bytes (see
``benchmarks/tfrecord.py``). It has two backends with one behaviour:

* ``_example.c``, a CPython extension that ``pip install -e .`` compiles with
  the system's C compiler (``setup.py``; optional: a failed build is no failed
  install). Every read is bounded by the end of its message, lengths are
  compared by subtraction (no overflow), and unknown groups are skipped with a
  fixed stack bounded by the depth limit below: no recursion on the input.
* the pure-Python decoder here (:func:`decode_example_python`...), used when the
  extension is not built or ``SHARDKIT_PURE_PYTHON=1`` is set at import.

:data:`~shardkit.formats.example.backend.BACKEND` says which one is in use
(:mod:`~shardkit.formats.example.backend` picks it). The tests run both
against protobuf, and the C one under a subprocess so that a crash fails a
test. Messages involved::

    Example         { Features features = 1; }
    SequenceExample { Features context = 1; FeatureLists feature_lists = 2; }
    Features        { map<string, Feature> feature = 1; }
    FeatureLists    { map<string, FeatureList> feature_list = 1; }
    FeatureList     { repeated Feature feature = 1; }
    Feature         { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                                   Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }  FloatList { repeated float value = 1 [packed]; }
    Int64List { repeated int64 value = 1 [packed]; }

Decoding follows protobuf's rules exactly: packed and unpacked repeated
values, negative int64 as 10-byte varints, repeated map keys (last wins),
repeated sub-messages merged, the last oneof member wins, unknown fields skipped,
and bytes that protobuf rejects are rejected. ``tests/formats/test_example_fuzz.py``
checks this against protobuf's upb runtime on tens of thousands of mutated
records, on both backends. Bytes are rejected with :class:`~shardkit.ShardkitError` ("malformed
tf.Example (N bytes): <what, at which byte>", or tf.SequenceExample), never
with another exception, when:

* a tag or a length is a varint of more than 5 bytes, or any other varint of
  more than 10 (the bits past the 64th of a 10-byte varint are dropped);
* a field number is 0 (allowed inside unknown groups only, as upb allows it)
  or past 2**29 - 1, a wire type is 6 or 7, an end-group tag matches no open
  group, a group is not closed inside its message;
* a field runs past the end of its message, a packed varint past the end of
  its run, packed floats are not a multiple of 4 bytes, a key is not UTF-8;
* unknown groups nest too deeply. As in protobuf (its default recursion limit
  is 100), every enclosing message counts a level and so does every group, up
  to 100 in all: Example 0 > Features 1 > map entry 2 > Feature 3 > value
  list 4, and SequenceExample 0 > FeatureLists 1 > entry 2 > FeatureList 3 >
  Feature 4 > value list 5 (its context as in Example). Groups are skipped
  iteratively: 10,000 levels cost no recursion. Unknown length-delimited
  fields are never parsed, so what they hold may nest arbitrarily deep, as in
  protobuf.

The one corner, where protobuf's own runtimes disagree: a map entry
(``Features.feature``, ``FeatureLists.feature_list``) that holds any field
besides key (field 1) and value (field 2), both length-delimited -- another
field number, a key or value with another wire type, an unknown group -- is
kept, as protobuf's C++ and pure-Python runtimes keep it: its last key (``""`` if none) and its
merged value (empty if none) enter the map like any other entry's. upb, the
runtime of Python's protobuf, leaves such an entry out of the map (keeping it
as an unknown field), so there an earlier entry with the same key, or none,
stands. Both accept and reject exactly the same bytes.
"""

from __future__ import annotations

from typing import Final, Optional, Union

import numpy as np

from shardkit.errors import ShardkitError

__all__ = [
    "F1_LEN",
    "F2_LEN",
    "KIND_BYTES",
    "KIND_FLOAT",
    "KIND_INT64",
    "SMALL_PACKED",
    "U64",
    "BytesLike",
    "Value",
    "decode_example_python",
    "decode_sequence_example_python",
]

Value = Union[np.ndarray, list]
"""A decoded feature: int64 array, float32 array, ``list[bytes]``, or ``[]`` if no kind is set."""

BytesLike = Union[bytes, bytearray, memoryview]

# Tags (field number << 3 | wire type) used here.
F1_LEN: Final = 0x0A
F2_LEN: Final = 0x12
_F3_LEN: Final = 0x1A
_F1_VARINT: Final = 0x08
_F1_FIXED32: Final = 0x0D
U64: Final = (1 << 64) - 1
_MAX_TAG: Final = (1 << 32) - 1  # field numbers go up to 2**29 - 1
_MAX_DEPTH: Final = 100  # protobuf's default recursion limit: messages and groups nested in a message
SMALL_PACKED: Final = 24  # below this many bytes, decode varints in Python
KIND_BYTES, KIND_FLOAT, KIND_INT64 = F1_LEN, F2_LEN, _F3_LEN  # Feature's oneof members, by tag


class _Malformed(ShardkitError):
    """Raised internally; re-raised as ShardkitError with the message kind."""


# What malformed bytes raise while decoding: reading past the end of the record
# is an IndexError, a key that is not UTF-8 a UnicodeDecodeError.
_ERRORS: Final = (_Malformed, IndexError, UnicodeDecodeError, ValueError)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """Decode a varint value (at most 10 bytes) at ``pos``; return (value mod 2**64, position after it)."""
    byte = buf[pos]
    if byte < 0x80:
        return byte, pos + 1
    value = byte & 0x7F
    shift = 7
    while True:
        pos += 1
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & U64, pos + 1
        shift += 7
        if shift >= 70:
            raise _Malformed(f"varint longer than 10 bytes at byte {pos}")


def _varint32(buf: bytes, pos: int) -> tuple[int, int]:
    """Decode a tag or a length, which protobuf reads as varints of at most 5 bytes.

    The value can reach 2**35 - 1; callers reject tags past 2**32 - 1 and
    lengths past the end of their message.
    """
    byte = buf[pos]
    if byte < 0x80:
        return byte, pos + 1
    value = byte & 0x7F
    shift = 7
    while True:
        pos += 1
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos + 1
        shift += 7
        if shift >= 35:
            raise _Malformed(f"tag or length longer than 5 bytes at byte {pos - 4}")


def _skip(buf: bytes, pos: int, end: int, tag: int, depth: int) -> int:
    """Skip the value of an unknown field whose tag was just read, in a message at ``depth``."""
    if tag < 8 or tag > _MAX_TAG:
        raise _Malformed(f"field number {tag >> 3} out of range at byte {pos}")
    return _skip_value(buf, pos, end, tag, depth)


def _skip_value(buf: bytes, pos: int, end: int, tag: int, depth: int) -> int:
    wire = tag & 7
    if wire == 0:
        return _varint(buf, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 2:
        length, pos = _varint32(buf, pos)
        return pos + length
    if wire == 5:
        return pos + 4
    if wire == 3:
        return _skip_group(buf, pos, end, tag >> 3, depth)
    raise _Malformed(f"invalid wire type {wire} at byte {pos}")


def _skip_group(buf: bytes, pos: int, end: int, number: int, depth: int) -> int:
    """Skip an unknown group, and the groups nested in it, up to its end tag.

    Iterative, so that no nesting exhausts Python's stack; like protobuf, a
    group counts as a level of nesting and more than 100 levels are rejected.
    Inside a group protobuf (upb) takes field number 0 too: so does this.
    """
    open_groups = [number]
    while open_groups:
        if depth + len(open_groups) > _MAX_DEPTH:
            raise _Malformed(f"groups nested deeper than {_MAX_DEPTH} levels at byte {pos}")
        if pos >= end:
            raise _Malformed(f"group {open_groups[-1]} not closed before byte {end}")
        tag, pos = _varint32(buf, pos)
        if tag > _MAX_TAG:
            raise _Malformed(f"field number {tag >> 3} out of range at byte {pos}")
        if tag & 7 == 4:
            if tag >> 3 != open_groups.pop():
                raise _Malformed(f"mismatched end-group tag at byte {pos}")
        elif tag & 7 == 3:
            open_groups.append(tag >> 3)
        else:
            pos = _skip_value(buf, pos, end, tag, depth)
    return pos


def _fields(buf: bytes, pos: int, end: int, depth: int) -> list[tuple[int, int, int]]:
    """The (tag, start, stop) of every field in ``buf[pos:end]``, a message nested ``depth`` levels deep.

    ``buf[start:stop]`` is the payload of a length-delimited field and the
    encoded value of any other (a varint's bytes, a fixed32's 4 bytes...).
    """
    out = []
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint32(buf, pos)
        if tag & 7 == 2 and 8 < tag <= _MAX_TAG:
            length = buf[pos]
            if length < 0x80:
                pos += 1
            else:
                length, pos = _varint32(buf, pos)
            out.append((tag, pos, pos + length))
            pos += length
        else:
            start = pos
            pos = _skip(buf, pos, end, tag, depth)
            out.append((tag, start, pos))
    if pos != end:
        raise _Malformed(f"field runs past the end of its message (byte {pos} > {end})")
    return out


def _map_entries(buf: bytes, spans: list[tuple[int, int]], depth: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """Decode map<string, message> entries from the spans of the map's messages, ``depth`` levels deep.

    Returns (key, spans of the value message) per entry, in order: several
    spans if the entry repeats the value field, which protobuf merges. Callers
    decode every entry, as protobuf does, and keep the last of a repeated key.
    """
    entries = []
    for start, stop in spans:
        for tag, a, b in _fields(buf, start, stop, depth):
            if tag != F1_LEN:
                continue
            key = ""
            value: list[tuple[int, int]] = []
            for etag, ea, eb in _fields(buf, a, b, depth + 1):
                if etag == F1_LEN:
                    key = buf[ea:eb].decode("utf-8")
                elif etag == F2_LEN:
                    value.append((ea, eb))
            entries.append((key, value))
    return entries


def _feature(buf: bytes, spans: list[tuple[int, int]], depth: int) -> Value:
    """Decode one Feature, ``depth`` levels deep, from the spans its message bytes occupy.

    The last oneof member set wins; a member replaced by another is still
    decoded, so that malformed bytes fail as they do in protobuf.
    """
    members: list[tuple[int, list[tuple[int, int]]]] = []  # (kind, parts), a new one per change of kind
    for start, stop in spans:
        for tag, a, b in _fields(buf, start, stop, depth):
            if members and tag == members[-1][0]:
                members[-1][1].append((a, b))  # the same member again: merged
            elif tag in (KIND_BYTES, KIND_FLOAT, KIND_INT64):
                members.append((tag, [(a, b)]))
    value: Value = []
    for kind, parts in members:
        if kind == KIND_INT64:
            value = _int64_list(buf, parts, depth + 1)
        elif kind == KIND_FLOAT:
            value = _float_list(buf, parts, depth + 1)
        else:
            value = [buf[va:vb] for a, b in parts for tag, va, vb in _fields(buf, a, b, depth + 1) if tag == F1_LEN]
    return value


def _int64_list(buf: bytes, parts: list[tuple[int, int]], depth: int) -> np.ndarray:
    values = [
        _packed_varints(buf, start, stop)  # an unpacked value is a packed run of one
        for a, b in parts
        for tag, start, stop in _fields(buf, a, b, depth)
        if tag in (F1_LEN, _F1_VARINT)
    ]
    return np.concatenate(values) if values else np.zeros(0, dtype=np.int64)


def _packed_varints(buf: bytes, start: int, stop: int) -> np.ndarray:
    """Decode packed int64 varints (two's complement, not zigzag) to an int64 array."""
    size = stop - start
    if size <= 2:  # one value below 2**14, the commonest case (labels): no list, no slice
        if size == 1 and buf[start] < 0x80:
            return np.array((buf[start],), dtype=np.int64)
        if size == 2 and buf[start] >= 0x80 > buf[start + 1]:
            return np.array(((buf[start] & 0x7F) | buf[start + 1] << 7,), dtype=np.int64)
    chunk = buf[start:stop]
    if chunk.isascii():  # every value below 128: one byte each
        if len(chunk) <= SMALL_PACKED:
            return np.array(list(chunk), dtype=np.int64)  # cheaper than numpy views when short
        return np.frombuffer(chunk, dtype=np.uint8).astype(np.int64)
    if stop - start < SMALL_PACKED:
        values = []
        pos = start
        while pos < stop:
            value, pos = _varint(buf, pos)
            values.append(value - (value >> 63 << 64))  # as int64
        if pos != stop:
            raise _Malformed(f"packed varints end inside a value (bytes {start}..{stop})")
        return np.array(values, dtype=np.int64)
    raw = np.frombuffer(chunk, dtype=np.uint8)
    last = np.flatnonzero(raw < 0x80)
    if not last.size or last[-1] != raw.size - 1:
        raise _Malformed(f"packed varints end inside a value (bytes {start}..{stop})")
    first = np.empty_like(last)
    first[0] = 0
    first[1:] = last[:-1] + 1
    if (last - first).max() >= 10:
        raise _Malformed(f"varint longer than 10 bytes in bytes {start}..{stop}")
    shifts = (np.arange(raw.size) - np.repeat(first, last - first + 1)) * 7
    pieces = (raw & 0x7F).astype(np.uint64) << shifts.astype(np.uint64)
    return np.bitwise_or.reduceat(pieces, first).view(np.int64)


def _float_list(buf: bytes, parts: list[tuple[int, int]], depth: int) -> np.ndarray:
    values = []
    for a, b in parts:
        for tag, start, stop in _fields(buf, a, b, depth):
            if tag in (F1_LEN, _F1_FIXED32):  # packed run, or one unpacked value
                if (stop - start) % 4:
                    raise _Malformed(f"packed floats of {stop - start} bytes at byte {start}")
                values.append(np.frombuffer(buf, dtype="<f4", count=(stop - start) // 4, offset=start))
    return np.concatenate(values) if values else np.zeros(0, dtype=np.float32)


def _canonical_features(buf: bytes, pos: int, end: int) -> Optional[dict[str, Value]]:
    """Fast path for Features as serializers write them, or ``None`` to fall back.

    Handles entries of exactly (key, value), each Feature holding one kind and
    each list one packed run (or only values, for bytes); anything else (unknown
    fields, unpacked values, merged messages) returns ``None`` and the general
    decoder runs instead. Both paths give the same result. Lengths of one or two
    bytes are decoded inline: a call per length costs about 10% of the decode.
    """
    out: dict[str, Value] = {}
    varint = _varint32
    while pos < end:
        if buf[pos] != F1_LEN:
            return None
        length = buf[pos + 1]
        if length < 0x80:
            pos += 2
        elif buf[pos + 2] < 0x80:
            length = (length & 0x7F) | buf[pos + 2] << 7
            pos += 3
        else:
            length, pos = varint(buf, pos + 1)
        stop = pos + length
        key_length = buf[pos + 1]
        if buf[pos] != F1_LEN or key_length >= 0x80:
            return None
        pos += 2 + key_length
        key = buf[pos - key_length : pos].decode("utf-8")
        if pos == stop or buf[pos] != F2_LEN:
            return None
        length = buf[pos + 1]
        if length < 0x80:
            pos += 2
        elif buf[pos + 2] < 0x80:
            length = (length & 0x7F) | buf[pos + 2] << 7
            pos += 3
        else:
            length, pos = varint(buf, pos + 1)
        if pos + length != stop:
            return None
        if not length:
            out[key] = []
            continue
        kind = buf[pos]
        length = buf[pos + 1]
        if length < 0x80:
            pos += 2
        elif buf[pos + 2] < 0x80:
            length = (length & 0x7F) | buf[pos + 2] << 7
            pos += 3
        else:
            length, pos = varint(buf, pos + 1)
        if pos + length != stop:
            return None
        if kind == KIND_BYTES:
            items = []
            while pos < stop:
                if buf[pos] != F1_LEN:
                    return None
                length = buf[pos + 1]
                if length < 0x80:
                    pos += 2
                elif buf[pos + 2] < 0x80:
                    length = (length & 0x7F) | buf[pos + 2] << 7
                    pos += 3
                else:
                    length, pos = varint(buf, pos + 1)
                items.append(buf[pos : pos + length])
                pos += length
            if pos != stop:
                return None
            out[key] = items
            continue
        if pos == stop:
            if kind != KIND_INT64 and kind != KIND_FLOAT:  # an unknown field, not a oneof member
                return None
            out[key] = np.zeros(0, dtype=np.int64 if kind == KIND_INT64 else np.float32)
            continue
        if buf[pos] != F1_LEN:
            return None
        length = buf[pos + 1]
        if length < 0x80:
            pos += 2
        elif buf[pos + 2] < 0x80:
            length = (length & 0x7F) | buf[pos + 2] << 7
            pos += 3
        else:
            length, pos = varint(buf, pos + 1)
        if pos + length != stop:
            return None
        if kind == KIND_INT64:
            out[key] = _packed_varints(buf, pos, stop)
        elif kind == KIND_FLOAT and not length % 4:
            out[key] = np.frombuffer(buf, dtype="<f4", count=length // 4, offset=pos).copy()  # writable
        else:
            return None
        pos = stop
    return out if pos == end else None


def _features(buf: bytes, spans: list[tuple[int, int]], depth: int) -> dict[str, Value]:
    """Decode the Features message(s) at ``spans``, ``depth`` levels deep: entries are one deeper, Features two."""
    return {key: _feature(buf, value, depth + 2) for key, value in _map_entries(buf, spans, depth)}


def _as_bytes(record: BytesLike) -> bytes:
    return record if isinstance(record, bytes) else bytes(record)


def decode_example_python(record: BytesLike) -> dict[str, Value]:
    """The pure-Python :func:`decode_example`: the fallback, and the reference for the C backend."""
    buf = _as_bytes(record)
    try:
        if buf and buf[0] == F1_LEN:
            length, pos = _varint32(buf, 1)
            if pos + length == len(buf):
                fast = _canonical_features(buf, pos, len(buf))
                if fast is not None:
                    return fast
    except _ERRORS:
        pass  # not canonical after all: the general decoder below decides, and names the fault
    try:
        spans = [(a, b) for tag, a, b in _fields(buf, 0, len(buf), 0) if tag == F1_LEN]
        return _features(buf, spans, 1)
    except _ERRORS as exc:
        raise ShardkitError(f"malformed tf.Example ({len(buf)} bytes): {exc}") from None


def decode_sequence_example_python(record: BytesLike) -> tuple[dict[str, Value], dict[str, list[Value]]]:
    """The pure-Python :func:`decode_sequence_example`: the fallback, and the reference for the C backend."""
    buf = _as_bytes(record)
    try:
        fields = _fields(buf, 0, len(buf), 0)
        context = _features(buf, [(a, b) for tag, a, b in fields if tag == F1_LEN], 1)
        lists = _map_entries(buf, [(a, b) for tag, a, b in fields if tag == F2_LEN], 1)
        feature_lists = {
            key: [
                _feature(buf, [(a, b)], 4)  # in SequenceExample > FeatureLists > entry > FeatureList
                for start, stop in spans
                for tag, a, b in _fields(buf, start, stop, 3)
                if tag == F1_LEN
            ]
            for key, spans in lists
        }
        return context, feature_lists
    except _ERRORS as exc:
        raise ShardkitError(f"malformed tf.SequenceExample ({len(buf)} bytes): {exc}") from None
