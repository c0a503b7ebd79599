"""A plan no call can change: every rank and DataLoader worker resolves the shards' record counts the same way
(a manifest, else index files or Parquet footers, else counted when the plan needs counts), whether or not
``len()``, ``count_records()`` or ``state_dict()`` was called first, under every balance mode."""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import shardkit
from shardkit import JsonlDataset, ParquetDataset, ShardList, TFRecordDataset, Topology
from shardkit.formats.base import FormatBase
from shardkit.formats.registry import format_for
from shardkit.planning import plan_whole_shards
from shardkit.sources import BalanceError, ShardedDataset
from tests.helpers.examples import examples
from tests.helpers.reading import sample_id, tag_worker
from tests.helpers.shards import format_ids, write_jsonl_shards, write_parquet_shards

slow = pytest.mark.slow
SIZES = [20, 10]  # the two shards: whole shards give the ranks 20 and 10, records 15 and 15


def _tfrecord_id(record: bytes) -> str:
    return record.decode()


def _write_tfrecords(root: str, sizes: list[int]) -> list[str]:
    urls, n = [], 0
    for i, size in enumerate(sizes):
        url = f"{root}/part-{i:03d}.tfrecord"
        with shardkit.TFRecordWriter(url) as out:
            for k in range(n, n + size):
                out.write(f"r{k:05d}".encode())
        urls.append(url)
        n += size
    return urls


def _tfrecord_dataset(shards, **kwargs):
    return TFRecordDataset(shards, decode="raw", **kwargs).map(_tfrecord_id)


def _jsonl_dataset(shards, **kwargs):
    return JsonlDataset(shards, **kwargs).map(sample_id)


def _parquet_dataset(shards, **kwargs):
    return ParquetDataset(shards, **kwargs).map(sample_id)


# (write(root, sizes), make(shards, **kwargs), whether the shards need an index file for cheap counts)
FORMATS = {
    "tfrecord": (_write_tfrecords, _tfrecord_dataset, True),
    "jsonl": (write_jsonl_shards, _jsonl_dataset, True),
    "parquet": (write_parquet_shards, _parquet_dataset, False),
}


def _shards_with_cheap_counts(tmp_path, name: str, sizes: list[int]) -> list[str]:
    """Shards of format ``name`` whose counts need no scan: index files beside them (Parquet: its footers)."""
    write, _, indexed = FORMATS[name]
    urls = write(str(tmp_path), sizes)
    if indexed:
        for url in urls:
            format_for(url).build_index(url)
    return urls


def _read_ranks(make, world_size: int, num_workers: int, before=None) -> list[list[str]]:
    """The sample ids each simulated rank's DataLoader yields; ``before(rank, dataset)`` runs first on each rank."""
    ranks = []
    for rank in range(world_size):
        dataset = make(rank=rank, world_size=world_size)
        if before is not None:
            before(rank, dataset)
        kwargs = {"multiprocessing_context": "fork"} if num_workers else {}
        ranks.append(list(DataLoader(dataset, batch_size=None, num_workers=num_workers, **kwargs)))
    return ranks


def _len_on(rank_calling: int):
    def before(rank: int, dataset) -> None:
        if rank == rank_calling:
            print(len(dataset))  # the rank-0-only print(len(ds))

    return before


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=slow)])
@pytest.mark.parametrize("rank_calling", [None, 0, 1])
@pytest.mark.parametrize("name", ["tfrecord", "jsonl", "parquet"])
def test_len_on_one_rank_only_leaves_every_record_read_exactly_once(tmp_path, name, rank_calling, num_workers):
    urls = _shards_with_cheap_counts(tmp_path, name, SIZES)
    _, dataset, _ = FORMATS[name]

    def make(**kwargs):
        return dataset(ShardList(urls), balance="none", **kwargs)

    before = None if rank_calling is None else _len_on(rank_calling)
    ranks = _read_ranks(make, world_size=2, num_workers=num_workers, before=before)
    assert sorted(s for rank in ranks for s in rank) == format_ids(name, SIZES)
    assert [len(rank) for rank in ranks] == [15, 15]  # records split from the cheap counts, called or not


@pytest.mark.parametrize("name", ["tfrecord", "jsonl", "parquet"])
def test_count_records_on_one_rank_only_leaves_the_plan_as_it_was(tmp_path, name):
    urls = _shards_with_cheap_counts(tmp_path, name, SIZES)
    _, dataset, _ = FORMATS[name]

    def make(**kwargs):
        return dataset(ShardList(urls), balance="none", **kwargs)

    def before(rank: int, mapped) -> None:
        if rank == 0:
            mapped.source.count_records()

    ranks = _read_ranks(make, world_size=2, num_workers=0, before=before)
    assert sorted(s for rank in ranks for s in rank) == format_ids(name, SIZES)
    assert [len(rank) for rank in ranks] == [15, 15]


