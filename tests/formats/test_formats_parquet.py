"""Parquet shards: files of pyarrow.parquet with several row groups, read back by pyarrow and HF datasets;
ranges by row group, column batches, splits, faults, resume, S3."""

from __future__ import annotations

import itertools
import os
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit import CorruptRecordError, ParquetDataset
from shardkit.formats.parquet import ParquetFormat, ParquetWriter
from shardkit.formats.registry import format_for
from shardkit.sources import BalanceError
from tests.helpers.reading import ids_per_rank, rank_factory, sample_id
from tests.helpers.shards import format_ids, parquet_row, write_parquet_shards

SIZES = [17, 3, 0, 25, 9, 11]


row = parquet_row


def write_shards(root: str, sizes=SIZES, row_group_size: int = 4, storage_options=None) -> list[str]:
    return write_parquet_shards(root, sizes, row_group_size, storage_options)


def all_ids(sizes=SIZES) -> list[str]:
    return format_ids("parquet", sizes)


def test_rows_equal_what_pyarrow_and_hf_datasets_read(tmp_path, monkeypatch):
    urls = write_shards(str(tmp_path))
    ours = [r for url in urls for r in ParquetFormat().read(url)]
    assert ours == [row(n) for n in range(sum(SIZES))]
    assert ours == [r for url in urls for r in pq.read_table(url).to_pylist()]
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    datasets = pytest.importorskip("datasets")
    theirs = datasets.load_dataset(
        "parquet", data_files=[u for u in urls if pq.read_metadata(u).num_rows], split="train", streaming=True
    )
    assert [sample["id"] for sample in theirs] == [r["id"] for r in ours]
    assert [dict(sample) for sample in theirs][5] == ours[5]


def test_counts_come_from_the_footer_and_ranges_read_only_their_row_groups(tmp_path, monkeypatch):
    (url,) = write_shards(str(tmp_path), [50], row_group_size=8)
    fmt = ParquetFormat()
    assert fmt.count(url) == 50 and fmt.build_index(url) is None
    read_groups = []
    original = pq.ParquetFile.read_row_group

    def spy(self, i, *args, **kwargs):
        read_groups.append(i)
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    for start, stop in [(0, 1), (7, 9), (13, 40), (49, None), (50, 51), (45, 99)]:
        assert list(fmt.read(url, start, stop)) == [row(n) for n in range(50)][start:stop]
    assert read_groups == [0, 0, 1, 1, 2, 3, 4, 6, 5, 6]
    assert format_for(url).name == "parquet"
    assert format_for(url.replace(".parquet", ".dat"), head=open(url, "rb").read(512)).name == "parquet"


def test_columns_are_projected_and_batches_are_column_arrays(tmp_path):
    (url,) = write_shards(str(tmp_path), [50], row_group_size=8)
    assert list(ParquetFormat(columns=["n"]).read(url, 3, 5)) == [{"n": 3}, {"n": 4}]
    fmt = ParquetFormat(columns=["n", "x"], batch_size=16)
    assert fmt.count(url) == 4
    batches = list(fmt.read(url))
    assert [len(b["n"]) for b in batches] == [16, 16, 16, 2]
    np.testing.assert_array_equal(np.concatenate([b["n"] for b in batches]), np.arange(50))
    assert batches[1]["x"].dtype == np.float64
    assert [b["n"][0] for b in fmt.read(url, 2, 9)] == [32, 48]
    with pytest.raises(shardkit.ShardkitError, match="has no columns"):
        list(ParquetFormat(columns=["nope"]).read(url))


@pytest.mark.parametrize("batch_size", [0, 2.0, True])
def test_a_batch_size_that_is_not_a_positive_int_names_the_value_and_none(batch_size):
    with pytest.raises(shardkit.ShardkitError, match=rf"batch_size must be an int >= 1, got {batch_size!r} .*or None"):
        ParquetFormat(batch_size=batch_size)


def test_the_writer_writes_row_groups_pyarrow_reads(tmp_path):
    url = str(tmp_path / "w.parquet")
    with ParquetWriter(url, row_group_size=10) as writer:
        for n in range(25):
            writer.write(row(n))
    assert pq.ParquetFile(url).num_row_groups == 3
    assert pq.read_table(url).to_pylist() == [row(n) for n in range(25)]


