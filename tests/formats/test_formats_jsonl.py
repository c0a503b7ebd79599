"""JSON lines shards: lines written by json, compression, newline index, splits, faults, resume, S3."""

from __future__ import annotations

import gzip
import json

import pytest

import shardkit
from shardkit import CorruptRecordError, JsonlDataset
from shardkit.formats.jsonl import JsonlFormat, JsonlWriter
from shardkit.formats.offsets import IndexFileError
from shardkit.formats.registry import format_for
from tests.helpers.reading import rank_factory
from tests.helpers.shards import format_ids, jsonl_row, write_jsonl_shards

SIZES = [17, 3, 0, 25, 9, 11]


row = jsonl_row


def write_shards(root: str, sizes=SIZES, suffix: str = ".jsonl", storage_options=None) -> list[str]:
    return write_jsonl_shards(root, sizes, suffix, storage_options)


def all_ids(sizes=SIZES) -> list[str]:
    return format_ids("jsonl", sizes)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_lines_written_by_json_read_back_equal_with_any_compression(tmp_path, suffix):
    if suffix.endswith(".zst"):
        zstandard = pytest.importorskip("zstandard")
        url = str(tmp_path / f"a{suffix}")
        with open(url, "wb") as f:
            f.write(zstandard.ZstdCompressor().compress("".join(json.dumps(row(n)) + "\n" for n in range(40)).encode()))
    else:
        (url,) = write_shards(str(tmp_path), [40], suffix)
    fmt = JsonlFormat()
    assert list(fmt.read(url)) == [row(n) for n in range(40)]
    assert list(fmt.read(url, 5, 9)) == [row(n) for n in range(5, 9)]
    assert fmt.count(url) == 40
    assert format_for(url).name == "jsonl"


def test_blank_lines_and_a_missing_final_newline(tmp_path):
    url = tmp_path / "a.jsonl"
    url.write_bytes(b'{"id": 1}\n\n  \n{"id": 2}\r\n[3]\n"four"')
    fmt = JsonlFormat()
    assert list(fmt.read(str(url))) == [{"id": 1}, {"id": 2}, [3], "four"]
    assert fmt.count(str(url)) == 4
    fmt.build_index(str(url))
    assert list(fmt.read(str(url), 1, 3)) == [{"id": 2}, [3]]
    assert fmt.count(str(url)) == 4


def test_a_newline_index_counts_and_seeks(tmp_path):
    (url,) = write_shards(str(tmp_path), [300])
    fmt = JsonlFormat()
    assert fmt.build_index(url) == url + ".idx"
    assert fmt.count(url) == 300
    for start, stop in [(0, 1), (150, 152), (299, None), (300, 301), (290, 999)]:
        assert list(fmt.read(url, start, stop)) == [row(n) for n in range(300)][start:stop]
    assert format_for(url.replace(".jsonl", ".data"), head=open(url, "rb").read(512)).name == "jsonl"


def test_the_writer_writes_lines_json_reads(tmp_path):
    url = str(tmp_path / "w.jsonl")
    with JsonlWriter(url) as writer:
        for n in range(5):
            writer.write(row(n))
    with open(url) as f:
        assert [json.loads(line) for line in f] == [row(n) for n in range(5)]


def make_dataset(urls, **kwargs):
    return rank_factory(JsonlDataset, urls, **kwargs)


def corrupt_line(url: str, line: int) -> int:
    """Replace one line's first byte by an unbalanced bracket; return the line's byte offset."""
    with open(url, "rb") as f:
        data = f.read()
    offset = 0
    for _ in range(line):
        offset = data.index(b"\n", offset) + 1
    with open(url, "r+b") as f:
        f.seek(offset)
        f.write(b"]")
    return offset


@pytest.mark.parametrize("indexed", [False, True])
def test_a_malformed_line_raises_with_its_location_or_costs_exactly_that_line(tmp_path, indexed):
    urls = write_shards(str(tmp_path), [10, 10])
    offsets = [corrupt_line(urls[0], 4), corrupt_line(urls[0], 7)]
    if indexed:
        JsonlFormat().build_index(urls[0])
    with pytest.raises(
        CorruptRecordError, match=rf"part-000.jsonl: record 4 at byte offset {offsets[0]}: line 5 is not valid JSON"
    ) as info:
        list(JsonlDataset(urls, balance="none"))
    assert info.value.framing_intact
    lenient = JsonlDataset(urls, balance="none", on_error="skip")
    with pytest.warns(UserWarning, match="skipping record 4 of .*part-000.jsonl"):
        ids = [r["id"] for r in lenient]
    assert ids == [i for n, i in enumerate(all_ids([20])) if n not in (4, 7)]
    stats = lenient.stats()
    assert stats.skipped.tolist() == [2, 0] and stats.read.tolist() == [8, 10]