@slow
def test_one_parquet_shard_of_600_rows_gives_each_of_2_ranks_x_3_workers_100_rows(tmp_path, recwarn):
    (url,) = write_parquet_shards(str(tmp_path), [600], row_group_size=50)
    per_reader = collections.Counter()
    seen = []
    for rank in range(2):
        source = ParquetDataset([url], balance="none", rank=rank, world_size=2)
        loader = DataLoader(source.map(tag_worker), batch_size=None, num_workers=3, multiprocessing_context="fork")
        for worker, row in loader:
            per_reader[(rank, worker)] += 1
            seen.append(row["id"])
    assert sorted(seen) == format_ids("parquet", [600])
    assert dict(per_reader) == {(rank, worker): 100 for rank in range(2) for worker in range(3)}
    assert not [w for w in recwarn if "unknown" in str(w.message)]  # the footer's count is known


def test_one_parquet_shard_of_600_rows_splits_by_rows_over_six_readers_without_a_dataloader(tmp_path, recwarn):
    (url,) = write_parquet_shards(str(tmp_path), [600], row_group_size=50)
    counts, balance = ParquetDataset([url], balance="none", rank=1, world_size=2)._counts(Topology(1, 2, 2, 3))
    assert counts.tolist() == [600] and balance == "none"
    assert not [w for w in recwarn if "unknown" in str(w.message)]


# -- planning level: the counts every reader plans with ------------------------------------------------------


class _Stored(FormatBase):
    """A format over ``mem/<shard>`` urls whose counts live in the files' metadata (an index, a footer)."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def read(self, url: str, start: int = 0, stop: int | None = None):
        shard = int(url.rsplit("/", 1)[1])
        return iter(range(start, self.counts[shard] if stop is None else min(stop, self.counts[shard])))

    def count(self, url: str) -> int:
        raise AssertionError(f"counted {url} by a scan: the stored count was there")

    def stored_count(self, url: str) -> int:
        return self.counts[int(url.rsplit("/", 1)[1])]


def _stored_dataset(counts: list[int], rank: int, world: int, balance: str):
    from shardkit.sources import FormatDataset

    urls = [f"mem/{i}" for i in range(len(counts))]
    return FormatDataset(ShardList(urls), _Stored(counts), balance=balance, rank=rank, world_size=world)


CALLS = {
    "nothing": lambda ds: None,
    "len": len,
    "state_dict": lambda ds: (next(iter(ds), None), ds.state_dict()),
    "iterate": lambda ds: next(iter(ds), None),
}


@settings(max_examples=examples(60), deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    world=st.integers(1, 3),
    workers=st.integers(1, 3),
    balance=st.sampled_from(["none", "pad", "drop"]),
    calls=st.lists(st.sampled_from(sorted(CALLS)), min_size=3, max_size=3),
)
def test_every_reader_plans_with_the_stored_counts_whatever_was_called_first(counts, world, workers, balance, calls):
    assume(balance != "drop" or not 0 < sum(counts) < world)  # a PlanError on every reader alike
    plans = set()
    for rank in range(world):
        for worker in range(workers):
            dataset = _stored_dataset(counts, rank, world, balance)
            CALLS[calls[rank]](dataset)
            planned, planned_balance = dataset._counts(Topology(rank, world, worker, workers))
            plans.add((tuple(planned.tolist()), planned_balance))
    assert plans == {(tuple(counts), balance)}


def test_unknown_counts_under_balance_none_stay_unknown_on_every_rank_whatever_was_counted_before(tmp_path):
    urls = _write_tfrecords(str(tmp_path), SIZES)  # no index: a count needs a scan
    shardkit.TFRecordDataset(urls, rank=0, world_size=2).count_records()  # fills this machine's counts cache
    counts, balance = TFRecordDataset(urls, balance="none", rank=1, world_size=2)._counts(Topology(1, 2))
    assert counts.null_count == 2 and balance == "none"  # not taken from the cache: another node has none
    whole = plan_whole_shards(counts, Topology(1, 2))
    assert [piece.shard for piece in whole.ranges[:]] == [1]


def test_a_balanced_plan_counts_once_and_a_manifest_wins_over_index_files(tmp_path, monkeypatch):
    urls = _shards_with_cheap_counts(tmp_path, "tfrecord", SIZES)
    manifest = ShardList(urls, num_records=[20, 10])
    monkeypatch.setattr(ShardedDataset, "count_records", lambda self: pytest.fail("counted with a manifest"))
    monkeypatch.setattr("shardkit.formats.tfrecord.index.load_index", lambda *a, **k: pytest.fail("read an index"))
    counts, _ = TFRecordDataset(manifest, rank=0, world_size=2)._counts(Topology(0, 2))
    assert counts.tolist() == [20, 10]


def test_a_counts_cache_written_before_counts_were_marked_stored_is_read_as_scanned_counts(tmp_path, caplog):
    import pyarrow as pa

    from shardkit import counting

    urls = _shards_with_cheap_counts(tmp_path, "tfrecord", SIZES)
    shards = ShardList(urls)
    identities = counting.cache._identities(shards, None)
    path = counting.cache_path(shards)
    old = pa.table(
        [pa.array(urls, pa.large_string()), pa.array([20, 10], pa.int64()), pa.array(identities, pa.large_string())],
        schema=counting.cache._SCHEMA_V1,
    )
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, old.schema) as writer:
        writer.write_table(old)
    caplog.set_level("INFO", logger="shardkit")
    assert counting.resolve_counts(shards, None, why="test").num_records.tolist() == [20, 10]  # no count_fn needed
    assert "ignoring" not in caplog.text
    assert TFRecordDataset(urls, balance="none")._counts(Topology())[0].tolist() == [20, 10]  # from the indexes


def test_shards_without_indexes_cost_one_index_probe_and_no_file_identities_under_balance_none(tmp_path, monkeypatch):
    from shardkit import counting
    from shardkit.formats.tfrecord import TFRecordFormat

    urls = _write_tfrecords(str(tmp_path), [3] * 8)  # no index files, no counts cache yet
    probes = []
    real = TFRecordFormat.index_offsets
    monkeypatch.setattr(TFRecordFormat, "index_offsets", lambda self, url: probes.append(url) or real(self, url))
    monkeypatch.setattr(counting.cache, "_identities", lambda *a: pytest.fail("listed or stat'ed every shard"))
    for rank in range(2):
        counts, _ = TFRecordDataset(urls, balance="none", rank=rank, world_size=2)._counts(Topology(rank, 2))
        assert counts.null_count == 8
    assert probes == [urls[0], urls[0]]  # one probe per reader: a remote store sees one HEAD, not a LIST


# -- a count that lies: no padded epoch is endless ------------------------------------------------------------

LIE = 10**12


def _lying_tfrecords(tmp_path, first_count: int) -> ShardList:
    """Two real 5-record TFRecord shards; the first one's explicit count says ``first_count``."""
    return ShardList(_write_tfrecords(str(tmp_path), [5, 5]), num_records=[first_count, 5])


