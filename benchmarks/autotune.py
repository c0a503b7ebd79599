"""``MixedLoader(num_workers="auto", prefetch="auto")`` against every hand-picked worker count and prefetch.

One content (``--records`` small tf.Examples in 8 TFRecord shards) read under three workloads,
each a pipeline and a training step that holds the loop for a fixed time without using the CPU
(a step on an accelerator: ``time.sleep``):

- ``cheap``: the records decoded and made tensors; batch 64, step 5 ms;
- ``map``: plus a ``.map`` of about 1 ms of pure-Python CPU per sample; batch 32, step 10 ms;
- ``remote``: plus a ranged GET of 1 KB per 16 records from an HTTP server on 127.0.0.1
  (``tests/helpers/fault_server.py``, in its own process) that answers each request after
  30 ms, as an object store's first byte: the workers wait with idle CPUs; batch 32, step 40 ms.

Each workload runs with ``num_workers`` in 0..4 x ``prefetch`` in {2, 4} (0 workers has no
prefetch) and with ``"auto"`` for both, one epoch each: the first ``--warm`` steps are not
timed (workers start; ``auto`` tunes), the next ``--steps`` are. Every configuration is timed
over the same steps of the epoch: a worker's memory grows as it opens its next shard, so
memory sampled at different points of the epoch would not compare. Configurations are interleaved ``--rounds`` times, each round in another order, and the
median kept. Memory is the peak, sampled every 10 steps of the timed part, of the proportional
set size (``/proc/PID/smaps_rollup``) of the main process and its workers: pages a forked worker
shares with the main process count once.

Printed per workload: each configuration's steps/s and peak memory, then auto's ratio to the
best hand-picked configuration (the fastest; targets: throughput >= 0.9x, memory <= 1.2x),
the count auto settled on, and the changes it made (with the time they took).

    python benchmarks/autotune.py            # full run: about 40 minutes on 2 shared cores
    python benchmarks/autotune.py --quick    # a smoke run (0 workers, 2 workers, auto; one round): not to be quoted
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import shardkit  # noqa: E402
from shardkit.loader.autotune import process_memory_bytes  # noqa: E402

REMOTE_LATENCY = 0.030
RECORDS_PER_GET = 16


def to_tensors(example: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"x": torch.from_numpy(example["x"]), "label": torch.from_numpy(example["label"])}


def expensive(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """About 1 ms of pure-Python CPU (an augmentation, a tokenizer)."""
    total = 0
    for i in range(12_000):
        total += i * i % 7
    sample["label"] = sample["label"] + (total % 1)
    return sample


_connections: dict[int, http.client.HTTPConnection] = {}
_fetched = [0]


def fetch(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One ranged GET of 1 KB per :data:`RECORDS_PER_GET` records, on a kept-alive connection per process."""
    _fetched[0] += 1
    if _fetched[0] % RECORDS_PER_GET == 1:
        connection = _connections.get(os.getpid())
        if connection is None:
            where = urlsplit(os.environ["AUTOTUNE_BENCH_URL"])
            connection = _connections[os.getpid()] = http.client.HTTPConnection(where.hostname, where.port)
        connection.request("GET", "/blob.bin", headers={"Range": "bytes=0-1023"})
        response = connection.getresponse()
        response.read()
    return sample


@dataclass(frozen=True)
class Workload:
    name: str
    maps: tuple[Any, ...]
    batch_size: int
    step_seconds: float


WORKLOADS = (
    Workload("cheap", (to_tensors,), 64, 0.005),
    Workload("map", (to_tensors, expensive), 32, 0.010),
    Workload("remote", (to_tensors, fetch), 32, 0.040),
)

Config = tuple[Any, Any]  # (num_workers, prefetch)
CONFIGS: tuple[Config, ...] = ((0, None), *((n, p) for n in range(1, 5) for p in (2, 4)), ("auto", "auto"))
QUICK_CONFIGS: tuple[Config, ...] = ((0, None), (2, 2), ("auto", "auto"))


