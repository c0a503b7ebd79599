"""The format interface: the registry finds formats by suffix and magic bytes; TFRecordFormat binds the TFRecord reader."""

from __future__ import annotations

import pickle

import pytest

import shardkit
from shardkit.formats.base import FormatError, ShardFormat
from shardkit.formats.jsonl import JsonlFormat
from shardkit.formats.parquet import ParquetFormat
from shardkit.formats.registry import format_for, formats, register_format
from shardkit.formats.tar import TarFormat
from shardkit.formats.tfrecord import TFRecordFormat, read_tfrecord
from tests.helpers.shards import record_offsets


def test_the_builtin_formats_are_registered_and_satisfy_the_protocol():
    registered = formats()
    assert set(registered) >= {"tfrecord", "tar", "parquet", "jsonl"}
    for fmt in registered.values():
        assert isinstance(fmt, ShardFormat)
        assert pickle.loads(pickle.dumps(fmt)).name == fmt.name  # travels to DataLoader workers


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a/train-0001.tar", "tar"),
        ("s3://b/x.tar.gz", "tar"),
        ("x.TGZ", "tar"),
        ("rows.parquet", "parquet"),
        ("lines.jsonl.gz", "jsonl"),
        ("lines.ndjson", "jsonl"),
        ("data.tfrecord.gz", "tfrecord"),
        ("data.tfrecords", "tfrecord"),
        ("data/corpus_text_document.bin", "megatron"),
    ],
)
def test_suffixes_name_the_format(name, expected):
    assert format_for(name, head=b"").name == expected


def test_magic_bytes_decide_when_the_suffix_does_not(tmp_path):
    url = str(tmp_path / "part-00000-of-00004")
    with shardkit.TFRecordWriter(url) as writer:
        writer.write(b"{" * 123 + b"\n")  # a length byte of "{" and a newline: still TFRecord, by its CRC
    assert format_for(url).name == "tfrecord"
    (tmp_path / "unknown").write_bytes(b"\x00\x01 nothing known")
    with pytest.raises(FormatError, match="neither its name nor its first bytes match a known shard format"):
        format_for(str(tmp_path / "unknown"))


class _Lines:
    """A toy format: text lines (enough of the interface to register)."""

    name = "toy"
    suffixes = (".toy",)

    def sniff(self, head):
        return head.startswith(b"TOY\n")

    def read(self, url, start=0, stop=None):
        with open(url) as f:
            yield from f.read().splitlines()[1:][start:stop]

    def count(self, url):
        return sum(1 for _ in self.read(url))

    def build_index(self, url):
        return None


def test_a_registered_format_is_found_and_reads_through_sharded_dataset(tmp_path):
    with pytest.raises(FormatError, match="lacks part of the ShardFormat interface"):
        register_format(object())
    fmt = register_format(_Lines())
    url = tmp_path / "a.toy"
    url.write_text("TOY\nx\ny\nz\n")
    assert format_for(str(url)) is fmt and format_for(str(tmp_path / "b"), head=b"TOY\n").name == "toy"
    dataset = shardkit.ShardedDataset([str(url)], fmt.read, count_fn=fmt.count, balance="pad", rank=1, world_size=2)
    assert list(dataset) == ["z", "x"]  # rank 1 of 2 over 3 records, padded


def test_tfrecord_format_reads_counts_and_indexes_like_the_tfrecord_functions(tmp_path):
    url = str(tmp_path / "a.tfrecord")
    with shardkit.TFRecordWriter(url) as writer:
        for n in range(30):
            writer.write(b"r%d" % n * n)
    fmt = TFRecordFormat()
    assert list(fmt.read(url)) == list(read_tfrecord(url))
    assert fmt.count(url) == 30 and fmt.sniff(open(url, "rb").read(512))
    assert fmt.build_index(url) == url + ".idx"
    assert list(fmt.read(url, 11, 14)) == list(read_tfrecord(url))[11:14]
    assert record_offsets(url)[11] > 0
    with fmt.writer(str(tmp_path / "b.tfrecord")) as writer:
        writer.write(b"x")
    assert list(read_tfrecord(str(tmp_path / "b.tfrecord"))) == [b"x"]


@pytest.mark.parametrize("fmt", [TarFormat(), ParquetFormat(), JsonlFormat(), TFRecordFormat()])
def test_bad_ranges_are_refused(fmt):
    with pytest.raises(ValueError, match="need 0 <= start <= stop"):
        next(iter(fmt.read("x", 5, 2)))


def mixed_id(sample: dict) -> str:
    """Which format a sample came from, and its id (Parquet rows have "n", JSON lines "nested")."""
    if "__key__" in sample:
        return f"tar:{sample['__key__']}"
    return f"{'parquet' if 'n' in sample else 'jsonl'}:{sample['id']}"