@pytest.mark.filterwarnings("ignore:.*counted as missing:UserWarning")
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_count_of_a_trillion_on_a_5_record_shard_raises_under_pad_instead_of_padding_without_end(
    tmp_path, world_size
):
    shards = _lying_tfrecords(tmp_path, LIE)
    for rank in range(world_size):
        dataset = TFRecordDataset(shards, decode="raw", on_error="skip", rank=rank, world_size=world_size)
        with pytest.raises(BalanceError, match=rf"part-000.tfrecord.*its record count says {LIE}.*count_records"):
            for _ in itertools.islice(dataset, 100_000):  # before: 100,000 stand-ins, and ~10**12 more to come
                pass
        stats = dataset.stats()
        assert stats.padded.tolist() == [0, 0] and stats.read.tolist()[0] == (5 if rank == 0 else 0)


@pytest.mark.filterwarnings("ignore:.*counted as missing:UserWarning")
def test_a_lying_count_raises_in_every_dataloader_worker_that_reads_the_shard(tmp_path):
    dataset = TFRecordDataset(_lying_tfrecords(tmp_path, LIE), decode="raw", on_error="skip")
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
    with pytest.raises(BalanceError, match="is taken as wrong"):
        for _ in itertools.islice(loader, 100_000):
            pass


@pytest.mark.filterwarnings("ignore:.*counted as missing:UserWarning")
def test_a_shard_short_by_up_to_the_allowance_is_still_padded_and_one_more_raises(tmp_path):
    from shardkit.sources import MADE_UP_MISSING

    shards = _lying_tfrecords(tmp_path, 5 + MADE_UP_MISSING)
    dataset = TFRecordDataset(shards, decode="raw", on_error="skip")
    samples = list(dataset)
    assert len(samples) == 10 + MADE_UP_MISSING  # every planned sample, the missing ones made up
    assert samples[5 : 5 + MADE_UP_MISSING] == [b"r00004"] * MADE_UP_MISSING
    assert dataset.stats().padded.tolist() == [MADE_UP_MISSING, 0]
    one_more = TFRecordDataset(_lying_tfrecords(tmp_path, 6 + MADE_UP_MISSING), decode="raw", on_error="skip")
    with pytest.raises(BalanceError, match=f"ends after 5 records.*says {6 + MADE_UP_MISSING}"):
        list(one_more)
    unbalanced = TFRecordDataset(shards, decode="raw", on_error="skip", balance="none")
    assert len(list(unbalanced)) == 10  # nothing is made up under balance="none": the lie costs no samples


