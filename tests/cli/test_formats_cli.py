"""The CLI on tar, Parquet and JSON lines files: inspect, verify, index, plan and convert, exit codes 0/1/2."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import webdataset as wds

import shardkit
from shardkit.cli import main
from shardkit.formats.tar import TarFormat
from tests.formats.test_formats_jsonl import corrupt_line
from tests.formats.test_formats_tar import header_offsets
from tests.helpers.cli import run_cli
from tests.helpers.shards import jsonl_row as json_row
from tests.helpers.shards import write_jsonl_shards as write_jsonl
from tests.helpers.shards import write_parquet_shards as write_parquet
from tests.helpers.shards import write_tar_shards as write_tars


def one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shardkit {command}: error: "), err
    return lines[0]


def test_inspect_verify_and_index_work_on_every_format(tmp_path, capsys):
    tars = write_tars(str(tmp_path), [5, 7])
    lines = write_jsonl(str(tmp_path), [4, 6])
    parquets = write_parquet(str(tmp_path), [3, 8])
    assert main(["index", *tars, *lines, *parquets]) == 0
    out = capsys.readouterr().out
    assert f"{tars[1]} -> {tars[1]}.idx" in out and f"{lines[0]} -> {lines[0]}.idx" in out
    assert "a parquet file needs no index" in out
    assert TarFormat().index_offsets(tars[1]) is not None
    assert main(["verify", *tars, *lines, *parquets]) == 0
    out = capsys.readouterr().out
    assert (
        f"ok {tars[1]}: 7 records" in out
        and f"ok {lines[1]}: 6 records" in out
        and f"ok {parquets[1]}: 8 records" in out
    )
    assert main(["inspect", tars[0], parquets[1], lines[0]]) == 0
    out = capsys.readouterr().out
    assert "5 records; format: tar" in out and "bin: bytes[" in out
    assert "8 records; format: parquet" in out and "jsonl" in out
    assert main(["plan", str(tmp_path / "part-*.parquet"), "--world-size", "2"]) == 0
    assert "from index files (2 of 2 shards)" in capsys.readouterr().out  # Parquet footers


def test_corrupt_files_of_every_format_exit_1_with_one_located_line(tmp_path, capsys):
    (tar,) = write_tars(str(tmp_path), [6])
    offset = header_offsets(tar)[6]
    with open(tar, "r+b") as f:
        f.seek(offset + 1)
        f.write(b"#")
    (line,) = write_jsonl(str(tmp_path), [9])
    at = corrupt_line(line, 3)
    (parquet,) = write_parquet(str(tmp_path), [10])
    with open(parquet, "r+b") as f:
        f.truncate(f.seek(0, 2) - 20)
    for url, where in [
        (tar, f"record 2 at byte offset {offset}"),  # the damaged header is sample 2's
        (line, f"record 3 at byte offset {at}: line 4"),
        (parquet, "record 0"),
    ]:
        assert main(["verify", url]) == 1
        assert where in one_error_line(capsys.readouterr().err, "verify")
    assert main(["verify", tar, str(tmp_path / "missing.tar")]) == 2  # 2 wins over 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 2


def test_convert_round_trips_records_through_every_format_with_manifests(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (source,) = write_jsonl(str(tmp_path / "src"), [50])
    assert main(["convert", source, "pq/rows-%03d.parquet", "--format", "parquet", "--max-records", "20"]) == 0
    assert "50 records from 1 files -> 3 parquet shards" in capsys.readouterr().out
    manifest = shardkit.ShardList.from_manifest("pq/rows.manifest.arrow")
    assert manifest.num_records.tolist() == [20, 20, 10]
    assert [r for url in manifest for r in pq.read_table(url).to_pylist()] == [
        json.loads(json.dumps(json_row(n))) for n in range(50)
    ]
    assert main(["convert", "pq/rows-*.parquet", "tar/s-%02d.tar", "--format", "tar", "--max-records", "30"]) == 0
    samples = [
        s
        for url in shardkit.ShardList.from_manifest("tar/s.manifest.arrow")
        for s in wds.WebDataset(url, shardshuffle=False)
    ]
    assert [s["__key__"] for s in samples] == [f"{n:09d}" for n in range(50)]
    assert samples[7]["id"] == b"r00007" and json.loads(samples[7]["values"]) == json_row(7)["values"]
    assert main(["convert", "tar/s-*.tar", "back/%02d.jsonl", "--format", "jsonl"]) == 0
    back = list(shardkit.JsonlDataset(shardkit.ShardList.from_manifest("back/manifest.arrow"), balance="none"))
    assert [r["id"] for r in back] == [f"r{n:05d}" for n in range(50)]


def test_convert_of_a_corrupt_source_exits_1_and_writes_no_manifest(tmp_path, capsys):
    urls = write_jsonl(str(tmp_path / "src"), [10, 10])
    corrupt_line(urls[1], 5)
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "src" / "*.jsonl"), str(out / "p-%02d.parquet"), "--format", "parquet"]) == 1
    assert "part-001.jsonl: record 5" in one_error_line(capsys.readouterr().err, "convert")
    assert not (out / "p.manifest.arrow").exists() and not list(out.glob("*.partial"))
    assert main(["convert", urls[0], str(out / "t-%02d.tfrecord"), "--format", "tfrecord"]) == 2
    assert "a tf.Example feature holds bytes, ints or floats" in one_error_line(capsys.readouterr().err, "convert")
    assert main(["convert", urls[0], str(out / "t-%02d.tfrecord"), "--format", "tfrecord", "--decode", "raw"]) == 2
    assert "TFRecord shards are written from TFRecord" in one_error_line(capsys.readouterr().err, "convert")


def test_the_console_script_converts_with_a_progress_bar_and_documented_help(tmp_path):
    (source,) = write_jsonl(str(tmp_path), [5])
    result = subprocess.run(
        [sys.executable, "-m", "shardkit", "convert", source, str(tmp_path / "o-%02d.tar"), "--format", "tar"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "5 records from 1 files -> 1 tar shards" in result.stdout
    help_text = run_cli("convert", "--help").stdout  # the same parser: no second process needed
    assert "--max-records" in help_text and "exit codes: 0 converted; 1 a source file is corrupt" in help_text.replace(
        "\n", " "
    )


def test_convert_usage_errors_exit_2_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["convert", "a.jsonl", "b-%02d.tar"])
    assert info.value.code == 2
    assert "the following arguments are required: --format" in one_error_line(capsys.readouterr().err, "convert")