def make_dataset(urls, **kwargs):
    return rank_factory(ParquetDataset, urls, **kwargs)


def batch_ids(batch: dict) -> list[str]:
    return [str(i) for i in batch["id"]]


@pytest.mark.parametrize("world_size", [1, 2])
def test_column_batches_split_exactly_once_and_manifest_counts_stay_rows(tmp_path, world_size):
    urls = write_shards(str(tmp_path))
    shards = shardkit.ShardList(urls, num_records=SIZES)  # rows, as a manifest holds them
    seen, lengths, batches = [], [], 0
    for rank in range(world_size):
        dataset = ParquetDataset(shards, batch_size=4, balance="none", rank=rank, world_size=world_size)
        lengths.append(len(dataset))
        for batch in dataset:
            seen += batch_ids(batch)
            batches += 1
    assert sorted(seen) == all_ids()
    assert sum(lengths) == batches == sum(-(-s // 4) for s in SIZES)  # len() counts batches, not rows


def flip_in_row_group(url: str, group: int, column: int = 1) -> int:
    """Flip a byte inside the data of ``column``'s last page in row group ``group`` (page CRCs catch it);
    return the byte offset where that column chunk starts."""
    from shardkit.formats.parquet import _chunk_start

    chunk = pq.ParquetFile(url).metadata.row_group(group).column(column)
    at = _chunk_start(chunk) + chunk.total_compressed_size - 3  # the size counts from the dictionary page
    with open(url, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x55]))
    return _chunk_start(chunk)


def test_a_corrupt_row_group_raises_with_its_first_record_and_column_chunk_offset(tmp_path):
    urls = write_shards(str(tmp_path), [20, 10], row_group_size=5)
    chunk_at = flip_in_row_group(urls[0], 2)  # rows 10..14, column "n"
    with pytest.raises(
        CorruptRecordError, match=r"part-000.parquet: records 10 to 14 \(5 records\) at byte offset \d+: row group 2"
    ) as info:
        list(ParquetDataset(urls, balance="none"))
    error = info.value
    assert (error.url, error.record_index, error.offset, error.framing_intact) == (urls[0], 10, chunk_at, True)
    assert error.records == 5 and "column 'n'" in error.reason
    with pytest.raises(CorruptRecordError) as info:  # a range starting inside the group names its own first record
        list(ParquetFormat().read(urls[0], 12, 18))
    assert (info.value.record_index, info.value.offset, info.value.records) == (12, chunk_at, 3)


