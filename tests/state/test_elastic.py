"""Resuming an epoch on another world size: gathered rank states, split over the new world.

Record ``i`` of the synthetic dataset reads as the int ``i``, so "exactly the
samples not yet delivered" is checked by counting ints.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import ShardedDataset, Topology
from shardkit.planning import plan_intervals, split_remaining, union
from shardkit.state import StateError, merge, merge_ranks
from tests.helpers.elastic import COUNTS_A, WORLDS, torchrun_root, torchrun_worlds
from tests.helpers.examples import examples
from tests.helpers.shards import positional_read, positional_shards

REPO = Path(__file__).resolve().parents[2]
COUNTS = [230, 410, 170, 388, 302, 95]  # 1,595 records: no world size below divides it
TOTAL = sum(COUNTS)


@contextmanager
def as_worker(worker: int, workers: int):  # type: ignore[no-untyped-def]
    info = SimpleNamespace(id=worker, num_workers=workers)
    with mock.patch.object(torch.utils.data, "get_worker_info", lambda: info):
        yield


def dataset(rank: int, world_size: int, balance: str = "none", shuffle: bool = True) -> ShardedDataset:
    source = ShardedDataset(
        positional_shards(COUNTS),
        positional_read,
        shuffle=shuffle,
        seed=9,
        balance=balance,
        rank=rank,
        world_size=world_size,
    )
    source.shuffle_block, source.shuffle_window = 32, 200
    return source


def owed_samples(state: dict[str, Any], shuffle: bool = True) -> set[int]:
    """The samples (storage positions) at the global stream positions a global state still owes."""
    remaining = [tuple(i) for i in state["remaining"]]
    size = sum(b - a for a, b in remaining)
    kwargs = {"seed": 9, "epoch": state["epoch"], "shuffle": shuffle, "balance": "none", "block_size": 32}
    pieces = plan_intervals(
        COUNTS, Topology(0, 1), [(0, size)], chunk=remaining, stream_world_size=state["world_size"], **kwargs
    )
    firsts = [sum(COUNTS[:i]) for i in range(len(COUNTS))]
    return {firsts[r.shard] + i for _, r in pieces for i in range(r.start, r.stop)}


def save_mid_epoch(
    world_size: int, workers: int, balance: str, shuffle: bool, reads: list[int]
) -> tuple[list[int], list[Any]]:
    """Every (rank, worker) reads ``reads[...]`` samples and saves; returns what was delivered and the rank states."""
    delivered: list[int] = []
    states = []
    for rank in range(world_size):
        worker_states = []
        for worker in range(workers):
            source = dataset(rank, world_size, balance, shuffle)
            with as_worker(worker, workers):
                iterator = iter(source)
                for _ in range(reads[(rank * workers + worker) % len(reads)]):
                    delivered.append(next(iterator, None))
                worker_states.append(json.loads(json.dumps(source.state_dict())))
        states.append(worker_states)
    return [d for d in delivered if d is not None], states


def resume_on(state: Any, world_size: int, workers: int, balance: str, shuffle: bool) -> list[list[int]]:
    """What every rank of the new world delivers after loading the global ``state``."""
    out = []
    for rank in range(world_size):
        samples: list[int] = []
        for worker in range(workers):
            source = dataset(rank, world_size, balance, shuffle)
            source.load_state_dict(state)
            with as_worker(worker, workers):
                samples += list(source)
        out.append(samples)
    return out


@settings(max_examples=examples(40), deadline=None)
@given(
    old=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    new=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    balance=st.sampled_from(["none", "pad", "drop"]),
    shuffle=st.booleans(),
    reads=st.lists(st.integers(0, 400), min_size=1, max_size=9),
)
def test_a_gathered_state_resumes_on_any_world_with_exactly_the_rest(
    old: tuple[int, int], new: tuple[int, int], balance: str, shuffle: bool, reads: list[int]
) -> None:
    delivered, states = save_mid_epoch(*old, balance, shuffle, reads)
    state = json.loads(json.dumps(merge_ranks(states)))
    assert state["rank"] is None
    ranks = resume_on(state, *new, balance, shuffle)
    owed = owed_samples(state, shuffle)
    after = Counter(p for samples in ranks for p in samples)
    assert len(owed) == sum(b - a for a, b in state["remaining"])
    # Under "pad" a record may be owed whose repeat another rank already delivered (pad repeats anyway).
    assert balance == "pad" or not owed & set(delivered)
    if balance == "none":
        assert sorted(delivered + list(after.elements())) == list(range(TOTAL))
        return
    sizes = {len(samples) for samples in ranks}
    assert len(sizes) == 1  # equal counts on the new world
    if balance == "pad":
        assert set(after) == owed and sum(after.values()) - len(owed) < new[0]
    else:
        assert max(after.values(), default=0) <= 1 and set(after) <= owed and len(owed) - len(after) < new[0]


@settings(max_examples=examples(200), deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), max_size=6),
    world_size=st.integers(1, 6),
    balance=st.sampled_from(["none", "pad", "drop"]),
)
def test_split_remaining_deals_every_remaining_position_by_the_balance(
    lengths: list[tuple[int, int]], world_size: int, balance: str
) -> None:
    remaining, position = [], 0
    for gap, length in lengths:
        remaining.append((position + gap, position + gap + length))
        position += gap + length
    total = position + 3
    parts = [split_remaining(remaining, total, world_size, rank, balance) for rank in range(world_size)]
    owed = [p for a, b in remaining for p in range(a, b)]
    got = [p for part in parts for a, b in part for p in range(a, b)]
    originals = [p for p in got if p < total]
    repeats = [p - total for p in got if p >= total]
    assert all(a < b for part in parts for a, b in part)
    if balance == "none":
        assert originals == owed and not repeats
        assert max(map(_size, parts)) - min(map(_size, parts)) <= 1
        return
    assert len({_size(part) for part in parts}) == 1  # equal counts
    if balance == "pad":
        assert originals == owed and len(repeats) < world_size and set(repeats) <= set(owed)
    else:
        assert originals == owed[: len(originals)] and len(owed) - len(originals) < world_size and not repeats


def _size(part: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in part)


def test_a_state_saved_after_an_elastic_resume_gathers_again() -> None:
    """2x2 -> 3x1 (saved mid-way) -> 1x2: still every sample exactly once."""
    delivered, states = save_mid_epoch(2, 2, "none", True, [150, 90])
    first = merge_ranks(states)
    second_states, more = [], []
    for rank in range(3):
        source = dataset(rank, 3)
        source.load_state_dict(first)
        iterator = iter(source)
        more += [next(iterator) for _ in range(70 + 20 * rank)]
        second_states.append(json.loads(json.dumps(source.state_dict())))
    assert all(s["base"]["world_size"] == 2 for s in second_states)
    rest = [p for samples in resume_on(merge_ranks(second_states), 1, 2, "none", True) for p in samples]
    assert sorted(delivered + more + rest) == list(range(TOTAL))


def test_merge_ranks_refuses_missing_or_repeated_ranks() -> None:
    _, states = save_mid_epoch(2, 1, "none", True, [10])
    with pytest.raises(StateError, match="every rank 0..1 exactly once"):
        merge_ranks([states[0], states[0]])
    with pytest.raises(StateError, match="every rank"):
        merge_ranks([states[1]])


def test_a_mixed_loader_state_gathers_into_a_global_mixed_loader_state() -> None:
    _, states = save_mid_epoch(1, 2, "none", True, [30, 50])
    fields = {"epoch": 0, "num_workers": 2, "batch_size": 4, "batch_index": 3, "finished": False}
    loader_state = {"version": 1, "kind": "mixed_loader", **fields, "workers": states[0], "carry": []}
    merged = merge_ranks([loader_state])
    assert merged["kind"] == "mixed_loader" and merged["workers"] == [merge_ranks([states[0]])]
    assert merged["num_workers"] == 0 and merged["balance"] == "none" and merged["carry"] == []
    tail = {"worker": 0, "count": 2, "payload": [1, 2]}
    assert merge_ranks([{**loader_state, "carry": [tail]}])["carry"] == [{**tail, "worker": None}]


def test_a_global_state_is_checked_like_any_state() -> None:
    _, states = save_mid_epoch(2, 1, "pad", True, [10])
    state = merge_ranks(states)
    bad = {**state, "remaining": [[0, TOTAL + 5]]}
    with pytest.raises(StateError, match="past the end"):
        source = dataset(0, 3, "pad")
        source.load_state_dict(bad)
        list(source)
    with pytest.raises(StateError, match="global state"):
        dataset(0, 3, "pad").load_state_dict({**state, "share": [0, 2]})
    with pytest.raises(StateError, match="saved with dataset"):
        other = dataset(0, 3, "drop")
        other.load_state_dict(state)


def test_per_worker_states_merge_before_ranks() -> None:
    _, states = save_mid_epoch(2, 2, "none", False, [40, 7])
    assert merge_ranks(states) == merge_ranks([merge(workers) for workers in states])
    assert union(merge_ranks(states)["remaining"]) == [tuple(i) for i in merge_ranks(states)["remaining"]]


# -- real ranks: gloo process groups ---------------------------------------------

# The worlds are tests/scripts/elastic_check.py's, shared with test_elastic_stages.py: two ranks of
# two workers save every balance mid-epoch, then 3 ranks of 1 worker and 1 rank of 3 workers resume.
BALANCES = ("none", "pad", "drop")
NEW_WORLDS = [(ranks, workers) for mode, ranks, workers in WORLDS if mode == "load"]
assert COUNTS == COUNTS_A


def _delivered(root: Path, balance: str, mode: str, ranks: int) -> list[list[int]]:
    return [json.loads((root / f"run.{balance}.{mode}.{rank}").read_text()) for rank in range(ranks)]


@pytest.fixture(scope="module")
def elastic_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the shared worlds wrote into (tests/helpers/elastic.py: three, for both files)."""
    torchrun_worlds(tmp_path_factory)
    return torchrun_root()


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first case waits for the three worlds of elastic_runs
@pytest.mark.parametrize("balance", BALANCES)
@pytest.mark.parametrize("new", NEW_WORLDS)
def test_two_ranks_of_two_workers_resume_on_another_world(
    elastic_runs: Path, balance: str, new: tuple[int, int]
) -> None:
    before = [p for part in _delivered(elastic_runs, balance, "save", 2) for p in part]
    state = json.loads((elastic_runs / f"run.{balance}.state").read_text())
    owed = owed_samples(state)
    after = _delivered(elastic_runs, balance, f"load{new[0]}x{new[1]}", new[0])
    got = Counter(p for part in after for p in part)
    assert balance == "pad" or not owed & set(before)
    if balance == "none":
        assert sorted(before + list(got.elements())) == list(range(TOTAL))
    else:
        assert len({len(part) for part in after}) == 1, [len(part) for part in after]
        if balance == "pad":
            assert set(got) == owed and sum(got.values()) - len(owed) < new[0]
        else:
            assert max(got.values()) == 1 and set(got) <= owed and len(owed) - len(got) < new[0]