def write(root: str, records: int) -> shardkit.ShardList:
    rng = np.random.default_rng(0)
    with shardkit.ShardWriter(f"{root}/train-%05d.tfrecord", max_records=records // 8) as writer:
        for i in range(records):
            writer.write(shardkit.encode_example({"x": rng.normal(size=4), "label": [i % 10]}))
    with open(f"{root}/blob.bin", "wb") as blob:
        blob.write(os.urandom(4096))
    return shardkit.ShardList.from_manifest(writer.manifest)


def loader(shards: shardkit.ShardList, workload: Workload, config: Config) -> shardkit.MixedLoader:
    pipeline: Any = shardkit.TFRecordDataset(shards, shuffle=True, seed=0)
    for function in workload.maps:
        pipeline = pipeline.map(function)
    workers, prefetch = config
    return shardkit.MixedLoader(pipeline, batch_size=workload.batch_size, num_workers=workers, prefetch=prefetch)


@dataclass
class Run:
    steps_per_second: float
    peak_bytes: int
    workers: int
    changes: list[dict[str, Any]]
    settled_seconds: float
    last: str = ""


def run(shards: shardkit.ShardList, workload: Workload, config: Config, warm: int, steps: int) -> Run:
    built = loader(shards, workload, config)
    batches = iter(built)
    start = time.perf_counter()
    for _ in range(warm):
        next(batches)
        time.sleep(workload.step_seconds)
    settled = time.perf_counter() - start
    peak, timed_start = 0, time.perf_counter()
    for step in range(steps):
        next(batches)
        time.sleep(workload.step_seconds)
        if step % 10 == 0:
            peak = max(peak, _memory(built))
    rate = steps / (time.perf_counter() - timed_start)
    tuned = built.stats().autotune  # type: ignore[union-attr]
    changes = [] if tuned is None else tuned["changes"]
    workers = built.num_workers
    del batches, built
    return Run(rate, peak, workers, changes, settled, "" if tuned is None else tuned["last"])


def _worker_pids(built: shardkit.MixedLoader | None) -> list[int]:
    if built is None or built._mixer is None:
        return []
    return [p.pid for p in getattr(built._mixer._source, "_workers", None) or ()]


def _memory(built: shardkit.MixedLoader) -> int:
    return process_memory_bytes([os.getpid(), *_worker_pids(built)]) or 0


class Server:
    """The 30 ms server in its own process, serving ``root``."""

    def __init__(self, root: str) -> None:
        env = {**os.environ, "PYTHONPATH": _ROOT}
        command = [sys.executable, "-m", "tests.helpers.fault_server", root, str(REMOTE_LATENCY)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, cwd=_ROOT)
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().decode().strip()
        if not self.url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"latency server did not start: {self.url!r}")

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


def label(config: Config) -> str:
    workers, prefetch = config
    return (
        "auto" if workers == "auto" else f"{workers} workers" + ("" if prefetch is None else f", prefetch {prefetch}")
    )


def bench(shards: shardkit.ShardList, workload: Workload, args: argparse.Namespace) -> bool:
    configs = args.configs
    results: dict[Config, list[Run]] = {config: [] for config in configs}
    for round_ in range(args.rounds):
        order = configs if round_ % 2 == 0 else tuple(reversed(configs))
        for config in order:
            results[config].append(run(shards, workload, config, args.warm, args.steps))
    rate = {c: statistics.median(r.steps_per_second for r in runs) for c, runs in results.items()}
    peak = {c: statistics.median(r.peak_bytes for r in runs) for c, runs in results.items()}
    hand = [c for c in configs if c[0] != "auto"]
    best = max(hand, key=rate.__getitem__)
    auto = ("auto", "auto")
    print(f"\n### {workload.name}: batch {workload.batch_size}, step {workload.step_seconds * 1e3:.0f} ms\n")
    print("| configuration | steps/s | peak memory (MiB) |\n|---|---|---|")
    for config in configs:
        mark = " (best)" if config == best else ""
        print(f"| {label(config)}{mark} | {rate[config]:.1f} | {peak[config] / 2**20:.0f} |")
    speed, memory = rate[auto] / rate[best], peak[auto] / peak[best]
    print(
        f"\nauto / best ({label(best)}): throughput {speed:.2f}x (target >= 0.9), memory {memory:.2f}x (target <= 1.2)"
    )
    for index, runs in enumerate(results[auto]):
        path = (
            " -> ".join([str(runs.changes[0]["from"])] + [str(c["to"]) for c in runs.changes]) if runs.changes else "1"
        )
        print(
            f"  auto round {index + 1}: workers {path} within {runs.settled_seconds:.1f} s of warm-up; last: {runs.last}"
        )
    return speed >= 0.9 and memory <= 1.2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run whose numbers are not meant to be quoted")
    parser.add_argument("--records", type=int, default=40_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per run")
    parser.add_argument("--warm", type=int, default=200, help="untimed steps before the timed ones (auto tunes)")
    parser.add_argument("--workloads", nargs="*", default=[w.name for w in WORKLOADS])
    args = parser.parse_args()
    args.configs = CONFIGS
    if args.quick:  # every code path once: no workers, workers with a prefetch, auto
        args.records, args.rounds, args.steps, args.warm = 2_000, 1, 10, 10  # auto judges no window in 20 steps either
        args.configs = QUICK_CONFIGS
    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)  # 3, 4 workers on 2 cores
    os.system("uptime")  # noqa: S605, S607 - the load the figures were measured under
    met = []
    with tempfile.TemporaryDirectory() as root:
        shards = write(root, args.records)
        server = Server(root)
        os.environ["AUTOTUNE_BENCH_URL"] = server.url
        try:
            for workload in WORKLOADS:
                if workload.name in args.workloads:
                    met.append(bench(shards, workload, args))
        finally:
            server.close()
    os.system("uptime")  # noqa: S605, S607
    print(f"\ntargets met on {sum(met)} of {len(met)} workloads")


if __name__ == "__main__":
    main()
