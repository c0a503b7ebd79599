"""Chainable wrappers: map, filter, shuffle, batch, repeat and interleave."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.epoch import SharedEpoch
from shardkit.errors import ShardkitError
from shardkit.pipeline import Pipeline, UnknownLengthError, interleave
from shardkit.seeding import seed_iteration
from shardkit.topology import Topology
from tests.helpers.examples import examples


class RangeSource(Pipeline):
    """``range(n)`` dealt round-robin to the readers of the current topology.

    Explicit rank / worker values stand in for DDP and DataLoader in tests.
    """

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        worker_id: int | None = None,
        num_workers: int | None = None,
    ) -> None:
        self.n = n
        self._seed = seed
        self._epoch = SharedEpoch()
        self._slot = {"rank": rank, "world_size": world_size, "worker_id": worker_id, "num_workers": num_workers}

    def set_epoch(self, epoch: int) -> None:
        self._epoch.set(epoch)

    @property
    def epoch(self) -> int:
        return self._epoch.effective()

    @property
    def seed(self) -> int:
        return self._seed

    def topology(self) -> Topology:
        return Topology.current(**self._slot)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        topo = self.topology()
        seed_iteration(self.seed, self.epoch, topo)
        return iter(range(topo.reader_index, self.n, topo.num_readers))


class EpochTagged(RangeSource):
    """Yields ``(epoch, i)``: the epoch the source read when its pass began."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return ((epoch, i) for i in super().__iter__())


class NoLength(RangeSource):
    def __len__(self) -> int:
        return Pipeline.__len__(self)


def double(x: int) -> int:
    return 2 * x


def is_even(x: int) -> bool:
    return x % 2 == 0


# -- chaining ---------------------------------------------------------------


def test_chain_returns_new_objects_and_leaves_the_original_alone():
    source = RangeSource(10)
    mapped = source.map(double)
    batched = mapped.batch(4)
    assert mapped is not source and batched is not mapped
    assert batched.upstream == (mapped,) and mapped.upstream == (source,) and source.upstream == ()
    assert list(source) == list(range(10))
    assert list(mapped) == [2 * i for i in range(10)]


def test_map_filter_batch():
    pipeline = RangeSource(10).filter(is_even).map(double).batch(2)
    batches = list(pipeline)
    assert [b.tolist() for b in batches] == [[0, 4], [8, 12], [16]]
    assert all(isinstance(b, torch.Tensor) for b in batches)


def test_batch_collate_fn_and_drop_last():
    assert list(RangeSource(7).batch(3, collate_fn=tuple)) == [(0, 1, 2), (3, 4, 5), (6,)]
    assert list(RangeSource(7).batch(3, collate_fn=tuple, drop_last=True)) == [(0, 1, 2), (3, 4, 5)]
    assert list(RangeSource(6).batch(3, collate_fn=tuple, drop_last=True)) == [(0, 1, 2), (3, 4, 5)]


def test_iterators_keep_raising_stop_iteration_when_exhausted():
    for pipeline in (
        RangeSource(3).map(double),
        RangeSource(3).filter(is_even),
        RangeSource(3).shuffle(2),
        RangeSource(3).batch(2),
        RangeSource(3).repeat(2),
        interleave([RangeSource(3), RangeSource(3)], stop="all_exhausted"),
    ):
        iterator = iter(pipeline)
        list(iterator)
        with pytest.raises(StopIteration):
            next(iterator)


def test_epoch_seed_and_topology_come_from_the_source():
    source = RangeSource(10, seed=7, rank=1, world_size=2)
    pipeline = source.map(double).shuffle(3).batch(2)
    assert pipeline.seed == 7
    assert pipeline.topology() == Topology(rank=1, world_size=2)
    pipeline.set_epoch(4)
    assert source.epoch == 4 and pipeline.epoch == 4


def test_a_source_that_overrides_nothing_says_what_to_override():
    class Bare(Pipeline):
        def __iter__(self) -> Iterator[int]:
            return iter(())

    with pytest.raises(NotImplementedError, match="source and must override epoch"):
        _ = Bare().map(double).epoch
    with pytest.raises(NotImplementedError, match="must override set_epoch"):
        Bare().set_epoch(1)


# -- len ----------------------------------------------------------------------


