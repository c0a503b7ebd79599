"""The guarantees every shard format shares, over tar, Parquet and JSON lines alike: exactly once or equal
counts over DataLoader workers and ranks, ranks from the environment, one huge shard split between
readers, resume mid-shard, an S3 round trip. Each format's own behaviour lives in tests/test_formats_<format>.py."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import pytest
from torch.utils.data import DataLoader

from shardkit import JsonlDataset, ParquetDataset, TarDataset
from shardkit.formats.registry import format_for
from tests.helpers.reading import assert_split, ids_per_rank, rank_factory, sample_id, tag_worker
from tests.helpers.shards import format_ids, write_jsonl_shards, write_parquet_shards, write_tar_shards
from tests.state.test_resume import Run, check_resume

SIZES = [17, 3, 0, 25, 9, 11]  # an empty shard among them
slow = pytest.mark.slow


class Case(NamedTuple):
    """One format: its dataset class, its writer ``write(root, sizes, storage_options)``, its file suffix."""

    dataset: Callable[..., Any]
    write: Callable[..., list[str]]
    suffix: str


def _write_big_tar(root: str, sizes: list[int], storage_options=None) -> list[str]:
    """One tar whose middle sample is a 5 MB member: the shard is split by sample, not by bytes."""
    import webdataset as wds

    url = f"{root}/big.tar"
    with wds.TarWriter(url) as writer:
        for n in range(sizes[0]):
            writer.write({"__key__": f"s{n:05d}", "bin": bytes([n]) * ((5 << 20) if n == sizes[0] // 2 else 100)})
    return [url]


CASES = {
    "tar": Case(TarDataset, write_tar_shards, ".tar"),
    "parquet": Case(ParquetDataset, write_parquet_shards, ".parquet"),
    "jsonl": Case(JsonlDataset, write_jsonl_shards, ".jsonl"),
    "jsonl.gz": Case(
        JsonlDataset,
        lambda root, sizes, options=None: write_jsonl_shards(root, sizes, ".jsonl.gz", options),
        ".jsonl.gz",
    ),
}
# One shard holding one huge record or row group, as each format makes it.
BIG = {
    "tar": (_write_big_tar, 12),
    "parquet": (lambda root, sizes: write_parquet_shards(root, sizes, row_group_size=sizes[0]), 600),
    "jsonl": (write_jsonl_shards, 500),
}


def ids(name: str, sizes: list[int]) -> list[str]:
    return format_ids(name.split(".")[0], sizes)


# Readers (ranks x workers) from 1 to 9 over 6 shards. A rank's part is split between its workers by one
# code path whatever the rank count, and the formats only see the ranges they are given: two workers on 1, 2
# and 3 ranks and three workers on three ranks (9 readers, more than shards) cover it. Three workers on one
# or two ranks started 3 workers per rank for no path of their own and were cut.
READERS = [(0, 1), (0, 2), (0, 3)] + [pytest.param(w, r, marks=slow) for w, r in ((2, 1), (2, 2), (2, 3), (3, 3))]


@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
@pytest.mark.parametrize(("num_workers", "world_size"), READERS)
@pytest.mark.parametrize("name", ["tar", "parquet", "jsonl"])
def test_every_sample_once_or_equal_counts_over_workers_and_ranks(tmp_path, name, num_workers, world_size, balance):
    case = CASES[name]
    urls = case.write(str(tmp_path), SIZES)
    make = rank_factory(case.dataset, urls, balance=balance, shuffle=True, seed=2)
    ranks = ids_per_rank(make, world_size=world_size, num_workers=num_workers)
    assert_split(ranks, ids(name, SIZES), balance)


@slow
@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
@pytest.mark.parametrize("name", ["tar", "parquet", "jsonl.gz"])
def test_ranks_from_the_environment_split_too(tmp_path, monkeypatch, name, balance):
    case = CASES[name]
    urls = case.write(str(tmp_path), SIZES)
    make = rank_factory(case.dataset, urls, balance=balance)
    ranks = ids_per_rank(make, world_size=3, num_workers=2, env=True, monkeypatch=monkeypatch)
    assert_split(ranks, ids(name, SIZES), balance)


@slow
@pytest.mark.parametrize("name", ["tar", "parquet", "jsonl"])
def test_one_shard_with_one_huge_record_or_row_group_is_split_between_every_reader(tmp_path, name):
    write, size = BIG[name]
    (url,) = write(str(tmp_path), [size])
    format_for(url).build_index(url)  # tar and JSON lines: an index to seek by
    for world in (1, 2):
        seen, workers = [], []
        for rank in range(world):
            dataset = CASES[name].dataset([url], balance="none", rank=rank, world_size=world).count_records()
            loader = DataLoader(dataset.map(tag_worker), batch_size=None, num_workers=3, multiprocessing_context="fork")
            tagged = [(worker, sample_id(sample)) for worker, sample in loader]
            seen += [i for _, i in tagged]
            workers.append({worker for worker, _ in tagged})
        assert sorted(seen) == ids(name, [size])
        assert workers == [{0, 1, 2}] * world  # every reader of every rank read part of the one shard


@pytest.mark.parametrize("name", ["tar", "parquet", "jsonl"])
def test_resuming_mid_shard_equals_the_uninterrupted_epoch(tmp_path, name):
    case = CASES[name]
    urls = case.write(str(tmp_path), SIZES)
    format_for(urls[3]).build_index(urls[3])  # one shard seeks by its index, the rest scan

    def make():
        return case.dataset(urls, shuffle=True, seed=4).count_records().map(sample_id)

    check_resume(Run("stateful", make, 2), [None])


@slow
@pytest.mark.parametrize(("name", "balance"), [("tar", "none"), ("parquet", "pad"), ("jsonl", "pad")])
def test_s3_round_trip_over_two_ranks(s3_server, name, balance):
    case = CASES[name]
    bucket = s3_server.new_bucket()
    options = s3_server.storage_options()
    urls = case.write(bucket, [7, 12, 5], storage_options=options)
    fmt = format_for(urls[1])
    fmt = type(fmt)(storage_options=options)
    assert fmt.count(urls[1]) == 12
    fmt.build_index(urls[1])
    assert list(fmt.read(urls[1], 3, 9)) == list(fmt.read(urls[1]))[3:9]
    make = rank_factory(case.dataset, f"{bucket}/part-*{case.suffix}", balance=balance, storage_options=options)
    assert_split(ids_per_rank(make, world_size=2, num_workers=2), ids(name, [7, 12, 5]), balance)
