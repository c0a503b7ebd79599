"""`shardkit convert` turns tf.Example features into Parquet columns, tar members and JSON fields, and back,
byte for byte."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.cli import main
from shardkit.formats.tar import TarFormat


def example(n: int) -> bytes:
    return shardkit.encode_example(
        {
            "image/encoded": [bytes([n, 255, 0])],  # not UTF-8
            "label": n,
            "caption": [f"caption {n}".encode()],
            "box": np.array([0.1 * n, 0.5, 1.0, 2.0], np.float32),
            "tags": [b"a", b"b"][: n % 3],
        }
    )


def write_examples(root, count: int = 7) -> list[bytes]:
    records = [example(n) for n in range(count)]
    with shardkit.TFRecordWriter(str(root / "src.tfrecord")) as w:
        for record in records:
            w.write(record)
    return records


def tfrecords(pattern: str) -> list[bytes]:
    return list(shardkit.read_tfrecord(pattern % 0))


def test_convert_to_parquet_writes_one_column_per_feature(tmp_path, capsys):
    write_examples(tmp_path)
    assert (
        main(["convert", str(tmp_path / "src.tfrecord"), str(tmp_path / "p-%02d.parquet"), "--format", "parquet"]) == 0
    )
    table = pq.read_table(tmp_path / "p-00.parquet")
    assert table.schema.field("label").type == pa.int64()
    assert table.schema.field("image/encoded").type == pa.binary()
    assert table.schema.field("box").type == pa.list_(pa.float32())
    assert table.column("caption").to_pylist()[3] == b"caption 3"
    assert table.column("tags").to_pylist()[:3] == [[], [b"a"], [b"a", b"b"]]


def test_convert_to_jsonl_writes_json_fields_with_base64_for_binary_bytes(tmp_path):
    write_examples(tmp_path)
    assert main(["convert", str(tmp_path / "src.tfrecord"), str(tmp_path / "j-%02d.jsonl"), "--format", "jsonl"]) == 0
    first = json.loads((tmp_path / "j-00.jsonl").read_text().splitlines()[1])
    assert first["label"] == 1 and first["caption"] == "caption 1" and first["tags"] == ["a"]
    assert first["image/encoded"] == {"base64": "Af8A"}


def test_convert_to_tar_writes_one_member_per_feature(tmp_path):
    write_examples(tmp_path)
    assert main(["convert", str(tmp_path / "src.tfrecord"), str(tmp_path / "t-%02d.tar"), "--format", "tar"]) == 0
    sample = list(TarFormat().read(str(tmp_path / "t-00.tar")))[2]
    assert sample["image%2fencoded"] == bytes([2, 255, 0])
    assert json.loads(sample["label.int64.json"]) == [2]
    assert json.loads(sample["tags.bytes.json"]) == ["YQ==", "Yg=="]


@pytest.mark.parametrize("fmt, suffix", [("parquet", "parquet"), ("jsonl", "jsonl"), ("tar", "tar")])
def test_convert_there_and_back_gives_the_same_records_byte_for_byte(tmp_path, fmt, suffix):
    records = write_examples(tmp_path)
    middle = str(tmp_path / f"m-%02d.{suffix}")
    assert main(["convert", str(tmp_path / "src.tfrecord"), middle, "--format", fmt]) == 0
    back = str(tmp_path / "back-%02d.tfrecord")
    assert main(["convert", middle % 0, back, "--format", "tfrecord"]) == 0
    assert tfrecords(back) == records


def test_decode_raw_keeps_the_opaque_record_column(tmp_path):
    write_examples(tmp_path)
    out = str(tmp_path / "p-%02d.parquet")
    assert main(["convert", str(tmp_path / "src.tfrecord"), out, "--format", "parquet", "--decode", "raw"]) == 0
    assert pq.read_table(out % 0).column_names == ["record"]


def test_records_that_are_not_examples_stay_opaque_by_default(tmp_path):
    with shardkit.TFRecordWriter(str(tmp_path / "src.tfrecord")) as w:
        w.write(b"r1")
    out = str(tmp_path / "p-%02d.parquet")
    assert main(["convert", str(tmp_path / "src.tfrecord"), out, "--format", "parquet"]) == 0
    assert pq.read_table(out % 0).column("record").to_pylist() == [b"r1"]
