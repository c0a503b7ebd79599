"""Reading bad shards: short and long shards, corrupt and undecodable records, lost temp files, errors
through DataLoader workers and a real gloo run. Every fault is injected for real and the documented
outcome asserted: an error naming the shard, or (on_error="skip") a counted loss that keeps every
rank at its planned number of samples.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptRecordError, ShardedDataset, TFRecordDataset
from shardkit.sources import BalanceError
from tests.helpers.examples import examples
from tests.helpers.load import hang_bound
from tests.helpers.reading import read_all
from tests.helpers.shards import record_offsets, synthetic_read

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:skipping:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*counted as missing:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*extra records are not read:UserWarning"),
]


def lying_shards(actual: list[int], planned: list[int]) -> shardkit.ShardList:
    """Synthetic shards holding ``actual`` records whose record counts say ``planned``."""
    urls = [f"mem/shard{i:03d}-{count}" for i, count in enumerate(actual)]
    return shardkit.ShardList(urls, num_records=planned)


def flat(batches) -> list:
    return [sample for batch in batches for sample in batch]


def run_rank(dataset, num_workers: int, batch_size: int = 4) -> list[list]:
    kwargs = {"multiprocessing_context": "fork"} if num_workers else {}
    return [list(b) for b in DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, **kwargs)]


# --------------------------------------------------------------------------- short and long shards


def test_a_short_shard_raises_naming_the_shard_and_what_was_planned():
    dataset = ShardedDataset(lying_shards([4, 5, 6], [4, 9, 6]), synthetic_read)
    with pytest.raises(CorruptRecordError) as info:
        list(dataset)
    error = info.value
    assert (error.url, error.record_index, error.offset, error.framing_intact) == ("mem/shard001-5", 5, -1, False)
    assert "ends after 5 records" in str(error) and "up to record 9" in str(error)
    assert "(byte offset unknown)" in str(error) and "recount" in str(error)


def test_a_long_shard_raises_or_is_counted_and_its_extra_records_are_not_read():
    shards = lying_shards([4, 8, 6], [4, 5, 6])
    with pytest.raises(CorruptRecordError, match="more records than its planned count 5") as info:
        list(ShardedDataset(shards, synthetic_read))
    assert (info.value.url, info.value.record_index) == ("mem/shard001-8", 5)
    lenient = ShardedDataset(shards, synthetic_read, on_error="skip")
    with pytest.warns(UserWarning, match="shard001-8.*more records than its planned count 5"):
        seen = list(lenient)
    assert seen == [f"{url}:{i}" for url, n in zip(shards, [4, 5, 6]) for i in range(n)]
    stats = lenient.stats()
    assert stats.errors.tolist() == [0, 1, 0] and stats.total_padded == 0 and stats.total_missing == 0


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("world_size", "balance"), [(2, "pad"), (3, "drop"), (1, "pad")])
def test_short_shards_under_skip_keep_every_rank_at_its_planned_count(world_size, balance, num_workers):
    actual, planned = [17, 3, 0, 10, 9, 30, 2, 6, 12], [17, 3, 0, 25, 9, 30, 11, 6, 12]
    shards = lying_shards(actual, planned)
    ranks, stats = [], []
    for rank in range(world_size):
        dataset = ShardedDataset(
            shards,
            synthetic_read,
            on_error="skip",
            balance=balance,
            shuffle=True,
            seed=4,
            rank=rank,
            world_size=world_size,
        )
        ranks.append(run_rank(dataset, num_workers))
        assert len(flat(ranks[-1])) == len(dataset)  # exactly the planned number of samples
        stats.append(dataset.stats())
    assert len({len(batches) for batches in ranks}) == 1, "ranks yield different numbers of batches"
    real = {f"{url}:{i}" for url, n in zip(shards, actual) for i in range(n)}
    seen = collections.Counter(s for batches in ranks for s in flat(batches))
    assert set(seen) <= real  # made-up samples are repeats of real records
    missing = sum(s.missing for s in stats)
    padded = sum(s.padded for s in stats)
    # Each planned record is either read or missing; every missing one is made up by one repeat.
    assert (sum(s.read for s in stats) + missing).tolist() == _planned_reads(planned, world_size, balance)
    assert missing.tolist()[3] > 0 and missing.tolist()[6] > 0 and padded.tolist() == missing.tolist()
    assert sum(seen.values()) == sum(len(flat(b)) for b in ranks)


def _planned_reads(planned: list[int], world_size: int, balance: str) -> list[int]:
    """How many times the plan reads each shard's records over all ranks (pad repeats a few)."""
    from shardkit import Topology, plan
    from shardkit.planning import SHUFFLE_BLOCK

    reads = [0] * len(planned)
    for rank in range(world_size):
        topology = Topology(rank=rank, world_size=world_size)
        # shuffle=True datasets plan with blocks of SHUFFLE_BLOCK (sample-level shuffling)
        for shard, start, stop in plan(
            planned, topology, seed=4, shuffle=True, balance=balance, block_size=SHUFFLE_BLOCK
        ):
            reads[shard] += stop - start
    return reads


