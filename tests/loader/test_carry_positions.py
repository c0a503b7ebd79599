"""MixedLoader's undelivered samples saved by position (issue 39, item 1).

A batch cut from the workers' micro-batches leaves the rest of each cut
micro-batch (and the micro-batches received before the worker's next state)
undelivered in the main process when ``state_dict()`` is called. Over a
pipeline that can read its records again, the state names those samples by
their records' positions (runs of consecutive records where they follow one
another) and the restore reads them again; the state's size no longer depends
on the samples'. Elsewhere (a wrapped plain iterable) they are carried as data,
and ``stats().carried_as`` says which.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit import JsonlDataset, ShardedDataset
from shardkit.pipeline.mapping import NondeterministicMapWarning
from shardkit.state import StateError, decode_positions, merge_ranks
from tests.helpers.shards import jsonl_row, positional_read, positional_shards, write_jsonl_shards

pytestmark = pytest.mark.slow  # DataLoader worker processes

COUNTS = [600] * 4  # 2,400 records, as in the issue


def large(i: int) -> dict[str, Any]:
    return {"id": i, "pixels": np.full((100, 1000), i % 251, np.uint8)}  # 100 KB


def small(i: int) -> dict[str, Any]:
    return {"id": i, "pixels": np.full(10, i % 251, np.uint8)}


def pipeline(fn: Any = large, buffer: int | None = None) -> shardkit.Pipeline:
    source = ShardedDataset(positional_shards(COUNTS), positional_read, shuffle=True, seed=5)
    source.shuffle_window = 0  # shuffled by blocks: a sample-level window's intervals are state of their own
    mapped = source.map(fn)
    return mapped if buffer is None else mapped.shuffle(buffer)


def loader(dataset: shardkit.Pipeline, workers: int = 2) -> shardkit.MixedLoader:
    return shardkit.MixedLoader(dataset, batch_size=50, num_workers=workers)


def run(built: shardkit.MixedLoader, save_at: set[int]) -> tuple[list[list[int]], dict[int, Any]]:
    """Every batch's ids, and the state (as a checkpoint stores it) after each step in ``save_at``."""
    batches, states = [], {}
    for step, batch in enumerate(built, 1):
        batches.append(batch["id"].tolist())
        if step in save_at:
            states[step] = pickle.loads(pickle.dumps(built.state_dict()))
    return batches, states


def carried(state: dict[str, Any]) -> int:
    return sum(tail["count"] for tail in state["carry"])


def shuffle_held(state: dict[str, Any]) -> int:
    return sum(len(decode_positions(worker["positions"], "test")) for worker in state["workers"])


def test_cut_micro_batches_of_100_kb_samples_are_saved_by_position_in_under_4_kb_and_resume_exactly() -> None:
    """Before: a cut micro-batch's decoded arrays went into the state (677 B to 13 MB by where the batch fell)."""
    saves = {14, 15}  # 30% of the epoch's 48 batches; 15 cuts every worker's micro-batch in half
    batches, states = run(loader(pipeline()), saves)
    assert sorted(i for batch in batches for i in batch) == list(range(2400))
    for step, state in states.items():
        size = len(pickle.dumps(state))
        assert size <= 4096, (step, size)
        assert all("payload" not in tail and "identities" in tail for tail in state["carry"])
        resumed = loader(pipeline())
        resumed.load_state_dict(state)
        assert [batch["id"].tolist() for batch in resumed] == batches[step:]  # the uninterrupted run's
    assert carried(states[15]) >= 50  # half of each worker's micro-batch at least


def test_held_records_cost_at_most_16_bytes_each_with_a_shuffle_buffer() -> None:
    _, states = run(loader(pipeline(large, buffer=512)), {15})
    state = states[15]
    held = shuffle_held(state) + carried(state)
    assert held >= 2 * 511 + 50
    assert len(pickle.dumps(state)) <= 4096 + 16 * held


