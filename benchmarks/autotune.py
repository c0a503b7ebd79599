"""``MixedLoader(num_workers="auto", prefetch="auto")`` against every hand-picked ``num_workers``, over first epochs.

One content (``--records`` small tf.Examples in 8 TFRecord shards) read under three workloads,
each a pipeline and a training step that holds the loop for a fixed time without using the CPU
(a step on an accelerator: ``time.sleep``):

- ``cheap``: the records decoded and made tensors; batch 64, step 5 ms; the whole epoch;
- ``map``: plus a ``.map`` of about 0.5 ms of pure-Python CPU per sample; batch 32, step 10 ms;
  the whole epoch (16k records: 500 steps, 5 to 9 s);
- ``remote``: plus a ranged GET of 1 KB per 16 records from an HTTP server on 127.0.0.1
  (``tests/helpers/fault_server.py``, in its own process) that answers each request after
  30 ms, as an object store's first byte: the workers wait with idle CPUs; batch 32, step 40 ms;
  the epoch's first 160 steps.

Each run is a new loader (not persistent) timed from its first ``next()``: the workers' start
and everything auto does to choose its count are inside the time, as in a job whose one long
first epoch is its whole run. Each workload runs with ``num_workers`` in 0..4 (``--prefetch``:
DataLoader's ``prefetch_factor``, 2 by default; ``--prefetch 2 4`` tries both) and with
``"auto"`` for both; the configurations are interleaved ``--rounds`` times, each round in
another order. Memory is the peak, sampled every 10 steps by a thread (the kernel's walk of the
page tables for ``/proc/PID/smaps_rollup`` takes about 20 ms a torch process: not in the timed
loop), of the proportional set size of the main process and its workers: pages a forked worker
shares with the main process count once.

Printed per workload: each configuration's median steps/s and peak memory, then auto's
ratio to the best hand-picked configuration (the fastest median): the median of the rounds'
ratios against the target (>= 0.9x) and the worst round's against its floor (>= 0.8x), the
load average over the workload's runs, and what auto chose in each round (with the step and
the second of the run each change came at, and its stall: the wait of the ``next()`` that made
it, the old workers stopped and the new ones started up to their first micro-batches).

    python benchmarks/autotune.py            # full run: about 10 minutes on 2 quiet cores
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
import threading
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
from shardkit.loader.usage import process_memory_bytes  # noqa: E402

REMOTE_LATENCY = 0.030
RECORDS_PER_GET = 16


def to_tensors(example: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"x": torch.from_numpy(example["x"]), "label": torch.from_numpy(example["label"])}


def expensive(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """About 0.5 ms of pure-Python CPU (an augmentation, a tokenizer)."""
    total = 0
    for i in range(6_000):
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
    steps: int  # timed from the first next(); at most the epoch


WORKLOADS = (
    Workload("cheap", (to_tensors,), 64, 0.005, 250),
    Workload("map", (to_tensors, expensive), 32, 0.010, 500),
    Workload("remote", (to_tensors, fetch), 32, 0.040, 160),
)

Config = tuple[Any, Any]  # (num_workers, prefetch)
AUTO: Config = ("auto", "auto")
TARGET, FLOOR = 0.9, 0.8  # auto / best hand-picked: the median over rounds, and every round


def configs(prefetches: list[int]) -> tuple[Config, ...]:
    return ((0, None), *((n, p) for n in range(1, 5) for p in prefetches), AUTO)


QUICK_CONFIGS: tuple[Config, ...] = ((0, None), (2, 2), AUTO)


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
    changes: list[Change]
    last: str = ""


def run(shards: shardkit.ShardList, workload: Workload, config: Config, steps: int) -> Run:
    """One new loader's first ``steps`` steps, timed from its first ``next()`` (its workers' start inside)."""
    built = loader(shards, workload, config)
    batches = iter(built)
    changes, workers = [], built.num_workers
    sampler = MemorySampler(built)
    start = time.perf_counter()
    done = 0
    for done in range(1, steps + 1):
        entered = time.perf_counter()
        if next(batches, None) is None:
            done -= 1
            break
        waited = time.perf_counter() - entered
        time.sleep(workload.step_seconds)
        if built.num_workers != workers:  # decided after the last batch, made in this next(): its wait is the stall
            changes.append(Change(done, entered - start, workers, built.num_workers, waited))
            workers = built.num_workers
        sampler.steps = done
    rate = done / (time.perf_counter() - start)
    peak = sampler.stop()
    tuned = built.stats().autotune  # type: ignore[union-attr]
    del batches, built
    return Run(rate, peak, workers, changes, "" if tuned is None else tuned["last"])


@dataclass
class Change:
    """A change of auto's count, made in the ``next()`` of batch ``step`` that began ``at`` seconds into the
    run (decided after the batch before), whose wait, ``stall``, the loop spent idle: the old workers
    stopped, the new ones started and their first micro-batches made."""

    step: int
    at: float
    old: int
    new: int
    stall: float


class MemorySampler:
    """The peak proportional set size of the loader's processes, read every 10 steps by a thread: reading
    ``smaps_rollup`` makes the kernel walk each process's page tables (about 20 ms a torch process), which
    the timed loop must not wait for (the read releases the GIL)."""

    def __init__(self, built: shardkit.MixedLoader) -> None:
        self.built, self.steps, self.peak, self._done = built, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        seen = -10
        while not self._done.wait(0.01):
            if self.steps - seen >= 10:
                seen = self.steps
                self.peak = max(self.peak, _memory(self.built))

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


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


def order(configs: tuple[Config, ...], round_: int) -> tuple[Config, ...]:
    """Round ``round_``'s order: rotated by the round, reversed every other round."""
    turned = configs[round_ % len(configs) :] + configs[: round_ % len(configs)]
    return turned if round_ % 2 == 0 else tuple(reversed(turned))


