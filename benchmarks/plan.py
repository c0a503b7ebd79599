"""How long one reader takes to plan its part of a large dataset.

Target: 10M shards for 64 ranks x 8 workers, well under a second per
reader. Prints seconds per reader for a few readers, with and without shuffle,
and for comparison the time numpy needs just to permute the shard indices
(the floor of any shuffled plan). With unknown counts (whole shards dealt
out), both the arrays the datasets read (``plan_whole_shards``) and the list
``plan()`` returns.

    python benchmarks/plan.py [--shards 10000000] [--ranks 64] [--workers 8]
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import pyarrow as pa

from shardkit import Topology, plan
from shardkit.planning import plan_whole_shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000_000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="1M shards")
    args = parser.parse_args()
    shards = 1_000_000 if args.quick else args.shards
    counts = np.random.default_rng(0).integers(0, 2000, size=shards, dtype=np.int64)

    start = time.perf_counter()
    np.random.default_rng(0).permutation(shards)
    permute = time.perf_counter() - start

    readers = [(0, 0), (args.ranks // 2, args.workers // 2), (args.ranks - 1, args.workers - 1)]
    print(f"{shards:,} shards, {int(counts.sum()):,} records, {args.ranks} ranks x {args.workers} workers")
    print(f"{'case':<28}{'s / reader':>12}{'ranges':>10}{'vs permute':>12}")
    for shuffle, balance in ((False, "none"), (False, "pad"), (True, "pad"), (True, "drop")):
        times, ranges = [], 0
        for rank, worker in readers:
            t0 = time.perf_counter()
            mine = plan(counts, Topology(rank, args.ranks, worker, args.workers), shuffle=shuffle, balance=balance)
            times.append(time.perf_counter() - t0)
            ranges = len(mine)
        seconds = float(np.median(times))
        print(f"{f'shuffle={shuffle} {balance}':<28}{seconds:>12.3f}{ranges:>10,}{seconds / permute:>11.1f}x")
    unknown = pa.nulls(shards, pa.int64())  # what a ShardList without counts holds
    calls = {"unknown, arrays": plan_whole_shards, "unknown, plan() list": functools.partial(plan, balance="none")}
    for name, make in calls.items():
        times = []
        for rank, worker in readers:
            t0 = time.perf_counter()
            mine = make(unknown, Topology(rank, args.ranks, worker, args.workers), shuffle=True)
            times.append(time.perf_counter() - t0)
        seconds = float(np.median(times))
        print(f"{name:<28}{seconds:>12.3f}{len(mine):>10,}{seconds / permute:>11.1f}x")
    print(f"{'numpy permutation alone':<28}{permute:>12.3f}")


if __name__ == "__main__":
    main()
