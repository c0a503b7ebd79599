"""A real torch.distributed run over the gloo backend, checked by tests/test_ddp.py.

Each of ``--world-size`` processes builds a ShardedDataset (rank detected from
the process group when iteration starts), iterates it with a DataLoader of 2
workers, all-reduces its batch count and gathers its sample ids. Rank 0 prints
one JSON line with what every rank saw.

    python tests/scripts/ddp_check.py --world-size 3 --context spawn --balance pad
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

from shardkit import ShardedDataset  # noqa: E402
from tests.helpers.processes import gloo_ranks
from tests.helpers.shards import synthetic_read, synthetic_shards

COUNTS = [17, 3, 0, 25, 9, 30, 11, 6, 12]


def run(rank: int, world_size: int, context: str, balance: str) -> None:
    dataset = ShardedDataset(synthetic_shards(COUNTS), synthetic_read, balance=balance, shuffle=True, seed=11)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context=context)
    ids: list[str] = []
    batches = 0
    for batch in loader:
        batches += 1
        ids.extend(batch)
        if balance != "none":
            # A collective per step, as DDP's gradient all-reduce: unequal batch
            # counts would hang here, so the test's timeout would catch them.
            dist.all_reduce(torch.ones(1))
    counts = torch.tensor([batches])
    gathered_counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered_counts, counts)
    gathered_ids: list[list[str] | None] = [None] * world_size
    dist.all_gather_object(gathered_ids, ids)
    if rank == 0:
        print(json.dumps({"batches": [int(c) for c in gathered_counts], "ids": gathered_ids}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--context", default="fork", choices=("fork", "spawn", "forkserver"))
    parser.add_argument("--balance", default="pad", choices=("none", "pad", "drop"))
    args = parser.parse_args()
    # Ranks forked (a spawned rank imports torch again, seconds each); --context is how each
    # rank's DataLoader starts its workers, the thing checked.
    gloo_ranks(run, args.world_size, args.context, args.balance, start_method="fork")


if __name__ == "__main__":
    main()
