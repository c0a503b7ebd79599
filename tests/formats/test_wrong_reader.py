"""A file read with the wrong reader is named for what it is, not reported as corrupt TFRecord data;
verify, index and inspect skip index and manifest files by name."""

from __future__ import annotations

import gzip
import io
import re
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.cli import main
from shardkit.errors import CorruptRecordError
from shardkit.formats.sniff import describe_head


def write_files(root) -> dict[str, str]:
    """One file of each kind a TFRecord reader could be handed by mistake."""
    paths = {name: str(root / name) for name in ("p.parquet", "m.arrow", "t.tar", "g.gz", "j.jsonl")}
    pq.write_table(pa.table({"x": list(range(50))}), paths["p.parquet"])
    shardkit.ShardList(["/a.tfrecord"]).to_manifest(paths["m.arrow"])
    with tarfile.open(paths["t.tar"], "w") as tar:
        info = tarfile.TarInfo("0.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    with open(paths["g.gz"], "wb") as f:
        f.write(gzip.compress(b"not a tfrecord at all, just text" * 10))
    with open(paths["j.jsonl"], "w") as f:
        f.write('{"a": 1, "b": "some text here"}\n' * 5)
    return paths


@pytest.mark.parametrize(
    "name, says",
    [
        ("p.parquet", "this is a Parquet file; use ParquetDataset"),
        ("m.arrow", "this is an Arrow IPC file (a shard manifest?); use ShardList.from_manifest"),
        ("t.tar", "this is a tar file; use TarDataset"),
        ("j.jsonl", "this looks like a JSON lines file; use JsonlDataset"),
    ],
)
def test_reading_another_format_as_tfrecord_names_the_format_and_the_right_reader(tmp_path, name, says):
    url = write_files(tmp_path)[name]
    with pytest.raises(CorruptRecordError, match=re.escape(says)):
        list(shardkit.read_tfrecord(url, compression=None))


def test_reading_an_index_file_as_tfrecord_says_it_is_an_index(tmp_path):
    url = str(tmp_path / "a.tfrecord")
    with shardkit.TFRecordWriter(url) as w:
        for n in range(3):
            w.write(b"record %d" % n)
    assert main(["index", url]) == 0
    with pytest.raises(CorruptRecordError, match="this is a shardkit index file"):
        list(shardkit.read_tfrecord(url + ".idx"))


def test_a_gzip_file_read_uncompressed_still_suggests_the_compression(tmp_path):
    url = write_files(tmp_path)["g.gz"]
    with pytest.raises(CorruptRecordError, match="compression='gzip'"):
        list(shardkit.read_tfrecord(url, compression=None))


def test_describe_head_recognises_nothing_in_a_tfrecord_start():
    assert describe_head(b"\x05\x00\x00\x00\x00\x00\x00\x00abcd") is None


def test_verify_over_a_directory_skips_index_and_manifest_files_by_name(tmp_path, capsys):
    with shardkit.ShardWriter(str(tmp_path / "train-%05d.tfrecord"), max_records=2) as w:
        for n in range(4):
            w.write(b"r%d" % n)
    assert main(["index", str(tmp_path / "train-*.tfrecord")]) == 0
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "*")]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert f"skipped {tmp_path}/train-00000.tfrecord.idx: a shardkit index file" in out
    assert f"skipped {tmp_path}/train.manifest.arrow: an Arrow IPC file (a shard manifest?)" in out
    assert out.count("ok ") == 2


@pytest.mark.parametrize("command", ["inspect", "verify", "index"])
def test_a_manifest_given_as_data_is_skipped_by_name_not_called_corrupt(tmp_path, capsys, command):
    manifest = write_files(tmp_path)["m.arrow"]
    assert main([command, manifest]) == 0
    out, err = capsys.readouterr()
    assert (
        err == ""
        and out
        == f"skipped {manifest}: an Arrow IPC file (a shard manifest?); plan and verify --manifest read manifests\n"
    )


def test_a_tfrecord_dataset_over_a_parquet_file_says_to_use_parquet_dataset(tmp_path):
    url = write_files(tmp_path)["p.parquet"]
    with pytest.raises(CorruptRecordError, match="this is a Parquet file; use ParquetDataset"):
        list(shardkit.TFRecordDataset(url))


def test_a_corrupt_tfrecord_whose_length_starts_with_a_brace_is_not_called_json():
    header = (123).to_bytes(8, "little") + b"\xde\xad\xbe\xef"  # a length of 123 is "{" then NULs
    assert describe_head(header + b"x" * 123 + b"\n") is None
