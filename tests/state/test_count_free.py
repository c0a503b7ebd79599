"""Saving and resuming sources whose record counts are unknown: positions are whole shards and
the records read of the shards begun (``shardkit.sources.whole``), no count needed.

Exactly once and in the same order under the worker count it was saved with; exactly once under
another worker count or world size; a shard changed since the save refused by name; a state that
needs counts either counts them now or says what to do.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit import ShardedDataset
from shardkit.state import StateError, merge, merge_ranks
from tests.helpers.count_free import dataset, resume_rank, write_glob
from tests.helpers.examples import examples
from tests.helpers.processes import gloo_ranks
from tests.helpers.reading import run_as_worker
from tests.helpers.shards import synthetic_read, synthetic_shards

pytestmark = pytest.mark.filterwarnings("ignore:.*whole shards are dealt out:UserWarning")


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def synthetic(counts: list[int], rank: int = 0, world_size: int = 1, **kwargs: Any) -> ShardedDataset:
    shards = synthetic_shards(counts, known=False)
    return ShardedDataset(shards, synthetic_read, rank=rank, world_size=world_size, balance="none", **kwargs)


def read(make: Any, worker: int, workers: int, take: int | None, state: dict[str, Any] | None = None) -> Any:
    """``take`` samples (None: all) of worker ``worker`` of ``workers``, and the state after them."""

    def run() -> tuple[list[str], dict[str, Any] | None]:
        source = make()
        if state is not None:
            source.load_state_dict(state)
        iterator = iter(source)
        got = list(itertools.islice(iterator, take))
        return got, roundtrip(source.state_dict()) if take is not None else None

    return run_as_worker(worker, workers, run)


def test_a_glob_of_shard_writer_output_saves_and_resumes_exactly_without_counts(tmp_path: Path) -> None:
    pattern = write_glob(tmp_path, 300, 37)
    full = [row["id"] for row in dataset(pattern)]
    assert sorted(full) == list(range(300))
    assert dataset(pattern).shards.num_records is None
    for cut in (0, 1, 36, 37, 150, 299, 300):
        source = dataset(pattern)
        iterator = iter(source)
        delivered = [next(iterator)["id"] for _ in range(cut)]
        state = roundtrip(source.state_dict())
        assert len(json.dumps(state)) < 1024
        resumed = dataset(pattern)
        resumed.load_state_dict(state)
        assert delivered + [row["id"] for row in resumed] == full, cut


@pytest.mark.slow
@settings(max_examples=examples(90), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    counts=st.lists(st.integers(0, 12), min_size=1, max_size=9),
    world_size=st.integers(1, 3),
    workers=st.integers(1, 3),
    shuffle=st.booleans(),
    cuts=st.lists(st.floats(0, 1), min_size=9, max_size=9),
    other=st.integers(1, 3),
)
def test_a_reader_cut_anywhere_in_a_shard_resumes_exactly(counts, world_size, workers, shuffle, cuts, other) -> None:
    everything = []
    for rank in range(world_size):

        def make(rank: int = rank) -> ShardedDataset:
            return synthetic(counts, rank, world_size, shuffle=shuffle, seed=7)

        states, delivered = [], []
        for worker in range(workers):
            full, _ = read(make, worker, workers, None)
            cut = int(cuts[(rank * workers + worker) % 9] * len(full))
            got, state = read(make, worker, workers, cut)
            rest, _ = read(make, worker, workers, None, state)
            assert got + rest == full  # its own state: the same order
            states.append(state)
            delivered += got
            everything += full
        whole_rank = merge(states)
        rest = [s for worker in range(other) for s in read(make, worker, other, None, whole_rank)[0]]
        assert sorted(delivered + rest) == sorted(s for w in range(workers) for s in read(make, w, workers, None)[0])
    ids = [f"mem/shard{i:03d}-{n}:{r}" for i, n in enumerate(counts) for r in range(n)]
    assert sorted(everything) == sorted(ids)


def test_rank_states_merge_and_resume_on_another_world_size_twice() -> None:
    counts = [5, 9, 0, 7, 12, 3, 8, 6, 11, 4]
    ids = sorted(f"mem/shard{i:03d}-{n}:{r}" for i, n in enumerate(counts) for r in range(n))
    delivered: list[str] = []

    def save(world_size: int, workers: int, take: int, state: dict[str, Any] | None) -> dict[str, Any]:
        ranks = []
        for rank in range(world_size):
            parts = []
            for worker in range(workers):
                got, saved = read(
                    lambda r=rank: synthetic(counts, r, world_size, shuffle=True), worker, workers, take, state
                )
                delivered.extend(got)
                parts.append(saved)
            ranks.append(merge(parts))
        return merge_ranks(ranks)

    first = save(2, 2, 4, None)  # 2 ranks x 2 workers read 4 each
    assert first["rank"] is None and first["started"]
    second = save(3, 1, 6, first)  # resumed on 3 ranks, read 6 more each, saved again
    for rank in range(4):  # the rest on 4 ranks of 2 workers
        for worker in range(2):
            make = lambda r=rank: synthetic(counts, r, 4, shuffle=True)  # noqa: E731
            delivered += read(make, worker, 2, None, second)[0]
    assert sorted(delivered) == ids


def test_worker_states_resume_with_another_worker_count(tmp_path: Path) -> None:
    pattern = write_glob(tmp_path, 200, 23)
    states, delivered = [], []
    for worker in range(3):
        got, state = read(lambda: dataset(pattern), worker, 3, 10 + worker)
        delivered += [row["id"] for row in got]
        states.append(state)
    with pytest.raises(StateError, match="worker 0's of 3"):
        read(lambda: dataset(pattern), 0, 2, None, states[0])
    rest = [
        row["id"] for worker in range(2) for row in read(lambda: dataset(pattern), worker, 2, None, merge(states))[0]
    ]
    assert sorted(delivered + rest) == list(range(200))


def _saved_inside_a_shard(pattern: str | list[str]) -> tuple[dict[str, Any], str]:
    """A state saved after 50 records (inside a shard of 37) and that shard's path."""
    source = dataset(pattern)
    iterator = iter(source)
    for _ in range(50):
        next(iterator)
    state = roundtrip(source.state_dict())
    assert state["started"] and state["started"][0][1] > 0
    source_shards = [str(url) for url in source.shards]
    begun = [url for url in source_shards if url in {str(u) for u in _begun_urls(source, state)}]
    return state, begun[0]


