"""A MixedLoader worker's log of its samples' record positions (issue 39, item 3).

Where the root iterator is ``.shuffle()``'s, ``.map()``'s or ``.filter()``'s, it
appends each sample's position to the log itself (``position_log``); around any
other root a generator reads ``position`` after each sample. Both must give every sample's own record
position, in order, across shard boundaries and after a resume; a
micro-batch's positions travel as an int64 array's bytes.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.loader import timing
from shardkit.loader.micro_batches import START, MicroBatches, PositionLog, positions_of
from shardkit.stateful import pack
from tests.helpers.examples import examples
from tests.helpers.shards import positional_read, positional_shards


def packed(counts: list[int], values: list[int]) -> list[int]:
    """The packed record positions of the samples ``values`` (record ``i`` of the dataset reads as ``i``)."""
    firsts = np.cumsum([0, *counts])
    shards = np.searchsorted(firsts, values, side="right") - 1
    return [pack(int(shard), int(value - firsts[shard])) for shard, value in zip(shards, values)]


def shuffled(counts: list[int], buffer: int, seed: int, window: int | None) -> shardkit.Pipeline:
    source = shardkit.ShardedDataset(positional_shards(counts), positional_read, shuffle=True, seed=seed)
    if window is not None:
        source.shuffle_window = window
    return source.shuffle(buffer)


def rooted(kind: str, counts: list[int], buffer: int, seed: int, window: int | None) -> shardkit.Pipeline:
    """A pipeline over positional records whose root (outermost) stage is ``kind``."""
    if kind == "map over the source":
        source = shardkit.ShardedDataset(positional_shards(counts), positional_read, shuffle=True, seed=seed)
        if window is not None:
            source.shuffle_window = window
        return source.map(lambda x: x)
    below = shuffled(counts, buffer, seed, window)
    return {"shuffle": below, "map": below.map(lambda x: x), "filter": below.filter(lambda x: x % 3 != 1)}[kind]


def logged(dataset: Any, size: int, bulk: bool = True) -> tuple[list[int], list[list[int] | None]]:
    """Every sample of a fresh iteration of ``dataset`` (state already loaded) and each micro-batch's
    positions as a worker logs them: by the root iterator itself (``bulk``), or by a generator around it."""
    samples = iter(dataset)
    log = PositionLog.of(dataset, samples)
    assert log is not None
    pulled = log.logged(samples) if bulk else log._noted(samples)
    assert (pulled is samples) == bulk  # the root logs them itself: nothing wraps it
    values: list[int] = []
    taken: list[list[int] | None] = []
    while chunk := list(islice(pulled, size)):
        values += chunk
        positions = positions_of(log.take(len(chunk)))
        taken.append(None if positions is None else positions.tolist())
    return values, taken


def flat(taken: list[list[int] | None]) -> list[int]:
    assert all(positions is not None for positions in taken)
    return [position for positions in taken for position in positions or ()]


counts_strategy = st.lists(st.integers(1, 40), min_size=1, max_size=5)
kinds = st.sampled_from(["shuffle", "map", "filter", "map over the source"])


@pytest.mark.slow  # many pipelines planned: about 10 s
@settings(max_examples=examples(80), deadline=None)
@given(
    kinds,
    counts_strategy,
    st.integers(1, 64),
    st.integers(1, 17),
    st.integers(0, 3),
    st.sampled_from([None, 0, 7]),
    st.floats(0, 1),
)
def test_a_root_logs_the_same_positions_in_bulk_as_read_one_sample_at_a_time_and_after_a_resume(
    kind: str, counts: list[int], buffer: int, size: int, seed: int, window: int | None, cut: float
) -> None:
    values, taken = logged(rooted(kind, counts, buffer, seed, window), size)
    assert logged(rooted(kind, counts, buffer, seed, window), size, bulk=False) == (values, taken)
    expected = [value for value in range(sum(counts)) if kind != "filter" or value % 3 != 1]
    assert sorted(values) == expected
    assert flat(taken) == packed(counts, values)  # every shard's records, named by their own shard
    # Resumed part-way (a shuffle buffer held by position, read again), both logs go on with the rest.
    before = rooted(kind, counts, buffer, seed, window)
    consumed = list(islice(iter(before), int(cut * len(expected))))
    state = before.state_dict()
    resumed = []
    for bulk in (True, False):
        after = rooted(kind, counts, buffer, seed, window)
        after.load_state_dict(state)
        resumed.append(logged(after, size, bulk))
    assert resumed[0] == resumed[1]
    assert resumed[0][0] == values[len(consumed) :]
    assert flat(resumed[0][1]) == packed(counts, resumed[0][0])


def test_a_map_that_raises_logs_no_position_for_the_sample_it_did_not_return() -> None:
    def fussy(value: int) -> int:
        if value == 5:
            raise ValueError("five")
        return value

    dataset = shardkit.ShardedDataset(positional_shards([4, 6]), positional_read, shuffle=False).map(fussy)
    samples = iter(dataset)
    log = PositionLog.of(dataset, samples)
    assert log is not None
    pulled = log.logged(samples)
    assert list(islice(pulled, 5)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="five"):
        next(pulled)
    assert positions_of(log.take(5)).tolist() == packed([4, 6], [0, 1, 2, 3, 4])  # type: ignore[union-attr]
    assert log.take(5) == b""  # nothing for the sample that raised


class _Positioned:
    """Records 0, 1, ... whose positions are themselves, but None for the ones in ``without``."""

    def __init__(self, count: int, without: set[int]) -> None:
        self._next, self._count, self._without = 0, count, without
        self.position: int | None = None

    def __iter__(self) -> _Positioned:
        return self

    def __next__(self) -> int:
        if self._next == self._count:
            raise StopIteration
        value, self._next = self._next, self._next + 1
        self.position = None if value in self._without else value
        return value


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(0, 40), st.integers(1, 9), st.sets(st.integers(0, 39), max_size=3))
def test_a_micro_batch_with_a_sample_without_a_position_has_no_positions_and_the_others_keep_theirs(
    count: int, size: int, without: set[int]
) -> None:
    log = PositionLog()
    samples = log.logged(_Positioned(count, without))
    for start in range(0, count, size):
        chunk = list(islice(samples, size))
        assert chunk == list(range(start, min(start + size, count)))
        taken = log.take(len(chunk))
        if without & set(chunk):
            assert taken is None
        else:
            assert taken is not None and positions_of(taken).tolist() == chunk
            assert len(taken) == 8 * len(chunk)  # int64 bytes: what a message carries


def test_a_worker_over_a_shuffle_sends_each_micro_batch_its_samples_positions_before_and_after_a_resume() -> None:
    counts = [23, 5, 31]
    dataset = shuffled(counts, 16, 1, 0)
    messages = list(MicroBatches(dataset, 8, collate=False, resumable=True, ask=True)._messages(0, None))
    assert messages[0][1] == START and messages[-1][1] == 0
    batches = messages[1:-1]
    values = [value for message in batches for value in message[2]]
    assert sorted(values) == list(range(sum(counts)))
    for message in batches:
        assert positions_of(message[5]).tolist() == packed(counts, message[2])  # type: ignore[union-attr]
    # The worker's state after the third micro-batch (as state_dict() asks of it), loaded into a new one.
    asked = MicroBatches(shuffled(counts, 16, 1, 0), 8, collate=False, resumable=True, ask=True)._messages(0, None)
    asks = next(asked)[5]
    for _ in range(2):
        next(asked)
    asks[0] += 1
    state = next(asked)[3]
    assert isinstance(state, dict)
    again = MicroBatches(shuffled(counts, 16, 1, 0), 8, collate=False, resumable=True, ask=True)
    rest = list(again._messages(0, [state]))[1:-1]
    assert [value for message in rest for value in message[2]] == values[24:]
    for message in rest:
        assert positions_of(message[5]).tolist() == packed(counts, message[2])  # type: ignore[union-attr]


def test_every_micro_batch_sampled_by_the_worker_clock_still_logs_each_samples_position(monkeypatch: Any) -> None:
    # The clock's timing proxies sit between the stages while a micro-batch is sampled; the shuffle
    # reads its input's `position` through the proxy, and must still hold every record's own.
    monkeypatch.setattr(timing, "SAMPLE_EVERY", 1)
    counts = [13, 40, 7]
    dataset = shuffled(counts, 9, 2, None).map(lambda x: x).shuffle(5)  # two shuffles: a proxy under each
    samples = iter(dataset)
    log = PositionLog.of(dataset, samples)
    assert log is not None
    pulled, clock, values = log.logged(samples), timing.WorkerClock(dataset), []
    while chunk := clock.take(pulled, 6):
        clock.collated(len(chunk))
        positions = positions_of(log.take(len(chunk)))
        assert positions is not None and positions.tolist() == packed(counts, chunk)
        values += chunk
    assert sorted(values) == list(range(sum(counts)))
    assert clock.figures()[timing.FIGURES.index("sampled")] > 0  # they were sampled
    proxy = timing._Timed(samples)
    assert proxy.position == samples.position and timing._Timed(iter([])).position is None
