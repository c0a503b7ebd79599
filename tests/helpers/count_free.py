"""Shards without record counts for resume tests (tests/state/test_count_free.py): a glob of
``ShardWriter``'s own JSON lines output, read as a ``JsonlDataset`` that deals whole shards, and the
gloo rank that saves and resumes it under DataLoader workers.

Module level, so that DataLoader workers and ranks started with spawn can unpickle them."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import torch

import shardkit


def write_glob(root: str | Path, records: int, per_shard: int) -> str:
    """``records`` rows ``{"id": i}`` written by ``ShardWriter`` in shards of ``per_shard``; the glob of the shards
    (its manifest, which holds the counts, is not in the glob: a dataset over it knows no count)."""
    with shardkit.ShardWriter(str(Path(root) / "part-%04d.jsonl"), max_records=per_shard) as writer:
        for i in range(records):
            writer.write({"id": i})
    return str(Path(root) / "part-*.jsonl")


def dataset(pattern: str | list[str], **kwargs: Any) -> shardkit.JsonlDataset:
    """Whole shards, shuffled at the level of shards (no sample-level window: that would count)."""
    built = shardkit.JsonlDataset(pattern, shuffle=True, seed=3, balance="none", **kwargs)
    built.shuffle_window = 0
    return built


def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"]]


def resume_rank(rank: int, world_size: int, pattern: str, workers: int) -> None:
    """One gloo rank: an uninterrupted epoch, then the same epoch saved at several batches (first,
    middle, last) and resumed by a fresh loader and dataset; delivered + resumed must be the
    uninterrupted batches exactly. Raises (failing the rank) otherwise.

    Its seven loaders start their workers from a forkserver that imported torch and shardkit once
    (:func:`preloaded_forkserver`): each worker still gets the dataset, and the resumed loader's state,
    pickled as under spawn (the rank's own default, a spawned process), without importing torch again:
    28 spawned workers were 70 s of CPU, the whole test at load 5-10 on 2 cores."""
    context = preloaded_forkserver() if workers else None

    def loader() -> shardkit.StatefulDataLoader:
        return shardkit.StatefulDataLoader(
            dataset(pattern), batch_size=4, num_workers=workers, multiprocessing_context=context
        )

    full = [ids(batch) for batch in loader()]
    assert full, f"rank {rank} read nothing"
    # Every rank saves at the same steps (states are gathered over the ranks): below the shortest rank's count.
    counts = [None] * world_size
    torch.distributed.all_gather_object(counts, len(full))
    shortest = min(counts)  # type: ignore[type-var]
    for cut in sorted({1, shortest // 2, shortest - 1}):
        interrupted, delivered, state = loader(), [], None
        for step, batch in enumerate(interrupted, 1):
            delivered.append(ids(batch))
            if step == cut:
                state = json.loads(json.dumps(interrupted.state_dict()))
                break
        resumed = loader()
        resumed.load_state_dict(state)
        rest = [ids(batch) for batch in resumed]
        assert delivered + rest == full, f"rank {rank}, {workers} workers, cut at batch {cut}"


def preloaded_forkserver() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server importing torch, shardkit and the JSONL source (pyarrow) before it
    forks a worker: workers that receive their dataset pickled, as spawned ones do, at the cost of a fork,
    not of an interpreter importing them (about 3 s of CPU each on a quiet machine, 0.2 s a loader after)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "shardkit", "shardkit.sources.formatted", __name__])
    return context