def _mixed(tmp_path, rank, world):
    from tests.formats.test_formats_jsonl import write_shards as write_jsonl
    from tests.formats.test_formats_parquet import write_shards as write_parquet
    from tests.formats.test_formats_tar import write_shards as write_tars

    roots = [tmp_path / name for name in ("tar", "parquet", "jsonl")]
    for root in roots:
        root.mkdir(exist_ok=True)
    sources = [
        shardkit.TarDataset(write_tars(str(roots[0]), [9, 4]), rank=rank, world_size=world, shuffle=True),
        shardkit.ParquetDataset(write_parquet(str(roots[1]), [6, 7]), rank=rank, world_size=world, shuffle=True),
        shardkit.JsonlDataset(write_jsonl(str(roots[2]), [5, 8]), rank=rank, world_size=world, shuffle=True),
    ]
    return shardkit.interleave(sources, weights=[1, 2, 1], seed=3, stop="all_exhausted")


@pytest.mark.slow
def test_the_formats_mix_with_every_sample_once_over_ranks_and_spawned_or_forked_workers(tmp_path):
    from torch.utils.data import DataLoader

    seen = []
    for rank, start in ((0, "spawn"), (1, "fork")):  # one rank each: spawned workers cost seconds to start
        loader = DataLoader(
            _mixed(tmp_path, rank, 2).map(mixed_id), batch_size=5, num_workers=2, multiprocessing_context=start
        )
        seen += [s for batch in loader for s in batch]
    expected = {f"{kind}:{key}" for kind, prefix in (("tar", "s"), ("parquet", "r"), ("jsonl", "r")) for key in
                (f"{prefix}{n:05d}" for n in range(13))}  # fmt: skip
    assert set(seen) == expected
    # balance="pad" over 2 ranks: each source's 13 records become 14, the one repeat the only duplicate
    assert len(seen) == 3 * 14 and all(seen.count(s) <= 2 for s in seen)


@pytest.mark.parametrize("indexed", [False, True])
def test_tfrecord_format_read_raises_at_a_bad_record_and_read_marked_reads_past_it(tmp_path, indexed):
    from shardkit import CorruptRecordError
    from shardkit.formats.base import BadRecord

    url = str(tmp_path / "a.tfrecord")
    records = [b"record %02d" % n for n in range(10)]  # 9 data bytes: 25 framed each
    with shardkit.TFRecordWriter(url) as writer:
        for record in records:
            writer.write(record)
    if indexed:
        shardkit.build_index(url)
    data = bytearray(open(url, "rb").read())
    data[4 * 25 + 12] ^= 0xFF  # a data byte of record 4: its data CRC fails, the framing holds
    open(url, "wb").write(bytes(data))

    with pytest.raises(CorruptRecordError, match="record 4 at byte offset 100: data CRC mismatch"):
        list(TFRecordFormat().read(url))
    marked = list(TFRecordFormat().read_marked(url, 2, None))
    assert [r for r in marked if not isinstance(r, BadRecord)] == records[2:4] + records[5:]
    assert marked[2].error.record_index == 4 and marked[2].error.framing_intact

    def fussy(record: bytes) -> bytes:
        if record.endswith(b"07"):
            raise ValueError("no sevens")
        return record.upper()

    decoded = list(TFRecordFormat(decode=fussy).read_marked(url, 5, 9))
    assert decoded[:2] == [b"RECORD 05", b"RECORD 06"] and decoded[3] == b"RECORD 08"
    bad = decoded[2].error
    assert (bad.record_index, bad.offset) == (7, 175)  # from the index, or without one from a scan
    assert "does not decode with fussy" in str(bad)
    with pytest.raises(CorruptRecordError, match="no sevens"):
        list(TFRecordFormat(decode=fussy).read(url, 5, 9))


def test_a_process_cache_drops_the_least_recently_used_and_arrives_empty_where_it_is_pickled():
    from shardkit.formats.base import ProcessCache

    built: list[str] = []

    def build(key: str) -> bytes:
        built.append(key)
        return key.encode() * 4

    cache: ProcessCache[bytes] = ProcessCache(10, len)  # 10 bytes: two 4-byte values fit, three do not
    for key in ("a", "b", "a", "c", "a", "b"):
        assert cache.get(key, lambda key=key: build(key)) == key.encode() * 4
    assert built == ["a", "b", "c", "b"]  # "b" was least recently used when "c" came
    copy = pickle.loads(pickle.dumps(cache))
    assert (len(cache), len(copy), copy.most, copy.weigh) == (2, 0, 10, len)
