"""A real torch.distributed (gloo) run over a shard shorter than its record count, checked by
tests/sources/test_faults_reading.py.

Two ranks, each with a DataLoader of 2 forked workers, read synthetic shards one of which
(``mem/shard003-10``) holds 10 records while its count says 25, and all-reduce once per step as
DDP's gradient sync does. With ``--on-error skip`` rank 0 prints one JSON line with every rank's
batch and sample counts and stats; with ``--on-error raise`` each rank that meets the short shard
prints the error's attributes as a JSON line and re-raises, ending the run.

    python tests/scripts/ddp_faults_check.py --on-error skip
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from shardkit import CorruptRecordError, ShardedDataset, ShardList  # noqa: E402
from tests.helpers.processes import gloo_ranks
from tests.helpers.shards import synthetic_read

ACTUAL = [17, 3, 0, 10, 9, 30, 11, 6, 12]
PLANNED = [17, 3, 0, 25, 9, 30, 11, 6, 12]
WORLD_SIZE = 2


def run(rank: int, world_size: int, on_error: str) -> None:
    shards = ShardList([f"mem/shard{i:03d}-{n}" for i, n in enumerate(ACTUAL)], num_records=PLANNED)
    dataset = ShardedDataset(shards, synthetic_read, balance="pad", on_error=on_error, shuffle=True, seed=2)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
    batches = samples = 0
    try:
        for batch in loader:
            batches += 1
            samples += len(batch)
            dist.all_reduce(torch.ones(1))  # unequal batch counts would hang here
    except CorruptRecordError as error:
        facts = {"type": type(error).__name__, "url": error.url, "record_index": error.record_index}
        facts.update(offset=error.offset, framing_intact=error.framing_intact)
        print(json.dumps(facts), flush=True)
        raise
    stats = dataset.stats()
    mine = [batches, samples, stats.total_missing, stats.total_padded]
    gathered: list[list[int] | None] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        result = {key: [g[i] for g in gathered] for i, key in enumerate(["batches", "samples", "missing", "padded"])}
        result.update(planned=len(dataset), world_size=world_size)
        print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--on-error", default="skip", choices=("raise", "skip"))
    args = parser.parse_args()
    # Ranks forked, as in ddp_check.py: a spawned rank imports torch and shardkit again (seconds each),
    # and what is checked (the short shard, the all-reduce per step) does not depend on how ranks start.
    gloo_ranks(run, WORLD_SIZE, args.on_error, start_method="fork")


if __name__ == "__main__":
    main()