@settings(max_examples=examples(40), deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 12), st.integers(-4, 4)), min_size=1, max_size=6),
    world_size=st.integers(1, 3),
    balance=st.sampled_from(["pad", "drop"]),
    shuffle=st.booleans(),
)
def test_any_wrong_counts_under_skip_yield_the_planned_samples_and_count_the_difference(
    sizes, world_size, balance, shuffle
):
    planned = [n for n, _ in sizes]
    actual = [max(0, n + delta) for n, delta in sizes]
    assume(sum(planned) >= world_size and any(actual))
    shards = lying_shards(actual, planned)
    for rank in range(world_size):
        dataset = ShardedDataset(
            shards, synthetic_read, on_error="skip", balance=balance, shuffle=shuffle, rank=rank, world_size=world_size
        )
        seen = list(dataset)
        assert len(seen) == len(dataset)
        assert set(seen) <= {f"{url}:{i}" for url, n in zip(shards, actual) for i in range(n)}
        stats = dataset.stats()
        assert stats.padded.tolist() == stats.missing.tolist()
        assert stats.total_read + stats.total_padded == len(seen)
        long = [i for i, (p, a) in enumerate(zip(planned, actual)) if a > p]
        assert set(np.flatnonzero(stats.errors).tolist()) <= set(long) | set(np.flatnonzero(stats.missing).tolist())


def test_balance_none_under_skip_only_counts_the_shortfall():
    dataset = ShardedDataset(lying_shards([4, 2, 6], [4, 5, 6]), synthetic_read, on_error="skip", balance="none")
    with pytest.warns(UserWarning, match=r"shard001-2: record 2 .*3 planned records are missing"):
        seen = list(dataset)
    assert len(seen) == 12 and len(set(seen)) == 12
    stats = dataset.stats()
    assert stats.missing.tolist() == [0, 3, 0] and stats.total_padded == 0 and stats.failed_shards() == [1]


def test_corrupt_records_under_skip_keep_the_planned_count():
    # Shard 1 has a bad record mid-way (framing intact); shard 2 loses its framing at record 3.
    dataset = ShardedDataset(lying_shards([5, 6, 7], [5, 6, 7]), broken_read, on_error="skip")
    seen = list(dataset)
    assert len(seen) == len(dataset) == 18
    assert seen[5:11] == [
        "mem/shard001-6:0",
        "mem/shard001-6:1",
        "mem/shard001-6:1",
        *[f"mem/shard001-6:{i}" for i in range(3, 6)],
    ]
    assert seen[11:] == [*[f"mem/shard002-7:{i}" for i in range(3)], *["mem/shard002-7:2"] * 4]
    stats = dataset.stats()
    assert stats.skipped.tolist() == [0, 1, 4] and stats.padded.tolist() == [0, 1, 4]
    assert stats.read.tolist() == [5, 5, 3] and stats.errors.tolist() == [0, 1, 1]


