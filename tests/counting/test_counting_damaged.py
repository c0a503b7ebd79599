"""Counting a damaged shard under ``on_error="skip"``: a shard whose record count cannot be taken (a TFRecord
cut mid-record or with a bad length CRC, a tar cut mid-member, a gzip JSON lines file cut mid-stream, a Parquet
file without its footer) counts as what reading it yields, so a ``"pad"`` job over two ranks starts, reads every
sound record once, keeps its ranks equal and counts the break in ``stats()``. Under ``on_error="raise"`` counting
still raises, naming the shard. Every fault is injected for real into files on disk."""

from __future__ import annotations

import collections
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pytest

from shardkit import CorruptRecordError, JsonlDataset, ParquetDataset, TarDataset, TFRecordDataset, TFRecordWriter
from shardkit.counting import readable_count
from tests.helpers.reading import assert_split, ids_per_rank, rank_factory, sample_id
from tests.helpers.shards import record_offsets, write_jsonl_shards, write_parquet_shards, write_tar_shards

pytestmark = [
    pytest.mark.filterwarnings("ignore:skipping:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*counted as missing:UserWarning"),
]

SIZES = [6, 10, 5]
DAMAGED = 1  # the shard each case breaks


def id_record(record: bytes) -> dict[str, str]:
    """A TFRecord test record is its id's bytes."""
    return {"id": record.decode()}


def write_tfrecord_shards(root: str, sizes: list[int]) -> list[str]:
    """TFRecord files whose records are the ids ``r00000``...; record 2 of each holds 300 bytes more, so
    that a cut near the end lands inside a record's data."""
    urls, n = [], 0
    for i, size in enumerate(sizes):
        url = f"{root}/part-{i:03d}.tfrecord"
        with TFRecordWriter(url) as writer:
            for _ in range(size):
                writer.write(f"r{n:05d}".encode())
                n += 1
        urls.append(url)
    return urls


def cut_last_record(path: str) -> None:
    """Cut the file 3 bytes into its last record's data."""
    os.truncate(path, record_offsets(path)[-1] + 12 + 3)


def flip_length_crc(path: str, record: int = 4) -> None:
    """Flip a byte of ``record``'s length CRC: the framing breaks there, the records before it are sound."""
    offset = record_offsets(path)[record] + 8
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def cut_at(fraction: float, path: str) -> None:
    os.truncate(path, int(os.path.getsize(path) * fraction))


