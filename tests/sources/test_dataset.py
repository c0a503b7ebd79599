"""Sources under real DataLoader workers and simulated ranks: coverage and equal counts."""

from __future__ import annotations

import collections
import functools
import os
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

import shardkit
from shardkit.pipeline import UnknownLengthError
from shardkit.sources import DatasetError, ShardedDataset
from tests.helpers.reading import CountingStream, batches_as_workers
from tests.helpers.shards import all_ids, synthetic_read, synthetic_shards

# 9 shards, uneven, with an empty one: 113 records, a prime, so no split is even.
COUNTS = [17, 3, 0, 25, 9, 30, 11, 6, 12]


# The worker counts whose matrix cells start real DataLoader workers; the other counts are read in this process
# as each worker would read (tests/helpers/reading.py batches_as_workers): the share is the same code, and the
# process path (fork, the dataset's pickled state, the shared stats) is one path whatever the count.
REAL_WORKERS = (0, 2)


def run_cell(dataset, *, num_workers, batch_size):
    """A matrix cell: :func:`run_rank`, or the same batches read in this process for the larger worker counts."""
    if num_workers in REAL_WORKERS:
        return run_rank(dataset, num_workers=num_workers, batch_size=batch_size)
    return run_simulated(dataset, num_workers=num_workers, batch_size=batch_size)


def run_simulated(dataset, *, num_workers, batch_size):
    """The batches of :func:`run_rank`, each worker's share read in this process (another order)."""
    return [list(batch) for batch in batches_as_workers(dataset, num_workers, batch_size)]


def run_rank(dataset, *, num_workers, batch_size, context="fork"):
    """All batches one rank's DataLoader yields, as lists of sample ids."""
    kwargs = {"multiprocessing_context": context} if num_workers else {}
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, **kwargs)
    return [list(batch) for batch in loader]


def run_world(make, world_size, **kwargs):
    return [run_cell(make(rank, world_size), **kwargs) for rank in range(world_size)]


@pytest.mark.parametrize("num_workers", [0, 2, 3, 4])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_balance_none_yields_every_record_exactly_once(num_workers, world_size, shuffle):
    shards = synthetic_shards(COUNTS)

    def make(rank, world):
        return ShardedDataset(shards, synthetic_read, balance="none", shuffle=shuffle, rank=rank, world_size=world)

    ranks = run_world(make, world_size, num_workers=num_workers, batch_size=5)
    seen = [sample for batches in ranks for batch in batches for sample in batch]
    assert sorted(seen) == sorted(all_ids(shards))


@pytest.mark.parametrize("balance", ["pad", "drop"])
@pytest.mark.parametrize("num_workers", [0, 2, 3, 4])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pad_and_drop_give_every_rank_the_same_batches(balance, num_workers, world_size):
    shards = synthetic_shards(COUNTS)
    total = sum(COUNTS)

    def make(rank, world):
        return ShardedDataset(
            shards, synthetic_read, balance=balance, shuffle=True, seed=3, rank=rank, world_size=world
        )

    ranks = run_world(make, world_size, num_workers=num_workers, batch_size=4)
    batch_counts = {len(batches) for batches in ranks}
    sample_counts = {sum(len(b) for b in batches) for batches in ranks}
    assert len(batch_counts) == 1, f"ranks yield different numbers of batches: {batch_counts}"
    per_rank = -(-total // world_size) if balance == "pad" else total // world_size
    assert sample_counts == {per_rank}
    seen = collections.Counter(s for batches in ranks for batch in batches for s in batch)
    everything = set(all_ids(shards))
    assert set(seen) <= everything
    if balance == "pad":
        assert set(seen) == everything  # nothing lost, the padding repeats
        assert sum(seen.values()) - total == world_size * per_rank - total
    else:
        assert max(seen.values()) == 1
        assert len(everything - set(seen)) == total % world_size
    # len() of the dataset is what each rank yields
    assert len(make(0, world_size)) == per_rank


def test_rank_comes_from_the_environment_when_iteration_starts(monkeypatch):
    shards = synthetic_shards(COUNTS)
    dataset = ShardedDataset(shards, synthetic_read, balance="none")  # built before RANK is set
    seen = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        seen += [s for batch in run_rank(dataset, num_workers=2, batch_size=7) for s in batch]
    assert sorted(seen) == sorted(all_ids(shards))
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' and WORLD_SIZE='3' must be integers"):
        list(dataset)


@pytest.mark.slow
def test_spawned_workers_split_too():
    shards = synthetic_shards(COUNTS)
    dataset = ShardedDataset(shards, synthetic_read, balance="none", shuffle=True)
    seen = [s for batch in run_rank(dataset, num_workers=2, batch_size=8, context="spawn") for s in batch]
    assert sorted(seen) == sorted(all_ids(shards))


def test_unknown_counts_on_one_rank_deal_whole_shards_and_warn_when_too_few(monkeypatch):
    shards = synthetic_shards(COUNTS, known=False)
    dataset = ShardedDataset(shards, synthetic_read)
    seen = [s for batch in run_rank(dataset, num_workers=2, batch_size=5) for s in batch]
    assert sorted(seen) == sorted(all_ids(shards))
    with pytest.raises(UnknownLengthError, match="count_records"):
        len(dataset)
    # Seen from worker 0 of 3 (warnings in real workers go to their stderr).
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(id=0, num_workers=3))
    few = ShardedDataset(synthetic_shards([4], known=False), synthetic_read)
    with pytest.warns(UserWarning, match="1 shards for 3 DataLoader workers"):
        assert len(list(few)) == 4


