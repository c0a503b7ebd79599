"""decode_columns: blocks of tf.Examples into columns, byte-exact against decode_example and protobuf.

Both backends run every decoding test: the pure-Python one and the compiled one
(``shardkit/formats/_example.c``), imported directly. Then
``TFRecordDataset(features=..., batch_size=...)``: column batches equal to
per-record decoding, each record once through two DataLoader workers, resume,
and faults (a record of another shape, a bad CRC).
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tfrecord import example_pb2
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptRecordError, ShardkitError
from shardkit.formats.example import columns as example_module
from shardkit.formats.example import decode_example_python, encode_example
from tests.formats.test_example import (
    DECODERS,
    FLOAT32,
    INT64,
    compiled,
    example_record,
    garbage_records,
    with_both_backends,
)
from tests.helpers.examples import examples
from tests.helpers.shards import COLUMN_FEATURES as FEATURES
from tests.helpers.shards import column_rows as rows
from tests.helpers.shards import per_record_rows, record_offsets
from tests.helpers.shards import write_column_shards as write_shards

SPECS = {  # name -> (dtype, shape, strategy of one value)
    "label": ("int64", (), INT64),
    "box": ("float32", (2, 2), FLOAT32),
    "ids": ("int64", (3,), INT64),
    "image": ("bytes", (), st.binary(max_size=20)),
    "pair": ("bytes", (2,), st.binary(max_size=5)),
    "nothing": ("float32", (0,), FLOAT32),
}


BUILT = list(DECODERS)  # "python", and "c" when built: the property tests check each on one drawn input


def decode_columns(backend: str, records: list, features: dict) -> dict:
    return example_module._decode_columns(records, features, compiled if backend == "c" else None)


def flat(column: object) -> list:
    """A column's (or a decoded value's) values in record order: float32 as their bits, bytes as bytes."""
    if isinstance(column, list):
        return column
    if isinstance(column, np.ndarray):
        return (column.view(np.uint32) if column.dtype == np.float32 else column).ravel().tolist()
    assert isinstance(column, (pa.LargeBinaryArray, pa.FixedSizeListArray))
    values = column.flatten() if isinstance(column, pa.FixedSizeListArray) else column
    return values.to_pylist()


def protobuf_values(record: bytes, name: str) -> list:
    feature = example_pb2.Example.FromString(record).features.feature[name]
    kind = feature.WhichOneof("kind")
    values = list(getattr(feature, kind).value) if kind else []
    return np.array(values, dtype=np.float32).view(np.uint32).tolist() if kind == "float_list" else values


@st.composite
def block(draw: st.DrawFn) -> tuple[list[bytes], dict]:
    """Records that all hold a random subset of SPECS at its shape, in random order, with other features around."""
    names = draw(st.lists(st.sampled_from(sorted(SPECS)), min_size=1, max_size=4, unique=True))
    records = []
    for _ in range(draw(st.integers(0, 6))):
        features = {}
        for name in draw(st.permutations(names)):
            dtype, shape, values = SPECS[name]
            size = int(np.prod(shape))
            features[name] = draw(st.lists(values, min_size=size, max_size=size))
            if dtype != "bytes":
                features[name] = np.array(features[name], dtype=np.int64 if dtype == "int64" else np.float32)
        features.update(draw(st.dictionaries(st.sampled_from(["x", "y"]), st.lists(INT64, max_size=3), max_size=2)))
        records.append(encode_example(features))
    return records, {name: SPECS[name][:2] for name in names}


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block())
def test_columns_equal_decode_example_and_protobuf_value_for_value(case: tuple) -> None:
    records, features = case
    for backend in BUILT:  # one drawn block for every built backend: drawing is most of the cost
        columns = decode_columns(backend, records, features)
        assert list(columns) == list(features), backend
        for name, (dtype, shape) in features.items():
            column = columns[name]
            if dtype == "bytes":
                assert len(column) == len(records) and column.null_count == 0
            else:
                assert column.shape == (len(records), *shape) and column.dtype == dtype and column.flags.writeable
            per_record = [decode_example_python(r)[name] for r in records]
            expected = [v for value in per_record for v in flat(value)]
            assert flat(column) == expected, backend
            assert flat(column) == [v for r in records for v in protobuf_values(r, name)], backend


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(example_record())
def test_columns_take_every_wire_form_as_decode_example_does(record: bytes) -> None:
    """Repeated keys, merged messages, replaced oneof members, unpacked values: each feature read as one column."""
    decoded = decode_example_python(record)
    for name, value in decoded.items():
        if isinstance(value, np.ndarray):
            features = {name: (str(value.dtype), (len(value),))}
        elif value:
            features = {name: ("bytes", (len(value),))}
        else:
            features = {name: ("int64", (0,))}  # no values fit a shape of size 0, whatever the kind
        for backend in BUILT:
            assert flat(decode_columns(backend, [record, record], features)[name]) == flat(value) * 2, backend


def column_outcome(backend: str, records: list, features: dict) -> object:
    try:
        return {name: flat(column) for name, column in decode_columns(backend, records, features).items()}
    except ShardkitError as error:  # the message up to the decoder's own detail, which differs by backend
        return str(error).split(": ")[0]


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    garbage_records(),
    st.sampled_from([{"a": ("int64", (1,))}, {"b": ("bytes", ())}, {"": ("float32", (0,))}, {"a": ("bytes", (2,))}]),
)
def test_garbage_records_give_the_same_columns_or_error_on_both_backends(record: bytes, features: dict) -> None:
    records = [encode_example({"a": [1], "b": b"x", "": []}), record]
    expected = column_outcome("python", records, features)
    if compiled is not None:
        assert column_outcome("c", records, features) == expected


@with_both_backends
def test_columns_of_no_records_are_empty(backend: str) -> None:
    columns = decode_columns(backend, [], {"a": ("float32", (3,)), "b": ("bytes", ())})
    assert columns["a"].shape == (0, 3) and columns["a"].dtype == np.float32
    assert columns["b"].type == pa.large_binary() and len(columns["b"]) == 0


GOOD = encode_example({"label": 1, "xy": np.array([1.0, 2.0], dtype=np.float32), "img": b"ab"})
ERRORS = [
    ({"missing": ("int64", ())}, "record 2 has no feature 'missing' (wanted: int64 of shape ())"),
    ({"label": ("float32", ())}, "feature 'label' of record 2 holds int64 values, expected float32 of shape ()"),
    ({"xy": ("float32", (3,))}, "feature 'xy' of record 2 has 2 values, expected 3 for float32 of shape (3,)"),
    ({"img": ("bytes", (2,))}, "feature 'img' of record 2 has 1 values, expected 2 for bytes of shape (2,)"),
]


@with_both_backends
@pytest.mark.parametrize(("features", "message"), ERRORS)
def test_a_missing_or_ill_shaped_feature_names_the_feature_and_the_record(
    backend: str, features: dict, message: str
) -> None:
    other = encode_example({"missing": 5, "label": 2.5, "xy": [1.0, 2.0, 3.0], "img": [b"a", b"b"]})
    decode_columns(backend, [other, other], features)  # records 0 and 1 fit
    with pytest.raises(ShardkitError) as caught:
        decode_columns(backend, [other, other, GOOD, other], features)
    assert str(caught.value) == message


@with_both_backends
def test_a_malformed_record_is_located(backend: str) -> None:
    for bad in (GOOD[:-1], GOOD + b"\x0f", b"\x0a\x80\x80\x80\x80\x80\x01"):
        with pytest.raises(ShardkitError, match=r"^record 1: malformed tf\.Example \(\d+ bytes\): "):
            decode_columns(backend, [GOOD, bad, GOOD], {"label": ("int64", ())})


@with_both_backends
def test_a_repeated_key_takes_its_last_value_even_if_an_earlier_one_had_another_shape(backend: str) -> None:
    first = encode_example({"k": [1, 2, 3]})
    last = encode_example({"k": [7]})
    entries = first[2:] + last[2:]  # both Features messages' entries (1-byte lengths) in one Features
    record = b"\x0a" + bytes([len(entries)]) + entries
    assert decode_example_python(record)["k"].tolist() == [7]
    assert decode_columns(backend, [record], {"k": ("int64", ())})["k"].tolist() == [7]


@pytest.mark.parametrize(
    "spec",
    [("int32", ()), ("int64", 3), ("int64", (-1,)), ("bytes", (2, 2)), ("bytes", (0,)), "int64", ("int64", (1.5,))],
)
def test_a_bad_feature_spec_is_refused_with_an_example(spec: object) -> None:
    with pytest.raises(ValueError, match="feature 'f'"):
        example_module.decode_columns([GOOD], {"f": spec})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="feature 'f'"):
        example_module.ColumnBatches(iter([GOOD]), {"f": spec}, 2)  # pyright: ignore[reportArgumentType]


def test_feature_names_must_be_str() -> None:
    with pytest.raises(ValueError, match="feature names are str"):
        example_module.decode_columns([GOOD], {b"label": ("int64", ())})  # pyright: ignore[reportArgumentType]


def test_column_batches_cut_the_records_into_blocks_and_keep_the_last_short_one() -> None:
    records = [encode_example({"i": i, "s": b"%d" % i}) for i in range(7)]
    batches = list(example_module.ColumnBatches(iter(records), {"i": ("int64", ()), "s": ("bytes", ())}, 3))
    assert [b["i"].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [v for b in batches for v in b["s"].to_pylist()] == [b"%d" % i for i in range(7)]


@with_both_backends
def test_records_may_be_bytearrays_and_memoryviews(backend: str) -> None:
    records = [GOOD, bytearray(GOOD), memoryview(b"xx" + GOOD)[2:]]
    columns = decode_columns(backend, records, {"img": ("bytes", ()), "xy": ("float32", (2,))})
    assert columns["img"].to_pylist() == [b"ab"] * 3 and columns["xy"].tolist() == [[1.0, 2.0]] * 3


# --------------------------------------------------------------------------- TFRecordDataset(features=, batch_size=)


def test_tfrecord_dataset_with_features_yields_the_records_as_column_batches(tmp_path) -> None:
    urls = write_shards(tmp_path)
    dataset = shardkit.TFRecordDataset(urls, features=FEATURES, batch_size=16).count_records()
    batches = list(dataset)
    assert [len(batch["id"]) for batch in batches] == [16] * 7 + [8] and len(dataset) == 8
    assert all(batch["xy"].shape == (len(batch["id"]), 2) for batch in batches)
    assert rows(batches) == per_record_rows(urls)


@pytest.mark.slow
def test_column_batches_through_two_dataloader_workers_hold_every_record_once(tmp_path) -> None:
    urls = write_shards(tmp_path)
    dataset = shardkit.TFRecordDataset(urls, features=FEATURES, batch_size=16).count_records()
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    batches = list(loader)
    assert len(loader) == len(batches) == 8  # 60 records per worker: 4 batches each, the last of 12
    assert all(isinstance(batch["id"], torch.Tensor) and batch["id"].dtype == torch.int64 for batch in batches)
    got = rows(batches)
    assert sorted(got) == sorted(per_record_rows(urls)) and len(got) == 120  # each record once, values equal


def test_column_batches_resume_at_the_next_batch(tmp_path) -> None:
    urls = write_shards(tmp_path)
    dataset = shardkit.TFRecordDataset(urls, features=FEATURES, batch_size=16).count_records()  # positions need counts
    iterator = iter(dataset)
    first = [next(iterator) for _ in range(3)]
    resumed = shardkit.TFRecordDataset(urls, features=FEATURES, batch_size=16).count_records()
    resumed.load_state_dict(dataset.state_dict())
    assert rows(first) + rows(list(resumed)) == per_record_rows(urls)


def test_a_record_of_another_shape_stops_the_batches_naming_the_feature(tmp_path) -> None:
    urls = write_shards(tmp_path, odd=45)
    with pytest.raises(ShardkitError, match=r"feature 'xy' of record 13 has 3 values, expected 2"):  # 45 = 2 * 16 + 13
        list(shardkit.TFRecordDataset(urls, features=FEATURES, batch_size=16))


def test_a_record_with_a_bad_crc_is_skipped_and_made_up_under_skip(tmp_path) -> None:
    urls = write_shards(tmp_path)
    data = bytearray(open(urls[1], "rb").read())
    offset = 0
    for _ in range(7):  # past records 0..6 of the shard: length (8), its CRC (4), data, data CRC (4)
        offset += 16 + int.from_bytes(data[offset : offset + 8], "little")
    data[offset + 12 + 5] ^= 0x01  # inside record 7's data: its data CRC no longer matches
    with open(urls[1], "wb") as f:
        f.write(data)
    with pytest.raises(CorruptRecordError, match="record 7"):
        list(shardkit.TFRecordDataset(urls, features=FEATURES, batch_size=16))
    dataset = shardkit.TFRecordDataset(urls, features=FEATURES, batch_size=16, on_error="skip").count_records()
    with pytest.warns(UserWarning, match="skipping record 7"):
        got = rows(list(dataset))
    assert len(got) == 120 and len({row[0] for row in got}) == 119  # one record lost, made up by a repeat


@pytest.mark.parametrize(
    ("misfit", "reason"),
    [
        ("shape", "feature 'xy' has 3 values, expected 2"),
        ("missing", "the record has no feature 'xy'"),
        ("type", "feature 'xy' holds bytes values, expected float32"),
    ],
)
def test_a_record_that_does_not_fit_the_features_costs_only_itself_under_skip(
    tmp_path, misfit: str, reason: str
) -> None:
    urls = write_shards(tmp_path, misfits={45: misfit})  # record 5 of part-1
    with pytest.raises(ShardkitError, match="feature 'xy'"):
        list(shardkit.TFRecordDataset(urls, features=FEATURES, batch_size=16))
    offset = record_offsets(urls[1])[5]
    where = rf"skipping record 5 of {re.escape(urls[1])}: .*record 5 at byte offset {offset}: .*{re.escape(reason)}"
    dataset = shardkit.TFRecordDataset(urls, features=FEATURES, batch_size=16, on_error="skip", balance="none")
    with pytest.warns(UserWarning, match=where):
        got = rows(list(dataset))
    assert [row[0] for row in got] == [i for i in range(120) if i != 45]
    assert dataset.stats().skipped.tolist() == [0, 1, 0] and dataset.stats().errors.tolist() == [0, 1, 0]
    padded = shardkit.TFRecordDataset(urls, features=FEATURES, batch_size=16, on_error="skip").count_records()
    with pytest.warns(UserWarning, match=where):
        got = rows(list(padded))
    assert len(got) == 120 and {row[0] for row in got} == set(range(120)) - {45}  # made up by a repeat


@pytest.mark.parametrize(
    "kwargs",
    [
        {"features": FEATURES},
        {"batch_size": 4},
        {"features": FEATURES, "batch_size": 0},
        {"features": FEATURES, "batch_size": 4, "decode": "raw"},
        {"features": {"x": ("int8", ())}, "batch_size": 4},
    ],
)
def test_features_and_batch_size_come_together_and_are_checked(tmp_path, kwargs: dict) -> None:
    with pytest.raises((ValueError, ShardkitError)):
        shardkit.TFRecordDataset(write_shards(tmp_path, shards=1, records=1), **kwargs)