def cut_tar_mid_member(path: str) -> None:
    """Cut the tar 100 bytes into a 512-byte block past the middle of the file (inside a member)."""
    os.truncate(path, (os.path.getsize(path) // 2 // 512) * 512 + 100)


def destroy_footer(path: str) -> None:
    """Overwrite the footer length and the closing magic: the file cannot be opened at all."""
    data = bytearray(Path(path).read_bytes())
    data[-8:] = b"\xff" * 8
    Path(path).write_bytes(bytes(data))


class Case(NamedTuple):
    dataset: Callable[..., Any]
    write: Callable[[str, list[int]], list[str]]
    damage: Callable[[str], None]
    options: dict[str, Any]
    #: False: the count never looks where the file is damaged (a framing scan checks no length CRC), so
    #: it counts what the framing says and reading makes up the records lost past the break (a guard case)
    count_breaks: bool = True


CASES = {
    "tfrecord cut mid-record": Case(TFRecordDataset, write_tfrecord_shards, cut_last_record, {"decode": id_record}),
    "tfrecord bad length crc": Case(
        TFRecordDataset, write_tfrecord_shards, flip_length_crc, {"decode": id_record}, count_breaks=False
    ),
    "tar cut mid-member": Case(TarDataset, write_tar_shards, cut_tar_mid_member, {}),
    "jsonl.gz cut mid-stream": Case(
        JsonlDataset, lambda root, sizes: write_jsonl_shards(root, sizes, ".jsonl.gz"), lambda p: cut_at(0.6, p), {}
    ),
    "parquet footer destroyed": Case(ParquetDataset, write_parquet_shards, destroy_footer, {}),
}


def readable_ids(case: Case, urls: list[str]) -> list[str]:
    """What one reader yields under skip with no counts needed (``balance="none"``): the sound records."""
    with pytest.warns(UserWarning):
        dataset = case.dataset(urls, on_error="skip", balance="none", **case.options)
        return [sample_id(sample) for sample in dataset]


def read_ranks(case: Case, urls: list[str], world_size: int = 2) -> tuple[list[list[str]], list[Any]]:
    """Each rank's sample ids and its dataset's stats, ranks given as ``rank=``/``world_size=``."""
    ranks, stats = [], []
    for rank in range(world_size):
        dataset = case.dataset(
            urls, rank=rank, world_size=world_size, balance="pad", on_error="skip", seed=3, **case.options
        )
        ranks.append([sample_id(sample) for sample in dataset])
        stats.append(dataset.stats())
    return ranks, stats


@pytest.fixture(params=list(CASES))
def damaged(request, tmp_path) -> tuple[Case, list[str], list[str]]:
    """A case, its shard urls (shard ``DAMAGED`` broken), and the ids one reader gets from them under skip."""
    case = CASES[request.param]
    urls = case.write(str(tmp_path), SIZES)
    case.damage(urls[DAMAGED])
    return case, urls, readable_ids(case, urls)


def test_a_damaged_shard_loses_only_what_breaks_and_reading_it_alone_says_so(damaged):
    case, urls, readable = damaged
    before = sum(SIZES[:DAMAGED])
    # the shards around it are whole, the damaged one keeps at least nothing and at most less than it had
    assert readable[:before] == [sample_id_of(case, n) for n in range(before)]
    assert readable[-SIZES[-1] :] == [sample_id_of(case, n) for n in range(sum(SIZES) - SIZES[-1], sum(SIZES))]
    assert len(readable) < sum(SIZES)


def sample_id_of(case: Case, n: int) -> str:
    return f"{'s' if case.dataset is TarDataset else 'r'}{n:05d}"


def test_a_pad_job_over_two_ranks_starts_reads_every_sound_record_and_keeps_ranks_equal(damaged):
    case, urls, readable = damaged
    with pytest.warns(UserWarning, match=r"part-001"):
        ranks, stats = read_ranks(case, urls)
    seen = collections.Counter(s for rank in ranks for s in rank)
    assert set(seen) == set(readable), "every sound record is read, and nothing else"
    planned = len(readable) if case.count_breaks else sum(SIZES)
    per_rank = -(-planned // 2)
    assert [len(rank) for rank in ranks] == [per_rank, per_rank]
    assert sum(seen.values()) - len(readable) == 2 * per_rank - len(readable), "only repeats stand in"
    errors = sum(s.errors[DAMAGED] for s in stats)
    assert errors >= 1, "the break is counted as an error of the damaged shard"
    assert all(s.errors[i] == 0 for s in stats for i in range(len(urls)) if i != DAMAGED)
    assert sum(s.total_missing for s in stats) == 0, "the count matched what was read: nothing is missing"
    lost = sum(s.skipped[DAMAGED] for s in stats)
    assert lost == (0 if case.count_breaks else sum(SIZES) - len(readable))


def test_counting_warns_naming_the_shard_where_it_broke_and_why(damaged):
    case, urls, _ = damaged
    dataset = case.dataset(urls, rank=0, world_size=2, balance="pad", on_error="skip", **case.options)
    if not case.count_breaks:
        assert dataset.count_records().shards.num_records.tolist() == SIZES
        return
    with pytest.warns(UserWarning, match=r"part-001.*counted as the \d+ records? reading yields") as got:
        dataset.count_records()
    assert any("part-001" in str(w.message) and ("byte" in str(w.message) or "record" in str(w.message)) for w in got)
    assert dataset.shards.num_records is not None and dataset.shards.num_records[0] == SIZES[0]


def test_counting_a_damaged_shard_still_raises_naming_it_under_on_error_raise(damaged):
    case, urls, _ = damaged
    dataset = case.dataset(urls, rank=0, world_size=2, balance="pad", **case.options)
    with pytest.raises(CorruptRecordError, match=r"part-001") as info:
        dataset.count_records()
        assert not case.count_breaks, "only the guard case counts, and then reading raises"
        list(case.dataset(urls, rank=1, world_size=2, balance="pad", **case.options))
    assert info.value.url == urls[DAMAGED]


def test_a_damaged_count_is_not_cached_as_sound_and_a_repaired_file_is_recounted_and_read_fully(tmp_path):
    case = CASES["tfrecord cut mid-record"]
    urls = case.write(str(tmp_path), SIZES)
    whole = Path(urls[DAMAGED]).read_bytes()
    case.damage(urls[DAMAGED])
    with pytest.warns(UserWarning, match="part-001"):
        first = case.dataset(urls, rank=0, world_size=2, balance="pad", on_error="skip", **case.options)
        assert first.count_records().shards.num_records.tolist() == [6, 9, 5]
    Path(urls[DAMAGED]).write_bytes(whole)  # repaired: rewritten whole
    ranks, stats = read_ranks(case, urls)
    assert sorted(set(s for rank in ranks for s in rank)) == [f"r{n:05d}" for n in range(sum(SIZES))]
    assert sum(s.total_errors for s in stats) == 0


def test_a_damaged_count_is_counted_again_next_time_not_taken_from_the_counts_cache(tmp_path, counts_cache_dir):
    case = CASES["tar cut mid-member"]
    urls = case.write(str(tmp_path), SIZES)
    case.damage(urls[DAMAGED])
    for _ in range(2):  # the second dataset finds the sound shards cached, the damaged one not
        with pytest.warns(UserWarning, match="part-001.tar"):
            dataset = case.dataset(urls, rank=0, world_size=2, balance="pad", on_error="skip").count_records()
        assert dataset.shards.num_records.tolist() == [6, 5, 5]
    (cache,) = Path(counts_cache_dir).glob("counts-*.arrow")
    table = pa.ipc.open_file(pa.OSFile(str(cache), "rb")).read_all()
    assert table.column("identity").null_count == 1 and table.column("identity")[DAMAGED].as_py() is None


def test_sample_level_shuffling_over_a_damaged_shard_reads_every_sound_record_once(damaged):
    case, urls, readable = damaged
    if not case.count_breaks:
        pytest.skip("the count does not break here: reading makes up what is lost (see the pad job test)")
    with pytest.warns(UserWarning, match="part-001"):
        dataset = case.dataset(urls, shuffle=True, seed=5, on_error="skip", **case.options)
        seen = [sample_id(sample) for sample in dataset]
    assert sorted(seen) == sorted(readable)


def test_two_ranks_with_dataloader_workers_each_counting_still_read_every_sound_record(tmp_path):
    case = CASES["jsonl.gz cut mid-stream"]
    urls = case.write(str(tmp_path), SIZES)
    case.damage(urls[DAMAGED])
    readable = readable_ids(case, urls)
    make = rank_factory(case.dataset, urls, balance="pad", on_error="skip", shuffle=True, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the workers' warnings stay in the workers
        ranks = ids_per_rank(make, world_size=2, num_workers=2)
    assert_split(ranks, readable, "pad")


def test_the_counting_warning_names_the_shard_without_its_credentials():
    url = "https://user:s3cr3tpw@host.example/part-001.tar?X-Amz-Signature=SIGabc"

    def read_two(url: str, start: int, stop: int | None):
        yield from ("a", "b")
        raise CorruptRecordError(url, 2, 1024, "the file ends without the end-of-archive marker")

    broke = CorruptRecordError(url, 2, 1024, "the file ends without the end-of-archive marker")
    with pytest.warns(UserWarning, match=r"part-001.tar.*record 2.*counted as the 2 records reading yields") as got:
        assert readable_count(url, read_two, broke) == 2
    text = str(got[0].message)
    assert "s3cr3tpw" not in text and "SIGabc" not in text and "host.example/part-001.tar" in text