def test_a_truncated_gzip_shard_is_a_located_error_or_a_counted_skip(tmp_path):
    urls = write_shards(str(tmp_path), [200, 10], ".jsonl.gz")
    with open(urls[0], "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    with pytest.raises(CorruptRecordError, match=r"part-000.jsonl.gz: record \d+ .*gzip stream is truncated"):
        list(JsonlFormat().read(urls[0]))
    lenient = JsonlDataset(shardkit.ShardList(urls, num_records=[200, 10]), balance="none", on_error="skip")
    with pytest.warns(UserWarning, match="skipping"):
        ids = [r["id"] for r in lenient]
    stats = lenient.stats()
    assert len(ids) == stats.read.sum() and stats.read[0] + stats.skipped[0] == 200 and stats.read[1] == 10


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.999])
def test_a_gzip_shard_cut_mid_stream_yields_every_complete_line_then_a_located_error(tmp_path, fraction):
    import zlib

    (url,) = write_shards(str(tmp_path), [3000], ".jsonl.gz")
    with open(url, "rb") as f:
        data = f.read()
    cut = int(len(data) * fraction)
    with open(url, "wb") as f:
        f.write(data[:cut])
    recoverable = zlib.decompressobj(31).decompress(data[:cut])  # an independent inflater's view of the prefix
    complete = recoverable.count(b"\n")
    read = []
    with pytest.raises(CorruptRecordError, match="gzip stream is truncated") as info:
        read.extend(JsonlFormat().read(url))
    assert [r["id"] for r in read] == all_ids([complete])
    error = info.value
    assert (error.url, error.record_index, error.offset) == (url, complete, recoverable.rindex(b"\n") + 1)


@pytest.mark.filterwarnings("ignore:skipping record")
def test_a_last_line_cut_short_without_a_newline_costs_exactly_that_line(tmp_path):
    urls = write_shards(str(tmp_path), [10, 4])
    with open(urls[0], "r+b") as f:
        data = f.read()
        f.truncate(len(data) - 20)  # inside the last line: no newline, not JSON
    last = data.rindex(b"\n", 0, len(data) - 1) + 1
    with pytest.raises(CorruptRecordError, match=rf"record 9 at byte offset {last}: line 10 is not valid JSON") as info:
        list(JsonlFormat().read(urls[0]))
    assert info.value.framing_intact
    assert JsonlFormat().count(urls[0]) == 10  # a scan counts it: numbering matches the planned count
    ranks = [JsonlDataset(urls, balance="pad", on_error="skip", rank=rank, world_size=2) for rank in (0, 1)]
    ids = [[r["id"] for r in lenient] for lenient in ranks]
    assert [len(i) for i in ids] == [7, 7]  # the planned count on each rank, made up by a repeat
    assert set(ids[0] + ids[1]) == set(all_ids([14])) - {"r00009"}
    assert sum(lenient.stats().skipped.tolist()[0] for lenient in ranks) == 1
    assert sum(int(lenient.stats().padded.sum()) for lenient in ranks) == 1


def test_a_stale_index_is_refused_for_seeking_and_replaced_by_a_scan_for_counting(tmp_path):
    (url,) = write_shards(str(tmp_path), [30])
    fmt = JsonlFormat()
    fmt.build_index(url)
    with open(url, "ab") as f:
        f.write(b'{"id": "extra"}\n')
    with pytest.raises(IndexFileError, match="part-000.jsonl.idx does not fit"):
        list(fmt.read(url, 3))
    with pytest.warns(UserWarning, match="counting its lines by a scan instead"):
        assert fmt.count(url) == 31
    write_shards(str(tmp_path), [30])  # same size as indexed, lines shifted by one byte
    with open(url, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(b" " + data[:-1] + b"\n")
    with pytest.raises(IndexFileError):
        list(fmt.read(url, 3))


def test_a_bad_line_far_in_is_located_by_line_number_and_byte_offset(tmp_path):
    (url,) = write_shards(str(tmp_path), [1200])
    offset = corrupt_line(url, 1000)
    with pytest.raises(CorruptRecordError, match=rf"record 1000 at byte offset {offset}: line 1001 is not valid JSON"):
        list(JsonlFormat().read(url))
    assert [r["id"] for r in JsonlFormat().read(url, 990, 1000)] == all_ids([1000])[990:]


def test_deep_nesting_and_bad_utf8_are_corrupt_records_not_crashes(tmp_path):
    url = tmp_path / "deep.jsonl"
    url.write_bytes(b'{"id": 0}\n' + b"[" * 100_000 + b"]" * 100_000 + b'\n"\xff\xfe"\n{"id": 3}\n')
    lenient = JsonlDataset([str(url)], balance="none", on_error="skip")
    with pytest.warns(UserWarning, match="skipping record 1 .*RecursionError"):
        assert [r["id"] for r in lenient] == [0, 3]
    assert lenient.stats().skipped.tolist() == [2]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_shard_writer_writes_jsonl_shards_and_a_manifest(tmp_path, suffix):
    with shardkit.ShardWriter(str(tmp_path / f"rows-%03d{suffix}"), max_records=12) as writer:
        for n in range(30):
            writer.write(row(n))
    assert writer.shards.num_records.tolist() == [12, 12, 6]
    opener = gzip.open if suffix.endswith(".gz") else open
    with opener(writer.shards[2], "rt") as f:
        assert [json.loads(line) for line in f] == [row(n) for n in range(24, 30)]
    manifest = shardkit.ShardList.from_manifest(str(tmp_path / "rows.manifest.arrow"))
    assert [r["id"] for r in JsonlDataset(manifest, balance="none")] == all_ids([30])
