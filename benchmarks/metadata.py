"""What checking metadata costs ("Trust nothing"), for a large shard list.

Medians of interleaved rounds, in seconds:

- loading a local IPC manifest of N absolute urls: mapped in place (what
  shardkit did, unsafe) vs copied to a private file first (what it does),
  both with the url validation;
- ``ShardList.url_digest`` (what counts caches and resume states are bound to);
- the duplicate-url check on a sorted and on a shuffled list;
- reading the identity (fsspec ``ls``) of F local files for the counts cache,
  and a full ``resolve_counts`` served from the cache.

    python benchmarks/metadata.py [--urls 1000000] [--files 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import numpy as np

from shardkit import ShardList
from shardkit.counting import resolve_counts
from shardkit.counting.cache import _identities
from shardkit.shardlist import _warn_duplicates
from shardkit.shardlist.arrowfile import map_ipc as _map_ipc
from shardkit.shardlist.manifest import normalize_manifest as _normalize_manifest


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rounds(cases: dict[str, Callable[[], object]], n: int) -> dict[str, float]:
    """Median seconds of each case, the cases interleaved within every round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(n):
        for name, fn in cases.items():
            times[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--urls", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-") as root:
        urls = [f"s3://bucket/train/shard-{i:07d}.tfrecord" for i in range(args.urls)]
        manifest = os.path.join(root, "manifest.arrow")
        shards = ShardList(urls, num_records=np.full(args.urls, 100))
        shards.to_manifest(manifest)
        shuffled = shards.select(np.random.default_rng(0).permutation(args.urls))
        print(f"{args.urls:,} urls, manifest {os.path.getsize(manifest) / 1e6:.0f} MB")
        results = rounds(
            {
                "from_manifest, mapped in place (before)": lambda: _normalize_manifest(_map_ipc(manifest)[0], "m", str),
                "from_manifest, copied then mapped (now)": lambda: len(ShardList.from_manifest(manifest)),
                "copyfile alone": lambda: shutil.copyfile(manifest, manifest + ".copy"),
                "url_digest": lambda: ShardList.from_manifest(manifest).url_digest(),
                "duplicate check, sorted": lambda: _warn_duplicates(shards.table.column("url"), "x"),
                "duplicate check, shuffled": lambda: _warn_duplicates(shuffled.table.column("url"), "x"),
            },
            args.rounds,
        )
        results["url_digest"] -= results["from_manifest, copied then mapped (now)"]
        files = _local_files(root, args.files)
        results.update(
            rounds(
                {
                    f"identities of {args.files:,} local files": lambda: _identities(files, None),
                    f"resolve_counts of {args.files:,} files, cached": lambda: resolve_counts(
                        files, len, why="bench", cache_dir=os.path.join(root, "cache")
                    ),
                },
                args.rounds,
            )
        )
    width = max(map(len, results))
    for name, seconds in results.items():
        print(f"{name:<{width}}  {seconds:8.3f} s")


def _local_files(root: str, n: int) -> ShardList:
    directory = os.path.join(root, "data")
    os.makedirs(directory)
    paths = [os.path.join(directory, f"part-{i:06d}") for i in range(n)]
    for path in paths:
        open(path, "wb").close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ShardList(paths)


if __name__ == "__main__":
    main()
