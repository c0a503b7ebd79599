"""Properties of the pure sharding plan: exactly-once, equal counts, determinism."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardkit import Range, Topology, plan
from shardkit.planning import PlanError, plan_whole_shards, reader_counts
from tests.helpers.examples import examples


def all_plans(counts, world, workers, **kwargs):
    """{(rank, worker): ranges} for every reader of the world."""
    return {
        (r, w): plan(counts, Topology(r, world, w, workers), **kwargs) for r in range(world) for w in range(workers)
    }


def multiplicity(counts, plans) -> np.ndarray:
    """How many times each record of the dataset is read, in shard order."""
    counts = np.asarray(counts, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    diff = np.zeros(int(offsets[-1]) + 1, dtype=np.int64)
    for ranges in plans.values():
        for shard, start, stop in ranges:
            assert 0 <= start < stop <= counts[shard], (shard, start, stop, counts[shard])
            diff[offsets[shard] + start] += 1
            diff[offsets[shard] + stop] -= 1
    return np.cumsum(diff)[:-1]


def sizes(plans, world, workers) -> np.ndarray:
    out = np.zeros((world, workers), dtype=np.int64)
    for (r, w), ranges in plans.items():
        out[r, w] = sum(stop - start for _, start, stop in ranges)
    return out


shard_counts = st.lists(st.integers(0, 1000), min_size=0, max_size=500)
worlds = st.integers(1, 16)
worker_counts = st.integers(1, 8)


@settings(max_examples=examples(150), deadline=None)
@given(shard_counts, worlds, worker_counts, st.booleans(), st.integers(0, 2**32 - 1), st.integers(0, 5))
def test_none_reads_every_record_exactly_once(counts, world, workers, shuffle, seed, epoch):
    plans = all_plans(counts, world, workers, balance="none", shuffle=shuffle, seed=seed, epoch=epoch)
    assert np.all(multiplicity(counts, plans) == 1)
    per_reader = sizes(plans, world, workers)
    total = sum(counts)
    # Even split: readers differ by at most one record per level, and none is
    # empty while another has two or more.
    assert per_reader.max() - per_reader.min() <= 2
    if total >= world * workers:
        assert per_reader.min() >= 1


@settings(max_examples=examples(150), deadline=None)
@given(shard_counts, worlds, worker_counts, st.booleans(), st.integers(0, 2**32 - 1))
def test_pad_gives_every_rank_ceil_and_equal_workers(counts, world, workers, shuffle, seed):
    plans = all_plans(counts, world, workers, balance="pad", shuffle=shuffle, seed=seed)
    per_reader = sizes(plans, world, workers)
    total = sum(counts)
    assert np.all(per_reader.sum(axis=1) == -(-total // world))
    # worker w reads the same number of records on every rank
    assert np.all(per_reader == per_reader[0])
    mult = multiplicity(counts, plans)
    assert np.all(mult >= 1)  # nothing is lost
    assert int(mult.sum()) == world * -(-total // world)  # the padding is all the repetition
    if total >= world:
        assert np.all(mult <= 2)


@settings(max_examples=examples(150), deadline=None)
@given(shard_counts, worlds, worker_counts, st.booleans(), st.integers(0, 2**32 - 1))
def test_drop_gives_every_rank_floor_and_leaves_out_the_fewest(counts, world, workers, shuffle, seed):
    total = sum(counts)
    if 0 < total < world:
        with pytest.raises(PlanError, match="leaves every rank empty"):
            plan(counts, Topology(0, world, 0, workers), balance="drop")
        return
    plans = all_plans(counts, world, workers, balance="drop", shuffle=shuffle, seed=seed)
    per_reader = sizes(plans, world, workers)
    assert np.all(per_reader.sum(axis=1) == total // world)
    assert np.all(per_reader == per_reader[0])
    mult = multiplicity(counts, plans)
    assert np.all(mult <= 1)
    assert int((mult == 0).sum()) == total % world


@settings(max_examples=examples(60), deadline=None)
@given(shard_counts, worlds, worker_counts, st.sampled_from(["none", "pad"]), st.integers(0, 1000))
def test_plan_is_deterministic_and_matches_reader_counts(counts, world, workers, balance, seed):
    first = all_plans(counts, world, workers, balance=balance, shuffle=True, seed=seed, epoch=3)
    again = all_plans(list(counts), world, workers, balance=balance, shuffle=True, seed=seed, epoch=3)
    assert first == again
    expected = reader_counts(sum(counts), world, workers, balance)
    assert np.array_equal(sizes(first, world, workers), expected)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(1, 50), min_size=10, max_size=200), worlds, worker_counts)
def test_epoch_changes_the_shuffle_identically_on_every_rank(counts, world, workers):
    def global_order(epoch):
        plans = all_plans(counts, world, workers, balance="none", shuffle=True, seed=7, epoch=epoch)
        return [tuple(r) for key in sorted(plans) for r in plans[key]]

    # >= 10 non-empty shards: the chance that two epochs draw the same order is < 1/10!
    assert global_order(0) != global_order(1)
    assert global_order(1) == global_order(1)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 100)), max_size=100), worlds, worker_counts, st.booleans())
def test_unknown_counts_deal_whole_shards_exactly_once(counts, world, workers, shuffle):
    assume(None in counts)
    plans = all_plans(counts, world, workers, balance="none", shuffle=shuffle, seed=1)
    dealt = sorted(r.shard for ranges in plans.values() for r in ranges)
    assert dealt == [i for i, count in enumerate(counts) if count != 0]  # known-empty shards are skipped
    for ranges in plans.values():
        for r in ranges:
            assert r.start == 0 and r.stop == counts[r.shard]
    shards_per_reader = [len(v) for v in plans.values()]
    assert max(shards_per_reader) - min(shards_per_reader) <= 1


def old_whole_shard_plan(counts, topology, seed, epoch, shuffle):
    """The unknown-count plan as it was built before WholeShards: a Range per shard, from Python ints."""
    values = np.array([-1 if c is None else c for c in counts], dtype=np.int64)
    candidates = np.flatnonzero(values != 0)
    order = np.random.default_rng([seed, epoch]).permutation(candidates) if shuffle else candidates
    mine = order[topology.rank :: topology.world_size][topology.worker_id :: topology.num_workers]
    return [Range(int(i), 0, None if values[i] < 0 else int(values[i])) for i in mine.tolist()]


@settings(max_examples=examples(100), deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.integers(0, 2**40)), max_size=300),
    worlds,
    worker_counts,
    st.booleans(),
    st.integers(0, 2**32 - 1),
    st.integers(0, 5),
    st.data(),
)
def test_the_array_plan_of_unknown_counts_equals_the_range_per_shard_plan_it_replaces(
    counts, world, workers, shuffle, seed, epoch, data
):
    assume(None in counts)
    rank, worker = data.draw(st.integers(0, world - 1)), data.draw(st.integers(0, workers - 1))
    topology = Topology(rank, world, worker, workers)
    old = old_whole_shard_plan(counts, topology, seed, epoch, shuffle)
    kwargs = {"seed": seed, "epoch": epoch, "shuffle": shuffle}
    assert plan(counts, topology, balance="none", **kwargs) == old
    for given_counts in (counts, pa.array(counts, pa.int64())):
        whole = plan_whole_shards(given_counts, topology, **kwargs)
        assert list(whole) == [(None, r) for r in old] and len(whole) == len(old)
        assert [whole.ranges[i] for i in range(len(old))] == old and list(whole.positions) == [None] * len(old)
        a, b = sorted(data.draw(st.lists(st.integers(0, len(old)), min_size=2, max_size=2)))
        assert whole.ranges[a:b] == old[a:b] and list(whole[a:b]) == [(None, r) for r in old[a:b]]


def test_a_million_shards_of_unknown_count_plan_as_two_arrays_not_an_object_per_shard():
    # How fast that is, is benchmarks/plan.py's to say (a timed test flakes on a loaded machine);
    # what makes it fast is that the plan is two int64 arrays, which this checks.
    counts = pa.nulls(1_000_000, pa.int64())
    whole = plan_whole_shards(counts, Topology(0, 1), shuffle=True)
    assert isinstance(whole.shard, np.ndarray) and whole.shard.dtype == np.int64
    assert isinstance(whole.counts, np.ndarray) and whole.counts.dtype == np.int64
    assert sorted(whole.shard.tolist()) == list(range(1_000_000))
    assert len(whole) == 1_000_000 and whole.ranges[-1].stop is None


def test_without_shuffle_whole_shards_are_read_in_order():
    counts = [100] * 8
    ranges = plan(counts, Topology(1, 2, 0, 2), balance="none")
    assert ranges == [Range(4, 0, 100), Range(5, 0, 100)]


def test_few_shards_are_split_into_contiguous_ranges():
    counts = [10, 10]
    plans = all_plans(counts, 2, 2, balance="none")
    assert plans[(0, 0)] == [Range(0, 0, 5)]
    assert plans[(0, 1)] == [Range(0, 5, 10)]
    assert plans[(1, 0)] == [Range(1, 0, 5)]
    assert plans[(1, 1)] == [Range(1, 5, 10)]


def test_pad_wraps_round_to_the_start_of_the_stream():
    # 5 records over 2 ranks: 3 each, the sixth is record 0 again.
    plans = all_plans([5], 2, 1, balance="pad")
    assert plans[(0, 0)] == [Range(0, 0, 3)]
    assert plans[(1, 0)] == [Range(0, 3, 5), Range(0, 0, 1)]


def test_accepts_numpy_and_pyarrow_counts():
    topo = Topology(0, 2, 1, 2)
    expected = plan([3, 4, 5], topo)
    assert plan(np.array([3, 4, 5], dtype=np.int32), topo) == expected
    assert plan(pa.array([3, 4, 5], pa.int64()), topo) == expected
    assert plan(pa.chunked_array([[3], [4, 5]]), topo) == expected
    unknown = plan(pa.array([3, None, 5]), Topology(0, 1, 0, 1), balance="none")
    assert unknown == [Range(0, 0, 3), Range(1, 0, None), Range(2, 0, 5)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_records": [3, -1]}, r"num_records\[1\] is -1: record counts cannot be negative"),
        ({"num_records": [3, None], "balance": "pad"}, r"balance='pad' needs the record count .* 1 of 2 shards"),
        ({"num_records": [3, None], "balance": "drop"}, r"shardkit index"),
        ({"num_records": [3], "balance": "even"}, r"balance must be one of"),
        ({"num_records": [3], "seed": -1}, r"seed must be an int >= 0, got -1 \(int\)"),
        ({"num_records": [3], "epoch": 1.5}, r"epoch must be an int >= 0, got 1.5 \(float\)"),
        ({"num_records": [[3]]}, r"one-dimensional"),
        ({"num_records": [1.5]}, r"whole numbers"),
        ({"num_records": [2], "balance": "drop", "world": 4}, r"balance='drop' with 2 records over world_size=4"),
        ({"num_records": [3], "topology": (0, 1, 0, 1)}, r"topology must be a shardkit.Topology"),
    ],
)
def test_errors_say_what_is_wrong(kwargs, message):
    world = kwargs.pop("world", 1)
    topology = kwargs.pop("topology", Topology(0, world, 0, 1))
    with pytest.raises(PlanError, match=message):
        plan(kwargs.pop("num_records"), topology, **kwargs)


def test_topology_rejects_impossible_values():
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size\) = \[0, 2\), got 2"):
        Topology(rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"num_workers must be an int >= 1, got 0 \(int\)"):
        Topology(num_workers=0)


# -- positions of a rank's chunk (resume) ---------------------------------------

intervals_strategy = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 60)), max_size=12).map(
    lambda pairs: [(start, start + length) for start, length in pairs]
)


@settings(max_examples=examples(100), deadline=None)
@given(intervals_strategy, worker_counts)
def test_share_splits_the_union_evenly_and_exactly(intervals, workers):
    from shardkit.planning import share, union

    merged = union(intervals)
    positions = [p for start, stop in merged for p in range(start, stop)]
    assert sorted(set(p for start, stop in intervals for p in range(start, stop))) == positions
    parts = [[p for a, b in share(intervals, workers, w) for p in range(a, b)] for w in range(workers)]
    assert [p for part in parts for p in part] == positions
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@settings(max_examples=examples(100), deadline=None)
@given(shard_counts, worlds, worker_counts, st.sampled_from(["none", "pad", "drop"]), st.booleans(), st.integers(0, 99))
def test_plan_intervals_of_a_worker_share_is_the_plan(counts, world, workers, balance, shuffle, seed):
    from shardkit.planning import plan_intervals, rank_span, share

    total = sum(counts)
    assume(balance != "drop" or total == 0 or total >= world)
    for rank in range(world):
        size = rank_span(total, world, rank, balance)[1]
        for worker in range(workers):
            topology = Topology(rank, world, worker, workers)
            kwargs = dict(seed=seed, epoch=2, shuffle=shuffle, balance=balance)
            pieces = plan_intervals(counts, topology, share([(0, size)], workers, worker), **kwargs)
            # The plan joins ranges that continue each other; so join the pieces too.
            joined: list[Range] = []
            for _, piece in pieces:
                if joined and joined[-1].shard == piece.shard and joined[-1].stop == piece.start:
                    joined[-1] = Range(piece.shard, joined[-1].start, piece.stop)
                else:
                    joined.append(piece)
            assert joined == plan(counts, topology, **kwargs)
            position = share([(0, size)], workers, worker)[0][0] if pieces else 0
            for start, piece in pieces:  # positions count the records of the pieces
                assert start >= position
                position = start + piece.stop - piece.start


def test_plan_intervals_rejects_unknown_counts_and_foreign_positions():
    from shardkit.planning import plan_intervals

    with pytest.raises(PlanError, match="record count of every shard"):
        plan_intervals([3, None], Topology(), [(0, 1)], balance="none")
    with pytest.raises(PlanError, match="outside this rank's chunk of 5 records"):
        plan_intervals([5], Topology(), [(2, 9)])


def per_range_plan_intervals(counts, topology, intervals, **kwargs):
    """The former form of plan_intervals: a (position, Range) tuple per piece, built in Python."""
    from shardkit.planning import rank_span, through
    from shardkit.planning.stream import Stream as _Stream

    total = sum(counts)
    rank_start, rank_size = rank_span(total, topology.world_size, topology.rank, kwargs["balance"])
    stream = _Stream.build(
        np.asarray(counts, dtype=np.int64),
        seed=kwargs["seed"],
        epoch=kwargs["epoch"],
        shuffle=kwargs["shuffle"],
        world_size=topology.world_size,
        block_size=kwargs.get("block_size"),
    )
    out = []
    for start, stop in intervals:
        position = start
        for a, b in through([(rank_start, rank_start + rank_size)], start, stop):
            for piece in stream.ranges(a, b):
                out.append((position, piece))
                position += piece.stop - piece.start
    return out


@settings(max_examples=examples(100), deadline=None)
@given(
    shard_counts,
    worlds,
    worker_counts,
    st.sampled_from(["none", "pad", "drop"]),
    st.booleans(),
    st.sampled_from([None, 1, 7, 512]),
    st.integers(0, 99),
)
def test_plan_intervals_as_arrays_equals_the_per_range_form(counts, world, workers, balance, shuffle, block, seed):
    from shardkit.planning import PlannedRanges, plan_intervals, rank_span, share

    total = sum(counts)
    assume(balance != "drop" or total == 0 or total >= world)
    kwargs = dict(seed=seed, epoch=1, shuffle=shuffle, balance=balance, block_size=block)
    for rank in range(world):
        size = rank_span(total, world, rank, balance)[1]
        for worker in range(workers):
            topology = Topology(rank, world, worker, workers)
            intervals = share([(0, size)], workers, worker)
            if size > 3:  # several intervals, as a resumed reader has
                intervals = [(0, size // 3), (size // 2, size)]
            planned = plan_intervals(counts, topology, intervals, **kwargs)
            expected = per_range_plan_intervals(counts, topology, intervals, **kwargs)
            assert isinstance(planned, PlannedRanges)
            assert list(planned) == expected
            assert len(planned) == len(expected)
            assert [planned.positions[i] for i in range(len(planned))] == [p for p, _ in expected]
            assert [planned.ranges[i] for i in range(len(planned))] == [r for _, r in expected]
            assert planned.ranges[1:4] == [r for _, r in expected[1:4]]
            assert all(type(v) is int for v in (*planned[0][1], planned[0][0])) if expected else True


def test_a_million_shards_are_planned_without_an_object_per_shard():
    from shardkit.planning import plan_intervals

    counts = np.full(1_000_000, 100, dtype=np.int64)
    planned = plan_intervals(counts, Topology(1, 2), [(0, 50_000_000)])
    assert len(planned) == 500_000
    assert planned.ranges[0] == Range(500_000, 0, 100) and planned.positions[-1] == 49_999_900


@settings(max_examples=examples(100), deadline=None)
@given(shard_counts, worlds, st.booleans(), st.integers(0, 99), st.data())
def test_what_a_planned_reader_has_left_is_the_union_of_its_unread_ranges(counts, world, shuffle, seed, data):
    from shardkit.planning import plan_intervals, rank_span, union

    size = rank_span(sum(counts), world, 0, "pad")[1]
    cut = data.draw(st.integers(0, size))
    intervals = [(cut, size), (0, cut)]  # out of order, as a resumed reader's may be
    planned = plan_intervals(counts, Topology(0, world), intervals, shuffle=shuffle, seed=seed, block_size=5)
    pieces = list(planned)  # once, not once per index
    for index in range(len(planned) + 1):
        if index < len(planned):
            length = planned.ranges[index].stop - planned.ranges[index].start
            done = data.draw(st.integers(0, length))
        else:
            done = 0
        left = [
            (position + (done if i == index else 0), position + piece.stop - piece.start)
            for i, (position, piece) in enumerate(pieces[index:], start=index)
        ]
        assert planned.remaining(index, done) == union(left)


@given(
    st.sets(st.integers(0, 400), max_size=120),
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 60)), max_size=8),
)
def test_positions_union_covers_exactly_the_positions_and_intervals_given(points, spans):
    from shardkit.planning import positions_union, union

    intervals = [(a, a + n) for a, n in spans]
    got = positions_union(np.array(sorted(points), dtype=np.int64)[::-1], intervals)
    assert got == [list(i) for i in union([(p, p + 1) for p in points] + intervals)]
