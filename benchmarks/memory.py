"""Memory of a shard list read by every DataLoader worker, per start method.

A parent and 4 DataLoader workers each read every entry of a list of urls,
then the workers block while the parent sums ``Pss`` from
``/proc/<pid>/smaps_rollup`` over itself and all its descendant processes
(workers, forkserver, resource tracker). The same run with an empty list is
the control. Reported: (total PSS - control) / data size, where the data size
is the Python objects' size for a list (``sys.getsizeof`` of the list and of
each str) and the url column's size for a ShardList (UTF-8 bytes plus int32
offsets; the workers do not touch its null count and size columns). A plain Python list is
the positive control: its workers' refcount writes copy it under fork, and
spawn / forkserver unpickle a copy in every worker. Target:
ShardList <= 1.1x under all three start methods. Linux only.

Each figure is the median of ``--repeat`` runs, each in a fresh interpreter.
``--quick`` (200k entries) is a smoke run: there, a few MiB of per-process
noise is a large fraction of the data.

    python benchmarks/memory.py [--entries 2000000] [--quick] [--workers 4] [--repeat 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import torch.utils.data
from _common import descendants

from shardkit import ShardList

METHODS = ("fork", "forkserver", "spawn")
KINDS = {"list": "python list", "shardlist": "ShardList"}


class ReadEverything(torch.utils.data.IterableDataset):
    """Each worker reads every entry, yields its pid, then waits for release."""

    def __init__(self, urls: Any, release: Any) -> None:
        self.urls = urls
        self.release = release

    def __iter__(self):
        chars = 0
        for url in self.urls:
            chars += len(url)
        yield os.getpid(), chars
        self.release.wait()


def _urls(entries: int) -> list[str]:
    return [f"s3://bucket/datasets/train/shard-{i:07d}.tfrecord" for i in range(entries)]


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss line in /proc/{pid}/smaps_rollup")


def measure(kind: str, method: str, entries: int, workers: int) -> dict[str, int]:
    """One run in this process: total PSS (KiB) while workers hold the list read."""
    import multiprocessing

    urls = _urls(entries)
    if kind == "list":
        data: Any = urls
        data_bytes = sys.getsizeof(urls) + sum(map(sys.getsizeof, urls))
    else:
        data = ShardList(urls)
        data_bytes = sum(len(url.encode()) for url in urls) + 4 * (entries + 1)
        del urls
    gc.collect()
    release = multiprocessing.get_context(method).Event()
    loader = torch.utils.data.DataLoader(
        ReadEverything(data, release),
        num_workers=workers,
        batch_size=None,
        prefetch_factor=1,
        multiprocessing_context=method,
    )
    batches = iter(loader)
    pids = {next(batches)[0] for _ in range(workers)}
    processes = [os.getpid(), *descendants(os.getpid())]
    if not pids <= set(processes):
        raise RuntimeError(f"workers {pids} are not descendants of {os.getpid()}")
    total = sum(_pss_kib(pid) for pid in processes)
    release.set()
    for _ in batches:
        pass
    return {"pss_kib": total, "data_bytes": data_bytes, "processes": len(processes)}


def _run(kind: str, method: str, entries: int, workers: int) -> dict[str, int]:
    """Measure in a fresh interpreter so earlier runs leave nothing behind."""
    command = [sys.executable, __file__, "--measure", kind, method, str(entries), "--workers", str(workers)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=2_000_000)
    parser.add_argument("--quick", action="store_true", help="200k entries")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="runs per figure (median)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated start methods")
    parser.add_argument("--measure", nargs=3, metavar=("KIND", "METHOD", "ENTRIES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        kind, method, entries = args.measure
        print(json.dumps(measure(kind, method, int(entries), args.workers)))
        return

    entries = 200_000 if args.quick else args.entries
    methods = args.methods.split(",")
    print(f"{entries:,} entries, parent + {args.workers} DataLoader workers each reading every entry")
    print("extra PSS over an empty-list control / data size (extra MiB in brackets)\n")
    print(f"{'start method':<14}" + "".join(f"{label:>24}" for label in KINDS.values()))
    ratios: dict[str, list[float]] = {kind: [] for kind in KINDS}
    sizes: dict[str, int] = {}
    for method in methods:
        cells = []
        for kind in KINDS:
            runs = [
                (_run(kind, method, entries, args.workers), _run(kind, method, 0, args.workers))
                for _ in range(max(args.repeat, 1))
            ]
            extra = statistics.median((full["pss_kib"] - control["pss_kib"]) * 1024 for full, control in runs)
            sizes[kind] = runs[0][0]["data_bytes"]
            ratio = extra / sizes[kind]
            ratios[kind].append(ratio)
            cells.append(f"{ratio:.2f}x ({extra / 2**20:,.0f} MiB)")
        print(f"{method:<14}" + "".join(f"{cell:>24}" for cell in cells))
    print(
        f"\ndata size: python list {sizes['list'] / 2**20:,.1f} MiB (list + str objects), "
        f"ShardList {sizes['shardlist'] / 2**20:,.1f} MiB (url column)"
    )
    worst = max(ratios["shardlist"])
    print(
        f"target ShardList <= 1.1x under every start method: {'met' if worst <= 1.1 else 'NOT met'} (worst {worst:.2f}x)"
    )


if __name__ == "__main__":
    main()