def _begun_urls(source: shardkit.JsonlDataset, state: dict[str, Any]) -> list[str]:
    """The urls of the shards a state began, from the plan (the state names them by item)."""
    from shardkit.planning import plan_whole_shards
    from shardkit.topology import Topology

    order = plan_whole_shards(source.shards.table.column("num_records"), Topology(rank=0, world_size=1), seed=3,
                              shuffle=True)  # fmt: skip
    return [str(source.shards[int(order.shard[item])]) for item, _, _ in state["started"]]


@pytest.mark.parametrize("change", ["truncated", "replaced", "removed"])
def test_a_begun_shard_changed_between_save_and_restore_is_refused_by_name(tmp_path: Path, change: str) -> None:
    urls = sorted(glob.glob(write_glob(tmp_path, 300, 37)))  # a list: a file removed keeps its place
    state, path = _saved_inside_a_shard(urls)
    lines = Path(path).read_bytes().splitlines(keepends=True)
    if change == "truncated":  # fewer records than the state read: resuming would read none of it
        with open(path, "r+b") as f:
            f.truncate(sum(len(line) for line in lines[:5]))
    elif change == "replaced":  # the same size, other records, by rename as writers do
        other = Path(path + ".new")
        other.write_bytes(b"".join(line.replace(b'"id"', b'"ID"') for line in lines))
        os.replace(other, path)
    else:
        os.remove(path)
    resumed = dataset(urls)
    resumed.load_state_dict(state)
    with pytest.raises(StateError, match=rf"{Path(path).name} changed since the state was saved"):
        list(resumed)


