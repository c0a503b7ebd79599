"""Held records saved as positions, read again on restore (issue 39, item 1).

A ``.shuffle(n)`` buffer over a source whose records can be read again saves
the (shard, record) positions of what it holds, not the samples: the state's
size does not depend on the samples' and grows by at most 16 bytes per held
record. On restore the records are read again through the stages below
(a map applied again, a filter checked again) after the shards' identities
are checked; a replaced shard, a filter that no longer accepts a held record
and a map that does not give the same sample twice are caught.
"""

from __future__ import annotations

import json
import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit import JsonlDataset, ShardedDataset, wrap
from shardkit.pipeline.mapping import NondeterministicMapWarning
from shardkit.state import StateError
from tests.helpers.shards import jsonl_row, positional_read, positional_shards, write_jsonl_shards

COUNTS = [700, 1300, 900, 2500]  # 5,400 records


def source(window: int | None = None) -> ShardedDataset:
    dataset = ShardedDataset(positional_shards(COUNTS), positional_read, shuffle=True, seed=7)
    if window is not None:
        dataset.shuffle_window = window
    return dataset


def small(i: int) -> dict[str, Any]:
    return {"id": i, "pixels": np.full(10, i % 251, np.uint8)}


def large(i: int) -> dict[str, Any]:
    return {"id": i, "pixels": np.full((100, 1000), i % 251, np.uint8)}  # 100 KB, as in the issue


def saved_after(
    pipeline: shardkit.Pipeline, steps: int, rest: bool = True
) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """(samples before, the state as a checkpoint stores it, samples after) of one uninterrupted run."""
    iterator = iter(pipeline)
    before = [next(iterator) for _ in range(steps)]
    state = json.loads(json.dumps(pipeline.state_dict()))
    return before, state, list(iterator) if rest else []


def ids(samples: list[Any]) -> list[int]:
    return [int(sample["id"]) for sample in samples]


def pickled_size(state: dict[str, Any]) -> int:
    return len(pickle.dumps(state))  # what a trainer's torch.save of the checkpoint holds


def test_a_shuffle_buffer_of_large_samples_saves_positions_whatever_the_samples_size() -> None:
    """Before: the buffer's 64 decoded 100 KB arrays went into the state (8.7 MB); now the same bytes as for 10 B."""
    _, of_large, _ = saved_after(source().map(large).shuffle(64), 300, rest=False)
    _, of_small, _ = saved_after(source().map(small).shuffle(64), 300, rest=False)
    assert "samples" not in of_large and "positions" in of_large
    assert pickled_size(of_large) == pickled_size(of_small) < 4096 + 16 * 64


def test_a_position_only_pipeline_state_is_under_4_kb_and_a_4096_buffer_adds_at_most_16_bytes_a_record() -> None:
    """Shuffled by blocks (no sample-level window: a window's unyielded positions are intervals of their own)."""
    _, plain, _ = saved_after(source(window=0).map(small), 1000, rest=False)
    _, shuffled, _ = saved_after(source(window=0).map(small).shuffle(4096), 1000, rest=False)
    held = len(shardkit.state.decode_positions(shuffled["positions"], "test"))
    assert held == 4095
    assert pickled_size(plain) <= 4096
    assert pickled_size(shuffled) - pickled_size(plain) <= 16 * held


@pytest.mark.parametrize("steps", [1, 250, 2000, 3590])
def test_a_shuffle_state_of_positions_resumes_the_uninterrupted_run_exactly(steps: int) -> None:
    before, state, after = saved_after(source().map(small).filter(lambda s: s["id"] % 3).shuffle(512), steps)
    resumed = source().map(small).filter(lambda s: s["id"] % 3).shuffle(512)
    resumed.load_state_dict(state)
    again = list(resumed)
    assert ids(again) == ids(after)
    assert all(np.array_equal(a["pixels"], b["pixels"]) for a, b in zip(again, after))
    assert sorted(ids(before) + ids(again)) == [i for i in range(sum(COUNTS)) if i % 3]


def test_samples_a_state_cannot_encode_resume_by_their_position() -> None:
    """Before: an OrderedDict in a shuffle buffer made state_dict() raise (the codec cannot hold it)."""
    items = [OrderedDict(id=i) for i in range(40)]
    before, state, after = saved_after(wrap(items, shuffle=True, seed=1).shuffle(16), 10)
    resumed = wrap(items, shuffle=True, seed=1).shuffle(16)
    resumed.load_state_dict(state)
    assert list(resumed) == after and sorted(s["id"] for s in before + after) == list(range(40))


