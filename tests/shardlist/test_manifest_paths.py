"""Manifests store shard paths relative to the manifest (or absolute), so they read the same from any directory."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

import shardkit
from shardkit.cli import main
from shardkit.shardlist import ShardListError
from tests.helpers.processes import run_python


def write_three(pattern: str) -> shardkit.ShardList:
    with shardkit.ShardWriter(pattern, max_records=2) as writer:
        for n in range(5):
            writer.write(f"record {n}".encode())
    assert writer.shards is not None
    return writer.shards


def read_back(manifest: str) -> list[bytes]:
    return list(shardkit.TFRecordDataset(shardkit.ShardList.from_manifest(manifest), decode="raw"))


def test_a_relative_pattern_writes_a_manifest_that_reads_back_from_the_same_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_three("data/t-%05d.tfrecord")
    assert read_back("data/t.manifest.arrow") == [f"record {n}".encode() for n in range(5)]


def test_a_manifest_reads_back_from_any_working_directory(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    write_three("out/data/t-%05d.tfrecord")
    expected = [f"record {n}".encode() for n in range(5)]
    for cwd, manifest in [
        (tmp_path / "out", "data/t.manifest.arrow"),
        (tmp_path / "out" / "data", "t.manifest.arrow"),
        (tmp_path / "elsewhere", "../out/data/t.manifest.arrow"),
        (tmp_path / "elsewhere", str(tmp_path / "out/data/t.manifest.arrow")),
    ]:
        monkeypatch.chdir(cwd)
        assert read_back(manifest) == expected, (cwd, manifest)


def test_the_manifest_stores_paths_relative_to_itself_and_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_three("data/t-%05d.tfrecord")
    table = pa.ipc.open_file(str(tmp_path / "data/t.manifest.arrow")).read_all()
    assert table.column("url").to_pylist() == ["t-00000.tfrecord", "t-00001.tfrecord", "t-00002.tfrecord"]
    assert table.schema.metadata[b"paths"] == b"relative-to-manifest"


def test_shards_outside_the_manifest_folder_are_stored_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with shardkit.ShardWriter("data/t-%05d.tfrecord", manifest="lists/train.arrow") as writer:
        writer.write(b"x")
    table = pa.ipc.open_file(str(tmp_path / "lists/train.arrow")).read_all()
    assert table.column("url").to_pylist() == [str(tmp_path / "data/t-00000.tfrecord")]
    monkeypatch.chdir(tmp_path / "lists")
    assert read_back("train.arrow") == [b"x"]


def test_an_absolute_root_round_trips_too(tmp_path, monkeypatch):
    write_three(str(tmp_path / "abs/t-%05d.tfrecord"))
    monkeypatch.chdir(tmp_path / "abs")
    assert len(read_back("t.manifest.arrow")) == 5


def test_an_old_manifest_without_the_paths_key_keeps_resolving_against_its_folder(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.tfrecord").write_bytes(b"")
    table = pa.table({"url": ["a.tfrecord"], "num_records": pa.array([0], pa.int64()), "size": [0]})
    with pa.OSFile(str(tmp_path / "d" / "old.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    assert shardkit.ShardList.from_manifest(str(tmp_path / "d" / "old.arrow")).urls() == [
        str(tmp_path / "d" / "a.tfrecord")
    ]


def test_a_manifest_with_an_unknown_paths_key_is_refused_by_name(tmp_path):
    table = pa.table({"url": ["a.tfrecord"]}).replace_schema_metadata({"paths": "relative-to-moon"})
    with pa.OSFile(str(tmp_path / "m.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pytest.raises(ShardListError, match="relative-to-moon"):
        shardkit.ShardList.from_manifest(str(tmp_path / "m.arrow"))


@pytest.mark.slow  # a new interpreter importing torch: seconds of CPU
def test_a_manifest_written_in_one_process_reads_in_another_with_another_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_three("data/t-%05d.tfrecord")
    (tmp_path / "other").mkdir()
    code = (
        "import shardkit; shards = shardkit.ShardList.from_manifest('../data/t.manifest.arrow'); "
        "print(len(list(shardkit.TFRecordDataset(shards, decode='raw'))))"
    )
    done = run_python("-c", code, cwd=str(tmp_path / "other"), env={**os.environ})
    assert done.stdout.strip() == "5"


def test_plan_shows_the_shard_path_relative_to_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_three("data/t-%05d.tfrecord")
    assert main(["plan", "data/t.manifest.arrow", "--balance", "none"]) == 0
    out = capsys.readouterr().out
    assert "data/t-00000.tfrecord[0:2]" in out