def bench(shards: shardkit.ShardList, workload: Workload, args: argparse.Namespace) -> bool:
    configs = args.configs
    steps = min(workload.steps, args.steps or workload.steps)
    results: dict[Config, list[Run]] = {config: [] for config in configs}
    loads = [os.getloadavg()[0]]
    for round_ in range(args.rounds):
        for config in order(configs, round_):
            results[config].append(run(shards, workload, config, steps))
        loads.append(os.getloadavg()[0])
    rate = {c: statistics.median(r.steps_per_second for r in runs) for c, runs in results.items()}
    peak = {c: statistics.median(r.peak_bytes for r in runs) for c, runs in results.items()}
    best = max((c for c in configs if c != AUTO), key=rate.__getitem__)
    ratios = [a.steps_per_second / b.steps_per_second for a, b in zip(results[AUTO], results[best])]
    print(
        f"\n### {workload.name}: batch {workload.batch_size}, step {workload.step_seconds * 1e3:.0f} ms, {steps} steps\n"
    )
    print("| configuration | steps/s (median) | peak memory (MiB) |\n|---|---|---|")
    for config in configs:
        mark = " (best)" if config == best else ""
        print(f"| {label(config)}{mark} | {rate[config]:.1f} | {peak[config] / 2**20:.0f} |")
    median, worst = statistics.median(ratios), min(ratios)
    met = median >= TARGET and worst >= FLOOR
    print(
        f"\nauto / best ({label(best)}): throughput {median:.2f}x median of {len(ratios)} rounds "
        f"(target >= {TARGET}), worst round {worst:.2f}x (floor >= {FLOOR}): {'met' if met else 'NOT met'}; "
        f"memory {peak[AUTO] / peak[best]:.2f}x; load average {min(loads):.1f}-{max(loads):.1f} "
        f"over {os.cpu_count()} CPUs"
    )
    print("  rounds: " + ", ".join(f"{r:.2f}x" for r in ratios))
    print_auto(results[AUTO])
    return met


def print_auto(runs: list[Run]) -> None:
    """What auto chose in each round, and when its first change came and what it stalled the loop: figures
    that depend on the machine's load less than the ratios do."""
    for index, run_ in enumerate(runs):
        path = " ".join(_change(change) for change in run_.changes) or "no change"
        print(f"  auto round {index + 1}: {run_.workers} workers at the end; {path}; last: {run_.last}")
    first = [run_.changes[0] for run_ in runs if run_.changes]
    if first:
        made = statistics.median(change.at for change in first)
        stall = statistics.median(change.stall for change in first)
        print(f"  first change (median of rounds): made {made:.2f} s after the first next(), a stall of {stall:.2f} s")


def _change(change: Change) -> str:
    return f"{change.old}->{change.new} at step {change.step} ({change.at:.2f} s, stall {change.stall:.2f} s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run whose numbers are not meant to be quoted")
    parser.add_argument("--records", type=int, default=16_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0, help="timed steps per run (0: each workload's own)")
    parser.add_argument("--prefetch", type=int, nargs="+", default=[2], help="prefetch factors of the hand-picked runs")
    parser.add_argument("--workloads", nargs="*", default=[w.name for w in WORKLOADS])
    args = parser.parse_args()
    args.configs = configs(args.prefetch)
    if args.quick:  # every code path once: no workers, workers with a prefetch, auto (its opening and guess)
        args.records, args.rounds, args.steps = 2_000, 1, 20
        args.configs = QUICK_CONFIGS
    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)  # 3, 4 workers on 2 cores
    print(f"load average at the start: {os.getloadavg()[0]:.1f} (1 min) over {os.cpu_count()} CPUs")
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
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (1 min)")
    print(f"targets met on {sum(met)} of {len(met)} workloads")


if __name__ == "__main__":
    main()