# -- counting once per job: the first rank looks the stored counts up, the others and every worker take its answer


def _read_with_spawned_workers(rank: int, world_size: int, pattern: str, out_dir: str) -> None:
    import json
    import os

    dataset = TFRecordDataset(pattern, decode="raw", balance="none")
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump([record.decode() for record in loader], f)


@slow
def test_two_ranks_of_two_spawned_workers_probe_each_index_once_per_job_and_list_once(tmp_path, monkeypatch):
    import json

    from shardkit.counting import counts_from_indexes
    from shardkit.formats.tfrecord import TFRecordFormat
    from tests.helpers.fault_server import FaultServer
    from tests.helpers.processes import gloo_ranks

    monkeypatch.setenv("SHARDKIT_CACHE_DIR", "")  # no counts cache standing in for the indexes: only probes count
    (tmp_path / "data").mkdir()
    for url in _write_tfrecords(str(tmp_path / "data"), [5, 5, 5, 5]):  # one whole shard per reader: no seeks
        shardkit.build_index(url)
    with FaultServer(str(tmp_path)) as server:
        pattern = f"{server.url}/data/part-*.tfrecord"
        # The ranks are forked (their DataLoader workers are the spawned ones), before this process
        # lists or probes anything: they inherit nothing it learnt, as spawned ranks would.
        gloo_ranks(_read_with_spawned_workers, 2, pattern, str(tmp_path), start_method="fork")
        job_probes = sorted(r.path for r in server.log if r.path.endswith(".idx"))
        job_listings = [r.method for r in server.log if r.method == "LIST"]
        server.log.clear()
        shards = ShardList.from_glob(pattern)
        one_listing = [r.method for r in server.log if r.method == "LIST"]
        server.log.clear()
        assert counts_from_indexes(shards, TFRecordFormat().stored_count, cache_dir="").num_records.tolist() == [5] * 4
        one_probe = sorted(r.path for r in server.log if r.path.endswith(".idx"))
        assert one_probe and job_probes == one_probe  # before: once per reader
        assert one_listing and job_listings == one_listing  # workers list nothing
    ranks = [json.load(open(tmp_path / f"{rank}.json")) for rank in range(2)]
    assert sorted(ranks[0] + ranks[1]) == [f"r{k:05d}" for k in range(20)] and len(ranks[0]) == len(ranks[1]) == 10


def _index_written_between_ranks(rank: int, world_size: int, urls: list[str], out_dir: str) -> None:
    import json
    import os

    import torch.distributed as dist

    if rank == 1:
        dist.barrier()  # rank 0 has read its part, planned without an index
        for url in urls:
            shardkit.build_index(url)
    read = [record.decode() for record in TFRecordDataset(urls, decode="raw", balance="none")]
    if rank == 0:
        dist.barrier()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(read, f)


@slow
def test_an_index_written_after_the_first_rank_built_its_dataset_leaves_every_record_read_once(tmp_path):
    import json

    from tests.helpers.processes import gloo_ranks

    urls = _write_tfrecords(str(tmp_path), SIZES)
    gloo_ranks(_index_written_between_ranks, 2, urls, str(tmp_path), start_method="fork")
    ranks = [json.load(open(tmp_path / f"{rank}.json")) for rank in range(2)]
    assert sorted(ranks[0] + ranks[1]) == [f"r{k:05d}" for k in range(30)]  # before: records 15 to 19 read twice
    assert [len(rank) for rank in ranks] == [20, 10]  # the first rank found no index: whole shards on both


def _build_over_a_stale_index(rank: int, world_size: int, urls: list[str], out_dir: str) -> None:
    import json
    import os

    try:
        TFRecordDataset(urls, decode="raw", balance="none")
        result = "built"
    except Exception as error:
        result = f"{type(error).__name__}: {error}"
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)


@slow
def test_a_stale_index_fails_the_rank_that_looked_and_every_rank_that_waits_for_its_answer(tmp_path):
    import json

    from tests.helpers.processes import gloo_ranks

    urls = _write_tfrecords(str(tmp_path), SIZES)
    for url in urls:
        shardkit.build_index(url)
    with open(urls[1], "ab") as f:  # the shard grew after it was indexed
        f.write(open(urls[1], "rb").read())
    gloo_ranks(_build_over_a_stale_index, 2, urls, str(tmp_path), start_method="fork")
    results = sorted(json.load(open(tmp_path / f"{rank}.json")) for rank in range(2))
    assert results[0].startswith("CountsUnavailableError: another rank looked up the record counts of 2 shards")
    assert results[1].startswith(f"IndexFileError: index file {urls[1]}.idx does not fit {urls[1]}")
    assert results[1].split(": ", 1)[1] in results[0]  # the waiting rank names the looker's error, not a hang