def broken_read(url: str, start: int, stop: int | None):
    """Record 2 of shard 1 has bad data (framing intact); shard 2 cannot be read past record 2."""
    for record in synthetic_read(url, start, stop):
        index = int(record.rsplit(":", 1)[1])
        if url == "mem/shard001-6" and index == 2:
            raise CorruptRecordError(url, index, 0, "bad data CRC", framing_intact=True)
        if url == "mem/shard002-7" and index == 3:
            raise CorruptRecordError(url, index, 99, "length CRC mismatch")
        yield record


def test_a_reader_that_has_read_nothing_stands_in_the_first_readable_record_of_its_rank():
    dataset = ShardedDataset(lying_shards([0, 3], [2, 3]), synthetic_read, on_error="skip")
    assert list(dataset) == ["mem/shard001-3:0"] * 2 + [f"mem/shard001-3:{i}" for i in range(3)]
    # Rank 0's whole part is missing: the first readable record of the dataset stands in.
    empty_part = [
        list(ShardedDataset(lying_shards([0, 5], [5, 5]), synthetic_read, on_error="skip", rank=r, world_size=2))
        for r in range(2)
    ]
    assert empty_part == [["mem/shard001-5:0"] * 5, [f"mem/shard001-5:{i}" for i in range(5)]]
    hopeless = ShardedDataset(lying_shards([0, 0], [2, 3]), synthetic_read, on_error="skip")
    with pytest.raises(BalanceError, match="no record of any shard can be read.*rank 0 cannot yield its planned 5"):
        list(hopeless)


def test_resuming_inside_a_run_of_made_up_samples_yields_exactly_the_rest():
    def make() -> ShardedDataset:
        return ShardedDataset(lying_shards([6, 2, 5], [6, 8, 5]), synthetic_read, on_error="skip")

    full = list(make())
    assert len(full) == 19 and full[8:14] == ["mem/shard001-2:1"] * 6
    for cut in (9, 11, 13):  # inside the six made-up samples
        dataset = make()
        iterator = iter(dataset)
        before = [next(iterator) for _ in range(cut)]
        state = json.loads(json.dumps(dataset.state_dict()))
        resumed = make()
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert len(before) + len(rest) == len(full)
        assert rest[14 - cut :] == full[14:]  # the real records after the run: the same
        assert resumed.stats().padded.tolist() == [0, 14 - cut, 0]


# --------------------------------------------------------------------------- TFRecord: bad records, bad decoding


def write_records(path: Path, records: list[bytes]) -> str:
    with shardkit.TFRecordWriter(str(path)) as out:
        for record in records:
            out.write(record)
    return str(path)


def flip_data_byte(path: str, offsets: list[int], records: list[int]) -> None:
    """Flip the first data byte of each record in ``records`` (its data CRC no longer matches)."""
    with open(path, "r+b") as file:
        for record in records:
            file.seek(offsets[record] + 12)
            byte = file.read(1)
            file.seek(offsets[record] + 12)
            file.write(bytes([byte[0] ^ 0xFF]))


def bad_every_other_record(tmp_path: Path, n: int) -> str:
    url = write_records(tmp_path / "bad.tfrecord", [b"%08d" % i for i in range(n)])
    flip_data_byte(url, record_offsets(url), list(range(1, n, 2)))
    return url