def test_len_where_it_is_known():
    source = RangeSource(10)
    assert len(source.map(double)) == 10
    assert len(source.shuffle(4)) == 10
    assert len(source.batch(3)) == 4
    assert len(source.batch(3, drop_last=True)) == 3
    assert len(source.repeat(3)) == 30
    assert len(source.repeat(2).batch(4)) == 5


@pytest.mark.parametrize(
    ("pipeline", "reason"),
    [
        (RangeSource(10).filter(is_even), "filter\\(\\) drops a number of samples"),
        (RangeSource(10).repeat(), "repeat\\(\\) without a count never ends; pass repeat\\(count\\)"),
        (RangeSource(10).repeat().batch(2), "repeat\\(\\) without a count never ends"),
        (NoLength(10).map(double), "NoLength is an unbounded or unknown-length stream"),
        (
            interleave([RangeSource(3), RangeSource(4)]),
            "stop='first_exhausted'.*stop='all_exhausted' has a length",
        ),
    ],
)
def test_len_of_an_unknown_length_stream_explains_itself(pipeline, reason):
    with pytest.raises(UnknownLengthError, match=reason) as caught:
        len(pipeline)
    assert isinstance(caught.value, TypeError)
    assert "len() is undefined for" in str(caught.value)


def test_list_of_an_unknown_length_stream_still_works():
    assert list(RangeSource(6).filter(is_even)) == [0, 2, 4]


# -- argument validation ------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda s: s.map(3), "map\\(fn\\) must be callable, got 3"),
        (lambda s: s.filter(None), "filter\\(predicate\\) must be callable, got None"),
        (lambda s: s.shuffle(0), "shuffle\\(buffer_size\\) must be an int >= 1, got 0 \\(int\\)"),
        (lambda s: s.shuffle(10.0), "shuffle\\(buffer_size\\) must be an int >= 1, got 10.0 \\(float\\)"),
        (
            lambda s: s.shuffle(10, seed=-1),
            "shuffle\\(seed\\) must be an int >= 0, got -1 \\(int\\); use abs\\(\\) or a hash",
        ),
        (lambda s: s.batch(0), "batch\\(batch_size\\) must be an int >= 1, got 0 \\(int\\)"),
        (lambda s: s.batch(True), "batch\\(batch_size\\) must be an int >= 1, got True \\(bool\\)"),
        (lambda s: s.batch(2, collate_fn="stack"), "batch\\(collate_fn\\) must be callable"),
        (lambda s: s.batch(2, drop_last="yes"), "batch\\(drop_last\\) must be a bool"),
        (lambda s: s.repeat(0), "repeat\\(count\\) must be an int >= 1, got 0 \\(int\\)"),
    ],
)
def test_bad_arguments_fail_at_construction(build, message):
    with pytest.raises(ShardkitError, match=message) as caught:
        build(RangeSource(4))
    assert isinstance(caught.value, ValueError)


def test_set_epoch_rejects_a_negative_or_non_int_epoch():
    pipeline = RangeSource(4).map(double)
    with pytest.raises(ValueError, match="epoch must be an int >= 0 and <= 9223372036854775807, got -1"):
        pipeline.set_epoch(-1)
    with pytest.raises(ValueError, match="epoch must be an int >= 0 and <= 9223372036854775807, got 1.5"):
        pipeline.set_epoch(1.5)


# -- shuffle ------------------------------------------------------------------


def test_shuffle_is_a_permutation_and_repeats_for_the_same_epoch():
    first = list(RangeSource(200, seed=3).shuffle(50))
    again = list(RangeSource(200, seed=3).shuffle(50))
    assert sorted(first) == list(range(200))
    assert first != list(range(200))
    assert first == again


def test_shuffle_changes_with_epoch_seed_and_reader():
    def order(epoch=0, seed=0, shuffle_seed=None, **slot):
        source = RangeSource(400, seed=seed, **slot)
        source.set_epoch(epoch)
        return list(source.shuffle(64, seed=shuffle_seed))

    base = order()
    assert order(epoch=1) != base
    assert order(seed=1) != base
    assert order(shuffle_seed=5) != base
    assert order(shuffle_seed=5) == order(seed=9, shuffle_seed=5)
    # Readers hold different samples; shifted onto the same values, the
    # orders still differ, so the shuffle is seeded per rank and per worker.
    rank0 = order(rank=0, world_size=2)
    rank1 = [i - 1 for i in order(rank=1, world_size=2)]
    assert sorted(rank0) == sorted(rank1) == list(range(0, 400, 2)) and rank0 != rank1
    worker0 = order(worker_id=0, num_workers=2)
    worker1 = [i - 1 for i in order(worker_id=1, num_workers=2)]
    assert sorted(worker0) == sorted(worker1) and worker0 != worker1