def test_unknown_counts_over_several_ranks_are_counted_once_or_explained(tmp_path):
    shards = synthetic_shards(COUNTS, known=False)
    no_counter = ShardedDataset(shards, synthetic_read, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"needs the record count of every shard.*count_fn="):
        list(no_counter)
    calls = []

    def count(url):
        calls.append(url)
        return sum(1 for _ in synthetic_read(url, 0, None))

    ranks = []
    for rank in range(2):
        dataset = ShardedDataset(shards, synthetic_read, rank=rank, world_size=2, count_fn=count)
        ranks.append(sorted(dataset))
    assert len(ranks[0]) == len(ranks[1]) == -(-sum(COUNTS) // 2)
    assert set(ranks[0]) | set(ranks[1]) == set(all_ids(shards))
    assert len(calls) >= len(COUNTS)


def test_counts_are_cached_in_the_cache_directory_not_beside_the_data(tmp_path, counts_cache_dir):
    urls = [str(tmp_path / f"part-{n}") for n in (4, 6)]
    for url in urls:
        open(url, "wb").close()
    calls = []

    def count(url):
        calls.append(url)
        return int(url.rsplit("-", 1)[1])

    first = ShardedDataset(urls, synthetic_read, count_fn=count, rank=0, world_size=2).count_records()
    assert first.shards.num_records.tolist() == [4, 6]
    assert sorted(os.listdir(tmp_path)) == ["part-4", "part-6"]
    assert len(os.listdir(counts_cache_dir)) == 1
    second = ShardedDataset(urls, synthetic_read, count_fn=count, rank=0, world_size=2).count_records()
    assert second.shards.num_records.tolist() == [4, 6]
    assert len(calls) == 2  # the second dataset read the cache


def test_epochs_reshuffle_identically_on_every_rank():
    shards = synthetic_shards([1] * 40)

    def epoch_order(epoch):
        order = []
        for rank in range(2):
            dataset = ShardedDataset(
                shards, synthetic_read, shuffle=True, seed=5, balance="none", rank=rank, world_size=2
            )
            dataset.set_epoch(epoch)
            order += list(dataset)
        return order

    assert epoch_order(0) == epoch_order(0)
    assert epoch_order(0) != epoch_order(1)
    assert sorted(epoch_order(0)) == sorted(epoch_order(1))


class Squares(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return index * index


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
def test_wrap_map_style_dataset(shuffle, balance):
    n, world = 23, 3
    # Real workers for "none" (exactly once through two processes); pad and drop read each worker's share in
    # this process (the same code plans it), so the 6 cells start 12 workers, not 36.
    read = run_rank if balance == "none" else run_simulated
    ranks = [
        read(
            shardkit.wrap(Squares(n), shuffle=shuffle, balance=balance, rank=r, world_size=world),
            num_workers=2,
            batch_size=3,
        )
        for r in range(world)
    ]
    values = collections.Counter(int(v) for batches in ranks for b in batches for v in b)
    squares = {i * i for i in range(n)}
    if balance == "none":
        assert sorted(values.elements()) == sorted(squares)
    else:
        assert len({sum(len(b) for b in batches) for batches in ranks}) == 1
        assert len({len(batches) for batches in ranks}) == 1
        assert set(values) <= squares
    dataset = shardkit.wrap(Squares(n), shuffle=shuffle, balance=balance, rank=0, world_size=world)
    assert len(dataset) == {"none": 8, "pad": 8, "drop": 7}[balance]


@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
def test_wrap_iterable_keeps_each_readers_share(balance):
    n, world, workers = 29, 2, 2
    ranks = [
        run_rank(
            shardkit.wrap(CountingStream(n), balance=balance, rank=r, world_size=world),
            num_workers=workers,
            batch_size=4,
        )
        for r in range(world)
    ]
    seen = collections.Counter(int(v) for batches in ranks for b in batches for v in b)
    readers = world * workers
    if balance == "none":
        assert sorted(seen.elements()) == list(range(n))
    elif balance == "drop":
        assert sum(seen.values()) == readers * (n // readers) and max(seen.values()) == 1
    else:
        assert sum(seen.values()) == readers * -(-n // readers) and set(seen) == set(range(n))
    if balance != "none":
        assert len({len(batches) for batches in ranks}) == 1


def test_wrap_rejects_what_it_cannot_wrap():
    with pytest.raises(DatasetError, match="map-style dataset .* or an iterable"):
        shardkit.wrap(42)
    with pytest.raises(DatasetError, match=r"chain .shuffle\(buffer_size\)"):
        shardkit.wrap(CountingStream(3), shuffle=True)
    source = shardkit.wrap(Squares(3))
    with pytest.raises(DatasetError, match="already a shardkit pipeline"):
        shardkit.wrap(source)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"balance": "even"}, "balance must be one of"),
        ({"rank": 1}, "give rank and world_size together"),
        ({"rank": 2, "world_size": 2}, r"rank must be an int in \[0, world_size\)"),
        ({"on_error": "ignore"}, "on_error must be 'raise' or 'skip'"),
        ({"seed": -3}, "seed must be an int >= 0"),
    ],
)
def test_arguments_are_checked_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardedDataset(synthetic_shards([3]), synthetic_read, **kwargs)
    with pytest.raises(DatasetError, match="read_fn must be callable"):
        ShardedDataset(synthetic_shards([3]), "not a function")