def write_rows(folder: Path, sizes: list[int], offset: int = 0) -> list[str]:
    """JSON lines shards; with ``offset`` the same counts, other rows (a shard rewritten)."""
    urls = write_jsonl_shards(str(folder), sizes)
    if offset:
        first = 0
        for url, size in zip(urls, sizes):
            text = "".join(json.dumps(jsonl_row(k + offset)) + "\n" for k in range(first, first + size))
            Path(url + ".new").write_text(text)
            os.replace(url + ".new", url)  # a new file: another inode and mtime
            first += size
    return urls


def jsonl(urls: list[str]) -> shardkit.Pipeline:
    return JsonlDataset(shardkit.ShardList(urls, num_records=[30, 30]), shuffle=True, seed=3).shuffle(12)


def test_a_shard_replaced_between_save_and_resume_is_refused(tmp_path: Path) -> None:
    """Before: the buffered rows were in the state, and the rest came from the replaced files unnoticed."""
    urls = write_rows(tmp_path, [30, 30])
    _, state, _ = saved_after(jsonl(urls), 20)
    write_rows(tmp_path, [30, 30], offset=1000)  # same urls and counts: the fingerprint agrees
    resumed = jsonl(urls)
    resumed.load_state_dict(state)
    with pytest.raises(StateError, match=r"shard \d .*part-00\d\.jsonl\) is not the file it was"):
        list(resumed)


def test_an_unchanged_shard_resumes_after_the_identity_check(tmp_path: Path) -> None:
    urls = write_rows(tmp_path, [30, 30])
    before, state, after = saved_after(jsonl(urls), 20)
    resumed = jsonl(urls)
    resumed.load_state_dict(state)
    assert list(resumed) == after and len(before + after) == 60


ACCEPT = {"odd": True}


def picky(sample: dict[str, Any]) -> bool:
    return sample["id"] % 2 == 1 if ACCEPT["odd"] else False


def test_a_held_record_a_filter_no_longer_accepts_is_a_state_error() -> None:
    """Before: the state held the samples themselves, so a changed filter went unnoticed."""
    _, state, _ = saved_after(source().map(small).filter(picky).shuffle(32), 40)
    ACCEPT["odd"] = False
    try:
        resumed = source().map(small).filter(picky).shuffle(32)
        resumed.load_state_dict(state)
        with pytest.raises(StateError, match=r"filter\(picky\) no longer accepts record \d+ of shard \d"):
            list(resumed)
    finally:
        ACCEPT["odd"] = True


CALLS = {"n": 0}


def drifting(i: int) -> dict[str, Any]:
    """A map that draws from a generator that runs on across records: not a function of its input."""
    CALLS["n"] += 1
    return {"id": i, "noise": CALLS["n"]}


def seeded(i: int) -> dict[str, Any]:
    """A random augmentation seeded by the record: the same sample whenever the record is mapped."""
    return {"id": i, "noise": int(np.random.default_rng(shardkit.record_seed()).integers(1 << 30))}


def test_a_map_that_is_not_a_function_of_its_record_is_warned_on_resume() -> None:
    _, state, after = saved_after(source().map(drifting).shuffle(16), 30)
    resumed = source().map(drifting).shuffle(16)
    resumed.load_state_dict(state)
    with pytest.warns(NondeterministicMapWarning, match=r"map\(drifting\) gave two different samples"):
        again = list(resumed)
    assert ids(again) == ids(after)  # the records still come exactly as they would have


@pytest.mark.slow  # a SeedSequence per record: seconds
def test_a_map_seeded_by_record_seed_resumes_the_same_samples_without_a_warning() -> None:
    _, state, after = saved_after(source().map(seeded).shuffle(16), 30)
    resumed = source().map(seeded).shuffle(16)
    resumed.load_state_dict(state)
    with warnings_as_errors():
        assert list(resumed) == after


def warnings_as_errors() -> Any:
    import warnings

    manager = warnings.catch_warnings()
    manager.__enter__()
    warnings.simplefilter("error", NondeterministicMapWarning)
    return _Exit(manager)


class _Exit:
    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        self.manager.__exit__(*exc)


def test_record_seed_outside_a_map_names_where_to_call_it() -> None:
    shardkit.seeding.mapping = None
    with pytest.raises(shardkit.seeding.SeedError, match="inside the function"):
        shardkit.record_seed()
