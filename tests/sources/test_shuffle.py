"""Sample-level ``shuffle=True``: quality, exactly-once, determinism and exact resume.

The data is synthetic: record ``i`` of the whole dataset (shard after shard)
reads as the int ``i``, so the order a loader yields is directly the sequence
of storage positions that :func:`shardkit.shuffle_quality` scores.
"""

from __future__ import annotations

import json
import pickle
import random
from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from shardkit import MixedLoader, ShardedDataset, shuffle_quality
from shardkit.sources.ranges import _RangeIterator
from shardkit.state import merge
from tests.helpers.examples import examples
from tests.helpers.shards import holey_positional_read, positional_read, positional_shards

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

#: 40 shards of uneven sizes, 24,000 records: enough windows for the scores to mean something.
COUNTS = [500 + 50 * (i % 5) for i in range(40)]
TOTAL = sum(COUNTS)


def dataset(counts: list[int] = COUNTS, **kwargs: Any) -> ShardedDataset:
    return ShardedDataset(positional_shards(counts), positional_read, **{"shuffle": True, "seed": 3, **kwargs})


@contextmanager
def as_worker(worker: int, workers: int):  # type: ignore[no-untyped-def]
    """Iterate in this process as DataLoader worker ``worker`` of ``workers`` would."""
    info = SimpleNamespace(id=worker, num_workers=workers)
    with mock.patch.object(torch.utils.data, "get_worker_info", lambda: info):
        yield


def rank_order(source: ShardedDataset, workers: int) -> list[int]:
    """What one rank yields through a DataLoader with ``workers`` workers, batch after batch.

    Batches of 64, not single samples: a sample per message made the worker IPC the cost of the
    test (24,000 messages). It is also the stricter measure: consecutive samples within a batch
    come from one worker's own stream, which is what the shuffle must keep apart, where single
    samples alternate between workers whose positions are rarely adjacent anyway."""
    loader = DataLoader(source, batch_size=64, num_workers=workers)
    return [int(sample) for batch in loader for sample in batch]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("workers", [0, 2, 3])
def test_default_shuffle_leaves_under_one_percent_adjacent_with_near_uniform_entropy(
    world_size: int, workers: int
) -> None:
    orders = [rank_order(dataset(rank=rank, world_size=world_size), workers) for rank in range(world_size)]
    assert sorted(p for order in orders for p in order) == list(range(TOTAL))  # exactly once (pad adds none here)
    for order in orders:
        quality = shuffle_quality(order)
        assert quality.adjacent_fraction <= 0.01, quality
        assert quality.difference_entropy >= 0.9, quality


def test_block_only_shuffle_is_what_shuffle_window_zero_gives_and_scores_badly() -> None:
    """The control: the measure does see the old shard-and-block order."""
    source = dataset()
    source.shuffle_window = 0
    quality = shuffle_quality([int(s) for s in source])
    assert quality.adjacent_fraction > 0.9


def test_shuffle_false_reads_in_storage_order_as_before() -> None:
    assert list(dataset(shuffle=False)) == list(range(TOTAL))


def test_order_is_a_function_of_seed_and_epoch() -> None:
    first, again = dataset(), dataset()
    order = list(first)  # a second pass over ``first`` would read epoch 1: passes count epochs
    assert order == list(again)
    again.set_epoch(1)
    other_epoch = list(again)
    assert other_epoch != order and sorted(other_epoch) == list(range(TOTAL))
    assert list(first) == other_epoch  # the second pass without set_epoch reads epoch 1
    assert list(dataset(seed=4)) != order


def test_what_a_rank_reads_does_not_depend_on_its_worker_count() -> None:
    """Elastic resume needs a rank's chunk to be the same whatever num_workers."""
    for rank in range(3):
        chunks = set()
        for workers in (1, 2, 3):
            samples = []
            for worker in range(workers):
                with as_worker(worker, workers):
                    samples += list(dataset(rank=rank, world_size=3))
            chunks.add(tuple(sorted(samples)))
        assert len(chunks) == 1