def test_a_read_fn_that_cannot_be_pickled_is_explained():
    dataset = ShardedDataset(synthetic_shards([3]), lambda url, start, stop: iter(()))
    with pytest.raises(DatasetError, match="cannot be pickled.*module level.*functools.partial"):
        pickle.dumps(dataset)
    with pytest.raises(DatasetError, match="cannot be pickled"):
        list(DataLoader(dataset, num_workers=1, multiprocessing_context="spawn"))
    fine = ShardedDataset(synthetic_shards([3]), functools.partial(synthetic_read))
    assert pickle.loads(pickle.dumps(fine)).shards == fine.shards


def flaky_read(url, start, stop):
    """Shard 'bad-*' fails after two records; shard 'gone-*' cannot be opened."""
    if url.startswith("gone"):
        raise FileNotFoundError(url)
    for index, record in enumerate(synthetic_read(url, start, stop), start):
        if url.startswith("bad") and index == 2:
            raise OSError(f"{url}: unreadable block at record 2")
        yield record


def test_on_error_skip_counts_what_it_skips_across_workers():
    shards = shardkit.ShardList(["ok-5", "bad-6", "gone-4", "ok2-3"], num_records=[5, 6, 4, 3])
    strict = ShardedDataset(shards, flaky_read, balance="none")
    with pytest.raises(OSError, match="unreadable block at record 2"):
        list(strict)
    in_process = ShardedDataset(shards, flaky_read, balance="none", on_error="skip")
    with pytest.warns(UserWarning) as caught:
        assert len(list(in_process)) == 10
    messages = " ".join(str(w.message) for w in caught)
    assert "skipping 4 records of bad-6 from record 2" in messages
    assert "skipping 4 records of gone-4 from record 0" in messages
    assert in_process.stats().read.tolist() == [5, 2, 0, 3]
    assert in_process.stats().skipped.tolist() == [0, 4, 4, 0]
    # With two workers bad-6 is split between them; whatever each skipped is counted.
    lenient = ShardedDataset(shards, flaky_read, balance="none", on_error="skip")
    seen = [s for b in run_rank(lenient, num_workers=2, batch_size=2) for s in b]
    stats = lenient.stats()
    assert stats.total_read == len(seen) == len(set(seen))
    assert stats.total_read + stats.total_skipped == sum([5, 6, 4, 3])
    assert stats.read.tolist()[0] == 5 and stats.read.tolist()[3] == 3
    assert stats.skipped.tolist()[2] == 4 and stats.skipped.tolist()[1] >= 1
    assert stats.errors.tolist() == [0, 1, 1, 0]
    assert stats.failed_shards() == [1, 2]
    assert "bad-6:2" not in seen and "bad-6:0" in seen


def test_sources_chain_a_shuffle_buffer():
    # shuffle=True (shards) and .shuffle(n) (a sample buffer) must not collide.
    shards = synthetic_shards(COUNTS)
    for source in (
        ShardedDataset(shards, synthetic_read, shuffle=True, balance="none"),
        shardkit.wrap(Squares(20), shuffle=True),
        shardkit.wrap(CountingStream(20)),
    ):
        buffered = source.shuffle(8, seed=1)
        assert sorted(buffered, key=str) == sorted(source, key=str)
        assert list(buffered) != list(source)