@settings(max_examples=examples(60), deadline=None)
@given(
    n=st.integers(0, 300),
    buffer_size=st.integers(1, 400),
    seed=st.integers(0, 2**70),
    epoch=st.integers(0, 1000),
    readers=st.integers(1, 4),
)
def test_shuffle_properties(n, buffer_size, seed, epoch, readers):
    def order(worker_id):
        source = RangeSource(n, seed=seed, worker_id=worker_id, num_workers=readers)
        source.set_epoch(epoch)
        return list(source.shuffle(buffer_size))

    orders = [order(w) for w in range(readers)]
    assert sorted(i for o in orders for i in o) == list(range(n))
    assert orders == [order(w) for w in range(readers)]


@settings(max_examples=examples(60), deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    weights=st.lists(st.floats(0.0, 10.0), min_size=4, max_size=4),
    batch_size=st.integers(1, 9),
)
def test_interleave_all_exhausted_then_batch_keeps_every_sample_once(sizes, weights, batch_size):
    weights = weights[: len(sizes)]
    if sum(weights) == 0:
        weights[0] = 1.0
    mixed = interleave([labelled(n, k) for k, n in enumerate(sizes)], weights, stop="all_exhausted")
    samples = [s for b in mixed.batch(batch_size, collate_fn=list) for s in b]
    expected = [(k, i) for k, n in enumerate(sizes) if weights[k] > 0 for i in range(n)]
    assert sorted(samples) == expected and len(mixed) == len(expected)


def test_shuffle_buffer_of_one_keeps_order():
    assert list(RangeSource(20).shuffle(1)) == list(range(20))


def test_shuffle_buffer_larger_than_the_data():
    out = list(RangeSource(10).shuffle(1000))
    assert sorted(out) == list(range(10)) and out != list(range(10))


def test_shuffle_moves_samples_about_as_far_as_the_buffer():
    out = list(RangeSource(5000).shuffle(100))
    displacement = [abs(pos - value) for pos, value in enumerate(out)]
    assert 20 < sum(displacement) / len(displacement) < 400


# -- repeat -------------------------------------------------------------------


def test_repeat_passes_read_successive_epochs_without_touching_the_shared_one():
    source = EpochTagged(4)
    source.set_epoch(5)
    out = list(source.repeat(3))
    assert out == [(e, i) for e in (5, 6, 7) for i in range(4)]
    assert source.epoch == 5


def test_repeat_reshuffles_each_pass_exactly_like_the_next_epoch():
    source = RangeSource(100)
    passes = list(source.shuffle(30).repeat(3))
    chunks = [passes[k * 100 : (k + 1) * 100] for k in range(3)]
    for k, chunk in enumerate(chunks):
        fresh = RangeSource(100)
        fresh.set_epoch(k)
        assert chunk == list(fresh.shuffle(30))
    assert chunks[0] != chunks[1] != chunks[2]


def test_shuffle_after_repeat_mixes_across_pass_boundaries():
    out = list(RangeSource(10).repeat(2).shuffle(8))
    assert sorted(out) == sorted(list(range(10)) * 2)
    assert out[:10] != list(range(10))


def test_infinite_repeat_keeps_going_and_stops_on_an_empty_pass():
    iterator = iter(RangeSource(3).repeat())
    assert [next(iterator) for _ in range(10)] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert list(RangeSource(0).repeat()) == []
    assert list(RangeSource(0).filter(is_even).repeat()) == []


def test_nested_repeats_give_every_pass_its_own_epoch():
    out = list(EpochTagged(1).repeat(2).repeat(3))
    assert [epoch for epoch, _ in out] == [0, 1, 2, 3, 4, 5]


def test_epoch_offset_does_not_leak_out_of_repeat():
    source = EpochTagged(2)
    iterator = iter(source.repeat(2))
    next(iterator), next(iterator), next(iterator)  # now in pass 1
    assert source.epoch == 0
    assert list(source) == [(0, 0), (0, 1)]