def test_a_state_of_positions_resumes_on_another_worker_count_and_from_a_global_state_exactly_once() -> None:
    batches, states = run(loader(pipeline(small, buffer=64)), {15})
    delivered = [i for batch in batches[:15] for i in batch]
    for state in (states[15], merge_ranks([states[15]])):  # a global state deals the carried positions
        resumed = loader(pipeline(small, buffer=64), workers=3)
        resumed.load_state_dict(state)
        rest = [i for batch in resumed for i in batch["id"].tolist()]
        assert sorted(delivered + rest) == list(range(2400))


def test_stats_say_the_carried_samples_are_held_by_position_or_as_data() -> None:
    """A wrapped plain iterable cannot read its records again: its cut micro-batches stay data."""
    by_position = loader(pipeline(small))
    _, states = run(by_position, {3})
    assert by_position.stats().carried_as == "positions"
    assert all("payload" not in tail for tail in states[3]["carry"]) and states[3]["carry"]

    plain = shardkit.MixedLoader(shardkit.wrap(Counting()).map(small), batch_size=50, num_workers=2)
    batches, states = run(plain, {3})
    assert plain.stats().carried_as == "data"
    assert states[3]["carry"] and all("payload" in tail for tail in states[3]["carry"])
    resumed = shardkit.MixedLoader(shardkit.wrap(Counting()).map(small), batch_size=50, num_workers=2)
    resumed.load_state_dict(states[3])
    assert [batch["id"].tolist() for batch in resumed] == batches[3:]


class Counting:
    """A plain iterable (no ``__getitem__``): wrapped, its items have no positions to read again by."""

    def __iter__(self) -> Any:
        return iter(range(400))


def rows(folder: Path, offset: int = 0) -> list[str]:
    """Two JSON lines shards of 40 rows; with ``offset`` the same files rewritten with other rows."""
    urls = write_jsonl_shards(str(folder), [40, 40])
    if offset:
        for shard, url in enumerate(urls):
            text = "".join(json.dumps(jsonl_row(40 * shard + k + offset)) + "\n" for k in range(40))
            Path(url + ".new").write_text(text)
            os.replace(url + ".new", url)  # a new file: another inode and mtime
    return urls


def row_number(row: dict[str, Any]) -> int:
    return row["nested"]["n"]


def jsonl_loader(urls: list[str]) -> shardkit.MixedLoader:
    dataset = JsonlDataset(shardkit.ShardList(urls, num_records=[40, 40])).map(row_number)
    return shardkit.MixedLoader(dataset, batch_size=8, num_workers=2)


def test_a_shard_replaced_between_save_and_resume_is_refused_naming_it(tmp_path: Path) -> None:
    """Before: the carried rows were data in the state, and the replaced files went unnoticed."""
    urls = rows(tmp_path)
    saving = jsonl_loader(urls)
    batches = iter(saving)
    next(batches)  # 4 of each worker's 8 delivered: both micro-batches cut
    state = pickle.loads(pickle.dumps(saving.state_dict()))
    del batches
    assert carried(state) >= 8 and all("identities" in tail for tail in state["carry"])
    rows(tmp_path, offset=1000)  # same urls and counts: the fingerprint agrees
    resumed = jsonl_loader(urls)
    resumed.load_state_dict(state)
    with pytest.raises(StateError, match=r"shard \d \(.*part-00\d\.jsonl\) is not the file it was"):
        next(iter(resumed))


CALLS = {"n": 0}


def drifting(i: int) -> dict[str, Any]:
    """A map that counts its calls: not a function of its input."""
    CALLS["n"] += 1
    return {"id": i, "noise": CALLS["n"]}


def test_a_map_that_is_not_a_function_of_its_record_is_warned_when_carried_samples_are_read_again() -> None:
    def dataset() -> shardkit.Pipeline:
        return pipeline(drifting)

    batches, states = run(loader(dataset()), {15})
    resumed = loader(dataset())
    resumed.load_state_dict(states[15])
    with pytest.warns(NondeterministicMapWarning, match=r"map\(drifting\) gave two different samples"):
        rest = [batch["id"].tolist() for batch in resumed]
    assert rest == batches[15:]  # the records still come exactly as they would have