def test_a_thousand_bad_records_in_one_shard_cost_exactly_those_records(tmp_path):
    n = 2_000  # skipping used to nest a generator per bad record: RecursionError near 490
    url = bad_every_other_record(tmp_path, n)
    dataset = TFRecordDataset([url], decode="raw", on_error="skip", balance="none")
    assert list(dataset) == [b"%08d" % i for i in range(0, n, 2)]
    stats = dataset.stats()
    assert (stats.total_read, stats.total_skipped, stats.total_errors, stats.total_padded) == (
        n // 2,
        n // 2,
        n // 2,
        0,
    )
    # Balanced: every bad record is made up by a repeat of the good one before it.
    balanced = TFRecordDataset(shardkit.ShardList([url], num_records=[n]), decode="raw", on_error="skip")
    assert list(balanced) == [b"%08d" % (i - i % 2) for i in range(n)]
    assert balanced.stats().padded.tolist() == [n // 2]


@pytest.mark.slow
def test_ten_thousand_bad_records_in_one_shard_cost_exactly_those_records(tmp_path):
    # The reader restarts after each bad record; its first read after a restart is small, so this is linear.
    n = 20_000
    url = bad_every_other_record(tmp_path, n)
    dataset = TFRecordDataset([url], decode="raw", on_error="skip", balance="none")
    assert list(dataset) == [b"%08d" % i for i in range(0, n, 2)]
    stats = dataset.stats()
    assert (stats.total_read, stats.total_skipped, stats.total_errors) == (n // 2, n // 2, n // 2)


def test_a_record_that_does_not_decode_costs_only_itself_and_is_located(tmp_path):
    records = [shardkit.encode_example({"id": [i]}) for i in range(10)]
    records[4] = b"\x0a\xff\xff\xff\xff\x0f"  # CRCs fine, not an Example
    url = write_records(tmp_path / "part.tfrecord", records)
    offset = record_offsets(url)[4]
    with pytest.raises(CorruptRecordError, match=rf"record 4 at byte offset {offset}: .*does not decode") as info:
        list(TFRecordDataset([url]))  # no index file: the offset comes from a scan on this error path
    assert (info.value.url, info.value.record_index, info.value.offset, info.value.framing_intact) == (
        url,
        4,
        offset,
        True,
    )
    shardkit.build_index(url)  # with an index file, from the index
    with pytest.raises(CorruptRecordError) as info:
        list(TFRecordDataset([url]))
    assert info.value.offset == offset
    lenient = TFRecordDataset([url], on_error="skip", balance="none")
    assert [int(e["id"][0]) for e in lenient] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert lenient.stats().skipped.tolist() == [1] and lenient.stats().read.tolist() == [9]


# --------------------------------------------------------------------------- stats without temp files


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_deleting_every_temp_file_mid_iteration_changes_nothing(tmp_path, monkeypatch, context):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    shards = lying_shards([20, 5, 20], [20, 10, 20])
    dataset = ShardedDataset(shards, synthetic_read, on_error="skip")
    assert [name for name in os.listdir(temp) if "stats" in name] == []  # the stats leave nothing to delete
    loader = DataLoader(dataset, batch_size=5, num_workers=2, multiprocessing_context=context)
    # Spawned workers map the ShardList's own Arrow file by path: that file is not the stats' (see the report).
    keep = {name for name in os.listdir(temp) if name.endswith(".arrow")} if context == "spawn" else set()
    for _epoch in range(2):  # the second epoch starts new workers after the deletion
        seen = []
        for batch in loader:
            seen += batch
            for name in set(os.listdir(temp)) - keep:
                os.unlink(temp / name)
        assert len(seen) == 50
    stats = dataset.stats()
    assert stats.read.tolist() == [40, 10, 40] and stats.missing.tolist() == [0, 10, 0] == stats.padded.tolist()


def test_stats_copied_by_plain_pickling_count_on_their_own():
    dataset = ShardedDataset(lying_shards([3], [3]), synthetic_read)
    copy = pickle.loads(pickle.dumps(dataset))
    assert len(list(copy)) == 3
    assert copy.stats().total_read == 3 and dataset.stats().total_read == 0


# --------------------------------------------------------------------------- errors through DataLoader workers


def test_corrupt_record_errors_keep_their_facts_through_dataloader_workers(tmp_path):
    records = [shardkit.encode_example({"id": [i]}) for i in range(10)]
    url = write_records(tmp_path / "part.tfrecord", records)
    offsets = record_offsets(url)
    flip_data_byte(url, offsets, [7])
    loader = DataLoader(TFRecordDataset([url, url], balance="none"), batch_size=2, num_workers=2)
    with pytest.raises(CorruptRecordError) as info:
        read_all(loader)
    error = info.value
    assert (error.url, error.record_index, error.offset, error.framing_intact) == (url, 7, offsets[7], True)
    assert error.reason.startswith("data CRC mismatch") and "DataLoader worker process" in str(error)
    short = DataLoader(ShardedDataset(lying_shards([3, 2], [3, 4]), synthetic_read), num_workers=2)
    with pytest.raises(CorruptRecordError) as info:
        read_all(short)
    assert (info.value.url, info.value.record_index, info.value.offset) == ("mem/shard001-2", 2, -1)
    assert not info.value.framing_intact and "planned records are missing" in info.value.reason
    mixed = shardkit.MixedLoader(ShardedDataset(lying_shards([3, 2], [3, 4]), synthetic_read), 2, num_workers=2)
    with pytest.raises(CorruptRecordError) as info:
        list(mixed)
    assert (info.value.url, info.value.record_index, info.value.offset) == ("mem/shard001-2", 2, -1)


def test_corrupt_record_error_text_outside_workers_is_one_sentence():
    error = CorruptRecordError("a/b.tfrecord", 3, 120, "data CRC mismatch", framing_intact=True)
    assert str(error) == "a/b.tfrecord: record 3 at byte offset 120: data CRC mismatch"
    again = pickle.loads(pickle.dumps(error))
    assert (again.url, again.record_index, again.offset, again.framing_intact) == ("a/b.tfrecord", 3, 120, True)
    assert CorruptRecordError("a message alone").url == "a message alone"


def test_corrupt_record_error_keeps_how_many_records_it_costs_through_pickle_and_a_worker_message(monkeypatch):
    import shardkit.errors

    error = CorruptRecordError("a.parquet", 10, 4, "row group 2 does not decode", framing_intact=True, records=5)
    assert str(error) == "a.parquet: records 10 to 14 (5 records) at byte offset 4: row group 2 does not decode"
    assert pickle.loads(pickle.dumps(error)).records == 5
    monkeypatch.setattr(shardkit.errors, "_in_dataloader_worker", lambda: True)
    rebuilt = CorruptRecordError(f"Traceback (worker 0):\n{error}")  # what DataLoader does in the main process
    assert (rebuilt.record_index, rebuilt.records, rebuilt.framing_intact) == (10, 5, True)
    with pytest.raises(ValueError, match=r"records must be an int >= 1, got 0"):
        CorruptRecordError("a.parquet", 10, 4, "bad", framing_intact=True, records=0)


# --------------------------------------------------------------------------- a real gloo run

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_faults_check.py"


def run_ddp(on_error: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--on-error", on_error],
        capture_output=True,
        text=True,
        timeout=hang_bound(240),  # a hang (unequal batch counts) fails here instead of stalling CI
    )


@pytest.mark.slow
def test_gloo_ranks_stay_in_step_over_a_short_shard_when_skipping():
    done = run_ddp("skip")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(set(result["batches"])) == 1 and len(set(result["samples"])) == 1, result
    assert result["samples"][0] == result["planned"]
    assert sum(result["missing"]) == sum(result["padded"]) == _planned_reads_past(3, 10, result["world_size"])


def _planned_reads_past(shard: int, actual: int, world_size: int) -> int:
    """How many records at or past ``actual`` of ``shard`` the plan of tests/scripts/ddp_faults_check.py reads."""
    from shardkit import Topology, plan
    from tests.scripts.ddp_faults_check import PLANNED

    ranges = [
        r
        for rank in range(world_size)
        for r in plan(PLANNED, Topology(rank=rank, world_size=world_size), seed=2, shuffle=True)
    ]
    return sum(max(0, stop - max(start, actual)) for s, start, stop in ranges if s == shard)


@pytest.mark.slow
def test_gloo_run_over_a_short_shard_ends_with_the_error_when_raising():
    done = run_ddp("raise")
    assert done.returncode != 0
    facts = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert facts, done.stderr[-3000:]
    assert {f["url"] for f in facts} == {"mem/shard003-10"}
    assert all(f["type"] == "CorruptRecordError" and f["offset"] == -1 and not f["framing_intact"] for f in facts)
    # The process group ends: the other rank's collective fails and mp.spawn stops it (which error it
    # reports first is a race), so the run ends instead of hanging.
    assert "Traceback" in done.stderr


@pytest.mark.parametrize("with_index", [False, True])
@pytest.mark.parametrize("known_counts", [False, True])
def test_a_bad_last_record_ends_the_shard_after_costing_only_itself(tmp_path, with_index, known_counts):
    url = bad_every_other_record(tmp_path, 20)  # records 1, 3, ..., 19 are bad: the file ends with one
    if with_index:
        shardkit.build_index(url)
    shards = shardkit.ShardList([url], num_records=[20] if known_counts else None)
    dataset = TFRecordDataset(shards, decode="raw", on_error="skip", balance="none")
    with pytest.warns(UserWarning, match="skipping record 19 of"):
        assert list(dataset) == [b"%08d" % i for i in range(0, 20, 2)]
    stats = dataset.stats()
    assert (stats.total_read, stats.total_skipped, stats.total_errors, stats.total_missing) == (10, 10, 10, 0)


@pytest.mark.parametrize("kind", ["tar", "jsonl"])
def test_a_damaged_gzip_tar_or_jsonl_names_the_compressed_byte(tmp_path, kind):
    import io
    import tarfile

    from tests.formats.test_faults_tfrecord import damaged_mid_stream

    words = [f"word{i % 17} " * (i % 13 + 1) for i in range(4000)]
    if kind == "tar":
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i, text in enumerate(words):
                data = text.encode()
                info = tarfile.TarInfo(f"s{i:05d}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        body, dataset = buffer.getvalue(), shardkit.TarDataset
    else:
        body, dataset = "".join(json.dumps({"text": text}) + "\n" for text in words).encode(), shardkit.JsonlDataset
    damaged, bad_byte = damaged_mid_stream(body, len(body) // 2, "gzip")
    url = str(tmp_path / f"damaged.{kind}.gz")
    Path(url).write_bytes(damaged)
    with pytest.raises(CorruptRecordError) as raised:
        list(dataset([url]))
    assert raised.value.compressed_offset == bad_byte and f"compressed byte {bad_byte}" in str(raised.value)


def test_many_undecodable_records_without_an_index_scan_their_shard_once(tmp_path, monkeypatch):
    from shardkit.formats.tfrecord import format as tfr

    records = [shardkit.encode_example({"id": [i]}) if i % 2 else b"\x0a\xff\xff\xff\xff\x0f" for i in range(40)]
    url = write_records(tmp_path / "part.tfrecord", records)
    scans = []
    real_scan = tfr.scan_offsets
    monkeypatch.setattr(tfr, "scan_offsets", lambda *args, **kwargs: scans.append(args) or real_scan(*args, **kwargs))
    lenient = TFRecordDataset([url], on_error="skip", balance="none")
    with pytest.warns(UserWarning, match=rf"skipping record 38 of {re.escape(url)}"):
        assert [int(e["id"][0]) for e in lenient] == list(range(1, 40, 2))
    assert len(scans) == 1 and lenient.stats().skipped.tolist() == [20]
