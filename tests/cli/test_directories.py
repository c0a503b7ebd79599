"""A directory where files are expected is named as a directory, in the library as in the CLI; plan takes one
shard file as well as a glob or a manifest."""

from __future__ import annotations

import pytest

import shardkit
from shardkit.cli import main
from shardkit.shardlist import ShardListError


def write_shards(root) -> None:
    with shardkit.ShardWriter(str(root / "train-%05d.tfrecord"), max_records=3) as w:
        for n in range(5):
            w.write(b"r%d" % n)


def test_a_dataset_over_a_directory_says_it_is_a_directory_and_how_to_glob(tmp_path):
    write_shards(tmp_path)
    with pytest.raises(ShardListError, match=r"is a directory; give files, or a glob such as '.*/\*\.tfrecord'"):
        shardkit.TFRecordDataset(str(tmp_path))


def test_read_tfrecord_of_a_directory_names_it_and_the_fix(tmp_path):
    with pytest.raises(IsADirectoryError, match=r"is a directory; give files, or a glob such as"):
        list(shardkit.read_tfrecord(str(tmp_path)))


def test_plan_of_one_shard_file_plans_that_file(tmp_path, capsys):
    write_shards(tmp_path)
    assert main(["index", str(tmp_path / "train-00000.tfrecord")]) == 0
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "train-00000.tfrecord")]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "1 shard, 3 records" in out and "from index files (1 of 1 shard)" in out


def test_plan_of_a_directory_says_it_is_a_directory(tmp_path, capsys):
    assert main(["plan", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
