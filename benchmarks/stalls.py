"""What stall accounting costs: MixedLoader throughput with it and without it, on the quickstart path.

The quickstart's pipeline (``TFRecordDataset(shuffle=True).map(to_tensors).shuffle(256)``,
small tf.Examples, ``MixedLoader(batch_size=64, num_workers=2, persistent_workers=True)``)
read by two loaders built alike. The one without accounting has workers that run
the untimed micro-batch loop (``Untimed`` below, the loop as it was before
accounting) and is iterated through its epoch's mixer directly, past the
per-step clock. Epochs alternate between the two loaders; the median epoch of
each counts, and the cost is one minus the median of the rounds' ratios.

Through DataLoader workers on a shared machine that comparison moves by +-10 %,
so the worker's loop is also compared directly, in one process: the same
pipeline pulled 64 samples at a time through the worker clock (``take``, and the
per-message calls) and through plain ``islice``, alternating, 15 rounds; and the
per-step clock of the main process is timed alone.

It also times what a sampled micro-batch adds on the real pipeline (proxies set up, pulled
through and taken out; sampled and unsampled micro-batches alternate in one stream): a timing proxy per stage per sample
(:mod:`shardkit.loader.timing`), paid by ``SAMPLED`` samples of one micro-batch in
``SAMPLE_EVERY``. Besides samples per second, each case reports the CPU seconds a
sample costs (main process and workers, from ``/proc``), which a shared machine
disturbs far less than wall time.

    python benchmarks/stalls.py            # full run
    python benchmarks/stalls.py --quick    # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import itertools
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch

import shardkit
from shardkit.loader import timing
from shardkit.loader.micro_batches import START, STATE_EVERY, MicroBatches, PositionLog, StateSaver
from shardkit.loader.slabs import SlabRing
from shardkit.loader.stalls import StallMeter
from shardkit.loader.timing import SAMPLE_EVERY, SAMPLED, WorkerClock, _Timed


def to_tensors(example: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"x": torch.from_numpy(example["x"]), "label": torch.from_numpy(example["label"])}


class Untimed(MicroBatches):
    """The workers' loop without the accounting's clock (figures None), for comparison. It still
    sends the dataset's state when the main process asks, as the timed loop does (an ask count
    sent with the first message; the work since the last state against what it cost without one),
    with the two clock reads that needs, and its samples' positions (resumable), so that the two
    loops differ by the accounting alone."""

    def _messages(self, worker: int, states: Any) -> Iterator[Any]:
        if states is not None:
            self.dataset.load_state_dict(states[worker])  # type: ignore[attr-defined]
        samples = iter(self.dataset)
        saver = StateSaver(self.dataset, self.resumable)
        log = PositionLog.of(self.dataset, samples) if self.resumable else None
        if log is not None:
            samples = log.logged(samples)
        ring = SlabRing(self.slots) if self.collate and self.slots else None
        control = torch.zeros(1, dtype=torch.int64).share_memory_() if self.ask and self.resumable else None
        asks, answered = (None, 0) if control is None else (control.numpy(), 0)
        yield worker, START, None if ring is None else ring.flags, saver(), None, control
        since, busy, cost = 0, 0, 0
        every = STATE_EVERY if self.state_every is None else self.state_every
        while True:
            start = time.perf_counter_ns()
            chunk = list(islice(samples, self.size))
            if not chunk:
                break
            payload = (
                chunk if not self.collate else ring.collate(chunk) if ring else torch.utils.data.default_collate(chunk)
            )
            since, state, end = since + 1, None, time.perf_counter_ns()
            busy += end - start
            if asks is not None and asks[0] != answered:
                answered, state = int(asks[0]), saver()
                since, busy, cost = 0, 0, time.perf_counter_ns() - end
            elif since >= every or (asks is None and busy >= self.state_ratio * cost):
                state = saver()
                since, busy, cost = 0, 0, time.perf_counter_ns() - end
            yield worker, len(chunk), payload, state, None, None if log is None else log.take(len(chunk))
        yield worker, 0, None, saver(), None, None


def write(root: str, records: int) -> shardkit.ShardList:
    rng = np.random.default_rng(0)
    with shardkit.ShardWriter(f"{root}/train-%05d.tfrecord", max_records=records // 8) as writer:
        for i in range(records):
            writer.write(shardkit.encode_example({"x": rng.normal(size=4), "label": [i % 10]}))
    return shardkit.ShardList.from_manifest(writer.manifest)


def loader(shards: shardkit.ShardList, timed: bool, resumable: bool) -> shardkit.MixedLoader:
    pipeline = shardkit.TFRecordDataset(shards, shuffle=True, seed=0, balance="pad").map(to_tensors).shuffle(256)
    built = shardkit.MixedLoader(pipeline, batch_size=64, num_workers=2, persistent_workers=True, resumable=resumable)
    if not timed:
        assert built._micro_batches is not None
        built._micro_batches.__class__ = Untimed
    return built


def cpu_seconds(built: shardkit.MixedLoader) -> float:
    """CPU seconds the main process and the loader's persistent workers have used (Linux; else the
    main process's alone). On a shared machine the CPU a sample costs moves far less than wall time."""
    total = time.process_time()
    iterator = getattr(built._loader, "_iterator", None)
    for process in getattr(iterator, "_workers", None) or ():
        try:
            with open(f"/proc/{process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def epoch(built: shardkit.MixedLoader, timed: bool) -> tuple[float, float]:
    """Samples per second of one epoch, and CPU seconds per million samples (main process and
    workers); untimed, through the mixer, past the per-step clock."""
    start, cpu = time.perf_counter(), cpu_seconds(built)
    batches = iter(built) if timed else built._start_epoch()
    samples = sum(len(batch["label"]) for batch in batches)
    wall = time.perf_counter() - start
    return samples / wall, (cpu_seconds(built) - cpu) / samples * 1e6


def proxy_ns(items: int = 300_000) -> float:
    """Nanoseconds a timing proxy adds to one ``next``."""
    start = time.perf_counter()
    for _ in iter(range(items)):
        pass
    plain = time.perf_counter() - start
    start = time.perf_counter()
    for _ in _Timed(iter(range(items))):
        pass
    return (time.perf_counter() - start - plain) / items * 1e9


def in_process(shards: shardkit.ShardList, rounds: int) -> tuple[float, float, float]:
    """The worker's loop in one process, timed and plain, by CPU time (the process's own, which
    other processes on the machine disturb less than wall time): (plain samples/s of CPU, timed, cost)."""
    pipeline = shardkit.TFRecordDataset(shards, shuffle=True, seed=0, balance="pad").map(to_tensors).shuffle(256)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(rounds):
        for timed in (True, False) if round_ % 2 == 0 else (False, True):
            start, samples = time.process_time(), 0
            if timed:
                clock = WorkerClock(pipeline)
                it = iter(pipeline)
                while chunk := clock.take(it, 64):
                    clock.collated(len(chunk))
                    clock.figures()
                    samples += len(chunk)
            else:
                it = iter(pipeline)
                while chunk := list(islice(it, 64)):
                    samples += len(chunk)
            rates[timed].append(samples / (time.process_time() - start))
    return statistics.median(rates[False]), statistics.median(rates[True]), cost(rates[True], rates[False])


def micro_batch_ns(batches: int = 20_000) -> float:
    """Nanoseconds of CPU the worker clock adds to an unsampled micro-batch of 64 (take, collated,
    figures), over pulling it with ``islice``."""
    data = list(range(64 * batches))
    start = time.process_time()
    it = iter(data)
    while list(islice(it, 64)):
        pass
    plain = time.process_time() - start
    clock = WorkerClock(data)
    clock._counts[6] = 1  # past the first micro-batch, which is sampled
    every, timing.SAMPLE_EVERY = timing.SAMPLE_EVERY, 1 << 62  # never sampled: the unsampled path alone
    try:
        start = time.process_time()
        it = iter(data)
        while chunk := clock.take(it, 64):
            clock.collated(len(chunk))
            clock.figures()
        return (time.process_time() - start - plain) / batches * 1e9
    finally:
        timing.SAMPLE_EVERY = every


def sampled_ns(shards: shardkit.ShardList, epochs: int) -> float:
    """Nanoseconds of CPU a sampled micro-batch of 64 (proxies on each stage, set up and taken out) adds over an
    unsampled one, on the quickstart pipeline: micro-batches alternate between the two in one stream, and the
    medians of each kind are compared (each micro-batch timed alone, so other processes disturb it little)."""
    pipeline = shardkit.TFRecordDataset(shards, shuffle=True, seed=0, balance="pad").map(to_tensors).shuffle(256)
    times: dict[bool, list[int]] = {True: [], False: []}
    for _ in range(epochs):
        clock = WorkerClock(pipeline)
        it = iter(pipeline)
        clock.take(it, 64)  # the first of an iteration: sampled, and it fills the shuffle buffer
        for i in itertools.count():
            sampled = i % 2 == 0
            clock._counts[6] = 0 if sampled else 1  # the micro-batch count decides whether take samples
            start = time.process_time_ns()
            chunk = clock.take(it, 64)
            if len(chunk) < 64:
                break
            times[sampled].append(time.process_time_ns() - start)
    return statistics.median(times[True]) - statistics.median(times[False])


def message_ns(messages: int = 100_000) -> float:
    """Nanoseconds of CPU the figures add to a worker's message: pickled with it, unpickled in the main process,
    and the main process's two clock reads around receiving it (the figures of a 3-stage pipeline, as ints of
    nanoseconds)."""
    figures = tuple(range(10**10, 10**10 + len(timing.FIGURES) + 3))
    plain, timed = (0, 64, None, None, None), (0, 64, None, None, figures)
    cost = []
    for message in (plain, timed):
        start = time.process_time()
        for _ in range(messages):
            begun = timing.now()
            pickle.loads(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
            if message[4] is not None:
                timing.now() - begun
        cost.append(time.process_time() - start)
    return (cost[1] - cost[0]) / messages * 1e9


def step_ns(steps: int = 200_000) -> float:
    """Nanoseconds of CPU the main process's clock adds to one step (the loop itself subtracted)."""
    meter = StallMeter()
    start = time.process_time()
    for _ in range(steps):
        pass
    loop = time.process_time() - start
    start = time.process_time()
    for _ in range(steps):
        meter.left(meter.entered())
    return (time.process_time() - start - loop) / steps * 1e9


def compare(
    shards: shardkit.ShardList, rounds: int, resumable: bool
) -> tuple[dict[bool, list[float]], dict[bool, list[float]], Any]:
    """Each loader's samples per second and CPU seconds per million samples, epochs interleaved;
    and the timed loader's stats."""
    loaders = {timed: loader(shards, timed, resumable) for timed in (True, False)}
    for timed, built in loaders.items():  # warm-up: starts the persistent workers
        epoch(built, timed)
    rates: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(rounds):
        for timed in (True, False) if round_ % 2 == 0 else (False, True):
            rate, cpu_per_sample = epoch(loaders[timed], timed)
            rates[timed].append(rate)
            cpu[timed].append(cpu_per_sample)
    return rates, cpu, loaders[True].stats()


def cost(on: list[float], off: list[float], *, higher_is_better: bool = True) -> float:
    """One minus the median of the rounds' on/off ratios (of a cost: the ratios less one)."""
    if higher_is_better:
        return 1 - statistics.median(a / b for a, b in zip(on, off))
    return statistics.median(a / b for a, b in zip(on, off)) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run whose numbers are not meant to be quoted")
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    records, rounds = (2_000, 2) if args.quick else (args.records, args.rounds)
    print(f"quickstart path, {records:,} records, {rounds} interleaved rounds, 2 workers, batch 64")
    print(
        "| case | accounting off, samples/s | on, samples/s | cost | CPU s/M samples off | on | CPU cost "
        "| slowest stage |\n|---|---|---|---|---|---|---|---|"
    )
    with tempfile.TemporaryDirectory() as root:
        shards = write(root, records)
        for resumable in (True, False):
            rates, cpu, stats = compare(shards, rounds, resumable)
            slowest = stats.slowest_stage[0] if stats.slowest_stage else "-"
            print(
                f"| resumable={resumable} | {statistics.median(rates[False]):,.0f} | "
                f"{statistics.median(rates[True]):,.0f} | {cost(rates[True], rates[False]):+.2%} | "
                f"{statistics.median(cpu[False]):.1f} | {statistics.median(cpu[True]):.1f} | "
                f"{cost(cpu[True], cpu[False], higher_is_better=False):+.2%} | {slowest} |"
            )
        plain, timed, cpu_cost = in_process(shards, 3 if args.quick else 15)
        sampled = sampled_ns(shards, 2 if args.quick else 10)
    print(f"| worker loop in one process | {plain:,.0f} | {timed:,.0f} | - | - | - | {cpu_cost:+.2%} | - |")
    print(
        "cost: 1 - the median of the rounds' on/off ratios of samples/s (negative: within noise); CPU cost: "
        "the median ratio of CPU seconds per sample (main process and workers) less 1"
    )
    step, batch, message, proxy = step_ns(), micro_batch_ns(), message_ns(), proxy_ns()
    print(f"the main process's clock adds {step:.0f} ns per step (batch of 64)")
    print(
        f"the worker clock adds {batch:.0f} ns per micro-batch of 64, and its figures {message:.0f} ns to its message"
    )
    print(
        f"a sampled micro-batch adds {sampled:,.0f} ns (a timing proxy: {proxy:.0f} ns per sample per stage, "
        f"on {SAMPLED} samples; one micro-batch in {SAMPLE_EVERY} is sampled, and the first of each iteration)"
    )
    per_sample = step / 64 + (batch + message) / 64 + sampled / (64 * SAMPLE_EVERY)
    share = per_sample * plain / 1e9
    print(
        f"so accounting costs {per_sample:.0f} ns per sample: {share:.2%} of the quickstart path's "
        f"{1e9 / plain:,.0f} ns per sample in one process (the plain worker loop above); "
        f"target <= 1%: {'met' if share <= 0.01 else 'NOT met'}; load {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