def read_all(
    counts: list[int], world_size: int, workers: int, balance: str, block: int, window: int
) -> list[list[int]]:
    """Every rank's samples, its workers one after the other, read in this process."""
    out = []
    for rank in range(world_size):
        samples: list[int] = []
        for worker in range(workers):
            source = dataset(counts, rank=rank, world_size=world_size, balance=balance)
            source.shuffle_block, source.shuffle_window = block, window
            with as_worker(worker, workers):
                samples += list(source)
        out.append(samples)
    return out


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    counts=st.lists(st.integers(0, 60), min_size=1, max_size=8).filter(lambda c: sum(c) > 0),
    world_size=st.integers(1, 4),
    workers=st.integers(1, 3),
    balance=st.sampled_from(["none", "pad", "drop"]),
    block=st.integers(1, 40),
    window=st.integers(1, 70),
)
def test_windows_keep_exactly_once_and_the_balances(
    counts: list[int], world_size: int, workers: int, balance: str, block: int, window: int
) -> None:
    total = sum(counts)
    if balance == "drop" and total < world_size:
        return  # refused with a PlanError, tested in test_plan
    ranks = read_all(counts, world_size, workers, balance, block, window)
    seen = Counter(p for samples in ranks for p in samples)
    if balance == "none":
        assert sorted(seen.elements()) == list(range(total))
    elif balance == "pad":
        assert {len(s) for s in ranks} == {-(-total // world_size)} and set(seen) == set(range(total))
        assert sum(seen.values()) - total < world_size
    else:
        assert {len(s) for s in ranks} == {total // world_size} and max(seen.values()) == 1


def states_along(make: Any, batches: list[int]) -> tuple[list[Any], dict[int, tuple[dict[str, Any], list[Any]]]]:
    """The uninterrupted run of loader ``make()`` and its JSON state after each count in ``batches``."""
    full = [batch.tolist() for batch in make()]
    loader, delivered, states = make(), [], {}
    for count, batch in enumerate(loader, 1):
        delivered.append(batch.tolist())
        if count in batches:
            states[count] = json.loads(json.dumps(loader.state_dict())), list(delivered)
    return full, states


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_windows_exactly_at_random_points(workers: int) -> None:
    counts = [300, 450, 200, 520, 330]  # 1,800 records; windows of 256 over blocks of 32

    def make() -> StatefulDataLoader:
        source = dataset(counts)
        source.shuffle_block, source.shuffle_window = 32, 256
        return StatefulDataLoader(source, batch_size=16, num_workers=workers)

    points = sorted(random.Random(workers).sample(range(1, 1800 // 16), 4))
    full, states = states_along(make, points)
    assert sorted(p for batch in full for p in batch) == list(range(1800))
    for count, (state, delivered) in states.items():
        loader = make()
        loader.load_state_dict(state)
        assert delivered + [batch.tolist() for batch in loader] == full, f"resumed after batch {count}"


def test_a_window_state_keeps_positions_only_and_lists_what_is_left() -> None:
    source = dataset()
    source.shuffle_window = 2048
    iterator = iter(source)
    delivered = [next(iterator) for _ in range(3000)]
    state = source.state_dict()
    assert state["window"] == {"yielded": 3000 - 2048, "skipped": []} and state["remaining"][0][0] == 2048
    assert sum(b - a for a, b in _RangeIterator.left_of(state)) == TOTAL - 3000
    assert len(json.dumps(state)) < 1024  # the window's start, not its positions
    resumed = dataset()
    resumed.shuffle_window = 2048
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert rest == list(iterator) and sorted(delivered + rest) == list(range(TOTAL))


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.77])
def test_a_window_state_with_default_settings_pickles_to_at_most_4_kb(fraction: float) -> None:
    """Issue 39's bound per rank: the default window (4,096 records) holding 12,000 records' positions,
    saved anywhere in it, is its start and a count, however its permutation scattered the yielded ones."""
    counts = [1500] * 8
    source = ShardedDataset(positional_shards(counts), positional_read, shuffle=True, seed=2)
    iterator = iter(source)
    delivered = [next(iterator) for _ in range(int(fraction * sum(counts)))]
    state = source.state_dict()
    assert len(pickle.dumps(state)) <= 4096
    assert sum(b - a for a, b in _RangeIterator.left_of(state)) == sum(counts) - len(delivered)
    resumed = ShardedDataset(positional_shards(counts), positional_read, shuffle=True, seed=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert list(resumed) == list(iterator)


def test_a_merged_window_state_resumes_the_same_set_with_another_worker_count() -> None:
    """MixedLoader's mechanism: merge every worker's state, split anew."""
    states, delivered = [], []
    for worker in range(2):
        source = dataset()
        with as_worker(worker, 2):
            iterator = iter(source)
            delivered += [next(iterator) for _ in range(1000 + 777 * worker)]
            states.append(json.loads(json.dumps(source.state_dict())))
    merged = merge(states)
    assert merged["window"] is None
    rest = []
    for worker in range(3):
        source = dataset()
        source.load_state_dict(merged)
        with as_worker(worker, 3):
            rest += list(source)
    assert sorted(delivered + rest) == list(range(TOTAL))


#: COUNTS at 1/16, with blocks and windows at 1/16 too: each of 2 workers still reads its
#: 740 records in several windows and is saved in the middle of one, at 1/16 of the cost.
SMALL = [count // 16 for count in COUNTS]


def test_mixed_loader_resumed_with_another_worker_count_delivers_the_rest_once() -> None:
    def make(workers: int) -> MixedLoader:
        source = dataset(SMALL)
        source.shuffle_block, source.shuffle_window = 32, 256
        return MixedLoader(source, 16, num_workers=workers, micro_batch_size=4)

    loader = make(2)
    delivered = []
    for count, batch in enumerate(loader, 1):
        delivered += batch.tolist()
        if count == 37:  # 592 of 1,480: each worker mid-window
            state = json.loads(json.dumps(loader.state_dict()))
            break
    assert len(state["workers"]) == 2 and all(worker["window"] for worker in state["workers"]), state
    resumed = make(3)
    resumed.load_state_dict(state)
    rest = [p for batch in resumed for p in batch.tolist()]
    assert sorted(delivered + rest) == list(range(sum(SMALL)))


@pytest.mark.filterwarnings("ignore:skipping record")
@pytest.mark.parametrize("workers", [0, 2])
def test_skipped_records_leave_windows_short_and_resume_stays_exact(workers: int) -> None:
    counts = [300, 450, 200, 520, 330]
    good = [p for p in range(sum(counts)) if p % 97 != 5]

    def make() -> StatefulDataLoader:
        source = ShardedDataset(
            positional_shards(counts), holey_positional_read, shuffle=True, seed=1, balance="none", on_error="skip"
        )
        source.shuffle_block, source.shuffle_window = 16, 100
        return StatefulDataLoader(source, batch_size=8, num_workers=workers)

    points = sorted(random.Random(7 + workers).sample(range(1, len(good) // 8), 4))
    full, states = states_along(make, points)
    assert sorted(p for batch in full for p in batch) == good
    for count, (state, delivered) in states.items():
        loader = make()
        loader.load_state_dict(state)
        assert delivered + [batch.tolist() for batch in loader] == full, f"resumed after batch {count}"


@pytest.mark.parametrize("longer", range(4))
def test_a_shard_longer_than_its_count_is_found_wherever_its_last_block_is_read(longer: int) -> None:
    """The end checks of a reader's last range run too (the window reads its reader to the end)."""
    counts = [40, 40, 40, 40]
    urls = [f"pos/{i}/{40 * i}-{40 + 5 * (i == longer)}" for i in range(4)]  # one shard holds 5 records more
    from shardkit import CorruptRecordError, ShardList

    for seed in range(6):
        source = ShardedDataset(ShardList(urls, num_records=counts), positional_read, shuffle=True, seed=seed)
        source.shuffle_block, source.shuffle_window = 8, 32
        with pytest.raises(CorruptRecordError, match="more records than its planned count"):
            list(source)