# -- interleave ---------------------------------------------------------------


def tag(label: int):
    return lambda i: (label, i)


def labelled(n: int, label: int, **kwargs) -> Pipeline:
    return RangeSource(n, **kwargs).map(tag(label))


def test_interleave_follows_the_weights():
    for seed in range(3):
        mixed = interleave([labelled(40_000, 0), labelled(40_000, 1)], [1, 3], seed=seed)
        counts = Counter(label for label, _ in mixed)
        share = counts[1] / (counts[0] + counts[1])
        assert abs(share - 0.75) < 0.015  # > 5 standard deviations
    three = interleave([labelled(50_000, k) for k in range(3)], [0.2, 0.3, 0.5], seed=1)
    counts = Counter(label for _, (label, _) in zip(range(20_000), three))
    for label, weight in enumerate((0.2, 0.3, 0.5)):
        assert abs(counts[label] / 20_000 - weight) < 0.02


def test_interleave_is_deterministic_and_changes_with_epoch_and_seed():
    def draw(seed=0, epoch=0):
        mixed = interleave([labelled(300, 0), labelled(300, 1)], seed=seed)
        mixed.set_epoch(epoch)
        return [label for label, _ in mixed]

    assert draw() == draw()
    assert draw(epoch=1) != draw()
    assert draw(seed=1) != draw()


def test_interleave_keeps_each_source_in_order():
    out = list(interleave([labelled(50, 0), labelled(50, 1)], stop="all_exhausted"))
    for label in (0, 1):
        assert [i for lab, i in out if lab == label] == list(range(50))


def test_interleave_stop_rules():
    first = list(interleave([labelled(5, 0), labelled(1000, 1)], stop="first_exhausted"))
    assert [i for lab, i in first if lab == 0] == list(range(5))
    assert len(first) < 200
    everything = interleave([labelled(5, 0), labelled(30, 1)], [1, 1], stop="all_exhausted")
    assert Counter(lab for lab, _ in everything) == {0: 5, 1: 30}
    assert len(everything) == 35


def test_interleave_never_reads_a_zero_weight_source():
    class Exploding(RangeSource):
        def __iter__(self) -> Iterator[int]:
            raise AssertionError("a weight-0 source was read")

    mixed = interleave([labelled(10, 0), Exploding(10)], [1, 0], stop="all_exhausted")
    assert [i for _, i in mixed] == list(range(10))
    assert len(mixed) == 10


def test_interleave_set_epoch_reaches_every_source_and_seed_is_the_mixing_seed():
    sources = [RangeSource(3, seed=11), RangeSource(3, seed=12)]
    mixed = interleave(sources, seed=4)
    mixed.map(double).set_epoch(3)
    assert [s.epoch for s in sources] == [3, 3]
    assert mixed.epoch == 3 and mixed.seed == 4


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([RangeSource(2), RangeSource(2)], [1.0]), {}, "got 2 datasets but 1 weights; pass one weight per dataset"),
        (([RangeSource(2)], [1, 2]), {}, "got 1 datasets but 2 weights"),
        (([RangeSource(2), RangeSource(2)], [1, -1]), {}, "weights\\[1\\]\\) must be finite and >= 0, got -1"),
        (([RangeSource(2), RangeSource(2)], [float("nan"), 1]), {}, "weights\\[0\\]\\) must be finite"),
        (([RangeSource(2), RangeSource(2)], [float("inf"), 1]), {}, "weights\\[0\\]\\) must be finite"),
        (([RangeSource(2), RangeSource(2)], [0, 0]), {}, "weights\\) are all zero"),
        (([RangeSource(2)], ["heavy"]), {}, "weights\\) must be a sequence of numbers"),
        (([],), {}, "needs at least one dataset"),
        ((RangeSource(2),), {}, "takes a list of pipelines, got RangeSource; write interleave\\(\\[a, b\\]"),
        (([RangeSource(2), range(3)],), {}, "datasets\\[1\\]\\) is a range, not a shardkit Pipeline; .*shardkit.wrap"),
        (([RangeSource(2)],), {"stop": "longest"}, "stop\\) must be one of"),
        (([RangeSource(2)],), {"seed": -3}, "interleave\\(seed\\) must be an int >= 0, got -3"),
    ],
)
def test_interleave_rejects_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        interleave(*args, **kwargs)