def test_a_shard_not_begun_may_change_and_is_read_as_it_is(tmp_path: Path) -> None:
    pattern = write_glob(tmp_path, 300, 37)
    source = dataset(pattern)
    iterator = iter(source)
    delivered = [next(iterator)["id"] for _ in range(50)]
    state = roundtrip(source.state_dict())
    begun = set(_begun_urls(source, state))
    later = [str(u) for u in source.shards if str(u) not in begun][-1]
    Path(later).write_text('{"id": 1000}\n')
    resumed = dataset(pattern)
    resumed.load_state_dict(state)
    rest = [row["id"] for row in resumed]
    assert 1000 in rest and len(set(delivered) & set(rest)) == 0


def test_a_state_with_counts_counts_them_now_where_they_are_unknown(tmp_path: Path) -> None:
    pattern = write_glob(tmp_path, 120, 25)
    counted = dataset(pattern).count_records()
    full = [row["id"] for row in counted]
    counted = dataset(pattern).count_records()
    iterator = iter(counted)
    delivered = [next(iterator)["id"] for _ in range(40)]
    state = roundtrip(counted.state_dict())
    assert state["fingerprint"]["records"] == 120
    fresh = dataset(pattern)
    assert fresh.shards.num_records is None
    fresh.load_state_dict(state)  # counts (the counts cache, bound to file identity, or a scan)
    assert delivered + [row["id"] for row in fresh] == full


def test_a_state_with_counts_says_how_to_give_them_where_nothing_can_count() -> None:
    counts = [4, 6, 5]
    counted = ShardedDataset(synthetic_shards(counts), synthetic_read, balance="none")
    iterator = iter(counted)
    next(iterator)
    state = roundtrip(counted.state_dict())
    with pytest.raises(StateError, match="saved with the record count of every shard.*Fix: give the counts"):
        synthetic(counts).load_state_dict(state)


def test_a_state_without_counts_is_refused_where_counts_are_known_saying_why() -> None:
    counts = [4, 6, 5]
    source = synthetic(counts)
    iterator = iter(source)
    next(iterator)
    state = roundtrip(source.state_dict())
    known = ShardedDataset(synthetic_shards(counts), synthetic_read, balance="none")
    with pytest.raises(StateError, match="saved while some record counts were unknown.*Fix: resume with the dataset"):
        known.load_state_dict(state)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_two_gloo_ranks_resume_a_count_free_glob_exactly(tmp_path: Path, workers: int) -> None:
    pattern = write_glob(tmp_path, 260, 19)  # 14 shards: 7 a rank, 3 or 4 a worker
    gloo_ranks(resume_rank, 2, pattern, workers)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"shards": [[3, 9, 1], [0, 2, 1]]}, "sorted, disjoint runs"),
        ({"shards": [[0, 10**9, 1]]}, "below the dataset's 3 shards"),
        ({"started": [[2, 1, None]], "shards": [[0, 2, 1]]}, "names item 2"),
        ({"started": [[0, -1, None]]}, r"\[item, records read, identity\]"),
        ({"fingerprint_shards": 2**40}, "more than"),
    ],
)
def test_an_edited_count_free_state_is_refused_naming_the_field(edit: dict[str, Any], message: str) -> None:
    source = synthetic([4, 6, 5])
    iterator = iter(source)
    next(iterator)
    state = roundtrip(source.state_dict())
    if "fingerprint_shards" in edit:
        state["fingerprint"]["shards"] = edit.pop("fingerprint_shards")
    state.update(edit)
    with pytest.raises(StateError, match=message):
        synthetic([4, 6, 5]).load_state_dict(state)
