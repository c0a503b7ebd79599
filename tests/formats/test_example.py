"""tf.Example / SequenceExample decoding and encoding, checked against protobuf's own parser.

protobuf (with the ``tfrecord`` package's generated messages) is the reference:
TensorFlow parses these messages with the same protobuf rules. Every decoding
test runs on both backends: the pure-Python decoder and the compiled one
(``shardkit/formats/_example.c``), imported directly whichever one
``shardkit.formats.example`` picked.
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tfrecord import example_pb2

import shardkit
from shardkit import ShardkitError
from shardkit.formats import example as example_module
from shardkit.formats.example import decode_example_python, decode_sequence_example_python, encode_example
from shardkit.formats.tfrecord import TFRecordWriter, read_tfrecord
from tests.helpers.examples import examples

try:
    from shardkit.formats import _example as compiled  # pyright: ignore[reportAttributeAccessIssue]
except ImportError:  # not built: its tests skip, except test_ci_runs_with_the_c_decoder_built under CI
    compiled = None

# backend -> (decode_example, decode_sequence_example)
DECODERS = {"python": (decode_example_python, decode_sequence_example_python)}
if compiled is not None:
    DECODERS["c"] = (compiled.decode_example, compiled.decode_sequence_example)
BACKENDS = [
    "python",
    pytest.param("c", marks=pytest.mark.skipif(compiled is None, reason="C decoder not built (pip install -e .)")),
]
with_both_backends = pytest.mark.parametrize("backend", BACKENDS)
# The property tests draw each input once and check every built backend on it: drawing is most of
# their cost (nested composite strategies), and one input for both decoders proves the same per input.
# "c" is in DECODERS only when built; test_ci_runs_with_the_c_decoder_built fails CI if it is not.

INT64 = st.integers(-(2**63), 2**63 - 1)
FLOAT32 = st.floats(width=32, allow_nan=False)
KEYS = st.text(max_size=8)


# --------------------------------------------------------------------------- reference and normal form


def normal(value: object) -> tuple[str, list]:
    """A comparable form of a decoded value: (kind, values)."""
    if isinstance(value, np.ndarray):
        if value.dtype == np.int64:
            return "int64", value.tolist()
        assert value.dtype == np.float32 and value.flags.writeable
        return "float", value.view(np.uint32).tolist()
    assert isinstance(value, list) and all(type(v) is bytes for v in value)
    return ("bytes", value) if value else ("none-or-empty-bytes", [])


def reference_feature(feature: example_pb2.Feature) -> tuple[str, list]:
    kind = feature.WhichOneof("kind")
    if kind == "int64_list":
        return "int64", list(feature.int64_list.value)
    if kind == "float_list":
        return "float", np.array(feature.float_list.value, dtype=np.float32).view(np.uint32).tolist()
    if kind == "bytes_list" and feature.bytes_list.value:
        return "bytes", list(feature.bytes_list.value)
    return "none-or-empty-bytes", []


def reference_example(record: bytes) -> dict[str, tuple[str, list]]:
    example = example_pb2.Example.FromString(record)
    return {key: reference_feature(f) for key, f in example.features.feature.items()}


def normal_example(decoded: dict) -> dict[str, tuple[str, list]]:
    return {key: normal(value) for key, value in decoded.items()}


# --------------------------------------------------------------------------- a wire encoder written for the tests


def varint(n: int) -> bytes:
    n &= 2**64 - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def field(number: int, wire: int, payload: bytes) -> bytes:
    head = varint(number << 3 | wire)
    return head + (varint(len(payload)) + payload if wire == 2 else payload)


@st.composite
def unknown_fields(draw: st.DrawFn) -> bytes:
    """Zero to two fields with numbers no message here uses."""
    out = b""
    for _ in range(draw(st.integers(0, 2))):
        number = draw(st.integers(4, 40))
        wire = draw(st.sampled_from([0, 1, 2, 5]))
        if wire == 0:
            out += field(number, 0, varint(draw(INT64)))
        elif wire == 1:
            out += field(number, 1, os.urandom(8))
        elif wire == 5:
            out += field(number, 5, os.urandom(4))
        else:
            out += field(number, 2, draw(st.binary(max_size=5)))
    return out


@st.composite
def list_message(draw: st.DrawFn, kind: str, values: list) -> bytes:
    """Int64List/FloatList/BytesList holding ``values``, packed or not, with noise."""
    out = draw(unknown_fields())
    if kind == "bytes":
        return out + b"".join(field(1, 2, v) for v in values) + draw(unknown_fields())
    encode = varint if kind == "int64" else lambda v: struct.pack("<f", v)
    i = 0
    while i < len(values):
        n = draw(st.integers(1, len(values) - i))
        chunk = values[i : i + n]
        if draw(st.booleans()):  # packed run
            out += field(1, 2, b"".join(map(encode, chunk)))
        else:
            out += b"".join(field(1, 0 if kind == "int64" else 5, encode(v)) for v in chunk)
        i += n
    return out + draw(unknown_fields())


@st.composite
def feature_message(draw: st.DrawFn) -> bytes:
    """A Feature, sometimes with its list split into merged parts or a replaced oneof member."""
    kind = draw(st.sampled_from(["int64", "float", "bytes", "none"]))
    out = b""
    if draw(st.booleans()):  # an earlier member of the oneof, replaced by the later one
        out += field(draw(st.sampled_from([1, 2, 3])), 2, b"")
    if kind == "none":
        return out
    values = draw(st.lists({"int64": INT64, "float": FLOAT32, "bytes": st.binary(max_size=6)}[kind], max_size=6))
    number = {"bytes": 1, "float": 2, "int64": 3}[kind]
    split = draw(st.integers(0, len(values)))
    for part in (values[:split], values[split:]) if draw(st.booleans()) else (values,):
        out += field(number, 2, draw(list_message(kind, part)))
    return out + draw(unknown_fields())


@st.composite
def example_record(draw: st.DrawFn) -> bytes:
    """A serialized Example with repeated keys, both entry orders and merged Features."""
    entries = []
    for _ in range(draw(st.integers(0, 5))):
        key = field(1, 2, draw(st.sampled_from(["a", "b", "", "ключ"])).encode())  # few keys: repeats, last wins
        value = field(2, 2, draw(feature_message()))
        entries.append(field(1, 2, (key + value) if draw(st.booleans()) else (value + key)))
    split = draw(st.integers(0, len(entries)))
    features = [b"".join(entries[:split]), b"".join(entries[split:])]
    return b"".join(field(1, 2, part) for part in features if part or draw(st.booleans())) + draw(unknown_fields())


def garbage_records() -> st.SearchStrategy[bytes]:
    """Random bytes, and well-formed records truncated or with a few bytes overwritten."""
    return st.one_of(
        st.binary(max_size=40),
        example_record().flatmap(lambda r: st.integers(0, len(r)).map(lambda i: r[:i])),  # truncated
        example_record().flatmap(  # a few bytes overwritten
            lambda r: st.tuples(st.integers(0, len(r)), st.binary(min_size=1, max_size=3)).map(
                lambda cut: r[: cut[0]] + cut[1] + r[cut[0] + len(cut[1]) :]
            )
        ),
    )


# --------------------------------------------------------------------------- decoding


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(example_record())
def test_decode_matches_protobuf_on_any_wire_form(record: bytes) -> None:
    expected = reference_example(record)
    for backend, (decode_example, _) in DECODERS.items():
        assert normal_example(decode_example(record)) == expected, backend


@settings(max_examples=examples(200), deadline=None)
@given(
    st.dictionaries(
        KEYS,
        st.one_of(
            st.lists(INT64, max_size=20), st.lists(FLOAT32, max_size=20), st.lists(st.binary(max_size=30), max_size=4)
        ),
        max_size=6,
    )
)
def test_decode_matches_protobuf_on_canonical_messages(features: dict) -> None:
    example = example_pb2.Example()
    for key, values in features.items():
        feature = example.features.feature[key]
        if values and isinstance(values[0], bytes):
            feature.bytes_list.value.extend(values)
        elif values and isinstance(values[0], float):
            feature.float_list.value.extend(values)
        elif values:
            feature.int64_list.value.extend(values)
    record = example.SerializeToString()
    expected = reference_example(record)
    for backend, (decode_example, _) in DECODERS.items():
        assert normal_example(decode_example(record)) == expected, backend


def map_entry_with_other_fields(record: bytes) -> bool:
    """Whether a Features map entry holds fields besides key and value.

    protobuf's runtimes disagree on such entries: C++ keeps key and value and
    drops the rest, upb (Python) turns the whole entry into an unknown field.
    shardkit does as C++; the comparison with upb skips these records.
    """
    from shardkit.formats.example.wire import _fields

    try:
        return any(
            etag not in (0x0A, 0x12)
            for tag, a, b in _fields(record, 0, len(record), 0)
            if tag == 0x0A
            for ftag, fa, fb in _fields(record, a, b, 1)
            if ftag == 0x0A
            for etag, _, _ in _fields(record, fa, fb, 2)
        )
    except Exception:  # malformed: not in the corner
        return False


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage_records())
def test_garbage_and_truncated_records_fail_exactly_when_protobuf_fails(record: bytes) -> None:
    assume(not map_entry_with_other_fields(record))
    try:
        expected = reference_example(record)
    except Exception:  # protobuf's DecodeError
        expected = None
    for backend, (decode_example, _) in DECODERS.items():
        if expected is None:
            with pytest.raises(ShardkitError, match="malformed tf.Example"):
                decode_example(record)
        else:
            assert normal_example(decode_example(record)) == expected, backend


@with_both_backends
def test_decoded_types(backend: str) -> None:
    decode_example = DECODERS[backend][0]
    example = example_pb2.Example()
    f = example.features.feature
    f["i"].int64_list.value.extend([-1, 2**63 - 1, -(2**63), 0, 300])
    f["f"].float_list.value.extend([1.5, -0.0])
    f["b"].bytes_list.value.extend([b"", b"\x00\xff"])
    f["none"].SetInParent()
    f["empty_int"].int64_list.SetInParent()
    decoded = decode_example(example.SerializeToString())
    assert decoded["i"].dtype == np.int64 and decoded["i"].tolist() == [-1, 2**63 - 1, -(2**63), 0, 300]
    assert decoded["f"].dtype == np.float32 and decoded["f"].tolist() == [1.5, -0.0]
    assert decoded["b"] == [b"", b"\x00\xff"]
    assert decoded["none"] == []
    assert decoded["empty_int"].dtype == np.int64 and decoded["empty_int"].size == 0
    assert decode_example(memoryview(example.SerializeToString())).keys() == decoded.keys()


def test_negative_int64_is_ten_byte_varint() -> None:
    record = encode_example({"x": [-1]})
    assert record.endswith(b"\xff" * 9 + b"\x01")
    assert example_pb2.Example.FromString(record).features.feature["x"].int64_list.value == [-1]


@with_both_backends
def test_long_packed_varints_vectorised_path(backend: str) -> None:
    decode_example = DECODERS[backend][0]
    values = [(-1) ** i * (7**i) % 2**63 * (-1) ** i for i in range(200)] + [-(2**63), 2**63 - 1, -1, 0]
    example = example_pb2.Example()
    example.features.feature["v"].int64_list.value.extend(values)
    assert decode_example(example.SerializeToString())["v"].tolist() == values
    assert decode_example(encode_example({"v": np.array(values)}))["v"].tolist() == values


@with_both_backends
@pytest.mark.parametrize(
    "record",
    [
        b"\x0a\x05\x0a\x03",  # length runs past the end
        b"\x0a",  # truncated length
        b"\x0f",  # wire type 7
        b"\x0a\x02\x0a\xff",  # truncated varint inside
        b"\x0a\x07\x0a\x05\x0a\x01\xff\x12\x00",  # key is not UTF-8
        b"\x0a\x0a\x0a\x08\x0a\x01k\x12\x03\x12\x01\x00",  # packed floats of 1 byte... inside a 3-byte Feature
    ],
)
def test_malformed_records_raise(backend: str, record: bytes) -> None:
    decode_example = DECODERS[backend][0]
    with pytest.raises(ShardkitError, match="malformed tf.Example"):
        decode_example(record)


@with_both_backends
def test_nan_payload_round_trips(backend: str) -> None:
    decode_example = DECODERS[backend][0]
    bits = np.array([0x7FC00001, 0xFF800000], dtype=np.uint32)
    decoded = decode_example(encode_example({"x": bits.view(np.float32)}))
    assert decoded["x"].view(np.uint32).tolist() == bits.tolist()


# --------------------------------------------------------------------------- SequenceExample


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(feature_message(), max_size=4), st.lists(feature_message(), max_size=4), KEYS, unknown_fields())
def test_sequence_example_matches_protobuf(context_features, list_features, key, noise) -> None:
    context = b"".join(
        field(1, 2, field(1, 2, f"c{i}".encode()) + field(2, 2, f)) for i, f in enumerate(context_features)
    )
    feature_list = b"".join(field(1, 2, f) for f in list_features)
    lists = field(1, 2, field(1, 2, key.encode()) + field(2, 2, feature_list))
    record = noise + field(1, 2, context) + field(2, 2, lists) + noise
    reference = example_pb2.SequenceExample.FromString(record)
    expected_context = {k: reference_feature(f) for k, f in reference.context.feature.items()}
    expected_lists = {
        k: [reference_feature(f) for f in fl.feature] for k, fl in reference.feature_lists.feature_list.items()
    }
    for backend, (_, decode_sequence_example) in DECODERS.items():
        got_context, got_lists = decode_sequence_example(record)
        assert normal_example(got_context) == expected_context, backend
        assert {k: [normal(v) for v in vs] for k, vs in got_lists.items()} == expected_lists, backend


@with_both_backends
def test_sequence_example_basic(backend: str) -> None:
    decode_sequence_example = DECODERS[backend][1]
    seq = example_pb2.SequenceExample()
    seq.context.feature["length"].int64_list.value.append(3)
    tokens = seq.feature_lists.feature_list["tokens"].feature
    for i in range(3):
        tokens.add().int64_list.value.extend([i, -i])
    context, lists = decode_sequence_example(seq.SerializeToString())
    assert context["length"].tolist() == [3]
    assert [v.tolist() for v in lists["tokens"]] == [[0, 0], [1, -1], [2, -2]]


# --------------------------------------------------------------------------- encoding


@with_both_backends
def test_encode_value_kinds(backend: str) -> None:
    decode_example = DECODERS[backend][0]
    record = encode_example(
        {
            "int": 5,
            "bool": True,
            "ints": [1, -2],
            "array": np.arange(3, dtype=np.uint8),
            "float": 0.5,
            "floats": [1, 2.5],
            "str": "héllo",
            "bytes": [b"a", bytearray(b"b")],
            "empty": [],
            "empty_floats": np.zeros(0, np.float32),
        }
    )
    got = normal_example(decode_example(record))
    assert got == reference_example(record)
    assert got["int"] == ("int64", [5]) and got["bool"] == ("int64", [1]) and got["ints"] == ("int64", [1, -2])
    assert got["array"] == ("int64", [0, 1, 2])
    assert decode_example(record)["floats"].tolist() == [1.0, 2.5]
    assert decode_example(record)["str"] == ["héllo".encode()]
    assert got["empty"] == ("none-or-empty-bytes", [])
    assert decode_example(record)["empty_floats"].dtype == np.float32
    with pytest.raises(TypeError, match="'bad'"):
        encode_example({"bad": {1: 2}})


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.dictionaries(
            KEYS,
            st.one_of(
                st.lists(INT64, max_size=40),
                st.lists(FLOAT32, min_size=1, max_size=40),
                st.lists(st.binary(max_size=50), min_size=1, max_size=4),
                st.just([]),
            ),
            max_size=5,
        ),
        max_size=5,
    ),
    st.sampled_from([None, "gzip", "zlib"]),
)
def test_encode_write_read_decode_round_trip(tmp_path, examples: list[dict], compression: str | None) -> None:
    path = str(tmp_path / f"rt-{compression}.tfrecord")
    with TFRecordWriter(path, compression=compression) as writer:
        for example in examples:
            writer.write(shardkit.encode_example(example))
    decoded = [shardkit.decode_example(r) for r in read_tfrecord(path)]
    assert len(decoded) == len(examples)
    for example, got in zip(examples, decoded):
        assert got.keys() == example.keys()
        for key, values in example.items():
            value = got[key]
            if values and isinstance(values[0], float):
                assert value.dtype == np.float32
                assert value.tolist() == [float(np.float32(v)) if math.isfinite(v) else v for v in values]
            elif values and isinstance(values[0], int):
                assert value.dtype == np.int64 and value.tolist() == values
            else:
                assert value == values


# --------------------------------------------------------------------------- the backends


def test_the_compiled_decoder_is_used_when_built() -> None:
    expected = "c" if compiled is not None and os.environ.get("SHARDKIT_PURE_PYTHON", "") in ("", "0") else "python"
    assert example_module.BACKEND == expected
    assert shardkit.decode_example(encode_example({"x": [1]}))["x"].tolist() == [1]


def test_ci_runs_with_the_c_decoder_built() -> None:
    """CI must exercise both backends: there a missing extension is a failure, not a skip."""
    if compiled is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but shardkit.formats._example is not built: `pip install -e .` must compile it")
        pytest.skip("C decoder not built (pip install -e .)")
    assert compiled.decode_example(encode_example({"x": [2]}))["x"].tolist() == [2]


@pytest.mark.slow  # a new interpreter importing torch: seconds of CPU
def test_shardkit_pure_python_forces_the_fallback() -> None:
    code = "import shardkit.formats.example.backend as e; print(e.BACKEND, e._decode_example.__name__)"
    for value, expected in (("1", "python decode_example_python"), ("0", "c decode_example"), ("", "c decode_example")):
        env = {**os.environ, "SHARDKIT_PURE_PYTHON": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        if compiled is None and value != "1":
            expected = "python decode_example_python"
        assert out.stdout.split() == expected.split(), (value, out.stdout, out.stderr)


@with_both_backends
def test_bytearray_and_memoryview_records_decode_like_bytes(backend: str) -> None:
    decode_example, decode_sequence_example = DECODERS[backend]
    record = encode_example({"i": [1, -2], "f": [0.5], "b": [b"xy", b""]})
    expected = normal_example(decode_example(record))
    for view in (bytearray(record), memoryview(record), memoryview(b"??" + record)[2:]):
        assert normal_example(decode_example(view)) == expected
    with pytest.raises(TypeError):
        decode_example("not bytes")
    with pytest.raises(ShardkitError, match="malformed tf.SequenceExample"):
        decode_sequence_example(memoryview(b"\x0a\x05"))
