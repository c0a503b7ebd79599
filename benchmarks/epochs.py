"""Epoch-boundary stall: how long training waits for the first batch of epoch 2.

A map-style dataset sleeps a fixed time per sample (I/O-like latency that does
not fight other processes for the 2 shared cores), runs through a shuffle
buffer and is batched in DataLoader workers. Ways to reach epoch 2 (the first
two also without the shuffle buffer, to separate its refill from the workers'):

* fresh workers:       ``persistent_workers=False``, ``set_epoch(1)``, new iterator
* persistent workers:  ``persistent_workers=True``, ``set_epoch(1)``, new iterator
* shuffle().repeat():  one endless iterator; each pass refills the shuffle buffer
* repeat().shuffle():  one endless iterator; the buffer carries across passes

For each it prints the wait for epoch 2's first batch, the worst wait in the
first batches of epoch 2 (prefetched batches can hide a stall for a few
steps), the steady batch time, their ratios to it, and the wall time of epoch 2.

    python benchmarks/epochs.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from torch.utils.data import DataLoader

import shardkit
from shardkit.pipeline import Pipeline


class SleepyItems:
    """A map-style dataset of ``n`` ints that sleeps ``cost`` seconds per item."""

    def __init__(self, n: int, cost: float) -> None:
        self.n = n
        self.cost = cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        time.sleep(self.cost)
        return index


def sleepy_source(n: int, cost: float) -> Pipeline:
    """``SleepyItems`` as a shardkit source, split over the DataLoader workers."""
    return shardkit.wrap(SleepyItems(n, cost))


@dataclass
class Config:
    samples: int
    cost: float
    batch_size: int
    buffer_size: int
    workers: int


@dataclass
class Result:
    name: str
    first_wait: float
    worst_wait: float
    steady: float
    epoch: float


def _loader(pipeline: Pipeline, config: Config, persistent: bool) -> DataLoader:
    return DataLoader(
        pipeline,
        batch_size=None,
        num_workers=config.workers,
        persistent_workers=persistent,
        multiprocessing_context="fork",
    )


def _summarise(name: str, waits: list[float], window: int) -> Result:
    """``waits[k]`` is how long batch ``k`` of epoch 2 kept the consumer waiting.

    Workers deliver in lockstep (one slow wait, then a batch already queued),
    so the steady time is the mean wait away from both ends of the epoch,
    where buffers fill and drain.
    """
    return Result(
        name=name,
        first_wait=waits[0],
        worst_wait=max(waits[:window]),
        steady=statistics.fmean(waits[window:-window]),
        epoch=sum(waits),
    )


def _epoch_waits(loader: DataLoader) -> list[float]:
    waits = []
    start = time.perf_counter()
    for _ in loader:
        now = time.perf_counter()
        waits.append(now - start)
        start = now
    return waits


def by_set_epoch(config: Config, persistent: bool, window: int, shuffle: bool = True) -> Result:
    source = sleepy_source(config.samples, config.cost)
    pipeline = source.shuffle(config.buffer_size) if shuffle else source
    pipeline = pipeline.batch(config.batch_size)
    loader = _loader(pipeline, config, persistent)
    _epoch_waits(loader)
    pipeline.set_epoch(1)
    name = "persistent workers" if persistent else "fresh workers"
    return _summarise(name if shuffle else f"{name}, no shuffle", _epoch_waits(loader), window)


def by_repeat(config: Config, shuffle_first: bool, window: int) -> Result:
    source = sleepy_source(config.samples, config.cost)
    if shuffle_first:
        name, pipeline = "shuffle().repeat()", source.shuffle(config.buffer_size).repeat()
    else:
        name, pipeline = "repeat().shuffle()", source.repeat().shuffle(config.buffer_size)
    pipeline = pipeline.batch(config.batch_size)
    per_epoch = config.samples // config.batch_size
    waits: list[float] = []
    start = time.perf_counter()
    for _, _batch in zip(range(2 * per_epoch), _loader(pipeline, config, persistent=False)):
        now = time.perf_counter()
        waits.append(now - start)
        start = now
    return _summarise(name, waits[per_epoch:], window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run for CI")
    args = parser.parse_args()
    workers, batch_size = 2, 32
    if args.quick:
        config = Config(samples=2048, cost=200e-6, batch_size=batch_size, buffer_size=256, workers=workers)
    else:
        config = Config(samples=8192, cost=300e-6, batch_size=batch_size, buffer_size=1024, workers=workers)
    # Batches a worker's shuffle buffer must fill before its first batch, plus
    # the DataLoader's prefetch (2 per worker): a stall shows within this window.
    window = workers * (config.buffer_size // batch_size + 2)
    assert config.samples // batch_size > 3 * window, "epoch 2 needs a steady middle"

    results = [
        by_set_epoch(config, persistent=False, window=window, shuffle=False),
        by_set_epoch(config, persistent=True, window=window, shuffle=False),
        by_set_epoch(config, persistent=False, window=window),
        by_set_epoch(config, persistent=True, window=window),
        by_repeat(config, shuffle_first=True, window=window),
        by_repeat(config, shuffle_first=False, window=window),
    ]
    print(
        f"{config.samples} samples x {config.cost * 1e6:.0f} us, {workers} workers, "
        f"batch {batch_size}, shuffle buffer {config.buffer_size}; epoch 2 has "
        f"{config.samples // batch_size} batches, worst wait over its first {window}"
    )
    header = f"{'how epoch 2 starts':<30}{'first ms':>10}{'worst ms':>10}{'steady ms':>11}{'first/steady':>14}{'worst/steady':>14}{'epoch 2 s':>11}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.name:<30}{r.first_wait * 1e3:>10.1f}{r.worst_wait * 1e3:>10.1f}{r.steady * 1e3:>11.2f}"
            f"{r.first_wait / r.steady:>14.1f}{r.worst_wait / r.steady:>14.1f}{r.epoch:>11.2f}"
        )


if __name__ == "__main__":
    main()