def test_a_corrupt_row_group_costs_exactly_its_rows_under_skip_with_one_warning(tmp_path, monkeypatch):
    urls = write_shards(str(tmp_path), [20, 10], row_group_size=5)
    flip_in_row_group(urls[0], 2)
    decoded = []
    original = pq.ParquetFile.read_row_group

    def spy(self, i, *args, **kwargs):
        decoded.append(i)
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    lenient = ParquetDataset(shardkit.ShardList(urls, num_records=[20, 10]), balance="none", on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids = [r["id"] for r in lenient]
    assert [str(w.message)[:50] for w in caught] == [f"skipping records 10 to 14 (5 records) of {urls[0]}"[:50]]
    assert "row group 2" in str(caught[0].message)
    assert ids == all_ids([30])[:10] + all_ids([30])[15:]
    stats = lenient.stats()
    assert (stats.skipped.tolist(), stats.read.tolist(), stats.errors.tolist()) == ([5, 0], [15, 10], [1, 0])
    # The bad group is decoded once (plus once per column to find the bad chunk), not once per skipped row.
    assert decoded.count(2) == 1 + 2


@pytest.mark.filterwarnings("ignore:skipping record")
@pytest.mark.parametrize("balance", ["pad", "drop"])
@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_corrupt_row_group_keeps_planned_counts_equal_over_ranks(tmp_path, balance, num_workers):
    urls = write_shards(str(tmp_path), [20, 10, 7], row_group_size=5)
    flip_in_row_group(urls[0], 2)
    ranks = ids_per_rank(make_dataset(urls, balance=balance, on_error="skip"), world_size=3, num_workers=num_workers)
    per_rank = -(-37 // 3) if balance == "pad" else 37 // 3
    assert [sum(len(b) for b in batches) for batches in ranks] == [per_rank] * 3
    seen = {s for batches in ranks for batch in batches for s in batch}
    assert seen.isdisjoint(all_ids([37])[10:15])
    if balance == "pad":
        assert seen == set(all_ids([37])) - set(all_ids([37])[10:15])


@pytest.mark.parametrize("balance", ["pad", "drop"])
def test_a_corrupt_row_group_over_two_ranks_warns_once_and_counts_its_rows_as_skipped(tmp_path, balance):
    urls = write_shards(str(tmp_path), [20, 10, 7], row_group_size=5)
    chunk_at = flip_in_row_group(urls[0], 1)  # rows 5..9, column "n": its data pages, bytes really flipped
    datasets = [make_dataset(urls, balance=balance, on_error="skip")(rank, 2) for rank in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = [sum(1 for _ in dataset) for dataset in datasets]
    assert counts[0] == counts[1] == (-(-37 // 2) if balance == "pad" else 37 // 2)
    (warning,) = [w for w in caught if "skipping" in str(w.message)]
    text = str(warning.message)
    assert f"skipping records 5 to 9 (5 records) of {urls[0]}" in text
    assert f"records 5 to 9 (5 records) at byte offset {chunk_at}: row group 1" in text and "column 'n'" in text
    stats = [dataset.stats() for dataset in datasets]
    assert sum(s.total_skipped for s in stats) == 5 and sum(s.total_errors for s in stats) == 1
    if balance == "pad":
        assert sum(s.total_padded for s in stats) == 5  # each lost row made up by a repeat: the ranks stay in step


def test_a_corrupt_row_group_cut_into_shuffled_blocks_costs_its_rows_with_a_warning_per_block(tmp_path):
    urls = write_shards(str(tmp_path), [20, 10, 7], row_group_size=5)
    flip_in_row_group(urls[0], 1)  # rows 5..9
    datasets = [make_dataset(urls, balance="pad", on_error="skip", shuffle=True, seed=3)(rank, 2) for rank in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids = [[sample_id(s) for s in dataset] for dataset in datasets]
    assert len(ids[0]) == len(ids[1]) == -(-37 // 2)
    assert set(ids[0] + ids[1]) == set(all_ids([37])) - set(all_ids([37])[5:10])
    stats = [dataset.stats() for dataset in datasets]
    assert sum(s.total_skipped for s in stats) == 5
    skipping = [str(w.message) for w in caught if "skipping" in str(w.message)]
    assert len(skipping) == sum(s.total_errors for s in stats) <= 5  # one per planned block that holds bad rows


@pytest.mark.filterwarnings("ignore:skipping record")
def test_a_corrupt_row_group_costs_the_batches_holding_its_rows(tmp_path):
    urls = write_shards(str(tmp_path), [20, 10], row_group_size=5)
    flip_in_row_group(urls[0], 2, column=0)  # rows 10..14: batches 2 (rows 8..11) and 3 (12..15) of 4 rows
    lenient = ParquetDataset(urls, balance="none", on_error="skip", batch_size=4)
    rows = [i for batch in lenient for i in batch_ids(batch)]
    assert rows == all_ids([30])[:8] + all_ids([30])[16:]
    assert lenient.stats().skipped.tolist() == [2, 0]
    assert list(ParquetFormat(columns=["n", "x"]).read(urls[0], 10, 12)) == [{"n": n, "x": n / 7} for n in (10, 11)]


def test_a_truncated_file_is_a_located_error_or_a_counted_skip(tmp_path):
    urls = write_shards(str(tmp_path), [20, 10])
    with open(urls[0], "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(CorruptRecordError, match=r"part-000.parquet: record 0 .*the Parquet footer cannot be read"):
        ParquetFormat().count(urls[0])
    lenient = ParquetDataset(
        shardkit.ShardList(urls, num_records=[20, 10]), balance="pad", on_error="skip", rank=0, world_size=1
    )
    with pytest.warns(UserWarning, match="skipping 20 records"):
        ids = [r["id"] for r in lenient]
    assert len(ids) == 30 and set(ids) == set(all_ids([30])[20:])  # made up to the planned count by repeats
    assert lenient.stats().skipped.tolist() == [20, 0] and lenient.stats().padded.sum() == 20


def test_shard_writer_writes_parquet_shards_and_a_manifest(tmp_path):
    with shardkit.ShardWriter(str(tmp_path / "rows-%03d.parquet"), max_records=12) as writer:
        for n in range(30):
            writer.write(row(n))
    assert writer.shards.num_records.tolist() == [12, 12, 6]
    assert [r for url in writer.shards for r in pq.read_table(url).to_pylist()] == [row(n) for n in range(30)]
    manifest = shardkit.ShardList.from_manifest(str(tmp_path / "rows.manifest.arrow"))
    assert [r["id"] for r in ParquetDataset(manifest, balance="none")] == all_ids([30])
    batches = list(ParquetDataset(manifest, balance="none", batch_size=5))
    assert [len(b["id"]) for b in batches] == [5, 5, 2, 5, 5, 2, 5, 1]  # counts from the manifest are rows


@pytest.mark.parametrize("batch_size", [None, 4])
def test_len_resume_and_balanced_ranks_take_counts_from_the_footers_without_count_records(
    tmp_path, monkeypatch, batch_size
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no counts cached from another test
    urls = write_shards(str(tmp_path))

    def make(**options):
        return ParquetDataset(urls, batch_size=batch_size, **options)

    counted = make().count_records()
    assert make().shards.num_records is None
    assert len(make()) == len(counted)

    def ids(sample):
        return list(sample["id"]) if batch_size else [sample["id"]]

    dataset = make(shuffle=True, seed=4)
    iterator = iter(dataset)
    first = [i for _ in range(3) for i in ids(next(iterator))]
    state = dataset.state_dict()
    resumed = make(shuffle=True, seed=4)
    resumed.load_state_dict(state)
    assert sorted(first + [i for s in resumed for i in ids(s)]) == sorted(all_ids())
    if batch_size is None:
        ranks = [[s["id"] for s in make(rank=r, world_size=2, balance="drop")] for r in range(2)]
        assert len(ranks[0]) == len(ranks[1]) == sum(SIZES) // 2


# --------------------------------------------------------------------------- a footer whose counts lie


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        value, shift, pos = value | (byte & 0x7F) << shift, shift + 7, pos + 1
        if byte < 0x80:
            return value, pos


def _skip_thrift(buf: bytes, pos: int, kind: int, element: bool = False) -> int:
    """The position after a Thrift compact-protocol value of type ``kind`` at ``pos``."""
    if kind in (1, 2):  # a bool: in the field header, or one byte as a list element
        return pos + 1 if element else pos
    if kind in (3, 7):
        return pos + (1 if kind == 3 else 8)
    if kind in (4, 5, 6):
        return _varint(buf, pos)[1]
    if kind == 8:
        size, pos = _varint(buf, pos)
        return pos + size
    if kind in (9, 10):  # list, set: size and element type in one byte (size 15: a varint follows)
        size, inner, pos = buf[pos] >> 4, buf[pos] & 0x0F, pos + 1
        if size == 15:
            size, pos = _varint(buf, pos)
        for _ in range(size):
            pos = _skip_thrift(buf, pos, inner, element=True)
        return pos
    if kind == 11:  # map
        size, pos = _varint(buf, pos)
        if size:
            key, value, pos = buf[pos] >> 4, buf[pos] & 0x0F, pos + 1
            for _ in range(size):
                pos = _skip_thrift(buf, _skip_thrift(buf, pos, key, True), value, True)
        return pos
    assert kind == 12, kind  # a struct: fields up to the stop byte
    last = 0
    while buf[pos]:
        delta, inner, pos = buf[pos] >> 4, buf[pos] & 0x0F, pos + 1
        if not delta:
            _, pos = _varint(buf, pos)  # a long-form field id
        pos = _skip_thrift(buf, pos, inner)
        last += delta
    return pos + 1


def rewrite_footer_num_rows(url: str, num_rows: int) -> None:
    """Set ``FileMetaData.num_rows`` (Thrift field 3, an i64 zigzag varint) in the footer, the row groups untouched."""
    with open(url, "rb") as f:
        data = f.read()
    assert data.endswith(b"PAR1")
    length = int.from_bytes(data[-8:-4], "little")
    meta = data[-8 - length : -8]
    pos, field = 0, 0
    while True:
        delta, kind, pos = meta[pos] >> 4, meta[pos] & 0x0F, pos + 1
        assert delta, "a long-form field id in FileMetaData"
        field += delta
        if field == 3:
            break
        pos = _skip_thrift(meta, pos, kind)
    assert kind == 6
    end = _varint(meta, pos)[1]
    zigzag, encoded = (num_rows << 1) ^ (num_rows >> 63), bytearray()
    while True:
        encoded.append(zigzag & 0x7F | (0x80 if zigzag > 0x7F else 0))
        zigzag >>= 7
        if not zigzag:
            break
    meta = meta[:pos] + bytes(encoded) + meta[end:]
    with open(url, "wb") as f:
        f.write(data[: -8 - length] + meta + len(meta).to_bytes(4, "little") + b"PAR1")
    assert pq.ParquetFile(url).metadata.num_rows == num_rows  # pyarrow reports the lie


@pytest.mark.parametrize("num_rows", [2**62, -5, 31, 0])
def test_a_footer_whose_row_count_disagrees_with_its_row_groups_is_a_located_error(tmp_path, num_rows):
    urls = write_shards(str(tmp_path), [30, 20], row_group_size=4)
    rewrite_footer_num_rows(urls[0], num_rows)
    footer_at = os.path.getsize(urls[0]) - 8 - pq.ParquetFile(urls[0]).metadata.serialized_size
    with pytest.raises(CorruptRecordError, match=rf"footer says it holds {num_rows} rows, its 8 row groups 30") as info:
        list(ParquetDataset(urls, balance="none"))
    error = info.value
    assert (error.url, error.record_index, error.offset, error.framing_intact) == (urls[0], 0, footer_at, False)
    with pytest.raises(CorruptRecordError, match="footer says"):
        ParquetFormat().build_index(urls[0])  # `shardkit index` checks the footer


@pytest.mark.filterwarnings("ignore:skipping")
@pytest.mark.parametrize("num_rows", [2**62, -5])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_footer_whose_row_count_lies_is_skipped_and_counted_and_the_padded_epoch_ends(
    tmp_path, monkeypatch, num_rows, batch_size
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no counts cached from another test
    urls = write_shards(str(tmp_path), [30, 20], row_group_size=4)
    rewrite_footer_num_rows(urls[0], num_rows)
    records = [30, 20] if batch_size is None else [8, 5]
    per_rank = sum(records) // 2 + sum(records) % 2
    good = all_ids([50])[30:]
    seen: list[str] = []
    for rank in range(2):
        dataset = ParquetDataset(urls, balance="pad", on_error="skip", rank=rank, world_size=2, batch_size=batch_size)
        assert len(dataset) == per_rank
        got = list(itertools.islice(dataset, 10 * per_rank))  # ends long before the cap
        assert len(got) == per_rank
        seen += [i for sample in got for i in (batch_ids(sample) if batch_size else [sample["id"]])]
        assert dataset.stats().skipped.tolist()[0] > 0
    assert set(seen) == set(good)  # every row of the sound shard, none from the one whose footer lies


@pytest.mark.filterwarnings("ignore:skipping")
@pytest.mark.parametrize("balance", ["pad", "drop"])
def test_a_shard_skipped_whole_that_leaves_nothing_to_stand_in_is_a_balance_error_naming_its_file_and_cause(
    tmp_path, monkeypatch, balance
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no counts cached from another test
    urls = write_shards(str(tmp_path), [30], row_group_size=4)
    rewrite_footer_num_rows(urls[0], 2**62)
    dataset = ParquetDataset(urls, balance=balance, on_error="skip", rank=1, world_size=2)
    with pytest.raises(BalanceError, match="rank 1 cannot yield its planned 15 samples") as info:
        list(dataset)
    first = f"The first failure: CorruptRecordError: {urls[0]}: record 15 at byte offset"  # rank 1 reads from 15
    assert first in str(info.value) and f"footer says it holds {2**62} rows, its 8 row groups 30" in str(info.value)
    assert "Fix: repair or remove that file" in str(info.value)
