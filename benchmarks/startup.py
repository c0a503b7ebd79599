"""Start-up at a million shards: from a manifest to the first sample.

Writes a manifest of ``--shards`` shards of ``--records`` records each with
:meth:`ShardList.to_manifest` into a temporary directory. Only the first few
shard files exist (tiny TFRecord files): an unshuffled plan reads those first,
and nothing reads past them before the first batch. Then, each ``--repeat``
times, it reports seconds for:

- ``load``: :meth:`ShardList.from_manifest`;
- ``build``: ``TFRecordDataset(shards, decode="raw")``;
- ``first (0 workers)``: ``iter()`` to the first sample in this process;
- ``first (N workers)``: a DataLoader with ``--workers`` workers, ``iter()`` to
  its first batch (worker start-up included);
- ``plan (rank r, worker w)``: :func:`plan_intervals` for each reader of a
  ``--ranks`` x ``--workers`` job, in this process: the planning every worker
  does before reading.

``--profile`` prints the top cProfile entries of one ``iter()`` to the first
sample in this process.

    python benchmarks/startup.py [--shards 1000000] [--records 100] [--workers 2] [--ranks 2] [--repeat 3]
                                 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import shardkit  # noqa: E402
from shardkit.planning import plan_intervals, rank_span, share  # noqa: E402
from shardkit.topology import Topology  # noqa: E402

_EXISTING = 8  # shard files actually written: the first ones of an unshuffled plan


def write_manifest(root: str, shards: int, records: int) -> str:
    """A manifest of ``shards`` urls under ``root``, the first few backed by real tiny files."""
    urls = [os.path.join(root, f"shard-{i:07d}.tfrecord") for i in range(shards)]
    for url in urls[:_EXISTING]:
        with shardkit.TFRecordWriter(url) as writer:
            for _ in range(records):
                writer.write(b"x" * 100)
    manifest = os.path.join(root, "train.manifest.arrow")
    shardkit.ShardList(urls, num_records=np.full(shards, records)).to_manifest(manifest)
    return manifest


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    result = call()
    return time.perf_counter() - began, result


def one_round(manifest: str, workers: int, ranks: int) -> dict[str, float]:
    out: dict[str, float] = {}
    out["load"], listed = timed(lambda: shardkit.ShardList.from_manifest(manifest))
    out["build"], dataset = timed(lambda: shardkit.TFRecordDataset(listed, decode="raw"))
    out["first (0 workers)"], _ = timed(lambda: next(iter(dataset)))
    began = time.perf_counter()
    batches = iter(DataLoader(dataset, batch_size=64, num_workers=workers))
    next(batches)
    out[f"first ({workers} workers)"] = time.perf_counter() - began
    del batches  # shuts the workers down
    counts = listed.num_records
    assert counts is not None
    total = int(counts.sum())
    for rank in range(ranks):
        size = rank_span(total, ranks, rank, "pad")[1]
        for worker in range(workers):
            topology = Topology(rank=rank, world_size=ranks, worker_id=worker, num_workers=workers)
            intervals = share([(0, size)], workers, worker)
            out[f"plan (rank {rank}, worker {worker})"], _ = timed(
                lambda: plan_intervals(counts, topology, intervals, balance="pad")
            )
    return out


def profile(manifest: str) -> None:
    listed = shardkit.ShardList.from_manifest(manifest)
    dataset = shardkit.TFRecordDataset(listed, decode="raw")
    profiler = cProfile.Profile()
    profiler.enable()
    next(iter(dataset))
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1_000_000)
    parser.add_argument("--records", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile one iter() to the first sample")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="shardkit-startup-")
    try:
        manifest = write_manifest(root, args.shards, args.records)
        if args.profile:
            profile(manifest)
            return
        rounds = [one_round(manifest, args.workers, args.ranks) for _ in range(args.repeat)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.shards:,} shards x {args.records} records, median of {args.repeat} rounds, seconds:\n")
    print("| step | median | min | max |")
    print("|---|---|---|---|")
    for name in rounds[0]:
        values = [r[name] for r in rounds]
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |")


if __name__ == "__main__":
    main()
